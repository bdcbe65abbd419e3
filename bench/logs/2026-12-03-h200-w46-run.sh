#!/usr/bin/env bash
# Issue 46 (w46): the CUDA tests after the GPU-path refactors (sparse_mla DeviceFacts / GluonCall
# and launch_flags, fused.TritonOnCuda device_type predicates, moe.fused_grouped_mm_on,
# budget.logits_budget_of). Pass: every selected test passes (0 failed); the new files' CPU
# tests also run here on CUDA tensors where they use DEV.
set -euo pipefail
cd "$(dirname "$0")/../.."
python -m pytest -m cuda -q \
  tests/test_dispatch_facts.py tests/test_kernels_direct.py \
  tests/test_kernels_sparse_mla_gluon.py tests/test_kernels_sparse_mla.py tests/test_backend.py \
  tests/test_kernels_moe.py tests/test_moe.py tests/test_kernels_index_quant.py \
  tests/test_kernels_indexer.py tests/test_kernels_topk.py tests/test_graphs.py \
  tests/test_invariance_triton.py tests/test_fourth_backend.py
# The new CPU edge files, on the GPU host too (they must not depend on the absence of CUDA):
python -m pytest -q tests/test_dispatch_facts.py tests/test_kernels_direct.py tests/test_graphs_host.py \
  tests/test_edges_budget.py tests/test_edges_outputs.py tests/test_edges_weights.py \
  tests/test_edges_config.py tests/test_edges_validate.py tests/test_edges_invariant.py \
  tests/test_edges_cp.py tests/test_edges_fidelity.py tests/test_edges_testing.py
