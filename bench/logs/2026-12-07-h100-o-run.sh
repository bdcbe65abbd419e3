#!/bin/bash
# 2026-12-07 run O (issues 42, 43), one device call after run N: issue 42's remaining rows
# (131K local 0, 1M local 0.5) with the FP8 in-place form beside the ring form and FlashMLA
# 9241ae3, the logits at issue 43's four shapes beside DeepGEMM 54e2261, the candidate select's
# probe (its sort, its block), one GLM-5.3 layer at 131,072 and 1,048,576 tokens (triton
# backend, FP8 KV); then, if time is left, the Q8KV8 Gluon CUDA tests (its softmax call changed
# form) and the frontier at 32,768 x 1,048,576. Logs: $OUT/o-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/ologs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
F="--queries 16384 --heads 64 128 --forms gluon gluon_fp8 flashmla --reps 5"
V='{"fp8_form": "in_place"}'
for part in "131k-local0 --local 0" "1m-local05 --s-kv 1048576 --local 0.5"; do
  set -- $part; name=$1; shift
  s sparse-$name
  timeout 60 python scripts/bench_sparse_mla.py $F --gluon-fp8-variants "$V" "$@" \
    --out $L/sparse-$name.json > $L/sparse-$name.log 2>&1; echo "rc=$?"
  grep -E "^s_q|gluon_fp8 " $L/sparse-$name.log | cut -c1-400 | tail -4
done
s logits
timeout 70 python scripts/bench_indexer.py --parts logits --out $L/logits.json > $L/logits.log 2>&1
echo "rc=$?"; grep "^| [0-9]" $L/logits.log
s select-probe
timeout 60 python bench/probes/2026-12-07-select-probe.py > $L/select-probe.log 2>&1; echo "rc=$?"
grep -E "^\|" $L/select-probe.log
s prefill; mkdir -p $L/prefill
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 190 python scripts/bench.py --out $L/prefill \
  --parts prefill --backend triton --prefill-tokens 131072,1048576 > $L/prefill.log 2>&1; echo "rc=$?"
grep -E "^prefill" $L/prefill.log | cut -c1-700
tar czf $OUT/o-logs.tgz -C $L .
s q8kv8-tests
timeout 90 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_q8kv8_gluon.py \
  > $L/pytest-q8kv8.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-q8kv8.log | cut -c1-240 | tail -6
s frontier
timeout 100 python scripts/bench_indexer.py --parts frontier --frontier-shapes 32768x1048576 \
  --out $L/frontier-1m.json > $L/frontier-1m.log 2>&1; echo "rc=$?"
grep -E "^\| [0-9]" $L/frontier-1m.log | cut -c1-400
tar czf $OUT/o-logs.tgz -C $L .
s end
