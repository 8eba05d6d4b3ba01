"""bench/kernel.py's target check (the speed issue's targets), on made-up results: no GPU needed."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def kernel_bench():
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "kernel.py"
    spec = importlib.util.spec_from_file_location("bench_kernel_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module          # dataclasses look the module up by name
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def row(case, impl, mode, tflops):
    return dict(case=case, impl=impl, mode=mode, tflops=tflops, ms=1.0)


def test_target_check_ratio_absolute_and_missing(kernel_bench):
    results = [
        row("causal_32k", "ffa", "fwd", 600.0), row("causal_32k", "cudnn", "fwd", 580.0),
        row("causal_32k", "tokamax", "fwd", 620.0),                     # the best peer decides: 0.97x
        row("causal_32k", "ffa", "fwd+bwd", 580.0), row("causal_32k", "cudnn", "fwd+bwd", 570.0),
        row("varlen_swa1024_32k", "ffa", "fwd", 501.0),
        row("varlen_swa1024_32k", "ffa", "fwd+bwd", 399.0),
    ]
    text = kernel_bench.target_check(results, "ffa")
    assert text.splitlines()[0] == "issue 4 targets for ffa: 2 of 4 met"
    assert "causal_32k fwd: 0.967x cudnn/tokamax (target 1.0x): MISSED" in text
    assert "causal_32k fwd+bwd: 1.017x cudnn (target 1.0x): met" in text
    assert "varlen_swa1024_32k fwd: 501.0 TFLOP/s (target 500): met" in text
    assert "varlen_swa1024_32k fwd+bwd: 399.0 TFLOP/s (target 400): MISSED" in text
    # A case absent from the run is not counted; an implementation that failed is a miss.
    assert "varlen_causal_64k" not in text
    failed = kernel_bench.target_check([row("causal_4k_x8", "cudnn", "fwd", 500.0)], "ffa")
    assert failed.splitlines()[0] == "issue 4 targets for ffa: 0 of 2 met"
    assert "causal_4k_x8 fwd: not measured (MISSED)" in failed
    # Against the best of two peers, both must have run.
    one_peer = kernel_bench.target_check(results[:2], "ffa")
    assert "causal_32k fwd: tokamax not measured (MISSED)" in one_peer
    # A near miss does not read as the target (575.4 / 575.5 = 0.99983).
    tie = kernel_bench.target_check([row("causal_32k", "ffa", "fwd+bwd", 575.4),
                                     row("causal_32k", "cudnn", "fwd+bwd", 575.5)], "ffa")
    assert "causal_32k fwd+bwd: 0.999x cudnn (target 1.0x): MISSED" in tie


def test_every_target_names_a_benchmarked_case(kernel_bench):
    names = {c.name for c in kernel_bench.make_cases()}
    assert {case for case, _ in kernel_bench.ISSUE4_TARGETS} <= names


def test_table_has_a_ratio_column_per_scheduler_variant(kernel_bench):
    results = [row("causal_32k", "ffa", "fwd+bwd", 500.0), row("causal_32k", "cudnn", "fwd+bwd", 550.0),
               row("causal_32k", "ffa_bwd_grid", "fwd+bwd", 400.0)]
    lines = kernel_bench.table(results).splitlines()
    assert lines[0] == ("| case | pass | ffa TFLOP/s (ms) | ffa_bwd_grid TFLOP/s (ms) | cudnn TFLOP/s (ms) | "
                        "ffa / cudnn | ffa / ffa_bwd_grid |")
    assert lines[1].count("---") == 7
    assert lines[3] == "| causal_32k | fwd+bwd | 500.0 (1.0) | 400.0 (1.0) | 550.0 (1.0) | 0.91 | 1.25 |"
    assert lines[2].endswith("| - | - |")  # no forward rows measured


def test_run_case_times_every_impl_over_rounds(kernel_bench):
    # a toy case on the CPU: both implementations compiled and checked first, then timed in 2 rounds
    from magi_jax import masks
    mask = masks.varlen_causal([96, 160])
    case = kernel_bench.Case("toy", mask, {"xla_dense": lambda: kernel_bench.xla_dense(mask)}, head_dim=64)
    results = []
    kernel_bench.run_case(case, ["ffa", "xla_dense"], results, rounds=2)
    assert {(r["impl"], r["mode"]) for r in results} == {(i, m) for i in ("ffa", "xla_dense")
                                                          for m in ("fwd", "fwd+bwd")}
    for r in results:
        assert len(r["ms_rounds"]) == 2 and min(r["ms_rounds"]) <= r["ms"] <= max(r["ms_rounds"]), r
        assert r["rel_diff_vs_ffa"] < 2e-2, r       # bf16 inputs, two implementations


def test_gqa_case_gives_k_and_v_its_kv_heads(kernel_bench):
    # The grouped-query case: k, v with 4 heads beside q's 16, FLOPs on q's heads; a toy of it on the CPU
    # runs ffa against XLA's dense attention (which takes the groups itself) and against FFA on k, v repeated to
    # the q heads (ffa_kv_repeat, dk and dv summed over each group by jax.grad), with close results.
    from magi_jax import masks
    case = next(c for c in kernel_bench.make_cases() if c.name == "varlen_causal_32k_gqa4")
    assert case.heads_kv == 4 and case.mask.num_slices > 1
    mask = masks.varlen_causal([96, 160])
    toy = kernel_bench.Case("toy", mask, {"xla_dense": lambda: kernel_bench.xla_dense(mask)}, head_dim=64, heads_kv=4)
    q, k, v = kernel_bench.case_inputs(toy)
    assert q.shape == (1, 256, kernel_bench.H, 64) and k.shape == v.shape == (1, 256, 4, 64)
    assert toy.flops == 2.0 * mask.area() * kernel_bench.H * 128
    toy.baselines["ffa_kv_repeat"] = lambda: kernel_bench.ffa_kv_repeat(mask)
    results = []
    kernel_bench.run_case(toy, ["ffa", "xla_dense", "ffa_kv_repeat"], results, rounds=1)
    others = [r for r in results if r["impl"] != "ffa"]
    assert len(others) == 4 and all(r["rel_diff_vs_ffa"] < 2e-2 for r in others), others
    assert "ffa_kv_repeat" in case.baselines


def test_gpu_table_times_over_ffa(kernel_bench):
    results = [dict(row("swa", "ffa", "fwd", 400.0), gpu_ms=0.5), dict(row("swa", "cudnn", "fwd", 410.0), gpu_ms=0.48),
               dict(row("swa", "ffa", "fwd+bwd", 350.0), gpu_ms=2.0), row("swa", "cudnn", "fwd+bwd", 340.0)]
    lines = kernel_bench.gpu_table(results).splitlines()
    assert lines[0] == "| case | pass | ffa GPU ms | cudnn GPU ms | cudnn / ffa |"
    assert lines[2] == "| swa | fwd | 0.5000 | 0.4800 | 0.9600 |"
    assert lines[3] == "| swa | fwd+bwd | 2.0000 | - | - |"      # cudnn's fwd+bwd without a GPU time
    assert kernel_bench.gpu_table([row("swa", "ffa", "fwd", 400.0)]) == ""


def test_run_case_gpu_time_is_absent_on_the_cpu(kernel_bench):
    # No GPU events in a CPU trace: the rows carry no gpu_ms (and the run goes on).
    from magi_jax import masks
    mask = masks.varlen_causal([64, 64])
    case = kernel_bench.Case("toy", mask, {}, head_dim=64)
    results = []
    kernel_bench.run_case(case, ["ffa"], results, rounds=1, gpu_time=True)
    assert len(results) == 2 and all("ms" in r and "gpu_ms" not in r for r in results)


def test_ffa_variant_environments(kernel_bench, monkeypatch):
    assert kernel_bench.kernel_env("ffa@MAGI_JAX_SM90_L2_BYTES=12582912,MAGI_JAX_SM90_SCHED=grid") == {
        "MAGI_JAX_SM90_L2_BYTES": "12582912", "MAGI_JAX_SM90_SCHED": "grid"}
    assert kernel_bench.kernel_env("ffa_bwd_even") == {"MAGI_JAX_SM90_BWD_STAGGER": "0"}
    assert kernel_bench.kernel_env("cudnn") == {}
    for bad in ("ffa@", "ffa@L2=1", "ffa@MAGI_JAX_SM90_L2_BYTES", "ffa@MAGI_JAX_SM90_L2_BYTES="):
        with pytest.raises(ValueError, match="--impls"):
            kernel_bench.kernel_env(bad)
    # Selecting one variant unsets what the one before it set.
    monkeypatch.delenv("MAGI_JAX_SM90_L2_BYTES", raising=False)
    kernel_bench.select_kernel("ffa@MAGI_JAX_SM90_L2_BYTES=123")
    assert kernel_bench.os.environ["MAGI_JAX_SM90_L2_BYTES"] == "123"
    kernel_bench.select_kernel("ffa")
    assert "MAGI_JAX_SM90_L2_BYTES" not in kernel_bench.os.environ


def test_table_has_a_column_and_a_ratio_per_ffa_variant(kernel_bench):
    variant = "ffa@MAGI_JAX_SM90_L2_BYTES=123"
    results = [row("causal_32k", "ffa", "fwd", 600.0), row("causal_32k", "cudnn", "fwd", 500.0),
               row("causal_32k", variant, "fwd", 300.0)]
    head, _, line = kernel_bench.table(results).splitlines()[:3]
    assert f"{variant} TFLOP/s (ms)" in head and f"ffa / {variant}" in head
    assert line.endswith("| 1.20 | 2.00 |")


@pytest.mark.parametrize("case_name", ["varlen_causal_32k", "varlen_swa1024_32k", "causal_4k_x8"])
def test_drop_in_baselines_compute_the_cases_mask(kernel_bench, case_name):
    """The ffa_nn and ffa_vmap columns (bench/kernel.py's baselines built lazily from closures) attend the
    case's own mask: on the CPU, one head of 64, against FFA on the case's AttnMask."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    case = next(c for c in kernel_bench.make_cases() if c.name == case_name)
    rng = np.random.default_rng(0)
    t = case.mask.total_seqlen_q
    q, k, v = (jnp.asarray(rng.standard_normal((1, t, 1, 64)), jnp.float32) for _ in range(3))
    want = np.asarray(kernel_bench.ffa(case.mask)(q, k, v))
    for impl in ("ffa_nn", "ffa_nn_traced", "ffa_vmap"):
        if impl not in case.baselines:
            continue
        got = np.asarray(jax.jit(case.baselines[impl]())(q, k, v))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=impl)


@pytest.mark.parametrize("v_padded", [False, True])
def test_stage_call_baseline_gives_ffas_output_and_gradients(kernel_bench, v_padded):
    """ffa_stage (K and V packed as a distributed stage call reads them, v narrower than k): out and the
    gradients of q, k, v those of FFA on separate arrays, on the CPU (a small causal mask, one head)."""
    import jax
    import jax.numpy as jnp

    from magi_jax import masks
    mask = masks.causal(200)
    rng = np.random.default_rng(1)
    q, k = (jnp.asarray(rng.standard_normal((1, 200, 1, 64)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((1, 200, 1, 40)), jnp.float32)
    cot = jnp.asarray(rng.standard_normal((1, 200, 1, 40)), jnp.float32)
    want_fn, got_fn = kernel_bench.ffa(mask), kernel_bench.ffa_stage(mask, v_padded=v_padded)
    for want, got in zip(jax.vjp(want_fn, q, k, v), jax.vjp(got_fn, q, k, v)):
        if callable(want):
            want, got = want(cot), got(cot)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
            assert a.shape == b.shape
            np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-5)


def test_window_sweep_counts_the_key_tiles_of_each_walk():
    from bench import window_sweep as ws
    from magi_jax import masks

    lens, w = [300, 700, 536], 200
    ks = ws.kb.window_start(lens, w)
    starts = np.repeat(np.cumsum([0] + lens[:-1]), lens)
    assert ks.tolist() == [max(int(s), q - w + 1) for q, s in enumerate(starts)]
    # tokamax's walk: per q block, every 128-key tile from the one holding its least first key to its own.
    brute = sum(1 for b in range(len(ks) // 128) for j in range(b + 1)
                if (j + 1) * 128 > ks[b * 128:(b + 1) * 128].min())
    assert ws.aligned_steps(ks) == brute
    # FFA's walk on one document of 4096, window 1024: q blocks 0-7 in the causal head (b + 1 tiles each),
    # 8-31 in the band, whose 128 rows see 1024 + 127 keys from the span's first: 9 tiles.
    steps = ws.ffa_steps(masks.sliding_window([4096], 1024))
    assert steps == sum(range(1, 9)) + 24 * 9
    assert type(steps) is int and type(ws.aligned_steps(ks)) is int  # the rows go to JSON


def test_window_sweep_bands_walk_the_windows_tiles_unmasked():
    from bench import window_sweep as ws
    from magi_jax import masks

    band = ws.band_mask(4096, 1024)
    dense = band.to_dense()
    rows, cols = np.indices(dense.shape)
    block_end = (rows // 128 + 1) * 128
    # q block b sees keys [128 b - 1024, 128 b + 128): whole key tiles, nothing masked inside them.
    np.testing.assert_array_equal(dense, ((cols < block_end) & (cols >= block_end - 128 - 1024)).astype(dense.dtype))
    assert ws.ffa_steps(band) == ws.ffa_steps(masks.sliding_window([4096], 1024))


def test_gqa_sweep_times_each_setting_and_leaves_the_environment_as_it_was(monkeypatch):
    from bench import gqa_sweep

    monkeypatch.delenv("MAGI_JAX_SM90_BWD_GQA_SPLIT", raising=False)
    for stage in (False, True):
        row = gqa_sweep.sweep_row(tokens=512, kv_heads=2, rounds=1, calls=1, stage=stage)
        assert sorted(row) == ["auto", "off", "on"]
        assert all(ms > 0 for ms in row.values()), row
    assert "MAGI_JAX_SM90_BWD_GQA_SPLIT" not in os.environ
