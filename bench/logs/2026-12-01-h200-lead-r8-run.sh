#!/bin/bash
# Session 4, one call: every CUDA and peer test on the final tree (graphs over FP8 KV, the tie
# rules of the top-k, the kernels after acad51c/986a301/8f8c915), then the CPU suite on this
# host's AVX-512 + AMX CPU with the GPU hidden.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
echo "== 1. pytest -m 'cuda or peers' (whole suite) $(date -u +%H:%M:%S)"
timeout 330 python -m pytest -q -rA -p no:cacheprovider -m "cuda or peers" > $OUT/pytest_cuda.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_cuda.log | cut -c1-240 | tail -20
echo "== 2. CPU suite, GPU hidden $(date -u +%H:%M:%S)"
CUDA_VISIBLE_DEVICES= timeout 210 python -m pytest -q -p no:cacheprovider > $OUT/pytest_cpu.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest_cpu.log | cut -c1-240 | tail -20
lscpu | grep "Model name"; grep -o -w -E "avx512f|amx_tile|amx_bf16" /proc/cpuinfo | sort -u | tr '\n' ' '; echo
date -u +%H:%M:%S
