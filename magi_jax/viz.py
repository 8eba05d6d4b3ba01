"""Pictures of masks (matplotlib, imported only when a plot is asked for)."""

from __future__ import annotations

import numpy as np

from magi_jax.mask import AttnMask

_MAX_PIXELS = 1024  # larger masks are drawn by coverage fraction per pixel block
_FIG_INCHES = 6.0   # the longer side of the figure (720 pixels at the 120 dpi written)
_MAX_ASPECT = 2.0   # the shorter side is at least _FIG_INCHES / _MAX_ASPECT, room for the labels


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
    """Write a PNG of ``mask`` with its slices outlined; a mask with no tokens gives an empty frame."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    tq, tk = mask.total_seqlen_q, mask.total_seqlen_k
    # The frame keeps the mask's shape up to _MAX_ASPECT; beyond it the cells are stretched, so a
    # 5000 x 3 mask neither writes a huge PNG nor collapses to a zero-pixel one.
    aspect = min(max(max(tq, 1) / max(tk, 1), 1 / _MAX_ASPECT), _MAX_ASPECT)   # height / width
    fig, ax = plt.subplots(figsize=(_FIG_INCHES, _FIG_INCHES * aspect) if aspect <= 1
                           else (_FIG_INCHES / aspect, _FIG_INCHES))
    ax.set_box_aspect(aspect)
    image = mask_image(mask)
    if image.size:
        ax.imshow(image, cmap="Blues", interpolation="nearest", vmin=0, vmax=max(1.0, float(image.max())),
                  extent=(0, tk, tq, 0), aspect="auto")
    else:
        ax.set(xticks=[], yticks=[])   # no tokens: an empty frame, not a 0..1 axis
    for (qs, qe), (ks, ke) in zip(mask.q_ranges, mask.k_ranges):
        ax.add_patch(Rectangle((ks, qs), ke - ks, qe - qs, fill=False, edgecolor="tab:red", linewidth=0.6))
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(title or f"{mask.num_slices} slices, area {mask.area():,}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
