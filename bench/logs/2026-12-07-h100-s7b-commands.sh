#!/bin/bash
# 2026-12-07 seventh session, run S7b (issue 43): the device call made after run S7a, whose CUDA
# tests hit their 240 s limit with 14 of 16 passed (a bare machine compiling every kernel); given
# inline, on the same tree 9135a69 (a fresh H100 came: the first had gone back). Log:
# bench/logs/2026-12-07-h100-s7b-pytest.log.
export PYTHONPATH=$PWD:/tmp/peer/pkg
timeout 400 python -m pytest -q -m cuda -p no:cacheprovider -rf --durations=25 tests/test_kernels_indexer.py \
  tests/test_kernels_direct.py tests/test_kernels_topk.py 2>&1 | tee $OUT/s7b-pytest.log | tail -40
