#!/bin/bash
# 2026-12-04 run E (issues 42, 43), one device call on nvidia-h200, the final tree (helper rq's
# requantization kernel, helper dd's shared kernel helpers): the FP8 requantization beside its
# torch form, the one-layer 1M prefill in FP8-query attention again, then the CUDA tests of every
# kernel and path changed this session (run D's were cut by their limit). Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > /tmp/e-peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s requant
timeout 60 python scripts/bench_kv_requant.py --tokens 131072,1048576 --out $OUT/e-kv_requant.json > $OUT/e-kv_requant.log 2>&1; echo "rc=$?"; tail -4 $OUT/e-kv_requant.log | cut -c1-300
s prefill-fp8; mkdir -p $OUT/fp8
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 130 python scripts/bench.py --out $OUT/fp8 \
  --parts prefill --backend triton --prefill-tokens 1048576 --attention-precision fp8 > $OUT/fp8/prefill.log 2>&1; echo "rc=$?"
grep -E "^prefill" $OUT/fp8/prefill.log | cut -c1-900
s pytest
timeout 330 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_kv_requant.py \
  tests/test_kernels_sparse_mla_q8kv8.py tests/test_attention_precision.py tests/test_kernels_sparse_mla.py \
  tests/test_backend.py tests/test_kernels_sparse_mla_q8kv8_gluon.py tests/test_kernels_sparse_mla_gluon.py \
  > $OUT/e-pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/e-pytest.log | cut -c1-240 | tail -10
s end
