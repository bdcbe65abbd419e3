#!/bin/bash
# Session 4, last call: every CUDA test of tests/test_graphs.py (the replay cases over bf16 and
# FP8 KV, the cases above index_topk, the failed check) and the fidelity run with the triton
# backend, on the final tree (top-k rows in ascending order).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S
timeout -s INT 290 python -m pytest -v -rA --tb=short -p no:cacheprovider -m cuda tests/test_graphs.py \
  tests/test_fidelity.py > $OUT/pytest.log 2>&1; echo "rc=$?"
echo "passed: $(grep -cE '::.* PASSED' $OUT/pytest.log)"; grep -E '::.* (FAILED|ERROR)' $OUT/pytest.log | cut -c1-200
grep -E "^E   " $OUT/pytest.log | cut -c1-200 | head -8; tail -1 $OUT/pytest.log | cut -c1-300
date -u +%H:%M:%S
