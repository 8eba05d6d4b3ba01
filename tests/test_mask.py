"""The mask model: validation, closed-form area, dense form."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from magi_jax.mask import AttnMask, AttnMaskType


def dense_by_rows(q_ranges, k_ranges, types, tq, tk):
    """Cell-by-cell definition of DESIGN.md section 1, written independently of AttnMask.to_dense."""
    out = np.zeros((tq, tk), np.int64)
    for (qs, qe), (ks, ke), t in zip(q_ranges, k_ranges, types):
        for q in range(qs, qe):
            lo = ks + (q - qs) if t in (2, 3) else ks
            hi = ke - (qe - q - 1) if t in (1, 3) else ke
            for k in range(max(lo, ks), min(hi, ke)):
                out[q, k] += 1
    return out


@st.composite
def random_masks(draw, max_len=24, max_slices=6):
    tq, tk = draw(st.integers(0, max_len)), draw(st.integers(0, max_len))
    n = draw(st.integers(0, max_slices))
    def rng_range(total):
        a, b = draw(st.integers(0, total)), draw(st.integers(0, total))
        return sorted((a, b))
    q = [rng_range(tq) for _ in range(n)]
    k = [rng_range(tk) for _ in range(n)]
    t = [draw(st.integers(0, 3)) for _ in range(n)]
    return q, k, t, tq, tk


@settings(max_examples=300, derandomize=True, deadline=None)
@given(random_masks())
def test_dense_and_area_match_the_definition(args):
    q, k, t, tq, tk = args
    mask = AttnMask(q, k, t, tq, tk)
    expected = dense_by_rows(q, k, t, tq, tk)
    np.testing.assert_array_equal(mask.to_dense(), expected)
    assert mask.area() == expected.sum()


def test_types_accept_names_and_enum():
    a = AttnMask([[0, 4]], [[0, 4]], ["causal"], 4)
    b = AttnMask([[0, 4]], [[0, 4]], [AttnMaskType.CAUSAL], 4)
    assert a == b and hash(a) == hash(b) and a.area() == 10


@pytest.mark.parametrize("kwargs, match", [
    (dict(q_ranges=[[3, 1]], k_ranges=[[0, 2]], types=[0]), r"q_ranges\[0\].*reversed"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[2, 1]], types=[0]), r"k_ranges\[0\].*reversed"),
    (dict(q_ranges=[[0, 9]], k_ranges=[[0, 2]], types=[0]), r"q_ranges\[0\].*out of bounds"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[-1, 2]], types=[0]), r"k_ranges\[0\].*out of bounds"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=[7]), r"types.*unknown"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=["diagonal"]), r"types.*unknown"),
    (dict(q_ranges=[[0, 2], [0, 1]], k_ranges=[[0, 2]], types=[0]), r"same length"),
    (dict(q_ranges=[[0, 1, 2]], k_ranges=[[0, 2]], types=[0]), r"q_ranges.*shape"),
    (dict(q_ranges=[[0.0, 1.0]], k_ranges=[[0, 2]], types=[0]), r"q_ranges.*integers"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=None), r"^types: expected a 1-D sequence"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=[1.5]), r"^types: expected mask type names or integer"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=[True]), r"^types: expected mask type names or integer"),
    (dict(q_ranges=[[0, 2]], k_ranges=[[0, 2]], types=[[1]]), r"^types: expected a 1-D sequence"),
])
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        AttnMask(total_seqlen_q=8, total_seqlen_k=8, **kwargs)


def test_bad_total_length():
    with pytest.raises(ValueError, match="total_seqlen_k"):
        AttnMask([[0, 1]], [[0, 1]], [0], 4, -1)


def test_plot_writes_png(tmp_path):
    from magi_jax import masks
    path = tmp_path / "mask.png"
    masks.shared_question([(6, [3, 4])]).plot(str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
