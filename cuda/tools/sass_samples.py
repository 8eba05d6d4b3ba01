"""Where a kernel's warps spend their time, from the SASS source page of an Nsight Compute report (no GPU
needed once the csv is here):

    KEEP_SASS=1 bash cuda/tools/ncu_profile.sh causal_32k fwd+bwd FlashBwdSm90Kernel   # on the GPU machine
    python cuda/tools/sass_samples.py ncu_causal_32k_fwd_bwd_sass.csv [top]

prints the warp-stall samples by instruction class (GEMM issue, GEMM waits, barrier waits and their spin
branches, exponentials, other float math, shuffles, shared and global memory, the rest) and the `top` lines
(default 25). The samples count every warp, producer included: a producer waiting on a barrier is expected.
"""

from __future__ import annotations

import collections
import csv
import sys

# First match wins; a prefix of the opcode (after any predicate) decides.
CLASSES = (
    ("gemm issue", ("HGMMA",)),
    ("gemm wait", ("WARPGROUP.DEPBAR", "WARPGROUP.ARRIVE", "WARPSYNC")),
    ("barrier wait", ("SYNCS", "BAR.", "BRA")),  # mbarrier try-waits, named barriers, their spin loops
    ("exp", ("MUFU",)),
    ("float math", ("FMUL", "FADD", "FFMA", "FMNMX", "FSETP", "FSEL", "F2F", "F2FP", "FCHK")),
    ("shuffle", ("SHFL",)),
    ("shared memory", ("LDS", "STS", "LDSM", "STSM")),
    ("global memory / TMA", ("LDG", "STG", "RED", "ATOM", "UTMA", "UBLKCP", "LDGSTS")),
)


def opcode(source: str) -> str:
    parts = source.split()
    if not parts:
        return ""
    return parts[1] if parts[0].startswith("@") and len(parts) > 1 else parts[0]


def instruction_class(source: str) -> str:
    op = opcode(source)
    for name, prefixes in CLASSES:
        if op.startswith(prefixes):
            return name
    return "other"


def read_rows(path: str) -> tuple[list[str], list[list[str]]]:
    rows = list(csv.reader(open(path)))
    at = next((i for i, r in enumerate(rows) if any("Stall Sampling" in h for h in r)), None)
    if at is None:
        raise SystemExit(f"{path}: no warp-stall sampling columns (was the report taken with --set full?)")
    return rows[at], rows[at + 1:]


def number(x: str) -> float:
    return float(x.replace(",", "") or 0)


def summary(path: str, top: int = 25) -> str:
    head, body = read_rows(path)
    col_all = next(i for i, h in enumerate(head) if "Stall Sampling (All" in h)
    col_not = next((i for i, h in enumerate(head) if "Not-issued" in h), None)
    src = head.index("Source")
    by_class: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    lines = []
    for r in body:
        if len(r) <= col_all:
            continue
        samples = number(r[col_all])
        not_issued = number(r[col_not]) if col_not is not None else 0.0
        by_class[instruction_class(r[src])][0] += samples
        by_class[instruction_class(r[src])][1] += not_issued
        lines.append((samples, r[src].strip()))
    total = sum(v[0] for v in by_class.values()) or 1.0
    out = [f"{len(lines)} SASS lines, {total:.0f} warp-stall samples",
           f"{'class':22s} {'samples':>8s} {'share':>7s} {'not issued':>11s}"]
    for name, (samples, not_issued) in sorted(by_class.items(), key=lambda kv: -kv[1][0]):
        out.append(f"{name:22s} {samples:8.0f} {samples / total:7.1%} {not_issued / max(samples, 1):11.1%}")
    out.append(f"top {top} lines:")
    for samples, source in sorted(lines, reverse=True)[:top]:
        out.append(f"{samples / total:6.1%}  {source}")
    return "\n".join(out)


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    print(summary(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 25))
