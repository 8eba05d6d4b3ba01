"""Runs pytest files as a Bazel py_test: `pytest_main.py tests/test_mask.py [pytest args]`.

The venv of the project may hold an editable install of magi_jax (`make install`), whose import hook would
redirect `import magi_jax` to the source checkout; under Bazel the package must be the one in the runfiles,
with the FFI module that Bazel built. So the hook is removed and magi_jax is imported (and checked) before
pytest starts. Bazel's test sharding, XML report and temporary folder are honoured.
"""

from __future__ import annotations

import os
import sys


def _drop_editable_hooks() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not type(f).__module__.startswith("_magi_jax_editable")]
    for name in [m for m in sys.modules if m == "magi_jax" or m.startswith("magi_jax.")]:
        del sys.modules[name]


def _import_from_runfiles(runfiles: str) -> None:
    import magi_jax._ffi_cpu  # noqa: F401  (the module Bazel built)

    for module in (sys.modules["magi_jax"], sys.modules["magi_jax._ffi_cpu"]):
        where = os.path.abspath(module.__file__)
        if not where.startswith(runfiles + os.sep):
            sys.exit(f"pytest_main: {module.__name__} was imported from {where}, not from the runfiles "
                     f"{runfiles}")


class _Shard:
    """Bazel's shard_count: this shard keeps every TEST_TOTAL_SHARDS-th collected test."""

    def __init__(self, index: int, total: int):
        self.index, self.total = index, total

    def pytest_collection_modifyitems(self, config, items):
        mine = [i % self.total == self.index for i in range(len(items))]
        config.hook.pytest_deselected(items=[item for item, m in zip(items, mine) if not m])
        items[:] = [item for item, m in zip(items, mine) if m]


def main(argv: list[str]) -> int:
    runfiles = os.path.abspath(os.getcwd())  # Bazel starts a test in its workspace's runfiles folder
    _drop_editable_hooks()
    if runfiles not in sys.path:
        sys.path.insert(0, runfiles)
    _import_from_runfiles(runfiles)

    tmp = os.environ.get("TEST_TMPDIR")
    if tmp:
        os.environ.setdefault("MPLCONFIGDIR", os.path.join(tmp, "matplotlib"))
    files = [os.path.join(runfiles, a) if not a.startswith("-") and os.path.exists(a) else a for a in argv]
    args = ["-q", "-rs", "-p", "no:cacheprovider", f"--rootdir={runfiles}", *files]
    xml = os.environ.get("XML_OUTPUT_FILE")
    if xml:
        args.append(f"--junitxml={xml}")
    plugins = []
    total = int(os.environ.get("TEST_TOTAL_SHARDS", "1"))
    if total > 1:
        plugins.append(_Shard(int(os.environ["TEST_SHARD_INDEX"]), total))
        status = os.environ.get("TEST_SHARD_STATUS_FILE")
        if status:
            open(status, "w").close()
    if tmp:
        os.chdir(tmp)  # hypothesis' example database and other scratch files go there, not into the runfiles

    import pytest

    code = pytest.main(args, plugins=plugins)
    # A shard may hold no test at all (exit code 5): that is not a failure.
    return 0 if code == pytest.ExitCode.NO_TESTS_COLLECTED and total > 1 else int(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
