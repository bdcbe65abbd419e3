#!/bin/bash
# 2026-12-03 run B (issues 39, 41, 46), one device call on nvidia-h200 after the merges of w45m,
# w46 and w41: the two DeepGEMM cast-helper tests run A failed on an undefined name (fixed in
# 8468a81); layer-major == chunk-major bitwise on GLM-5.3 layers 6:9 at 32K (CUDA); the whole
# GLM-5.3 at 131,072 tokens in layer-major order (target <= 45 s); then the CUDA tests of the
# GPU-path refactors (bench/logs/2026-12-03-h200-w46-run.sh's first part). Pass: 0 failed.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S; git log --oneline -1 2>/dev/null; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
summary() { grep -E "^(FAILED|ERROR)|passed|failed|^E  " "$1" | cut -c1-300 | tail -12; }
timeout 90 python -m pytest -q -rf -p no:cacheprovider -m "cuda or peers" tests/test_peers_2026.py -k cast_helpers \
  > $OUT/cast.log 2>&1; echo "cast helpers rc=$?"; summary $OUT/cast.log
echo "== w41 test $(date -u +%H:%M:%S)"
OUT=$OUT timeout 170 bash bench/logs/2026-12-03-h200-w41-run.sh test | tail -n +4
mv $OUT/pytest.log $OUT/w41_pytest.log 2>/dev/null
echo "== w41 131k $(date -u +%H:%M:%S)"
OUT=$OUT timeout 110 bash bench/logs/2026-12-03-h200-w41-run.sh 131k | tail -n +4
echo "== w46 cuda tests $(date -u +%H:%M:%S)"
left=$(( 575 - SECONDS )); echo "time left for them: $left s"
timeout $left python -m pytest -m cuda -v -rf -p no:cacheprovider --durations=15 \
  tests/test_dispatch_facts.py tests/test_kernels_direct.py \
  tests/test_kernels_sparse_mla_gluon.py tests/test_kernels_sparse_mla.py tests/test_backend.py \
  tests/test_kernels_moe.py tests/test_moe.py tests/test_kernels_index_quant.py \
  tests/test_kernels_indexer.py tests/test_kernels_topk.py tests/test_graphs.py \
  tests/test_fourth_backend.py tests/test_invariance_triton.py > $OUT/w46.log 2>&1; echo "w46 cuda rc=$?"
summary $OUT/w46.log; grep -cE " PASSED" $OUT/w46.log; grep -E "::" $OUT/w46.log | tail -1 | cut -c1-200
date -u +%H:%M:%S
