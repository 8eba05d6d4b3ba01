"""cuda_shared_library: a plain shared CUDA library built by nvcc in genrules (Bazel 4 has no CUDA rules).

With nvcc (see cuda_configure.bzl): one genrule per .cu file (`nvcc -c`, so they compile in parallel, as CMake
does) and one that links them (`nvcc -shared`). Without nvcc: `name` is an empty filegroup, so `bazel build
//...` still succeeds and nothing depending on it changes.
"""

load("@local_config_magi_jax_cuda//:defs.bzl", "NVCC")

def _source_dir(label):
    """Execroot-relative folder of a package (works in this repository and as an external one)."""
    return "/".join([p for p in (label.workspace_root, label.package) if p]) or "."

def cuda_shared_library(name, out, srcs, hdrs = [], include_dirs = [], system_include_dirs = [], copts = [],
                        linkopts = [], **kwargs):
    """Declares `name`, whose output is `out` (a shared library) when nvcc exists, else empty.

    Args:
      name: the target (a filegroup of `out`).
      out: the library's file name, in this package.
      srcs: the .cu files.
      hdrs: every header they include (labels), so that a change rebuilds them.
      include_dirs: folders for the include path, written as package labels ("//ffi",
        "@repo//some/dir"); this package's folder is always on it.
      system_include_dirs: the same, as -isystem (third-party headers: their warnings are not ours).
      copts: nvcc flags for compiling each source.
      linkopts: nvcc flags for linking.
      **kwargs: visibility, tags for the filegroup.
    """
    if not NVCC:
        native.filegroup(name = name, srcs = [], **kwargs)
        return

    here = Label("//%s:BUILD.bazel" % native.package_name())
    includes = " ".join(
        ["-I" + d for d in [_source_dir(here)] + [_source_dir(Label(l)) for l in include_dirs]] +
        ["-isystem " + _source_dir(Label(l)) for l in system_include_dirs],
    )
    # nvcc names its temporaries after its pid (/tmp/tmpxft_<pid>_...); in the sandbox every action is pid 2
    # of its own namespace and /tmp is shared, so parallel actions overwrote each other's files ("ptxas
    # fatal: Input file ... could not be opened"). Each run gets its own TMPDIR.
    nvcc = "T=$$(mktemp -d) && TMPDIR=$$T %s" % NVCC
    cleanup = "; s=$$?; rm -rf $$T; exit $$s"
    objects = []
    for src in srcs:
        stem = src.rsplit("/", 1)[-1].rsplit(".", 1)[0]
        obj = "_objs/%s/%s.o" % (name, stem)
        native.genrule(
            name = "%s_%s_o" % (name, stem),
            srcs = [src] + hdrs,
            outs = [obj],
            cmd = "%s -c %s %s -o $@ $(location %s)%s" % (nvcc, " ".join(copts), includes, src, cleanup),
            message = "nvcc %s" % src,
            visibility = ["//visibility:private"],
        )
        objects.append(obj)
    native.genrule(
        name = name + "_link",
        srcs = objects,
        outs = [out],
        cmd = "%s -shared %s -o $@ $(SRCS)%s" % (nvcc, " ".join(linkopts), cleanup),
        message = "nvcc -shared " + out,
        visibility = ["//visibility:private"],
    )
    native.filegroup(name = name, srcs = [out], **kwargs)

def cuda_library_copy(name, src, out, **kwargs):
    """`out` in this package, a copy of the library `src` (a cuda_shared_library); empty without nvcc."""
    if not NVCC:
        native.filegroup(name = name, srcs = [], **kwargs)
        return
    native.genrule(
        name = name + "_copy",
        srcs = [src],
        outs = [out],
        cmd = "cp $(SRCS) $@",
        visibility = ["//visibility:private"],
    )
    native.filegroup(name = name, srcs = [out], **kwargs)
