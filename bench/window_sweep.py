"""Where a sliding-window forward's and forward+backward's time goes: FFA against tokamax and cuDNN on one
document of 8k or 32k tokens with windows of 256 to 4096 keys (and the varlen bench case), timed as
bench/kernel.py times its cases (run_case: rounds in turn, wall clock and GPU busy time per call).

A q block of 128 rows walks about window / 128 + 1 key tiles: the windows change the steps per tile, the
document lengths the number of tiles. A least-squares fit of time = c + tiles x a + steps x b, per
implementation and pass and for the wall clock and the GPU busy time, splits what a call costs whatever its
size (c: its preparation and launches), what a tile costs beyond its steps (a: start, epilogue, scheduling) and
what a step costs (b). Steps are counted on each implementation's forward walk (FFA: from the key span's first
key, cuda/tools/tile_waste.py; tokamax and cuDNN: aligned to 128, as tokamax's is); the backward's row steps
per k block grow with the window alike on one document.

--bands also times FFA on bands: per q block of 128 rows one FULL slice of the window / 128 + 1 key tiles that
end with the block, the same tiles and steps as the window's walk with no cell masked. Band against window
at equal walks is what the masks cost (a window's first and last key tile per q block); the bands' own fit
is the per-tile cost without them.

    python bench/window_sweep.py [--docs 8192 32768] [--windows 256 512 1024 2048 4096] [--impls ffa tokamax cudnn]
    python bench/window_sweep.py --impls ffa --bands
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
from bench.common import doc_lengths  # noqa: E402
from magi_jax import masks  # noqa: E402
from magi_jax.mask import AttnMask, AttnMaskType  # noqa: E402

sys.path.insert(0, str(kb.ROOT / "cuda" / "tools"))
import tile_waste  # noqa: E402  (the forward's walk, host model)

BLOCK = 128


def aligned_steps(k_start: np.ndarray) -> int:
    """Key tiles tokamax's causal walk visits: per q block, from its least k_start (aligned down) to the
    block's end."""
    lo = k_start.reshape(-1, BLOCK).min(axis=1) // BLOCK
    return int(np.sum(np.arange(1, len(lo) + 1) - lo))


def ffa_steps(mask) -> int:
    """Key tiles the FFA forward walks per head (the host model of cuda/tools/tile_waste.py)."""
    return tile_waste.walk_cells(mask) // (BLOCK * BLOCK)


def band_mask(length: int, window: int) -> AttnMask:
    """One document of `length` (a multiple of 128): q block b sees keys [128 b - window, 128 b + 128), FULL."""
    slices = [(qs, qs + BLOCK, max(0, qs - window), qs + BLOCK, AttnMaskType.FULL) for qs in range(0, length, BLOCK)]
    arr = np.array(slices, np.int64)
    return AttnMask(arr[:, 0:2], arr[:, 2:4], arr[:, 4], length, length)


def fit(rows: list[dict], key: str) -> tuple[float, float, float] | None:
    """(c, a, b) of time = c + tiles x a + steps x b in microseconds over rows' `key` (ms); None without two
    document lengths."""
    rows = [r for r in rows if r.get(key)]
    if len({r["tiles"] for r in rows}) < 2 or len(rows) < 4:
        return None
    x = np.array([[1.0, r["tiles"], r["steps"]] for r in rows])
    c, a, b = np.linalg.lstsq(x, np.array([r[key] * 1e3 for r in rows]), rcond=None)[0]
    return float(c), float(a), float(b)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, nargs="*", default=[8192, 32768], help="single-document lengths")
    parser.add_argument("--windows", type=int, nargs="*", default=[256, 512, 1024, 2048, 4096])
    parser.add_argument("--impls", nargs="*", default=["ffa", "tokamax", "cudnn"])
    parser.add_argument("--rounds", type=kb.positive_int, default=3)
    parser.add_argument("--bands", action="store_true", help="also FFA on unmasked bands of the same walks")
    a = parser.parse_args()
    cases = [(f"doc{t // 1024}k_w{w}", [t], w) for t in a.docs for w in a.windows if w < t]
    cases.append(("varlen_w1024", doc_lengths(32768, seed=32768), 1024))  # bench/kernel.py's varlen_swa1024_32k
    rows = []
    for name, lens, w in cases:
        mask = masks.sliding_window(lens, w)
        ks = kb.window_start(lens, w)
        case = kb.Case(name, mask, {"tokamax": lambda ks=ks: kb.tokamax(k_start=ks, is_causal=True),
                                    "cudnn": lambda lens=lens, w=w: kb.cudnn_varlen(lens, window=w)})
        steps = {"ffa": ffa_steps(mask), "tokamax": aligned_steps(ks), "cudnn": aligned_steps(ks)}
        results: list[dict] = []
        kb.run_case(case, a.impls, results, rounds=a.rounds, gpu_time=True)
        for r in results:
            r.update(window=w, tiles=-(-sum(lens) // BLOCK) * kb.H, steps=steps.get(r["impl"], steps["ffa"]) * kb.H)
        rows += results
    for t in a.docs if a.bands else []:
        for w in (w for w in a.windows if w < t):
            mask = band_mask(t, w)
            results = []
            kb.run_case(kb.Case(f"band{t // 1024}k_w{w}", mask, {}), ["ffa"], results, rounds=a.rounds, gpu_time=True)
            for r in results:
                r.update(window=w, tiles=-(-t // BLOCK) * kb.H, steps=ffa_steps(mask) * kb.H)
            rows += results
    timed = [r for r in rows if "ms" in r]
    print("\n| case | impl | pass | steps / tile | wall ms | GPU ms | TFLOP/s (wall) | diff vs ffa |")
    print("|---|---|---|---|---|---|---|---|")
    for r in timed:
        print(f"| {r['case']} | {r['impl']} | {r['mode']} | {r['steps'] / r['tiles']:.2f} | {r['ms']:.3f} | "
              f"{r.get('gpu_ms') or float('nan'):.3f} | {r['tflops']:.1f} | {r['rel_diff_vs_ffa']:.1e} |")
    sms = getattr(kb.jax.devices()[0], "core_count", None) or 1  # SMs on a GPU
    print(f"\nfit on the single-document cases, time = c + tiles x a + steps x b (a, b as an SM's time: x {sms}):")
    for mode in ("fwd", "fwd+bwd"):
        for impl in a.impls:
            for prefix in ("doc", "band"):
                sel = [r for r in timed if r["impl"] == impl and r["mode"] == mode and r["case"].startswith(prefix)]
                for key, label in (("ms", "wall"), ("gpu_ms", "GPU")):
                    got = fit(sel, key)
                    if got is not None:
                        c, ta, sb = got
                        print(f"  {mode:7s} {label:4s} {impl + (' band' if prefix == 'band' else ''):13s} c {c:.1f} us "
                              f"per call, a {ta * sms:.2f} us per tile, b {sb * sms:.3f} us per step")
    if os.environ.get("OUT"):
        pathlib.Path(os.environ["OUT"], "window_sweep.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
