#!/bin/bash
# Session 4, third call. A: the graphs test above index_topk (R9: both cases failed, cut before
# their tracebacks) and the Gluon FP8-pool test now eager; B: the indexer top-k CUDA tests R9 cut
# (now asserting ascending rows); C: scripts/probe_topk_paths.py, where eager, again, graphs
# and padded eager part ways, with autotuned and with pinned logits configs.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S
T="python -m pytest -v -rA --tb=short -p no:cacheprovider -m cuda"
S() { echo "passed: $(grep -cE '::.* PASSED' $1)"; grep -E '::.* (FAILED|ERROR)' $1 | cut -c1-200; grep -E "^E " $1 | cut -c1-400 | head -16; tail -1 $1 | cut -c1-300; }
echo "== A $(date -u +%H:%M:%S)"
timeout -s INT 140 $T tests/test_graphs.py::test_graphs_above_index_topk_replay_equals_eager_bitwise \
  tests/test_kernels_sparse_mla_gluon.py::test_triton_backend_attends_an_fp8_pool_with_gluon_over_the_dequantized_context \
  > $OUT/pytest_A.log 2>&1; echo "rc=$?"; S $OUT/pytest_A.log
echo "== B $(date -u +%H:%M:%S)"
timeout -s INT 110 $T tests/test_kernels_indexer.py::test_indexer_topk_is_an_exact_topk_of_the_kernels_own_logits_at_glm_shapes \
  tests/test_kernels_indexer.py::test_indexer_topk_at_glm_shapes_recall > $OUT/pytest_B.log 2>&1; echo "rc=$?"; S $OUT/pytest_B.log
echo "== C $(date -u +%H:%M:%S)"
timeout 120 python scripts/probe_topk_paths.py --out $OUT/probe.json > $OUT/probe.log 2>&1; echo "rc=$?"
cut -c1-900 $OUT/probe.log | grep -v Warn | tail -4
timeout 100 python scripts/probe_topk_paths.py --pin --out $OUT/probe_pin.json > $OUT/probe_pin.log 2>&1; echo "rc=$?"
cut -c1-900 $OUT/probe_pin.log | grep -v Warn | tail -4
date -u +%H:%M:%S
