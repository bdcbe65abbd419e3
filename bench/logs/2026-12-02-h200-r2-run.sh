#!/bin/bash
# R2 (issue 38): after R1 — the harness's worker thread binds the CUDA context (R1: DeepGEMM and
# FlashMLA failed with CUDA_ERROR_INVALID_CONTEXT there), golden MLA top-k a multiple of 128.
export PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
timeout 300 python -m pytest -q -rA -p no:cacheprovider --durations=10 \
  "tests/test_peers.py::test_check_passes_flashmla_under_the_newest_convention_and_names_it_under_sep2025" \
  "tests/test_peers.py::test_check_passes_deepgemm_logits_at_the_full_fp8_range" \
  tests/test_kernels_indexer.py::test_logits_kernels_pass_the_harness_at_glm_shapes \
  tests/test_kernels_sparse_mla_gluon.py::test_gluon_passes_the_harness_at_glm_shapes \
  tests/test_kernels_topk.py::test_topk_per_row_passes_the_harness_at_glm_shapes \
  > $OUT/pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $OUT/pytest.log | cut -c1-300 | tail -12
echo "== the real kernels through glm-dsa check / compare, own signatures $(date -u +%H:%M:%S)"
P="python -m glm_dsa"
timeout 60 $P golden --out golden > /dev/null 2>&1; echo "golden rc=$?"
run() { name=$1; shift; timeout 100 $P "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?"; grep -m1 -E "cause:|^conventions|^PASS:|^FAIL:" $OUT/$name.log | cut -c1-260; tail -1 $OUT/$name.log | cut -c1-260; }
run flashmla_check check glm_dsa.peers:flash_mla_sparse_fwd --contract flash_mla_sparse_fwd --device cuda --shapes glm-5.3 --cases 10
run flashmla_check_sep2025 check glm_dsa.peers:flash_mla_sparse_fwd --contract flash_mla_sparse_fwd --device cuda --shapes glm-5.3 --cases 10 --convention sep2025
run flashmla_compare compare --golden golden --kernel glm_dsa.peers:flash_mla_sparse_fwd --device cuda
run flashmla_compare_sep2025 compare --golden golden --kernel glm_dsa.peers:flash_mla_sparse_fwd --device cuda --convention sep2025
run deepgemm_check check deep_gemm:fp8_mqa_logits --contract fp8_mqa_logits --device cuda --shapes glm-5.3 --cases 12
run deepgemm_compare compare --golden golden --kernel deep_gemm:fp8_mqa_logits --device cuda
run deepgemm_paged_check check glm_dsa.peers:fp8_paged_mqa_logits --contract fp8_paged_mqa_logits --device cuda --shapes glm-5.3 --cases 12 --convention deepgemm
run deepgemm_paged_check_newest check glm_dsa.peers:fp8_paged_mqa_logits --contract fp8_paged_mqa_logits --device cuda --shapes glm-5.3 --cases 12
date -u +%H:%M:%S
