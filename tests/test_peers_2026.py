"""The 2026 contracts beside the real kernels on an H200: DeepGEMM 54e2261's SM90 logits with a
top-k after them, checked as the fused indexers (`fp8_mqa_topk`, `fp8_paged_mqa_topk`) at
tensor-parallel shard shapes, and as a flashinfer-bench paged indexer through `--definition`.

A fused kernel ranks its own float32 logits; DeepGEMM's are those, so `topk_margin` must accept
them at every shard shape SM90 takes (32 and 64 index heads; top-k 256 to 2048).

Not yet run on the H200 (written 2026-12-02 on branch oracle39; the device runs main's
checkout): the adapters below were checked on the CPU with the oracle's logits standing in for
DeepGEMM's (the paged ones left uncleaned, with 1e30 past each context, as 54e2261 leaves them).
"""

import os

import pytest
import torch

from glm_dsa import oracle, peers
from glm_dsa.testing import check_kernel, edge_case_names
from glm_dsa.testing.definitions import check_definition, load_definition

pytestmark = [pytest.mark.peers, pytest.mark.cuda]

DEV = "cuda"
INDEXER_DEF = os.path.join(os.path.dirname(__file__), "definitions",
                           "dsa_topk_indexer_fp8_h64_d128_topk2048_ps64.json")


def _rows_topk(logits: torch.Tensor, starts: torch.Tensor, ends: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 [R, topk]: each row's best columns in [start, end) relative to start, -1 padded."""
    col = torch.arange(logits.shape[1], device=logits.device)
    inside = (col[None, :] >= starts[:, None]) & (col[None, :] < ends[:, None])
    scores = logits.masked_fill(~inside, -torch.inf)
    width = min(topk, scores.shape[1])
    best = scores.topk(width, dim=1)
    rel = torch.where(torch.isfinite(best.values), best.indices - starts[:, None].long(), -1)
    out = torch.full((scores.shape[0], topk), -1, dtype=torch.int32, device=logits.device)
    out[:, :width] = rel.to(torch.int32)
    return out


def deepgemm_mqa_topk(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, topk):
    """deep_gemm.fp8_mqa_logits, then each row's top-k: a fused ragged indexer's output."""
    return _rows_topk(peers.fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke),
                      cu_seqlen_ks, cu_seqlen_ke, topk)


def deepgemm_paged_mqa_topk(q, kv_cache, weights, context_lens, block_table, topk):
    """deep_gemm.fp8_paged_mqa_logits (entries past a row's context masked here: 54e2261 does
    not clean them), then each row's top-k positions."""
    ends = oracle.visible_lens(context_lens, q.shape[1])
    width = -(-max(int(context_lens.max()), 1) // kv_cache.shape[1]) * kv_cache.shape[1]
    logits = peers.fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, width)
    return _rows_topk(logits, torch.zeros_like(ends), ends, topk)


def deepgemm_dsa_topk_indexer(q_index_fp8, k_index_cache_fp8, weights, seq_lens, block_table):
    """flashinfer-bench's dsa_topk_indexer signature over DeepGEMM: slots out."""
    pos = deepgemm_paged_mqa_topk(q_index_fp8[:, None], k_index_cache_fp8.view(torch.uint8), weights,
                                  seq_lens, block_table, 2048).long()
    page = k_index_cache_fp8.shape[1]
    slots = block_table.long().gather(1, pos.clamp_min(0) // page) * page + pos.clamp_min(0) % page
    return (torch.where(pos >= 0, slots, -1).to(torch.int32),)


@pytest.mark.parametrize("shapes", ["h32", "h64"])
def test_deepgemm_logits_then_top_k_pass_the_fused_ragged_contract_at_a_shard(shapes):
    n = len(edge_case_names("fp8_mqa_topk")) + 3
    report = check_kernel("fp8_mqa_topk", deepgemm_mqa_topk, cases=n, device=DEV, shapes=shapes)
    assert report.passed and report.cases_run == n


@pytest.mark.parametrize("shapes", ["h32", "h64"])
def test_deepgemm_paged_logits_then_top_k_pass_the_fused_paged_contract_at_a_shard(shapes):
    n = len(edge_case_names("fp8_paged_mqa_topk")) + 3
    report = check_kernel("fp8_paged_mqa_topk", deepgemm_paged_mqa_topk, cases=n, device=DEV,
                          shapes=shapes)
    assert report.passed and report.cases_run == n


def test_deepgemm_as_a_flashinfer_bench_indexer_passes_its_definition():
    report, reference = check_definition(load_definition(INDEXER_DEF), deepgemm_dsa_topk_indexer,
                                         cases=8, device=DEV, against_reference=True)
    assert report.passed, report.failure
    assert " 7 of 7 cases within" in reference[0]
