#!/bin/bash
# 2026-12-07 sixth session, run Z6 (issue 43): the committed tree (the candidate kernel's PTX
# epilogue, stores one tile later only; the logits kernels with Triton's stores; the head sum's
# explicit fmas): the CUDA tests of the indexer, the direct kernel entries and the top-k, then
# the frontier at 4,096 x 131,072 beside DeepGEMM 54e2261.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/z6logs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s pytest
timeout 290 python -m pytest -q -m cuda tests/test_kernels_indexer.py tests/test_kernels_direct.py \
  tests/test_kernels_topk.py > $L/pytest.log 2>&1; echo "rc=$?"; tail -3 $L/pytest.log
tar czf $OUT/z6-logs.tgz -C $L .
for shape in 4096x131072; do
  s frontier-$shape
  timeout 150 python scripts/bench_indexer.py --parts frontier --frontier-shapes $shape \
    --out $L/frontier-$shape.json > $L/frontier-$shape.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]" $L/frontier-$shape.log | cut -c1-300
  tar czf $OUT/z6-logs.tgz -C $L .
done
s end
