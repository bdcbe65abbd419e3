#!/bin/bash
# Session 4, fourth call. R10: the graphs test above index_topk failed (bf16 KV: graph against
# its padded steps run eagerly, calc_diff 0.079) while the probe (FP8 KV, host syncs from its
# checksums) found every pair bitwise equal. A: the test over bf16 and FP8 KV; B: the probe
# with one change at a time (KV dtype, checksums, the sparse MLA kernel's L2 prefetch).
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S
S() { echo "passed: $(grep -cE '::.* PASSED' $1)"; grep -E '::.* (FAILED|ERROR)' $1 | cut -c1-200; grep -E "^E   Assert" $1 | cut -c1-200 | head -8; tail -1 $1 | cut -c1-300; }
echo "== A $(date -u +%H:%M:%S)"
timeout -s INT 150 python -m pytest -v -rA --tb=short -p no:cacheprovider -m cuda \
  tests/test_graphs.py::test_graphs_above_index_topk_replay_equals_eager_bitwise > $OUT/pytest_A.log 2>&1; echo "rc=$?"; S $OUT/pytest_A.log
echo "== B $(date -u +%H:%M:%S)"
P="python scripts/probe_topk_paths.py --lengths 1536,512"
for v in "bf16 --no-digest" "bf16 --no-digest --no-prefetch" "fp8 --no-digest" "bf16"; do
  n=$(echo $v | tr -d ' -'); timeout 70 $P --kv-dtype $v --out $OUT/probe_$n.json > $OUT/probe_$n.log 2>&1; echo "rc=$?"
  grep -v Warn $OUT/probe_$n.log | cut -c1-330 | tail -1
done
date -u +%H:%M:%S
