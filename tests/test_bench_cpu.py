"""bench/cpu.py's arguments (python -m magi_jax bench --backend cpu): bad values are usage errors naming the
option, before any compilation."""

from __future__ import annotations

import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
import bench.cpu  # noqa: E402


@pytest.mark.parametrize("argv, option", [
    (["--seqlen", "0"], "--seqlen"),
    (["--docs", "0"], "--docs"),
    (["--heads", "-1"], "--heads"),
    (["--head-dim", "7"], "--head-dim"),
    (["--seqlen", "10", "--docs", "20"], "--seqlen"),
])
def test_bad_arguments_are_usage_errors(argv, option, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.cpu.main(argv + ["--no-append"])
    assert exit_info.value.code == 2
    assert f"argument {option}:" in capsys.readouterr().err.strip().splitlines()[-1]
