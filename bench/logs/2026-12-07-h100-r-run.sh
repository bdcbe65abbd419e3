#!/bin/bash
# 2026-12-07 run R (issue 43): where indexer_topk's 4,096 x 131,072 call leaves the GPU idle
# (torch.profiler gaps), and Nsight Compute on the candidate kernel beside the logits kernel it
# extends (bench/probes/2026-12-07-indexer-gaps.py). Logs: $OUT/r-logs.tgz.
set -u
export PYTHONUNBUFFERED=1
L=/tmp/rlogs; mkdir -p $L
echo "== gaps $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$L timeout 120 python bench/probes/2026-12-07-indexer-gaps.py gaps > $L/gaps.log 2>&1; echo "rc=$?"
grep -E "^gap|gaps over|device activities" $L/gaps.log | cut -c1-300 | head -30
tar czf $OUT/r-logs.tgz -C $L .
M='regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
for f in candidates logits; do
  echo "== ncu-$f $(date -u +%H:%M:%S)"
  timeout 60 python bench/probes/2026-12-07-indexer-gaps.py $f > $L/warm-$f.log 2>&1
  timeout 90 ncu --clock-control none -k "regex:_mqa_${f}_kernel" --launch-skip 1 --launch-count 1 \
    --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats \
    --section InstructionStats --section SourceCounters --metrics "$M" -f -o $L/ncu-$f \
    python bench/probes/2026-12-07-indexer-gaps.py $f > $L/ncu-$f.log 2>&1; echo "rc=$?"
  ncu -i $L/ncu-$f.ncu-rep --page details --print-units base > $L/ncu-$f.txt 2>&1
  ncu -i $L/ncu-$f.ncu-rep --page source --csv --print-source sass > $L/sass-$f.csv 2>&1
  grep -E "^    (Duration|Registers Per|Achieved Occ|Theoretical Occ|Executed Ipc A|Issue Slots Busy|Compute \(SM\) Th|Memory Th)" $L/ncu-$f.txt | awk '{print $1,$2,$3, $NF}' | tr '\n' ';'; echo
  tar czf $OUT/r-logs.tgz -C $L .
done
echo "== end $(date -u +%H:%M:%S)"
