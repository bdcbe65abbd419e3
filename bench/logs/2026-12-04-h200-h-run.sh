#!/bin/bash
# 2026-12-04 run H (issues 42, 43), one device call on nvidia-h200: the gather-hint probe (bf16
# sparse MLA, CONFIG's gather_hint variants beside FlashMLA 9241ae3), the Gluon-candidates probe
# (indexer_topk with the Gluon candidate kernel, DeepGEMM 54e2261 beside), then the top-k CUDA
# tests file by file (verbose, each under its own limit). Logs: $OUT/h-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/hlogs; mkdir -p $L/hint
date -u +%H:%M:%S
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
echo "== hint $(date -u +%H:%M:%S)"
OUT=$L/hint timeout 240 python bench/probes/2026-12-04-h200-hint.py > $L/hint.log 2>&1; echo "rc=$?"; tail -12 $L/hint.log
echo "== gluon candidates $(date -u +%H:%M:%S)"
timeout 150 python bench/probes/2026-12-04-h200-gluon-cand.py > $L/gluon-cand.log 2>&1; echo "rc=$?"; tail -5 $L/gluon-cand.log
for f in test_kernels_topk:45 test_kernels_direct:45 test_kernels_indexer:60; do
  n=${f%%:*}; t=${f##*:}
  echo "== $n $(date -u +%H:%M:%S)"
  timeout $t python -m pytest -v -p no:cacheprovider --durations=5 tests/$n.py > $L/pytest-$n.log 2>&1
  echo "rc=$?"; grep -E " passed| failed|FAILED" $L/pytest-$n.log | tail -4; echo "PASSED lines: $(grep -c PASSED $L/pytest-$n.log)"
done
tar czf $OUT/h-logs.tgz -C $L .
date -u +%H:%M:%S
