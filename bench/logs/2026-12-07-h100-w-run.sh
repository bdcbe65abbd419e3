#!/bin/bash
# 2026-12-07 fourth session, runs W and W2 (issue 43): the candidate kernel at tiles the tuner does not
# have, and the sample's aim (stride x target), at 4,096 and 16,384 rows over 131,072 keys
# (bench/probes/2026-12-07d-candidate-tiles-and-target.py: every variant beside the shipped
# call in one process). Logs: $OUT/w-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/wlogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
if [ "${1:-}" = w2 ]; then
  s density
  timeout 300 python bench/probes/2026-12-07d-candidate-tiles-and-target.py --density 4096x131072 \
    16384x131072 4096x1048576 > $L/density.log 2>&1; echo "rc=$?"
  grep -E "^\||^[0-9]+ x" $L/density.log | cut -c1-200; tail -2 $L/density.log | cut -c1-300
  tar czf $OUT/w2-logs.tgz -C $L .; s end; exit 0
fi
s probe
timeout 420 python bench/probes/2026-12-07d-candidate-tiles-and-target.py 4096x131072 16384x131072 \
  > $L/tiles-and-target.log 2>&1; echo "rc=$?"
grep -E "^\||^[0-9]+ x" $L/tiles-and-target.log | cut -c1-200
tail -3 $L/tiles-and-target.log | cut -c1-300
tar czf $OUT/w-logs.tgz -C $L .
s end
# Run W2 (the same session, after W): keep density, bash bench/logs/2026-12-07-h100-w-run.sh w2
