"""Registration of the FFA custom calls: the CPU module always, the CUDA library where it was built."""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib

import jax
import jax.numpy as jnp

from magi_jax import _ffi_cpu

FFA_FWD = "magi_jax_ffa_fwd"
FFA_BWD = "magi_jax_ffa_bwd"
RANGE_GATHER = "magi_jax_range_gather"
RANGE_SCATTER_ADD = "magi_jax_range_scatter_add"
RANGE_SCATTER_ADD_INTO = "magi_jax_range_scatter_add_into"

# Target name -> exported handler symbol of the CUDA library (cuda/).
CUDA_SYMBOLS = {FFA_FWD: "MagiFfaFwdCuda", FFA_BWD: "MagiFfaBwdCuda", RANGE_GATHER: "MagiRangeGatherCuda",
                RANGE_SCATTER_ADD: "MagiRangeScatterAddCuda",
                RANGE_SCATTER_ADD_INTO: "MagiRangeScatterAddIntoCuda"}
CUDA_LIBRARY = "libmagi_jax_cuda.so"

# jax.export refuses custom calls that promise no compatibility across versions, and these promise none:
# a function exported with these checks disabled runs where the same magi_jax version is imported.
EXPORT_DISABLED_CHECKS = tuple(jax.export.DisabledSafetyCheck.custom_call(name) for name in CUDA_SYMBOLS)

# The CUDA kernels' switch, read by the handlers at every call: unset or "sm90" the TMA + wgmma kernels,
# "mma" the mma.sync ones (cuda/handlers.cu).
KERNEL_ENV = "MAGI_JAX_FFA_KERNEL"
KERNELS = ("sm90", "mma")


def _cuda_library_path() -> pathlib.Path | None:
    """MAGI_JAX_CUDA_LIB, else the library installed beside this file by the CMake build."""
    env = os.environ.get("MAGI_JAX_CUDA_LIB")
    if env:
        return pathlib.Path(env)
    for folder in (pathlib.Path(__file__).parent, pathlib.Path(_ffi_cpu.__file__).parent):
        if (folder / CUDA_LIBRARY).exists():
            return folder / CUDA_LIBRARY
    return None


def _register() -> bool:
    for name, capsule in _ffi_cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    path = _cuda_library_path()
    if path is None:
        return False
    # Registering for CUDA needs no GPU (the target is only looked up when compiling for one), so this
    # does not start any backend at import.
    library = ctypes.cdll.LoadLibrary(str(path))
    for name, symbol in CUDA_SYMBOLS.items():
        if hasattr(library, symbol):
            jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), platform="CUDA")
    return True


HAS_CUDA_LIBRARY = _register()


def varying_axes(x) -> frozenset:
    """The manual mesh axes x varies over inside a shard_map (empty outside one)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
    return frozenset(vma)


def match_varying(outs, *inputs) -> tuple:
    """Outputs cast to vary over every manual axis any input varies over.

    An FFI call's results are typed invariant inside a shard_map whatever its inputs (jax 0.11); left so,
    shard_map's transpose would sum their cotangents over the axis, and custom-VJP rules would reject
    cotangents typed unlike their primals."""
    axes = frozenset().union(*(varying_axes(x) for x in inputs))
    def cast(y):
        missing = tuple(sorted(axes - varying_axes(y)))
        return jax.lax.pcast(y, missing, to="varying") if missing else y
    return tuple(cast(y) for y in outs)


def check_kernel_env() -> None:
    """A mistyped kernel switch fails here, at trace time and on every platform, not at the GPU call."""
    value = os.environ.get(KERNEL_ENV, "")
    if value and value not in KERNELS:
        raise ValueError(f"{KERNEL_ENV}: {value!r} is not a kernel; use one of {KERNELS} or leave it unset")


def call(target: str, results, *args, aliases: dict[int, int] | None = None, **attrs) -> tuple:
    """jax.ffi.ffi_call whose results vary like its arguments inside a shard_map; aliases: input index ->
    output index (the output is written in the input's buffer). Under jax.vmap the calls run one batch
    element after another (the kernels take one packed sequence; flex_flash_attn packs a batch into one
    call itself, ffa._batched_fwd). Empty arguments (an optional operand left out) are made inside a jitted
    call of their own: passed in, an eagerly run shard_map hands each to XLA's partitioner as an unused
    manual-computation operand, which crashes it (jax 0.11.2: a segfault in Shardy's
    ManualComputationUnusedInputsPattern)."""
    empties = tuple((i, tuple(x.shape), jnp.dtype(x.dtype)) for i, x in enumerate(args) if x.size == 0)
    if not empties:
        fn = jax.ffi.ffi_call(target, results, input_output_aliases=aliases, vmap_method="sequential")
        return match_varying(fn(*args, **attrs), *args)
    fn = _call_making_empties(target, tuple(results), tuple(sorted((aliases or {}).items())), empties,
                              tuple(sorted(attrs.items())))
    dropped = {i for i, _, _ in empties}
    return match_varying(fn(*(x for i, x in enumerate(args) if i not in dropped)), *args)


@functools.lru_cache(maxsize=256)
def _call_making_empties(target: str, results: tuple, aliases: tuple, empties: tuple, attrs: tuple):
    """The jitted FFI call of `call`, given its non-empty arguments (cached: one compilation a signature when
    run eagerly)."""
    fn = jax.ffi.ffi_call(target, results, input_output_aliases=dict(aliases) or None, vmap_method="sequential")

    def apply(*given):
        args = list(given)
        for i, shape, dtype in empties:
            args.insert(i, jnp.zeros(shape, dtype))
        return fn(*args, **dict(attrs))
    return jax.jit(apply)
