#!/bin/bash
# The next session's first call, one script, most needed first (written in the ninth session,
# 2026-12-07, when every start failed; the tenth moved the timeline and the dequantization's
# times ahead of its tests, a short call should bring the figures back; the eleventh, given no
# device, replaced the dequantization patch by bench/probes/2026-12-08-fp8-dequant.patch: 8
# partition barriers a tile instead of 19, then the integer path). Steps: the host timeline at
# 4,096 x 131,072 (issue 43); the FP8 in-place kernel's times, HEAD's beside the patched
# float / pow2 / auto in one process, and its CUDA tests (issue 42); the row select's sort as its
# own kernel (bench/probes/2026-12-07i-row-select-sort.patch) timed beside HEAD's select, then
# the top-k file's CUDA tests on it. ~10 minutes on a bare machine. Logs: $OUT/logs.tgz.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
T0=$(date +%s)
L=/tmp/logs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S), $(( $(date +%s) - T0 )) s in"; }
pack() { tar czf $OUT/logs.tgz -C $L .; }
s start; nvidia-smi --query-gpu=name --format=csv,noheader
git show HEAD:glm_dsa/kernels/topk.py > /tmp/topk_head.py
git show HEAD:glm_dsa/kernels/sparse_mla_gluon.py > /tmp/sparse_mla_gluon_head.py
git apply bench/probes/2026-12-08-fp8-dequant.patch && echo dequant-applied
s timeline
timeout 75 python bench/probes/2026-12-07h-host-timeline.py 4096x131072 > $L/timeline-4096x131072.log 2>&1
echo "rc=$?"; grep -vE "^\|---" $L/timeline-4096x131072.log | tail -16; pack
s dequant-times
timeout 170 python bench/probes/2026-12-08-fp8-dequant.py /tmp/sparse_mla_gluon_head.py \
  > $L/dequant-times.log 2>&1; echo "rc=$?"
grep -E "^\||CPU|Error" $L/dequant-times.log; pack
s dequant-tests
timeout 200 python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_kernels_sparse_mla_gluon.py \
  -k "in_place or fp8_dequant or integer_dequantization" > $L/dequant-pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $L/dequant-pytest.log | cut -c1-240 | tail -6; pack
s sort
git apply bench/probes/2026-12-07i-row-select-sort.patch && echo sort-applied
timeout 80 python bench/probes/2026-12-07i-row-select-sort.py /tmp/topk_head.py > $L/row-select.log 2>&1; echo "rc=$?"
grep -E "^\||Error" $L/row-select.log; pack
LEFT=$(( 560 - ($(date +%s) - T0) ))
s "sort-tests (${LEFT} s left)"
if [ $LEFT -gt 40 ]; then
  timeout $LEFT python -m pytest -q -m cuda -p no:cacheprovider -rf tests/test_kernels_topk.py > $L/topk-pytest.log 2>&1; echo "rc=$?"
  grep -E "^(FAILED|ERROR)|passed|failed" $L/topk-pytest.log | cut -c1-240 | tail -6
fi
pack; s end
