#!/bin/bash
# Planned in the eighth session (2026-12-07), when no device was lent after run S8a: the next
# session's first call, one script, ~8 minutes on a bare machine. Logs: $OUT/next-logs.tgz.
#   1. issue 43: the host timeline of one indexer_topk call at 4,096 and 16,384 x 131,072
#      (bench/probes/2026-12-07h-host-timeline.py): where the ~1 ms outside the kernels of
#      run S8a goes, and the autotuned launches' own cost;
#   2. issue 42: the FP8-row dequantization without conversions
#      (bench/probes/2026-12-07h-fp8-dequant.patch, applied on the device's copy only): its CUDA
#      tests (bitwise against the float32 path, both forms, ue8m0 and raw scales), then the
#      in-place form's times at float / pow2 / auto beside the bf16 kernel
#      (bench/probes/2026-12-07h-fp8-dequant.py, 16,384 queries over 131,072 keys, local 0 and
#      0.5, h_q 64 and 128).
set -u
export PYTHONUNBUFFERED=1
L=/tmp/nextlogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
export PYTHONPATH=$PWD
for shape in 4096x131072 16384x131072; do
  s timeline-$shape
  timeout 90 python bench/probes/2026-12-07h-host-timeline.py $shape > $L/timeline-$shape.log 2>&1
  echo "rc=$?"; grep -vE "^\|---" $L/timeline-$shape.log | tail -16
  tar czf $OUT/next-logs.tgz -C $L .
done
s dequant-tests
git apply bench/probes/2026-12-07h-fp8-dequant.patch && echo applied
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_kernels_sparse_mla_gluon.py \
  -k "integer_dequantization or fp8_dequant" > $L/dequant-pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/dequant-pytest.log | cut -c1-240 | tail -8
tar czf $OUT/next-logs.tgz -C $L .
s dequant-times
timeout 150 python bench/probes/2026-12-07h-fp8-dequant.py > $L/dequant-times.log 2>&1; echo "rc=$?"
grep -E "^\||CPU" $L/dequant-times.log
tar czf $OUT/next-logs.tgz -C $L .
s end
