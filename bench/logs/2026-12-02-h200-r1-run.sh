#!/bin/bash
# R1 (issue 38): the harness's new cases on the GPU kernels and on the real DeepGEMM / FlashMLA
# called through their own signatures (conventions, full-range FP8 cases, the fused indexer).
export PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
timeout 420 python -m pytest -q -rA -p no:cacheprovider --durations=15 \
  tests/test_peers.py \
  tests/test_kernels_indexer.py::test_logits_kernels_pass_the_harness \
  tests/test_kernels_indexer.py::test_logits_kernels_pass_the_harness_at_glm_shapes \
  tests/test_kernels_sparse_mla.py::test_flash_mla_sparse_fwd_passes_the_harness \
  tests/test_kernels_sparse_mla.py::test_flash_mla_sparse_fwd_passes_the_harness_at_glm_shapes \
  tests/test_kernels_sparse_mla_gluon.py::test_gluon_passes_the_harness_at_glm_shapes \
  tests/test_kernels_sparse_mla_gluon.py::test_triton_kernel_on_gpu_passes_the_harness_at_glm_shapes \
  tests/test_kernels_topk.py::test_topk_per_row_passes_the_harness \
  tests/test_kernels_topk.py::test_topk_per_row_passes_the_harness_at_glm_shapes \
  > $OUT/pytest.log 2>&1; echo "rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | cut -c1-300 | tail -20
echo "== glm-dsa check on the real kernels, own signatures $(date -u +%H:%M:%S)"
timeout 100 python -m glm_dsa check glm_dsa.peers:flash_mla_sparse_fwd --contract flash_mla_sparse_fwd --device cuda --shapes glm-5.3 --cases 10 > $OUT/check_flashmla.log 2>&1; echo "flashmla newest rc=$?"; tail -2 $OUT/check_flashmla.log | cut -c1-300
timeout 100 python -m glm_dsa check glm_dsa.peers:flash_mla_sparse_fwd --contract flash_mla_sparse_fwd --device cuda --shapes glm-5.3 --cases 10 --convention sep2025 > $OUT/check_flashmla_sep2025.log 2>&1; echo "flashmla sep2025 rc=$?"; grep -m1 "cause:" $OUT/check_flashmla_sep2025.log | cut -c1-300
timeout 100 python -m glm_dsa check deep_gemm:fp8_mqa_logits --contract fp8_mqa_logits --device cuda --shapes glm-5.3 --cases 12 > $OUT/check_deepgemm.log 2>&1; echo "deepgemm ragged rc=$?"; tail -2 $OUT/check_deepgemm.log | cut -c1-300
timeout 100 python -m glm_dsa check glm_dsa.peers:fp8_paged_mqa_logits --contract fp8_paged_mqa_logits --device cuda --shapes glm-5.3 --cases 12 --convention deepgemm > $OUT/check_deepgemm_paged.log 2>&1; echo "deepgemm paged (deepgemm) rc=$?"; tail -2 $OUT/check_deepgemm_paged.log | cut -c1-300
timeout 100 python -m glm_dsa check glm_dsa.peers:fp8_paged_mqa_logits --contract fp8_paged_mqa_logits --device cuda --shapes glm-5.3 --cases 12 > $OUT/check_deepgemm_paged_newest.log 2>&1; echo "deepgemm paged (newest) rc=$?"; grep -m2 "FAIL" $OUT/check_deepgemm_paged_newest.log | cut -c1-300
date -u +%H:%M:%S
