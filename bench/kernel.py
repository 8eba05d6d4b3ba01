"""Kernel benchmark on one GPU: magi_jax FFA (cuda/) against cuDNN (dense, and packed varlen through
q_offsets/kv_offsets), tokamax's Mosaic GPU attention where importable, and XLA dense where it fits.

bf16, 16 heads, head dim 128 (else as the case's name says: `_d256`, `_d96`, `_mla192_128` for q / k 192 and v 128,
`_gqa4` for 4 kv heads shared by groups of 4 q heads), batch 1 packed. TFLOP/s count the unmasked area only: forward
4 * area * H * D (2 * area * H * (D + Dv) where v's head dim differs), forward+backward 3.5x that (DESIGN.md section
5). Forward+backward is jax.grad of sum(out), forward included, as in ../shared/peers. `ffa` runs the default sm90
kernels (TMA + wgmma), `ffa_mma` the mma.sync ones (MAGI_JAX_FFA_KERNEL=mma, set only while its own calls run),
`ffa_nn` the same kernels through magi_jax.dot_product_attention (jax.nn's signature; segment ids as constants:
slices built on the host), `ffa_nn_traced` with the ids traced (slices built on the device, empty ones included),
`ffa_vmap` flex_flash_attn under jax.vmap over causal_4k_x8's batch (one causal mask per element, packed into one
call by ffa.py's vmap rule), `jax_nn` jax.nn.dot_product_attention itself (cuDNN) on that batch, `ffa_kv_repeat` the
grouped-query case with k and v repeated to the q heads (run as multi-head), `ffa_padded` causal_16k_d96 with q, k, v
padded to head dim 128 and causal_16k_mla192_128 with them padded to 256 (as they ran before the kernels had
head dims 96 and 192), `ffa_v_padded` causal_16k_mla192_128 with v padded to 192 (as it ran before the forward took
v at 128), `ffa_stage` the same as a distributed stage call runs it (K and V packed in one buffer, v padded to 192
there and read at 128; the backward's keys the packed second source), `ffa_stage_v_padded` that with v read at 192 (as
the stage calls ran before 2026-12-06's 42nd session). Every implementation's output (and dq)
is compared with FFA's before it is timed. The last lines check the targets of the speed issue (ISSUE4_TARGETS).
Prints a progress line per measurement and a table; appends the table to BENCHMARKS.md; writes JSON and the table to
$OUT when set.

    python bench/kernel.py                 # all cases
    python bench/kernel.py --cases varlen_causal_64k --no-append
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import pathlib
import sys
import traceback
import types
from typing import Callable

import numpy as np

# tokamax imports xprof for its own benchmarking only; stub it (as ../shared/peers does).
for _name in ("xprof", "xprof.cli", "xprof.cli.tools"):
    sys.modules.setdefault(_name, types.ModuleType(_name))
sys.modules["xprof.cli.tools"].get_kernel_stats_tool = None

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import magi_jax as mj  # noqa: E402
from magi_jax import masks  # noqa: E402
from magi_jax.ffa import pad_last_axis  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402

H, D = 16, 128
ROOT = pathlib.Path(__file__).resolve().parents[1]


sys.path.insert(0, str(ROOT))  # run as a script: make the repository's bench package importable
from bench.common import doc_lengths, gpu_seconds_per_call, median_seconds, positive_int, ratio_text  # noqa: E402


def doc_starts(lens: list[int]) -> np.ndarray:
    """Each token's document start, documents of `lens` packed end to end (tokamax's k_start for
    masks.varlen_causal(lens))."""
    return np.repeat(np.cumsum([0] + lens[:-1]), lens)


def window_start(lens: list[int], window: int) -> np.ndarray:
    """Each token's first visible key under a causal sliding window inside its document: the document's start
    or window - 1 keys back (tokamax's k_start for masks.sliding_window(lens, window))."""
    return np.maximum(doc_starts(lens), np.arange(sum(lens)) - (window - 1))


def shared_question_samples(lens: list[int]) -> list[tuple[int, list[int]]]:
    """Per document: the first quarter is the question, the rest split into answers of a third each."""
    samples = []
    for n in lens:
        question = max(1, n // 4)
        rest, piece = n - question, max(1, (n - question) // 3)
        samples.append((question, [min(piece, rest - p) for p in range(0, rest, piece)]))
    return samples


# ---------------------------------------------------------------------------------------------- baselines
# Each takes q, k, v of shape [1, T, H, D] and returns out [1, T, H, D].

def ffa(mask: AttnMask, deterministic: bool = False, max_logit: bool = False) -> Callable:
    """max_logit: the forward also tracks each row's largest logit (return_max_logit; ffa_max_logit, its
    cost side by side). Only out is returned: the custom call computes the rows' maxima all the same."""
    qr, kr, types_ = mask.kernel_args()
    return lambda q, k, v: mj.flex_flash_attn(q[0], k[0], v[0], qr, kr, types_, deterministic=deterministic,
                                              return_max_logit=max_logit)[0][None]


# Implementations that are FFA with a kernel chosen by environment variables the handler reads at every call
# (cuda/handlers.cu, cuda/launch.h), to measure a scheduler's share side by side: ffa_grid, the sm90 forward
# without its persistent scheduler (one CTA per tile); ffa_natural, the forward's q blocks not longest first;
# ffa_l2all, the tiles of both passes in one L2 section (all heads at once); ffa_bwd_grid, the backward's CTAs
# in the grid's order (k blocks in order, head after head) instead of longest first; ffa_bwd_even, the
# backward's two consumer warpgroups starting together instead of half a step apart.
FFA_KERNELS = {
    "ffa_mma": {"MAGI_JAX_FFA_KERNEL": "mma"},
    "ffa_grid": {"MAGI_JAX_SM90_SCHED": "grid"},
    "ffa_natural": {"MAGI_JAX_SM90_SCHED": "natural"},
    "ffa_l2all": {"MAGI_JAX_SM90_L2_BYTES": str(1 << 50)},
    "ffa_bwd_grid": {"MAGI_JAX_SM90_BWD_ORDER": "grid"},
    "ffa_bwd_even": {"MAGI_JAX_SM90_BWD_STAGGER": "0"},
}
# Any other setting of the handler's variables: "ffa@VAR=VALUE[,VAR=VALUE...]", e.g.
# ffa@MAGI_JAX_SM90_L2_BYTES=12582912 (L2 sections of 12 MB), a column of its own.
_variant_envs = {name for env in FFA_KERNELS.values() for name in env}  # every variable a variant has set


def is_ffa_variant(impl: str) -> bool:
    return impl in FFA_KERNELS or impl.startswith("ffa@")


def kernel_env(impl: str) -> dict[str, str]:
    """The environment variables of an FFA variant (none for any other implementation)."""
    if not impl.startswith("ffa@"):
        return FFA_KERNELS.get(impl, {})
    pairs = [p.split("=", 1) for p in impl[len("ffa@"):].split(",")]
    if any(len(p) != 2 or not p[0].startswith("MAGI_JAX_") or not p[1] for p in pairs):
        raise ValueError(f"--impls: {impl!r} is not ffa@VAR=VALUE[,VAR=VALUE...] with VAR a MAGI_JAX_ variable")
    return dict(pairs)


def select_kernel(impl: str) -> None:
    """Sets the kernel variables for `impl` (unset for every other one); call with no work in flight."""
    env = kernel_env(impl)
    for name in _variant_envs:
        os.environ.pop(name, None)
    _variant_envs.update(env)
    os.environ.update(env)


def as_batch(x, batch: int):
    """A case's [1, T, H, D] as [batch, T / batch, H, D]."""
    return x.reshape(batch, x.shape[1] // batch, *x.shape[2:])


def ffa_nn(batch: int = 1, lens: list[int] | None = None, traced: bool = False, **kwargs) -> Callable:
    """magi_jax.dot_product_attention (the drop-in for jax.nn's) on the case's tokens as [batch, T / batch],
    documents `lens` (of the one sequence) as segment ids. traced: the ids a traced value, as in a training
    step taking them as an argument (slices built on the device with room for twice the documents; without
    lens, one document per sequence)."""
    segs = None if lens is None else np.repeat(np.arange(len(lens)) % 2, lens)[None].astype(np.int32)

    def fn(q, k, v):
        ids, extra = segs, {}
        if traced:
            ids = jnp.zeros((batch, q.shape[1] // batch), jnp.int32) if segs is None else jnp.asarray(segs)
            ids = jax.lax.optimization_barrier(ids)  # not a constant of the jitted call
            extra = dict(max_segments=2 * (len(lens) if lens else 1))
        return mj.dot_product_attention(as_batch(q, batch), as_batch(k, batch), as_batch(v, batch), segment_ids=ids,
                                        **extra, **kwargs).reshape(q.shape)
    return fn


def ffa_kv_repeat(mask: AttnMask) -> Callable:
    """FFA with k and v repeated to q's heads: a grouped-query case run as multi-head (the backward's CTAs then
    one per q head, jax.grad summing dk, dv over each group), to price the grouped backward's own order."""
    call = ffa(mask)

    def fn(q, k, v):
        group = q.shape[2] // k.shape[2]
        return call(q, jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2))
    return fn


def ffa_padded(mask: AttnMask, kernel_dim: int, kernel_dim_v: int | None = None) -> Callable:
    """FFA on q, k zero-padded to head dim kernel_dim and v to kernel_dim_v (default kernel_dim; the scale kept
    at q's own head dim's): how head dims 96 (at 128) and 192 (at 256; v at 192) ran before the kernels had
    them, side by side with them."""
    qr, kr, types_ = mask.kernel_args()

    def fn(q, k, v):
        out = mj.flex_flash_attn(pad_last_axis(q[0], kernel_dim), pad_last_axis(k[0], kernel_dim),
                                 pad_last_axis(v[0], kernel_dim_v or kernel_dim), qr, kr, types_,
                                 softmax_scale=q.shape[-1] ** -0.5)[0]
        return out[None, ..., :v.shape[-1]]
    return fn


def ffa_stage(mask: AttnMask, v_padded: bool = False) -> Callable:
    """FFA as the distributed layer's stage calls run it: K and V in one packed buffer [T, 2, Hkv, D] (v
    zero-padded to D, as it travels), the forward reading V at v's own head dim (or, v_padded, at D: how MLA's
    stage calls ran before they took v at 128), the backward with every key the packed second source."""
    from magi_jax import ffa as ffa_mod
    qr, kr, types_ = (jnp.asarray(a) for a in mask.kernel_args())

    def fn(q, k, v):
        q, k, v = q[0], k[0], v[0]
        d, dv = k.shape[-1], v.shape[-1]
        dv_kernel = d if v_padded else dv
        scale = d ** -0.5

        @jax.custom_vjp
        def attn(q, kv):
            return ffa_mod._fwd_call(q, kv, None, qr, kr, types_, scale, 0.0, head_dim_v=dv_kernel)[0]

        def attn_fwd(q, kv):
            out, lse = ffa_mod._fwd_call(q, kv, None, qr, kr, types_, scale, 0.0, head_dim_v=dv_kernel)
            return out, (q, kv, out, lse)

        def attn_bwd(res, dout):
            q, kv, out, lse = res
            none_k, none_v = jnp.zeros((0, *kv.shape[2:]), kv.dtype), jnp.zeros((0, kv.shape[2], dv_kernel), kv.dtype)
            dq, _, _, dkv, _ = ffa_mod._bwd_call(q, none_k, none_v, out, dout, lse, jnp.zeros_like(lse), qr, kr,
                                                 types_, scale, 0.0, False, k2=kv)
            return dq, dkv

        attn.defvjp(attn_fwd, attn_bwd)
        return attn(q, jnp.stack([k, pad_last_axis(v, d)], axis=1))[None, ..., :dv]
    return fn


def ffa_vmap(batch: int, mask: AttnMask) -> Callable:
    """flex_flash_attn under jax.vmap over the case's tokens as [batch, T / batch], each element `mask`."""
    attn = jax.vmap(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask)[0])

    def fn(q, k, v):
        return attn(*(as_batch(x, batch) for x in (q, k, v))).reshape(q.shape)
    return fn


def cudnn_dense_causal(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")


def cudnn_dense_causal_v_padded(q, k, v):
    """cuDNN through jax.nn, which takes v at q's head dim: v zero-padded to it, out sliced back (MLA's shapes as a
    JAX user runs them there)."""
    return cudnn_dense_causal(q, k, pad_last_axis(v, q.shape[-1]))[..., :v.shape[-1]]


def jax_nn_batched(batch: int) -> Callable:
    """jax.nn.dot_product_attention (cuDNN) on the tokens as [batch, T / batch], causal: what ffa_nn drops in for."""
    def fn(q, k, v):
        return jax.nn.dot_product_attention(as_batch(q, batch), as_batch(k, batch), as_batch(v, batch),
                                            is_causal=True, implementation="cudnn").reshape(q.shape)
    return fn


def cudnn_varlen(lens: list[int], window: int | None = None, head_dim: int = D) -> Callable:
    from jax._src.cudnn import fused_attention_stablehlo as fa
    starts = np.cumsum([0] + lens[:-1]).astype(np.int32)
    offsets = jnp.asarray(np.concatenate([starts, [-1]]).astype(np.int32))[None]
    seqlens = jnp.asarray(np.array(lens, np.int32))[None]

    def fn(q, k, v):
        return fa.dot_product_attention(q, k, v, q_seqlen=seqlens, kv_seqlen=seqlens, q_offsets=offsets,
                                        kv_offsets=offsets, scale=head_dim ** -0.5, mask_type=fa.MaskType.CAUSAL,
                                        qkv_layout="BTNH", sliding_window_length=window)
    return fn


def xla_dense(mask: AttnMask) -> Callable:
    dense = jnp.asarray(mask.to_dense() > 0)[None, None]
    return lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense, implementation="xla")


def tokamax(k_start=None, k_end=None, is_causal=False, dense_mask=None) -> Callable:
    from tokamax._src.ops.attention import base, pallas_mosaic_gpu as pmg  # ImportError: not installed
    op = pmg.PallasMosaicGpuFlashAttention()
    if dense_mask is not None:
        mask = base.Mask(jnp.asarray(dense_mask)[None, None])
    elif k_start is None and k_end is None:
        return lambda q, k, v: op(q, k, v, is_causal=is_causal)
    else:
        as_arg = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.int32))[None, None]
        mask = base.Mask(k_start=as_arg(k_start), k_end=as_arg(k_end), is_causal=is_causal)
    return lambda q, k, v: op(q, k, v, mask=mask)


# ------------------------------------------------------------------------------------------------- cases

@dataclasses.dataclass
class Case:
    name: str
    mask: AttnMask
    baselines: dict[str, Callable[[], Callable]]  # built lazily: an import or a shape may fail
    head_dim: int = D
    head_dim_v: int | None = None   # v's head dim where it differs from q / k's (MLA-style)
    heads_kv: int = H               # k / v heads (GQA: fewer than q's H); the FLOPs count q's heads

    @property
    def flops(self) -> float:
        """Forward FLOPs on the unmasked area: S = QK^T and O = PV, 2 x area x H x (D + Dv)."""
        return 2.0 * self.mask.area() * H * (self.head_dim + (self.head_dim_v or self.head_dim))


def make_cases() -> list[Case]:
    # Each baseline is built lazily by a lambda; every value it closes over is bound once here and never
    # rebound (until 2026-12-01 the sliding window's cuDNN baseline read a `lens` reassigned below it, and
    # so ran on 8 documents of 4096 instead of the case's mask: BENCHMARKS.md 2026-12-01).
    cases = []
    cases.append(Case("causal_32k", masks.causal(32768), {
        "cudnn": lambda: cudnn_dense_causal,
        "tokamax": lambda: tokamax(is_causal=True),
        "ffa_nn": lambda: ffa_nn(is_causal=True),
        "ffa_nn_traced": lambda: ffa_nn(is_causal=True, traced=True)}))
    for t in (32768, 65536):
        lens = doc_lengths(t, seed=t)
        starts = doc_starts(lens)
        cases.append(Case(f"varlen_causal_{t // 1024}k", masks.varlen_causal(lens), {
            "cudnn": (lambda lens=lens: cudnn_varlen(lens)),
            "tokamax": (lambda s=starts: tokamax(k_start=s, is_causal=True)),
            "ffa_nn": (lambda lens=lens: ffa_nn(lens=lens, is_causal=True)),
            "ffa_nn_traced": (lambda lens=lens: ffa_nn(lens=lens, is_causal=True, traced=True))}))
    docs = doc_lengths(32768, seed=32768)
    start = doc_starts(docs)
    pos = np.arange(32768)
    block_end = np.minimum(start + ((pos - start) // 2048 + 1) * 2048, np.repeat(np.cumsum(docs), docs))
    cases.append(Case("varlen_block_causal_32k", masks.block_causal(docs, 2048), {
        "tokamax": lambda: tokamax(k_start=start, k_end=block_end)}))
    cases.append(Case("varlen_swa1024_32k", masks.sliding_window(docs, 1024), {
        "cudnn": lambda: cudnn_varlen(docs, window=1024),
        "tokamax": lambda: tokamax(k_start=window_start(docs, 1024), is_causal=True),
        "ffa_nn": lambda: ffa_nn(lens=docs, is_causal=True, local_window_size=(1023, 0)),
        "ffa_nn_traced": lambda: ffa_nn(lens=docs, is_causal=True, local_window_size=(1023, 0), traced=True)}))
    shared = masks.shared_question(shared_question_samples(doc_lengths(16384, seed=16384)))
    cases.append(Case("shared_question_16k", shared, {
        "tokamax": lambda: tokamax(dense_mask=shared.to_dense() > 0),
        "xla_dense": lambda: xla_dense(shared)}))
    cases.append(Case("causal_4k_x8", masks.varlen_causal([4096] * 8), {
        "cudnn": lambda: cudnn_varlen([4096] * 8),
        "tokamax": lambda: tokamax(k_start=np.repeat(np.arange(8) * 4096, 4096), is_causal=True),
        "ffa_nn": lambda: ffa_nn(batch=8, is_causal=True),
        "ffa_nn_traced": lambda: ffa_nn(batch=8, is_causal=True, traced=True),
        "ffa_vmap": lambda: ffa_vmap(8, masks.causal(4096)),
        "jax_nn": lambda: jax_nn_batched(8)}))
    # Grouped-query attention, as most long-context models train: 4 kv heads for the 16 q heads, on `docs`
    # (doc_lengths(32768, seed=32768): the documents of varlen_causal_32k).
    gqa_mask = masks.varlen_causal(docs)
    cases.append(Case("varlen_causal_32k_gqa4", gqa_mask, {
        "cudnn": lambda: cudnn_varlen(docs),
        "tokamax": lambda: tokamax(k_start=start, is_causal=True),
        "ffa_kv_repeat": lambda: ffa_kv_repeat(gqa_mask)}, heads_kv=4))
    cases.append(Case("causal_16k_d256", masks.causal(16384), {
        "cudnn": lambda: cudnn_dense_causal,
        "tokamax": lambda: tokamax(is_causal=True)}, head_dim=256))
    # Head dim 96 and MLA's 192 for q / k with 128 for v, which the kernels run at their own sizes (ffa_padded:
    # at 128 and 256, ffa_v_padded: v at 192, as before they did). TFLOP/s count the unpadded dims.
    cases.append(Case("causal_16k_d96", masks.causal(16384), {
        "cudnn": lambda: cudnn_dense_causal,
        "tokamax": lambda: tokamax(is_causal=True),
        "ffa_padded": lambda: ffa_padded(masks.causal(16384), 128)}, head_dim=96))
    cases.append(Case("causal_16k_mla192_128", masks.causal(16384), {
        "cudnn": lambda: cudnn_dense_causal_v_padded,
        "ffa_padded": lambda: ffa_padded(masks.causal(16384), 256),
        "ffa_v_padded": lambda: ffa_padded(masks.causal(16384), 192, 192),
        "ffa_stage": lambda: ffa_stage(masks.causal(16384)),
        "ffa_stage_v_padded": lambda: ffa_stage(masks.causal(16384), v_padded=True)}, head_dim=192, head_dim_v=128))
    return cases


# ----------------------------------------------------------------------------------------------- checking

def rel_diff(a, b) -> float:
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.maximum(jnp.linalg.norm(b), 1e-30))


def case_inputs(case: Case) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [1, T, H, D], k and v [1, T, heads_kv, D] bf16, the same random values for every implementation."""
    keys = jax.random.split(jax.random.key(0), 3)
    shapes = ((H, case.head_dim), (case.heads_kv, case.head_dim), (case.heads_kv, case.head_dim_v or case.head_dim))
    return tuple(jax.random.normal(kk, (1, case.mask.total_seqlen_q, h, d), jnp.bfloat16)
                 for kk, (h, d) in zip(keys, shapes))


def jitted(fn: Callable, mode: str) -> Callable:
    """The timed function of a pass: fn itself ("fwd"), or the gradients of sum(out) in q, k, v, forward
    included ("fwd+bwd")."""
    if mode == "fwd":
        return jax.jit(fn)
    return jax.jit(jax.grad(lambda q, k, v: fn(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2)))


def run_case(case: Case, impls: list[str], results: list[dict], rounds: int = 3, gpu_time: bool = False) -> None:
    """Every implementation on one case: each is compiled and checked against ffa first; then ``rounds``
    rounds time them in turn (the machine's drift falls on all alike) and each keeps its median round.
    gpu_time: also each one's GPU busy time per call, from a profiler trace (``gpu_ms``; gpu_table)."""
    total = case.mask.total_seqlen_q
    area = case.mask.area()
    flops = case.flops
    q, k, v = case_inputs(case)
    fns: dict[str, Callable] = {"ffa": ffa(case.mask)}
    for name in impls:
        if name == "ffa":
            continue
        if name == "ffa_det":
            fns[name] = ffa(case.mask, deterministic=True)
        elif name == "ffa_max_logit":
            fns[name] = ffa(case.mask, max_logit=True)
        elif is_ffa_variant(name):
            fns[name] = ffa(case.mask)
        elif name in case.baselines:
            try:
                fns[name] = case.baselines[name]()
            except Exception as e:  # not importable, or not expressible
                results.append(dict(case=case.name, impl=name, error=f"unavailable: {e!r}"[:300]))
                print(f"[{case.name}] {name}: unavailable ({e!r})"[:200], flush=True)
    reference: dict[str, jax.Array] = {}
    timed = []   # (row, f)
    for name, fn in fns.items():
        for mode in ("fwd", "fwd+bwd"):
            row = dict(case=case.name, impl=name, mode=mode, tokens=total, area=area, slices=case.mask.num_slices)
            select_kernel(name)  # the previous call ended in block_until_ready: nothing in flight
            try:
                f = jitted(fn, mode)
                key = "out" if mode == "fwd" else "dq"
                got = f(q, k, v) if mode == "fwd" else f(q, k, v)[0]
                if name == "ffa":
                    reference[key] = got
                row["rel_diff_vs_ffa"] = rel_diff(got, reference[key]) if key in reference else float("nan")
                del got
                timed.append((row, f))
            except Exception as e:
                traceback.print_exc(limit=2)
                row["error"] = repr(e)[:400]
                results.append(row)
                print(f"[{case.name}] {name:>10} {mode:>7}: error {row['error'][:120]}", flush=True)
            jax.effects_barrier()
    times: dict[int, list[float]] = {}
    for _ in range(rounds):
        for i, (row, f) in enumerate(timed):
            if "error" in row:
                continue
            select_kernel(row["impl"])
            try:
                times.setdefault(i, []).append(median_seconds(f, q, k, v, warmup=1, reps=5, calls=10))
            except Exception as e:
                traceback.print_exc(limit=2)
                row["error"] = repr(e)[:400]
            jax.effects_barrier()
    for i, (row, f) in enumerate(timed):
        if "error" not in row:
            seconds = float(np.median(times[i]))
            mult = 1.0 if row["mode"] == "fwd" else 3.5
            row.update(ms=round(seconds * 1e3, 3), tflops=round(flops * mult / seconds / 1e12, 1),
                       ms_rounds=[round(t * 1e3, 3) for t in times[i]])
            if gpu_time:
                select_kernel(row["impl"])
                gpu = gpu_seconds_per_call(f, q, k, v)
                if gpu is not None:
                    row["gpu_ms"] = round(gpu * 1e3, 4)
                jax.effects_barrier()
        results.append(row)
        shown = (f"{row['ms']:8.3f} ms {row['tflops']:6.1f} TFLOP/s  diff vs ffa {row['rel_diff_vs_ffa']:.1e}  "
                 f"(rounds: {', '.join(f'{t:.3f}' for t in row['ms_rounds'])})"
                 + (f"  GPU {row['gpu_ms']:.4f} ms" if "gpu_ms" in row else "")
                 if "ms" in row else f"error {row['error'][:120]}")
        print(f"[{case.name}] {row['impl']:>10} {row['mode']:>7}: {shown}", flush=True)


# ------------------------------------------------------------------------------------------------- table

def measured(results: list[dict]) -> dict[tuple, dict]:
    """(case, impl, mode) -> the row, for the rows that were timed."""
    return {(r["case"], r["impl"], r.get("mode")): r for r in results if "tflops" in r}


COLUMNS = ("ffa", "ffa_mma", "ffa_grid", "ffa_natural", "ffa_l2all", "ffa_bwd_grid", "ffa_bwd_even", "ffa_det",
           "ffa_max_logit", "ffa_nn", "ffa_nn_traced", "ffa_vmap", "ffa_kv_repeat", "ffa_padded", "ffa_v_padded",
           "ffa_stage", "ffa_stage_v_padded", "jax_nn", "cudnn", "tokamax", "xla_dense")


def table(results: list[dict]) -> str:
    by = measured(results)
    cases = list(dict.fromkeys(r["case"] for r in results))
    timed = list(dict.fromkeys(r["impl"] for r in results if "tflops" in r))
    present = [c for c in COLUMNS if c in timed] + [c for c in timed if c not in COLUMNS]
    # (numerator, denominator) of the ratio columns: to cuDNN, and ffa to each scheduler variant present
    # (what the variant's knob is worth, side by side in one run).
    pairs = [("ffa", "cudnn")] + ([("ffa_mma", "cudnn")] if "ffa_mma" in present else [])
    pairs += [("ffa", v) for v in present if is_ffa_variant(v) and v != "ffa_mma"]
    head = ("| case | pass | " + " | ".join(f"{c} TFLOP/s (ms)" for c in present) + " | " +
            " | ".join(f"{a} / {b}" for a, b in pairs) + " |")
    lines = [head, "|" + "---|" * (len(present) + 2 + len(pairs))]
    for case in cases:
        for mode in ("fwd", "fwd+bwd"):
            cells = []
            for c in present:
                r = by.get((case, c, mode))
                cells.append(f"{r['tflops']} ({r['ms']})" if r else "-")
            ratios = []
            for a, b in pairs:
                f, c = by.get((case, a, mode)), by.get((case, b, mode))
                ratios.append(f"{f['tflops'] / c['tflops']:.2f}" if f and c else "-")
            lines.append(f"| {case} | {mode} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def gpu_table(results: list[dict]) -> str:
    """GPU busy time per call (ms) of every implementation with one (run_case's gpu_time), and each one's time
    over ffa's: kernel time without the host's dispatch and launch gaps (the clock's drift stays). Empty:
    none."""
    rows = [r for r in results if "gpu_ms" in r]
    if not rows:
        return ""
    by = {(r["case"], r["impl"], r["mode"]): r["gpu_ms"] for r in rows}
    present = list(dict.fromkeys(r["impl"] for r in rows))
    others = [c for c in present if c != "ffa"]
    lines = ["| case | pass | " + " | ".join(f"{c} GPU ms" for c in present) + " | "
             + " | ".join(f"{c} / ffa" for c in others) + " |",
             "|" + "---|" * (2 + len(present) + len(others))]
    for case in dict.fromkeys(r["case"] for r in rows):
        for mode in ("fwd", "fwd+bwd"):
            cells = [f"{by[(case, c, mode)]:.4f}" if (case, c, mode) in by else "-" for c in present]
            mine = by.get((case, "ffa", mode))
            ratios = [f"{by[(case, c, mode)] / mine:.4f}" if mine and (case, c, mode) in by else "-" for c in others]
            lines.append(f"| {case} | {mode} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")
    return "\n".join(lines)


def speed_bar(results: list[dict]) -> str:
    by = measured(results)
    parts = []
    for mode, bar in (("fwd", 0.5), ("fwd+bwd", 0.4)):
        c = by.get(("varlen_causal_64k", "cudnn", mode))
        for impl in ("ffa", "ffa_mma"):
            f = by.get(("varlen_causal_64k", impl, mode))
            if f and c:
                ratio = f["tflops"] / c["tflops"]
                parts.append(f"{impl} {mode} {ratio:.2f}x cuDNN (bar {bar}x: {'met' if ratio >= bar else 'NOT met'})")
    return "speed bar, varlen causal 64k: " + ("; ".join(parts) if parts else "not measured")


# The speed issue's targets: (case, pass) -> ("x", ratio to the best of the named peers) or ("tflops", value).
ISSUE4_TARGETS = {
    ("varlen_causal_64k", "fwd"): ("x", 1.05, ("cudnn",)),
    ("varlen_causal_64k", "fwd+bwd"): ("x", 1.05, ("cudnn",)),
    ("causal_32k", "fwd"): ("x", 1.0, ("cudnn", "tokamax")),
    ("causal_32k", "fwd+bwd"): ("x", 1.0, ("cudnn",)),
    ("varlen_block_causal_32k", "fwd"): ("tflops", 550, ()),
    ("varlen_block_causal_32k", "fwd+bwd"): ("tflops", 450, ()),
    ("varlen_swa1024_32k", "fwd"): ("tflops", 500, ()),
    ("varlen_swa1024_32k", "fwd+bwd"): ("tflops", 400, ()),
    ("shared_question_16k", "fwd"): ("tflops", 450, ()),
    ("shared_question_16k", "fwd+bwd"): ("tflops", 380, ()),
    ("causal_4k_x8", "fwd"): ("x", 0.9, ("cudnn",)),
    ("causal_4k_x8", "fwd+bwd"): ("x", 0.9, ("cudnn",)),
    ("causal_16k_d256", "fwd"): ("x", 0.8, ("cudnn",)),
    ("causal_16k_d256", "fwd+bwd"): ("x", 0.8, ("cudnn",)),
}


def target_check(results: list[dict], impl: str) -> str:
    """One line per target of ISSUE4_TARGETS measured in this run, for ``impl``."""
    by = measured(results)
    lines, met, total = [], 0, 0
    for (case, mode), (kind, bar, peers) in ISSUE4_TARGETS.items():
        if not any(r["case"] == case for r in results):
            continue
        total += 1
        mine = by.get((case, impl, mode))
        if mine is None:
            lines.append(f"  {case} {mode}: not measured (MISSED)")
            continue
        if kind == "tflops":
            ok, shown = mine["tflops"] >= bar, f"{mine['tflops']} TFLOP/s (target {bar})"
        else:
            ran = [p for p in peers if (case, p, mode) in by]
            if len(ran) < len(peers):  # a target against the best of several peers needs all of them
                absent = "/".join(p for p in peers if p not in ran)
                lines.append(f"  {case} {mode}: {absent} not measured (MISSED)")
                continue
            ratio = mine["tflops"] / max(by[(case, p, mode)]["tflops"] for p in ran)
            ok, shown = ratio >= bar, f"{ratio_text(ratio)}x {'/'.join(peers)} (target {bar}x)"
        met += ok
        lines.append(f"  {case} {mode}: {shown}: {'met' if ok else 'MISSED'}")
    return f"issue 4 targets for {impl}: {met} of {total} met\n" + "\n".join(lines)


def versions() -> str:
    parts = [f"jax {jax.__version__}"]
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version
        parts.append(f"cuDNN {check_cudnn_version()}")
    except Exception:
        pass
    try:
        import tokamax
        parts.append(f"tokamax {getattr(tokamax, '__version__', '?')}")
    except Exception:
        parts.append("tokamax not installed")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", help="case names (default: all)")
    parser.add_argument("--impls", nargs="*", default=["ffa", "ffa_mma", "cudnn", "tokamax", "xla_dense"],
                        help="implementations; ffa_det adds FFA with deterministic=True, ffa_max_logit with "
                             "return_max_logit=True, ffa_mma is FFA with the "
                             "mma.sync kernels, ffa_grid the sm90 forward without its persistent scheduler, "
                             "ffa_natural without the longest-first order, ffa_l2all without L2 sections, "
                             "ffa_bwd_grid the backward's CTAs in grid order, ffa_bwd_even its consumer "
                             "warpgroups starting together; ffa@VAR=VALUE[,VAR=VALUE] FFA with any MAGI_JAX_ "
                             "variables set (a column and a ratio of its own)")
    parser.add_argument("--no-append", action="store_true", help="do not append to BENCHMARKS.md")
    parser.add_argument("--rounds", type=positive_int, default=3, help="rounds over the implementations per case")
    parser.add_argument("--gpu-time", action="store_true",
                        help="also each implementation's GPU busy time per call from a profiler trace (a second "
                             "table: kernel time without host overhead)")
    args = parser.parse_args()
    for impl in args.impls:
        kernel_env(impl)  # a malformed ffa@ variant fails here, before any compilation
    device = jax.devices()[0]
    print(f"{device.device_kind}; {versions()}", flush=True)
    results: list[dict] = []
    for case in make_cases():
        if args.cases and case.name not in args.cases:
            continue
        print(f"[{case.name}] {case.mask.num_slices} slices, area {case.mask.area():.3e}", flush=True)
        run_case(case, args.impls, results, args.rounds, args.gpu_time)
    text = table(results)
    gpu = gpu_table(results)
    if gpu:
        text += "\n\nGPU busy time per call, from a profiler trace of 10 calls:\n\n" + gpu
    bar = speed_bar(results)
    bar += "\n\n" + target_check(results, "ffa")
    print("\n" + text + "\n\n" + bar, flush=True)
    command = "python " + " ".join([pathlib.Path(sys.argv[0]).as_posix(), *sys.argv[1:]])
    section = (f"\n## Kernel, one GPU ({datetime.date.today().isoformat()})\n\n{device.device_kind}; {versions()}; "
               f"bf16, {H} heads, D {D} (else as the case's name says); TFLOP/s on the unmasked area "
               f"(fwd+bwd = 3.5x fwd flops); per implementation the median of {args.rounds} rounds (implementations "
               f"in turn), each the median of 5 x 10 calls.\nCommand: `{command}`\n\n{text}\n\n{bar}\n")
    if not args.no_append:
        with open(ROOT / "BENCHMARKS.md", "a") as f:
            f.write(section)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "kernel_bench.json"), "w") as f:
            json.dump(dict(device=device.device_kind, versions=versions(), command=command, results=results), f,
                      indent=1)
        with open(os.path.join(out, "kernel_bench.md"), "w") as f:
            f.write(section)


if __name__ == "__main__":
    main()
