#!/bin/bash
# 2026-12-07 seventh session, run S7a (issue 43), the committed tree 9135a69 (the refactor of
# the candidate kernel's helpers after run Z6, not yet run on a GPU): the CUDA tests of the
# indexer, the direct kernel entries and the top-k; one GLM-5.3 layer at 131,072 and 1,048,576
# tokens (triton backend, FP8 KV); the logits at issue 43's four shapes beside DeepGEMM 54e2261.
# Logs: $OUT/s7a-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/s7alogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s pytest
timeout 240 python -m pytest -q -m cuda -p no:cacheprovider tests/test_kernels_indexer.py \
  tests/test_kernels_direct.py tests/test_kernels_topk.py > $L/pytest.log 2>&1; echo "rc=$?"
tail -3 $L/pytest.log
tar czf $OUT/s7a-logs.tgz -C $L .
s prefill; mkdir -p $L/prefill
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 200 python scripts/bench.py --out $L/prefill \
  --parts prefill --backend triton --prefill-tokens 131072,1048576 > $L/prefill.log 2>&1; echo "rc=$?"
grep -E "^prefill" $L/prefill.log | cut -c1-700
tar czf $OUT/s7a-logs.tgz -C $L .
s logits
timeout 80 python scripts/bench_indexer.py --parts logits --out $L/logits.json > $L/logits.log 2>&1
echo "rc=$?"; grep "^| [0-9]" $L/logits.log
tar czf $OUT/s7a-logs.tgz -C $L .
s end
