#!/bin/bash
# 2026-12-04 run G (issue 43), one device call on nvidia-h200: the CUDA tests of the indexer
# and top-k kernels on this tree, then an A/B of the top-k frontier in three trees, each its own
# process, same machine: .oldtree = 8f556e5 (per-entry atomics, 8,192-key sample, sort always),
# .oldcand = this tree with 8f556e5's candidate kernel, and this tree. DeepGEMM 54e2261 from the
# prebuilt peers beside each. Logs: $OUT/g-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/glogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
echo "== tests $(date -u +%H:%M:%S)"
PYTHONPATH=$PWD:/tmp/peer/pkg timeout 240 python -m pytest -q -p no:cacheprovider tests/test_kernels_indexer.py \
  tests/test_kernels_topk.py tests/test_kernels_direct.py > $L/pytest.log 2>&1
echo "pytest rc=$?"; tail -4 $L/pytest.log
SHAPES=4096x131072,32768x1048576
for tree in .oldtree .oldcand .; do
  name=$(basename $tree); [ "$tree" = . ] && name=new
  echo "== frontier $name $(date -u +%H:%M:%S)"
  PYTHONPATH=$PWD/$tree:/tmp/peer/pkg timeout 150 python $tree/scripts/bench_indexer.py --parts frontier \
    --frontier-shapes $SHAPES --out $L/frontier-$name.json > $L/frontier-$name.log 2>&1
  echo "bench rc=$?"; grep "^| [0-9]" $L/frontier-$name.log
done
tar czf $OUT/g-logs.tgz -C $L .
date -u +%H:%M:%S
