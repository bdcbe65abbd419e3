#!/bin/bash
# 2026-12-07 sixth session, run Z2 (issue 43): why run Z's CUDA tests failed and its probe's
# candidate sets differed: bench/probes/2026-12-07f-ptx-diag.py (each epilogue's buffers against
# the logits kernel's truth), then the failing tests alone with their messages.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
L=/tmp/z2logs; mkdir -p $L
echo "== diag $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python bench/probes/2026-12-07f-ptx-diag.py > $L/diag.log 2>&1; echo "rc=$?"
cut -c1-600 $L/diag.log | tail -40
tar czf $OUT/z2-logs.tgz -C $L .
echo "== pytest $(date -u +%H:%M:%S)"
timeout 200 python -m pytest -q -m cuda -x tests/test_kernels_indexer.py -k "same_logit_bits or ptx_epilogue" \
  > $L/pytest.log 2>&1; echo "rc=$?"
grep -E "Error|assert|^E " $L/pytest.log | head -30; tail -3 $L/pytest.log
tar czf $OUT/z2-logs.tgz -C $L .
