#!/bin/bash
# 2026-12-07 run M (issue 42), one device call (H100 or H200, whichever is lent): Nsight Compute's stall reasons
# and per-instruction stall samples of the sparse MLA kernels beside FlashMLA 9241ae3's
# (bench/probes/2026-12-07-ncu-stalls.py: 4,096 queries, top-2048 of 131,072 keys).
# Logs: $OUT/m-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/mlogs; mkdir -p $L
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for f in ${FORMS:-gluon_h64 flashmla_h64 gluon_h128 flashmla_h128 gluon_fp8_ring_h64 gluon_fp8_in_place_h64}; do
  echo "== ncu-$f $(date -u +%H:%M:%S)"
  timeout 80 ncu --clock-control none -k 'regex:gluon|fwd' --launch-skip 1 --launch-count 1 \
    --section WarpStateStats --section SourceCounters --metrics "$M" -f -o $L/ncu-$f \
    python bench/probes/2026-12-07-ncu-stalls.py $f > $L/ncu-$f.log 2>&1; echo "rc=$?"
  ncu -i $L/ncu-$f.ncu-rep --page details --print-units base > $L/ncu-$f.txt 2>&1
  ncu -i $L/ncu-$f.ncu-rep --page source --csv --print-source sass > $L/sass-$f.csv 2>&1
  grep -E "Duration|stalled_" $L/ncu-$f.txt | sed 's/smsp__average_warps_issue_stalled_//;s/_per_issue_active.ratio//' | awk '{print $1, $NF}' | tr '\n' ' '; echo
done
tar czf $OUT/m-logs.tgz -C $L .
