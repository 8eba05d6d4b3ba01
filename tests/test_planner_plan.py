"""make_plan: cell-by-cell coverage, layouts, padding, dispatch permutation, errors, hashing."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from magi_jax.mask import AttnMask
from magi_jax.planner import CostModel, make_plan
from magi_jax.planner.plan import default_chunk_size
from magi_jax.planner.stages import stage_timing

from tests.test_planner_helpers import check_coverage, random_masks, varlen_causal

SOLVER_NAMES = ["comm_aware", "minheap", "zigzag", "contiguous"]


@settings(derandomize=True, max_examples=400, deadline=None)
@given(mask=random_masks(), data=st.data())
def test_coverage_random_masks(mask, data):
    _random_plan_covers(mask, data, max_cp=4)


@settings(derandomize=True, max_examples=60, deadline=None)
@given(mask=random_masks(max_len=160, max_slices=24), data=st.data())
def test_coverage_larger_random_masks(mask, data):
    _random_plan_covers(mask, data, max_cp=8)


def _random_plan_covers(mask, data, max_cp):
    T = mask.total_seqlen_q
    cp = data.draw(st.integers(1, min(max_cp, T)))
    chunk = data.draw(st.integers(1, max(1, T // cp)))
    solver = data.draw(st.sampled_from(SOLVER_NAMES))
    overlap = data.draw(st.sampled_from(["auto", 0, 1, 2, 3]))
    plan = make_plan(mask, cp=cp, chunk_size=chunk, solver=solver, overlap=overlap)
    check_coverage(plan)
    assert plan.stats().area.sum() == mask.area()


@pytest.mark.parametrize("solver", SOLVER_NAMES)
@pytest.mark.parametrize("overlap", [0, 1, 3, "auto"])
def test_coverage_documents(solver, overlap):
    mask = varlen_causal([37, 5, 60, 1, 12, 90, 3, 48])  # 256 tokens
    plan = make_plan(mask, cp=4, chunk_size=8, solver=solver, overlap=overlap)
    check_coverage(plan)
    if overlap != "auto" and plan.num_stages:
        assert plan.num_stages <= max(1, overlap)


def test_padding_and_permutation():
    mask = varlen_causal([5, 9, 3])                           # 17 tokens, pads to 24 with cp=3, chunk 4
    plan = make_plan(mask, cp=3, chunk_size=4)
    assert (plan.seqlen, plan.padded_seqlen, plan.local_len) == (17, 24, 8)
    perm = plan.dispatch_perm
    assert perm.dtype == np.int32 and perm.shape == (24,)
    assert sorted(perm[perm >= 0].tolist()) == list(range(17)) and (perm < 0).sum() == 7
    pos = plan.position_ids()
    assert np.array_equal(np.where(pos < 17, pos, -1), perm)
    x = np.arange(17) * 10
    x_d = np.concatenate([x, np.zeros(7, x.dtype)])[pos]      # dispatch
    assert np.array_equal(x_d[plan.undispatch_perm], x)        # undispatch
    for r, p in enumerate(plan.partitions):                    # each rank holds its chunks in order
        assert list(p) == sorted(p) and len(p) == plan.chunks_per_rank
        assert np.array_equal(pos[r * 8:(r + 1) * 8], (np.array(p)[:, None] * 4 + np.arange(4)).ravel())
    check_coverage(plan)


@pytest.mark.parametrize("T, cp", [(1, 1), (17, 2), (17, 4), (17, 8), (257, 2), (257, 4), (257, 8), (1000, 2),
                                   (1000, 4), (1000, 8)])   # (a length below cp can't be planned by any solver)
def test_zigzag_pads_to_an_even_chunk_count_per_rank(T, cp):
    mask = varlen_causal([T - T // 3, T // 3] if T > 2 else [T])
    for chunk_size in (None, 2):
        plan = make_plan(mask, cp=cp, chunk_size=chunk_size, solver="zigzag")
        assert plan.padded_seqlen % (2 * plan.chunk_size * cp) == 0 and plan.chunks_per_rank % 2 == 0
        assert plan.padded_seqlen - T < 2 * plan.chunk_size * cp
        perm = plan.dispatch_perm
        assert sorted(perm[perm >= 0].tolist()) == list(range(T))          # every real token exactly once
        assert np.array_equal(perm[plan.undispatch_perm], np.arange(T))
        check_coverage(plan)


def test_zigzag_distributed_attention_on_an_awkward_length():
    """257 tokens at cp=4, chunk 16: 17 chunks would pad to 5 per rank; zigzag's plan pads to 6 (384 tokens).
    Forward and gradients through dispatch, calc_attn, undispatch equal single-device flex_flash_attn."""
    import jax
    import jax.numpy as jnp
    import magi_jax as mj
    from tests.test_dist_helpers import global_fn, mesh_of
    mask = varlen_causal([100, 57, 100])
    mp = mj.plan(mask, mesh_of(4), solver="zigzag", chunk_size=16, num_heads_q=2, head_dim=64)
    assert mp.plan.padded_seqlen == 384

    def loss_and_outputs(attn):
        def f(q, k, v):
            out, lse = attn(q, k, v)
            return jnp.sum(jnp.sin(out)) + jnp.sum(lse), (out, lse)
        return jax.value_and_grad(f, argnums=(0, 1, 2), has_aux=True)

    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((257, 2, 64)), jnp.float32) for _ in range(3))
    (_, want), dwant = loss_and_outputs(lambda q, k, v: mj.flex_flash_attn(q, k, v, mask=mask))(q, k, v)
    (_, got), dgot = loss_and_outputs(global_fn(mp))(q, k, v)
    for name, g, w in zip(["out", "lse", "dq", "dk", "dv"], (*got, *dgot), (*want, *dwant)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-5, atol=2e-5, err_msg=name)


def test_padding_rows_get_no_slices():
    plan = make_plan(AttnMask([[0, 10]], [[0, 10]], ["full"], 10, 10), cp=4, chunk_size=2)
    pos = plan.position_ids()
    for r in range(4):
        rows = pos[r * plan.local_len:(r + 1) * plan.local_len]
        lists = [plan.host.of_rank(r)] + [s.slices.of_rank(r) for s in plan.stages]
        for q, _, _ in lists:
            for a, b in q:
                assert (rows[a:b] < 10).all()


def test_layout_shapes_and_padding_slices():
    mask = varlen_causal([100, 28, 64, 40, 24])
    plan = make_plan(mask, cp=4, chunk_size=8, overlap=2)
    for ss in [plan.host] + [s.slices for s in plan.stages]:
        cp, N = ss.types.shape
        assert cp == 4 and ss.q_ranges.shape == (4, N, 2) and ss.k_ranges.shape == (4, N, 2)
        assert ss.q_ranges.dtype == ss.k_ranges.dtype == ss.types.dtype == np.int32
        empty = ss.q_ranges[:, :, 1] == ss.q_ranges[:, :, 0]
        assert (ss.q_ranges[empty] == 0).all() and (ss.k_ranges[empty] == 0).all()
        assert (ss.q_ranges[:, :, 1] <= plan.local_len).all()
    for s in plan.stages:
        t = s.transfers
        assert (s.slices.k_ranges[:, :, 1] <= t.buffer_len).all()
        assert t.buffer_len == t.recv_tokens.max()
        # every row's destination block lies inside the buffer; sources inside the local buffer
        assert ((t.dst_start + t.src_end - t.src_start) <= t.buffer_len).all()
        assert (t.src_end <= plan.local_len).all() and (t.src != t.dst).all()


def test_transfer_indices_match_tables():
    mask = varlen_causal([70, 10, 50, 30, 40, 56])
    plan = make_plan(mask, cp=4, chunk_size=8, solver="minheap", overlap=2)
    L = plan.local_len
    for i, s in enumerate(plan.stages):
        t = s.transfers
        send, recv = t.send_index(), t.recv_index()
        m = t.pair_max
        assert send.shape == (4, 4, m) and recv.shape == (4, t.buffer_len)
        # emulate all_to_all on global token ids: rank src's row dst goes to rank dst's row src
        sent = np.where(send >= 0, plan.dispatch_perm[np.arange(4)[:, None, None] * L + np.maximum(send, 0)], -1)
        received = sent.transpose(1, 0, 2).reshape(4, 4 * m)          # [dst, src * m]
        got = np.where(recv >= 0, np.take_along_axis(received, np.maximum(recv, 0), axis=1), -1)
        assert np.array_equal(got, plan.recv_global_keys(i))
        assert np.array_equal((send >= 0).sum(axis=2), t.pair_tokens)
        shifts = t.shift_tokens()
        assert shifts[0] == 0 and shifts.max() == t.pair_max
        assert all(shifts[(d - s_) % 4] >= t.pair_tokens[s_, d] for s_ in range(4) for d in range(4) if s_ != d)


def test_keys_sent_once_per_stage_and_rank():
    plan = make_plan(varlen_causal([200, 56]), cp=4, chunk_size=8, solver="minheap", overlap=3)
    for r in range(4):
        keys = np.concatenate([plan.recv_global_keys(s)[r] for s in range(plan.num_stages)])
        keys = keys[keys >= 0]
        assert len(keys) == len(set(keys.tolist())) == plan.stats().remote_keys[r]


def test_fused_slices_cover_the_same_cells():
    plan = make_plan(varlen_causal([50, 14, 30, 34]), cp=2, chunk_size=8, solver="minheap", overlap=0)
    assert plan.overlap_degree == 0 and plan.num_stages == 1
    fused = plan.fused_slices()
    L, T = plan.local_len, plan.seqlen
    keys_of = [np.concatenate([plan.position_ids()[r * L:(r + 1) * L], plan.recv_global_keys(0)[r]])
               for r in range(2)]
    full = plan.mask.to_dense()
    for r in range(2):
        q, k, t = fused.of_rank(r)
        d = AttnMask(q, k, t, L, len(keys_of[r])).to_dense()
        got = np.zeros((L, T), np.int64)
        for j, g in enumerate(keys_of[r]):
            if g >= 0:
                got[:, g] += d[:, j]
        rows = plan.position_ids()[r * L:(r + 1) * L]
        assert np.array_equal(got, full[rows])


def test_worked_example_of_the_docstring():
    plan = make_plan(varlen_causal([6, 2]), cp=2, chunk_size=2, solver="minheap", overlap=1)
    assert plan.chunk_areas.tolist() == [3, 7, 11, 3]
    assert plan.partitions == ((2, 3), (0, 1))
    assert plan.dispatch_perm.tolist() == [4, 5, 6, 7, 0, 1, 2, 3]
    q, k, t = plan.host.of_rank(0)
    assert (q.tolist(), k.tolist(), t.tolist()) == ([[0, 2], [2, 4]], [[0, 2], [2, 4]], [1, 1])
    q, k, t = plan.host.of_rank(1)
    assert (q.tolist(), k.tolist(), t.tolist()) == ([[0, 4]], [[0, 4]], [1])
    assert plan.host.q_ranges.shape == (2, 2, 2) and plan.host.q_ranges[1, 1].tolist() == [0, 0]
    (stage,) = plan.stages
    tr = stage.transfers
    assert (tr.src.tolist(), tr.dst.tolist(), tr.src_start.tolist(), tr.src_end.tolist(),
            tr.dst_start.tolist(), tr.buffer_len) == ([1], [0], [0], [4], [0], 4)
    q, k, t = stage.slices.of_rank(0)
    assert (q.tolist(), k.tolist(), t.tolist()) == ([[0, 2]], [[0, 4]], [0])
    assert stage.slices.of_rank(1)[0].shape == (0, 2)
    assert stage.slices.q_ranges.shape == (2, 1, 2)     # rank 1 holds one empty padding slice


def test_hashable_equal_and_cached():
    mask = varlen_causal([30, 34])
    a = make_plan(mask, cp=2, chunk_size=8)
    b = make_plan(varlen_causal([30, 34]), cp=2, chunk_size=8)
    c = make_plan(mask, cp=2, chunk_size=4)
    assert a == b and hash(a) == hash(b) and a is b          # cached on equal inputs
    assert a != c
    assert len({a, b, c}) == 2
    with pytest.raises(Exception):
        a.cp = 3
    arrays = [a.dispatch_perm, a.undispatch_perm, a.host.q_ranges, a.host.types, a.stats().area]
    arrays += [x for s in a.stages for x in (s.slices.k_ranges, s.transfers.src_start, s.transfers.pair_tokens)]
    assert not any(x.flags.writeable for x in arrays)


def test_stats():
    mask = varlen_causal([100, 28, 64, 40, 24])
    plan = make_plan(mask, cp=4, chunk_size=8)
    s = plan.stats()
    assert s.area.sum() == mask.area()
    assert np.array_equal(s.area, s.host_area + s.stage_area.sum(axis=0))
    assert s.imbalance == pytest.approx(s.area.max() / s.area.mean())
    assert s.remote_keys.sum() == s.sent_keys.sum()
    assert s.predicted_time_s > 0 and len(s.rank_time_s) == 4
    assert "imbalance" in s.table()


def test_default_chunk_size():
    assert default_chunk_size(8192 * 64, 64) == 1024
    assert default_chunk_size(1 << 20, 64) == 2048
    assert default_chunk_size(100, 2) == 4
    plan = make_plan(varlen_causal([100, 60]), cp=2)
    assert plan.chunk_size == default_chunk_size(160, 2) and plan.chunks_per_rank >= 8


def test_cost_model_calibration_changes_stages():
    mask = varlen_causal([700, 200, 124])
    slow_net = CostModel(bytes_per_s=1e6)
    p = make_plan(mask, cp=4, chunk_size=16, solver="minheap", cost_model=slow_net)
    assert p.cost_model == slow_net and p.overlap_degree in range(0, 9)
    cal = CostModel.calibrated(attn_cells=1e9, attn_seconds=1e-3, num_heads_q=8, head_dim=64,
                               comm_bytes=1e8, comm_seconds=1e-3)
    assert cal.flops_per_s == pytest.approx(4 * 8 * 64 * 1e12) and cal.bytes_per_s == pytest.approx(1e11)


def test_head_dim_v_prices_mla_cells_and_keys():
    """MLA (q / k 192, v 128): a cell costs q k^T at 192 plus p v at 128; a key travels as K and V both at 192
    (packed, v padded on the wire). Without head_dim_v, v is priced at head_dim."""
    model = CostModel()
    assert model.cell_seconds(8, 192, 128) == pytest.approx(2 * 8 * (192 + 128) / model.flops_per_s)
    assert model.cell_seconds(8, 192) == pytest.approx(4 * 8 * 192 / model.flops_per_s)
    assert model.key_seconds(2, 192, 128) == model.key_seconds(2, 192) == model.key_seconds(2, 128, 192)
    mask = varlen_causal([700, 200, 124])
    mla = make_plan(mask, cp=4, chunk_size=16, head_dim=192, head_dim_v=128)
    same = make_plan(mask, cp=4, chunk_size=16, head_dim=192)
    assert (mla.head_dim, mla.head_dim_v, same.head_dim_v) == (192, 128, 192) and mla != same
    assert mla.stats().flops == pytest.approx(2 * int(mla.stats().area.sum()) * 16 * (192 + 128))
    assert mla.stats().predicted_time_s < same.stats().predicted_time_s
    cal = CostModel.calibrated(attn_cells=1e9, attn_seconds=1e-3, num_heads_q=8, head_dim=192, head_dim_v=128,
                               comm_bytes=1e8, comm_seconds=1e-3)
    assert cal.cell_seconds(8, 192, 128) * 1e9 == pytest.approx(1e-3)   # the measured call, priced back


def test_stage_timing_lets_ranks_peak_in_different_stages():
    """Rank 0 heavy on host cells, rank 1 on remote ones: with one overlap stage their peaks run at the same
    time, so degree 1 beats degree 0 (a bulk-synchronous sum of per-stage maxima would say the opposite)."""
    model = CostModel(flops_per_s=1.0, bytes_per_s=1.0, collective_latency_s=0.0, launch_s=0.0, dtype_bytes=1)
    host = np.array([10.0, 2.0])
    dst, src, tokens = np.array([1, 0]), np.array([0, 1]), np.array([1.0, 1.0])
    area, stage = np.array([8.0, 1.0]), np.zeros(2, np.int64)
    kw = dict(cell_s=1.0, key_s=0.5, model=model)
    fused = stage_timing(0, 2, host, dst, src, tokens, area, stage, **kw)
    staged = stage_timing(1, 2, host, dst, src, tokens, area, stage, **kw)
    # comm 0.5 (one key each way); fused: 0.5 + max(10 + 1, 2 + 8); staged: max(host, 0.5) + remote
    assert fused.total == pytest.approx(11.5)
    assert staged.per_rank == pytest.approx([11.0, 10.0]) and staged.total == pytest.approx(11.0)
    # a slow network: stage 0's keys land after rank 1's host call, so rank 1 waits for them
    slow = stage_timing(1, 2, host, dst, src, tokens, area, stage, cell_s=1.0, key_s=5.0, model=model)
    assert slow.per_rank == pytest.approx([11.0, 13.0])


def test_auto_overlap_prefers_a_stage_when_compute_hides_the_fetch():
    plan = make_plan(varlen_causal([300, 500, 224]), cp=2, chunk_size=32)
    assert plan.overlap_degree >= 1 and plan.num_stages >= 1


@pytest.mark.parametrize("kwargs, match", [
    (dict(cp=0), "cp"),
    (dict(cp=2, chunk_size=0), "chunk_size"),
    (dict(cp=8, chunk_size=4), "only 4 chunks"),
    (dict(cp=2, solver="nope"), "solver"),
    (dict(cp=2, overlap=9), "overlap"),
    (dict(cp=2, num_heads_q=6, num_heads_kv=4), "multiple"),
    (dict(cp=2, head_dim=0), "head_dim"),
    (dict(cp=2, head_dim_v=-1), "^head_dim_v: expected"),
    (dict(cp=2, cost_model="fast"), "^cost_model: expected"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_plan(varlen_causal([10, 6]), **kwargs)


def test_cross_attention_is_rejected_plainly():
    with pytest.raises(ValueError, match="cross-attention.*not supported"):
        make_plan(AttnMask([[0, 4]], [[0, 6]], ["full"], 4, 6), cp=2, chunk_size=1)
    with pytest.raises(TypeError, match="AttnMask"):
        make_plan("causal", cp=2)


def test_mask_lengths_disagreeing_with_arrays_are_rejected():
    with pytest.raises(ValueError, match="out of bounds"):
        AttnMask([[0, 12]], [[0, 12]], ["causal"], 10, 10)


def test_planner_does_not_import_jax():
    # magi_jax/__init__ loads the kernel layer (jax); the planner layer below it must not need it, so load
    # the package without its __init__ and check that planning never brings jax in.
    import subprocess
    from pathlib import Path
    pkg = Path(__file__).resolve().parents[1] / "magi_jax"
    code = ("import sys, types; m = types.ModuleType('magi_jax'); m.__path__ = [%r]; sys.modules['magi_jax'] = m\n"
            "import magi_jax.planner as p, magi_jax.planner.cli, magi_jax.planner.workloads as w\n"
            "p.make_plan(w.varlen_mask([40, 24]), cp=2, chunk_size=4)\n"
            "print(sorted(k for k in sys.modules if k.split('.')[0] in ('jax', 'jaxlib')))") % str(pkg)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def _families():
    from magi_jax import masks
    docs = [37, 5, 60, 1, 12, 90, 3, 48]                        # 256 tokens
    return {
        "full": masks.full(96), "causal": masks.causal(128), "varlen_full": masks.varlen_full(docs),
        "varlen_causal": masks.varlen_causal(docs), "sliding_window": masks.sliding_window(docs, 9),
        "sliding_window_bi": masks.sliding_window(docs, 7, causal=False),
        "block_causal": masks.block_causal(docs, 16),
        "shared_question": masks.shared_question([(20, [30, 14, 9]), (40, [50, 13]), (64, [16])]),
        "prefix_lm": masks.prefix_lm(docs, [n // 2 for n in docs]),
        "global_sliding_window": masks.global_sliding_window(docs, 8, 4),
        "causal_blockwise": masks.causal_blockwise(docs),
    }


@pytest.mark.parametrize("name", sorted(_families()))
@pytest.mark.parametrize("solver", ["comm_aware", "minheap"])
def test_coverage_mask_families(name, solver):
    mask = _families()[name]
    plan = make_plan(mask, cp=4, chunk_size=4, solver=solver, overlap="auto")
    check_coverage(plan)
    assert plan.stats().area.sum() == mask.area()


def test_capacity_of_rejects_infinite_headroom_and_non_plans():
    from magi_jax.planner.plan import PlanCapacity
    mask = varlen_causal([10, 6])
    plan = make_plan(mask, cp=2, chunk_size=2)
    assert PlanCapacity.of([plan, plan.capacity()]) == plan.capacity()
    for headroom in (float("inf"), float("nan"), 0.5):
        with pytest.raises(ValueError, match="headroom: must be finite and >= 1"):
            PlanCapacity.of([plan], headroom=headroom)
    with pytest.raises(ValueError, match=r"plans: element 1 \(AttnMask\) is not a"):
        PlanCapacity.of([plan, mask])
    with pytest.raises(ValueError, match=r"plans: element 0 \(str\)"):
        PlanCapacity.of(["causal"])
