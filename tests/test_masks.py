"""Each mask constructor against a dense definition written here, cell by cell."""

import numpy as np
import pytest

from magi_jax import masks


def docs_of(lengths):
    starts = np.cumsum([0] + list(lengths[:-1]))
    return [(int(s), int(s + n)) for s, n in zip(starts, lengths)]


def dense(total, rule):
    """rule(q, k) -> bool for every cell."""
    return np.array([[int(rule(q, k)) for k in range(total)] for q in range(total)])


def same_doc(lengths):
    d = {}
    for i, (s, e) in enumerate(docs_of(lengths)):
        for t in range(s, e):
            d[t] = (i, s, e)
    return d


LENGTHS = [7, 1, 12, 5]


def check(mask, expected):
    got = mask.to_dense()
    np.testing.assert_array_equal(got, expected)
    assert got.max() <= 1, "constructors never cover a cell twice"
    assert mask.area() == expected.sum()


def test_full_and_causal_bottom_right():
    check(masks.full(5, 7), np.ones((5, 7)))
    check(masks.causal(6), dense(6, lambda q, k: k <= q))
    expected = np.array([[int(k <= q + 3) for k in range(7)] for q in range(4)])  # Tk - Tq = 3
    check(masks.causal(4, 7), expected)


def test_varlen():
    doc = same_doc(LENGTHS)
    total = sum(LENGTHS)
    check(masks.varlen_full(LENGTHS), dense(total, lambda q, k: doc[q][0] == doc[k][0]))
    check(masks.varlen_causal(LENGTHS), dense(total, lambda q, k: doc[q][0] == doc[k][0] and k <= q))


@pytest.mark.parametrize("window", [1, 3, 5, 20])
def test_sliding_window(window):
    doc = same_doc(LENGTHS)
    total = sum(LENGTHS)
    check(masks.sliding_window(LENGTHS, window),
          dense(total, lambda q, k: doc[q][0] == doc[k][0] and q - window < k <= q))
    check(masks.sliding_window(LENGTHS, window, causal=False),
          dense(total, lambda q, k: doc[q][0] == doc[k][0] and abs(q - k) < window))


@pytest.mark.parametrize("block", [1, 4, 5, 50])
def test_block_causal(block):
    doc = same_doc(LENGTHS)
    total = sum(LENGTHS)
    rule = lambda q, k: doc[q][0] == doc[k][0] and (k - doc[k][1]) // block <= (q - doc[q][1]) // block
    check(masks.block_causal(LENGTHS, block), dense(total, rule))


def test_shared_question():
    samples = [(4, [3, 2, 5]), (3, [1])]
    owner = {}  # token -> (sample, part, start) with part -1 for the question
    start = 0
    for i, (question, answers) in enumerate(samples):
        for t in range(start, start + question):
            owner[t] = (i, -1, start)
        start += question
        for j, n in enumerate(answers):
            for t in range(start, start + n):
                owner[t] = (i, j, start)
            start += n

    def rule(q, k):
        (sq, pq, _), (sk, pk, _) = owner[q], owner[k]
        if sq != sk:
            return False
        if pk == -1:
            return pq != -1 or k <= q  # answers see the whole question; the question is causal
        return pq == pk and k <= q

    check(masks.shared_question(samples), dense(start, rule))


def test_prefix_lm():
    prefixes = [3, 1, 0, 5]
    doc = same_doc(LENGTHS)
    total = sum(LENGTHS)

    def rule(q, k):
        i, s, _ = doc[q]
        if doc[k][0] != i:
            return False
        p = prefixes[i]
        return (q - s < p and k - s < p) or k <= q

    check(masks.prefix_lm(LENGTHS, prefixes), dense(total, rule))


@pytest.mark.parametrize("window, num_global", [(2, 1), (3, 0), (4, 3), (30, 2)])
def test_global_sliding_window(window, num_global):
    doc = same_doc(LENGTHS)
    total = sum(LENGTHS)

    def rule(q, k):
        i, s, _ = doc[q]
        return doc[k][0] == i and k <= q and (q - window < k or k - s < num_global)

    check(masks.global_sliding_window(LENGTHS, window, num_global), dense(total, rule))


def test_causal_blockwise():
    doc = same_doc(LENGTHS)
    total = sum(LENGTHS)
    last = len(LENGTHS) - 1
    rule = lambda q, k: k <= q and (doc[q][0] == doc[k][0] or doc[q][0] == last)
    check(masks.causal_blockwise(LENGTHS), dense(total, rule))


@pytest.mark.parametrize("call, match", [
    (lambda: masks.varlen_causal([3, 0]), r"lengths\[1\]"),
    (lambda: masks.varlen_causal([]), "lengths"),
    (lambda: masks.varlen_causal(5), "^lengths: expected a sequence"),
    (lambda: masks.sliding_window([4], 0), "window"),
    (lambda: masks.block_causal([4], -2), "block"),
    (lambda: masks.prefix_lm([4, 2], [1]), "prefix_lengths"),
    (lambda: masks.prefix_lm([4], [5]), r"prefix_lengths\[0\]"),
    (lambda: masks.global_sliding_window([4], 2, -1), "num_global"),
    (lambda: masks.shared_question([(3, [])]), "answers"),
])
def test_bad_input_names_the_argument(call, match):
    with pytest.raises(ValueError, match=match):
        call()
