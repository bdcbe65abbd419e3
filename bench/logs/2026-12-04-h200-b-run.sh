#!/bin/bash
# 2026-12-04 run B (issues 42, 43), one device call on nvidia-h200, tree `int` after run A (the
# 32-key FP8-row form reverted, Q8KV8_STAT_TOL, helper q8t's mode merged, helper lg4's Gluon
# logits schedules): the Q8KV8 CUDA tests (Gluon kernel, entry, engine mode), then lg4's
# logits run (bench/logs/2026-12-04-h200-lg4-run.sh: smoke, bench beside DeepGEMM 54e2261,
# CUDA tests). Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/b-peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s pytest-q8
timeout 170 python -m pytest -m cuda -q -rf -s -p no:cacheprovider tests/test_kernels_sparse_mla_q8kv8_gluon.py tests/test_kernels_sparse_mla_q8kv8.py tests/test_attention_precision.py > $OUT/b-pytest-q8.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|calc_diff" $OUT/b-pytest-q8.log | cut -c1-240 | tail -12
s lg4
mkdir -p $OUT/lg4; OUT=$OUT/lg4 bash bench/logs/2026-12-04-h200-lg4-run.sh
s end
