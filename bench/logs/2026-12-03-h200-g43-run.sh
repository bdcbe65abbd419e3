#!/usr/bin/env bash
# Issue 43 (helper g43): the Gluon sm_90 logits kernel beside the Triton kernel and DeepGEMM
# 54e2261, run from a copy of the branch in .g43 (PYTHONPATH=$PWD:/tmp/peer/pkg, DeepGEMM from
# ../.peer/build_peers.py --prebuilt ../.peer/prebuilt). Outputs under $OUT.
set -uo pipefail
run="${1:-1}"
if [ "$run" = 1 ]; then  # commit 34cb611: cp.async loader, turns, 128-key tiles (its CONFIG)
  timeout 40 python3 bench/probes/2026-12-03-h200-g43-smoke.py > "$OUT/smoke.log" 2>&1
  timeout 125 python3 scripts/bench_indexer.py --out "$OUT/bench.json" --parts logits \
    --gluon-configs '[{}, {"block_n": 64, "stages": 6}, {"stages": 6}]' > "$OUT/bench.log" 2>&1
  timeout 55 python3 -m pytest -q -m cuda tests/test_kernels_mqa_logits_gluon.py > "$OUT/pytest.log" 2>&1
else  # run 2 at 6a81653, the variants (CONFIG then: TMA, ping-pong, 64-key tiles, 8 stages)
  timeout 90 python3 scripts/bench_indexer.py --out "$OUT/bench.json" --parts logits \
    --gluon-configs '[{}, {"block_n": 128, "stages": 4, "pingpong": false}, {"tma": false}]' \
    > "$OUT/bench.log" 2>&1
  timeout 45 python3 -m pytest -q -m cuda tests/test_kernels_mqa_logits_gluon.py > "$OUT/pytest.log" 2>&1
fi
