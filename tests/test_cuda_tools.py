"""cuda/tools/sass_samples.py on a made-up Nsight Compute source page: no GPU needed."""

from __future__ import annotations

import csv
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cuda" / "tools"))
from sass_samples import instruction_class, summary  # noqa: E402


def test_instruction_classes_read_the_opcode_after_a_predicate():
    assert instruction_class("HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ, !UPT") == "gemm issue"
    assert instruction_class("@!P0  BRA 0x7f2ecafd1990") == "barrier wait"
    assert instruction_class("WARPGROUP.DEPBAR.LE gsb0, 0x1") == "gemm wait"
    assert instruction_class("MUFU.EX2 R70, R70") == "exp"
    assert instruction_class("@P1 STS [R3], R4") == "shared memory"
    assert instruction_class("IMAD R0, R1, R2, R3") == "other"


def test_summary_shares_and_top_lines(tmp_path):
    path = tmp_path / "page.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Source page"])                      # a title row before the header
        w.writerow(["Address", "Source", "Warp Stall Sampling (All Samples)",
                    "Warp Stall Sampling (Not-issued Samples)"])
        w.writerow(["0x10", "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", "1,000", "400"])
        w.writerow(["0x20", "MUFU.EX2 R1, R1", "500", "500"])
        w.writerow(["0x30", "MUFU.EX2 R2, R2", "250", "0"])
        w.writerow(["0x40", "@!P0  BRA 0x10", "250", "250"])
    text = summary(str(path), top=2)
    lines = text.splitlines()
    assert lines[0] == "4 SASS lines, 2000 warp-stall samples"
    rows = {ln.split()[0]: ln for ln in lines[2:5]}
    assert "50.0%" in rows["gemm"] and "40.0%" in rows["gemm"]        # 1000 of 2000; 400 of 1000 not issued
    assert "37.5%" in rows["exp"] and "66.7%" in rows["exp"]          # 750; 500 of 750
    assert lines[-2:] == [" 50.0%  HGMMA.64x128x16.F32.BF16 R24, gdesc[UR8], RZ", " 25.0%  MUFU.EX2 R1, R1"]
