#!/bin/bash
# 2026-12-07 run U (issue 43), the session's last device call: the exact top-k over 1M-key rows
# (the CUDA test runs I-T left out for time), then the frontier at the four shapes of issue 43's
# bench not measured on this card (16K and 32K rows over 131K keys, 4K and 16K over 1M) beside
# DeepGEMM 54e2261. Logs: $OUT/u-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/ulogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s 1m-test
timeout 120 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_indexer.py \
  -k "1m_keys" > $L/pytest-1m.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-1m.log | cut -c1-240 | tail -4
tar czf $OUT/u-logs.tgz -C $L .
for shape in 16384x131072 32768x131072 4096x1048576 16384x1048576; do
  s frontier-$shape
  timeout 110 python scripts/bench_indexer.py --parts frontier --frontier-shapes $shape \
    --out $L/frontier-$shape.json > $L/frontier-$shape.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]" $L/frontier-$shape.log | cut -c1-400
  grep -oE '"sample_threshold_ms[^}]*' $L/frontier-$shape.log
  tar czf $OUT/u-logs.tgz -C $L .
done
s end
