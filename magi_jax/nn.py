"""A drop-in for `jax.nn.dot_product_attention` on FFA, with packed documents by segment ids.

Same arguments, layout ([B, T, N, H] or [T, N, H]) and mask semantics as jax.nn's: `is_causal` is top-left
aligned (query i sees keys j <= i), `local_window_size=(left, right)` keeps keys i - left <= j <= i + right,
`query_seq_lengths` / `key_value_seq_lengths` cut each batch element's queries and keys. `segment_ids` [B, T]
(self-attention) adds packed documents: a token attends only within its run of equal consecutive ids.

The mask becomes FFA slices, three per document (the rows where the window's lower bound or the document's
first key binds, and where its upper bound or the last key binds, give CAUSAL, BI_CAUSAL or FULL, and
INV_CAUSAL pieces): on the host for concrete segment ids and lengths (empty slices dropped), on the device for
traced ones, so that a jitted step takes new packings without recompiling. Traced, the slice count is static:
`max_segments` documents per sequence (required when segment_ids are traced; if a sequence has more, the
whole output is NaN, so that a training loss shows it).

    >>> out = magi_jax.dot_product_attention(q, k, v, is_causal=True, segment_ids=seg, max_segments=64)

Differences from jax.nn: `bias` and a dense `mask` are not taken (express the mask as slices with
flex_flash_attn); a query row that attends no key gives 0 and lse -inf (jax.nn's xla path averages the
values there). Under jit on arrays sharded over the batch (data parallel) or the heads (tensor parallel), each
device runs its own (magi_jax.partition); for the sequence axis use magi_jax.calc_attn.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from magi_jax import ffa
from magi_jax.mask import AttnMaskType
from magi_jax.partition import split_spec


def dot_product_attention(query, key, value, bias=None, mask=None, *, scale: float | None = None,
                          is_causal: bool = False, query_seq_lengths=None, key_value_seq_lengths=None,
                          local_window_size: int | tuple[int, int] | None = None, implementation: str | None = None,
                          return_residual: bool = False, segment_ids=None, max_segments: int | None = None,
                          softcap: float = 0.0, deterministic: bool = False):
    """jax.nn.dot_product_attention's contract on FFA (see the module docstring), plus `segment_ids` [B, T]
    with `max_segments`, `softcap` and `deterministic` (as flex_flash_attn). Returns the output shaped as
    query, and with return_residual=True also the lse [B, T, N] (or [T, N]), float32 (jax.nn casts it to key's
    dtype) and differentiable."""
    if bias is not None:
        raise ValueError("bias: not supported; express the mask as slices with magi_jax.flex_flash_attn")
    if mask is not None:
        raise ValueError("mask: a dense mask is not supported; use is_causal, local_window_size, the seq "
                         "lengths and segment_ids, or slices with magi_jax.flex_flash_attn")
    if implementation is not None:
        raise ValueError(f"implementation: magi_jax runs FFA only; got {implementation!r}")
    _check_qkv(query, key, value)
    # Checked here so that errors name `scale`, not flex_flash_attn's softmax_scale.
    scale = None if scale is None else ffa.concrete_float("scale", scale)
    unbatched = np.ndim(query) == 3
    q, k, v = (jnp.reshape(x, (1, *np.shape(x))) if unbatched else x for x in (query, key, value))   # as ffa._one
    B, T, S = q.shape[0], q.shape[1], k.shape[1]
    build = lambda q_len, kv_len, ids: mask_slices(B, T, S, is_causal, local_window_size, q_len, kv_len, ids,
                                                   max_segments, unbatched)
    mask_args = (query_seq_lengths, key_value_seq_lengths, segment_ids)
    batch = _explicit_batch(mask_args, unbatched)
    if batch is None:
        q_ranges, k_ranges, types, overflow = build(*mask_args)
    else:
        # Explicit sharding types have no rule for some of the building's ops (a sharded array concatenated
        # with a replicated one): built over Auto axes, where XLA splits it by sequence as the arguments are.
        q_ranges, k_ranges, types, overflow = jax.sharding.auto_axes(
            build, out_sharding=(P(batch[0]), P(batch[0]), P(batch[0]), P()))(*mask_args)
    # flex_flash_attn's batched form: one packed call, on each device's own sequences and heads when sharded.
    out, lse = ffa.flex_flash_attn(q, k, v, q_ranges, k_ranges, types, softmax_scale=scale, softcap=softcap,
                                   deterministic=deterministic)
    if overflow is not None:
        # NaN everywhere when a sequence overflows, added as a constant outside the gradient: one elementwise
        # pass in the forward (fused into a consumer where XLA can), nothing in the backward. Cheaper on paper,
        # a NaN row updated in place measured slower (BENCHMARKS.md 2026-12-01 01:03 UTC).
        poison = jax.lax.stop_gradient(jnp.where(overflow, jnp.nan, 0.0))
        out, lse = out + poison.astype(out.dtype), lse + poison
    if unbatched:
        out, lse = out.reshape(out.shape[1:]), lse.reshape(lse.shape[1:])
    return (out, lse) if return_residual else out


def mask_slices(B: int, T: int, S: int, is_causal: bool = False, local_window_size=None, query_seq_lengths=None,
                key_value_seq_lengths=None, segment_ids=None, max_segments: int | None = None,
                unbatched: bool = False):
    """The FFA slices of dot_product_attention's mask, each sequence's over its own T queries and S keys
    (q_ranges [B, N, 2], k_ranges [B, N, 2], types [B, N]), and for traced segment ids whether any sequence
    overflows max_segments (a bool scalar; else None). Concrete ids and lengths give numpy slices, a
    sequence's empty ones left out (N is the most any sequence has; the others' rest are empty slices);
    traced ones give jnp slices, three per document."""
    left, right = _window(local_window_size, T + S)
    if is_causal:
        right = min(right, 0)
    # Concrete ids and lengths give the slices in numpy, empty ones dropped (the call then sees the same
    # mask as flex_flash_attn with an AttnMask); traced ones give them in jnp, a fixed count.
    traced = any(isinstance(x, jax.core.Tracer) for x in (segment_ids, query_seq_lengths, key_value_seq_lengths))
    xp = jnp if traced else np
    q_len = _lengths("query_seq_lengths", query_seq_lengths, B, T, xp)
    kv_len = _lengths("key_value_seq_lengths", key_value_seq_lengths, B, S, xp)
    if segment_ids is not None:
        if T != S:
            raise ValueError(f"segment_ids: self-attention only, but query has {T} tokens and key {S}")
        segment_ids = _segment_ids(segment_ids, B, T, unbatched)
        starts, ends, overflow = _documents(segment_ids, max_segments, xp)
    else:
        if max_segments is not None:
            raise ValueError("max_segments: given without segment_ids")
        starts, ends, overflow = np.zeros((B, 1), np.int32), np.full((B, 1), T, np.int32), None
    # Each document's queries and keys, cut by the sequence lengths; without segments one document [0, T)
    # of queries over [0, S) of keys.
    qs, qe = xp.minimum(starts, q_len[:, None]), xp.minimum(ends, q_len[:, None])
    if segment_ids is None:
        ks, ke = xp.zeros_like(qs), xp.broadcast_to(kv_len[:, None], qs.shape)
    else:
        ks, ke = xp.minimum(starts, kv_len[:, None]), xp.minimum(ends, kv_len[:, None])
    q_ranges, k_ranges, types = band_slices(qs, qe, ks, ke, left, right, xp)
    q_ranges, k_ranges, types = q_ranges.reshape(B, -1, 2), k_ranges.reshape(B, -1, 2), types.reshape(B, -1)
    empty = (q_ranges[..., 0] >= q_ranges[..., 1]) | (k_ranges[..., 0] >= k_ranges[..., 1])
    if traced:
        q_ranges = jnp.where(empty[..., None], 0, q_ranges)
        k_ranges = jnp.where(empty[..., None], 0, k_ranges)
        types = jnp.where(empty, int(AttnMaskType.FULL), types)
        return q_ranges, k_ranges, types, overflow
    # Each sequence's nonempty slices first, the others emptied: the count is the most any sequence has.
    order = np.argsort(empty, axis=1, kind="stable")
    count = int((~empty).sum(axis=1).max()) if B else 0
    keep = lambda x: np.take_along_axis(x, order[..., None] if x.ndim == 3 else order, axis=1)[:, :count]
    kept = keep(~empty)
    q_ranges = np.where(kept[..., None], keep(q_ranges), 0).astype(np.int32)
    k_ranges = np.where(kept[..., None], keep(k_ranges), 0).astype(np.int32)
    types = np.where(kept, keep(types), int(AttnMaskType.FULL)).astype(np.int32)
    return q_ranges, k_ranges, types, overflow


def band_slices(qs, qe, ks, ke, left: int, right: int, xp=jnp):
    """The slices of each document's band {(i, j): qs <= i < qe, ks <= j < ke, i - left <= j <= i + right}
    (positions in one frame): rows below a = ks + left have the lower bound ks, rows from a on i - left; rows
    below b = ke - right the upper bound i + right, rows from b on ke - 1. So rows [qs, min(a, b)) are CAUSAL
    over [ks, end + right), rows between a and b BI_CAUSAL over [start - left, end + right) (a <= b) or FULL
    over [ks, ke) (b < a), rows from max(a, b) INV_CAUSAL over [start - left, ke). Arrays [...] in, ranges
    [..., 3, 2] and types [..., 3] out (int32, numpy or jnp as xp); a slice may be empty or reversed where
    its rows see nothing."""
    qs, qe, ks, ke = (xp.asarray(x, np.int32) for x in (qs, qe, ks, ke))
    a, b = ks + left, ke - right
    lo1, hi1 = qs, xp.clip(xp.minimum(a, b), qs, qe)
    lo2, hi2 = xp.clip(xp.minimum(a, b), qs, qe), xp.clip(xp.maximum(a, b), qs, qe)
    lo3 = xp.clip(xp.maximum(a, b), qs, qe)
    band = a <= b
    q_ranges = xp.stack([xp.stack([lo1, hi1], -1), xp.stack([lo2, hi2], -1), xp.stack([lo3, qe], -1)], -2)
    k_ranges = xp.stack([xp.stack([ks, hi1 + right], -1),
                         xp.where(band[..., None], xp.stack([lo2 - left, hi2 + right], -1), xp.stack([ks, ke], -1)),
                         xp.stack([lo3 - left, ke], -1)], -2)
    middle = xp.where(band, int(AttnMaskType.BI_CAUSAL), int(AttnMaskType.FULL))
    types = xp.stack([xp.full_like(qs, int(AttnMaskType.CAUSAL)), middle,
                      xp.full_like(qs, int(AttnMaskType.INV_CAUSAL))], -1)
    return q_ranges, k_ranges, types


def _explicit_batch(mask_args, unbatched: bool) -> tuple | None:
    """(the spec entry of the batch,) when a traced mask argument is typed with Explicit mesh axes, else None."""
    for x in mask_args:
        spec = split_spec(x) if isinstance(x, jax.core.Tracer) else None
        if spec is not None:
            return (None if unbatched else spec[0],)
    return None


def _window(local_window_size, limit: int) -> tuple[int, int]:
    """(left, right) from jax.nn's int or pair, each at most `limit` (no window: both `limit`)."""
    if local_window_size is None:
        return limit, limit
    pair = (local_window_size, local_window_size) if isinstance(local_window_size, (int, np.integer)) else \
        tuple(local_window_size) if isinstance(local_window_size, (tuple, list)) else None
    if pair is None or len(pair) != 2 or not all(isinstance(w, (int, np.integer)) and w >= 0 for w in pair):
        raise ValueError(f"local_window_size: expected an int >= 0 or a pair (left, right) of them, got "
                         f"{local_window_size!r}")
    return min(int(pair[0]), limit), min(int(pair[1]), limit)


def _check_qkv(query, key, value) -> None:
    """ffa.check_qkv on the caller's arrays, before they are flattened, so that errors name query, key and
    value with the shapes passed."""
    if np.ndim(query) not in (3, 4):
        raise ValueError(f"query: expected [B, T, N, H] or [T, N, H], got shape {np.shape(query)}")
    ffa.check_qkv(query, key, value, names=("query", "key", "value"), ndim=np.ndim(query))
    if np.ndim(query) == 4 and key.shape[0] != query.shape[0]:
        raise ValueError(f"key: batch {key.shape[0]} differs from query's {query.shape[0]}")


def _check_ints(name: str, x, shape: tuple) -> None:
    if np.shape(x) != shape or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
        raise ValueError(f"{name}: expected integers of shape {shape}, got {jnp.result_type(x)} {np.shape(x)}")


def _lengths(name: str, lengths, batch: int, total: int, xp):
    if lengths is None:
        return np.full((batch,), total, np.int32)
    if isinstance(lengths, (list, tuple)):
        lengths = np.asarray(lengths)   # as jax.nn takes them; floats are still refused below
    _check_ints(name, lengths, (batch,))
    if not isinstance(lengths, jax.core.Tracer) and not np.all((np.asarray(lengths) >= 0) &
                                                               (np.asarray(lengths) <= total)):
        raise ValueError(f"{name}: lengths must lie in [0, {total}], got {np.asarray(lengths).tolist()}")
    return xp.clip(xp.asarray(lengths, np.int32), 0, total)


def _segment_ids(segment_ids, batch: int, tokens: int, unbatched: bool):
    _check_ints("segment_ids", segment_ids, (tokens,) if unbatched else (batch, tokens))
    xp = jnp if isinstance(segment_ids, jax.core.Tracer) else np
    return xp.asarray(segment_ids).reshape(batch, tokens)


def _documents(segment_ids, max_segments: int | None, xp):
    """Each sequence's documents, the runs of equal consecutive ids: starts and ends [B, M] (unused
    documents empty, at T) as xp arrays, and for traced ids whether any sequence has more than M runs
    (concrete ids are counted here, M defaulting to the most)."""
    if max_segments is not None and (isinstance(max_segments, bool) or not isinstance(max_segments, (int, np.integer))
                                     or max_segments < 1):
        raise ValueError(f"max_segments: expected an int >= 1, got {max_segments!r}")
    B, T = segment_ids.shape
    ids = np if isinstance(segment_ids, np.ndarray) else jnp
    is_start = ids.concatenate([ids.ones((B, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    if ids is np:
        most = int(is_start.sum(axis=1).max()) if B else 0
        if max_segments is not None and most > max_segments:
            raise ValueError(f"max_segments: a sequence has {most} documents, more than {max_segments}")
        starts = np.full((B, max(most, 1) if max_segments is None else int(max_segments)), T, np.int32)
        for b in range(B):
            first = np.flatnonzero(is_start[b])
            starts[b, :len(first)] = first
        overflow = None
    else:
        if max_segments is None:
            raise ValueError("max_segments: required when segment_ids are traced (under jit): the most documents "
                             "a sequence may hold")
        m = int(max_segments)
        # nonzero (a scan and a scatter: 0.05-0.07 ms on an H200 at 4k-64k tokens; a sort took 0.12), for one
        # start more than kept: a sequence whose (m + 1)-th start exists overflows.
        first = jax.vmap(lambda s: jnp.nonzero(s, size=m + 1, fill_value=T)[0])(is_start).astype(jnp.int32)
        starts, overflow = first[:, :m], jnp.any(first[:, m] < T)
    ends = ids.concatenate([starts[:, 1:], ids.full((B, 1), T, ids.int32)], axis=1)
    return xp.asarray(starts), xp.asarray(ends), overflow
