#!/bin/bash
# Evening R2 (issue 44): the triton backend in batch-invariant mode (fixed CUDA tiles) at
# GLM-5.3 width: the CUDA invariance tests, the reference mode's CUDA tests, the MoE and graphs
# CUDA tests, then the cost of the switch at 2K / 16K / 131K / 1M tokens of one layer.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S; git log --oneline -1 2>/dev/null; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 300 python -m pytest -q -rf -p no:cacheprovider -m cuda --durations=8 \
  tests/test_invariance_triton.py tests/test_determinism.py tests/test_moe.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E " $OUT/pytest.log | cut -c1-300 | tail -15
timeout 280 python scripts/bench_invariance.py --device cuda --cases triton --repeat 1 \
  --triton-tokens 2048,16384,131072,1048576 --out $OUT > $OUT/bench_invariance.log 2>&1; echo "bench rc=$?"
tail -8 $OUT/bench_invariance.log | cut -c1-250
date -u +%H:%M:%S
