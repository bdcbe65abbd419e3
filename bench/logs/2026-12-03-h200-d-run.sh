#!/bin/bash
# 2026-12-03 run D (issue 41), one device call on nvidia-h200: the whole GLM-5.3 at 131,072 tokens
# in layer-major order twice, on a bare machine (Triton compiles and autotunes in layer 0) and
# again with Triton's cache warm (the compiled kernels and, since this tree, the autotune choices
# kept there: cache_results=True); then checkpoint streaming (scripts/bench_checkpoint_stream.py:
# an FP8 checkpoint of GLM-5.3 layers 6:9 written to local disk, its pages dropped, layer-major at
# 1,048,576 tokens with --weights against random weights); then the CUDA tests of the layer-major
# and checkpoint paths. Logs: $OUT/d-logs.tgz.
set -u
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
L=/tmp/dlogs; mkdir -p $L
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
df -h /tmp | tail -1; free -g | head -2
for run in cold warm; do
  echo "== 131k $run $(date -u +%H:%M:%S)"
  OUT=$L timeout 120 bash bench/logs/2026-12-03-h200-w41-run.sh 131k | tail -n +4 | grep -v "^  "
  mv $L/prefill_131k.out $L/prefill_131k_$run.out; mv $L/prefill_131k.err $L/prefill_131k_$run.err
done
echo "== checkpoint streaming $(date -u +%H:%M:%S)"
timeout 330 python scripts/bench_checkpoint_stream.py --dir /tmp/ckpt --layers 6:9 --tokens 1048576 \
  --out $L/ckpt 2>&1 | tee $L/ckpt.log | grep -v "^  "
rm -rf /tmp/ckpt
echo "== cuda tests $(date -u +%H:%M:%S)"
left=$(( 590 - SECONDS )); echo "time left for them: $left s"
timeout $left python -m pytest -m cuda -v -rf -p no:cacheprovider --durations=5 tests/test_layer_major.py \
  tests/test_edges_weights.py > $L/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $L/pytest.log | cut -c1-300 | tail -8
tar czf $OUT/d-logs.tgz -C $L .
date -u +%H:%M:%S
