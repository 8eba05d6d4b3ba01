"""What is particular to the sm90 kernels (TMA + wgmma: cuda/flash_fwd_sm90_kernel.h,
cuda/flash_bwd_sm90_kernel.h), the default CUDA kernels: the persistent grid with many more tiles than SMs, the
longest-first order, bitwise reproducibility of the forward and of the deterministic backward, agreement of
both with the mma.sync kernels (MAGI_JAX_FFA_KERNEL=mma). The whole GPU suite runs on the sm90 kernels in
tests/test_ffa_gpu.py, and on the mma.sync ones in tests/test_ffa_mma_gpu.py.

Run first, alone, with a hard timeout (a barrier bug hangs rather than fails):
    timeout 120 python -m pytest -q -x tests/test_ffa_sm90_gpu.py -k smoke
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import magi_jax as mj
from magi_jax import masks
from magi_jax.mask import AttnMask
from tests.conftest import check_against_reference, random_qkv, split_key_grads
from tests.test_ffa_gpu import _on_gpu, run_case  # noqa: F401  (the module's skip-without-GPU fixture)

pytestmark = pytest.mark.gpu

ENV = "MAGI_JAX_FFA_KERNEL"


@pytest.fixture(autouse=True)
def _sm90_kernels(monkeypatch):
    monkeypatch.setenv(ENV, "sm90")  # the default, said explicitly: these tests are about these kernels


@contextlib.contextmanager
def _kernel(name: str):
    """MAGI_JAX_FFA_KERNEL=name for the calls inside (the handlers read it at every call)."""
    old = os.environ.get(ENV)
    os.environ[ENV] = name
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = old


def _forward(mask, q, k, v, kernel):
    """out, lse of the forward with the kernel named ("sm90" or "mma")."""
    qr, kr, types = mask.kernel_args()
    with _kernel(kernel):
        out, lse = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types))(q, k, v)
        return np.asarray(out, np.float32), np.asarray(lse)


@pytest.mark.parametrize("d", [64, 128])
def test_smoke_sm90_forward_matches_mma_sync(d):
    # Two slices (one causal), unaligned edges, GQA: one tile per (q block, head), fewer tiles than SMs.
    mask = AttnMask([[0, 300], [100, 333]], [[0, 300], [250, 400]], [1, 0], 333, 400)
    rng = np.random.default_rng(d)
    q, k, v = random_qkv(rng, 333, 400, 4, 2, d, jnp.bfloat16)
    out, lse = _forward(mask, q, k, v, "sm90")
    ref_out, ref_lse = _forward(mask, q, k, v, "mma")
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=2e-3)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=2e-2)


@pytest.mark.parametrize("d", [192, 256])
def test_smoke_head_dim_256_forward(d):
    # D 192 and 256 have no mma.sync kernel to agree with: the float64 reference. The smoke mask (two slices,
    # one causal, unaligned edges, GQA), forward only (the backward: test_smoke_head_dim_256_backward).
    mask = AttnMask([[0, 300], [100, 333]], [[0, 300], [250, 400]], [1, 0], 333, 400)
    run_case(mask, hq=4, hkv=2, d=d, seed=d, grads=False)


@pytest.mark.parametrize("d", [192, 256])
def test_smoke_head_dim_256_backward(d):
    # The D 192 / 256 backward (64-key CTAs, dQ by TMA reduce-add; at 256 the warpgroups split D, at 192 they
    # take roles a step apart) against the float64 reference on the smoke mask: 7 CTAs of 64 keys per kv head
    # (400 = 6 x 64 + 16), two per k-block list. A hang here: cuda/NOTES.md (D 256 backward) debugging hints
    # (barriers 1 / 5, row_empty's 2 arrivals; at 192 the ready / consumed barriers 6-9).
    mask = AttnMask([[0, 300], [100, 333]], [[0, 300], [250, 400]], [1, 0], 333, 400)
    run_case(mask, hq=4, hkv=2, d=d, seed=d + 2)


@pytest.mark.parametrize("mask_type", ["full", "causal", "inv_causal"])
@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_forward_rows_whose_max_climbs_along_the_keys(mask_type, d):
    # The forward keeps a row's max while it grows by at most kRescaleSlack (8, log2 units) and rescales O only
    # when it grows by more (flash_fwd_sm90_kernel.h, Sm90RowSoftmax); at D 64 / 128 its mainloop first tries
    # each step against the kept maxima without computing the step's own (ExpKeepingMax, taken while a
    # thread's row sum stays within 2^14) and computes S again where that fails. Logits that climb along the
    # keys, by 0, 3, 7, 20 or 150 log2 units per 128 keys in a random order, take every path at every row
    # (150: probabilities past fp32's range against the kept max); the three types walk the keys against the
    # climb, with it, and from the diagonal. Checked with the gradients too.
    t, h = 2048, 2
    rng = np.random.default_rng(d)
    a, scale_log2 = 4.0, d ** -0.5 / np.log(2)  # q's first coordinate, the softmax scale in log2 units
    rises = rng.choice([0.0, 3.0, 7.0, 20.0, 150.0], size=t // 128)  # per 128 keys, linear within them
    climb = np.concatenate([r0 + r * np.arange(128) / 128 for r0, r in zip(np.cumsum(rises) - rises, rises)])
    q, k, v = (np.array(x, np.float32) for x in random_qkv(rng, t, t, h, h, d))
    q[:, :, 0] = a
    k[:, :, 0] = (climb / (a * scale_log2))[:, None]
    q, k, v = (jnp.asarray(x).astype(jnp.bfloat16) for x in (q, k, v))
    mask = AttnMask([[0, t]], [[0, t]], [mask_type], t, t)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask))
    check_against_reference(fn, mask, q, k, v, rng)


@pytest.mark.parametrize("offset", [-60.0, 30.0])
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("d", [64, 128])
def test_forward_rows_whose_first_keys_come_in_a_later_step(offset, dtype, d):
    # A row with no max yet takes its first keys in a mainloop step against 0 (ExpKeepingMax) only where each of
    # its threads' sums lies in [1, 2^14]. Windows over documents that start inside key tiles give rows whose
    # first keys come in a later step; logits all `offset` log2 units from 0 must then take the full update:
    # -60 underflows fp16's P against 0 (a wrong path gives a zero row sum), +30 overflows it.
    t, h = 2048, 2
    rng = np.random.default_rng(d)
    a, scale_log2 = 4.0, d ** -0.5 / np.log(2)
    q, k, v = (np.array(x, np.float32) for x in random_qkv(rng, t, t, h, h, d))
    q[:, :, 0] = a
    k[:, :, 0] = offset / (a * scale_log2)
    q, k, v = (jnp.asarray(x).astype(dtype) for x in (q, k, v))
    mask = masks.sliding_window([300, 700, 1048], 200, causal=False)
    fn = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask))
    check_against_reference(fn, mask, q, k, v, rng)


@pytest.mark.parametrize("sched", ["lpt", "natural", "grid"])
def test_head_dim_256_persistent_grid(sched, monkeypatch):
    # 6000 tokens x 8 heads = 376 tiles over ~132 CTAs: later tiles reuse the Q buffer that stages O at D 256
    # (released only after both epilogues' stores have read it).
    monkeypatch.setenv("MAGI_JAX_SM90_SCHED", sched)
    run_case(masks.varlen_causal([3000, 300, 1500, 1200]), hq=8, hkv=2, d=256, grads=False, seed=12)


@pytest.mark.parametrize("sched", ["lpt", "natural", "grid"])
def test_persistent_grid_many_tiles_varlen_causal(sched, monkeypatch):
    # 8k tokens x 16 heads = 1024 tiles over ~132 CTAs, documents of very different lengths (uneven work);
    # MAGI_JAX_SM90_SCHED: longest first (default), last-first, one CTA per tile (not persistent). (16k x 8
    # heads before: the same tiles at twice the float64 reference's cost, the slowest test of the QUICK set,
    # which its time limit cut in every run of 2026-12-01.)
    monkeypatch.setenv("MAGI_JAX_SM90_SCHED", sched)
    lens = [4000, 150, 2000, 1024, 500, 518]
    mask = masks.varlen_causal(lens)
    run_case(mask, hq=16, hkv=4, d=128, grads=False, seed=11)


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
def test_persistent_grid_many_short_walks(d):
    # A window of 128 over 8k tokens x 16 heads: 1024 tiles of about two steps, ~8 a CTA, so the tile warp
    # waits on each Q buffer's release (q_empty) for every tile after a CTA's second, and the K / V warp runs
    # ahead of the consumers. A release count that did not match the arrivals (2026-12-02: every consumer warp
    # arriving on a barrier counting warpgroups) passed every longer-walk test and hung on the bench's
    # sliding window.
    mask = masks.sliding_window([3000, 2500, 2692], 128)
    run_case(mask, hq=16, hkv=4, d=d, grads=False, seed=14)


# Slices that a q block walks as one group (scheduler_sm90.h FwdStepFrom: consecutive in its list, rows
# disjoint and ascending, key spans less than a tile apart: one walk over their union) and slices it must not
# group, per q block of 128 rows: [0] one group whose first warpgroup's rows lie in both slices, with
# different key ends (its interior tiles are the intersection); [1] a 50-key gap (grouped) and a 400-key one
# (a group of its own); [2] rows overlapping (two groups: the shared rows take both slices' keys); [3] rows
# out of order in the list; [4] a slice without keys in the block (rows 600-639 attend nothing there: it
# ends the group); [5] the rest of that slice; [6] its last rows with a slice inside its keys (grouped), then
# three documents (one group of three).
GROUP_SLICES = [
    (0, 32, 0, 256, "full"), (32, 128, 0, 512, "full"),
    (128, 168, 0, 100, "full"), (168, 218, 150, 300, "full"), (218, 256, 700, 800, "full"),
    (256, 320, 300, 400, "causal"), (288, 384, 400, 520, "full"),
    (448, 512, 0, 128, "full"), (384, 448, 128, 256, "bi_causal"),
    (512, 600, 600, 700, "inv_causal"), (600, 800, 0, 100, "causal"), (800, 830, 40, 90, "full"),
    (830, 850, 830, 850, "causal"), (850, 870, 850, 870, "causal"), (870, 896, 870, 896, "causal"),
]


@pytest.mark.parametrize("d", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("capacity", [None, "0"])
def test_forward_walks_groups_of_slices(d, capacity, monkeypatch):
    # Against the float64 reference, from the block lists and by the scan (capacity 0), at each head dim's
    # key tile (128; 80 at D 192 and 256); the families of tests/test_ffa_gpu.py (sliding windows, block causal,
    # shared question) group too.
    if capacity is not None:
        monkeypatch.setenv("MAGI_JAX_CUDA_LIST_CAPACITY", capacity)
    q, k, types = zip(*[((a, b), (c, e), t) for a, b, c, e, t in GROUP_SLICES])
    run_case(AttnMask(list(q), list(k), list(types), 896, 896), hq=4, hkv=2, d=d, grads=False, seed=d)


@pytest.mark.parametrize("sm_margin", [8, 120, 10_000])
def test_sm_margin_gives_the_same_bits(sm_margin):
    # Fewer persistent CTAs (8 SMs left free; 12 CTAs; 1 CTA) take more tiles each; each tile's result does
    # not depend on which CTA computes it.
    rng = np.random.default_rng(13)
    mask = masks.varlen_causal([3000, 700, 2400])
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 4, 4, 128, jnp.bfloat16)
    qr, kr, types = mask.kernel_args()
    fwd = lambda m: jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types, sm_margin=m))(q, k, v)
    for a, b in zip(fwd(0), fwd(sm_margin)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4), (6, 3)])
def test_l2_sections_give_the_same_bits(hq, hkv, monkeypatch):
    # Three tile orders: one L2 section (MAGI_JAX_SM90_L2_BYTES huge), one GQA group per section with a wider
    # last one (L2_BYTES=1: on these 16 documents of 1024 tokens the last section starts at head 4, 1, 2 of
    # 8, 4, 6 by TailSectionStart; cuda/tools/sched_sim.py tail_section_start), and the default. A tile's
    # result does not depend on when it runs.
    rng = np.random.default_rng(14)
    mask = masks.varlen_causal([1024] * 16)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hkv, 128, jnp.bfloat16)
    qr, kr, types = mask.kernel_args()
    fwd = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types))
    want = [np.asarray(x) for x in fwd(q, k, v)]
    for l2_bytes in ("1", str(1 << 50)):
        monkeypatch.setenv("MAGI_JAX_SM90_L2_BYTES", l2_bytes)
        for a, b in zip(want, fwd(q, k, v)):
            np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("d", [64, 128])
def test_claim_leads_give_the_same_bits(d, monkeypatch):
    # MAGI_JAX_SM90_CLAIM_LEAD moves when the tile warp takes the next tile (flash_fwd_sm90_kernel.h,
    # claim_next): after the last K/V load of the tile before (0), a step or three before it, or at its start (a
    # lead longer than any walk). Long walks (a 6000-token document), short ones (windows of 256), and q
    # blocks with no keys (rows 9000-10000 attend nothing: tiles without steps, which arrive at their start).
    rng = np.random.default_rng(16)
    win = masks.sliding_window([3000], 256)
    mask = AttnMask([[0, 6000], *[[6000 + s, 6000 + e] for s, e in win.q_ranges]],
                    [[0, 6000], *[[6000 + s, 6000 + e] for s, e in win.k_ranges]],
                    ["causal", *win.types], 10000, 9000)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 8, 2, d, jnp.bfloat16)
    qr, kr, types = mask.kernel_args()
    fwd = jax.jit(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types))
    want = [np.asarray(x) for x in fwd(q, k, v)]
    for lead in ("0", "1", "3", str(1 << 30)):
        monkeypatch.setenv("MAGI_JAX_SM90_CLAIM_LEAD", lead)
        for a, b in zip(want, fwd(q, k, v)):
            np.testing.assert_array_equal(a.view(np.uint8), np.asarray(b).view(np.uint8), err_msg=lead)


@pytest.mark.parametrize("deterministic", [False, True])
def test_chained_launches_give_the_same_bits(deterministic, monkeypatch):
    # Each call's small kernels and attention kernels are chained launches (programmatic dependent launch,
    # cuda/launch.h); MAGI_JAX_PDL=0 launches them plainly. Chaining changes when a kernel starts, never what
    # it reads: the forward is the same bits, and with deterministic=True the gradients too. The default dQ is
    # summed by reduce-adds in an order that may change between any two calls: it, and what the first call's
    # backward computes from it, agree to rounding. Two calls in one jitted step, so that a call's first
    # kernels follow the previous call's.
    rng = np.random.default_rng(16)
    mask = masks.varlen_causal([3000, 700, 1400, 1092])
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 8, 2, 128, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    qr, kr, types = mask.kernel_args()

    def step(q, k, v):
        def attn(q):
            return mj.flex_flash_attn(q, k, v, qr, kr, types, deterministic=deterministic)[0]
        out, vjp = jax.vjp(lambda q, k, v: attn(attn(q).astype(q.dtype)), q, k, v)
        return (out, *vjp(dout))

    f = jax.jit(step)
    want = [np.asarray(x) for x in f(q, k, v)]
    monkeypatch.setenv("MAGI_JAX_PDL", "0")
    got = [np.asarray(x) for x in f(q, k, v)]
    for name, a, b in zip(("out", "dq", "dk", "dv"), want, got):
        if name == "out" or deterministic:
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=name)
        else:
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=2e-2, atol=2e-2,
                                       err_msg=name)


# The backward's tile orders (cuda/launch_bwd_sm90.cu): longest first with the default L2 sections, one kv
# head per section (L2_BYTES=1, the last section wider; at 8 / 2 heads, D 128, it takes the GQA split: one q
# head per section), one section of all heads (L2_BYTES huge), and the grid's own order
# (MAGI_JAX_SM90_BWD_ORDER=grid); and the consumer warpgroups starting their walks together rather than half a
# step apart (MAGI_JAX_SM90_BWD_STAGGER=0: the same work, other timing).
BWD_ORDERS = {"default": {}, "sections_of_one": {"MAGI_JAX_SM90_L2_BYTES": "1"},
              "one_section": {"MAGI_JAX_SM90_L2_BYTES": str(1 << 50)}, "grid": {"MAGI_JAX_SM90_BWD_ORDER": "grid"},
              "even_start": {"MAGI_JAX_SM90_BWD_STAGGER": "0"}}


@pytest.mark.parametrize("order", sorted(BWD_ORDERS))
@pytest.mark.parametrize("hq, hkv, d", [(8, 2, 128), (6, 3, 64), (4, 2, 96), (4, 4, 256)])
def test_backward_tile_orders_against_reference(order, hq, hkv, d, monkeypatch):
    # Documents of very different lengths: very uneven k blocks, many more CTAs than SMs at D 64 / 128.
    for name, value in BWD_ORDERS[order].items():
        monkeypatch.setenv(name, value)
    run_case(masks.varlen_causal([5000, 300, 2000, 900]), hq=hq, hkv=hkv, d=d, seed=21)


@pytest.mark.parametrize("hq, hkv", [(8, 2), (4, 4)])
def test_backward_tile_orders_give_the_same_dk_dv(hq, hkv, monkeypatch):
    # A CTA owns its keys' dK and dV whenever it runs: the same bits in every order. dQ is summed by reduce-adds
    # from all CTAs of a row, in an order that changes with the tiles', so it agrees to rounding. Without the
    # GQA split, which L2_BYTES=1 would take at 8 / 2 heads (its dK, dV are summed by reduce-adds too).
    monkeypatch.setenv("MAGI_JAX_SM90_BWD_GQA_SPLIT", "0")
    rng = np.random.default_rng(15)
    mask = masks.varlen_causal([3000, 1024, 200, 2900])
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, hq, hkv, 128, jnp.bfloat16)
    dout = jnp.asarray(rng.standard_normal(q.shape), jnp.bfloat16)
    qr, kr, types = mask.kernel_args()

    def grads():
        _, vjp = jax.vjp(lambda q, k, v: mj.flex_flash_attn(q, k, v, qr, kr, types)[0], q, k, v)
        return [np.asarray(g, np.float32) for g in vjp(dout)]

    with monkeypatch.context() as m:
        m.setenv("MAGI_JAX_SM90_BWD_ORDER", "grid")
        want = grads()
    for order in ("default", "sections_of_one", "one_section", "even_start"):
        with monkeypatch.context() as m:
            for name, value in BWD_ORDERS[order].items():
                m.setenv(name, value)
            dq, dk, dv = grads()
        np.testing.assert_array_equal(dk.view(np.uint32), want[1].view(np.uint32))
        np.testing.assert_array_equal(dv.view(np.uint32), want[2].view(np.uint32))
        np.testing.assert_allclose(dq, want[0], rtol=2e-2, atol=2e-2 * np.abs(want[0]).max())


# The backward's GQA split (cuda/flash_bwd_sm90_kernel.h kGqaSplit: a CTA per (k block, q head), dK and dV
# reduce-added in fp32 and converted after): forced (MAGI_JAX_SM90_BWD_GQA_SPLIT=1, one L2 section of all q
# heads at these sizes), forced with the grid's own order, off (=0: a CTA per kv head), and taken by the default
# rule: as it stands (these calls' 8-15 k blocks x 2 kv heads leave SMs idle) and by its L2 term
# (MAGI_JAX_SM90_L2_BYTES=1: every group's Q and dO exceed the budget; sections of one q head). The handler
# reads the variables at every call.
GQA_SPLIT = {"default": {}, "on": {"MAGI_JAX_SM90_BWD_GQA_SPLIT": "1"},
             "on_grid_order": {"MAGI_JAX_SM90_BWD_GQA_SPLIT": "1", "MAGI_JAX_SM90_BWD_ORDER": "grid"},
             "off": {"MAGI_JAX_SM90_BWD_GQA_SPLIT": "0"}, "by_budget": {"MAGI_JAX_SM90_L2_BYTES": "1"}}
# Documents of uneven lengths (the last k block's keys past Tk clipped: 1893 = 14 x 128 + 101); rows in no
# slice, a slice with an empty q range, keys nobody attends (dK = dV = 0: accumulators nothing adds into,
# whole k blocks among them); softcap in fp16 (the split's other instantiations).
GQA_SPLIT_CASES = {
    "varlen_causal": (masks.varlen_causal([700, 130, 1063]), {}),
    "rows_and_keys_with_nothing": (AttnMask([[100, 300], [300, 300], [380, 900]], [[0, 200], [0, 500], [600, 900]],
                                            ["full", "full", "causal"], 1000, 950), {}),
    "softcap_fp16": (masks.varlen_causal([300, 1200, 77]), {"dtype": jnp.float16, "softcap": 20.0}),
}


@pytest.mark.parametrize("case", sorted(GQA_SPLIT_CASES))
@pytest.mark.parametrize("split", sorted(GQA_SPLIT))
def test_backward_gqa_split_against_reference(split, case, monkeypatch):
    for name, value in GQA_SPLIT[split].items():
        monkeypatch.setenv(name, value)
    mask, kwargs = GQA_SPLIT_CASES[case]
    run_case(mask, hq=8, hkv=2, d=128, seed=41, **kwargs)


@pytest.mark.parametrize("split, packed", [(0, True), (0, False), (256, True)])
def test_backward_gqa_split_on_the_second_key_source(split, packed, monkeypatch):
    # A staged distributed backward's stage call (split 0: every key the second source's) takes the split too,
    # its accumulators laid out as dk2 (packed: dV's heads after dK's in each row); with keys in both sources
    # (256) it does not apply, forced or not. Against the same keys in one array with the split off.
    rng = np.random.default_rng(43 + split)
    mask = masks.varlen_causal([700, 130, 1063])
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 8, 2, 128, jnp.bfloat16)
    monkeypatch.setenv("MAGI_JAX_SM90_BWD_GQA_SPLIT", "0")
    want, _ = split_key_grads(mask, q, k, v, split, packed=packed)
    monkeypatch.setenv("MAGI_JAX_SM90_BWD_GQA_SPLIT", "1")
    _, got = split_key_grads(mask, q, k, v, split, packed=packed)
    for name, a, b in zip(["dq", "dk", "dv"], want, got):
        _assert_close_rel(b, a, 1e-2, name)   # dk, dv: fp32 sums rounded once; dq: the reduce-adds' order


def test_forward_is_bitwise_repeatable():
    rng = np.random.default_rng(12)
    mask = masks.sliding_window([5000, 3000, 700], 512)
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 8, 8, 128, jnp.bfloat16)
    first = _forward(mask, q, k, v, "sm90")
    for _ in range(2):
        again = _forward(mask, q, k, v, "sm90")
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_agrees_with_mma_sync_forward_on_a_long_mask(dtype):
    lens = [6000, 2192]
    mask = masks.varlen_causal(lens)
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, 8192, 8192, 4, 4, 128, dtype)
    out, lse = _forward(mask, q, k, v, "sm90")
    ref_out, ref_lse = _forward(mask, q, k, v, "mma")
    # Both are fp32-accumulated flash attention over the same tiles: bf16/fp16 rounding of P differs only
    # through the order of the key tiles' max updates, far inside the dtype's resolution.
    np.testing.assert_allclose(lse, ref_lse, rtol=0, atol=1e-3)
    rel = np.linalg.norm(out - ref_out) / np.linalg.norm(ref_out)
    assert rel < 1e-2, rel


def _gradients(mask, q, k, v, kernel, deterministic=False):
    """out, dq, dk, dv (float32 numpy) of one forward + backward with the kernel named ("sm90" or "mma")."""
    qr, kr, types = mask.kernel_args()
    do = jnp.asarray(np.random.default_rng(99).standard_normal(q.shape), q.dtype)

    def loss(q, k, v):
        out, _ = mj.flex_flash_attn(q, k, v, qr, kr, types, deterministic=deterministic)
        return jnp.sum(out.astype(jnp.float32) * do.astype(jnp.float32)), out

    with _kernel(kernel):
        (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
        return [np.asarray(x, np.float32) for x in (out, *grads)]


def _assert_close_rel(a, b, tol, what):
    rel = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)
    assert rel < tol, (what, rel)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_smoke_sm90_backward_matches_mma_sync(d, deterministic):
    # The forward smoke mask (two slices, one causal, unaligned edges, GQA), now with gradients: one CTA
    # per (k block, kv head), fewer than the SMs; a k block with keys past the end (400 = 3 x 128 + 16).
    mask = AttnMask([[0, 300], [100, 333]], [[0, 300], [250, 400]], [1, 0], 333, 400)
    rng = np.random.default_rng(d + 7)
    q, k, v = random_qkv(rng, 333, 400, 4, 2, d, jnp.bfloat16)
    got = _gradients(mask, q, k, v, "sm90", deterministic)
    ref = _gradients(mask, q, k, v, "mma", deterministic)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
        _assert_close_rel(a, b, 1e-2, name)


def test_sm90_deterministic_backward_is_bitwise_repeatable():
    # deterministic=True: sm90 dK/dV (each CTA owns its keys, a fixed walk) + the mma.sync dq kernel.
    rng = np.random.default_rng(21)
    mask = masks.varlen_causal([3000, 1200, 700])
    q, k, v = random_qkv(rng, mask.total_seqlen_q, mask.total_seqlen_k, 8, 2, 128, jnp.bfloat16)
    first = _gradients(mask, q, k, v, "sm90", deterministic=True)
    for _ in range(2):
        again = _gradients(mask, q, k, v, "sm90", deterministic=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_sm90_backward_agrees_with_mma_sync_on_a_long_mask(dtype, deterministic):
    # Many row tiles per k block (thousands of rows per key), GQA group of 2, two documents.
    mask = masks.varlen_causal([6000, 2192])
    rng = np.random.default_rng(23)
    q, k, v = random_qkv(rng, 8192, 8192, 8, 4, 128, dtype)
    got = _gradients(mask, q, k, v, "sm90", deterministic)
    ref = _gradients(mask, q, k, v, "mma", deterministic)
    # Both accumulate in fp32 over the same cells; P^T / dS^T are rounded to the dtype in both. The atomic
    # dq differs in summation order only.
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, ref):
        _assert_close_rel(a, b, 1e-2, name)


@pytest.mark.parametrize("d", [64, 128])
def test_sm90_backward_softcap_many_slices(d):
    # Softcap's derivative path and a k block touched by many slices (the k-block walk), against float64.
    lens = [130, 257, 70, 511, 300]
    run_case(masks.varlen_causal(lens), hq=4, hkv=1, d=d, seed=31, softcap=20.0)
