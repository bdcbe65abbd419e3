#!/bin/bash
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 150 python -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_graphs.py tests/test_kernels_index_quant.py > $OUT/pytest_cuda3.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR|PASSED)|passed|failed" $OUT/pytest_cuda3.log | cut -c1-200 | head -20
grep -E "^(glm_dsa)\S+:[0-9]+" $OUT/pytest_cuda3.log | sort | uniq -c | sort -rn | head -6
