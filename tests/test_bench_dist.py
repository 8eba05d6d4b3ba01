"""bench/dist.py end to end on 2 host devices at toy sizes (the GPU runs use the same code): every magi
variant and the baselines run, agree on their output, and the report and the profile come out. No GPU."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import bench.dist as dist  # noqa: E402

TOY = ["--platform", "cpu", "--gpus", "2", "--tokens-per-gpu", "1024", "--heads", "2", "--kv-heads", "2",
       "--head-dim", "64", "--dtype", "float32", "--reps", "1", "--warmup", "1", "--calls", "2", "--no-append",
       "--masks", "varlen_causal"]


def test_methods_run_and_agree(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("OUT", str(tmp_path))
    methods = ["magi", "magi_bwd_fused", "allgather", "ring", "single"]
    assert dist.main(TOY + ["--methods", *methods]) == 0
    results = json.loads((tmp_path / "dist_bench.json").read_text())
    assert {(r["method"], r["pass"]) for r in results} == {(m, p) for m in methods for p in ("fwd", "fwd+bwd")}
    for r in results:
        assert r["ms"] > 0 and r["tflops_per_gpu"] > 0, r
        if r["method"] not in ("magi", "single"):  # the dispatched output against magi's, in float32
            assert r["rel_diff_vs_first"] < 1e-5, r
    table = capsys.readouterr().out
    assert "| varlen_causal | fwd+bwd |" in table and "magi / single" in table


@pytest.mark.parametrize("method", ["magi", "single"])
def test_profile_runs_on_host_devices(tmp_path, method, capsys):
    # On CPUs the trace has no GPU events: the schedule's report (magi) and the profile's header still print.
    assert dist.main(TOY + ["--profile", str(tmp_path), "--profile-only", "--profile-method", method]) == 0
    out = capsys.readouterr().out
    assert f"profile: varlen_causal, {method}, fwd+bwd" in out
    if method == "magi":
        assert "collectives:" in out and "async collectives in the schedule" in out
