"""bench/dist.py end to end on 2 host devices at toy sizes (the GPU runs use the same code): every magi
variant and the baselines run, agree on their output, and the report and the profile come out. No GPU."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import bench.dist as dist  # noqa: E402

def toy(gpus: int = 2) -> list[str]:
    return ["--platform", "cpu", "--gpus", str(gpus), "--tokens-per-gpu", "1024", "--heads", "2", "--kv-heads", "2",
            "--head-dim", "64", "--dtype", "float32", "--reps", "1", "--warmup", "1", "--calls", "2",
            "--rounds", "2", "--no-append", "--masks", "varlen_causal"]


def test_methods_run_and_agree(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    methods = ["magi", "magi_bwd_fused", "magi_margin4", "allgather", "ring", "single", "magi_local",
               "allgather_minheap", "ring_minheap"]
    assert dist.main(toy() + ["--methods", *methods]) == 0
    results = json.loads((tmp_path / "dist_bench.json").read_text())
    assert {(r["method"], r["pass"]) for r in results} == {(m, p) for m in methods for p in ("fwd", "fwd+bwd")}
    for r in results:
        assert r["ms"] > 0 and r["tflops_per_gpu"] > 0, r
        assert len(r["ms_rounds"]) == 2 and min(r["ms_rounds"]) <= r["ms"] <= max(r["ms_rounds"]), r
        if r["method"] not in ("magi", "single", "magi_local"):  # dispatched output against magi's, float32
            assert r["rel_diff_vs_first"] < 1e-5, r
    table = capsys.readouterr().out
    assert "| varlen_causal | fwd+bwd |" in table and "magi / single" in table


def test_magi_local_compiles_without_collectives():
    # the diagnostic method: its traced step has no collective, magi's has; the transport is restored after
    import jax
    import magi_jax as mj
    from magi_jax import comm
    mesh = jax.make_mesh((2,), ("cp",), devices=jax.devices("cpu")[:2], axis_types=(jax.sharding.AxisType.Auto,))
    mask = dist.make_mask("varlen_causal", 2048)
    mp = mj.plan(mask, mesh, num_heads_q=2, num_heads_kv=2, head_dim=64)
    assert mp.num_stages >= 1
    x = jax.numpy.zeros((mp.padded_seqlen, 2, 64), jax.numpy.float32)
    step = jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp))
    with_transfers = step.lower(x, x, x).as_text()
    real = comm._transport
    with dist.transfers_for("magi_local"):
        local = jax.jit(lambda q, k, v: mj.calc_attn(q, k, v, mp)).lower(x, x, x).as_text()
    assert comm._transport is real
    assert ("all_to_all" in with_transfers or "collective_permute" in with_transfers)
    assert "all_to_all" not in local and "collective_permute" not in local


def test_data_parallel_groups(tmp_path, monkeypatch):
    # --dp 2 on 4 devices: a (dp 2, cp 2) mesh, each group its own batch element; the baselines shard the
    # batch the same way and agree with magi.
    monkeypatch.setenv("OUT", str(tmp_path))
    assert dist.main(toy(gpus=4) + ["--dp", "2", "--methods", "magi", "allgather", "ring"]) == 0
    results = json.loads((tmp_path / "dist_bench.json").read_text())
    assert {(r["gpus"], r["cp"], r["dp"]) for r in results} == {(4, 2, 2)}
    assert all(r["rel_diff_vs_first"] < 1e-5 for r in results if r["method"] != "magi")
    assert dist.main(toy(gpus=4) + ["--dp", "3", "--methods", "magi"]) == 2  # 4 devices are not 3 groups


def test_v_at_its_own_head_dim(tmp_path, monkeypatch, capsys):
    """MLA's shapes (here q / k 64, v 32): every method takes v at 32, their outputs agree, and TFLOP/s count
    q k^T at 64 and p v at 32 (a magi run's rate times its ms gives that flop count)."""
    monkeypatch.setenv("OUT", str(tmp_path))
    methods = ["magi", "allgather", "ring", "single"]
    assert dist.main(toy() + ["--head-dim-v", "32", "--methods", *methods]) == 0
    results = json.loads((tmp_path / "dist_bench.json").read_text())
    assert {r["method"] for r in results} == set(methods) and all(r["pass"] != "error" for r in results)
    for r in results:
        if r["method"] in ("allgather", "ring"):
            assert r["rel_diff_vs_first"] < 1e-5, r
    magi = next(r for r in results if r["method"] == "magi" and r["pass"] == "fwd")
    flops = magi["tflops_per_gpu"] * magi["ms"] * 1e9 * magi["gpus"]
    assert flops == pytest.approx(2.0 * magi["area"] * 2 * (64 + 32), rel=1e-6)
    assert "D 64, v 32" in capsys.readouterr().out


def test_unknown_method_is_named(capsys):
    with pytest.raises(SystemExit):
        dist.main(toy() + ["--methods", "magi_margin"])
    assert "unknown method 'magi_margin'" in capsys.readouterr().err


def test_rounds_must_be_positive(capsys):
    with pytest.raises(SystemExit):
        dist.main(toy() + ["--rounds", "0"])
    err = capsys.readouterr().err
    assert "--rounds" in err and "must be >= 1, got 0" in err


def test_head_dim_v_must_be_positive(capsys):
    # 0 is refused by name, not taken for "the default" (--head-dim's)
    with pytest.raises(SystemExit):
        dist.main(toy() + ["--head-dim-v", "0"])
    err = capsys.readouterr().err
    assert "--head-dim-v" in err and "must be >= 1, got 0" in err


@pytest.mark.parametrize("method", ["magi", "magi_local", "single"])
def test_profile_runs_on_host_devices(tmp_path, method, capsys):
    # On CPUs the trace has no GPU events: the schedule's report (magi) and the profile's header still print.
    assert dist.main(toy() + ["--profile", str(tmp_path), "--profile-only", "--profile-method", method]) == 0
    out = capsys.readouterr().out
    assert f"profile: varlen_causal, {method}, fwd+bwd" in out
    if method != "single":
        assert "collectives:" in out and "async collectives in the schedule" in out
