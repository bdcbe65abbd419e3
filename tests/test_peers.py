"""The oracle against the real kernels: DeepGEMM 54e2261 and FlashMLA 9241ae3 on an H200.

Each test feeds the oracle and the kernel (``glm_dsa.peers``) the same inputs and applies the
upstream test's own metric: DeepGEMM's ``calc_diff`` with exactly equal ``-inf`` masks, FlashMLA's
``check_is_allclose`` with its tolerances on inputs of std 0.1 (as FlashMLA's ``tests/lib.py``
draws them), and bytes for the cast helpers. Shapes: small, and GLM-5.3's (32 index heads of
128, 64 MLA heads, top-2048, 64-token pages); h_q 128 for DeepSeek-V3.2.
"""

import pytest
import torch

from glm_dsa import oracle, peers
from glm_dsa.fp8 import act_quant
from glm_dsa.kv_format import index_k_store

pytestmark = [pytest.mark.peers, pytest.mark.cuda]

DEV = "cuda"
# DeepGEMM's bound against a reference on the dequantized inputs (docs/conventions.md §14).
CALC_DIFF_DEQUANTIZED = 5e-6
# FlashMLA tests/test_flash_mla_sparse_prefill.py.
OUT_TOL = dict(abs_tol=8e-4, rel_tol=3.01 / 128, cos_diff_tol=7e-6)
STAT_TOL = dict(abs_tol=1e-6, rel_tol=2.01 / 65536, cos_diff_tol=1e-7)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def _masked_calc_diff(got: torch.Tensor, ref: torch.Tensor, valid: torch.Tensor) -> float:
    return oracle.calc_diff(got.masked_fill(~valid, 0), ref.masked_fill(~valid, 0))


# ------------------------------------------------------------------ cast helpers (bytes)
@pytest.mark.parametrize("use_ue8m0", [False, True])
def test_deepgemm_cast_helpers_write_the_oracles_bytes(use_ue8m0):
    import deep_gemm

    k = (torch.randn(102_400, 128, generator=_gen(0), device=DEV) * 3).bfloat16()
    fmt = "ue8m0" if use_ue8m0 else None
    ours_fp8, ours_scale = act_quant(k, 128, fmt, reciprocal=True)
    dg_fp8, dg_scale = deep_gemm.utils.per_custom_dims_cast_to_fp8(k, (0,), use_ue8m0)
    assert torch.equal(ours_scale[:, 0].view(torch.int32), dg_scale.view(torch.int32))
    assert torch.equal(ours_fp8.view(torch.uint8), dg_fp8.view(torch.uint8))
    tok_fp8, tok_scale = deep_gemm.utils.per_token_cast_to_fp8(k, use_ue8m0, 128)
    assert torch.equal(ours_scale.view(torch.int32), tok_scale.view(torch.int32))
    assert torch.equal(ours_fp8.view(torch.uint8), tok_fp8.view(torch.uint8))


# ------------------------------------------------------------------ fp8_mqa_logits
def _ragged(requests: list[tuple[int, int]]):
    """Causal rows of requests (prefix, extend) over one concatenated KV: ks, ke int32 [S]."""
    ks, ke, off = [], [], 0
    for prefix, extend in requests:
        ks += [off] * extend
        ke += [off + prefix + i + 1 for i in range(extend)]
        off += prefix + extend
    as_t = lambda v: torch.tensor(v, dtype=torch.int32, device=DEV)  # noqa: E731
    return as_t(ks), as_t(ke), off


@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("requests", [
    [(0, 100), (300, 77), (1000, 200)],       # small, ragged, lengths not multiples of 64
    [(131_072 - 4096, 4096)],                  # GLM-5.3: a 4,096-row chunk at 131,072 keys
], ids=["small", "glm"])
def test_fp8_mqa_logits_matches_the_oracle(requests, heads):
    g = _gen(1)
    ks, ke, s_kv = _ragged(requests)
    S = ks.shape[0]
    q = torch.randn(S, heads, 128, generator=g, device=DEV).to(torch.float8_e4m3fn)
    k_fp8, k_scale = act_quant(torch.randn(s_kv, 128, generator=g, device=DEV).bfloat16(), 128)
    w = torch.randn(S, heads, generator=g, device=DEV)
    kv = (k_fp8, k_scale[:, 0].contiguous())
    got = peers.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=True)
    ref = oracle.fp8_mqa_logits(q, kv, w, ks, ke, clean_logits=True)
    ref_mask = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(got), ref_mask)
    diff = _masked_calc_diff(got, ref, ~ref_mask)
    print(f"\nfp8_mqa_logits {requests} H={heads}: calc_diff {diff:.2e}")
    assert diff < CALC_DIFF_DEQUANTIZED


# ------------------------------------------------------------------ fp8_paged_mqa_logits
@pytest.mark.parametrize("heads", [32, 64])
@pytest.mark.parametrize("batch, next_n, max_ctx", [(6, 1, 3000), (4, 2, 131_072)],
                         ids=["small", "glm"])
def test_fp8_paged_mqa_logits_reads_pages_written_by_kv_format(batch, next_n, max_ctx, heads):
    g = _gen(2)
    page = 64
    ctx = torch.randint(max_ctx // 2, max_ctx + 1, (batch,), generator=g, device=DEV, dtype=torch.int32)
    blocks = [-(-int(c) // page) for c in ctx]
    width = max(blocks)
    num_pages = sum(blocks) + 3
    perm = torch.randperm(num_pages, generator=g, device=DEV)  # pages scattered in the pool
    block_table = torch.zeros(batch, width, dtype=torch.int32, device=DEV)
    pages = torch.zeros(num_pages, page * 132, dtype=torch.uint8, device=DEV)
    used = 0
    for b, nb in enumerate(blocks):
        phys = perm[used:used + nb]
        used += nb
        block_table[b, :nb] = phys.to(torch.int32)
        n = int(ctx[b])
        slots = (phys.long()[:, None] * page + torch.arange(page, device=DEV)).reshape(-1)[:n]
        k_fp8, k_scale = act_quant(torch.randn(n, 128, generator=g, device=DEV).bfloat16(), 128)
        index_k_store(pages, slots, k_fp8, k_scale[:, 0].contiguous(), page)
    kv_cache = pages.view(num_pages, page, 1, 132)
    q = torch.randn(batch, next_n, heads, 128, generator=g, device=DEV).to(torch.float8_e4m3fn)
    w = torch.randn(batch * next_n, heads, generator=g, device=DEV)
    max_len = width * page
    got = peers.fp8_paged_mqa_logits(q, kv_cache, w, ctx, block_table, max_len, clean_logits=False)
    ref = oracle.fp8_paged_mqa_logits(q, kv_cache, w, ctx, block_table, max_len, clean_logits=True)
    valid = ~torch.isneginf(ref)
    assert bool(torch.isfinite(got[valid]).all())
    diff = _masked_calc_diff(got, ref, valid)
    print(f"\nfp8_paged_mqa_logits B={batch} next_n={next_n} ctx≤{max_ctx} H={heads}: calc_diff {diff:.2e}")
    assert diff < CALC_DIFF_DEQUANTIZED


# ------------------------------------------------------------------ FlashMLA sparse prefill
def _sparse_inputs(s_q, s_kv, topk, h_q, std, seed, sink, length):
    g = _gen(seed)
    q = (torch.randn(s_q, h_q, 576, generator=g, device=DEV) * std).bfloat16()
    kv = (torch.randn(s_kv, 1, 576, generator=g, device=DEV) * std).bfloat16()
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, device=DEV, dtype=torch.int32)
    noise = torch.rand(s_q, 1, topk, generator=g, device=DEV)
    idx = torch.where(noise < 0.05, -1, idx)                   # padding
    idx = torch.where(noise > 0.98, s_kv + 5, idx)             # out of range: invalid
    idx[0] = -1                                                # a row with no valid index
    attn_sink = torch.randn(h_q, generator=g, device=DEV) if sink else None
    topk_length = (torch.randint(0, topk + 1, (s_q,), generator=g, device=DEV, dtype=torch.int32)
                   if length else None)
    return q, kv, idx, attn_sink, topk_length


def _check_sparse(args, sm_scale):
    q, kv, idx, attn_sink, topk_length = args
    out, mx, lse = peers.flash_mla_sparse_fwd(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    r_out, r_mx, r_lse = oracle.flash_mla_sparse_fwd(q, kv, idx, sm_scale, 512, attn_sink, topk_length)
    return (oracle.check_allclose(out.float(), r_out, **OUT_TOL),
            oracle.check_allclose(mx, r_mx, **STAT_TOL),
            oracle.check_allclose(lse, r_lse, **STAT_TOL))


@pytest.mark.parametrize("s_q, s_kv, topk, h_q, sink, length", [
    (64, 512, 128, 64, False, False),
    (200, 4000, 512, 128, True, True),
    (4096, 131_072, 2048, 64, False, False),    # GLM-5.3 sparse prefill
    (1024, 131_072, 2048, 128, True, True),     # DeepSeek-V3.2 heads
], ids=["small", "small-h128-sink-length", "glm", "dsv32"])
def test_flash_mla_sparse_prefill_matches_the_oracle_at_flashmlas_input_scale(s_q, s_kv, topk, h_q,
                                                                            sink, length):
    args = _sparse_inputs(s_q, s_kv, topk, h_q, 0.1, 3, sink, length)
    for name, r in zip(("out", "max_logits", "lse"), _check_sparse(args, 576**-0.5 if h_q == 128 else 1 / 16)):
        print(f"\nsparse prefill {s_q}×{topk} h={h_q} {name}: {r}")
        assert r.passed, f"{name}: {r}"


def test_flash_mla_at_unit_variance_departs_only_by_its_bf16_probabilities():
    """Documented kernel behaviour (docs/peers.md): FlashMLA rounds the probabilities to bf16
    before the PV product. At unit-variance inputs the logits spread wider, a few probabilities
    are large, and their bf16 rounding (relative 2^-9) moves 0.01–0.03 % of ``out`` elements
    past FlashMLA's own tolerance; FlashMLA's ``tests/ref.py`` agrees with the oracle there. The
    statistics (float32 in the kernel) still pass."""
    args = _sparse_inputs(4096, 131_072, 2048, 64, 1.0, 4, False, False)
    out, mx, lse = _check_sparse(args, 1 / 16)
    frac = out.num_failed / (4096 * 64 * 512)
    print(f"\nunit variance: out {out}; failing fraction {frac:.2e}")
    assert mx.passed and lse.passed
    assert out.anomaly is None and frac < 1e-3


# ------------------------------------------------------------------ the harness on the real kernels
def test_check_passes_flashmla_under_the_newest_convention_and_names_it_under_sep2025():
    """FlashMLA's own signature (no lse_base / lonely_lse): it passes the newest convention and,
    asked for Sep 2025's, fails with the convention it follows named."""
    from glm_dsa.testing import check_kernel, edge_case_names

    n = len(edge_case_names("flash_mla_sparse_fwd")) + 2
    for shapes in ("golden", "glm-5.3"):
        assert check_kernel("flash_mla_sparse_fwd", peers.flash_mla_sparse_fwd, cases=n,
                            device=DEV, shapes=shapes).passed
    with pytest.raises(AssertionError, match="cause: the kernel follows convention 'newest'"):
        check_kernel("flash_mla_sparse_fwd", peers.flash_mla_sparse_fwd, cases=n, device=DEV,
                     shapes="golden", convention="sep2025")


def test_check_passes_deepgemm_logits_at_the_full_fp8_range():
    """deep_gemm.fp8_mqa_logits as it is (a binding without a Python signature) on the case
    table's act_quant inputs, float16-overflow case included; the paged kernel under the
    deepgemm convention (its newest build cannot clean 2-D context_lens)."""
    import deep_gemm

    from glm_dsa.testing import check_kernel, edge_case_names

    for contract, fn, convention in (("fp8_mqa_logits", deep_gemm.fp8_mqa_logits, None),
                                     ("fp8_paged_mqa_logits", peers.fp8_paged_mqa_logits, "deepgemm")):
        n = len(edge_case_names(contract)) + 4
        report = check_kernel(contract, fn, cases=n, device=DEV, shapes="glm-5.3", convention=convention)
        assert report.passed and report.cases_run == n
