#!/bin/bash
# Session 3, one call: the captured FP8-KV step and the deterministic top-k (CUDA tests), then
# the HF comparison with CUDA graphs on (2,048 and 16,384 first: partial output comes back).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
echo "== 1. CUDA tests $(date -u +%H:%M:%S)"
timeout 80 python -m pytest -q -rA -p no:cacheprovider tests/test_kernels_topk.py \
    "tests/test_kernels_indexer.py::test_indexer_topk_is_an_exact_topk_of_the_kernels_own_logits" \
    "tests/test_kernels_indexer.py::test_indexer_topk_redoes_rows_whose_ties_overflow_the_buffer" \
    tests/test_graphs.py -k "not test_graphs_replay or fp8" > $OUT/pytest_cuda.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR|PASSED)|passed|failed|^E " $OUT/pytest_cuda.log | cut -c1-220 | head -30
echo "== 2. HF comparison $(date -u +%H:%M:%S)"
mkdir -p $OUT/hf; timeout 150 python scripts/bench.py --out $OUT/hf --parts hf --backend triton --hf-tokens 2048,16384,8192 \
    > $OUT/bench_hf.log 2>&1; echo "rc=$?"
grep -E "^hf" $OUT/bench_hf.log | cut -c1-900; tail -3 $OUT/bench_hf.log | cut -c1-300
date -u +%H:%M:%S
