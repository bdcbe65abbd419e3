#!/bin/bash
# 2026-12-07 fourth session, run X (issue 43): the frontier at 4,096 x 131,072 and
# 32,768 x 1,048,576 on the H200 the targets name (run W2's machine, still warm), beside
# DeepGEMM 54e2261 in the same process; tree 7ada516+ (no indexer kernel change since runs P-V).
# Logs: $OUT/x-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/xlogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
for shape in 4096x131072 32768x1048576; do
  s frontier-$shape
  timeout 170 python scripts/bench_indexer.py --parts frontier --frontier-shapes $shape \
    --out $L/frontier-$shape.json > $L/frontier-$shape.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]" $L/frontier-$shape.log | cut -c1-400
  grep -oE '"sample_threshold_ms[^}]*' $L/frontier-$shape.log
  tar czf $OUT/x-logs.tgz -C $L .
done
s end
