"""The whole GPU suite of tests/test_ffa_gpu.py again on the mma.sync kernels (MAGI_JAX_FFA_KERNEL=mma): the
fallback the handlers take where the sm90 launch declines an input, and the kernels for comparison."""

from __future__ import annotations

import pytest

from tests.test_ffa_gpu import *  # noqa: F401,F403  (every GPU test, collected again under the mma.sync kernels)
from tests.test_ffa_gpu import _on_gpu  # noqa: F401  (the module's skip-without-GPU fixture; star skips _names)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _mma_sync_kernels(request, monkeypatch):
    # By the test's head dim, not by "256" anywhere in its id (that skipped D 128 cases of 256 keys too); the
    # MLA tests are D 192's.
    callspec = getattr(request.node, "callspec", None)
    name = request.node.name
    if "head_dim_256" in name or "mla" in name or (callspec is not None and callspec.params.get("d") in (192, 256)):
        pytest.skip("head dims 192 and 256 have only the sm90 kernels (tests/test_ffa_gpu.py runs them)")
    monkeypatch.setenv("MAGI_JAX_FFA_KERNEL", "mma")
