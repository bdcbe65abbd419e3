"""The MX index-key contracts (issue #39): DeepGEMM's MXFP8 and MXFP4 indexer logits, ragged
(``fp8_fp4_mqa_logits``) and paged (``fp8_fp4_paged_mqa_logits``), the MXFP8 page writer
(``kv_cache_cast_to_mxfp8``), SGLang's FP4 writer convention, and the sparse decode over a bf16
cache (``flash_mla_sparse_decode_bf16``).

Each passing kernel here is written from the upstream description, never from the oracle:
DeepGEMM 559d79f ``tests/test_attention.py`` (dequantize with ``cast_back_from_fp8/fp4``, then
float32 einsum logits on the values: ``ref_fp8_mqa_logits``, ``ref_paged_mqa_logits``; its
``kv_cache_cast_to_mxfp8``), FlashMLA 9241ae3 ``tests/ref.py`` ``ref_sparse_attn_decode`` and
SGLang 1875c52's ``store_fp4_index_k_cache``. Each failing one is that kernel with one bug
planted, and the test asserts the cause the harness prints for it.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm_dsa import oracle
from glm_dsa.testing import check_kernel, make_case
from glm_dsa.testing.cases import SHAPES, edge_case_names, mx_quantize
from test_testing_2026 import _failure, assert_only_cause

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


# ------------------------------------------------------------------ dequantizing the MX operands
def unpack_fp4(codes, swap=False):
    """float32 [..., 2n] of int8 [..., n] packed e2m1 (cast_back_from_fp4: element 2i low)."""
    raw = codes.view(torch.uint8).long()
    lo, hi = raw & 0xF, raw >> 4
    if swap:
        lo, hi = hi, lo
    both = torch.stack([lo, hi], -1).flatten(-2)
    mag = E2M1[both & 7]
    return torch.where(both >= 8, -mag, mag)


def block_scales(sf, d, *, ignore=False, twice=False, per_token=False, big_endian=False):
    """float32 [..., d] per-element scales of int32 words of ue8m0 bytes (unpack_ue8m0_from_int,
    block j in byte j); the keywords misread them one way each."""
    shifts = torch.arange(4) * 8
    if big_endian:
        shifts = shifts.flip(0)
    byte = (sf.long()[..., None] >> shifts) & 0xFF  # [..., 4]
    e = byte[..., : d // 32].double() - 127
    if per_token:
        e = e[..., :1].expand_as(e)
    if twice:
        e = 2 * e
    if ignore:
        e = torch.zeros_like(e)
    return torch.exp2(e).float().repeat_interleave(32, -1)


def mx_values(fp, sf, d, *, swap=False, **misread):
    """cast_back_from_fp8 / cast_back_from_fp4 on one operand: float32 [..., d]."""
    elems = unpack_fp4(fp, swap) if fp.dtype == torch.int8 else fp.float()
    return elems * block_scales(sf, d, **misread)


def mx_ragged_logits(q, kv, weights, cu_seq_len_k_start, cu_seq_len_k_end, clean_logits=True,
                     max_seqlen_k=0, logits_dtype=torch.float32, *, bug=None):
    """DeepGEMM's MX prefill logits as its test computes the reference: dequantized q and kv,
    einsum('mhd,nd->hmn'), ReLU, einsum with the gates, -inf outside [ks, ke). ``bug`` plants
    one mistake by name."""
    (q_fp, q_sf), (k_fp, k_sf) = q, kv
    d = q_fp.shape[-1] * (2 if q_fp.dtype == torch.int8 else 1)
    qv = mx_values(q_fp, q_sf, d, ignore=bug == "q_scale", twice=bug == "q_twice",
                   per_token=bug == "per_token", big_endian=bug == "big_endian")
    kvv = mx_values(k_fp, k_sf, d, swap=bug == "nibbles", ignore=bug == "k_scale",
                    per_token=bug == "per_token", big_endian=bug == "big_endian")
    score = torch.einsum("mhd,nd->hmn", qv, kvv)
    if bug != "relu":
        score = score.relu()
    w = torch.ones_like(weights) if bug == "gates" else weights
    logits = torch.einsum("hmn,hm->mn", score, w.float().t())
    col = torch.arange(kvv.shape[0])
    ks, ke = cu_seq_len_k_start.long()[:, None], cu_seq_len_k_end.long()[:, None]
    logits = logits.masked_fill((col < ks) | (col >= ke), -math.inf)
    if max_seqlen_k:  # compressed: column j of row i is key ks[i] + j
        j = torch.arange(max_seqlen_k)
        at = (ks + j).clamp(max=kvv.shape[0] - 1)
        logits = torch.where(ks + j < ke, logits.gather(1, at), -math.inf)
    return logits


def mx_paged_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                    clean_logits=True, logits_dtype=torch.float32, *, bug=None):
    """DeepGEMM's MX decode logits as its test computes them (ref_paged_mqa_logits on the
    dequantized cache): a block is block_kv payloads then block_kv int32 scale words."""
    q_fp, q_sf = q
    fp4 = q_fp.dtype == torch.int8
    b, next_n, h, width = q_fp.shape
    d = width * 2 if fp4 else width
    nb, bkv = kv_cache.shape[:2]
    flat = kv_cache.reshape(nb, -1)
    payload = flat[:, : bkv * width].reshape(nb, bkv, width)
    words = flat[:, bkv * width:].contiguous().view(torch.int32).reshape(nb, bkv)
    payload = payload.view(torch.int8) if fp4 else payload.contiguous().view(torch.float8_e4m3fn)
    keys = mx_values(payload, words, d, swap=bug == "nibbles", ignore=bug == "k_scale",
                     per_token=bug == "per_token", big_endian=bug == "big_endian")  # [nb, bkv, d]
    qv = mx_values(q_fp, q_sf, d, ignore=bug == "q_scale", twice=bug == "q_twice",
                   per_token=bug == "per_token", big_endian=bug == "big_endian")
    out = torch.full((b * next_n, max_context_len), -math.inf)
    for i in range(b):
        for j in range(next_n):
            n = int(context_lens[i, j]) if context_lens.dim() == 2 else int(context_lens[i]) - next_n + j + 1
            if n <= 0:
                continue
            k = keys[block_table[i, : -(-n // bkv)].long()].reshape(-1, d)[:n]
            s = qv[i, j] @ k.T  # [h, n]
            w = torch.ones(h) if bug == "gates" else weights[i * next_n + j]
            out[i * next_n + j, :n] = w @ (s if bug == "relu" else s.relu())
    return out


@pytest.mark.parametrize("contract, kernel", [("fp8_fp4_mqa_logits", mx_ragged_logits),
                                              ("fp8_fp4_paged_mqa_logits", mx_paged_logits)])
def test_mx_logits_written_from_deepgemms_test_pass_in_both_formats(contract, kernel):
    report = check_kernel(contract, kernel, cases=8)
    assert report.passed, report.failure
    formats = {oracle.index_format(make_case(contract, e).args[0]) for e in edge_case_names(contract)}
    assert formats == {"mxfp8", "mxfp4"}


def test_a_one_format_table_checks_a_one_format_kernel(fmt="mxfp4"):
    def only(q, *args, **kw):
        assert oracle.index_format(q) == fmt
        return mx_ragged_logits(q, *args, **kw)
    assert check_kernel("fp8_fp4_mqa_logits", only, cases=8, shapes=fmt).passed


MX_BUGS = {
    "q scale applied twice": ("q_twice", "the query scale is applied twice"),
    "q scale ignored": ("q_scale", "the query scales (q_sf) are not applied"),
    "key scales ignored": ("k_scale", "the key scales are not applied"),
    "FP4 nibble order swapped in the keys": ("nibbles", "the two e2m1 codes of a key byte are swapped"),
    "one scale per token (block 0's byte)": ("per_token", "one exponent per row"),
    "scale word read big-endian": ("big_endian", "the scale word is read big-endian"),
    "ReLU left out": ("relu", "the ReLU is left out"),
}


# Every bug in the ragged contract; the paged one reads the same operands through its pages,
# so its own share: the page's codes and scale words, and the query's scale.
PAGED_MX_BUGS = ("q scale applied twice", "key scales ignored", "FP4 nibble order swapped in the keys",
                 "scale word read big-endian")


@pytest.mark.parametrize("contract, kernel, bug", [
    *(("fp8_fp4_mqa_logits", mx_ragged_logits, bug) for bug in MX_BUGS),
    *(("fp8_fp4_paged_mqa_logits", mx_paged_logits, bug) for bug in PAGED_MX_BUGS)])
def test_an_mx_logits_bug_fails_with_its_cause_and_no_other(contract, kernel, bug):
    planted, cause = MX_BUGS[bug]
    message = _failure(contract, lambda *a, **k: kernel(*a, **k, bug=planted))
    assert "fails calc_diff" in message.splitlines()[0]
    assert_only_cause(message, cause)


@pytest.mark.parametrize("fmt, q_bytes", [
    # MXFP4: 0.75 / 6 -> scale 2^-3 (0.75 is code 7, 6.0), 32 / 6 -> 2^3 (32 is code 6, 4.0).
    ("mxfp4", [127 - 3, 127 + 3, 127, 127]),
    # MXFP8: 0.75 / 448 -> 2^-9 (0.75 is e4m3 384), 32 / 448 -> 2^-3 (32 is 256).
    ("mxfp8", [127 - 9, 127 - 3, 127, 127]),
])
def test_the_mx_logits_of_a_hand_worked_row(fmt, q_bytes):
    """One head, D = 64 (two blocks): q is 0.75 at element 0 and 32 at element 40, k is 2 at
    both; every value is exact in either format, so q·k = 1.5 + 64 and the gate 0.5 gives 32.75."""
    qv = torch.zeros(1, 1, 64)
    qv[0, 0, 0], qv[0, 0, 40] = 0.75, 32.0
    kv = torch.zeros(1, 64)
    kv[0, 0], kv[0, 40] = 2.0, 2.0
    q, k = mx_quantize(qv.bfloat16(), fmt), mx_quantize(kv.bfloat16(), fmt)
    assert q[0].dtype == (torch.int8 if fmt == "mxfp4" else torch.float8_e4m3fn)
    assert q[1].view(torch.uint8).reshape(-1).tolist() == q_bytes
    out = oracle.fp8_fp4_mqa_logits(q, k, torch.tensor([[0.5]]), torch.tensor([0], dtype=torch.int32),
                                    torch.tensor([1], dtype=torch.int32))
    assert out.tolist() == [[32.75]]


def test_the_mx_oracles_refuse_what_deepgemm_refuses_in_one_line():
    case = make_case("fp8_fp4_mqa_logits", "empty_window")  # MXFP4
    (q_fp, q_sf), kv, rest = case.args[0], case.args[1], case.args[2:]
    assert q_fp.dtype == torch.int8
    refusals = {
        "MXFP4 queries need their int32 ue8m0 scales": ((q_fp, None), kv),
        "the exponent byte 255, NaN in ue8m0": ((q_fp, q_sf.view(torch.uint8).clone().fill_(255).view(torch.int32)), kv),
        r"kv\[1\] must be int32": ((q_fp, q_sf), (kv[0], kv[1].float())),
        "head_dim=32: mxfp4 takes 64, 128": ((q_fp[..., :16].contiguous(), q_sf), kv),
    }
    for message, (q, k) in refusals.items():
        with pytest.raises(ValueError, match=message):
            oracle.fp8_fp4_mqa_logits(q, k, *rest)
    with pytest.raises(ValueError, match="logits_dtype=torch.float16 must be torch.float32 or torch.bfloat16"):
        oracle.fp8_fp4_mqa_logits((q_fp, q_sf), kv, *rest, logits_dtype=torch.float16)
    paged = make_case("fp8_fp4_paged_mqa_logits", "smallest_head_dim")
    q, cache = paged.args[0], paged.args[1]
    with pytest.raises(ValueError, match=r"kv_cache must be uint8 \[num_blocks, block_kv, 1, "):
        oracle.fp8_fp4_paged_mqa_logits(q, cache[..., :-1], *paged.args[2:])
    decode = make_case("flash_mla_sparse_decode", "lonely_entry")
    with pytest.raises(ValueError, match="use flash_mla_sparse_decode"):
        oracle.flash_mla_sparse_decode_bf16(*decode.args)


# ------------------------------------------------------------------ the MXFP8 page writer
def mxfp8_cache(k, *, gran=32, fp32_scales=False, nearest=False, unbiased=False, interleaved=False):
    """DeepGEMM 559d79f's kv_cache_cast_to_mxfp8 as its test writes it: per_token_cast_to_fp8(
    use_ue8m0=True, gran_k=32, use_packed_ue8m0=True) — sf = amax / 448 (CUDA: amax × fl32(1/448))
    rounded up to a power of two by its float32 bits, the payload x × (1/sf) in e4m3, the
    exponent bytes packed into an int32 per token — then a block's payloads, then its words.
    Keywords plant one bug each."""
    nb, bs, _, d = k.shape
    g = min(gran, d)
    x = k.float().reshape(nb * bs, d // g, g)
    raw = x.abs().amax(-1).clamp_min(1e-4) * torch.tensor(1 / 448.0, dtype=torch.float32)
    if fp32_scales:  # kv_cache_cast_to_fp8's page: one float32 scale per token
        sf = k.float().abs().amax(-1).clamp_min(1e-4).reshape(nb * bs, 1) * torch.tensor(1 / 448.0)
        payload = (k.float().reshape(nb * bs, d) * (1.0 / sf)).to(torch.float8_e4m3fn)
        words = sf.contiguous().view(torch.uint8)
    else:
        bits = raw.view(torch.int32)
        e = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()  # ceil_to_ue8m0
        if nearest:
            e = torch.round(torch.log2(raw)).int() + 127
        sf = (e << 23).view(torch.float32)
        payload = (x * (1.0 / sf)[..., None]).to(torch.float8_e4m3fn).reshape(nb * bs, d)
        e = (e - 127) & 0xFF if unbiased else e
        words = torch.full((nb * bs, 4), 127, dtype=torch.uint8)
        words[:, : d // 32] = e.repeat_interleave(g // min(g, 32), 1)[:, : d // 32].to(torch.uint8)
    payload = payload.view(torch.uint8)
    if interleaved:
        return torch.cat([payload, words], 1).view(nb, bs, 1, d + 4)
    return torch.cat([payload.view(nb, -1), words.view(nb, -1)], 1).view(nb, bs, 1, d + 4)


def test_an_mxfp8_index_k_writer_from_deepgemms_test_passes_bitwise():
    assert check_kernel("kv_cache_cast_to_mxfp8", mxfp8_cache, cases=10).passed


MXFP8_BUGS = {
    "float32 scales (the FP8 page)": (dict(fp32_scales=True), "the words hold float32 per-token scales"),
    "ue8m0 scale per 128 elements": (dict(gran=128), "one ue8m0 scale per 128 elements"),
    "exponent rounded to nearest": (dict(nearest=True), "the ue8m0 exponent is rounded to nearest"),
    "unbiased exponent bytes": (dict(unbiased=True), "the exponent bytes are unbiased"),
    "interleaved rows": (dict(interleaved=True), "interleaved D + 4-byte rows"),
}


@pytest.mark.parametrize("bug", list(MXFP8_BUGS))
def test_an_mxfp8_writer_bug_fails_with_its_cause_and_no_other(bug):
    planted, cause = MXFP8_BUGS[bug]
    message = _failure("kv_cache_cast_to_mxfp8", lambda k: mxfp8_cache(k, **planted))
    assert "bitwise" in message.splitlines()[0]
    assert_only_cause(message, cause)


def test_the_mxfp8_bytes_of_a_hand_worked_key():
    """Block 0 amax 448 (scale 2^0: 448 -> 0x7E), block 1 all 0.5 (2^ceil(log2(0.5/448)) = 2^-9,
    0.5 * 512 = 256 -> 0x78), blocks 2-3 zero (1e-4/448 -> 2^-22, byte 105); 32 dims pad the word
    with 127."""
    k = torch.zeros(1, 64, 1, 128)
    k[0, 0, 0, 0] = 448.0
    k[0, 0, 0, 32:64] = 0.5
    cache = oracle.kv_cache_cast_to_mxfp8(k.bfloat16()).reshape(-1)
    assert cache[0] == 0x7E and cache[32] == 0x78 and cache[64] == 0
    assert cache[64 * 128: 64 * 128 + 4].tolist() == [127, 127 - 9, 127 - 22, 127 - 22]
    short = oracle.kv_cache_cast_to_mxfp8(k[..., :32].bfloat16()).reshape(-1)
    assert short[64 * 32: 64 * 32 + 4].tolist() == [127, 127, 127, 127]


# ------------------------------------------------------------------ SGLang's FP4 writer
def sglang_fp4_cache(k, rne=False):
    """SGLang 1875c52 store_fp4_index_k_cache (dsv4/fp4_indexer.py) over DeepGEMM's page:
    sf = max(amax / 6, 1e-4) rounded up to ue8m0, codes counted against the midpoints (strict >,
    or >= with the odd one stepped down for rne), a page of codes then one word per token."""
    nb, bs, _, d = k.shape
    x = k.float().reshape(nb * bs, d // 32, 32)
    sf = (x.abs().amax(-1) / 6.0).clamp_min(1e-4)
    bits = sf.view(torch.int32)
    e = (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()).clamp(1, 254)
    v = (x / (e << 23).view(torch.float32)[..., None]).abs().clamp(max=6.0)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    idx = ((v[..., None] >= bounds) if rne else (v[..., None] > bounds)).sum(-1)
    if rne:
        idx = torch.where(torch.isin(v, bounds) & (idx % 2 == 1), idx - 1, idx)
    code = (idx | (((x < 0) & (idx > 0)).long() << 3)).reshape(nb * bs, d // 2, 2)
    packed = (code[..., 0] | (code[..., 1] << 4)).to(torch.uint8)
    words = torch.full((nb * bs, 4), 127, dtype=torch.uint8)
    words[:, : d // 32] = e.to(torch.uint8)
    return torch.cat([packed.view(nb, -1), words.view(nb, -1)], 1).view(nb, bs, 1, d // 2 + 4)


def test_sglangs_fp4_writer_is_deepgemms_layout_with_its_scale_floor():
    """SGLang's 68-byte cache has DeepGEMM's byte layout; only its floor (on the scale, not on
    amax) differs: checked newest it fails at the zero key with the convention named, and passes
    under --convention sglang (rne=True is ties='even')."""
    message = _failure("kv_cache_cast_to_fp4", sglang_fp4_cache)
    assert "[case zero_key]" in message.splitlines()[0]
    assert_only_cause(message, "the kernel follows convention 'sglang' (scale_floor='scale')")
    assert check_kernel("kv_cache_cast_to_fp4", sglang_fp4_cache, cases=8, convention="sglang").passed
    assert check_kernel("kv_cache_cast_to_fp4", lambda k: sglang_fp4_cache(k, rne=True), cases=8,
                        scale_floor="scale", ties="even").passed


def test_an_all_zero_key_has_exponent_byte_112_in_deepgemms_cache_and_114_in_sglangs():
    k = torch.zeros(1, 64, 1, 128, dtype=torch.bfloat16)
    ours = oracle.kv_cache_cast_to_fp4(k).reshape(-1)[64 * 64:][:4].tolist()
    theirs = oracle.kv_cache_cast_to_fp4(k, scale_floor="scale").reshape(-1)[64 * 64:][:4].tolist()
    assert ours == [112] * 4 and theirs == [114] * 4  # 2^ceil(log2(1e-4 / 6)) = 2^-15; 2^-13


# ------------------------------------------------------------------ sparse decode, bf16 cache
def bf16_decode(q, k_cache, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None, *,
                bug=None):
    """FlashMLA's ref_sparse_attn_decode on a bf16 cache: gather the slots (clamped, -1 and
    columns past topk_length masked), float32 softmax, output times 1 / (1 + exp(sink - lse)),
    lonely queries out 0 and lse +inf; lse [b, h, s_q]. ``bug`` plants one mistake."""
    b, s_q, h, d = q.shape
    topk = indices.shape[-1]
    rows = k_cache.reshape(-1, d).float()
    idx = indices.long()
    invalid = idx == -1
    if bug == "minus_one_is_0":
        invalid = torch.zeros_like(invalid)
    if topk_length is not None and bug != "topk_length":
        invalid |= torch.arange(topk)[None, None, :] >= topk_length.long()[:, None, None]
    if bug == "dedup":
        for r in idx.reshape(-1, topk):
            seen = set()
            for j, v in enumerate(r.tolist()):
                if v in seen:
                    r[j] = -1
                seen.add(v)
        invalid |= idx == -1
    kv = rows[idx.clamp_min(0)]  # [b, s_q, topk, d]
    if bug != "nan_reaches":
        kv = kv.masked_fill(invalid[..., None], 0.0)
    w = torch.einsum("bshd,bstd->bsht", q.float(), kv) * sm_scale
    w = w.masked_fill(invalid[:, :, None, :], -math.inf)
    lse = w.logsumexp(-1)
    out = torch.einsum("bsht,bstd->bshd", torch.exp(w - lse[..., None]), kv[..., :d_v])
    if attn_sink is not None:
        out = out * (1.0 / (1.0 + torch.exp(attn_sink.float()[None, None, :] - lse)))[..., None]
    lonely = torch.isneginf(lse)
    out = out.masked_fill(lonely[..., None], 0.0)
    lse = lse.masked_fill(lonely, -math.inf if bug == "flashinfer" else math.inf)
    if bug == "flashinfer":
        lse = lse / math.log(2)
    return out.to(torch.bfloat16), lse.transpose(1, 2).contiguous()


def test_a_bf16_decode_written_from_flashmlas_reference_passes():
    report = check_kernel("flash_mla_sparse_decode_bf16", bf16_decode, cases=9)
    assert report.passed, report.failure

    def flashinfer(q, k_cache, indices, sm_scale, d_v=512):  # no attn_sink, no topk_length
        return bf16_decode(q, k_cache, indices, sm_scale, d_v, bug="flashinfer")

    assert check_kernel("flash_mla_sparse_decode_bf16", flashinfer, cases=8, convention="flashinfer").passed


DECODE_BUGS = {
    "-1 read as slot 0": ("minus_one_is_0", "-1 is read as slot 0"),
    "repeated slots de-duplicated": ("dedup", "repeated slots are de-duplicated"),
    "topk_length ignored": ("topk_length", "topk_length is ignored"),
    "an unread NaN slot multiplied by 0": ("nan_reaches", "a slot that is not read reaches the output"),
    "base-2 lse, -inf lonely rows": ("flashinfer", "the kernel follows convention 'flashinfer'"),
}


@pytest.mark.parametrize("bug", list(DECODE_BUGS))
def test_a_bf16_decode_bug_fails_with_its_cause_and_no_other(bug):
    planted, cause = DECODE_BUGS[bug]
    message = _failure("flash_mla_sparse_decode_bf16", lambda *a, **k: bf16_decode(*a, **k, bug=planted))
    assert_only_cause(message, cause)


# ------------------------------------------------------------------ shapes
def test_the_shard_tables_reach_the_new_contracts():
    for h in (8, 16, 32, 64):
        case = make_case("fp8_fp4_paged_mqa_logits", "smallest_block_kv", shapes=f"h{h}")
        assert case.args[0][0].shape[2] == h and case.args[1].shape[1] == 32
    for h in (8, 128):
        case = make_case("flash_mla_sparse_decode_bf16", "page_size_1", shapes=f"h{h}")
        assert case.args[0].shape[2] == h and case.args[2].shape[-1] in SHAPES["tp"]["mla_topk"]
    assert SHAPES["sm90"]["index_formats"] == ("fp8",) and SHAPES["sm90"]["block_kv"] == (64,)


def mx_paged_logits_big_endian(*args, **kwargs):
    """A planted mutant for the docs' example: the scale words read big-endian."""
    return mx_paged_logits(*args, **kwargs, bug="big_endian")


# ------------------------------------------------------------------ float64 truth for attention
def _sparse_ref64(q, kv_rows, idx, valid, sm_scale, sink=None):
    """FlashMLA's ref_sparse_attn_fwd in float64: out, lse per (row, head)."""
    keys = kv_rows.double()[idx.clamp(0, kv_rows.shape[0] - 1)]  # [r, topk, d]
    s = torch.einsum("rhd,rtd->rht", q.double(), keys) * sm_scale
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    lse = s.logsumexp(-1)
    out = torch.einsum("rht,rtd->rhd", torch.exp(s - lse[..., None]).nan_to_num(0.0), keys[..., :512])
    if sink is not None:
        out = out / (1 + torch.exp(sink.double() - lse))[..., None]
    return out, lse


@pytest.mark.parametrize("contract, edge", [("flash_mla_sparse_fwd", "attn_sink"),
                                            ("flash_mla_sparse_decode_bf16", "repeated_slot")])
def test_attention_truth_is_the_float64_result_rounded_once(contract, edge):
    """Within half a float32 ulp of an independent float64 computation (a float32 one errs by
    several ulps on some elements)."""
    from glm_dsa.testing.cases import expected_outputs

    case = make_case(contract, edge)
    if contract == "flash_mla_sparse_fwd":
        q, kv, indices, sm_scale = case.args
        idx = indices[:, 0].long()
        valid = (idx >= 0) & (idx < kv.shape[0])
        out, lse = _sparse_ref64(q, kv[:, 0], idx, valid, sm_scale, case.kwargs.get("attn_sink"))
        got = dict(zip(case.checks, expected_outputs(case)))
    else:
        q, cache, indices, sm_scale = case.args
        b, s_q, h, d = q.shape
        idx = indices.reshape(b * s_q, -1).long()
        out, lse = _sparse_ref64(q.reshape(b * s_q, h, d), cache.reshape(-1, d), idx, idx >= 0, sm_scale)
        out, lse = out.view(b, s_q, h, 512), lse.view(b, s_q, h).transpose(1, 2)
        got = dict(zip(case.checks, expected_outputs(case)))
    for name, ref in (("out", out), ("lse", lse)):
        fin = torch.isfinite(ref)
        half_ulp = ref.abs().float().double() * 2.0**-24 * (1 + 1e-9) + 1e-40
        err = (got[name].double() - ref).abs()
        assert got[name].dtype == torch.float32 and bool((err[fin] <= half_ulp[fin]).all()), name
