"""examples/train_lm.py's argument handling: bad values are usage errors (exit 2, the option named), caught
before any planning or training; and its QK-clip option on CPU devices."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from tests.conftest import has_gpu


@pytest.fixture(scope="module")
def train_lm():
    path = pathlib.Path(__file__).resolve().parents[1] / "examples" / "train_lm.py"
    spec = importlib.util.spec_from_file_location("train_lm_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, option", [
    (["--cp", "0"], "--cp"),
    (["--dp", "0"], "--dp"),
    (["--seqlen", "0"], "--seqlen"),
    (["--width", "0"], "--width"),
    (["--steps", "0"], "--steps"),
    (["--steps", "-3"], "--steps"),
    (["--layers", "-1"], "--layers"),
    (["--steps", "abc"], "--steps"),
    (["--qk-clip", "0"], "--qk-clip"),
    (["--qk-clip", "-1.5"], "--qk-clip"),
    # Fewer chunks (64 tokens on CPU) than cp ranks: the planner could not place them.
    (["--platform", "cpu", "--cp", "4", "--dp", "1", "--seqlen", "192"], "--seqlen 192"),
    (["--platform", "cpu", "--cp", "8", "--dp", "2"], "--dp 2 x --cp 8"),
])
def test_bad_values_are_usage_errors_naming_the_option(train_lm, capsys, argv, option):
    with pytest.raises(SystemExit) as exit_:
        train_lm.main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in err[-1] and option in err[-1]   # one line after the usage


@pytest.mark.skipif(has_gpu(), reason="needs a host without a GPU")
def test_missing_platform_is_a_usage_error(train_lm, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_lm.main(["--platform", "gpu"])
    assert exit_.value.code == 2
    assert "--platform gpu: no gpu devices" in capsys.readouterr().err


@pytest.mark.skipif(has_gpu(), reason="a CPU run (the GPU default is a larger model)")
def test_qk_clip_trains_and_reports_each_steps_largest_logit(train_lm, capsys):
    # The largest logit comes from calc_attn's return_max_logit over the (dp, cp) mesh; W_q is scaled where
    # it passes the threshold, and the loss still falls.
    assert train_lm.main(["--platform", "cpu", "--steps", "8", "--layers", "1", "--qk-clip", "1.0"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "largest logit" in line]
    assert lines and all(line.endswith("(clip 1.0)") for line in lines)
    largest = [float(line.split("largest logit ")[1].split()[0]) for line in lines]
    assert all(0.0 < x < 100.0 for x in largest), largest
