"""Does a kernel-source change alter the device code? Compares two PTX files of one translation unit kernel by
kernel, offline (no GPU): a refactor whose kept kernels read the same needs no GPU run to show it changed
nothing. Branch labels ($L__BB<function>_<n>) and inline-asm labels (WAIT_<n>, numbered across the unit) are
renumbered in order of appearance first, so removing one kernel does not make the others differ.

Make the PTX from the build's own compile command (build/cp312-cp312-linux_x86_64; the unit's flags as built):
    cmd=$(ninja -t commands magi_jax_cuda | grep nvcc | grep launch_bwd_sm90.cu.o)
    eval "$(echo "$cmd" | sed 's/ -MD -MT [^ ]* -MF [^ ]*//; s/ -c / -ptx /; s/ -o [^ ]*$/ -o \\/tmp\\/a.ptx/')"
then again after the change into /tmp/b.ptx, and:
    python cuda/tools/ptx_same.py /tmp/a.ptx /tmp/b.ptx
Exit status 0 when every kernel of b is in a and reads the same (kernels only in a are listed as removed).
"""

from __future__ import annotations

import re
import sys

_ENTRY = re.compile(r"^(?:\.visible )?\.entry (\S+)\($", re.M)
_ASM_LABEL = re.compile(r"\b([A-Z][A-Z_]*[A-Z])_(\d+)\b")


def kernels(ptx: str) -> dict[str, str]:
    """Kernel name -> its PTX from its .entry line to the next kernel's, labels renumbered."""
    starts = list(_ENTRY.finditer(ptx))
    out = {}
    for i, m in enumerate(starts):
        end = starts[i + 1].start() if i + 1 < len(starts) else len(ptx)
        body = re.sub(r"^\s*// \.globl.*$", "", ptx[m.start():end], flags=re.M).rstrip()
        body = re.sub(r"\$L__BB\d+_", "$L__BB_", body)
        seen: dict[str, str] = {}
        body = _ASM_LABEL.sub(lambda x: seen.setdefault(x.group(0), f"{x.group(1)}_#{len(seen)}"), body)
        out[m.group(1)] = body
    return out


def compare(before: str, after: str) -> dict[str, list[str]]:
    """The kernels of `after` that read the same as in `before`, those that differ, and those only in one."""
    a, b = kernels(before), kernels(after)
    return {"same": [k for k in b if a.get(k) == b[k]],
            "differ": [k for k in b if k in a and a[k] != b[k]],
            "added": [k for k in b if k not in a],
            "removed": [k for k in a if k not in b]}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__)
        return 2
    with open(argv[0]) as f0, open(argv[1]) as f1:
        result = compare(f0.read(), f1.read())
    print(", ".join(f"{len(v)} {k}" for k, v in result.items()))
    for key in ("differ", "added", "removed"):
        for name in result[key]:
            print(f"{key}: {name}")
    return 0 if not result["differ"] and not result["added"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
