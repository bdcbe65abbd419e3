#!/bin/bash
# 2026-12-03 run I (issue 41), one device call on nvidia-h200: run H again with the reader's times per layer (ReadTimes: pinning, reading, waiting for the stage, copying) on each progress line, to profile the first layer. Run H: after run F (two pinned buffers,
# plain reads, up to two layers ahead: later layers 1.27x): the reader now also copies each layer's
# stored bytes on to a device stage on a stream of its own while the layer before computes, and
# pins each host buffer at first use. The CUDA tests of the checkpoint and layer-major paths, then
# the checkpoint-streaming bench (GLM-5.3 layers 6:9, 1,048,576 tokens, an untimed warm-up first).
# Logs: $OUT/i-logs.tgz.
set -u
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=/tmp/ilogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== cuda tests $(date -u +%H:%M:%S)"
timeout 150 python -m pytest -m cuda -v -rf -p no:cacheprovider --durations=5 tests/test_layer_major.py \
  tests/test_edges_weights.py > $L/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $L/pytest.log | cut -c1-300 | tail -8
echo "== checkpoint streaming $(date -u +%H:%M:%S)"
timeout 360 python scripts/bench_checkpoint_stream.py --dir /tmp/ckpt --layers 6:9 --tokens 1048576 --warm-up \
  --out $L/ckpt 2>&1 | tee $L/ckpt.log
grep -E "^prefill: layer|staged" $L/ckpt/checkpoint.err
rm -rf /tmp/ckpt
tar czf $OUT/i-logs.tgz -C $L .
date -u +%H:%M:%S
