#!/bin/bash
# 2026-12-07 run N (issues 42, 43), one device call: the CUDA tests of this session's kernel
# changes (the softmax's FFMA fold, the FP8 in-place form, the threshold block) and of the third
# session's (head-major logits, STORE_LAG, order_keys), never run on a GPU before; issue 42's
# 131K local-0.5 rows with the FP8 in-place form beside the ring form and FlashMLA 9241ae3; the
# indexer frontier at 4,096 x 131,072 beside DeepGEMM 54e2261. Logs: $OUT/n-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/nlogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s sparse-tests
timeout 130 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py \
  -k "fp8 or in_place or harness" > $L/pytest-sparse.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-sparse.log | cut -c1-240 | tail -8
s indexer-tests
timeout 150 python -m pytest -m cuda -q -rf -p no:cacheprovider tests/test_kernels_indexer.py \
  tests/test_kernels_direct.py -k "not 1m_keys" > $L/pytest-indexer.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/pytest-indexer.log | cut -c1-240 | tail -8
s sparse-bench
timeout 90 python scripts/bench_sparse_mla.py --queries 16384 --heads 64 128 --forms gluon gluon_fp8 \
  flashmla --local 0.5 --reps 5 --gluon-fp8-variants '{"fp8_form": "in_place"}' \
  --out $L/sparse-131k-local05.json > $L/sparse-131k-local05.log 2>&1; echo "rc=$?"
grep -E "^s_q|gluon|flashmla" $L/sparse-131k-local05.log | cut -c1-400 | tail -6
s frontier
timeout 90 python scripts/bench_indexer.py --parts frontier --frontier-shapes 4096x131072 \
  --out $L/frontier.json > $L/frontier.log 2>&1; echo "rc=$?"
grep -E "^\| [0-9]|profile" $L/frontier.log | cut -c1-400
tar czf $OUT/n-logs.tgz -C $L .
s end
