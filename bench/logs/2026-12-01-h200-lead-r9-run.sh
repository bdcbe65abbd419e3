#!/bin/bash
# Session 4, second call: the top-k rows now written in ascending order (same bits every run).
# 1. the graphs test above index_topk and the top-k / indexer CUDA tests on the new select;
# 2. the indexer at one 32K chunk of a 1M prefill (the select's cost with the sort);
# 3. the CUDA and peer tests that R8's 330 s limit cut (R8 passed the 13 before the graphs one).
# -v lines and SIGINT on timeout: a cut run still names every test it finished.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
T="python -m pytest -v -rA -p no:cacheprovider"
echo "== 1. graphs above index_topk, top-k, indexer $(date -u +%H:%M:%S)"
timeout -s INT 200 $T -m "cuda or peers" tests/test_graphs.py::test_graphs_above_index_topk_replay_equals_eager_bitwise \
  tests/test_graphs.py::test_failed_check_inside_a_replayed_graph_raises tests/test_kernels_topk.py \
  tests/test_kernels_indexer.py tests/test_indexer.py > $OUT/pytest_1.log 2>&1; echo "rc=$?"
S() { echo "passed: $(grep -cE '::.* PASSED' $1)"; grep -E '::.* (FAILED|ERROR)' $1 | cut -c1-200; grep -E "^E " $1 | cut -c1-300 | head -12; tail -1 $1 | cut -c1-300; }
S $OUT/pytest_1.log
echo "== 2. indexer, one 32K chunk at prefix 983,040 $(date -u +%H:%M:%S)"
timeout 130 python scripts/bench_indexer.py --out $OUT/bench_indexer.json --parts indexer > $OUT/bench_indexer.log 2>&1; echo "rc=$?"
grep -E "^indexer" $OUT/bench_indexer.log | cut -c1-1500; tail -4 $OUT/bench_indexer.log | cut -c1-300
echo "== 3. the rest of -m 'cuda or peers' $(date -u +%H:%M:%S)"
timeout -s INT 230 $T -m "cuda or peers" tests/test_peers.py tests/test_kernels_sparse_mla_gluon.py tests/test_mla.py \
  tests/test_moe.py tests/test_oracle.py tests/test_quantizers_cuda.py > $OUT/pytest_3.log 2>&1; echo "rc=$?"
S $OUT/pytest_3.log
date -u +%H:%M:%S
