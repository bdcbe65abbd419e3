#!/bin/bash
# R2 (issue 29, helper G): Gluon sparse MLA — bench rows beside FlashMLA (131K and 1M keys), CUDA tests.
echo "cwd $(pwd) $(date -u +%H:%M:%S)"; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader
echo "=== 1. smoke: FP8-row kernel with split byte/RoPE barriers vs float64 oracle"
timeout 18 python scratch/r1.py smoke v2fp8 > $RES/smoke_fp8.txt 2>&1; tail -5 $RES/smoke_fp8.txt
if grep -q "all ok = True" $RES/smoke_fp8.txt; then FP8=gluon_fp8; else FP8=; echo "FP8 smoke failed: FP8 left out"; fi
echo "=== 2. bench 131,072 keys: gluon bf16 / gluon FP8 / FlashMLA, 16384 and 32768 q, h 64 and 128 $(date -u +%H:%M:%S)"
timeout 42 python scripts/bench_sparse_mla.py --queries 16384 32768 --heads 64 128 --forms gluon $FP8 flashmla --reps 3 --out $RES/bench_131k.json 2>&1 | grep -v "^    gluon " | tail -10
echo "=== 3. bench 1,048,576 keys, 16384 q $(date -u +%H:%M:%S)"
timeout 35 python scripts/bench_sparse_mla.py --s-kv 1048576 --queries 16384 --heads 64 128 --forms gluon $FP8 flashmla --reps 3 --out $RES/bench_1m.json 2>&1 | tail -6
echo "=== 4. pytest -m cuda: Gluon (harness, stress bf16 + FP8, dispatch, backend), sparse MLA kernel tests, Triton kernel harness on the GPU $(date -u +%H:%M:%S)"
timeout 45 python -m pytest -q -rA -p no:cacheprovider tests/test_kernels_sparse_mla_gluon.py tests/test_kernels_sparse_mla.py -m cuda 2>&1 | grep -E "^(PASSED|FAILED|ERROR)|passed|failed|Error" | tail -50
echo "=== 5. Triton kernels, same run (32768 q, h 64, 131,072 keys) $(date -u +%H:%M:%S)"
timeout 30 python scripts/bench_sparse_mla.py --queries 32768 --heads 64 --forms triton triton_fp8 --reps 2 --out $RES/bench_triton.json 2>&1 | grep -v "^    triton" | tail -4
echo "=== end $(date -u +%H:%M:%S)"
