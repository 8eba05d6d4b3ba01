"""The coefficients of Exp2Fma (cuda/softmax.h): 2^f on [-0.5, 0.5] as 1 + f (c1 + f (c2 + f c3)), fitted
for relative error (weighted least squares on Chebyshev nodes, then a few minimax-style reweightings), and
a float32 emulation of the device function's exact operation order over every float32 in [-130, 0] step
1/4096 plus the edge cases (-inf, clamp boundary, 0, tiny positive): max relative error, masked cells 0.

    python cuda/tools/exp2_poly.py
"""

from __future__ import annotations

import numpy as np

MAGIC = np.float32(12582912.0)   # 1.5 * 2^23: x + MAGIC rounds x to an integer held in the low mantissa bits


def fit(degree: int = 3, rounds: int = 30) -> np.ndarray:
    f = np.cos(np.linspace(0, np.pi, 4001)) * 0.5
    f = f[np.abs(f) > 1e-9]
    target = (np.exp2(f) - 1) / f                    # c1 + c2 f + c3 f^2 ~ (2^f - 1) / f, c0 = 1 exactly
    weight = f / np.exp2(f)                          # relative error of 2^f
    w = np.ones_like(f)
    for _ in range(rounds):                          # Lawson: push weight to where the error peaks
        a = np.stack([f ** k for k in range(degree)], 1) * (weight * w)[:, None]
        c = np.linalg.lstsq(a, target * weight * w, rcond=None)[0]
        err = np.abs((np.polyval(c[::-1], f) - target) * weight)
        w = w * (err / err.max()) ** 0.5 + 1e-12
    return c.astype(np.float32)


def fma(a, b, c):
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(np.float32)


def exp2_fma(x: np.ndarray, c: np.ndarray) -> np.ndarray:
    """The device code, op by op, in float32."""
    x = np.maximum(x.astype(np.float32), np.float32(-127.0))
    t = (x + MAGIC).astype(np.float32)
    j = (t - MAGIC).astype(np.float32)
    f = (x - j).astype(np.float32)
    p = fma(f, c[2], c[1])
    p = fma(f, p, c[0])
    p = fma(f, p, np.float32(1.0))
    bits = (p.view(np.uint32) + (t.view(np.uint32) << np.uint32(23))).astype(np.uint32)
    return bits.view(np.float32)


def main() -> None:
    c = fit()
    print("c1, c2, c3 =", ", ".join(f"{v:.9e}f" for v in c))
    x = np.arange(-130 * 4096, 1, dtype=np.int64).astype(np.float32) / np.float32(4096)
    got = exp2_fma(x, c).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    normal = x >= -125
    rel = np.abs(got[normal] - want[normal]) / want[normal]
    print(f"max relative error on [-125, 0]: {rel.max():.3e}  (bf16 rounding of P: 3.9e-3, fp16: 4.9e-4)")
    tiny = ~normal
    print(f"max absolute error below -125: {np.abs(got[tiny] - want[tiny]).max():.3e}, all >= 0: "
          f"{bool((got >= 0).all())}, finite: {bool(np.isfinite(got).all())}")
    edge = np.array([-np.inf, -1e30, -127.0, -126.75, -126.5, -126.25, -126.0, -0.5, 0.0, 1e-7, 3e-7],
                    np.float32)
    for xe, ge in zip(edge, exp2_fma(edge, c)):
        print(f"  2^{xe:<10g} -> {ge:.9g}  (exact {np.exp2(np.float64(xe)):.9g})")
    assert exp2_fma(np.array([-np.inf], np.float32), c)[0] == 0.0, "masked cells must give exactly 0"
    assert rel.max() < 2e-4 and (got >= 0).all()


if __name__ == "__main__":
    main()
