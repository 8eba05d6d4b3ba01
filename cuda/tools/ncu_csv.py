"""Metrics per launch from Nsight Compute's --csv output: cycle A/Bs of several cases in one process.

    ncu --clock-control none --csv --metrics sm__cycles_elapsed.max,smsp__inst_executed.sum \\
        -k regex:FlashFwdSm90Kernel python3 cuda/tools/ncu_case.py causal_32k varlen_swa1024_32k fwd > c.csv
    python3 cuda/tools/ncu_csv.py c.csv --every 3 --labels causal_32k varlen_swa1024_32k

prints a markdown row per kept launch: the every-th launch of each group in launch order (ncu_case.py calls
each case three times, the third measured, as --launch-skip 2 measured it for one case), its label, then each
metric's value in the order the metrics first appear.
"""

from __future__ import annotations

import argparse
import csv
import sys


def launches(text: str) -> list[dict[str, str]]:
    """{metric name: value} per profiled launch, in launch order (ncu --csv: a row per launch and metric;
    lines not CSV, such as ==PROF== messages and the program's own output, are left out)."""
    rows = [line for line in text.splitlines() if line.startswith('"')]
    by_id: dict[str, dict[str, str]] = {}
    for row in csv.DictReader(rows):
        by_id.setdefault(row["ID"], {})[row["Metric Name"]] = row["Metric Value"].replace(",", "")
    return list(by_id.values())


def kept(all_launches: list[dict[str, str]], every: int) -> list[dict[str, str]]:
    """The every-th launch of each group of `every` (the last of each)."""
    return all_launches[every - 1::every]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv_file")
    ap.add_argument("--every", type=int, default=3)
    ap.add_argument("--labels", nargs="*", default=[])
    a = ap.parse_args()
    chosen = kept(launches(open(a.csv_file).read()), a.every)
    if a.labels and len(a.labels) != len(chosen):
        print(f"{len(chosen)} measured launches for {len(a.labels)} labels (a run that stopped early?)",
              file=sys.stderr)
    for i, metrics in enumerate(chosen):
        label = a.labels[i] if i < len(a.labels) else f"launch {(i + 1) * a.every}"
        print(f"| {label} | " + " | ".join(metrics.values()) + " |")


if __name__ == "__main__":
    main()
