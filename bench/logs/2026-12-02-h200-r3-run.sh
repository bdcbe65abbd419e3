#!/bin/bash
# R3 (issues 38, 40): the merged tree. a: the CLI on CUDA, then every CUDA test whose path the
# architecture pass moved (fused-pass dispatch, graphs, Gluon choice, paged row ends, engine
# step, fidelity); b (R3b): the Gluon kernel's tests and the harness on the real kernels.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
part=${1:-a}
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
if [ "$part" = a ]; then
  timeout 120 python -m glm_dsa prefill --config small --device cuda --backend triton --tokens 2048 --chunk 512 --requests 2 --kv-dtype fp8 > $OUT/cli_prefill.log 2>&1; echo "prefill triton fp8 graphs rc=$?"; tail -4 $OUT/cli_prefill.log | cut -c1-200
  timeout 120 python -m glm_dsa fidelity --config small --device cuda --tokens 1024 --chunk 256 > $OUT/cli_fidelity.log 2>&1; echo "fidelity rc=$?"; tail -3 $OUT/cli_fidelity.log | cut -c1-200
  timeout 420 python -m pytest -q -rf -p no:cacheprovider -m "cuda or peers" --durations=15 \
    tests/test_graphs.py tests/test_moe.py tests/test_kernels_moe.py tests/test_kernels_index_quant.py \
    tests/test_kernels_indexer.py tests/test_mla.py tests/test_indexer.py tests/test_determinism.py \
    tests/test_fidelity.py tests/test_checkpoints.py tests/test_kernels_topk.py \
    tests/test_kernels_sparse_mla.py tests/test_oracle.py tests/test_quantizers_cuda.py > $OUT/pytest_a.log 2>&1; echo "rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_a.log | cut -c1-300 | tail -15
else
  timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
  timeout 480 python -m pytest -q -rf -p no:cacheprovider -m "cuda or peers" --durations=10 \
    tests/test_kernels_sparse_mla_gluon.py tests/test_peers.py > $OUT/pytest_b.log 2>&1; echo "rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_b.log | cut -c1-300 | tail -15
fi
date -u +%H:%M:%S
