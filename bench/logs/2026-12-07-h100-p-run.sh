#!/bin/bash
# 2026-12-07 run P (issues 42, 43), one short device call after run O: the FP8 in-place form as
# CONFIG's default through the harness (CUDA tests), the Triton sparse MLA's folded scale (all its
# CUDA tests), the logits at 8,192 x 1,048,576 beside
# DeepGEMM 54e2261 (run O's ran out of memory on the 80 GB card: two full outputs held), the
# frontier at 32,768 x 1,048,576 with its steps timed after a warm-up. Logs: $OUT/p-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/plogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s logits
timeout 60 python scripts/bench_indexer.py --parts logits --logits-shapes 8192x1048576x32 \
  --out $L/logits-1m.json > $L/logits-1m.log 2>&1; echo "rc=$?"; grep "^| [a-z]" $L/logits-1m.log
s sparse-tests
timeout 130 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla.py \
  > $L/pytest-sparse-triton.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-sparse-triton.log | cut -c1-240 | tail -6
timeout 130 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py \
  -k "fp8 or harness" > $L/pytest-sparse.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-sparse.log | cut -c1-240 | tail -6
tar czf $OUT/p-logs.tgz -C $L .
s frontier
timeout 100 python scripts/bench_indexer.py --parts frontier --frontier-shapes 32768x1048576 \
  --out $L/frontier-1m.json > $L/frontier-1m.log 2>&1; echo "rc=$?"
grep -E "^\| [0-9]" $L/frontier-1m.log | cut -c1-400
tar czf $OUT/p-logs.tgz -C $L .
s end
