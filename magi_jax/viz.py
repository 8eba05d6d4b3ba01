"""Pictures of masks (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import numpy as np

from magi_jax.mask import AttnMask

_MAX_PIXELS = 1024  # larger masks are drawn by coverage fraction per pixel block


def mask_image(mask: AttnMask, pixels: int = _MAX_PIXELS) -> np.ndarray:
    """Fraction of attended cells in each pixel block, from the slices (no dense matrix for large masks)."""
    tq, tk = mask.total_seqlen_q, mask.total_seqlen_k
    if tq * tk <= pixels * pixels:
        return mask.to_dense().astype(np.float32)
    sq, sk = max(1, -(-tq // pixels)), max(1, -(-tk // pixels))
    rows = np.arange(0, tq, sq)
    image = np.zeros((len(rows), -(-tk // sk)), np.float32)
    # Sample one query row per pixel row: each slice gives an interval of keys for that row.
    for (qs, qe), (ks, ke), t in zip(mask.q_ranges, mask.k_ranges, mask.types):
        inside = rows[(rows >= qs) & (rows < qe)]
        lo = ks + (inside - qs) if t in (2, 3) else np.full_like(inside, ks)
        hi = ke - (qe - inside - 1) if t in (1, 3) else np.full_like(inside, ke)
        for r, a, b in zip(inside // sq, np.maximum(lo, ks), np.minimum(hi, ke)):
            if a < b:
                image[r, a // sk:(b - 1) // sk + 1] += 1.0
    return image


def plot_mask(mask: AttnMask, path: str, title: str | None = None) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    image = mask_image(mask)
    sy, sx = mask.total_seqlen_q / image.shape[0], mask.total_seqlen_k / image.shape[1]
    fig, ax = plt.subplots(figsize=(6, 6 * mask.total_seqlen_q / max(1, mask.total_seqlen_k)))
    ax.imshow(image, cmap="Blues", interpolation="nearest", vmin=0, vmax=max(1.0, float(image.max())),
              extent=(0, mask.total_seqlen_k, mask.total_seqlen_q, 0))
    for (qs, qe), (ks, ke) in zip(mask.q_ranges, mask.k_ranges):
        ax.add_patch(Rectangle((ks, qs), ke - ks, qe - qs, fill=False, edgecolor="tab:red", linewidth=0.6))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title or f"{mask.num_slices} slices, area {mask.area():,}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
