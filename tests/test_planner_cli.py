"""The plan and simulate commands, called as functions."""

from __future__ import annotations

import pytest

from magi_jax.demo import main as demo_main
from magi_jax.planner.cli import parse_tokens, plan_main, simulate_main
from magi_jax.planner.workloads import sample_doc_lengths


def test_parse_tokens():
    assert parse_tokens("1M") == 1 << 20 and parse_tokens("64k") == 65536 and parse_tokens("4096") == 4096


def test_sample_doc_lengths_sum_and_cap():
    lengths = sample_doc_lengths(65536, 0)
    assert sum(lengths) == 65536 and max(lengths) <= 65536 // 4 and min(lengths) >= 1
    assert lengths == sample_doc_lengths(65536, 0)


def test_plan_prints_table_and_plots(tmp_path, capsys):
    png = tmp_path / "plan.png"
    assert plan_main(["--mask", "varlen_causal", "--seqlen", "32k", "--cp", "4", "--chunk", "1024",
                      "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    assert "imbalance" in out and "remote keys" in out and "planned in" in out
    assert png.stat().st_size > 1000


@pytest.mark.parametrize("mask", ["full", "causal", "varlen_full"])
def test_plan_other_masks(mask, capsys):
    assert plan_main(["--mask", mask, "--seqlen", "8k", "--cp", "2", "--solver", "minheap", "--overlap", "2"]) == 0
    assert "total area" in capsys.readouterr().out


def test_plan_prices_v_at_its_own_head_dim(capsys):
    """MLA: --head-dim-v 128 beside --head-dim 192 prices a cell at 2 Hq (192 + 128) flops, a sixth less
    than v at 192, so the same plan's predicted time falls (the cost model's choice of stages aside)."""
    def predicted_ms(*extra):
        assert plan_main(["--mask", "varlen_causal", "--seqlen", "32k", "--cp", "4", "--overlap", "2",
                          "--head-dim", "192", *extra]) == 0
        line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("total area"))
        return float(line.split("predicted ")[1].split(" ms")[0])
    assert predicted_ms("--head-dim-v", "128") < predicted_ms()


def test_plan_reports_bad_input(capsys):
    assert plan_main(["--seqlen", "4k", "--cp", "8", "--chunk", "1024"]) == 2
    assert "chunk" in capsys.readouterr().out


def test_simulate_small(tmp_path, capsys):
    md = tmp_path / "B.md"
    assert simulate_main(["--cp", "4", "--per-gpu", "4k", "--seeds", "1", "--markdown", str(md)]) == 0
    out = capsys.readouterr().out
    assert "comm_aware" in out and "all-gather" in out
    assert "Planner simulation" in md.read_text()


@pytest.mark.parametrize("mask", ["sliding_window", "block_causal", "shared_question", "prefix_lm",
                                  "global_sliding_window", "causal_blockwise", "sliding_window_bidirectional"])
def test_plan_mask_families(mask, capsys):
    assert plan_main(["--mask", mask, "--seqlen", "16k", "--cp", "4", "--window", "512", "--block", "1k"]) == 0
    assert "total area" in capsys.readouterr().out


@pytest.mark.parametrize("main, argv, option", [
    (plan_main, ["--mask", "global_sliding_window", "--num-global", "-1"], "--num-global"),
    (plan_main, ["--plot", "/nonexistent/dir/x.png"], "--plot"),
    (plan_main, ["--cp", "2", "--plot-rank", "5"], "--plot-rank"),
    (plan_main, ["--seed", "-1"], "--seed"),
    (plan_main, ["--cp", "0"], "--cp"),
    (plan_main, ["--head-dim-v", "0"], "--head-dim-v"),
    (simulate_main, ["--cp", "0"], "--cp"),
    (simulate_main, ["--cp", "-4"], "--cp"),
    (simulate_main, ["--cp", "4,x"], "--cp"),
    (simulate_main, ["--seeds", "0"], "--seeds"),
    (simulate_main, ["--heads-q", "0"], "--heads-q"),
    (demo_main, ["--seqlen", "0"], "--seqlen"),
    (demo_main, ["--seqlen", "7"], "--seqlen"),
])
def test_bad_arguments_are_usage_errors(main, argv, option, capsys):
    """Rejected while parsing (before any planning or kernel run): exit 2, one line naming the option."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {option}:" in last
