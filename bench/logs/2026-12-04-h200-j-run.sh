#!/bin/bash
# 2026-12-04 run J (issue 43), one device call on nvidia-h200: the exact-top-k CUDA tests run I's
# limit cut off (ties and short rows at GLM-5.3 shapes, the top-k harness at GLM shapes and at the
# indexer's size, the direct kernel calls' CUDA test). Logs: $OUT/j-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/jlogs; mkdir -p $L
date -u +%H:%M:%S
export PYTHONPATH=$PWD
timeout 200 python -m pytest -v -p no:cacheprovider --durations=8 -m cuda tests/test_kernels_topk.py \
  tests/test_kernels_direct.py "tests/test_kernels_indexer.py::test_indexer_topk_is_an_exact_topk_of_the_kernels_own_logits_at_glm_shapes" \
  -k "not 1m_keys" > $L/pytest-cuda.log 2>&1; echo "rc=$?"; grep -E "PASSED|FAILED|ERROR| passed| failed" $L/pytest-cuda.log | tail -12
tar czf $OUT/j-logs.tgz -C $L .
date -u +%H:%M:%S
