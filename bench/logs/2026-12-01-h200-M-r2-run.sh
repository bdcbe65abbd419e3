#!/bin/bash
# Helper M (issue 31, MoE half), round 2: the MoE alone at 2K and 32K, before (main's moe.py) and
# after on the same weights, profiles at both lengths; then the CUDA tests of the MoE and kernels.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
timeout 24 python scripts/bench_moe.py --out "$RES" --tokens 2048,32768 --before _before_moe.py --profile-tokens 2048,32768 > "$RES/bench_moe.log" 2>&1
echo "bench rc=$?"; grep -E "^(ceilings|kernels|moe|graph)" "$RES/bench_moe.log" | cut -c1-600
timeout 18 python -m pytest -q -p no:cacheprovider -rA --tb=short -m cuda tests/test_kernels_moe.py tests/test_kernels_index_quant.py tests/test_moe.py tests/test_indexer.py::test_cuda_forward_equals_cpu > "$RES/pytest_cuda.log" 2>&1
echo "pytest rc=$?"; grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$RES/pytest_cuda.log" | tail -14
