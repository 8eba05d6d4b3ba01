#!/bin/bash
# Nsight Compute on one FFA kernel launch of a bench/kernel.py case (GPU machine, Firecracker runtime):
# the full section set, then the details page and the SASS lines with the most warp-stall samples.
#   bash cuda/tools/ncu_profile.sh causal_32k fwd FlashFwdSm90Kernel   # -> $OUT/ncu_<case>_<mode>.txt, _sass.csv
#   MAGI_JAX_SM90_BWD_CHAIN=1 NCU_TAG=cta1 bash cuda/tools/ncu_profile.sh ...  # a variant, its own file names
set -u
CASE=$1 MODE=$2 KERNEL=$3
OUT=${OUT:-/tmp/magi_out}
TAG=${CASE}_${MODE/+/_}${NCU_TAG:+_$NCU_TAG}  # no "+" in file names
REP=/tmp/ncu_$TAG
TXT="$OUT/ncu_${TAG}.txt"
NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
# Two warm-up calls each launch the kernel once (the forward) or once per pass: skip them, profile one.
timeout "${NCU_TIMEOUT:-240}" "$NCU" --clock-control none --set full --import-source no -k "regex:$KERNEL" \
  --launch-skip "${NCU_SKIP:-2}" --launch-count 1 -f -o "$REP" \
  python3 cuda/tools/ncu_case.py "$CASE" "$MODE" > "$TXT" 2>&1
echo "ncu $CASE $MODE: rc $?" | tee -a "$TXT"
"$NCU" -i "$REP.ncu-rep" --page details >> "$TXT" 2>&1
"$NCU" -i "$REP.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_${TAG}_sass.csv" 2>> "$TXT"
python3 - "$OUT/ncu_${TAG}_sass.csv" >> "$TXT" 2>&1 <<'PY'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
if not rows:
    sys.exit("no source page")
at = next((i for i, r in enumerate(rows) if any("Stall Sampling" in h for h in r)), 0)  # after a title row
head, body = rows[at], rows[at + 1:]
print("source columns:", head)
col = next((i for i, h in enumerate(head) if "Stall Sampling (All" in h), None)
if col is None:
    sys.exit("no stall-sampling column")
num = lambda x: float(x.replace(",", "") or 0)
total = sum(num(r[col]) for r in body if len(r) > col)
print(f"{len(body)} SASS lines, {total:.0f} stall samples; the top 60:")
for r in sorted(body, key=lambda r: -num(r[col]) if len(r) > col else 0)[:60]:
    print(f"{num(r[col]) / total * 100:5.1f}%  " + " | ".join(r[:3]))
PY
# The csv is large and the txt holds its top lines: dropped unless KEEP_SASS=1 (8 files come back at most;
# cuda/tools/pack_out.sh packs what a call wrote beyond them).
[ "${KEEP_SASS:-0}" = 1 ] || rm -f "$OUT/ncu_${TAG}_sass.csv"
