"""Command line: python -m magi_jax {demo, bench, plan, simulate} [options]."""

from __future__ import annotations

import pathlib
import sys

USAGE = """usage: python -m magi_jax COMMAND [options]

commands:
  demo       forward and backward on two masks, errors against float64, timing, mask plot
  bench      kernel benchmark (--backend cpu | gpu); needs the source checkout (bench/)
  plan       distributed plan of one mask: per-rank table (see --help)
  simulate   planner at scale, cp 8..1024 (see --help)
"""


def _bench(argv: list[str]) -> int:
    root = pathlib.Path(__file__).resolve().parents[1]
    if not (root / "bench").is_dir():
        print("bench: the benchmarks live in the source checkout (bench/); run from an editable install",
              file=sys.stderr)
        return 2
    sys.path.insert(0, str(root))
    backend = "cpu"
    if "--backend" in argv:
        i = argv.index("--backend")
        backend, argv = argv[i + 1] if i + 1 < len(argv) else "", argv[:i] + argv[i + 2:]
    if backend == "cpu":
        from bench import cpu
        return cpu.main(argv)
    if backend == "gpu":
        from bench import kernel
        sys.argv = [str(root / "bench" / "kernel.py"), *argv]
        return kernel.main() or 0
    print(f"bench: --backend must be cpu or gpu, got {backend!r}", file=sys.stderr)
    return 2


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "demo":
        from magi_jax.demo import main as demo
        return demo(rest)
    if command == "bench":
        return _bench(rest)
    if command in ("plan", "simulate"):
        from magi_jax.planner import cli
        return (cli.plan_main if command == "plan" else cli.simulate_main)(rest)
    print(f"unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
