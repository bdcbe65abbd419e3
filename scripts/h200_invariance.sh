#!/usr/bin/env bash
# One H200 run for issue 26: the CUDA determinism tests, the cost table, and the CPU numerics
# tests on the GPU host's own CPU. Run from the repository root; logs go to ${OUT:-.}.
set -u
OUT=${OUT:-.}
export PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/gpu.txt"
lscpu | grep -E "Model name|Flags" | cut -c1-200 > "$OUT/cpu.txt"
CUDA_VISIBLE_DEVICES=0 timeout 120 python -m pytest -q -p no:cacheprovider -m cuda \
    tests/test_determinism.py tests/test_oracle.py 2>&1 | tee "$OUT/pytest-cuda.log" | tail -8
CUDA_VISIBLE_DEVICES=0 timeout 150 python scripts/bench_invariance.py --out "$OUT" 2>&1 | tee "$OUT/bench_invariance.log"
CUDA_VISIBLE_DEVICES= timeout 60 python -m pytest -q -p no:cacheprovider \
    tests/test_determinism.py tests/test_oracle.py 2>&1 | tee "$OUT/pytest-cpu.log" | tail -3
