"""Offline SASS checks of the sm90 forward's steady-state softmax (no GPU needed): build a cubin, then

    nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -Icuda -Iffi -I$(python -c "import jax.ffi; \\
        print(jax.ffi.include_dir())") -cubin cuda/launch_fwd_sm90.cu -o /tmp/fwd.cubin
    cuobjdump -sass /tmp/fwd.cubin > /tmp/fwd.sass
    python cuda/tools/sass_stats.py /tmp/fwd.sass [kernel name part]

prints, for the bf16 D 128 kernel by default: the FMNMX dependency depth feeding each row-max quad shuffle,
and per MUFU.EX2 cluster between the S wait (DEPBAR gsb0 0x1) and the PV wait (0x0) its MUFU count and span
(the interior softmax block is the short cluster of 50-66 MUFU; the long one is the softcap path).
"""

from __future__ import annotations

import collections
import re
import sys

from sass_path import kernel_listing  # a script: its folder (cuda/tools) is on the path


def kernel_instructions(sass: str, name: str) -> list[str]:
    return [ins for _, ins in kernel_listing(sass, name)]


def opcode(ins: str) -> str:
    parts = ins.split()
    return (parts[1] if parts[0].startswith("@") else parts[0]).split(".")[0]


def registers(ins: str) -> list[str]:
    return re.findall(r"\bR\d+\b", ins)


def fmnmx_depth(ins: list[str], at: int, reg: str, memo: dict) -> int:
    """Longest chain of FMNMX ending in the last write of reg before instruction at."""
    for j in range(at - 1, max(at - 400, -1), -1):
        regs = registers(ins[j])
        if regs and regs[0] == reg and not opcode(ins[j]).startswith(("HGMMA", "ST")):
            if opcode(ins[j]) != "FMNMX":
                return 0
            if (j, reg) not in memo:
                memo[(j, reg)] = 1 + max([fmnmx_depth(ins, j, r, memo) for r in regs[1:]] + [0])
            return memo[(j, reg)]
    return 0


def main() -> None:
    sass = open(sys.argv[1]).read()
    ins = kernel_instructions(sass, sys.argv[2] if len(sys.argv) > 2 else "FlashFwdSm90KernelI13__nv_bfloat16Li128E")
    print(f"{len(ins)} instructions")
    memo: dict = {}
    for i, s in enumerate(ins):
        if s.startswith("SHFL.BFLY") and ", 0x1, 0x1f" in s:
            print(f"  row-max shuffle at {i}: FMNMX depth {fmnmx_depth(ins, i, registers(s)[1], memo)}")
    for a in (i for i, s in enumerate(ins) if s.startswith("WARPGROUP.DEPBAR.LE gsb0, 0x1")):
        b = next(i for i in range(a + 1, len(ins)) if "WARPGROUP.DEPBAR.LE gsb0, 0x0" in ins[i])
        mufu = [i for i in range(a, b) if ins[i].startswith("MUFU.EX2")]
        clusters: list[list[int]] = []
        for i in mufu:
            if clusters and i - clusters[-1][-1] <= 60:
                clusters[-1].append(i)
            else:
                clusters.append([i])
        counts = collections.Counter(opcode(s) for s in ins[a:b])
        print(f"  S wait at {a} .. PV wait at {b}: {b - a} instructions, {counts['MUFU']} MUFU, {counts['FFMA']} FFMA")
        for c in clusters:
            print(f"    MUFU cluster {c[0]}..{c[-1]}: {len(c)} MUFU over {c[-1] - c[0]} instructions")


if __name__ == "__main__":
    main()
