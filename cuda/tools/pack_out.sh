#!/bin/bash
# At most 8 files come back from a device call: every file under $OUT not named here goes into
# $OUT/rest.tar.gz (one file), the ones named stay as they are.
#   bash cuda/tools/pack_out.sh bench.log tests.log     # the rest (ncu csv, extra logs) packed
set -u
OUT=${OUT:?}
cd "$OUT" || exit 1
keep=" $* rest.tar.gz "
rest=()
for f in $(find . -type f | sed 's#^\./##' | sort); do
  [[ "$keep" == *" $f "* ]] || rest+=("$f")
done
[ ${#rest[@]} -eq 0 ] && exit 0
tar -czf rest.tar.gz "${rest[@]}" && rm -f "${rest[@]}"
echo "packed into rest.tar.gz: ${rest[*]}"
