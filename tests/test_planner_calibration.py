"""Calibration files of the cost model: save/load, bad input, the plan and simulate commands with
--calibration, and bench/calibrate.py end to end on host devices (tiny sizes)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from magi_jax.planner import CostModel, make_plan
from magi_jax.planner.cli import plan_main, simulate_main
from magi_jax.planner.stages import finish_times, load_calibration, save_calibration, stored_calibrations
from magi_jax.planner.workloads import sample_doc_lengths, varlen_mask

MODEL = CostModel(flops_per_s=300e12, bytes_per_s=200e9, collective_latency_s=30e-6, launch_s=12e-6, dtype_bytes=2)
# Every rate halved and every fixed cost doubled: every predicted time doubles, every choice stays.
SLOW = CostModel(flops_per_s=MODEL.flops_per_s / 2, bytes_per_s=MODEL.bytes_per_s / 2,
                 collective_latency_s=MODEL.collective_latency_s * 2, launch_s=MODEL.launch_s * 2)


def test_save_load_round_trip(tmp_path):
    path = MODEL.save(tmp_path / "new" / "dev.json", "varlen_causal", device_kind="test")
    assert CostModel.load(path, mask_class="varlen_causal") == MODEL
    assert CostModel.load(path) == MODEL                    # one class: no name needed
    save_calibration(path, {"varlen_causal": MODEL, "varlen_full": SLOW}, device_kind="test", points={"a": [1]})
    models, meta = load_calibration(path)
    assert models == {"varlen_causal": MODEL, "varlen_full": SLOW}
    assert meta == {"device_kind": "test", "points": {"a": [1]}}
    assert CostModel.load(str(path), "varlen_full") == SLOW


def _write(tmp_path, doc) -> str:
    path = tmp_path / "c.json"
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return str(path)


def _fields(**over):
    return {"classes": {"varlen_causal": {**MODEL.__dict__, **over}}}


@pytest.mark.parametrize("doc, message", [
    ("{not json", "not readable as JSON"),
    ([1, 2], "non-empty \"classes\""),
    ({"classes": {}}, "non-empty \"classes\""),
    ({"classes": {"varlen_causal": 3}}, "classes.varlen_causal: expected an object"),
    ({"classes": {"varlen_causal": {"flops_per_s": 1.0}}}, "missing fields"),
    (_fields(speed=1.0), "unknown fields \\['speed'\\]"),
    (_fields(flops_per_s=-1.0), "flops_per_s: expected a positive number"),
    (_fields(bytes_per_s=0), "bytes_per_s: expected a positive number"),
    (_fields(launch_s=-1e-6), "launch_s: expected a non-negative number"),
    (_fields(collective_latency_s=True), "collective_latency_s"),
    (_fields(dtype_bytes=2.5), "dtype_bytes: expected a positive integer"),
    (_fields(bytes_per_s="fast"), "bytes_per_s"),
])
def test_bad_files_name_the_file_and_field(tmp_path, doc, message):
    path = _write(tmp_path, doc)
    with pytest.raises(ValueError, match=message) as e:
        CostModel.load(path, "varlen_causal")
    assert f"calibration file {path}" in str(e.value)


def test_missing_file_and_unknown_class(tmp_path):
    with pytest.raises(ValueError, match="calibration file .*nope.json: not found"):
        CostModel.load(tmp_path / "nope.json")
    path = save_calibration(tmp_path / "c.json", {"varlen_causal": MODEL, "varlen_full": SLOW})
    with pytest.raises(ValueError, match=r"mask_class: 'causal' is not in .*varlen_causal"):
        CostModel.load(path, "causal")
    with pytest.raises(ValueError, match="mask_class: .* holds .*; name one"):
        CostModel.load(path)


def test_plan_stats_parts_compose_to_the_predicted_time():
    mask = varlen_mask(sample_doc_lengths(16384, 1))
    for overlap in (0, 1, 3):
        s = make_plan(mask, cp=4, chunk_size=512, overlap=overlap, cost_model=MODEL).stats()
        per_rank = finish_times(s.host_time_s, s.stage_comm_s, s.stage_time_s, fused=overlap == 0)
        np.testing.assert_allclose(per_rank, s.rank_time_s)
        assert s.stage_time_s.shape == (len(s.buffer_lens), 4)


def _predicted_ms(out: str) -> float:
    return float(re.search(r"predicted ([0-9.]+) ms", out).group(1))


def test_plan_with_calibration_scales_the_predicted_time(tmp_path, capsys):
    base = ["--mask", "varlen_full", "--seqlen", "64k", "--cp", "4", "--chunk", "2048"]
    fast = save_calibration(tmp_path / "fast.json", {"varlen_full": MODEL})
    slow = save_calibration(tmp_path / "slow.json", {"varlen_full": SLOW, "other": MODEL})
    assert plan_main(base + ["--calibration", str(fast)]) == 0
    out = capsys.readouterr().out
    assert f"cost model: {fast} [varlen_full]: 300 TFLOP/s, 200 GB/s" in out
    assert plan_main(base + ["--calibration", str(slow)]) == 0        # class taken from --mask
    assert _predicted_ms(capsys.readouterr().out) == pytest.approx(2 * _predicted_ms(out), rel=2e-3)
    assert plan_main(base + ["--calibration", str(slow), "--mask-class", "other"]) == 0
    assert _predicted_ms(capsys.readouterr().out) == pytest.approx(_predicted_ms(out), rel=2e-3)
    plan = make_plan(varlen_mask(sample_doc_lengths(65536, 0), causal=False), cp=4, chunk_size=2048,
                     cost_model=CostModel.load(slow, "varlen_full"))
    assert plan.stats().predicted_time_s * 1e3 == pytest.approx(2 * _predicted_ms(out), rel=2e-3)


def test_plan_block_causal_reads_the_varlen_block_causal_class(tmp_path, capsys):
    path = save_calibration(tmp_path / "c.json", {"varlen_block_causal": SLOW, "varlen_causal": MODEL})
    assert plan_main(["--mask", "block_causal", "--seqlen", "16k", "--cp", "2", "--calibration", str(path)]) == 0
    assert "[varlen_block_causal]" in capsys.readouterr().out


def test_stored_calibration_loads_by_name(capsys):
    # The 2 x H200 calibration measured by bench/calibrate.py ships with the package (BENCHMARKS.md).
    assert "NVIDIA_H200_x2" in stored_calibrations()
    models, meta = load_calibration("NVIDIA_H200_x2")
    assert {"varlen_causal", "varlen_full", "varlen_block_causal"} <= set(models)
    assert all(100e12 < m.flops_per_s < 1000e12 for m in models.values())   # H200 bf16 attention rates
    assert plan_main(["--seqlen", "64k", "--cp", "2", "--calibration", "NVIDIA_H200_x2"]) == 0
    assert "cost model: NVIDIA_H200_x2 [varlen_causal]" in capsys.readouterr().out


def _simulate_tflops(out: str) -> float:
    row = next(line for line in out.splitlines() if line.startswith("| 4 |"))
    return float(row.split("|")[3].split(",")[2])      # comm_aware's TFLOP/s per GPU


def test_simulate_with_calibration_scales_throughput(tmp_path, capsys):
    # 1/20 of the rates and 20x the fixed costs: TFLOP/s 20x lower (printed as whole numbers).
    slow = CostModel(flops_per_s=MODEL.flops_per_s / 20, bytes_per_s=MODEL.bytes_per_s / 20,
                     collective_latency_s=MODEL.collective_latency_s * 20, launch_s=MODEL.launch_s * 20)
    args = ["--cp", "4", "--per-gpu", "4k", "--seeds", "1", "--solvers", "comm_aware"]
    assert simulate_main(args + ["--calibration", str(MODEL.save(tmp_path / "a.json", "varlen_causal"))]) == 0
    fast = _simulate_tflops(capsys.readouterr().out)
    assert simulate_main(args + ["--calibration", str(slow.save(tmp_path / "b.json", "varlen_causal"))]) == 0
    assert _simulate_tflops(capsys.readouterr().out) == pytest.approx(fast / 20, abs=0.6)


@pytest.mark.parametrize("main", [plan_main, simulate_main])
def test_cli_bad_calibration_names_the_flag(tmp_path, capsys, main):
    small = ["--cp", "2"] + (["--seqlen", "4k"] if main is plan_main else ["--per-gpu", "2k", "--seeds", "1"])
    assert main(small + ["--calibration", str(tmp_path / "missing.json")]) == 2
    assert "--calibration: calibration file" in capsys.readouterr().out
    path = _write(tmp_path, "{")
    assert main(small + ["--calibration", path]) == 2
    assert "--calibration: calibration file" in capsys.readouterr().out
    path = str(MODEL.save(tmp_path / "ok.json", "varlen_causal"))
    assert main(small + ["--calibration", path, "--mask-class", "nope"]) == 2
    assert "--mask-class: 'nope' is not in" in capsys.readouterr().out


# ------------------------------------------------------------------------- bench/calibrate.py on CPU

def test_fit_line():
    from bench import calibrate
    assert calibrate.fit_line(1.0, 3.0, 3.0, 7.0) == pytest.approx((2.0, 1.0))
    assert calibrate.fit_line(1.0, 3.0, 4.0, 2.0) == (0.5, 0.0)          # falling (noise): through the origin
    assert calibrate.fit_line(1.0, 1.0, 2.0, 5.0) == (2.5, 0.0)          # negative at zero: through the origin


def test_calibrate_end_to_end_on_host_devices(tmp_path, monkeypatch, capsys):
    from bench import calibrate
    monkeypatch.delenv("OUT", raising=False)
    out = tmp_path / "cal" / "cpu.json"
    assert calibrate.main(["--platform", "cpu", "--devices", "2", "--tokens-per-device", "128", "--heads", "2",
                           "--kv-heads", "1", "--head-dim", "64", "--dtype", "float32", "--reps", "1",
                           "--warmup", "1", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("forward: predicted") == 3 and "stage 0 group_cast" in printed
    models, meta = load_calibration(out)
    assert sorted(models) == sorted(calibrate.MASKS)
    assert meta["device_kind"] == "cpu" and meta["devices"] == 2 and meta["dtype"] == "float32"
    assert meta["command"].startswith("python") and meta["jax_version"]
    for c in meta["check"]:
        assert c["predicted_ms"] > 0 and c["measured_ms"] > 0
        assert c["error_pct"] == pytest.approx((c["predicted_ms"] / c["measured_ms"] - 1) * 100)
    # The stored rates drive the planner: the check's prediction is the plan's under the loaded model.
    assert all(m.dtype_bytes == 4 for m in models.values())
    assert plan_main(["--mask", "varlen_full", "--seqlen", "512", "--cp", "2", "--heads-q", "2", "--heads-kv",
                      "1", "--head-dim", "64", "--calibration", str(out)]) == 0
    assert "cost model: " + str(out) + " [varlen_full]" in capsys.readouterr().out
