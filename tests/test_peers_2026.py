"""The 2026 contracts beside the real kernels on an H200: DeepGEMM 54e2261's SM90 logits with a
top-k after them, checked as the fused indexers (`fp8_mqa_topk`, `fp8_paged_mqa_topk`) at
tensor-parallel shard shapes, and as a flashinfer-bench paged indexer through `--definition`.

A fused kernel ranks its own float32 logits; DeepGEMM's are those, so `topk_margin` must accept
them at every shard shape SM90 takes (32 and 64 index heads; top-k 256 to 2048).

Not yet run on the H200 (written 2026-12-02 on branch oracle39; the device runs main's
checkout): the adapters below were checked on the CPU with the oracle's logits standing in for
DeepGEMM's (the paged ones left uncleaned, with 1e30 past each context, as 54e2261 leaves them).

The MX entry points (issue #39, branch o39): DeepGEMM's `fp8_fp4_mqa_logits` and
`fp8_fp4_paged_mqa_logits` on SM90 (their FP8 path, float32 and bf16 logits) beside the new
contracts at `--shapes sm90`, DeepGEMM's MX cast helpers on CUDA writing the MX caches' bytes,
and FlashMLA's SM90 sparse kernel as a bf16-cache decode; checked on the CPU with stand-ins
(the oracle for the kernels, DeepGEMM 54e2261's `deep_gemm/utils/math.py` for the helpers).
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


# ------------------------------------------------------------------ the MX entry points (#39)
# DeepGEMM's fp8_fp4_*mqa_logits take MXFP4 (54e2261) and MXFP8 (559d79f, #377) only on SM100
# (csrc/apis/attention.hpp: `DG_HOST_ASSERT(arch_major == 10)` where q_sf is given); the H200
# runs their FP8 path, checked here through the new entry points' contracts at the "sm90" table
# (FP8 keys, 32 / 64 heads, 64-token blocks, GLM-5.3 contexts). The MX formats' bytes and
# numerics are pinned on the CPU from DeepGEMM's sources and tests instead
# (tests/test_testing_2026_mx.py); their writers' bytes are DeepGEMM's own Python helpers' on
# CUDA here.
def deepgemm_fp8_fp4_mqa_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end,
                                clean_logits=True, max_seqlen_k=0, logits_dtype=torch.float32):
    import deep_gemm

    return deep_gemm.fp8_fp4_mqa_logits(q=q, kv=kv, weights=weights, cu_seq_len_k_start=cu_seq_len_k_start,
                                        cu_seq_len_k_end=cu_seq_len_k_end, clean_logits=clean_logits,
                                        max_seqlen_k=max_seqlen_k, logits_dtype=logits_dtype)


def deepgemm_fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                                      clean_logits=False, logits_dtype=torch.float32):
    """54e2261 takes 2-D context_lens only and cannot clean them: run under the `deepgemm`
    convention (clean_logits=False)."""
    import deep_gemm

    lens = peers.paged_context_lens_2d(context_lens, q[0].shape[1])
    meta = deep_gemm.get_paged_mqa_logits_metadata(lens, kv_cache.shape[1], deep_gemm.get_num_sms())
    return deep_gemm.fp8_fp4_paged_mqa_logits(q, kv_cache, weights, lens, block_table, meta, max_context_len,
                                              clean_logits=False, logits_dtype=logits_dtype)


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_deepgemms_fp8_fp4_mqa_logits_on_sm90_pass_the_new_contract(logits_dtype):
    fn = lambda *a, **k: deepgemm_fp8_fp4_mqa_logits(*a, **k, logits_dtype=logits_dtype)  # noqa: E731
    n = len(edge_case_names("fp8_fp4_mqa_logits")) + 4
    report = check_kernel("fp8_fp4_mqa_logits", fn, cases=n, device=DEV, shapes="sm90")
    assert report.passed and report.cases_run == n


@pytest.mark.parametrize("logits_dtype", [torch.float32, torch.bfloat16])
def test_deepgemms_fp8_fp4_paged_mqa_logits_on_sm90_pass_the_new_contract(logits_dtype):
    def fn(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits=False):
        return deepgemm_fp8_fp4_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
                                                 max_context_len, clean_logits, logits_dtype)
    n = len(edge_case_names("fp8_fp4_paged_mqa_logits")) + 4
    report = check_kernel("fp8_fp4_paged_mqa_logits", fn, cases=n, device=DEV, shapes="sm90",
                          convention="deepgemm")
    assert report.passed and report.cases_run == n


@pytest.mark.parametrize("head_dim", [64, 128])
def test_deepgemms_cast_helpers_write_the_oracles_mx_bytes_on_cuda(head_dim):
    """per_token_cast_to_fp4 / per_token_cast_to_fp8 (use_ue8m0=True, gran_k=32,
    use_packed_ue8m0=True; deep_gemm/utils/math.py) on CUDA, where `amax / 448.0` is a product
    with the reciprocal: the bytes of kv_cache_cast_to_fp4 / kv_cache_cast_to_mxfp8. (54e2261's
    per_token_cast_to_fp8 packs whole int32 words only, 128 dims; 559d79f pads 32 / 64.)"""
    from deep_gemm.utils import per_token_cast_to_fp4, per_token_cast_to_fp8

    g = torch.Generator(device=DEV).manual_seed(7)
    k = (torch.randn(1024, 64, 1, head_dim, generator=g, device=DEV)
         * torch.exp(torch.randn(1024, 64, 1, 1, generator=g, device=DEV) * 3)).bfloat16()
    k[0, 0] = 0  # the floor
    k[1, :, 0, 0] = 448.0 * 2.0 ** torch.arange(-32, 32, device=DEV).float()  # power-of-two amax
    nb = k.shape[0]

    def pages(payload, sf, width):
        out = torch.empty(nb, 64 * (width + 4), dtype=torch.uint8, device=DEV)
        out[:, : 64 * width] = payload.view(nb, -1).view(torch.uint8)
        out[:, 64 * width:] = sf.view(nb, 64).view(torch.uint8)
        return out.view(nb, 64, 1, width + 4)

    fp4 = per_token_cast_to_fp4(k.view(-1, head_dim), use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
    assert torch.equal(oracle.kv_cache_cast_to_fp4(k), pages(*fp4, head_dim // 2))
    if head_dim == 128:
        fp8 = per_token_cast_to_fp8(k.view(-1, head_dim), use_ue8m0=True, gran_k=32, use_packed_ue8m0=True)
        assert torch.equal(oracle.kv_cache_cast_to_mxfp8(k), pages(*fp8, head_dim))


def flashmla_as_bf16_decode(q, k_cache, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None):
    """FlashMLA's SM90 sparse prefill kernel over the decode rows: the bf16 cache's slots are
    its kv rows, each (b, s) row a query row (FlashMLA 9241ae3 builds no bf16 sparse decode)."""
    b, s_q, h, d = q.shape
    lengths = None if topk_length is None else topk_length.repeat_interleave(s_q)
    out, _, lse = peers.flash_mla_sparse_fwd(q.reshape(b * s_q, h, d), k_cache.view(-1, 1, d),
                                             indices.reshape(b * s_q, 1, -1), sm_scale, d_v,
                                             attn_sink, lengths)
    return out.view(b, s_q, h, d_v), lse.view(b, s_q, h).transpose(1, 2).contiguous()


def test_flashmlas_sparse_kernel_passes_the_bf16_decode_contract():
    n = len(edge_case_names("flash_mla_sparse_decode_bf16")) + 3
    report = check_kernel("flash_mla_sparse_decode_bf16", flashmla_as_bf16_decode, cases=n, device=DEV,
                          shapes="glm-5.3")
    assert report.passed and report.cases_run == n
