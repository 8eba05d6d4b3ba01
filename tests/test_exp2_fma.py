"""Exp2Fma (cuda/ptx.h), the softmax's exponential on the FMA pipe: its constants, emulated op by op in
float32 (cuda/tools/exp2_poly.py), stay within the error bound it promises and give exactly 0 for masked
cells. No GPU needed; the GPU suite checks the kernels that use it against float64 attention."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _tool():
    spec = importlib.util.spec_from_file_location("exp2_poly", ROOT / "cuda" / "tools" / "exp2_poly.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _device_constants() -> np.ndarray:
    text = (ROOT / "cuda" / "ptx.h").read_text()
    found = dict(re.findall(r"(kC[123]) = ([-+0-9.e]+)f", text))
    return np.array([found["kC1"], found["kC2"], found["kC3"]], np.float32)


def test_exp2_fma_error_bound_and_masked_cells():
    tool, c = _tool(), _device_constants()
    x = np.arange(-125 * 4096, 1, dtype=np.int64).astype(np.float32) / np.float32(4096)
    got = tool.exp2_fma(x, c).astype(np.float64)
    rel = np.abs(got - np.exp2(x.astype(np.float64))) / np.exp2(x.astype(np.float64))
    assert rel.max() < 1.1e-4, rel.max()
    below = np.array([-np.inf, -1e30, -200.0, -127.0, -126.6, -126.0], np.float32)
    out = tool.exp2_fma(below, c)
    assert (out[:4] == 0).all() and (out >= 0).all() and (out <= 2.0 ** -125).all(), out


def test_device_constants_are_the_tools_fit():
    np.testing.assert_allclose(_device_constants(), _tool().fit(), rtol=1e-6)
