#!/bin/bash
# 2026-12-04 run F, one device call on nvidia-h200, the final tree: the numerics tests and this
# session's kernel tests on the H200 host's CPU (AVX-512 + AMX; CUDA hidden, Triton's
# interpreter), then the AOT compile tests and a CUDA pass over the Gluon kernels after the
# compile_sm90 refactor (kernels/aot.py). Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
date -u +%H:%M:%S; lscpu | grep -iE "model name|flags" | grep -oE "Model name.*|avx512f|amx_tile" | sort -u | tr '\n' ' '; echo
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s cpu
CUDA_VISIBLE_DEVICES= TRITON_INTERPRET=1 timeout 200 python -m pytest -q -p no:cacheprovider tests/test_determinism.py tests/test_oracle.py \
  tests/test_mla.py tests/test_prefill.py tests/test_moe.py tests/test_norm.py tests/test_kernels_kv_requant.py \
  tests/test_kernels_sparse_mla_q8kv8.py tests/test_testing_2026.py tests/test_attention_precision.py > $OUT/f-cpu.log 2>&1; echo "rc=$?"
tail -1 $OUT/f-cpu.log
s cuda
timeout 150 python -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py tests/test_kernels_sparse_mla_q8kv8_gluon.py \
  -k "harness or config" > $OUT/f-cuda.log 2>&1; echo "rc=$?"; tail -1 $OUT/f-cuda.log
s end
