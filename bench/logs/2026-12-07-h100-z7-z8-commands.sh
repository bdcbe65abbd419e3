#!/bin/bash
# 2026-12-07 sixth session, runs Z7 and Z8 (issue 43): the device calls made right after run Z6
# on the same warm H100, given inline (PYTHONPATH and peers as run Z6's; the committed tree):
# the frontier at 32,768 x 1,048,576 (Z7), then 16,384 x 131,072 and 4,096 x 1,048,576 (Z8).
export PYTHONPATH=$PWD:/tmp/peer/pkg
case "${1:-}" in
z7) L=/tmp/z7logs; mkdir -p $L
    timeout 140 python scripts/bench_indexer.py --parts frontier --frontier-shapes 32768x1048576 \
      --out $L/frontier-32768x1048576.json > $L/frontier-32768x1048576.log 2>&1; echo rc=$?
    grep -E "^\| [0-9]" $L/frontier-32768x1048576.log | cut -c1-300; tar czf $OUT/z7-logs.tgz -C $L . ;;
z8) L=/tmp/z8logs; mkdir -p $L
    for sh in 16384x131072 4096x1048576; do
      timeout 45 python scripts/bench_indexer.py --parts frontier --frontier-shapes $sh \
        --out $L/frontier-$sh.json > $L/frontier-$sh.log 2>&1; echo rc=$?
      grep -E "^\| [0-9]" $L/frontier-$sh.log | cut -c1-300
    done; tar czf $OUT/z8-logs.tgz -C $L . ;;
*) echo "usage: $0 z7|z8"; exit 2 ;;
esac
