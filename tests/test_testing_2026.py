"""The contracts of the kernels written in 2026 (issue #39): a fused ragged score + top-k
(``fp8_mqa_topk``) beside the paged one, tensor-parallel shard shapes, and the planted bugs each
fused top-k contract names.

Each passing kernel here is written from the upstream description (dequantize the keys, float32
scores, ``torch.topk`` over the row's window), never from the oracle; each failing one is that
kernel with one bug planted, and the test asserts the cause the harness prints for it.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm_dsa import oracle
from glm_dsa.testing import SHAPES, check_kernel, edge_case_names, make_case
from glm_dsa.testing.check import run_checks
from glm_dsa.testing.metrics import SPARSE_STAT_TOL, TOPK_REL_TOL
from test_testing_conventions import paged_indexer  # noqa: E402


# ------------------------------------------------------------------ fused ragged top-k
def ragged_indexer(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, topk, *, relu=True, gates=True,
                   k_scales=True, end_shift=0, key_numbers=False):
    """vLLM's prefill indexer as its RFC describes it (fp8_mqa_logits, then
    top_k_per_row_prefill), fused: per row, float32 scores of keys [ks, ke) from dequantized
    keys, heads summed by a matmul, torch.topk; positions relative to ks, -1 padded. The
    keywords plant one bug each."""
    k_fp8, k_scale = kv
    keys = k_fp8.float() * (k_scale[:, None] if k_scales else 1.0)
    out = torch.full((q.shape[0], topk), -1, dtype=torch.int32)
    for r in range(q.shape[0]):
        s, e = int(cu_seqlen_ks[r]), int(cu_seqlen_ke[r]) + end_shift
        n = max(e - s, 0)
        if n == 0:
            continue
        dots = q[r].float() @ keys[s:e].T  # [H, n]
        if relu:
            dots = dots.relu()
        w = weights[r].float() if gates else torch.ones(q.shape[1])
        score = w[None, :] @ dots  # [1, n]
        picked = torch.arange(n) if n <= topk else score[0].topk(topk).indices
        out[r, : picked.numel()] = (picked + (s if key_numbers else 0)).to(torch.int32)
    return out


def assert_only_cause(message: str, cause: str) -> None:
    """The failure names ``cause`` and no other."""
    causes = [line for line in message.splitlines() if line.startswith("  cause: ")]
    assert causes and all(cause in line for line in causes), message


def _failure(contract, fn):
    with pytest.raises(AssertionError) as info:
        check_kernel(contract, fn, cases=len(edge_case_names(contract)) + 2)
    return str(info.value)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_fused_ragged_indexer_written_from_the_description_passes(seed):
    report = check_kernel("fp8_mqa_topk", ragged_indexer, cases=10, seed=seed)
    assert report.passed and report.worst["indices"].value <= TOPK_REL_TOL


RAGGED_BUGS = {
    "the k-th member dropped (range read as [ks, ke - 1))": (
        dict(end_shift=-1), "each row's last key is never ranked"),
    "the ReLU left out": (dict(relu=False), "the ReLU is left out"),
    "the head gates ignored": (dict(gates=False), "the head gates (weights) are not applied"),
    "the key scales ignored": (dict(k_scales=False), "the key scales are not applied"),
    "key numbers returned": (dict(key_numbers=True), "the indices are key numbers (ks + position)"),
}


@pytest.mark.parametrize("bug", list(RAGGED_BUGS))
def test_a_fused_ragged_indexer_bug_fails_with_its_cause_and_no_other(bug):
    planted, cause = RAGGED_BUGS[bug]
    message = _failure("fp8_mqa_topk",
                       lambda *a: ragged_indexer(*a, **planted))
    assert_only_cause(message, cause)
    assert "fails topk_margin" in message.splitlines()[0]


# ------------------------------------------------------------------ fused paged top-k
def _paged_with(bug):
    def kernel(q, kv_cache, weights, context_lens, block_table, topk):
        if bug == "relu":  # relu(x) - relu(-x) = x: the same kernel on -q, subtracted per head
            return paged_indexer_scored(q, kv_cache, weights, context_lens, block_table, topk,
                                        relu=False)
        if bug == "gates":
            return paged_indexer(q, kv_cache, torch.ones_like(weights), context_lens, block_table, topk)
        out = paged_indexer(q, kv_cache, weights, context_lens, block_table, topk)
        bs = kv_cache.shape[1]  # "slots": flashinfer-bench's global slot indices
        for r in range(out.shape[0]):
            row = out[r].long()
            pages = block_table[r // q.shape[1]].long()[row.clamp_min(0) // bs]
            out[r] = torch.where(row >= 0, pages * bs + row % bs, -1).to(torch.int32)
        return out
    return kernel


def paged_indexer_scored(q, kv_cache, weights, context_lens, block_table, topk, relu=True):
    """``paged_indexer`` with the ReLU optional (one planted bug), 1-D context_lens."""
    b, next_n, h, d = q.shape
    bs = kv_cache.shape[1]
    flat = kv_cache.reshape(kv_cache.shape[0], -1)
    payload = flat[:, : bs * d].reshape(-1, bs, d).contiguous().view(torch.float8_e4m3fn).float()
    keys = payload * flat[:, bs * d:].contiguous().view(torch.float32).reshape(-1, bs, 1)
    out = torch.full((b * next_n, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for j in range(next_n):
            r, n = bi * next_n + j, int(context_lens[bi]) - next_n + j + 1
            k = keys[block_table[bi, : -(-n // bs)].long()].reshape(-1, d)[:n]
            s = q[bi, j].float() @ k.T
            score = weights[r].float()[None, :] @ (s.relu() if relu else s)
            picked = torch.arange(n) if n <= topk else score[0].topk(topk).indices
            out[r, : picked.numel()] = picked.to(torch.int32)
    return out


PAGED_BUGS = {
    "the ReLU left out": ("relu", "the ReLU is left out"),
    "the head gates ignored": ("gates", "the head gates (weights) are not applied"),
    "physical slots returned": ("slots", "the indices are physical slots"),
}


@pytest.mark.parametrize("bug", list(PAGED_BUGS))
def test_a_fused_paged_indexer_bug_fails_with_its_cause_and_no_other(bug):
    planted, cause = PAGED_BUGS[bug]
    message = _failure("fp8_paged_mqa_topk", _paged_with(planted))
    assert_only_cause(message, cause)


def test_the_paged_indexer_with_an_optional_relu_passes_with_it():
    """The planted-bug kernel is the passing kernel with one keyword changed."""
    assert check_kernel("fp8_paged_mqa_topk", paged_indexer_scored, cases=6).passed


# ------------------------------------------------------------------ tensor-parallel shards
def test_shard_tables_cover_the_head_counts_and_top_k_widths_upstream_allows():
    assert set(SHAPES["tp"]["index_heads"]) == {8, 16, 32, 64}  # DeepGEMM: at most 64
    assert set(SHAPES["tp"]["mla_heads"]) == {8, 16, 32, 64, 128}
    assert set(SHAPES["tp"]["topk"]) == set(SHAPES["tp"]["mla_topk"]) == {256, 512, 1024, 2048}
    for h in (8, 16, 32, 64, 128):
        assert SHAPES[f"h{h}"]["mla_heads"] == (h,)
        assert SHAPES[f"h{h}"]["index_heads"] == (min(h, 64),)


@pytest.mark.parametrize("contract, dim", [("fp8_mqa_topk", 1), ("fp8_paged_mqa_topk", 2),
                                           ("flash_mla_sparse_fwd", 1)])
def test_a_shard_table_builds_that_shards_head_count(contract, dim):
    for which in ("tied_keys" if "topk" in contract else "invalid_indices", 0):
        case = make_case(contract, which, shapes="h16")
        assert case.args[0].shape[dim] == 16, (contract, which)


def test_check_runs_a_fused_indexer_at_an_h8_shard_with_top_k_256_to_2048():
    report = run_checks("fp8_mqa_topk", ragged_indexer, cases=len(edge_case_names("fp8_mqa_topk")),
                        shapes="h8")
    assert report.passed, report.failure
    widths = {make_case("fp8_mqa_topk", e, shapes="h8").args[5] for e in edge_case_names("fp8_mqa_topk")}
    assert widths <= {256, 512, 1024, 2048} and len(widths) >= 2


# ------------------------------------------------------------------ FP8-query sparse prefill (Q8KV8)
def q8kv8_prefill(q, kv, indices, sm_scale, q_scale, kv_scale, d_v=512, attn_sink=None,
                  topk_length=None, *, q_scale_twice=False, kv_scale_twice=False, d_qk_scale=False,
                  minus_one_is_key_0=False, fp8_accumulation=False):
    """SGLang's Q8KV8 kernel as its PR describes it: e4m3 q and kv, one float32 scale each;
    float32 scores of the dequantized values; the softmax weights rounded to e4m3 (their max is
    1) for the second FP8 GEMM, the normaliser summed in float32; bf16 out, float32 max_logits
    and natural-log lse, +inf lse / -inf max / 0 out for a row with no valid index. Keywords
    plant one bug each; ``fp8_accumulation`` adds the scores' products as Hopper's FP8 wgmma
    does (``_fp8_accumulated``), which is no bug."""
    qs = float(q_scale) ** (2 if q_scale_twice else 1)
    ks = float(kv_scale) ** (2 if kv_scale_twice else 1)
    scale = q.shape[-1] ** -0.5 if d_qk_scale else sm_scale
    qv, kvv = q.float() * qs, kv[:, 0].float() * ks
    s_q, h_q, _ = q.shape
    out = torch.zeros(s_q, h_q, d_v)
    m_out = torch.full((s_q, h_q), -math.inf)
    lse = torch.full((s_q, h_q), math.inf)
    for i in range(s_q):
        idx = indices[i, 0].long()
        n = idx.numel() if topk_length is None else int(topk_length[i])
        idx = idx[:n]
        if minus_one_is_key_0:
            idx = torch.where(idx == -1, 0, idx)
        idx = idx[(idx >= 0) & (idx < kv.shape[0])]
        if idx.numel() == 0:
            continue
        raw = _fp8_accumulated(qv[i], kvv[idx]) if fp8_accumulation else qv[i] @ kvv[idx].T
        scores = raw * scale  # [h, n]
        m = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - m)
        total = p.sum(-1)
        p8 = p.to(torch.float8_e4m3fn).float()
        if attn_sink is not None:
            total = total + torch.exp(attn_sink.float() - m[:, 0])
        out[i] = (p8 @ kvv[idx, :d_v]) / total[:, None]
        m_out[i] = m[:, 0]
        lse[i] = m[:, 0] + torch.log(p.sum(-1))
    return out.to(torch.bfloat16), m_out, lse


def _fp8_accumulated(q, k, group=32, bits=14, chain=256):
    """``q @ k.T`` summed as FP8 wgmma chains on Hopper (DeepSeek-V3 report §3.3.2): each
    instruction's ``group`` products (exact) join an accumulator that keeps ``bits``
    significant bits, cut toward zero; every ``chain`` products the accumulator is added to a
    float32 sum and restarts (the Gluon Q8KV8 kernel's two chains, 256 + 320 products)."""
    prods = q.double()[:, None, :] * k.double()[None, :, :]  # [h, n, d]
    total = torch.zeros(prods.shape[:2], dtype=torch.float32)
    for c0 in range(0, prods.shape[-1], chain):
        acc = torch.zeros(prods.shape[:2], dtype=torch.float64)
        for g0 in range(c0, min(c0 + chain, prods.shape[-1]), group):
            acc = acc + prods[..., g0:g0 + group].sum(-1)
            mant, exp = torch.frexp(acc)
            acc = torch.ldexp(torch.trunc(mant * 2.0**bits) / 2.0**bits, exp)
        total = total + acc.float()
    return total


def test_a_q8kv8_kernel_with_hopper_fp8_accumulation_passes_a_bound_flashmla_s_would_fail():
    # The max_logits / lse bound is Q8KV8_STAT_TOL, not FlashMLA's: a kernel whose scores
    # carry the FP8 accumulator's error passes it, and errs past FlashMLA's 1e-6.
    report = check_kernel("sparse_mla_q8kv8_prefill_fwd",
                          lambda *a, **k: q8kv8_prefill(*a, **k, fp8_accumulation=True), cases=9)
    assert report.passed, report.failure
    case = make_case("sparse_mla_q8kv8_prefill_fwd", 0)
    got = q8kv8_prefill(*case.args, **case.kwargs, fp8_accumulation=True)[1]
    want = oracle.sparse_mla_q8kv8_prefill_fwd(*case.args, **case.kwargs)[1]
    assert not oracle.check_allclose(got, want.float(), **SPARSE_STAT_TOL).passed


def test_a_q8kv8_kernel_with_fp8_softmax_weights_passes_within_the_stated_bound():
    report = check_kernel("sparse_mla_q8kv8_prefill_fwd", q8kv8_prefill, cases=9)
    assert report.passed, report.failure
    assert report.worst["out"].value > 1e-7  # the FP8 weights' error shows, inside the bound


Q8KV8_BUGS = {
    "q scale applied twice": (dict(q_scale_twice=True), "q_scale is applied twice"),
    # (A scale left out sharpens the softmax a thousandfold: e4m3 weights then err past the
    # bound against the mistaken computation too, so the cause cannot be told apart.)
    "kv scale applied twice": (dict(kv_scale_twice=True), "kv_scale is applied twice"),
    "1/sqrt(d_qk) as the softmax scale": (dict(d_qk_scale=True), "scaled by 1/sqrt(d_qk)"),
    "-1 read as key 0": (dict(minus_one_is_key_0=True), "-1 is read as key 0"),
}


@pytest.mark.parametrize("bug", list(Q8KV8_BUGS))
def test_a_q8kv8_bug_fails_with_its_cause_and_no_other(bug):
    planted, cause = Q8KV8_BUGS[bug]
    message = _failure("sparse_mla_q8kv8_prefill_fwd", lambda *a, **k: q8kv8_prefill(*a, **k, **planted))
    assert_only_cause(message, cause)


def test_q8kv8_takes_attn_sink_and_topk_length_together_only():
    case = make_case("sparse_mla_q8kv8_prefill_fwd", "attn_sink_and_topk_length")
    with pytest.raises(ValueError, match="attn_sink and topk_length go together"):
        oracle.sparse_mla_q8kv8_prefill_fwd(*case.args, attn_sink=case.kwargs["attn_sink"])


# ------------------------------------------------------------------ MXFP4 index-K cache
def fp4_index_k_cache(k, *, swap=False, gran=32, ties_even=False, nearest=False, interleaved=False):
    """DeepGEMM's FP4 index-K cache as its test describes it: per 32 elements a power-of-two
    scale 2^ceil(log2(amax / 6)), each element to the nearest e2m1 value (a midpoint to the
    smaller one), two codes a byte (the first low), a page of codes then one int32 of exponent
    bytes per token. Written with frexp and bucketize; keywords plant one bug each."""
    nb, bs, _, d = k.shape
    g = min(gran, d)
    x = k.float().reshape(nb * bs, d // g, g)
    amax = x.abs().amax(-1).clamp_min(1e-4) / 6
    mantissa, exp = torch.frexp(amax)  # amax / 6 = mantissa * 2^exp, mantissa in [0.5, 1)
    e = torch.where(mantissa == 0.5, exp - 1, exp)  # ceil(log2): an exact power keeps its exponent
    if nearest:
        e = torch.round(torch.log2(amax)).int()
    y = x / torch.exp2(e.float())[..., None]
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    # right=False: a value equal to a bound stays below it (the smaller magnitude).
    mag = torch.bucketize(y.abs(), bounds, right=False)
    if ties_even:
        on_bound = torch.isin(y.abs(), bounds)
        mag = torch.where(on_bound & (mag % 2 == 1), mag + 1, mag)  # the even code above
    code = mag | ((y < 0) & (mag > 0)).long() << 3
    pairs = code.reshape(nb * bs, d // 2, 2)
    first, second = (pairs[..., 1], pairs[..., 0]) if swap else (pairs[..., 0], pairs[..., 1])
    packed = (first + 16 * second).to(torch.uint8)
    scale_bytes = torch.full((nb * bs, 4), 127, dtype=torch.uint8)
    scale_bytes[:, : e.shape[1]] = (e + 127).to(torch.uint8)
    if interleaved:
        return torch.cat([packed, scale_bytes], 1).view(nb, bs, 1, d // 2 + 4)
    return torch.cat([packed.view(nb, -1), scale_bytes.view(nb, -1)], 1).view(nb, bs, 1, d // 2 + 4)


def test_an_fp4_index_k_writer_from_the_description_passes_bitwise():
    assert check_kernel("kv_cache_cast_to_fp4", fp4_index_k_cache, cases=10).passed


def test_the_fp4_bytes_of_a_hand_worked_key():
    """Block 0 has amax 6 (scale 1): 0.75 -> code 1 (0.5, the smaller), -5 -> code 8|6 (-4),
    6 -> 7; block 1 all 0.1: scale 2^ceil(log2(0.1/6)) = 2^-5, 0.1 * 32 = 3.2 -> 3 (code 5)."""
    k = torch.zeros(1, 64, 1, 128)
    k[0, 0, 0, :3] = torch.tensor([0.75, -5.0, 6.0])
    k[0, 0, 0, 32:64] = 0.1
    cache = oracle.kv_cache_cast_to_fp4(k.to(torch.bfloat16)).reshape(-1)
    assert cache[:2].tolist() == [0x1 | (0xE << 4), 0x7]
    assert cache[16] == 0x5 | (0x5 << 4)
    scales = cache[64 * 64:64 * 64 + 4].tolist()
    assert scales[0] == 127 and scales[1] == 127 - 5  # 2^0, 2^-5
    # 0.1 rounds to bf16 0.10009765625, times 32 = 3.203 -> 3; the dequantized key is 3 * 2^-5.
    from glm_dsa.kv_format import mxfp4_dequantize
    codes, exps = cache[:64 * 64].view(64, 64), cache[64 * 64:].view(64, 4)
    assert mxfp4_dequantize(codes, exps, 128)[0, 32:36].tolist() == [3 / 32] * 4


FP4_BUGS = {
    "nibble order swapped": (dict(swap=True), "the two codes of a byte are swapped"),
    "ue8m0 scale per 128 elements": (dict(gran=128), "one ue8m0 scale per 128 elements"),
    "midpoints to the even code": (dict(ties_even=True), "midpoints round to the even code"),
    "exponent rounded to nearest": (dict(nearest=True), "the ue8m0 exponent is rounded to nearest"),
    "interleaved 68-byte rows": (dict(interleaved=True), "interleaved 68-byte rows"),
}


@pytest.mark.parametrize("bug", list(FP4_BUGS))
def test_an_fp4_index_k_writer_bug_fails_with_its_cause_and_no_other(bug):
    planted, cause = FP4_BUGS[bug]
    message = _failure("kv_cache_cast_to_fp4", lambda k: fp4_index_k_cache(k, **planted))
    assert message.splitlines()[0].startswith("kv_cache_cast_to_fp4 [case ") and "bitwise" in message
    assert_only_cause(message, cause)
