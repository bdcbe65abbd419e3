#!/bin/bash
# 2026-12-04 run C (issues 42, 43), one device call on nvidia-h200: the Q8KV8 CUDA tests (with
# helper q8g2's schedule knobs), issue 42's six sparse MLA rows (16,384 queries, top-2048: 131K
# keys h_q 64/128 at local 0 and 0.5, 1M keys h_q 64/128 at local 0.5) with every form beside
# FlashMLA 9241ae3 in one process per key count, the Q8KV8 variants, then one Nsight Compute
# profile per kernel whose target was missed. Logs under $OUT. Arg 1: the q8 probe's variants.
set -u
export PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 40 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > /tmp/c-peers.log 2>&1; echo "peers rc=$?"
export PYTHONPATH=$PWD:/tmp/peer/pkg
L=/tmp/clogs; mkdir -p $L
s() { echo "== $1 $(date -u +%H:%M:%S)"; }
s pytest
timeout 160 python -m pytest -m cuda -q -rf -s -p no:cacheprovider tests/test_kernels_sparse_mla_q8kv8_gluon.py tests/test_attention_precision.py > $OUT/c-pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|calc_diff" $OUT/c-pytest.log | cut -c1-240 | tail -10
F="--queries 16384 --heads 64 128 --forms gluon gluon_fp8 flashmla q8kv8 --reps 3"
for part in "131k-local0 --local 0" "131k-local05 --local 0.5" "1m-local05 --s-kv 1048576 --local 0.5"; do
  set -- $part; name=$1; shift
  s sparse-$name
  timeout 110 python scripts/bench_sparse_mla.py $F "$@" --out $L/sparse-$name.json --gluon-variants '{"schedule": "seesaw"}' > $L/sparse-$name.log 2>&1; echo "rc=$?"
  grep -E "^s_q|gluon |q8kv8" $L/sparse-$name.log | cut -c1-330
done
s q8-variants
timeout 90 python bench/probes/2026-12-04-h200-q8-time.py $Q8V > $L/q8-variants.log 2>&1; echo "rc=$?"; tail -12 $L/q8-variants.log
for f in bf16 q8kv8 fp8rows logits_gluon; do
  s ncu-$f
  timeout 75 ncu --clock-control none -k regex:gluon --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    python bench/probes/2026-12-04-h200-ncu-kernels.py $f > $L/ncu-$f.txt 2>&1; echo "rc=$?"
  grep -E "Duration|Compute \(SM\) Throughput|Memory Throughput|Issued Warp|No Eligible|Stall|Warp Cycles Per Issued" $L/ncu-$f.txt | head -12 | cut -c1-150
done
tar czf $OUT/c-logs.tgz -C $L .
s end
