#!/bin/bash
# 2026-12-07 fifth session, runs Y2-Y5 (issue 43): the device calls made right after run Y on
# the same warm H100 (bench/logs/2026-12-07-h100-y-run.sh), each given inline; PYTHONPATH as
# run Y's (the peers build of run Y, DeepGEMM 54e2261). Trees: Y2 = 78db826 (the select as
# before); Y3 = 78db826 with the candidate select at CANDIDATE_BLOCK 2048 / 5-bit digits; Y4,
# Y5 = the committed 1024 / 6-bit select. Logs: bench/logs/2026-12-07-h100-y{2,3,4,5}-*.
set -u
export PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
frontier() { timeout "$2" python scripts/bench_indexer.py --parts frontier --frontier-shapes "$1" \
  --out "$L/frontier-$1.json" > "$L/frontier-$1.log" 2>&1; grep -E "^\| [0-9]" "$L/frontier-$1.log"; }
case "${1:-}" in
y2) L=/tmp/y2; mkdir -p $L
    timeout 100 python -m pytest -q -m cuda tests/test_kernels_indexer.py -k 1m_keys > $L/pytest-1m.log 2>&1
    frontier 16384x131072 200; frontier 32768x1048576 200 ;;
y3|y4) L=/tmp/$1; mkdir -p $L
    timeout 120 python bench/probes/2026-12-07e-select-digits.py > $L/select-digits.log 2>&1
    grep "^|" $L/select-digits.log
    frontier 4096x131072 100; frontier 16384x131072 100
    timeout 230 python -m pytest -q -m cuda tests/test_kernels_indexer.py tests/test_kernels_direct.py \
      tests/test_kernels_topk.py > $L/pytest.log 2>&1; tail -2 $L/pytest.log ;;
y5) L=/tmp/y5; mkdir -p $L
    frontier 32768x1048576 150; frontier 4096x1048576 150 ;;
*) echo "usage: $0 y2|y3|y4|y5"; exit 2 ;;
esac
