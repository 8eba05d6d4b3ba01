"""One path through a kernel's SASS: how many instructions it issues and how many branches it takes (no GPU).

    cuobjdump -sass /tmp/fwd.cubin > /tmp/fwd.sass   # nvcc ... -cubin, as in sass_stats.py
    python cuda/tools/sass_path.py /tmp/fwd.sass FlashFwdSm90KernelI13__nv_bfloat16Li128ELb0 b380 TNTTTTTNN

walks from the address given (hex, e.g. the mainloop's S wait, `WARPGROUP.DEPBAR.LE gsb0, 0x1`) until it
comes back there, printing each branch met. An unconditional branch is followed; a predicated one takes the
next letter of the decisions (T taken, N not taken), and the walk stops where they run out, so the letters
are found one branch at a time. Used to compare the forward's usual step between builds (cuda/NOTES.md, "The
usual step without jumps over the rare paths").
"""

from __future__ import annotations

import re
import sys

BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\b.*?0x([0-9a-f]+)\s*$")


def kernel_listing(sass: str, name: str) -> list[tuple[int, str]]:
    """(address, instruction) of the first function whose name contains `name`."""
    for func in re.split(r"\n\s+Function : ", sass):
        if name in func.split("\n")[0]:
            return [(int(m.group(1), 16), m.group(2).strip())
                    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", func)]
    raise SystemExit(f"no function matching {name!r}")


def walk(listing: list[tuple[int, str]], start: int, decisions: str, limit: int = 5000) -> dict:
    """The walk from `start` back to it: instructions issued, branches taken, the branches met (address,
    instruction, decision) and whether it closed (False: the decisions ran out or `limit` was reached)."""
    at = {address: i for i, (address, _) in enumerate(listing)}
    i, issued, taken, met, d = at[start], 0, 0, [], 0
    while issued < limit:
        if issued and listing[i][0] == start:
            return {"issued": issued, "taken": taken, "branches": met, "closed": True}
        address, ins = listing[i]
        issued += 1
        branch = BRANCH.match(ins)
        if branch:
            if branch.group(1) is None:
                decision = "T"
            elif d < len(decisions):
                decision, d = decisions[d], d + 1
            else:
                met.append((address, ins, "?"))
                break
            met.append((address, ins, decision))
            if decision == "T":
                taken += 1
                i = at[int(branch.group(2), 16)]
                continue
        i += 1
    return {"issued": issued, "taken": taken, "branches": met, "closed": False}


def main() -> None:
    path, name, start = sys.argv[1:4]
    result = walk(kernel_listing(open(path).read(), name), int(start, 16), sys.argv[4] if len(sys.argv) > 4 else "")
    for address, ins, decision in result["branches"]:
        print(f"{address:6x}  {decision}  {ins}")
    state = "back at the start" if result["closed"] else "stopped (give the next decision)"
    print(f"{result['issued']} instructions, {result['taken']} branches taken: {state}")


if __name__ == "__main__":
    main()
