#!/bin/bash
# 2026-12-07 sixth session, run Z4 (issue 43), right after run Z3 on the same machine: the
# frontier at 32,768 x 1,048,576, 16,384 x 131,072 and 4,096 x 1,048,576, and the logits at
# issue 43's four shapes, beside DeepGEMM 54e2261, with the PTX epilogue and the explicit-fma
# head sum. Logs: $OUT/z4-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/z4logs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
[ -d /tmp/peer/pkg ] || timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1
export PYTHONPATH=$PWD:/tmp/peer/pkg
for shape in 32768x1048576 16384x131072 4096x1048576; do
  s frontier-$shape
  timeout 170 python scripts/bench_indexer.py --parts frontier --frontier-shapes $shape \
    --out $L/frontier-$shape.json > $L/frontier-$shape.log 2>&1; echo "rc=$?"
  grep -E "^\| [0-9]" $L/frontier-$shape.log | cut -c1-400
  tar czf $OUT/z4-logs.tgz -C $L .
done
s logits
timeout 200 python scripts/bench_indexer.py --parts logits --out $L/logits.json > $L/logits.log 2>&1
echo "rc=$?"; grep -E "^\| [0-9]" $L/logits.log | cut -c1-300
tar czf $OUT/z4-logs.tgz -C $L .
s end
