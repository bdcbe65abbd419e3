#!/bin/bash
# P (issue 30), round 2: issue 30's four logits shapes beside DeepGEMM and the fp8 ceiling; the
# CUDA tests of the final indexer; the candidate kernel with per-thread regions (vs R1b's atomics).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
nvidia-smi --query-gpu=name,driver_version --format=csv > $RES/gpu.txt 2>&1
echo "== bench logits"; date
timeout 55 python scripts/bench_indexer.py --parts ceiling,logits --out $RES/bench_logits.json > $RES/bench_logits.log 2>&1
echo "rc=$?"; tail -c 2500 $RES/bench_logits.log
echo "== cuda tests"; date
timeout 20 python -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_kernels_indexer.py -k "exact_topk_of_the_kernels_own_logits_at_glm_shapes or indexer_topk_at_glm_shapes_recall" > $RES/pytest_cuda.log 2>&1
echo "rc=$?"; tail -n 8 $RES/pytest_cuda.log
echo "== diag regions"; date
timeout 13 python p30scratch/diag_regions.py > $RES/diag_regions.log 2>&1
echo "rc=$?"; tail -c 1500 $RES/diag_regions.log
date
