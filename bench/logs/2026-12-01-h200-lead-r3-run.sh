#!/bin/bash
# Lead's final H200 run (R3) of the merged tree.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
git log --oneline -1 2>/dev/null; date -u +%H:%M:%S
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > /tmp/peers.log 2>&1; echo "peers rc=$?"
mkdir -p /tmp/b/prefill /tmp/b/hf
echo "== 1. CUDA tests $(date -u +%H:%M:%S)"
timeout 200 python -m pytest -q -rA -p no:cacheprovider -m "cuda or peers" tests/test_kernels_sparse_mla_gluon.py tests/test_kernels_sparse_mla.py tests/test_graphs.py tests/test_kernels_indexer.py tests/test_kernels_moe.py tests/test_moe.py tests/test_determinism.py tests/test_kernels_index_quant.py > $OUT/pytest_cuda.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_cuda.log | tail -15
echo "== 2. one GLM-5.3 layer, 1M tokens, triton $(date -u +%H:%M:%S)"
timeout 235 python scripts/bench.py --out /tmp/b/prefill --parts prefill --backend triton --prefill-tokens 1048576 > $OUT/bench_prefill_1m.log 2>&1; echo "rc=$?"
grep -E "^prefill|ceiling" $OUT/bench_prefill_1m.log | cut -c1-1500
echo "== 3. HF comparison $(date -u +%H:%M:%S)"
timeout 125 python scripts/bench.py --out /tmp/b/hf --parts hf --backend triton --hf-tokens 2048,8192 > $OUT/bench_hf.log 2>&1; echo "rc=$?"
grep -E "^hf" $OUT/bench_hf.log | cut -c1-900
tar czf $OUT/bench_dirs.tgz -C /tmp/b . ; date -u +%H:%M:%S
