"""examples/train_lm.py's argument handling: bad values are usage errors (exit 2, the option named), caught
before any planning or training."""

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
