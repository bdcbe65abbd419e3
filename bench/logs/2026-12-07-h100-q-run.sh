#!/bin/bash
# 2026-12-07 run Q (issue 42), after run P: the Gluon sparse MLA's FP8 and harness CUDA tests
# (run P's 130 s were too short for their compiles), then run M's ncu stall reasons for the
# h_q 128 seesaw beside FlashMLA 9241ae3 and the FP8 in-place form (FORMS below).
# Logs: $OUT/q-logs.tgz and $OUT/m-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/qlogs; mkdir -p $L
echo "== sparse-tests $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 280 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py \
  -k "fp8 or harness" > $L/pytest-sparse-gluon.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-sparse-gluon.log | cut -c1-240 | tail -6
tar czf $OUT/q-logs.tgz -C $L .
echo "== run M $(date -u +%H:%M:%S)"
FORMS="gluon_h128 flashmla_h128 gluon_fp8_in_place_h64" bash bench/logs/2026-12-07-h100-m-run.sh
echo "== end $(date -u +%H:%M:%S)"
