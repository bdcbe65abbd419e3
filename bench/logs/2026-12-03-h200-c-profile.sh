#!/bin/bash
# 2026-12-03 run C (issue 41): where the whole-model run's time goes outside its layers. The 131K
# layer-major run took 61 s of process wall for 47.2 s of layers (run B), the 1M one 514 s for
# 428.7 s: cProfile of the 131K run, the top functions by cumulative time.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S
t0=$(date +%s)
timeout 200 python -m cProfile -o $OUT/p131k.prof -m glm_dsa prefill --config glm-5.3 --tokens 131072 --chunk 32768 \
  --device cuda --dtype bfloat16 --kv-dtype fp8 --backend triton --order layer --no-progress > $OUT/p131k.out 2> $OUT/p131k.err
echo "rc=$? wall $(( $(date +%s) - t0 )) s"; grep -E "^memory:" $OUT/p131k.out
python -c "
import pstats, sys
p = pstats.Stats('$OUT/p131k.prof', stream=sys.stdout)
p.sort_stats('cumulative').print_stats(40)
" > $OUT/p131k_stats.txt; grep -E "function calls|^ +[0-9]" $OUT/p131k_stats.txt | head -42 | cut -c1-160
date -u +%H:%M:%S
