#!/bin/bash
# 2026-12-07 seventh session, run S7e (issue 43): the one call that found a machine of the four
# made for this tree (the others answered "no device machine could be started"), with the
# session's last device time: the CUDA tests of the indexer, the direct kernel entries and the
# top-k on the tree with the candidate kernel's int32 slot indices, the key loads clamped to the
# last key instead of masked (both now in
# bench/probes/2026-12-07-candidate-trials/run-s7e-int32-slots.patch and
# bench/probes/2026-12-07-candidate-trials/run-s7e-clamped-loads.patch, reverted
# after this run) and the candidate select's sort as its own kernel (kept); then the raw kernels
# against 9135a69's at 4,096 x 131,072 (bench/probes/2026-12-07g-int32-slots-clamped-loads.py,
# the old module carried in .oldtree). Logs: $OUT/s7e-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/s7elogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
s pytest
timeout 215 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_kernels_indexer.py \
  tests/test_kernels_direct.py tests/test_kernels_topk.py > $L/pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest.log | cut -c1-240 | tail -8
tar czf $OUT/s7e-logs.tgz -C $L .
s probe
timeout 45 python bench/probes/2026-12-07g-int32-slots-clamped-loads.py .oldtree/mqa_logits_9135a69.py \
  4096x131072 > $L/probe.log 2>&1; echo "rc=$?"; grep -E "^\|" $L/probe.log
tar czf $OUT/s7e-logs.tgz -C $L .
s end
