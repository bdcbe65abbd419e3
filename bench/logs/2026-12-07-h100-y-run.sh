#!/bin/bash
# 2026-12-07 fifth session, run Y (issue 43): indexer_topk's host plan without the span read.
# 1. the CUDA tests of the indexer, the direct kernel entries and the top-k (the new windows
#    kernel and window split compiled for the first time); 2. the previous host plan against
#    the shipped one in one process (bench/probes/2026-12-07e-host-plan.py); 3. the frontier at
#    4,096 x 131,072 beside DeepGEMM 54e2261; 4. the candidate select at
#    8/6/5-bit radix digits (bench/probes/2026-12-07e-select-digits.py). Logs: $OUT/y-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/ylogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s pytest
timeout 200 python -m pytest -q -m cuda tests/test_kernels_indexer.py tests/test_kernels_direct.py \
  tests/test_kernels_topk.py -k "not 1m_keys" > $L/pytest.log 2>&1; echo "rc=$?"; tail -3 $L/pytest.log
tar czf $OUT/y-logs.tgz -C $L .
s plan
timeout 120 python bench/probes/2026-12-07e-host-plan.py 4096x131072 16384x131072 > $L/host-plan.log 2>&1
echo "rc=$?"; grep "^|" $L/host-plan.log
tar czf $OUT/y-logs.tgz -C $L .
s digits
timeout 100 python bench/probes/2026-12-07e-select-digits.py > $L/select-digits.log 2>&1; echo "rc=$?"
grep "^|" $L/select-digits.log
tar czf $OUT/y-logs.tgz -C $L .
for shape in 4096x131072; do
  s frontier-$shape
  timeout 90 python scripts/bench_indexer.py --parts frontier --frontier-shapes $shape \
    --out $L/frontier-$shape.json > $L/frontier-$shape.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]" $L/frontier-$shape.log | cut -c1-400
  grep -oE '"gpu_idle_ms[^,]*|"launches[^,]*' $L/frontier-$shape.log | head -2
  tar czf $OUT/y-logs.tgz -C $L .
done
s end
