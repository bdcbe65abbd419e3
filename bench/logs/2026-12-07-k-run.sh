#!/bin/bash
# 2026-12-07 run K (issues 42, 43), one device call (H100 or H200, whichever is lent): the CUDA tests of the third
# session's kernel changes (head-major MMA columns, STORE_LAG, order_keys shift), never run on a
# GPU before; then the top-k frontier A/B of 7713308 (run G's final tree, .oldtree) against this
# tree, each its own process, and the logits beside DeepGEMM 54e2261. Logs: $OUT/k-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/klogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 50 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
echo "== cuda tests $(date -u +%H:%M:%S)"
timeout 170 python -m pytest -v -p no:cacheprovider --durations=10 -m cuda tests/test_kernels_indexer.py \
  tests/test_kernels_direct.py -k "not 1m_keys" > $L/pytest-cuda.log 2>&1; echo "rc=$?"; grep -E "FAILED|ERROR| passed| failed" $L/pytest-cuda.log | tail -8
echo "== compiled small-shape tests $(date -u +%H:%M:%S)"
timeout 60 python -m pytest -q -p no:cacheprovider tests/test_kernels_indexer.py tests/test_kernels_direct.py \
  -k "candidates_are or exact_topk_of_the_kernels or head_order or matches_oracle or order_keys or key_value" \
  > $L/pytest-gpu.log 2>&1; echo "rc=$?"; grep -E "FAILED|ERROR| passed| failed" $L/pytest-gpu.log | tail -8
SHAPES=4096x131072,32768x1048576
for tree in .oldtree .; do
  name=$(basename $tree); [ "$tree" = . ] && name=new
  echo "== frontier $name $(date -u +%H:%M:%S)"
  PYTHONPATH=$PWD/$tree:/tmp/peer/pkg timeout 110 python $tree/scripts/bench_indexer.py --parts frontier \
    --frontier-shapes $SHAPES --out $L/frontier-$name.json > $L/frontier-$name.log 2>&1
  echo "bench rc=$?"; grep "^| [0-9]" $L/frontier-$name.log
done
echo "== logits $(date -u +%H:%M:%S)"
timeout 70 python scripts/bench_indexer.py --parts logits --out $L/logits.json > $L/logits.log 2>&1
echo "rc=$?"; grep "^| [0-9]" $L/logits.log
tar czf $OUT/k-logs.tgz -C $L .
date -u +%H:%M:%S
