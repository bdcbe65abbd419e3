#!/bin/bash
# 2026-12-04 run I (issues 42, 43), one device call on nvidia-h200: the gather-hint probe after
# the ptxas workaround (h_q 128 alone first, then the six rows beside FlashMLA 9241ae3), the
# hinted forms' bitwise CUDA tests, then the top-k / indexer CUDA tests. Logs: $OUT/i-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/ilogs; mkdir -p $L/hint
date -u +%H:%M:%S
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
echo "== h_q 128 alone $(date -u +%H:%M:%S)"
timeout 60 python scripts/bench_sparse_mla.py --queries 16384 --heads 128 --s-kv 131072 --local 0.0 \
  --forms gluon flashmla --reps 10 --out $L/h128.json --gluon-variants '{"gather_hint": "evict_last_256b"}' \
  '{"gather_hint": "evict_last"}' '{"gather_hint": "256b"}' > $L/h128.log 2>&1; echo "rc=$?"; tail -6 $L/h128.log
echo "== hint probe $(date -u +%H:%M:%S)"
OUT=$L/hint timeout 150 python bench/probes/2026-12-04-h200-hint.py > $L/hint.log 2>&1; echo "rc=$?"; grep -E "^ *[0-9]+ \||keys" $L/hint.log | head -12
echo "== hinted bitwise tests $(date -u +%H:%M:%S)"
timeout 90 python -m pytest -q -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py tests/test_kernels_ptx_hints.py \
  -k "bit_unchanged or gather_hint or hint" > $L/pytest-hint.log 2>&1; echo "rc=$?"; tail -3 $L/pytest-hint.log
echo "== top-k cuda tests $(date -u +%H:%M:%S)"
timeout 150 python -m pytest -v -p no:cacheprovider --durations=8 -m cuda tests/test_kernels_indexer.py \
  tests/test_kernels_topk.py tests/test_kernels_direct.py > $L/pytest-cuda.log 2>&1; echo "rc=$?"; grep -E " passed| failed|FAILED" $L/pytest-cuda.log | tail -5
echo "== top-k tests on the GPU $(date -u +%H:%M:%S)"
timeout 90 python -m pytest -v -p no:cacheprovider tests/test_kernels_topk.py tests/test_kernels_indexer.py \
  -k "candidates_are or exact_topk_of_the_kernels or redoes or launches_of_few or equals_torch_topk_sets or lowest_tied" \
  > $L/pytest-topk.log 2>&1; echo "rc=$?"; grep -E " passed| failed|FAILED" $L/pytest-topk.log | tail -5; echo "PASSED lines $(grep -c PASSED $L/pytest-topk.log)"
tar czf $OUT/i-logs.tgz -C $L .
date -u +%H:%M:%S
