"""Where a sliding-window forward's time goes (or forward+backward's): FFA against tokamax and cuDNN on one
document of 8k or 32k tokens with windows of 256 to 4096 keys (and the varlen bench case), wall clock and GPU
busy time per call.

A q block of 128 rows walks about window / 128 + 1 key tiles: the windows change the steps per tile, the
document lengths the number of tiles. A least-squares fit of time = c + tiles x a + steps x b, per
implementation and for the wall clock and the GPU busy time, splits what a call costs whatever its size (c:
its preparation and launches), what a tile costs beyond its steps (a: start, epilogue, scheduling) and what a
step costs (b). Steps are counted on each implementation's walk (FFA: from the key span's first key,
cuda/tools/tile_waste.py; tokamax and cuDNN: aligned to 128, as tokamax's is).

    python bench/window_sweep.py [--docs 8192 32768] [--windows 256 512 1024 2048 4096] [--impls ffa tokamax cudnn]
    python bench/window_sweep.py --mode fwd+bwd --impls ffa cudnn     # the same fit for forward+backward

With --mode fwd+bwd (jax.grad of sum(out), forward included, as bench/kernel.py) the steps are still the
forward's: the backward's row steps per k block grow with the window alike on one document.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from bench import kernel as kb  # noqa: E402  (stubs xprof for tokamax before jax is imported)
from bench.common import doc_lengths, gpu_seconds_per_call, median_seconds  # noqa: E402
from magi_jax import masks  # noqa: E402

BLOCK = 128


def window_start(lens: list[int], window: int) -> np.ndarray:
    """Each token's first visible key: its document's start or window - 1 keys back."""
    start = np.repeat(np.cumsum([0] + lens[:-1]), lens)
    return np.maximum(start, np.arange(sum(lens)) - (window - 1))


def aligned_steps(k_start: np.ndarray) -> int:
    """Key tiles tokamax's causal walk visits: per q block, from its least k_start (aligned down) to the
    block's end."""
    lo = k_start.reshape(-1, BLOCK).min(axis=1) // BLOCK
    return int(np.sum(np.arange(1, len(lo) + 1) - lo))


def ffa_steps(mask) -> int:
    """Key tiles the FFA forward walks per head (the host model of cuda/tools/tile_waste.py)."""
    sys.path.insert(0, str(kb.ROOT / "cuda" / "tools"))
    import tile_waste
    return tile_waste.computed_cells(mask, tile_waste.BLOCK_M, False, False) // (BLOCK * BLOCK)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, nargs="*", default=[8192, 32768], help="single-document lengths")
    parser.add_argument("--windows", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--impls", nargs="*", default=["ffa", "tokamax", "cudnn"])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=["fwd", "fwd+bwd"], default="fwd")
    a = parser.parse_args()
    cases = [(f"doc{t // 1024}k_w{w}", [t], w) for t in a.docs for w in a.windows if w < t]
    cases.append(("varlen_w1024", doc_lengths(32768, seed=32768), 1024))  # bench/kernel.py's varlen_swa1024_32k
    rows = []
    for name, lens, w in cases:
        mask = masks.sliding_window(lens, w)
        ks = window_start(lens, w)
        case = kb.Case(name, mask, {})
        q, k, v = kb.case_inputs(case)
        fns = {"ffa": kb.ffa(mask), "tokamax": kb.tokamax(k_start=ks, is_causal=True),
               "cudnn": kb.cudnn_varlen(lens, window=w)}
        steps = {"ffa": ffa_steps(mask), "tokamax": aligned_steps(ks), "cudnn": aligned_steps(ks)}
        timed = {}
        ref = None
        for impl in a.impls:
            f = kb.jitted(fns[impl], a.mode)
            out = f(q, k, v) if a.mode == "fwd" else f(q, k, v)[0]  # the output, or dq
            ref = out if ref is None else ref
            timed[impl] = (f, kb.rel_diff(out, ref))
        wall = {impl: [] for impl in timed}
        for _ in range(a.rounds):
            for impl, (f, _) in timed.items():
                wall[impl].append(median_seconds(f, q, k, v, warmup=1, reps=5, calls=10))
        for impl, (f, diff) in timed.items():
            gpu = gpu_seconds_per_call(f, q, k, v)
            row = dict(case=name, impl=impl, window=w, tiles=-(-sum(lens) // BLOCK) * kb.H,
                       steps=int(steps[impl]) * kb.H, area=int(mask.area()), wall_ms=float(np.median(wall[impl])) * 1e3,
                       gpu_ms=None if gpu is None else gpu * 1e3, diff=float(diff))
            flops = 4.0 * row["area"] * kb.H * kb.D * (1.0 if a.mode == "fwd" else 3.5)
            row["tflops"] = flops / (row["wall_ms"] * 1e-3) / 1e12
            rows.append(row)
            print(json.dumps(row), flush=True)
    print("\n| case | impl | steps / tile | wall ms | GPU ms | TFLOP/s (wall) | diff |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['case']} | {r['impl']} | {r['steps'] / r['tiles']:.2f} | {r['wall_ms']:.3f} | "
              f"{r['gpu_ms'] or float('nan'):.3f} | {r['tflops']:.1f} | {r['diff']:.1e} |")
    sms = getattr(kb.jax.devices()[0], "core_count", None) or 1  # SMs on a GPU
    print(f"\nfit on the single-document cases, time = c + tiles x a + steps x b (a, b as an SM's time: x {sms}):")
    for key in ("wall_ms", "gpu_ms"):
        for impl in a.impls:
            sel = [r for r in rows if r["impl"] == impl and r["case"].startswith("doc") and r[key]]
            if len({r["tiles"] for r in sel}) < 2 or len(sel) < 4:
                continue  # c and a need two document lengths
            x = np.array([[1.0, r["tiles"], r["steps"]] for r in sel])
            (c, ta, sb), *_ = np.linalg.lstsq(x, np.array([r[key] * 1e3 for r in sel]), rcond=None)
            print(f"  {key[:-3]:4s} {impl:8s} c {c:.1f} us per call, a {ta * sms:.2f} us per tile, "
                  f"b {sb * sms:.3f} us per step")
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], "window_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
