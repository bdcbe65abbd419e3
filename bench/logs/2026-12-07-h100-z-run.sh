#!/bin/bash
# 2026-12-07 sixth session, runs Z and Z3 (issue 43; argument: the run's label): the logits and
# candidate kernels' epilogues as inline PTX (no Triton layout conversion, no barrier of the
# program a tile); Z3 after the head sum's explicit fmas (run Z2). 1. the CUDA tests of the
# indexer, the direct kernel entries and the top-k; 2. bench/probes/2026-12-07f-ptx-epilogue.py
# (each kernel raw at fixed tiles, Triton's epilogue against the PTX one, and indexer_topk both
# ways, in one process); 3. the frontier at 4,096 x 131,072 beside DeepGEMM 54e2261.
set -u
# (Run Z gave the tests 240 s, which cut them after 12; run Z3 the 300 s below.)
export PYTHONUNBUFFERED=1
Z=${1:-z}; L=/tmp/${Z}logs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
s pytest
timeout 300 python -m pytest -q -m cuda tests/test_kernels_indexer.py tests/test_kernels_direct.py \
  tests/test_kernels_topk.py > $L/pytest.log 2>&1; echo "rc=$?"; tail -3 $L/pytest.log
tar czf $OUT/${Z}-logs.tgz -C $L .
s probe
timeout 150 python bench/probes/2026-12-07f-ptx-epilogue.py > $L/ptx-epilogue.log 2>&1
echo "rc=$?"; grep "^|" $L/ptx-epilogue.log; tail -3 $L/ptx-epilogue.log | grep -v "^|"
tar czf $OUT/${Z}-logs.tgz -C $L .
s frontier
timeout 90 python scripts/bench_indexer.py --parts frontier --frontier-shapes 4096x131072 \
  --out $L/frontier-4096x131072.json > $L/frontier-4096x131072.log 2>&1; echo "rc=$?"
grep -E "^\| [0-9]" $L/frontier-4096x131072.log | cut -c1-400
tar czf $OUT/${Z}-logs.tgz -C $L .
s end
