#!/usr/bin/env bash
# Issue 43 (helper lg4): the Gluon logits kernel's four-consumer schedules beside CONFIG, the
# Triton kernel and DeepGEMM at the four logits shapes, in the g43 runs' environment
# (PYTHONPATH=$PWD:/tmp/peer/pkg, DeepGEMM importable). Outputs under $OUT.
set -uo pipefail
F='"consumers": 4, "smem_gates": true, "loader_regs": 24, "consumer_regs": 112'
CONFIGS="[{}, {$F}, {$F, \"turns\": false}, {$F, \"row_groups\": 1, \"block_n\": 256, \"stages\": 3}, {$F, \"row_groups\": 4, \"block_n\": 64, \"stages\": 6}]"
timeout 45 python3 bench/probes/2026-12-04-h200-lg4-smoke.py "$CONFIGS" > "$OUT/smoke.log" 2>&1 || { echo "smoke failed rc=$?"; tail -5 "$OUT/smoke.log"; exit 1; }
timeout 110 python3 scripts/bench_indexer.py --out "$OUT/bench.json" --parts logits \
  --logits-shapes 4096x131072x32,32768x131072x32,8192x1048576x32,4096x131072x64 \
  --gluon-configs "$CONFIGS" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; grep -E "gluon \{|^\| logits" "$OUT/bench.log"
timeout 90 python3 -m pytest -q -m cuda tests/test_kernels_mqa_logits_gluon.py > "$OUT/pytest.log" 2>&1
echo "pytest rc=$?"; tail -3 "$OUT/pytest.log"
