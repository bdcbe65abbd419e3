#!/usr/bin/env bash
# Lead's H200 run 2 (2026-12-01): CUDA determinism tests and the invariance cost after the merge
# fix; the whole CPU suite on the H200 host's CPU (AVX-512 + AMX).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
lscpu | grep -E "Model name|Flags" | cut -c1-400 > $OUT/cpu.txt
echo "== pytest -m cuda determinism"
timeout 120 python3 -m pytest -q -rA -p no:cacheprovider -m cuda tests/test_determinism.py tests/test_oracle.py > $OUT/pytest-cuda-determinism.log 2>&1; echo "rc=$?"
grep -E "^(PASSED|FAILED|ERROR)|passed|failed" $OUT/pytest-cuda-determinism.log | tail -8
grep -E "^E  " $OUT/pytest-cuda-determinism.log | head -6
echo "== bench_invariance"
timeout 150 python3 scripts/bench_invariance.py --out $OUT > $OUT/bench_invariance.log 2>&1; echo "rc=$?"; tail -8 $OUT/bench_invariance.log
echo "== CPU suite on the H200 host CPU"
CUDA_VISIBLE_DEVICES= timeout 290 python3 -m pytest -q -p no:cacheprovider -x > $OUT/pytest-cpu-h200host.log 2>&1; echo "rc=$?"
tail -3 $OUT/pytest-cpu-h200host.log; grep -E "^FAILED|^ERROR" $OUT/pytest-cpu-h200host.log | head
