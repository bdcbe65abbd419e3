#!/bin/bash
# 2026-12-07 eighth session, run S8a (issue 43), on 8c91485 (the select's sort as its own
# kernel, the candidate and logits kernels of 9135a69): the top-k file's CUDA tests (not reached
# in run S7e), the sort kernel's time at 1/2/4/8 warps against 9135a69's in-select sort, the
# frontier at 4,096 x 131,072 beside DeepGEMM 54e2261, then the int32 slot indices alone
# (bench/probes/2026-12-07-candidate-trials/run-s7e-int32-slots.patch, applied on the device's
# copy only) against 9135a69's candidate kernel, timed old, new, new, old.
# Logs: $OUT/s8a-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/s8alogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s pytest
timeout 150 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_kernels_topk.py \
  > $L/pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest.log | cut -c1-240 | tail -8
tar czf $OUT/s8a-logs.tgz -C $L .
s sort
timeout 60 python bench/probes/2026-12-07g-select-sort.py .oldtree/topk_9135a69.py \
  > $L/sort.log 2>&1; echo "rc=$?"; grep -vE "^\|---" $L/sort.log | tail -8
tar czf $OUT/s8a-logs.tgz -C $L .
s frontier
timeout 150 python scripts/bench_indexer.py --parts frontier --frontier-shapes 4096x131072 \
  --out $L/frontier-4096x131072.json > $L/frontier-4096x131072.log 2>&1; echo "rc=$?"
grep -E "^\| [0-9]" $L/frontier-4096x131072.log | cut -c1-300
tar czf $OUT/s8a-logs.tgz -C $L .
s int32
git apply bench/probes/2026-12-07-candidate-trials/run-s7e-int32-slots.patch && \
timeout 60 python bench/probes/2026-12-07g-int32-slots-clamped-loads.py .oldtree/mqa_logits_9135a69.py \
  4096x131072 > $L/int32.log 2>&1; echo "rc=$?"; grep -E "^\|" $L/int32.log
git checkout -- glm_dsa tests
tar czf $OUT/s8a-logs.tgz -C $L .
s end
