#!/bin/bash
# 2026-12-04 run A (issue 42), one device call on nvidia-h200, tree `int` (helpers fp8r, q8g, bf16s
# merged): CUDA tests of the 32-key FP8-row form, the seesaw bf16 form and the Gluon Q8KV8 kernel,
# then their timings beside FlashMLA 9241ae3 (prebuilt peers). Logs under $OUT.
set -u
export PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/a-peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s pytest-sparse
timeout 150 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py -k "fp8 or seesaw" > $OUT/a-pytest-sparse.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/a-pytest-sparse.log | cut -c1-240 | tail -8
s pytest-q8
timeout 100 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_q8kv8_gluon.py > $OUT/a-pytest-q8.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/a-pytest-q8.log | cut -c1-240 | tail -8
s bench-131k
timeout 120 python scripts/bench_sparse_mla.py --queries 16384 --heads 64 128 --forms gluon gluon_fp8 flashmla --reps 3 --out $OUT/a-sparse-131k.json --gluon-variants '{"schedule": "seesaw"}' '{"schedule": "seesaw", "seesaw_early_scores": false}' --gluon-fp8-variants '{"fp8_stages": 2}' > $OUT/a-sparse-131k.log 2>&1; echo "rc=$?"
grep -vE "^\s*$" $OUT/a-sparse-131k.log | tail -14 | cut -c1-260
s q8-time
timeout 80 python bench/probes/2026-12-04-h200-q8-time.py '{"stages":2,"v_stages":3}' > $OUT/a-q8-time.log 2>&1; echo "rc=$?"; cat $OUT/a-q8-time.log | tail -8
s bench-1m
timeout 90 python scripts/bench_sparse_mla.py --s-kv 1048576 --queries 16384 --heads 64 --forms gluon gluon_fp8 flashmla --reps 3 --out $OUT/a-sparse-1m.json --gluon-variants '{"schedule": "seesaw"}' > $OUT/a-sparse-1m.log 2>&1; echo "rc=$?"
grep -vE "^\s*$" $OUT/a-sparse-1m.log | tail -6 | cut -c1-260
s end
