#!/bin/bash
# 2026-12-07 sixth session, run Z5 (issue 43): the device call made right after run Z4 on the
# same warm H100, given inline (PYTHONPATH and peers as run Z4's): the frontier at 4,096 x 131,072
# with the candidate tuner at stores-a-tile-later only, run Z4's logits table, and the CUDA tests
# of the PTX epilogue, the bit equality across configs and the exact top-k.
export PYTHONPATH=$PWD:/tmp/peer/pkg; L=/tmp/z5logs; mkdir -p $L
timeout 100 python scripts/bench_indexer.py --parts frontier --frontier-shapes 4096x131072 \
  --out $L/frontier-4096x131072.json > $L/frontier-4096x131072.log 2>&1; echo rc=$?
grep -E "^\| [0-9]" $L/frontier-4096x131072.log | cut -c1-300; tail -5 /tmp/z4logs/logits.log | cut -c1-600
timeout 200 python -m pytest -q -m cuda tests/test_kernels_indexer.py -k "same_logit_bits or ptx_epilogue or exact" \
  > $L/pytest.log 2>&1; echo rc=$?; tail -2 $L/pytest.log; tar czf $OUT/z5-logs.tgz -C $L .
