#!/bin/bash
# 2026-12-07 run S (issue 43): the candidate kernel with its atomics' slots first read after the
# next tile's MMA (STORE_LAG 1; run R's ncu found the warps waiting on them at a select in
# their own tile): the indexer CUDA tests, then the frontier at 4,096 x 131,072 and
# 32,768 x 1,048,576 beside DeepGEMM 54e2261 (both lags tuned and timed per shape class).
# Tree: HEAD b53d312 + bench/probes/2026-12-07-candidate-trials/run-s-lagged-slots.patch (the candidate kernel's atomics' slots first read at the lagged stores;
# reverted after the run). Logs: $OUT/s-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/slogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s indexer-tests
timeout 150 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_indexer.py \
  tests/test_kernels_direct.py -k "not 1m_keys" > $L/pytest-indexer.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-indexer.log | cut -c1-240 | tail -8
tar czf $OUT/s-logs.tgz -C $L .
for shape in 4096x131072 32768x1048576; do
  s frontier-$shape
  timeout 170 python scripts/bench_indexer.py --parts frontier --frontier-shapes $shape \
    --out $L/frontier-$shape.json > $L/frontier-$shape.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]" $L/frontier-$shape.log | cut -c1-400
  grep -oE '"candidate_config_ms": \{[^}]*\}' $L/frontier-$shape.log | sed 's/, num_ctas: 1, num_stages: [0-9], maxnreg: None//g'
  grep -oE '"sample_threshold_ms[^}]*' $L/frontier-$shape.log
  tar czf $OUT/s-logs.tgz -C $L .
done
s end
