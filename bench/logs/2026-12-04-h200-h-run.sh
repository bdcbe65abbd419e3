#!/bin/bash
# 2026-12-04 run H (issues 43, 42), one device call on nvidia-h200: the indexer/top-k CUDA tests
# file by file (verbose, each under its own limit), the Gluon-candidates probe, and the top-k
# frontier on this tree at all six shapes with DeepGEMM 54e2261. Logs: $OUT/h-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/hlogs; mkdir -p $L
date -u +%H:%M:%S
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
for f in test_kernels_topk test_kernels_direct test_kernels_indexer; do
  echo "== $f $(date -u +%H:%M:%S)"
  timeout 120 python -m pytest -v -p no:cacheprovider --durations=5 tests/$f.py > $L/pytest-$f.log 2>&1
  echo "rc=$?"; grep -E "passed|failed|FAILED" $L/pytest-$f.log | tail -4; grep -c PASSED $L/pytest-$f.log
done
echo "== gluon candidates $(date -u +%H:%M:%S)"
timeout 150 python bench/probes/2026-12-04-h200-gluon-cand.py > $L/gluon-cand.log 2>&1; echo "rc=$?"; tail -6 $L/gluon-cand.log
echo "== frontier $(date -u +%H:%M:%S)"
timeout 200 python scripts/bench_indexer.py --parts ceiling,frontier --out $L/frontier.json > $L/frontier.log 2>&1
echo "bench rc=$?"; grep -E "^\| [0-9]|^ceiling" $L/frontier.log
tar czf $OUT/h-logs.tgz -C $L .
date -u +%H:%M:%S
