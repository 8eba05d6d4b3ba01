"""flex_flash_attn: flexible-mask attention on one device, a custom_vjp over the two FFA custom calls."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from magi_jax import _ffi, partition
from magi_jax.mask import AttnMask, as_type_codes

SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
# The kernels' head dims. Any other up to the largest runs zero-padded to the next of them (kernel_head_dim).
SUPPORTED_HEAD_DIMS = (64, 96, 128, 192, 256)
# The head dims of deterministic=True: the GPU's deterministic dq kernel has 64 and 128 (96 runs padded to
# 128, 192 to 256, which the GPU refuses: it has no deterministic backward at 256).
DETERMINISTIC_HEAD_DIMS = (64, 128, 256)
# The kernels' head dims for v smaller than q's, by q's kernel head dim: MLA's q / k 192 with v up to 128 run
# with v at 128, not padded to 192 (a third less P V, dP and dV work, and v traffic).
V_HEAD_DIMS = {192: 128}
# The names that flex_flash_attn and calc_attn give their out and lse as saved for the backward: under
# jax.checkpoint, the policy jax.checkpoint_policies.save_only_these_names(*CHECKPOINT_NAMES) keeps them,
# so the backward pass does not run the attention forward again (by default it does).
CHECKPOINT_NAMES = ("magi_attn_out", "magi_attn_lse")


def flex_flash_attn(q: jax.Array, k: jax.Array, v: jax.Array, q_ranges=None, k_ranges=None,
                    attn_type_map=None, *, mask: AttnMask | None = None, softmax_scale: float | None = None,
                    softcap: float = 0.0, deterministic: bool = False, sm_margin: int = 0,
                    return_max_logit: bool = False) -> tuple[jax.Array, ...]:
    """Attention of packed q [Tq, Hq, D] over k [Tk, Hkv, D] and v [Tk, Hkv, Dv] restricted to a flexible mask.

    The mask is either `mask=` (an AttnMask) or the three arrays q_ranges [N, 2], k_ranges [N, 2] and
    attn_type_map [N] (int32; numpy or traced: a new mask with the same N does not recompile). Concrete
    ranges are validated (named errors); traced ones cannot be: the kernels clamp them to the sequences, so
    no value reads or writes out of bounds, but invalid ones (reversed, type codes outside 0..3) give
    unspecified results. softmax_scale and softcap are Python or NumPy numbers, finite (the kernels run a
    negative or zero scale as a positive one: positive_scale).
    Returns out [Tq, Hq, Dv] in q's dtype and lse [Tq, Hq] float32 (natural log; -inf on rows with no key).
    A batch of sequences, q [B, Tq, Hq, D] with k, v [B, Tk, ...] (or [Tk, ...], keys every sequence shares),
    takes the mask (or slices [N, 2], [N]) of every sequence, or slices [B, N, 2], [B, N] each its own, and
    gives out [B, Tq, Hq, Dv], lse [B, Tq, Hq]: as jax.vmap over the sequences would, one packed call.
    D and Dv (1 to 256) may differ; the kernels run 64, 96, 128, 192 and 256 (deterministic=True: 96 padded
    to 128, 192 to 256), other sizes zero-padded to the next of them (kernel_head_dim), at the padded size's
    cost; D 192 with Dv up to 128 runs at Dv 128 (MLA's shapes; V_HEAD_DIMS).
    softcap > 0 caps logits as softcap * tanh(logit / softcap). deterministic=True makes the backward
    bitwise reproducible. Under jax.vmap the batch runs as one call (its elements packed end to end, each
    element's slices on its own tokens; keys shared by the batch are not copied). Under jit on arrays sharded
    over that batch or the heads, each device runs its own (magi_jax.partition). sm_margin > 0 leaves that
    many SMs out of the forward's persistent grid (Hopper), for a collective the caller runs beside it: a
    persistent kernel holds every SM until it ends, so a communication kernel launched after it would
    otherwise wait. Differentiable in q, k, v (and through lse).
    return_max_logit=True adds a third result, max_logit [Hq] float32 ([B, Hq] for a batch): per q head the
    largest logit (softmax_scale * q.k, softcapped as the softmax takes it) over every cell the mask lets a
    row attend; -inf where no row attends anything. What QK-clip (MuonClip) rescales W_q and W_k by; not
    differentiable (its cotangent is dropped). It costs the forward a running max per row (on an H100, 5-15%
    of a D 128 forward, up to 3.4% of forward+backward; BENCHMARKS.md 2026-12-06 and 2026-12-07).
    Under jax.checkpoint, out and lse are saveable by name (CHECKPOINT_NAMES).

    Example::

        mask = magi_jax.masks.varlen_causal([3, 2])
        out, lse = flex_flash_attn(q, k, v, mask=mask)      # q, k, v: [5, H, D]
    """
    if mask is not None:
        if any(x is not None for x in (q_ranges, k_ranges, attn_type_map)):
            raise ValueError("mask: give either mask= or q_ranges/k_ranges/attn_type_map, not both")
        if not isinstance(mask, AttnMask):
            raise ValueError(f"mask: expected an AttnMask, got {type(mask).__name__}")
        for name, x, total in (("q", q, mask.total_seqlen_q), ("k", k, mask.total_seqlen_k)):
            if np.ndim(x) in (3, 4) and x.shape[-3] != total:
                raise ValueError(f"{name}: has {x.shape[-3]} tokens but the mask expects {total}")
        q_ranges, k_ranges, attn_type_map = mask.kernel_args()
    elif any(x is None for x in (q_ranges, k_ranges, attn_type_map)):
        raise ValueError("q_ranges, k_ranges and attn_type_map are all required when mask= is not given")
    return_max_logit = check_flag("return_max_logit", return_max_logit)
    if np.ndim(q) == 4:
        return _each_sequence(q, k, v, (q_ranges, k_ranges, attn_type_map), dict(
            softmax_scale=softmax_scale, softcap=softcap, deterministic=deterministic, sm_margin=sm_margin,
            return_max_logit=return_max_logit))
    check_qkv(q, k, v)
    q_ranges, k_ranges, attn_type_map = check_ranges(q_ranges, k_ranges, attn_type_map, q.shape[0], k.shape[0])
    scale, cap = check_scale_and_softcap(softmax_scale, softcap, q.shape[-1])
    q, scale = positive_scale(q, scale)
    head_dim_v = v.shape[-1]
    deterministic = check_flag("deterministic", deterministic)
    out, lse, *max_logit = _ffa(*pad_head_dims(q, k, v, deterministic, v_apart=True), q_ranges, k_ranges,
                                attn_type_map, scale, cap, deterministic, check_sm_margin(sm_margin),
                                return_max_logit)
    return drop_head_dim_padding(out, head_dim_v), lse, *max_logit


def _each_sequence(q, k, v, slices: tuple, options: dict) -> tuple[jax.Array, ...]:
    """flex_flash_attn of a batch q [B, Tq, Hq, D], k and v [B, Tk, ...] (or [Tk, ...]: keys every sequence
    shares), slices [N, 2], [N, 2], [N] for every sequence or [B, N, 2], [B, N, 2], [B, N] each its own: a
    jax.vmap over the sequences (one packed call). Concrete slices are checked per sequence first, so that
    errors name them (under the vmap they are traced)."""
    batch = q.shape[0]
    keys_shared = np.ndim(k) == 3
    element = lambda x: jax.ShapeDtypeStruct(x.shape[-3:], x.dtype)
    check_qkv(element(q), element(k), element(v))
    for name, x in (("k", k), ("v", v)):
        if np.ndim(x) != np.ndim(k) or (not keys_shared and x.shape[0] != batch):
            raise ValueError(f"{name}: expected [{batch}, Tk, H, D] (q's batch) or [Tk, H, D] for k and v alike, "
                             f"got shape {np.shape(x)}")
    axes = []
    for name, x, rank in zip(("q_ranges", "k_ranges", "attn_type_map"), slices, (2, 2, 1)):
        batched = np.ndim(x) == rank + 1
        if batched and np.shape(x)[0] != batch:
            raise ValueError(f"{name}: {np.shape(x)[0]} sequences' slices for q's batch of {batch}")
        axes.append(0 if batched else None)
    if not any(isinstance(x, jax.core.Tracer) for x in slices):
        for b in range(batch if any(a is not None for a in axes) else 1):
            check_ranges(*(x if a is None else x[b] for x, a in zip(slices, axes)), q.shape[1], k.shape[-3])
    attend = lambda q, k, v, *ranges: flex_flash_attn(q, k, v, *ranges, **options)
    slices = tuple(x if a is None else _batch_sharded_like(x, q) for x, a in zip(slices, axes))
    return jax.vmap(attend, in_axes=(0, None if keys_shared else 0, None if keys_shared else 0, *axes))(
        q, k, v, *slices)


def _batch_sharded_like(x, q):
    """x [B, ...] with its batch split as q's is over Explicit mesh axes (jax.vmap wants the axes it maps
    sharded alike); as it is otherwise."""
    spec = partition.split_spec(q)
    if spec is None or spec[0] is None:
        return x
    return jax.sharding.reshard(jnp.asarray(x), jax.sharding.PartitionSpec(spec[0]))


def with_sinks(out: jax.Array, lse: jax.Array, sinks) -> tuple[jax.Array, jax.Array]:
    """out and lse of the same attention with one more logit per head in every row's softmax, a learned sink
    (as in gpt-oss) whose value is zero: each row's weights shrink by exp(lse) / (exp(lse) + exp(sink)).
    out [..., Hq, Dv] and lse [..., Hq] as flex_flash_attn or calc_attn return them; sinks [Hq], in the
    logits' units (after softmax_scale). Rows with no key stay 0 (their lse becomes the sink).
    Differentiable in all three: the kernels' backward takes the gradient that reaches lse."""
    if lse.shape != out.shape[:-1]:
        raise ValueError(f"lse: expected out's shape without its last axis, {out.shape[:-1]}, got {lse.shape}")
    sinks = jnp.asarray(sinks)
    if sinks.shape != lse.shape[-1:]:
        raise ValueError(f"sinks: expected one per head, shape ({lse.shape[-1]},), got {sinks.shape}")
    if not jnp.issubdtype(sinks.dtype, jnp.floating):
        raise ValueError(f"sinks: expected floats, got {sinks.dtype}")
    sinks = sinks.astype(jnp.float32)
    kept = jax.nn.sigmoid(lse - sinks)  # exp(lse) / (exp(lse) + exp(sink)): 0 where lse is -inf
    return (out.astype(jnp.float32) * kept[..., None]).astype(out.dtype), jnp.logaddexp(lse, sinks)


def kernel_head_dim(head_dim: int, head_dim_v: int, deterministic: bool = False) -> int:
    """The kernels' head dim for q, k of head_dim and v of head_dim_v: the least of SUPPORTED_HEAD_DIMS (or
    DETERMINISTIC_HEAD_DIMS for deterministic=True) that holds both."""
    dims = DETERMINISTIC_HEAD_DIMS if deterministic else SUPPORTED_HEAD_DIMS
    return next(d for d in dims if d >= max(head_dim, head_dim_v))


def pad_head_dims(q: jax.Array, k: jax.Array, v: jax.Array, deterministic: bool = False,
                  v_apart: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q, k, v zero-padded along their last axis to kernel_head_dim (as they are where it is theirs); with
    v_apart, v to the kernels' own head dim for it where there is one (V_HEAD_DIMS). Exact: zeros
    add nothing to q k^T, and v's zero columns give output columns that the caller drops. The softmax scale
    stays the caller's (its default from q's own head dim)."""
    d = kernel_head_dim(q.shape[-1], v.shape[-1], deterministic)
    dv = V_HEAD_DIMS.get(d, d) if v_apart else d
    return pad_last_axis(q, d), pad_last_axis(k, d), pad_last_axis(v, dv if v.shape[-1] <= dv else d)


def pad_last_axis(x: jax.Array, size: int) -> jax.Array:
    """x zero-padded along its last axis to size."""
    return x if x.shape[-1] == size else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, size - x.shape[-1])])


def drop_head_dim_padding(out: jax.Array, head_dim_v: int) -> jax.Array:
    """out's first head_dim_v columns: pad_head_dims undone."""
    return out if out.shape[-1] == head_dim_v else out[..., :head_dim_v]


def check_scale_and_softcap(softmax_scale, softcap, head_dim: int) -> tuple[float, float]:
    """(softmax_scale, softcap) as floats: finite, softcap >= 0 (0: none), the scale head_dim ** -0.5 when None.
    Both are compiled into the kernel call, so they must be concrete."""
    scale = head_dim ** -0.5 if softmax_scale is None else concrete_float("softmax_scale", softmax_scale)
    cap = concrete_float("softcap", softcap)
    if cap < 0.0:
        raise ValueError(f"softcap: must be >= 0 (0 disables it), got {cap}")
    return scale, cap


def positive_scale(q: jax.Array, scale: float) -> tuple[jax.Array, float]:
    """(q, scale) with the same logits and a positive scale, as the CUDA kernels need: a negative scale's sign
    moves into q (scale * q.k = -scale * (-q).k), and a zero scale runs as 1 over a zero q (every logit 0).
    Their online softmax takes each row's maximum of q.k before scaling, under a negative scale its smallest
    logit, against which the exponentials overflow (fp16's P beyond a spread of ~11); and it masks cells with
    -inf, which a zero scale turns into NaN."""
    if scale > 0.0:
        return q, scale
    return (-q, -scale) if scale < 0.0 else (jnp.zeros_like(q), 1.0)


def concrete_float(name: str, x) -> float:
    if isinstance(x, jax.core.Tracer):
        raise ValueError(f"{name}: must be a Python or NumPy number (it is fixed at trace time), got a traced value")
    if np.ndim(x) != 0 or not np.issubdtype(np.asarray(x).dtype, np.number):
        raise ValueError(f"{name}: expected a number, got {x!r}")
    value = float(x)
    if not np.isfinite(value):
        raise ValueError(f"{name}: must be finite, got {value}")
    return value


def check_flag(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name}: expected True or False, got {value!r}")
    return bool(value)


def check_sm_margin(sm_margin) -> int:
    if isinstance(sm_margin, bool) or not isinstance(sm_margin, (int, np.integer)) or sm_margin < 0:
        raise ValueError(f"sm_margin: expected an int >= 0, got {sm_margin!r}")
    return int(sm_margin)


def check_qkv(q, k, v, names: tuple[str, str, str] = ("q", "k", "v"), ndim: int = 3) -> None:
    """Shape and dtype checks of [..., tokens, heads, head_dim] arrays of ``ndim`` dims (leading dims, if any,
    are the caller's to check), with errors that name the argument as ``names`` give it."""
    nq, nk, nv = names
    layout = "[tokens, heads, head_dim]" if ndim == 3 else f"{ndim} dims, [..., tokens, heads, head_dim]"
    for name, x in zip(names, (q, k, v)):
        if np.ndim(x) != ndim:
            raise ValueError(f"{name}: expected {layout}, got shape {np.shape(x)}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"{nq}: dtype {q.dtype} unsupported; use bfloat16, float16 or float32")
    for name, x in ((nk, k), (nv, v)):
        if x.dtype != q.dtype:
            raise ValueError(f"{name}: dtype {x.dtype} differs from {nq}'s {q.dtype}")
    if v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"{nv}: shape {v.shape} differs from {nk}'s {k.shape} (only the head dims may differ)")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"{nk}: head_dim {k.shape[-1]} differs from {nq}'s {q.shape[-1]}")
    for name, x in ((nq, q), (nv, v)):
        if not 1 <= x.shape[-1] <= SUPPORTED_HEAD_DIMS[-1]:
            raise ValueError(f"{name}: head_dim {x.shape[-1]} unsupported; use 1 to {SUPPORTED_HEAD_DIMS[-1]} "
                             f"(sizes other than {SUPPORTED_HEAD_DIMS} run zero-padded to the next of them)")
    if k.shape[-2] == 0 or q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"{nk}: {k.shape[-2]} kv heads do not divide {q.shape[-2]} {nq} heads")


def check_ranges(q_ranges, k_ranges, attn_type_map, tq: int, tk: int):
    """Shapes always; values too when the arrays are concrete. Returns int32 arrays."""
    arrays = []
    for name, x, shape in (("q_ranges", q_ranges, (None, 2)), ("k_ranges", k_ranges, (None, 2)),
                           ("attn_type_map", attn_type_map, (None,))):
        if isinstance(x, (list, tuple)) and len(shape) == 1:
            x = as_type_codes(x, name)   # names too, as AttnMask takes them
        elif isinstance(x, (list, tuple)):
            x = np.asarray(x) if len(x) else np.zeros((0, 2), np.int32)   # [] has no shape of its own
        if len(np.shape(x)) != len(shape) or (len(shape) == 2 and np.shape(x)[1] != 2):
            raise ValueError(f"{name}: expected shape {'[N, 2]' if len(shape) == 2 else '[N]'}, "
                             f"got {np.shape(x)}")
        if not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name}: expected an integer array, got dtype {x.dtype}")
        arrays.append(x)
    if not np.shape(arrays[0])[0] == np.shape(arrays[1])[0] == np.shape(arrays[2])[0]:
        raise ValueError(f"q_ranges, k_ranges and attn_type_map have different lengths: "
                         f"{np.shape(arrays[0])[0]}, {np.shape(arrays[1])[0]}, {np.shape(arrays[2])[0]}")
    if not any(isinstance(x, jax.core.Tracer) for x in arrays):
        # Concrete: the mask model validates values (bounds, order, type codes) with named errors.
        AttnMask(np.asarray(arrays[0]), np.asarray(arrays[1]), np.asarray(arrays[2]), tq, tk)
    # Traced ones pass through a copy (elided by XLA): jax.vmap leaves a mapped numpy array as it is inside
    # its tracer, which jit's trace then refuses as a custom_vjp operand (jax 0.11.2).
    return tuple(jnp.array(x, jnp.int32, copy=True) if isinstance(x, jax.core.Tracer) else
                 jnp.asarray(x, jnp.int32) if isinstance(x, jax.Array) else np.asarray(x, np.int32) for x in arrays)


def _fwd_call(q, k, v, q_ranges, k_ranges, attn_type_map, scale, softcap, sm_margin=0, prev=None,
              head_dim_v=None, max_logit=False):
    """out, lse over the slices given; prev: (out, lse) of an earlier call over the same q and other keys
    (disjoint slices), merged in by the kernel and updated in place: the result is that of both calls'
    slices together. max_logit=True: a third result, each row's largest logit over this call's keys (not
    prev's) [Tq, Hq] float32, -inf for rows without any. v None: k is K and V packed, [Tk, 2, Hkv, D] (a
    group collective's receive buffer), read as is; V is the first head_dim_v columns of its heads (default
    D: all). out is [Tq, Hq, Dv], v's head dim (V_HEAD_DIMS: the pairs the GPU takes)."""
    kv_packed = v is None
    if kv_packed:
        if k.ndim != 4 or k.shape[1] != 2:
            raise ValueError(f"k: packed K and V must be [Tk, 2, Hkv, D], got {k.shape}")
        head_dim_v = k.shape[-1] if head_dim_v is None else head_dim_v
        if not 0 < head_dim_v <= k.shape[-1]:
            raise ValueError(f"head_dim_v: must be in [1, {k.shape[-1]}] (k's head dim), got {head_dim_v}")
        k = k.reshape(k.shape[0], 2 * k.shape[2], k.shape[3])
        v = k
    elif head_dim_v is not None:
        raise ValueError("head_dim_v: only for packed K and V (v None); v's own head dim says it otherwise")
    out_shape = (*q.shape[:2], head_dim_v if kv_packed else v.shape[-1])
    if prev is None:
        prev = (jnp.zeros((0,), q.dtype), jnp.zeros((0,), jnp.float32))
        aliases = None
    else:
        if prev[0].shape != out_shape or prev[0].dtype != q.dtype or prev[1].shape != q.shape[:2]:
            raise ValueError(f"prev: expected out {out_shape} {q.dtype} and lse {q.shape[:2]} float32, got "
                             f"{prev[0].shape} {prev[0].dtype} and {prev[1].shape}")
        prev = (prev[0], prev[1].astype(jnp.float32))
        aliases = {6: 0, 7: 1}
    _ffi.check_kernel_env()
    outs = _ffi.call(
        _ffi.FFA_FWD,
        (jax.ShapeDtypeStruct(out_shape, q.dtype), jax.ShapeDtypeStruct(q.shape[:2], jnp.float32),
         jax.ShapeDtypeStruct(q.shape[:2] if max_logit else (0,), jnp.float32)),
        q, k, v, q_ranges, k_ranges, attn_type_map, *prev, aliases=aliases, softmax_scale=np.float32(scale),
        softcap=np.float32(softcap), sm_margin=np.int32(sm_margin), kv_packed=kv_packed)
    return outs if max_logit else outs[:2]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def _ffa(q, k, v, q_ranges, k_ranges, attn_type_map, scale, softcap, deterministic, sm_margin, max_logit):
    return _forward(q, k, v, q_ranges, k_ranges, attn_type_map, scale, softcap, sm_margin, max_logit)


def _forward(q, k, v, q_ranges, k_ranges, attn_type_map, scale, softcap, sm_margin, max_logit):
    return _one(_batched_fwd(scale, softcap, sm_margin, max_logit), (q, True), (k, False), (v, False),
                (q_ranges, True), (k_ranges, True), (attn_type_map, True))


# The calls' batched form: a leading batch axis, B = 1 for a lone call, the batch of a jax.vmap otherwise.
# Its elements run as one call (their sequences packed end to end, each element's slices moved onto its own
# tokens: one kernel launch instead of one per element, as a varlen mask would be), on each device's own
# batch elements and heads when the arrays are sharded (magi_jax.partition). The custom calls alone would run
# one element after another (_ffi.call's vmap_method) and gather sharded arrays.

def _one(fn, *args_and_batched):
    """fn's batched form on a lone call: a batch axis of 1 added where batched is True, taken off the results.
    By reshapes: eager x[None] on arrays committed to one mesh left a later jit's transpose parsing another
    mesh's shardings with the first mesh (jax 0.11.2)."""
    outs = fn(*(jnp.reshape(x, (1, *np.shape(x))) if batched else x for x, batched in args_and_batched))
    return tuple(y.reshape(y.shape[1:]) for y in outs)


def _batched(x, axis_size: int, batched: bool) -> jax.Array:
    """x with a leading batch axis (broadcast when x is the same for every element)."""
    x = jnp.asarray(x)
    return x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))


def _merged(x, axis_size: int, batched: bool) -> jax.Array:
    """[A, B, ...] (x batched by an outer jax.vmap of size A, or broadcast to it) -> [A * B, ...]."""
    return pack_tokens(_batched(x, axis_size, batched))


def _pack_ranges(ranges: jax.Array, tokens: int, packed: bool = True) -> jax.Array:
    """[B, N, 2] ranges over each element's `tokens` -> [B * N, 2] over the packed sequence (packed=False:
    over one sequence all elements share). Clamped to the element first, so that an invalid traced range
    (unspecified results, flex_flash_attn) stays in its own element; a lone element's go as they are (the
    kernels clamp them), so that a lone call with traced ranges runs no extra kernel."""
    if ranges.shape[0] == 1:
        return jnp.asarray(ranges, jnp.int32).reshape(-1, 2)
    offsets = jnp.arange(ranges.shape[0], dtype=jnp.int32)[:, None, None] * (tokens if packed else 0)
    return (jnp.clip(ranges.astype(jnp.int32), 0, tokens) + offsets).reshape(-1, 2)


def pack_tokens(x: jax.Array) -> jax.Array:
    """[B, T, ...] -> [B * T, ...]: a batch's sequences end to end, as the kernels take them."""
    return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])


def _unpack_tokens(x: jax.Array, batch: int, length: int) -> jax.Array:
    """[batch * length, ...] -> [batch, length, ...]: pack_tokens undone (sizes given: batch may be 0)."""
    return x.reshape(batch, length, *x.shape[1:])


@functools.lru_cache(maxsize=None)
def _batched_fwd(scale: float, softcap: float, sm_margin: int, max_logit: bool):
    """The forward over (q [B, T, Hq, D], k, v, q_ranges [B, N, 2], k_ranges [B, N, 2], types [B, N]) ->
    (out, lse), and with max_logit each element's largest logit per q head [B, Hq]: k [Tk, Hkv, D] and v
    one context every element shares (its keys are not copied: each element's slices index the same keys),
    or [B, Tk, ...] each element's own."""
    def per_device(q, k, v, q_ranges, k_ranges, types):
        if q.shape[0] == 0:
            outs = (jnp.zeros((*q.shape[:-1], v.shape[-1]), q.dtype), jnp.zeros(q.shape[:-1], jnp.float32),
                    jnp.full((0, q.shape[2]), -jnp.inf, jnp.float32))
            return outs if max_logit else outs[:2]
        shared_keys = k.ndim == 3
        tk = k.shape[-3]
        if not shared_keys:
            k, v = pack_tokens(k), pack_tokens(v)
        outs = _fwd_call(pack_tokens(q), k, v, _pack_ranges(q_ranges, q.shape[1]),
                         _pack_ranges(k_ranges, tk, not shared_keys), types.reshape(-1), scale, softcap,
                         sm_margin, max_logit=max_logit)
        out, lse, *rows = (_unpack_tokens(x, *q.shape[:2]) for x in outs)
        return out, lse, *(jnp.max(x, axis=1, initial=-jnp.inf) for x in rows)

    keys = ("sGd", "sGe"), ("bsGd", "bsGe")
    out_layouts = ("btHe", "btH", "bH")[:3 if max_logit else 2]
    runs = {shared: partition.over_batch_and_heads(per_device, ("btHd", *keys[not shared], "bnx", "bnx", "bn"),
                                                   out_layouts)
            for shared in (True, False)}

    @jax.custom_batching.custom_vmap
    def fwd(q, k, v, q_ranges, k_ranges, types):
        return runs[k.ndim == 3](q, k, v, q_ranges, k_ranges, types)

    @fwd.def_vmap
    def outer(axis_size, in_batched, q, k, v, q_ranges, k_ranges, types):
        # An outer jax.vmap (of size A) over the batched form: its axis joins the batch, [A * B, ...]. Shared
        # keys stay shared unless the outer vmap batches them; then each element gets its own.
        q_batched, k_batched, v_batched = in_batched[:3]
        inner = q.shape[int(q_batched)]
        if k.ndim - k_batched == 4:
            k, v = _merged(k, axis_size, k_batched), _merged(v, axis_size, v_batched)
        elif k_batched or v_batched:
            k, v = (pack_tokens(jnp.broadcast_to(_batched(x, axis_size, b)[:, None],
                                                 (axis_size, inner, *x.shape[int(b):])))
                    for x, b in ((k, k_batched), (v, v_batched)))
        q, q_ranges, k_ranges, types = (_merged(x, axis_size, b) for x, b in
                                        zip((q, q_ranges, k_ranges, types), (q_batched, *in_batched[3:])))
        outs = fwd(q, k, v, q_ranges, k_ranges, types)
        return tuple(_unpack_tokens(y, axis_size, inner) for y in outs), (True,) * len(outs)

    return fwd


@functools.lru_cache(maxsize=None)
def _batched_bwd(scale: float, softcap: float, deterministic: bool):
    """The backward over (q, k, v, out, dout, lse, dlse, q_ranges, k_ranges, types), each with a leading batch
    axis, -> (dq, dk, dv): _batched_fwd's, each element with its own keys (shared keys are copied per element
    by the caller, whose transpose sums their gradients)."""
    def per_device(q, k, v, out, dout, lse, dlse, q_ranges, k_ranges, types):
        if q.shape[0] == 0:
            return jnp.zeros_like(q), jnp.zeros_like(k), jnp.zeros_like(v)
        grads = _bwd_call(*(pack_tokens(x) for x in (q, k, v, out, dout, lse, dlse)),
                          _pack_ranges(q_ranges, q.shape[1]), _pack_ranges(k_ranges, k.shape[1]),
                          types.reshape(-1), scale, softcap, deterministic)[:3]
        return tuple(_unpack_tokens(g, *x.shape[:2]) for g, x in zip(grads, (q, k, v)))

    run = partition.over_batch_and_heads(
        per_device, ("btHd", "bsGd", "bsGe", "btHe", "btHe", "btH", "btH", "bnx", "bnx", "bn"),
        ("btHd", "bsGd", "bsGe"))

    @jax.custom_batching.custom_vmap
    def bwd(*args):
        return run(*args)

    @bwd.def_vmap
    def outer(axis_size, in_batched, *args):
        inner = args[0].shape[int(in_batched[0])]
        grads = bwd(*(_merged(x, axis_size, b) for x, b in zip(args, in_batched)))
        return tuple(_unpack_tokens(g, axis_size, inner) for g in grads), (True, True, True)

    return bwd


def named_for_checkpoint(out: jax.Array, lse: jax.Array) -> tuple[jax.Array, jax.Array]:
    """out and lse tagged with CHECKPOINT_NAMES (identities outside jax.checkpoint)."""
    return checkpoint_name(out, CHECKPOINT_NAMES[0]), checkpoint_name(lse, CHECKPOINT_NAMES[1])


def _ffa_fwd(q, k, v, q_ranges, k_ranges, attn_type_map, scale, softcap, deterministic, sm_margin, max_logit):
    out, lse, *max_logit = _forward(q, k, v, q_ranges, k_ranges, attn_type_map, scale, softcap, sm_margin,
                                    max_logit)
    out, lse = named_for_checkpoint(out, lse)
    return (out, lse, *max_logit), (q, k, v, out, lse, q_ranges, k_ranges, attn_type_map)


def _ffa_bwd(scale, softcap, deterministic, sm_margin, max_logit, residuals, cotangents):
    q, k, v, out, lse, q_ranges, k_ranges, attn_type_map = residuals
    dout, dlse = cotangents[:2]  # max_logit's, if any, is dropped: it is not differentiable
    dq, dk, dv = _one(_batched_bwd(scale, softcap, deterministic), *((x, True) for x in (
        q, k, v, out, dout, lse, dlse, q_ranges, k_ranges, attn_type_map)))
    return dq, dk, dv, None, None, None


def _bwd_call(q, k, v, out, dout, lse, dlse, q_ranges, k_ranges, attn_type_map, scale, softcap, deterministic,
              k2=None, v2=None, dq_in=None, dq_f32=False, delta=None):
    """dq, dk, dv, dk2, dv2: the backward over the keys concat(k, k2) (k_ranges index them), without
    concatenating k and k2 in memory; k2, v2 None: no second source (dk2, dv2 empty). v2 None with k2: k2 is
    K and V packed [Tk2, 2, Hkv, D] (a group collective's receive buffer), and dk2 comes back packed the same
    way, dK and dV side by side (dv2 None): one buffer for the partials' return. Where v's head dim Dv is
    below D (MLA's 192 / 128), V and dV are each packed V head's first Dv columns (dk2's others unspecified).
    A backward split into calls over disjoint key sets chains dQ in float32: dq_f32=True returns dq
    unrounded in float32, plus dq_in (float32, q's shape) when given; the next call takes it as dq_in and
    adds to it in place. Not with deterministic=True. Such calls share one delta = rowsum(dout * out) - dlse
    (float32 [Tq, Hq], backward_delta): given, a call takes it instead of computing it."""
    if dq_f32 and deterministic:
        raise ValueError("dq_f32: not with deterministic=True (its dQ kernel writes q's dtype)")
    if dq_in is not None and not dq_f32:
        raise ValueError("dq_in: needs dq_f32=True (the chained sum stays in float32)")
    if dq_in is not None and (dq_in.shape != q.shape or dq_in.dtype != jnp.float32):
        raise ValueError(f"dq_in: must be float32 of q's shape {q.shape}, got {dq_in.dtype}{list(dq_in.shape)}")
    if delta is not None and (delta.shape != q.shape[:2] or delta.dtype != jnp.float32):
        raise ValueError(f"delta: must be float32 [Tq, Hq] = {list(q.shape[:2])}, got {delta.dtype}{list(delta.shape)}")
    kv2_packed = k2 is not None and v2 is None
    if k2 is not None and not kv2_packed and v.shape[-1] != k.shape[-1]:
        raise ValueError(f"k2: with v of its own head dim {v.shape[-1]}, a second key source only packed (v2 None)")
    if k2 is None:
        k2 = v2 = jnp.zeros((0, *k.shape[1:]), k.dtype)
    elif kv2_packed:
        if k2.ndim != 4 or k2.shape[1] != 2 or k2.shape[2:] != k.shape[1:]:
            raise ValueError(f"k2: packed K and V must be [Tk2, 2, {k.shape[1]}, {k.shape[2]}], got {k2.shape}")
        k2 = v2 = k2.reshape(k2.shape[0], 2 * k2.shape[2], k2.shape[3])
    has_in = dq_in is not None
    if not has_in:
        dq_in = jnp.zeros((0,), jnp.float32)
    if delta is None:
        delta = jnp.zeros((0,), jnp.float32)
    _ffi.check_kernel_env()
    dv2_shape = (0,) if kv2_packed else v2.shape
    dq, dk, dv, dk2, dv2 = _ffi.call(
        _ffi.FFA_BWD,
        (jax.ShapeDtypeStruct(q.shape, jnp.float32 if dq_f32 else q.dtype), jax.ShapeDtypeStruct(k.shape, k.dtype),
         jax.ShapeDtypeStruct(v.shape, v.dtype), jax.ShapeDtypeStruct(k2.shape, k2.dtype),
         jax.ShapeDtypeStruct(dv2_shape, v2.dtype)),
        q, k, v, out, dout.astype(q.dtype), lse, dlse.astype(jnp.float32), q_ranges, k_ranges, attn_type_map, k2,
        v2, dq_in, delta, aliases={12: 0} if has_in else None, softmax_scale=np.float32(scale),
        softcap=np.float32(softcap), deterministic=deterministic, dq_f32=dq_f32, kv2_packed=kv2_packed)
    if kv2_packed:
        return dq, dk, dv, dk2.reshape(dk2.shape[0], 2, dk2.shape[1] // 2, dk2.shape[2]), None
    return dq, dk, dv, dk2, dv2


def backward_delta(out: jax.Array, dout: jax.Array, dlse: jax.Array) -> jax.Array:
    """delta = rowsum(dout * out) - dlse (float32 [Tq, Hq]): what every backward call over the same queries
    computes first; a backward split into calls computes it once and gives it to each (_bwd_call's delta)."""
    prod = out.astype(jnp.float32) * dout.astype(jnp.float32)
    return jnp.sum(prod, axis=-1) - dlse.astype(jnp.float32)


_ffa.defvjp(_ffa_fwd, _ffa_bwd)

