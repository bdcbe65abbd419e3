#!/bin/bash
# 2026-12-03 run F (issue 41), one device call on nvidia-h200, after run D's checkpoint figure
# (reads through safetensors' mmap at ~0.4 GB/s holding the GIL, one layer ahead): the read-ahead
# now reads with plain file reads (GIL released) into two pinned buffers allocated once, up to two
# layers ahead. The CUDA tests of the checkpoint and layer-major paths, then the checkpoint-streaming
# bench (GLM-5.3 layers 6:9, 1,048,576 tokens, an untimed warm-up first). Logs: $OUT/f-logs.tgz.
set -u
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=/tmp/flogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== cuda tests $(date -u +%H:%M:%S)"
timeout 150 python -m pytest -m cuda -v -rf -p no:cacheprovider --durations=5 tests/test_layer_major.py \
  tests/test_edges_weights.py > $L/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $L/pytest.log | cut -c1-300 | tail -8
echo "== checkpoint streaming $(date -u +%H:%M:%S)"
timeout 380 python scripts/bench_checkpoint_stream.py --dir /tmp/ckpt --layers 6:9 --tokens 1048576 --warm-up \
  --out $L/ckpt 2>&1 | tee $L/ckpt.log
grep -E "^prefill: layer" $L/ckpt/checkpoint.err
rm -rf /tmp/ckpt
tar czf $OUT/f-logs.tgz -C $L .
date -u +%H:%M:%S
