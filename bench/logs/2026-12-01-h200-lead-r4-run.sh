#!/bin/bash
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > /tmp/peers.log 2>&1; echo "peers rc=$?"
echo "== 1. CUDA tests $(date -u +%H:%M:%S)"
timeout 170 python -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_graphs.py tests/test_kernels_sparse_mla.py > $OUT/pytest_cuda2.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR|PASSED)|passed|failed|^E " $OUT/pytest_cuda2.log | cut -c1-250 | head -30
echo "== 2. HF comparison $(date -u +%H:%M:%S)"
mkdir -p /tmp/b/hf
timeout 130 python scripts/bench.py --out /tmp/b/hf --parts hf --backend triton --hf-tokens 2048,8192 > $OUT/bench_hf2.log 2>&1; echo "rc=$?"
grep -E "^hf" $OUT/bench_hf2.log | cut -c1-700; tail -3 $OUT/bench_hf2.log | cut -c1-300
cp /tmp/b/hf/bench.json $OUT/bench_hf2.json 2>/dev/null; date -u +%H:%M:%S
