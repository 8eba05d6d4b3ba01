"""AttnMask.plot on degenerate shapes: bounded PNG sizes, quickly."""

from __future__ import annotations

import pytest

from magi_jax import masks


def _png_size(path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(header[16:20], "big"), int.from_bytes(header[20:24], "big")


@pytest.mark.parametrize("seqlen_q, seqlen_k, landscape", [(5000, 3, False), (3, 5000, True),
                                                           (0, 0, None), (64, 64, None)])
def test_plot_size_is_bounded(tmp_path, seqlen_q, seqlen_k, landscape):
    path = tmp_path / "mask.png"
    masks.full(seqlen_q, seqlen_k).plot(str(path))
    width, height = _png_size(path)
    assert 300 <= width <= 800 and 300 <= height <= 800
    if landscape is not None:      # the longer side of the mask stays the longer side of the picture
        assert (width > height) == landscape
