#!/bin/bash
# 2026-12-07 run V (issue 43): the host time of indexer_topk's steps at 4,096 x 131,072
# (bench/probes/2026-12-07-host-costs.py). Log: $OUT/v-host-costs.log.
set -u
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 120 python bench/probes/2026-12-07-host-costs.py > $OUT/v-host-costs.log 2>&1; echo "rc=$?"
grep "^|" $OUT/v-host-costs.log
