"""cuda/tools/sass_samples.py on a made-up Nsight Compute source page, cuda/tools/sass_path.py on a made-up
SASS listing, cuda/tools/sched_sim.py's backward model, cuda/tools/tile_waste.py's forward walks on small
masks, cuda/tools/power_probe.py on made-up nvidia-smi samples and cuda/tools/ptx_same.py on made-up PTX: no GPU
needed."""

from __future__ import annotations

import csv
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "cuda" / "tools"))
from ncu_csv import kept, launches  # noqa: E402
from power_probe import parse_samples, summarize  # noqa: E402
from ptx_same import compare  # noqa: E402
from sass_path import kernel_listing, walk  # noqa: E402
from sass_samples import instruction_class, summary  # noqa: E402
from sched_sim import bwd_makespans, kv_block_work  # noqa: E402
from tile_waste import computed_cells, masked_wg_steps, walk_cells  # noqa: E402

from magi_jax import masks  # noqa: E402
from magi_jax.mask import AttnMask  # noqa: E402


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


def test_kv_block_work_counts_the_row_steps_of_each_k_block():
    # Causal 256 x 256: keys 0-127 are seen by rows 0-255 (4 steps of 64), keys 128-255 by rows 128-255 (2).
    assert kv_block_work(AttnMask([[0, 256]], [[0, 256]], ["causal"], 256, 256)).tolist() == [4, 2]
    # Full 100 x 300: every k block (the last one partial) by all 100 rows, 2 steps.
    assert kv_block_work(AttnMask([[0, 100]], [[0, 300]], ["full"], 100, 300)).tolist() == [2, 2, 2]
    # Inverse causal 256 x 256: keys 0-127 by rows 0-127, keys 128-255 by all rows.
    assert kv_block_work(AttnMask([[0, 256]], [[0, 256]], ["inv_causal"], 256, 256)).tolist() == [2, 4]


def test_bwd_longest_first_order_closes_the_grid_orders_tail():
    # One long document and many short ones: in the grid's order the last head's heavy k blocks start late.
    work = kv_block_work(masks.varlen_causal([8192] + [512] * 16))
    bound, grid, kernel = bwd_makespans(work, heads=16, per=1, sms=132, tile_cost=1.0)
    assert grid > 1.02 * bound
    assert kernel < 1.01 * bound


def test_tile_waste_counts_the_walks_cells():
    # Causal 128 x 128: one q block, one key tile. The block computes all 128 x 128 cells; by halves, rows
    # 0-63 need keys 0-63 only (one half) and rows 64-127 keys 0-127 (two).
    causal = AttnMask([[0, 128]], [[0, 128]], ["causal"], 128, 128)
    assert causal.area() == 128 * 129 // 2
    assert computed_cells(causal, 128, halves=False, union=False) == 128 * 128
    assert computed_cells(causal, 64, halves=True, union=False) == 64 * 64 + 64 * 128
    # Two slices with disjoint rows of one block and the same keys: walked twice, or once as their union.
    two = AttnMask([[0, 64], [64, 128]], [[0, 128], [0, 128]], ["full", "full"], 128, 128)
    assert two.area() == 128 * 128
    assert computed_cells(two, 128, halves=False, union=False) == 2 * 128 * 128
    assert computed_cells(two, 128, halves=False, union=True) == 128 * 128
    # The kernel's walk groups them (rows disjoint and ascending, same keys), not slices sharing rows.
    assert walk_cells(two) == 128 * 128
    shared_rows = AttnMask([[0, 128], [0, 128]], [[0, 64], [64, 128]], ["full", "full"], 128, 128)
    assert walk_cells(shared_rows) == 2 * 128 * 128
    # Nor slices whose rows come in the other order in the list.
    reversed_rows = AttnMask([[64, 128], [0, 64]], [[0, 128], [0, 128]], ["full", "full"], 128, 128)
    assert walk_cells(reversed_rows) == 2 * 128 * 128
    # Keys 64-192: the walk's one tile starts at the span (128 keys); the union's aligned grid needs two.
    shifted = AttnMask([[0, 128]], [[64, 192]], ["full"], 128, 192)
    assert computed_cells(shifted, 128, halves=False, union=False) == 128 * 128
    assert computed_cells(shifted, 128, halves=False, union=True) == 2 * 128 * 128
    # 60 keys: one 128-key tile, or one of 64 (now_n64).
    narrow = AttnMask([[0, 128]], [[0, 60]], ["full"], 128, 60)
    assert walk_cells(narrow) == 128 * 128
    assert walk_cells(narrow, 64) == 128 * 64
    # A band of 65 keys a row (bi-causal over 192 keys): three tiles of 64.
    band = AttnMask([[0, 128]], [[0, 192]], ["bi_causal"], 128, 192)
    assert walk_cells(band, 64) == 3 * 128 * 64


def test_masked_wg_steps_counts_the_backward_pairs_no_row_of_which_attends():
    # Causal 256 x 256: k block 0 walks 4 steps of 64 rows, k block 1 two; in each k block the first step's
    # rows (the diagonal's upper half) attend none of the second warpgroup's 64 keys.
    causal = AttnMask([[0, 256]], [[0, 256]], ["causal"], 256, 256)
    assert masked_wg_steps(causal) == (2, 12)
    # Full 100 x 300: every row attends every key, but the last k block holds keys 256-299 only: its second
    # warpgroup's keys (320-383) lie past the slice, so both of its steps are masked for it.
    assert masked_wg_steps(AttnMask([[0, 100]], [[0, 300]], ["full"], 100, 300)) == (2, 12)


def test_power_probe_averages_each_phase_per_gpu(tmp_path, capsys):
    path = tmp_path / "smi.csv"
    lines = ["2026/11/30 21:00:00.000, 0, 1980, 120.0, 0x0000000000000001",   # idle phase
             "2026/11/30 21:00:01.000, 0, 1700, 690.0, 0x0000000000000004",   # busy: software power cap
             "2026/11/30 21:00:01.500, 0, 1600, 700.0, 0x0000000000000000",
             "2026/11/30 21:00:01.500, 1, 1980, 121.0, 0x0000000000000000",
             "[Unknown Error]"]
    path.write_text("\n".join(lines) + "\n")
    samples = parse_samples(path)
    assert len(samples) == 4 and samples[1][1:] == (0, 1700.0, 690.0, 4)
    t0 = samples[0][0]
    summarize(samples, [("idle", t0 - 0.1, t0 + 0.1, 0.0, 0.0), ("busy", t0 + 0.9, t0 + 1.6, 0.002, 1380.0)])
    idle, busy = capsys.readouterr().out.splitlines()
    assert "gpu0:   1980 MHz   120 W capped   0% (1)" in idle and "gpu1" not in idle and "mJ" not in idle
    assert "2.000 ms/call    1380.0 mJ/call ( 690 W)" in busy  # the energy counter's mean power
    assert "gpu0:   1650 MHz   695 W capped  50% (2)" in busy and "gpu1:   1980 MHz   121 W capped   0% (1)" in busy


SASS = """
		Function : other_kernel
        /*0000*/                   EXIT ;
		Function : _Z4loopv
        /*0000*/                   MOV R0, RZ ;
        /*0010*/                   WARPGROUP.DEPBAR.LE gsb0, 0x1 ;
        /*0020*/              @P0 BRA 0x50 ;
        /*0030*/                   FADD R1, R1, R2 ;
        /*0040*/                   FADD R1, R1, R3 ;
        /*0050*/             @!P1 BRA P2, 0x10 ;
        /*0060*/                   BRA 0x10 ;
"""


def test_sass_path_counts_a_loops_instructions_and_taken_branches():
    listing = kernel_listing(SASS, "loopv")
    assert listing[0] == (0x0, "MOV R0, RZ") and len(listing) == 7
    skip = walk(listing, 0x10, "TT")  # over the FADDs, then back
    assert (skip["issued"], skip["taken"], skip["closed"]) == (3, 2, True)
    fall = walk(listing, 0x10, "NN")  # through the FADDs, then the unconditional branch back
    assert (fall["issued"], fall["taken"], fall["closed"]) == (6, 1, True)
    assert [b[2] for b in fall["branches"]] == ["N", "N", "T"]
    short = walk(listing, 0x10, "N")  # decisions run out at the second predicated branch
    assert not short["closed"] and short["branches"][-1] == (0x50, "@!P1 BRA P2, 0x10", "?")


def test_ncu_csv_keeps_every_third_launch_of_several_cases():
    # ncu --csv: a row per (launch, metric), between ==PROF== lines and the program's own output; two cases of
    # three calls each in one process: the third and the sixth launch are the measured ones.
    header = ('"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size",'
              '"Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"')
    rows = [f'"{i}","7","python3","h","FlashFwdSm90Kernel","1","13","(384, 1, 1)","(132, 1, 1)","0","9.0",'
            f'"Command line profiler metrics","{name}","{unit}","{value}"'
            for i in range(6) for name, unit, value in (("sm__cycles_elapsed.max", "cycle", f"{1000 + i},123"),
                                                        ("smsp__inst_executed.sum", "inst", str(50 + i)))]
    text = "\n".join(["==PROF== Connected to process 7", "causal_32k fwd: 3 calls done", header, *rows,
                      "==PROF== Disconnected from process 7"])
    got = kept(launches(text), 3)
    assert got == [{"sm__cycles_elapsed.max": "1002123", "smsp__inst_executed.sum": "52"},
                   {"sm__cycles_elapsed.max": "1005123", "smsp__inst_executed.sum": "55"}]


def _ptx(kernels: dict[str, list[str]], first_label: int) -> str:
    """A made-up PTX unit: each kernel a branch to its own label, numbered across the unit as nvcc does."""
    text, n = "//\n.version 8.8\n", first_label
    for name, body in kernels.items():
        text += f"\t// .globl\t{name}\n.visible .entry {name}(\n)\n{{\n"
        text += "".join(f"\t{line}\n" for line in body)
        text += f"\t@%p1 bra \t$L__BB{n}_2;\nWAIT_{n}:\n\tbra WAIT_{n};\n$L__BB{n}_2:\n\tret;\n}}\n"
        n += 1
    return text


def test_ptx_same_renumbers_labels_and_finds_a_changed_kernel():
    body = ["mul.f32 %f1, %f2, %f3;"]
    before = _ptx({"dead": ["mov.u32 %r1, 0;"], "kept": body, "changed": body}, first_label=0)
    after = _ptx({"kept": body, "changed": ["mul.f32 %f1, %f3, %f2;"]}, first_label=7)
    result = compare(before, after)
    # "kept" is the second kernel before and the first after: its labels' numbers differ, its code does not.
    assert result == {"same": ["kept"], "differ": ["changed"], "added": [], "removed": ["dead"]}
    assert compare(before, before)["same"] == ["dead", "kept", "changed"]
