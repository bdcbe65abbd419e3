#!/bin/bash
# 2026-12-07 run L (issues 42, 43), one device call (H100 or H200, whichever is lent): the sparse MLA CUDA tests
# after the exponent's FFMA fold and the FP8 in-place form (Gluon split, seesaw, FP8 rows, Q8KV8), issue 42's six rows
# beside FlashMLA 9241ae3 (one process per key count and local share), then one GLM-5.3 layer
# (triton backend, FP8 KV, bf16 attention, chunk 32,768) at 131,072 and 1,048,576 tokens.
# Logs: $OUT/l-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/llogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s pytest
timeout 150 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py \
  tests/test_kernels_sparse_mla_q8kv8_gluon.py tests/test_attention_precision.py > $L/pytest-sparse.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-sparse.log | cut -c1-240 | tail -6
F="--queries 16384 --heads 64 128 --forms gluon gluon_fp8 flashmla --reps 5"
V='{"fp8_form": "in_place"}'  # the FP8 in-place form beside the ring form (gluon_fp8)
for part in "131k-local0 --local 0" "131k-local05 --local 0.5" "1m-local05 --s-kv 1048576 --local 0.5"; do
  set -- $part; name=$1; shift
  s sparse-$name
  timeout 80 python scripts/bench_sparse_mla.py $F --gluon-fp8-variants "$V" "$@" --out $L/sparse-$name.json > $L/sparse-$name.log 2>&1; echo "rc=$?"
  grep -E "^s_q|gluon|flashmla" $L/sparse-$name.log | cut -c1-300 | tail -4
done
s prefill; mkdir -p $L/prefill
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python scripts/bench.py --out $L/prefill \
  --parts prefill --backend triton --prefill-tokens 131072,1048576 > $L/prefill.log 2>&1; echo "rc=$?"
grep -E "^prefill" $L/prefill.log | cut -c1-700
tar czf $OUT/l-logs.tgz -C $L .
s end
