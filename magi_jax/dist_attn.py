"""Distributed flexible attention over one mesh axis (DESIGN.md sections 2 and 3).

    plan = magi_jax.plan(mask, mesh, axis="cp", num_heads_q=Hq, num_heads_kv=Hkv, head_dim=D)
    q_d, k_d, v_d = (magi_jax.dispatch(x, plan) for x in (q, k, v))      # global -> dispatched, sharded
    out_d, lse_d = magi_jax.calc_attn(q_d, k_d, v_d, plan)              # jit- and grad-able
    out = magi_jax.undispatch(out_d, plan)                               # dispatched -> global
    pos = magi_jax.position_ids(plan)                                    # for RoPE on dispatched tokens

A plan closed over is a constant of the compiled step. ``plan_tables(plan, capacity)`` makes it run-time data
instead: a pytree of int32 arrays padded to a ``PlanCapacity``, passed to the jitted step as an argument, so
that the plans of every mask that fits the capacity share one compilation; it goes wherever a plan goes.

Per rank (``calc_attn_local``, the body of calc_attn's shard_map), for a plan with stages 0..n-1:

    forward   group_cast(stage i keys) for every i      -- depend on the local k, v only; K and V of a key
                                                           side by side in one buffer: one collective
              FFA(local q, local kv, host slices) -> (out, lse)
              FFA(local q, stage i receive buffer, stage i slices, prev=(out, lse)) -> (out, lse)
                  -- each stage's part lse-merged into the result so far by the kernel, in place; the
                     receive buffer read as is (K and V packed)
    backward  group_cast(stage i keys) again             -- re-fetched: residuals are q, k, v, out, lse only
              delta = rowsum(out * dout)                  -- once, shared by every call
              FFA bwd(local q, stage i receive buffer, stage i slices) -> dq (float32, chained), dkv_i
              group_reduce(dkv_i) -> back to the owners      -- under the next call
              FFA bwd(local q, local kv, host slices) -> dq, dk, dv of the local keys   -- last
              dk, dv = local rows + returned partials, summed in float32; dq stays local
    (backward="fused": one FFA bwd over the local keys and every receive buffer as a second key source,
    then all partials travel back after it, not overlapped.)

No group_cast depends on an attention call, so XLA's latency-hiding scheduler is free to run stage i's
transfer under the host or stage i-1's kernel (and the staged backward's group_reduce i under FFA bwd i+1).
A plan of overlap degree 0 fetches everything in one stage and runs one fused call over
``concat(local kv, received kv)`` in the forward too.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from magi_jax import ffa
from magi_jax.partition import typed_sharding
from magi_jax._ffi import match_varying, varying_axes
from magi_jax.comm import TRANSPORTS, accumulate_partials, group_cast, own_row, return_partials
from magi_jax.mask import AttnMask
from magi_jax.planner.plan import DistAttnPlan, PlanCapacity, make_plan
from magi_jax.run_tables import PlanSpec, PlanTables, RunTables, padded_tables, run_tables, stacked_tables


# ---------------------------------------------------------------------------------------------------------
# The plan bound to a mesh.

@dataclass(frozen=True, eq=False)
class MeshPlan:
    """A ``DistAttnPlan`` bound to the mesh whose axis ``plan.axis`` it spans (``mesh.shape[axis] ==
    plan.cp``). Hashable; attribute reads fall through to the plan (``mp.local_len``, ``mp.stats()``)."""

    plan: DistAttnPlan
    mesh: Mesh

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.plan, name)

    def __hash__(self) -> int:
        return hash((self.plan, self.mesh))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, MeshPlan) and self.plan == other.plan and self.mesh == other.mesh

    def __repr__(self) -> str:
        return f"MeshPlan({self.plan!r}, mesh axes {dict(self.mesh.shape)})"


def plan(mask: AttnMask, mesh: Mesh, axis: str = "cp", **kw) -> MeshPlan:
    """``magi_jax.planner.make_plan(mask, cp=mesh.shape[axis], axis=axis, **kw)`` bound to ``mesh``;
    cached (keyword values must be hashable). Keywords: chunk_size, solver, overlap, num_heads_q,
    num_heads_kv, head_dim, head_dim_v, cost_model, imbalance_cap."""
    if not isinstance(mesh, Mesh):
        raise TypeError(f"mesh: expected a jax.sharding.Mesh, got {type(mesh).__name__}")
    if axis not in mesh.axis_names:
        raise ValueError(f"axis: {axis!r} is not an axis of the mesh {tuple(mesh.axis_names)}")
    if "cp" in kw:
        raise ValueError("cp: taken from mesh.shape[axis]; do not pass it")
    return _bound_plan(mask, mesh, axis, tuple(sorted(kw.items())))


@functools.lru_cache(maxsize=64)
def _bound_plan(mask: AttnMask, mesh: Mesh, axis: str, kw: tuple) -> MeshPlan:
    return MeshPlan(make_plan(mask, int(mesh.shape[axis]), axis=axis, **dict(kw)), mesh)


def _split(plan_like, mesh: Mesh | None) -> tuple[DistAttnPlan | PlanTables, Mesh | None]:
    if isinstance(plan_like, MeshPlan):
        return plan_like.plan, mesh or plan_like.mesh
    if isinstance(plan_like, PlanTables):
        return plan_like, mesh or plan_like.spec.mesh
    if isinstance(plan_like, DistAttnPlan):
        return plan_like, mesh
    raise TypeError("plan: expected a magi_jax.plan(...), magi_jax.plan_tables(...) or DistAttnPlan, got "
                    f"{type(plan_like).__name__}")


def _need_mesh(p: DistAttnPlan, mesh: Mesh | None, what: str) -> Mesh:
    if mesh is None:
        raise ValueError(f"{what}: the plan has no mesh; build it with magi_jax.plan(mask, mesh, ...) or "
                         "pass mesh=")
    if p.axis not in mesh.axis_names or mesh.shape[p.axis] != p.cp:
        raise ValueError(f"{what}: the plan spans {p.cp} ranks of axis {p.axis!r}, but the mesh has "
                         f"{dict(mesh.shape)}")
    return mesh


# ---------------------------------------------------------------------------------------------------------
# Sharding specs: the token axis over plan.axis, leading batch over the other axes, heads optionally.

def _as_tuple(axes) -> tuple[str, ...]:
    if axes is None:
        return ()
    return (axes,) if isinstance(axes, str) else tuple(axes)


def _batch_entry(mesh: Mesh, p: DistAttnPlan, batch: int, batch_axes, head_axes) -> Any:
    """The spec entry of one leading batch dim: ``batch_axes`` as given, or "auto": every other mesh axis
    (not the plan's, not the heads') when their product divides the batch, else replicated."""
    if batch_axes != "auto":
        return batch_axes
    axes = tuple(a for a in mesh.axis_names if a != p.axis and a not in _as_tuple(head_axes)
                 and mesh.shape[a] > 1)
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or batch % size:
        return None
    return axes[0] if len(axes) == 1 else axes


def _spec(mesh: Mesh, p: DistAttnPlan, shape: tuple, seq_dim: int, batch_axes, head_axes=None,
          head_dim: int | None = None) -> P:
    entries: list[Any] = [None] * len(shape)
    entries[seq_dim] = p.axis
    if seq_dim == 1:
        entries[0] = _batch_entry(mesh, p, shape[0], batch_axes, head_axes)
    elif seq_dim > 1 and batch_axes not in ("auto", None):
        raise ValueError(f"batch_axes: only one leading batch dim is supported, got {seq_dim}")
    if head_dim is not None and head_axes is not None:
        entries[head_dim] = head_axes
    return P(*entries)


# ---------------------------------------------------------------------------------------------------------
# dispatch / undispatch / position_ids: the plan's permutation, each the other's transpose.

def _whole_tokens(x, seq_dim: int):
    """x with Explicit axes: its token dim gathered whole (the other dims keep their sharding), as Auto axes
    do implicitly before a gather along it; otherwise x."""
    sharding = typed_sharding(x)
    if sharding is not None:
        spec = list(sharding.spec) + [None] * (x.ndim - len(sharding.spec))
        if spec[seq_dim] is not None:
            spec[seq_dim] = None
            x = jax.sharding.reshard(x, NamedSharding(sharding.mesh, P(*spec)))
    return x


def _take(x, index, seq_dim: int):
    """jnp.take along seq_dim (index static or traced), the token dim whole first (_whole_tokens)."""
    return jnp.take(_whole_tokens(x, seq_dim), jnp.asarray(index), axis=seq_dim)


def _pad_tokens(x, padded_len: int, seq_dim: int):
    pad = [(0, 0)] * x.ndim
    pad[seq_dim] = (0, padded_len - x.shape[seq_dim])
    return jnp.pad(x, pad)


def _pad_take(x, take, padded_len: int, seq_dim: int):
    return _take(_pad_tokens(x, padded_len, seq_dim), take, seq_dim)


# dispatch: x padded to padded_len, then taken at `take` (position_ids); undispatch: taken at `back`
# (undispatch_perm). The permutations' gradients are each other (a gather, not the scatter-add autodiff would
# make: with Explicit mesh axes that scatter's output sharding is ambiguous once a batch dim is sharded, and
# jax refuses it); the index arrays are arguments (static plans: constants; PlanTables: traced) with no
# gradient. `like`: the primal's sharding where its mesh axes are Explicit (its cotangent must carry it), else
# None.
@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _dispatch(x, take, back, padded_len, seq_dim, like):
    return _pad_take(x, take, padded_len, seq_dim)


_dispatch.defvjp(lambda x, take, back, n, d, like: (_pad_take(x, take, n, d), (take, back)),
                 lambda n, d, like, res, g: (_like(_take(g, res[1], d), like), None, None))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _undispatch(x, take, back, padded_len, seq_dim, like):
    return _take(x, back, seq_dim)


_undispatch.defvjp(lambda x, take, back, n, d, like: (_take(x, back, d), (take, back)),
                   lambda n, d, like, res, g: (_like(_pad_take(g, res[0], n, d), like), None, None))


def _like(x, sharding):
    return x if sharding is None else jax.sharding.reshard(x, sharding)


def _check_seq(name: str, x, seq_dim: int, expect: int, what: str) -> int:
    if not -x.ndim <= seq_dim < x.ndim:
        raise ValueError(f"seq_dim: {seq_dim} out of range for {name} of rank {x.ndim}")
    seq_dim %= x.ndim
    if x.shape[seq_dim] != expect:
        raise ValueError(f"{name}: has {x.shape[seq_dim]} tokens along dim {seq_dim}, expected {expect} ({what})")
    return seq_dim


def _place(x, mesh: Mesh, spec: P):
    """x laid out as ``spec`` on ``mesh``: ``reshard`` where the mesh's axes are Explicit (jax.make_mesh's
    default), a sharding constraint where they are Auto."""
    sharding = NamedSharding(mesh, spec)
    explicit = getattr(jax.sharding.AxisType, "Explicit", None)
    if explicit is not None and explicit in tuple(getattr(mesh, "axis_types", ())):
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def _constrain(x, mesh: Mesh | None, p: DistAttnPlan, seq_dim: int, batch_axes):
    if mesh is None:
        return x
    _need_mesh(p, mesh, "dispatch")
    return _place(x, mesh, _spec(mesh, p, x.shape, seq_dim, batch_axes))


def dispatch(x: jax.Array, plan: MeshPlan | DistAttnPlan | PlanTables, *, seq_dim: int = 0, mesh: Mesh | None = None,
             batch_axes="auto") -> jax.Array:
    """Global array (``plan.seqlen`` tokens along ``seq_dim``) -> dispatched order (``padded_seqlen``
    tokens: rank 0's local buffer, then rank 1's, ...; padding zero), sharded over the plan's axis (a
    leading batch dim, if any, over the other mesh axes: see ``calc_attn``). Any dtype; jit-able;
    differentiable (its transpose is undispatch). On devices this is a global permutation (XLA gathers the
    token axis first); a data loader can instead dispatch on the host: ``x_pad[plan.position_ids()]``."""
    p, mesh = _split(plan, mesh)
    x = jnp.asarray(x)
    seq_dim = _check_seq("x", x, seq_dim, p.seqlen, "the plan's seqlen")
    take, back = p.position_ids(), p.undispatch_perm
    if _batched(p, x, seq_dim):
        return _constrain(_take_each(_pad_tokens(x, p.padded_seqlen, 1), take), mesh, p, seq_dim, batch_axes)
    y = _dispatch(x, take, back, p.padded_seqlen, seq_dim, typed_sharding(x))
    return _constrain(y, mesh, p, seq_dim, batch_axes)


def _batched(p, x, seq_dim: int) -> bool:
    """Whether p is batched PlanTables (then x must be [B, T, ...] with the tables' B)."""
    batch = getattr(getattr(p, "spec", None), "batch", None)
    if batch is None:
        return False
    if seq_dim != 1 or x.shape[0] != batch:
        raise ValueError(f"x: batched plan tables of {batch} plans need x [{batch}, T, ...] with seq_dim=1, got "
                         f"shape {x.shape}, seq_dim={seq_dim}")
    return True


def _take_each(x, index):
    """x [B, T, ...] taken along its tokens by batch element's own index [B, n] (autodiff's transpose: a
    scatter-add). The token dim is gathered whole first, as _take does."""
    x, index = _whole_tokens(x, 1), jnp.asarray(index)
    sharding = typed_sharding(x)
    if sharding is not None:   # vmap needs the index's batch dim sharded as x's
        spec = P((tuple(sharding.spec) + (None,))[0], None)
        if isinstance(x, jax.core.Tracer):
            index = jax.sharding.reshard(index, NamedSharding(sharding.mesh, spec))
        else:   # eager: placed on x's devices (reshard needs a mesh context, jax.set_mesh, outside jit)
            index = jax.device_put(index, NamedSharding(x.sharding.mesh, spec))
    return jax.vmap(lambda xb, ib: jnp.take(xb, ib, axis=0))(x, index)


def undispatch(x: jax.Array, plan: MeshPlan | DistAttnPlan | PlanTables, *, seq_dim: int = 0, mesh: Mesh | None = None
               ) -> jax.Array:
    """Dispatched array (``padded_seqlen`` tokens along ``seq_dim``) -> global order (``seqlen`` tokens,
    padding dropped). The inverse of dispatch, and its transpose."""
    p, mesh = _split(plan, mesh)
    x = jnp.asarray(x)
    seq_dim = _check_seq("x", x, seq_dim, p.padded_seqlen, "the plan's padded_seqlen")
    if _batched(p, x, seq_dim):
        return _take_each(x, p.undispatch_perm)
    return _undispatch(x, p.position_ids(), p.undispatch_perm, p.padded_seqlen, seq_dim, typed_sharding(x))


def position_ids(plan: MeshPlan | DistAttnPlan | PlanTables, *, mesh: Mesh | None = None) -> jax.Array:
    """int32 [padded_seqlen] (batched PlanTables: [B, padded_seqlen]): the global position of every
    dispatched token (padding: seqlen and up), sharded like dispatched arrays when the plan has a mesh. Use
    for RoPE on dispatched q, k."""
    p, mesh = _split(plan, mesh)
    ids = jnp.asarray(p.position_ids())
    if mesh is None:
        return ids
    spec = _spec(mesh, p, ids.shape, 1, "auto") if ids.ndim == 2 else P(p.axis)   # batched: [B, T]
    sharding = NamedSharding(_need_mesh(p, mesh, "position_ids"), spec)
    return _place(ids, mesh, sharding.spec) if isinstance(ids, jax.core.Tracer) else jax.device_put(ids, sharding)


# ---------------------------------------------------------------------------------------------------------
# Plans as run-time data (magi_jax/run_tables.py).

def plan_tables(plan: MeshPlan | DistAttnPlan | Sequence[MeshPlan | DistAttnPlan], capacity: PlanCapacity
                ) -> PlanTables:
    """``plan``'s tables padded to ``capacity`` (ValueError naming the field it exceeds), for passing to a
    jitted step as an argument. The transport is all_to_all. A list of plans (one mask per batch element,
    the same sequence length, mesh and overlap degree) gives batched tables, stacked along a new first dim."""
    if not isinstance(capacity, PlanCapacity):
        raise TypeError(f"capacity: expected a PlanCapacity, got {type(capacity).__name__}")
    if isinstance(plan, (list, tuple)):
        if not plan:
            raise ValueError("plan: an empty list")
        return stacked_tables([plan_tables(x, capacity) for x in plan])
    p, mesh = _split(plan, None)
    if isinstance(p, PlanTables):
        raise TypeError("plan: already PlanTables")
    return padded_tables(p, mesh, capacity)


# ---------------------------------------------------------------------------------------------------------
# The per-rank computation.

@dataclass(frozen=True)
class _Config:
    axis: str
    fused: bool      # overlap degree 0: fetch everything, then one call each way
    scale: float
    softcap: float
    deterministic: bool
    wire_dtype: str | None
    backward: str
    sm_margin: int
    max_logit: bool  # the forward also gives each row's largest logit (return_max_logit)


def _rows(slices, axis: str):
    return tuple(own_row(a, axis) for a in slices)


def _fwd_call(cfg, q, k, v, slices, beside_transfer=False, prev=None, head_dim_v=None):
    """beside_transfer: a group_cast may run during this call, so the persistent grid leaves it SMs.
    prev: the (out, lse, ...) of the calls before, out and lse merged in by the kernel, the rows' largest
    logits (cfg.max_logit) here. v None: k is a receive buffer, K and V packed [n, 2, Hkv, D], V the first
    head_dim_v columns of its heads."""
    outs = ffa._fwd_call(q, k, v, *_rows(slices, cfg.axis), cfg.scale, cfg.softcap,
                         cfg.sm_margin if beside_transfer else 0, None if prev is None else prev[:2], head_dim_v,
                         cfg.max_logit)
    if prev is not None and cfg.max_logit:
        outs = (*outs[:2], jnp.maximum(prev[2], outs[2]))
    return outs


def _bwd_call(cfg, q, k, v, out, dout, lse, dlse, slices, kv2=None, **dq_chain):
    """dq, dk, dv, and with a second key source kv2 (a receive buffer, K and V packed; keys concat(k, kv2),
    not concatenated) its gradients dkv2, packed the same way; dq_chain: ffa._bwd_call's dq_in, dq_f32, delta."""
    grads = ffa._bwd_call(q, k, v, out, dout, lse, dlse, *_rows(slices, cfg.axis), cfg.scale, cfg.softcap,
                          cfg.deterministic, kv2, None, **dq_chain)
    return grads[:4] if kv2 is not None else grads[:3]


def _fetch(k, v, tabs: RunTables, cfg: _Config) -> list:
    """Every stage's receive buffer, K and V packed [buffer_len, 2, Hkv, D]: one collective per stage. A v
    narrower than k (MLA's 128 beside 192) travels zero-padded to D; the kernels read its first columns."""
    v = ffa.pad_last_axis(v, k.shape[-1])
    return [group_cast((k, v), st.tables, cfg.axis, packed=True)[0] for st in tabs.stages]


def _forward(q, k, v, tabs: RunTables, cfg: _Config):
    recv = _fetch(k, v, tabs, cfg)
    if cfg.fused and recv:
        return _fwd_call(cfg, q, *_concat_kv(k, v, recv), tabs.fused)
    # The host call runs under the transfers; stage i's under those of the stages after it. Each stage call
    # merges its part into the out and lse so far, in place (no merge pass over all parts after them).
    last = len(recv) - 1
    out = _fwd_call(cfg, q, k, v, tabs.host, beside_transfer=bool(recv))
    for i, (st, kv) in enumerate(zip(tabs.stages, recv)):
        out = _fwd_call(cfg, q, kv, None, st.slices, beside_transfer=i < last, prev=out, head_dim_v=v.shape[-1])
    return out


def _concat_kv(k, v, recv):
    dv = v.shape[-1]
    return (jnp.concatenate([k, *(kv[:, 0] for kv in recv)]),
            jnp.concatenate([v, *(kv[:, 1, ..., :dv] for kv in recv)]))


def _backward(cfg: _Config, res, cts):
    q, k, v = res[:3]
    grads = _backward_body(cfg, res, cts[:2])  # the rows' largest logits, if any, take no gradient
    return (*(match_varying((g,), x)[0] for g, x in zip(grads, (q, k, v))), None)


def _add_partials(backs, tables, axis, local):
    """local (dK, dV of the local keys, the kernel's dtype) plus every stage's returned partials (dK and dV
    packed side by side), summed in float32 and rounded once. One stage whose partials travel in the
    kernel's dtype: added in place, touching only the rows that were sent; otherwise through a float32
    accumulator. A dV narrower than dK is summed padded as it travels and cut after (the kernels leave
    the padding of the partials unspecified: it only ever lands in the columns cut)."""
    dtype, dv_dim = local[0].dtype, local[1].shape[-1]
    local = (local[0], ffa.pad_last_axis(local[1], local[0].shape[-1]))
    if len(backs) == 1 and backs[0][0].dtype == dtype:
        dk, dv = accumulate_partials(backs[0], tables[0], axis, init=local, packed=True)
    else:
        acc = None
        for back, t in zip(backs, tables):
            acc = accumulate_partials(back, t, axis, local[0].shape[0], jnp.float32, init=acc, packed=True)
        dk, dv = ((a + x.astype(jnp.float32)).astype(dtype) for a, x in zip(acc, local))
    return dk, ffa.drop_head_dim_padding(dv, dv_dim)


def _backward_body(cfg: _Config, res, cts):
    q, k, v, tabs, out, lse = res
    dout, dlse = cts
    dout, dlse = dout.astype(q.dtype), dlse.astype(jnp.float32)
    axis = cfg.axis
    wire = cfg.wire_dtype and jnp.dtype(cfg.wire_dtype)
    if not tabs.stages:
        return _bwd_call(cfg, q, k, v, out, dout, lse, dlse, tabs.host)
    # The re-fetch is the forward's group_cast again: in one jitted module XLA merges the two, so the
    # forward's receive buffers are reused rather than fetched twice. The kernels read them packed as they
    # are and return their dK and dV packed the same way: one collective per stage each way.
    recv = _fetch(k, v, tabs, cfg)
    tables = [st.tables for st in tabs.stages]
    if cfg.backward == "fused" or cfg.fused:
        # One call over concat(local, every receive buffer): one preprocess, one dQ accumulator and one
        # kernel tail instead of one per stage; the partials then travel back (not overlapped). The local
        # keys and the received ones are the call's two key sources: neither is copied into a concatenation,
        # and the local gradients are a buffer of their own (the partials add into it in place).
        # dQ comes back unrounded (float32) and is rounded here, by XLA, which can then round it while the
        # partials travel instead of before (inside the call, the rounding delayed the collective's start).
        kv2 = recv[0] if len(recv) == 1 else jnp.concatenate(recv)
        chain = {} if cfg.deterministic else dict(dq_f32=True)
        dq, dk_local, dv_local, dkv2 = _bwd_call(cfg, q, k, v, out, dout, lse, dlse, tabs.fused, kv2, **chain)
        ends = np.cumsum([0] + [t.buffer_len for t in tables])
        backs = [return_partials((dkv2[a:b],), t, axis, wire) for t, a, b in zip(tables, ends[:-1], ends[1:])]
        dk, dv = _add_partials(backs, tables, axis, (dk_local, dv_local))
        return dq.astype(q.dtype), dk, dv
    # Staged: stages first, the host call last: stage i's partials travel back under stage i+1's call,
    # the last ones under the host call. dQ: one float32 accumulator passed from call to call and rounded
    # once (deterministic: each call's own dQ, summed here, since that kernel writes q's dtype). A stage
    # call's keys are its receive buffer alone: the second source of a call with no first one.
    # Every call shares one delta (computed once here, not by each call's pass over out and dout).
    none_k, none_v = jnp.zeros((0, *k.shape[1:]), k.dtype), jnp.zeros((0, *v.shape[1:]), v.dtype)
    delta = ffa.backward_delta(out, dout, dlse)

    def call(slices, dq, kv=None):
        """One staged call over the local keys, or over the receive buffer kv: (dq so far plus this call's,
        in float32) and the key gradients: (dk, dv) of the local keys, or (dkv,) packed."""
        kk, vv = (k, v) if kv is None else (none_k, none_v)
        chain = dict(delta=delta) if cfg.deterministic else dict(dq_in=dq, dq_f32=True, delta=delta)
        dq_i, dk_i, dv_i, *dkv = _bwd_call(cfg, q, kk, vv, out, dout, lse, dlse, slices, kv, **chain)
        if cfg.deterministic:
            dq_i = dq_i.astype(jnp.float32) if dq is None else dq + dq_i.astype(jnp.float32)
        return dq_i, (tuple(dkv) if kv is not None else (dk_i, dv_i))

    dq, backs = None, []
    for st, kv in zip(tabs.stages, recv):
        dq, dkv = call(st.slices, dq, kv)
        backs.append(return_partials(dkv, st.tables, axis, wire))
    dq, local = call(tabs.host, dq)
    dk, dv = _add_partials(backs, tables, axis, local)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


# The tables are an argument (no gradient): constants for a static plan, traced for PlanTables.
@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attn(q, k, v, tabs, cfg):
    return _forward(q, k, v, tabs, cfg)


def _attn_fwd(q, k, v, tabs, cfg):
    out, lse, *max_logit = _forward(q, k, v, tabs, cfg)
    out, lse = ffa.named_for_checkpoint(out, lse)
    return (out, lse, *max_logit), (q, k, v, tabs, out, lse)


_attn.defvjp(_attn_fwd, _backward)


BACKWARDS = ("staged", "fused")
# SMs the forward calls beside a group_cast leave out of their persistent grid. 0: the collective's kernel,
# launched first, holds its SMs while it runs and the forward's CTAs there join when it ends, taking the next
# tile in line; on 2 H200s 0.7% faster forward+backward than 8 and 0.3% than 4 (BENCHMARKS.md 2026-11-30 10:25).
SM_MARGIN = 0


# What the backward's dK/dV partials may travel as (summed in float32 on arrival).
WIRE_DTYPES = ("bfloat16", "float16", "float32")


def _config(p: DistAttnPlan | PlanTables, head_dim: int, softmax_scale, softcap, deterministic, transport,
            wire_dtype, backward, sm_margin, max_logit) -> _Config:
    if transport not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {transport!r}")
    if isinstance(p, PlanTables) and transport == "ppermute":
        raise ValueError("transport: PlanTables move keys with all_to_all; got 'ppermute'")
    if backward not in BACKWARDS:
        raise ValueError(f"backward: expected one of {BACKWARDS}, got {backward!r}")
    scale, cap = ffa.check_scale_and_softcap(softmax_scale, softcap, head_dim)
    wire = None if wire_dtype is None else _wire_dtype(wire_dtype)
    return _Config(p.axis, p.overlap_degree == 0, scale, cap, ffa.check_flag("deterministic", deterministic),
                   wire, backward, ffa.check_sm_margin(sm_margin), ffa.check_flag("return_max_logit", max_logit))


def _wire_dtype(dtype) -> str:
    try:
        name = jnp.dtype(dtype).name
    except TypeError:
        name = None
    if name not in WIRE_DTYPES:
        raise ValueError(f"reduce_wire_dtype: expected one of {WIRE_DTYPES} (or None), got {dtype!r}")
    return name


def calc_attn_local(q: jax.Array, k: jax.Array, v: jax.Array, plan: MeshPlan | DistAttnPlan | PlanTables, *,
                    softmax_scale: float | None = None, softcap: float = 0.0, deterministic: bool = False,
                    transport: str = "auto", reduce_wire_dtype=None, backward: str = "staged",
                    sm_margin: int = SM_MARGIN, return_max_logit: bool = False
                    ) -> tuple[jax.Array, ...]:
    """calc_attn's per-rank body, for callers inside their own shard_map over (at least) the plan's axis.

    q [L, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv]: this rank's local buffers (L = plan.local_len), or with one
    leading batch dim [B, L, ...] (every batch element has the plan's mask). Head dims as flex_flash_attn's
    (MLA's v 128 beside q 192 computed at 128, padded only on the wire). Returns out [.., L, Hq, Dv] in q's
    dtype and lse [.., L, Hq] float32. Options: ``transport`` of the group collectives ("auto", "all_to_all",
    "ppermute"); ``reduce_wire_dtype``: dtype of dK/dV partials on the wire in the backward (default: the
    kernel's output dtype, i.e. q's; the sum is always float32); ``backward``: "staged" (default: one FFA
    backward call per stage and the local keys' call last, each stage's partials travelling back under the
    next call; the calls share one delta, dQ summed in place in one float32 buffer) or "fused" (one call
    over the local and all fetched keys, then the partials travel back, not overlapped; 1-2% slower
    forward+backward on 2 H200s, BENCHMARKS.md 2026-11-30 08:23); ``sm_margin``: SMs that the forward calls
    running beside a group_cast leave free for it (flex_flash_attn's sm_margin; default 0: the collective,
    launched first, keeps its SMs and the call's CTAs there join later); ``return_max_logit``: a third
    result, max_logit [.., Hq] float32, per q head the largest logit over the whole sequence's mask (the
    ranks' maxima joined over the plan's axis), as flex_flash_attn's; the rest as flex_flash_attn.
    A plan with cp == 1 also runs outside any shard_map. ``plan`` may be PlanTables (plan_tables), whose
    arrays the caller passes into its shard_map replicated or split over the plan's axis (each rank its own
    row of every table, as calc_attn does)."""
    p, _ = _split(plan, None)
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim not in (3, 4):
            raise ValueError(f"{name}: expected [L, H, D] or [B, L, H, D], got shape {x.shape}")
        if x.shape[-3] != p.local_len:
            raise ValueError(f"{name}: has {x.shape[-3]} local tokens, the plan's local_len is {p.local_len}")
    if not q.ndim == k.ndim == v.ndim or q.shape[:-3] != k.shape[:-3]:
        raise ValueError(f"q, k, v: batch dims differ: {q.shape}, {k.shape}, {v.shape}")
    ffa.check_qkv(q.reshape(-1, *q.shape[-2:]), k.reshape(-1, *k.shape[-2:]), v.reshape(-1, *v.shape[-2:]))
    cfg = _config(p, q.shape[-1], softmax_scale, softcap, deterministic, transport, reduce_wire_dtype,
                  backward, sm_margin, return_max_logit)
    q, scale = ffa.positive_scale(q, cfg.scale)
    cfg = replace(cfg, scale=scale)
    tabs = p.run if isinstance(p, PlanTables) else run_tables(p, transport)
    batched = isinstance(p, PlanTables) and p.spec.batch is not None
    if batched and (q.ndim != 4 or q.shape[0] != jax.tree.leaves(tabs)[0].shape[0]):
        raise ValueError(f"q: batched plan tables of {jax.tree.leaves(tabs)[0].shape[0]} here need q [B, L, H, D] "
                         f"with that B, got shape {q.shape}")
    head_dim_v = v.shape[-1]
    # Before the collectives; v at the kernels' own head dim for it (MLA's 128 beside 192: _fetch pads it
    # only for the wire, where K and V travel packed).
    q, k, v = ffa.pad_head_dims(q, k, v, cfg.deterministic, v_apart=True)
    if q.ndim == 3:
        out, lse, *rows = _attn(q, k, v, tabs, cfg)
    else:
        pick = (lambda b: jax.tree.map(lambda a: a[b], tabs)) if batched else (lambda b: tabs)
        outs = [_attn(q[b], k[b], v[b], pick(b), cfg) for b in range(q.shape[0])]
        out, lse, *rows = (jnp.stack(x) for x in zip(*outs))
    if not cfg.max_logit:
        return ffa.drop_head_dim_padding(out, head_dim_v), lse
    max_logit = jax.lax.stop_gradient(jnp.max(rows[0], axis=-2))  # not differentiable (pmax has no rule)
    if p.axis in varying_axes(max_logit):   # inside a shard_map over the axis (cp 1 may run outside one)
        max_logit = jax.lax.pmax(max_logit, p.axis)
    return ffa.drop_head_dim_padding(out, head_dim_v), lse, max_logit


def calc_attn(q: jax.Array, k: jax.Array, v: jax.Array, plan: MeshPlan | DistAttnPlan | PlanTables, *,
              mesh: Mesh | None = None, batch_axes="auto", head_axes=None, **options
              ) -> tuple[jax.Array, ...]:
    """Attention of dispatched q [T, Hq, D] over dispatched k [T, Hkv, D], v [T, Hkv, Dv] (T =
    plan.padded_seqlen) with the plan's mask; returns dispatched out [T, Hq, Dv] and lse [T, Hq] (float32).
    jit- and grad-able.

    A shard_map over the plan's mesh axis; the other mesh axes pass through: a leading batch dim
    [B, T, H, D] is split over ``batch_axes`` ("auto": every other mesh axis whose sizes divide B, else
    replicated), and heads over ``head_axes`` (e.g. "tp" for tensor parallel heads; by default the axes that
    split q's heads in its type where the mesh axes are Explicit and the kv heads divide by them, else
    replicated: with Auto axes give them).
    ``options`` go to calc_attn_local (softmax_scale, softcap, deterministic, transport,
    reduce_wire_dtype, backward, sm_margin, return_max_logit: then a third result, max_logit [.., Hq]).
    Under jax.checkpoint, out and lse are saveable by name (magi_jax.CHECKPOINT_NAMES): the backward pass
    then does not run the attention forward again."""
    p, mesh = _split(plan, mesh)
    mesh = _need_mesh(p, mesh, "calc_attn")
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim not in (3, 4):
            raise ValueError(f"{name}: expected [T, H, D] or [B, T, H, D], got shape {x.shape}")
        _check_seq(name, x, x.ndim - 3, p.padded_seqlen, "the plan's padded_seqlen: dispatch it first")
    seq_dim = q.ndim - 3
    if head_axes is None:
        head_axes = _typed_head_axes(q, k, mesh, p.axis)
    spec = _spec(mesh, p, q.shape, seq_dim, batch_axes, head_axes, seq_dim + 1)
    lse_spec = P(*tuple(spec)[:-1])
    out_specs = (spec, lse_spec)
    if options.get("return_max_logit", False):   # [.., Hq]: the same on every rank of the plan's axis
        out_specs += (P(*tuple(spec)[:seq_dim], tuple(spec)[seq_dim + 1]),)
    # Explicit mesh axes: q, k, v come as dispatch left them (heads whole, the batch as its batch_axes chose);
    # shard_map takes them only in its in_specs, so they are resharded here (Auto axes do this implicitly).
    q, k, v = (_place(x, mesh, spec) if typed_sharding(x) is not None else x for x in (q, k, v))
    if isinstance(p, PlanTables):   # every rank receives its own rows of the tables (comm.own_row)
        table_spec = P(p.axis)
        if p.spec.batch is not None:    # batched: the batch dim split like q's
            if q.ndim != 4 or q.shape[0] != p.spec.batch:
                raise ValueError(f"q: batched plan tables of {p.spec.batch} plans need q [{p.spec.batch}, T, H, D], "
                                 f"got shape {q.shape}")
            table_spec = P(spec[0], p.axis)
        run = jax.tree.map(lambda a: _place(jnp.asarray(a), mesh, table_spec), p.run)   # Explicit axes: resharded
        body = functools.partial(_local_with_tables, spec=p.spec, options=options)
        return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec, table_spec),
                             out_specs=out_specs)(q, k, v, run)
    body = functools.partial(calc_attn_local, plan=p, **options)
    return jax.shard_map(body, mesh=mesh, in_specs=(spec, spec, spec), out_specs=out_specs)(q, k, v)


def _typed_head_axes(q, k, mesh: Mesh, plan_axis: str):
    """The mesh axes that split q's heads in its type (Explicit axes: q from a tensor-parallel projection),
    kept when they also divide the kv heads and are not the plan's; else None (heads whole)."""
    sharding = typed_sharding(q)
    if sharding is None:
        return None
    spec = tuple(sharding.spec) + (None,) * (q.ndim - len(sharding.spec))
    axes = _as_tuple(spec[-2])
    size = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if not axes or plan_axis in axes or k.shape[-2] % size:
        return None
    return spec[-2]


def _local_with_tables(q, k, v, run: RunTables, spec: PlanSpec, options: dict):
    return calc_attn_local(q, k, v, PlanTables(spec, run, None, None), **options)


__all__ = ["MeshPlan", "plan", "dispatch", "undispatch", "position_ids", "calc_attn", "calc_attn_local",
           "plan_tables", "BACKWARDS"]
