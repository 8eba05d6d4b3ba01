"""Shared test helpers: the tolerance rule of DESIGN.md section 5, random inputs, the gpu marker."""

from __future__ import annotations

import os

# Set before jax starts its backends. Eight host devices for the shard_map and distributed tests. On a GPU, no
# autotuning of XLA's own GEMMs (the references' and the glue's; the FFA kernels are custom calls): under 8 test
# workers on one GPU it tripled the GPU files' time (206 tests of test_ffa_gpu.py: ~400 s -> 120 s on an H100).
for flag in ("--xla_force_host_platform_device_count=8", "--xla_gpu_autotune_level=0"):
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from magi_jax.mask import AttnMask
from magi_jax.reference import attention_dense, attention_f64, error_and_bound, max_logit_dense, max_logit_f64


def has_gpu() -> bool:
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    if has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_qkv(rng: np.random.Generator, tq: int, tk: int, hq: int, hkv: int, d: int, dtype=jnp.float32):
    """Fresh normal inputs in the given dtype (never zeros or ones)."""
    shapes = ((tq, hq, d), (tk, hkv, d), (tk, hkv, d))
    return tuple(jnp.asarray(rng.standard_normal(s).astype(np.float32)).astype(dtype) for s in shapes)


def fill_free_memory(value, nbytes=1 << 30):
    """Leaves `value` in memory XLA's allocator is likely to hand out next (outputs are never zeroed): a GPU
    test's poison, so that an element a kernel fails to write shows."""
    x = jnp.full((nbytes // 4,), value, jnp.float32)
    x.block_until_ready()
    x.delete()


def stacked_slices(per_sequence, range_fill: int = 0) -> list[np.ndarray]:
    """One mask per sequence as flex_flash_attn's batched slices: q_ranges, k_ranges [B, N, 2] and types [B, N],
    each mask padded to the most slices with empty ones ([range_fill, range_fill), FULL) at its end."""
    n = max(m.num_slices for m in per_sequence)
    pad = lambda a, fill: np.concatenate([a, np.full((n - a.shape[0], *a.shape[1:]), fill, a.dtype)])
    return [np.stack([pad(np.asarray(m.kernel_args()[i]), fill) for m in per_sequence])
            for i, fill in ((0, range_fill), (1, range_fill), (2, 0))]


def assert_within_rule(name: str, got, ref64, ref_lp) -> None:
    """The tolerance rule (magi_jax.reference.error_and_bound), no NaN, and -inf exactly where expected."""
    got64 = np.asarray(got, np.float64)
    assert not np.isnan(got64).any(), f"{name}: NaN in result"
    np.testing.assert_array_equal(np.isneginf(got64), np.isneginf(np.asarray(ref64)),
                                  err_msg=f"{name}: -inf (empty rows) misplaced")
    err, bound = error_and_bound(got, ref64, ref_lp)
    assert err <= bound, f"{name}: error {err:.3e} exceeds the bound {bound:.3e}"


def check_max_logit(attend, mask: AttnMask, q, k, softmax_scale=None, softcap: float = 0.0) -> jax.Array:
    """attend(return_max_logit) -> that call's results (flex_flash_attn or calc_attn on q, k and their v):
    max_logit [Hq] float32 against float64 by the tolerance rule, and out and lse bitwise those of the call
    without it. Returns that max_logit."""
    out, lse, got = attend(True)
    assert got.shape == (q.shape[1],) and got.dtype == jnp.float32
    assert_within_rule("max_logit", got, max_logit_f64(q, k, mask, softmax_scale, softcap),
                       max_logit_dense(q, k, mask.to_dense(), softmax_scale, softcap))
    for name, a, b in zip(("out", "lse"), (out, lse), attend(False)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=name)
    return got


def check_against_reference(attn_fn, mask: AttnMask, q, k, v, rng: np.random.Generator,
                            softmax_scale=None, softcap: float = 0.0, grads: bool = True) -> None:
    """Runs attn_fn(q, k, v) -> (out, lse) and its vjp, and checks all against the float64 reference."""
    (out, lse), vjp = jax.vjp(attn_fn, q, k, v)
    dout = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32)).astype(out.dtype)
    dlse = jnp.asarray(rng.standard_normal(lse.shape).astype(np.float32))
    ref = attention_f64(q, k, v, mask, softmax_scale, softcap, dout=dout, dlse=dlse)
    counts = mask.to_dense()
    lp_fn = lambda q, k, v: attention_dense(q, k, v, counts, softmax_scale, softcap)
    (lp_out, lp_lse), lp_vjp = jax.vjp(lp_fn, q, k, v)
    assert_within_rule("out", out, ref[0], lp_out)
    assert_within_rule("lse", lse, ref[1], lp_lse)
    if grads:
        got = vjp((dout, dlse))
        lp = lp_vjp((dout, dlse))
        for name, g, r, l in zip(("dq", "dk", "dv"), got, ref[2:], lp):
            assert_within_rule(name, g, r, l)


def _kernel_args(mask: AttnMask, q):
    """The mask's kernel arguments (q_ranges, k_ranges, types) and the default softmax scale."""
    return tuple(jnp.asarray(a) for a in mask.kernel_args()), q.shape[-1] ** -0.5


def _two_forward_calls(q, k, v, args, scale, cut: int, kv=None):
    """The distributed forward's two calls: slices [:cut] on k, v, then slices [cut:] merging into that
    call's out and lse (ffa._fwd_call's prev); kv given: the second call reads K and V packed from it (V the
    first v.shape[-1] columns of its heads)."""
    from magi_jax import ffa
    qr, kr, types = args
    first = ffa._fwd_call(q, k, v, qr[:cut], kr[:cut], types[:cut], scale, 0.0)
    if kv is None:
        return ffa._fwd_call(q, k, v, qr[cut:], kr[cut:], types[cut:], scale, 0.0, prev=first)
    return ffa._fwd_call(q, kv, None, qr[cut:], kr[cut:], types[cut:], scale, 0.0, prev=first,
                         head_dim_v=v.shape[-1])


def _packed(k, v):
    """K and V side by side per row, [T, 2, Hkv, D], as a group collective's receive buffer holds them (a v
    narrower than k zero-padded to D, as the distributed layer sends it)."""
    from magi_jax import ffa
    return jnp.stack([k, ffa.pad_last_axis(v, k.shape[-1])], axis=1)


def _backward_inputs(mask: AttnMask, q, k, v, seed: int):
    """The mask's kernel arguments, the softmax scale, and a backward's inputs: the forward's out and lse,
    fresh random cotangents dout, dlse."""
    from magi_jax import ffa
    (qr, kr, types), scale = _kernel_args(mask, q)
    out, lse = ffa._fwd_call(q, k, v, qr, kr, types, scale, 0.0)
    rng = np.random.default_rng(seed)
    dout = jnp.asarray(rng.standard_normal(out.shape).astype(np.float32)).astype(q.dtype)
    dlse = jnp.asarray(rng.standard_normal(lse.shape).astype(np.float32))
    return (qr, kr, types), scale, (out, dout, lse, dlse)


def split_key_grads(mask: AttnMask, q, k, v, split: int, deterministic: bool = False, packed: bool = False):
    """The FFA backward over keys concat(k[:split], k[split:]) both ways: one key array, and two key sources
    (ffa._bwd_call's k2, v2: the distributed backward's path; packed: k2 holds K and V side by side per row,
    [Tk2, 2, Hkv, D], and dk2 dK and dV; a narrower v padded there). Returns (dq, dk, dv) of each, float32
    numpy, the two-source dk, dv concatenated back."""
    from magi_jax import ffa
    (qr, kr, types), scale, (out, dout, lse, dlse) = _backward_inputs(mask, q, k, v, seed=split)
    args = (q, k, v, out, dout, lse, dlse, qr, kr, types)
    one = jax.jit(lambda *a: ffa._bwd_call(*a, scale, 0.0, deterministic)[:3])(*args)

    def two(q, k, v, *a):
        if not packed:
            return ffa._bwd_call(q, k[:split], v[:split], *a, scale, 0.0, deterministic, k2=k[split:], v2=v[split:])
        dq, dk, dv, dkv2, dv2 = ffa._bwd_call(q, k[:split], v[:split], *a, scale, 0.0, deterministic,
                                              k2=_packed(k[split:], v[split:]))
        assert dv2 is None and dkv2.shape == (k.shape[0] - split, 2, *k.shape[1:])
        return dq, dk, dv, dkv2[:, 0], dkv2[:, 1, ..., :v.shape[-1]]

    dq, dk, dv, dk2, dv2 = jax.jit(two)(*args)
    as_np = lambda x: np.asarray(x, np.float32)
    return [as_np(x) for x in one], [as_np(dq), as_np(jnp.concatenate([dk, dk2])),
                                     as_np(jnp.concatenate([dv, dv2]))]


def ffi_eqns(fn, *args) -> list:
    """fn's FFI calls, the equations of its jaxpr, once at every use of a sub-jaxpr (the printed jaxpr and the
    lowered text name a shared sub-jaxpr, custom_vmap's for one, once however often it is called)."""
    eqns = []

    def walk(jaxpr):
        jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ffi_call":
                eqns.append(eqn)
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else (value,):
                    if hasattr(sub, "eqns") or hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        walk(sub)

    walk(jax.make_jaxpr(fn)(*args))
    return eqns


def attention_scales(fn, *args) -> list[float]:
    """The softmax_scale of each FFA forward and backward call of fn (ffi_eqns), as the kernels get it."""
    return [float(dict(e.params["attributes"])["softmax_scale"]) for e in ffi_eqns(fn, *args)
            if e.params["target_name"] in ("magi_jax_ffa_fwd", "magi_jax_ffa_bwd")]


def ffi_calls(fn, *args) -> dict[str, int]:
    """How often fn calls each FFI target (ffi_eqns)."""
    counts: dict[str, int] = {}
    for eqn in ffi_eqns(fn, *args):
        counts[eqn.params["target_name"]] = counts.get(eqn.params["target_name"], 0) + 1
    return counts


def remat_grads_and_calls(loss, *args):
    """loss's gradients without jax.checkpoint and under it with the policy saving magi_jax.CHECKPOINT_NAMES,
    and the FFA forward calls of each program: without, under plain jax.checkpoint (the backward pass
    reruns the forward), with the policy. Returns (grads without, grads with the policy, (calls, remat
    calls, policy calls))."""
    import magi_jax as mj

    def run(fn):
        grad = jax.grad(fn, argnums=tuple(range(len(args))))
        return jax.jit(grad)(*args), ffi_calls(grad, *args).get("magi_jax_ffa_fwd", 0)

    want, calls = run(loss)
    remat_calls = run(jax.checkpoint(loss))[1]
    got, saved_calls = run(jax.checkpoint(loss, policy=jax.checkpoint_policies.save_only_these_names(
        *mj.CHECKPOINT_NAMES)))
    return want, got, (calls, remat_calls, saved_calls)


def merged_forward(mask: AttnMask, q, k, v, cut: int, first_too: bool = False):
    """The FFA forward over the mask's slices in one call, and in two: slices [:cut], then slices [cut:]
    merging into the first call's out and lse (ffa._fwd_call's prev, as the distributed forward's stage
    calls do). Returns ((out, lse) of one call, (out, lse) of the two), float32 numpy; first_too: also the
    first of the two calls alone, between them."""
    from magi_jax import ffa
    args, scale = _kernel_args(mask, q)
    calls = [lambda q, k, v: ffa._fwd_call(q, k, v, *args, scale, 0.0)]
    if first_too:
        calls.append(lambda q, k, v: ffa._fwd_call(q, k, v, *(a[:cut] for a in args), scale, 0.0))
    calls.append(lambda q, k, v: _two_forward_calls(q, k, v, args, scale, cut))
    return [[np.asarray(x, np.float32) for x in jax.jit(f)(q, k, v)] for f in calls]


def packed_kv_forward(mask: AttnMask, q, k, v, cut: int):
    """The distributed forward's two calls, slices [:cut] on separate k, v, then slices [cut:] merging into
    them, run twice: the second call on separate k, v, and on K and V packed side by side per row ([Tk, 2,
    Hkv, D], as a group collective's receive buffer holds them; ffa._fwd_call with v None). Returns
    ((out, lse) separate, (out, lse) packed), numpy in the calls' dtypes."""
    args, scale = _kernel_args(mask, q)
    separate = jax.jit(lambda q, k, v: _two_forward_calls(q, k, v, args, scale, cut))(q, k, v)
    packed = jax.jit(lambda q, k, v: _two_forward_calls(q, k, v, args, scale, cut, _packed(k, v)))(q, k, v)
    return [np.asarray(x) for x in separate], [np.asarray(x) for x in packed]


def chained_dq_grads(mask: AttnMask, q, k, v, cut: int, shared_delta: bool = False):
    """The FFA backward over the mask's slices in one call, and in two calls over slices [:cut] and [cut:]
    (the same out and lse: each slice's gradient is its own) chaining dQ through ffa._bwd_call's float32
    dq_in / dq_f32, as the staged distributed backward does; shared_delta: both take one delta computed by
    ffa.backward_delta (as the staged backward does) instead of each computing its own. Returns (dq, dk, dv)
    of each, float32 numpy."""
    from magi_jax import ffa
    (qr, kr, types), scale, (out, dout, lse, dlse) = _backward_inputs(mask, q, k, v, seed=cut)
    one = jax.jit(lambda *a: ffa._bwd_call(*a, qr, kr, types, scale, 0.0, False)[:3])(q, k, v, out, dout, lse, dlse)

    def chained(*a):
        delta = ffa.backward_delta(a[3], a[4], a[6]) if shared_delta else None
        first = ffa._bwd_call(*a, qr[:cut], kr[:cut], types[:cut], scale, 0.0, False, dq_f32=True, delta=delta)
        second = ffa._bwd_call(*a, qr[cut:], kr[cut:], types[cut:], scale, 0.0, False, dq_in=first[0], dq_f32=True,
                               delta=delta)
        assert second[0].dtype == jnp.float32
        return second[0], first[1] + second[1], first[2] + second[2]

    two = jax.jit(chained)(q, k, v, out, dout, lse, dlse)
    return [np.asarray(x, np.float32) for x in one], [np.asarray(x, np.float32) for x in two]
