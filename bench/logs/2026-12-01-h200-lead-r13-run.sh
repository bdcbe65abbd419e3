#!/bin/bash
# Session 4, after the review: the graphs test above index_topk with its config pin now shared
# with tests/test_kernels_indexer.py (pin_logits_configs), the same four cases as R11.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S
timeout -s INT 140 python -m pytest -v -rA --tb=short -p no:cacheprovider -m cuda \
  tests/test_graphs.py::test_graphs_above_index_topk_replay_equals_eager_bitwise > $OUT/pytest.log 2>&1; echo "rc=$?"
grep -E '::.* (PASSED|FAILED|ERROR)' $OUT/pytest.log | cut -c1-160; tail -1 $OUT/pytest.log | cut -c1-200
