#!/bin/bash
# 2026-12-03 run G (issue 43), one device call on nvidia-h200: the frontier part of
# scripts/bench_indexer.py (indexer_topk beside DeepGEMM's logits alone, our logits alone and the
# peers composition at 4K/16K/32K rows x 131,072 and 1,048,576 keys) with the fp8 ceiling first,
# DeepGEMM 54e2261 from the prebuilt peers. Logs: $OUT/g-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/glogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $L/peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
echo "== frontier $(date -u +%H:%M:%S)"
timeout 450 python scripts/bench_indexer.py --parts ceiling,frontier --out $L/frontier.json > $L/frontier.log 2>&1
echo "bench rc=$?"; tail -25 $L/frontier.log
tar czf $OUT/g-logs.tgz -C $L .
date -u +%H:%M:%S
