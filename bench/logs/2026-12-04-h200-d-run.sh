#!/bin/bash
# 2026-12-04 run D (issues 42, 43), one device call on nvidia-h200, the final kernels: one
# GLM-5.3 layer (triton backend, FP8 KV, chunk 32,768) at 131,072 and 1,048,576 tokens with
# bf16 attention and with FP8-query (Q8KV8) attention, then the CUDA tests of the changed
# kernels and paths. Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > /tmp/d-peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
for p in bf16 fp8; do
  s prefill-$p; mkdir -p $OUT/$p
  PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python scripts/bench.py --out $OUT/$p \
    --parts prefill --backend triton --prefill-tokens 131072,1048576 --attention-precision $p > $OUT/$p/prefill.log 2>&1; echo "rc=$?"
  grep -E "^prefill" $OUT/$p/prefill.log | cut -c1-900
done
s pytest
timeout 180 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py \
  tests/test_kernels_sparse_mla_q8kv8_gluon.py tests/test_kernels_sparse_mla_q8kv8.py tests/test_attention_precision.py \
  tests/test_kernels_sparse_mla.py tests/test_backend.py > $OUT/d-pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/d-pytest.log | cut -c1-240 | tail -10
s end
