"""The kernel oracle: every function against an independent computation written here.

Independent means: E4M3 codes found by nearest-value search over the 256-entry code table
(ties to the even code), bf16 by integer round-to-nearest-even on float32 bits, byte layouts
assembled with numpy, the Hadamard matrix from ``popcount(i & j)``, logits and attention as
float64 loops over heads / indices, top-k by ``sorted`` with the key ``(-score, index)``,
and the metrics from their formulas with ``math.fsum``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from formats import E4M3, bf16_bits, encode_e4m3
from glm_dsa import oracle

NEG_INF, POS_INF = float("-inf"), float("inf")
INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


# ----------------------------------------------------------------------------- helpers
def f32(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float32)


def ceil_pow2(s: float) -> float:
    m, e = math.frexp(s)
    return 2.0 ** (e - 1 if m == 0.5 else e)


# 1/448 rounded to float32 (PyTorch on CUDA: the double reciprocal of a CPU scalar divisor).
RECIP_448 = np.float32(1 / 448)


def quantize_block(x64: np.ndarray, ue8m0: bool, floor_on_scale: bool = False,
                   reciprocal: bool = False):
    """(codes, float32 scale) of one block: s = max(amax, 1e-4)/448 or its power-of-two ceil.

    ``amax / 448`` is the float32 product ``amax · fl32(1/448)``. ``floor_on_scale``: FlashMLA's
    ue8m0 floors ``amax / 448`` (not amax) at 1e-4. ``reciprocal``: the payload is
    ``x · fl32(1/s)`` (DeepGEMM's helpers), else the quotient ``x / s``.
    """
    amax = float(np.abs(x64).max())
    if floor_on_scale:
        s = float(f32(max(float(f32(amax) * RECIP_448), 1e-4)))
    else:
        s = float(f32(max(amax, 1e-4)) * RECIP_448)
    if ue8m0:
        s = ceil_pow2(s)
    if reciprocal:
        q = f32(x64) * (np.float32(1) / np.float32(s))  # float32 reciprocal, float32 product
    else:
        q = f32(x64 / s)  # the float32 quotient (IEEE: rounding the float64 quotient is the same)
    return encode_e4m3(np.clip(q.astype(np.float64), -448, 448)), np.float32(s)


def t_bytes(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def hadamard_matrix(n: int) -> np.ndarray:
    i = np.arange(n)
    parity = np.vectorize(lambda v: bin(v).count("1") & 1)(i[:, None] & i[None, :])
    return np.where(parity == 1, -1.0, 1.0)


def fp8_values(t: torch.Tensor) -> np.ndarray:
    return E4M3[t.view(torch.uint8).numpy().astype(np.int64)]


def index_k_pages_by_hand(codes: np.ndarray, scales: np.ndarray, block_size: int) -> np.ndarray:
    """uint8 [num_blocks, block_size * (D + 4)]: codes [n, D] then float32 scales [n] per block."""
    n, d = codes.shape
    nb = n // block_size
    out = np.zeros((nb, block_size * (d + 4)), dtype=np.uint8)
    for b in range(nb):
        for t in range(block_size):
            out[b, t * d : (t + 1) * d] = codes[b * block_size + t]
            at = block_size * d + 4 * t
            out[b, at : at + 4] = np.frombuffer(np.float32(scales[b * block_size + t]).tobytes(), np.uint8)
    return out


def logits_loop64(q_vals, k_vals, k_scale, weights, visible) -> np.ndarray:
    """float64 Σ_h w[m, h] · relu(q[m, h] · k[n]) · k_scale[n]; -inf where not visible[m, n]."""
    S, H, _ = q_vals.shape
    out = np.zeros((S, k_vals.shape[0]))
    for h in range(H):
        out += weights[:, h, None] * np.maximum(q_vals[:, h] @ k_vals.T, 0.0)
    out *= k_scale[None, :]
    return np.where(visible, out, NEG_INF)


def mla_rows_by_hand(raw: np.ndarray) -> np.ndarray:
    """float64 [n, 576] latent values of 656-byte rows: e4m3 × tile scale (float32), bf16 RoPE."""
    n = raw.shape[0]
    codes = raw[:, :512].astype(np.int64)
    scales = raw[:, 512:528].copy().view(np.float32)  # [n, 4]
    nope = f32(E4M3[codes]) * np.repeat(scales, 128, axis=1)  # float32 product, one rounding
    rope = (raw[:, 528:656].copy().view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    return np.concatenate([nope.astype(np.float64), rope.astype(np.float64)], axis=1).reshape(n, 576)


def attend64(q, keys, valid, sm_scale, d_v, sink=None):
    """float64 sparse attention of one query row [h, d] over keys [t, d] where valid [t]."""
    h = q.shape[0]
    if not valid.any():
        return np.zeros((h, d_v)), np.full(h, NEG_INF), np.full(h, NEG_INF)
    kk = keys[valid]
    p = (q @ kk.T) * sm_scale  # [h, t]
    mx = p.max(axis=1)
    lse = mx + np.log(np.exp(p - mx[:, None]).sum(axis=1))
    norm = lse if sink is None else np.logaddexp(lse, sink)
    out = np.exp(p - norm[:, None]) @ kk[:, :d_v]
    return out, mx, lse


# ----------------------------------------------------------------------------- hadamard
@given(d=st.sampled_from([1, 2, 8, 64, 128, 3, 80, 100]), scale=st.sampled_from([1.0, 0.125]),
       seed=st.integers(0, 2**31 - 1))
def test_hadamard_transform_equals_sylvester_matrix_on_the_zero_padded_vector(d, scale, seed):
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    n = 1 << (d - 1).bit_length()
    padded = np.concatenate([x.numpy(), np.zeros((3, n - d))], axis=1)
    expected = (padded @ hadamard_matrix(n).T * scale)[:, :d]
    got = oracle.hadamard_transform(x, scale)
    assert got.dtype == torch.float64 and got.shape == (3, d)
    np.testing.assert_allclose(got.numpy(), expected, rtol=0, atol=1e-12 * max(1, d))


def test_hadamard_transform_of_bf16_is_within_one_bf16_rounding_of_the_exact_result():
    x = torch.randn(4, 32, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    got = oracle.hadamard_transform(x, 128**-0.5)
    exact = x.double().numpy() @ hadamard_matrix(128).T * 128**-0.5
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    err = np.abs(got.double().numpy() - exact)
    assert (err <= 2.0**-8 * np.abs(exact) + 1e-6).all()


# ----------------------------------------------------------------------------- act_quant
@given(rows=st.integers(1, 6), blocks=st.integers(1, 3), scale_fmt=st.sampled_from([None, "ue8m0"]),
       magnitude=st.sampled_from([1e-7, 1.0, 300.0]), seed=st.integers(0, 2**31 - 1))
def test_act_quant_equals_a_blockwise_loop_bit_for_bit(rows, blocks, scale_fmt, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 128 * blocks, generator=g) * magnitude).to(torch.bfloat16)
    x_fp8, scale = oracle.act_quant(x, 128, scale_fmt)
    xs = x.double().numpy()
    for r in range(rows):
        for b in range(blocks):
            codes, s = quantize_block(xs[r, 128 * b : 128 * (b + 1)], scale_fmt == "ue8m0")
            assert np.array_equal(t_bytes(x_fp8[r, 128 * b : 128 * (b + 1)]), codes)
            assert scale[r, b].item() == s


# ----------------------------------------------------------------------------- index-K cache
@pytest.mark.parametrize("block_size", [64, 32])
def test_kv_cache_cast_to_fp8_bytes_equal_the_deepgemm_layout_assembled_by_hand(block_size):
    g = torch.Generator().manual_seed(block_size)
    k = torch.randn(3, block_size, 1, 128, generator=g)
    k[1, 4] = 0.0  # the 1e-4 amax floor
    k = k.to(torch.bfloat16)
    got = oracle.kv_cache_cast_to_fp8(k)
    assert got.dtype == torch.uint8 and got.shape == (3, block_size, 1, 132)
    flat = k.double().numpy().reshape(-1, 128)
    blocks = [quantize_block(row, ue8m0=False, reciprocal=True) for row in flat]
    expected = index_k_pages_by_hand(np.stack([c for c, _ in blocks]),
                                     np.array([s for _, s in blocks]), block_size)
    assert np.array_equal(got.numpy().reshape(3, -1), expected)


# ---------------------------------------------- the CUDA arithmetic, emulated in numpy float32
# PyTorch on CUDA computes ``t / 448.0`` as ``t * fl32(1/448)`` (BinaryDivTrueKernel.cu: a CPU
# scalar divisor becomes its reciprocal); tensor-by-tensor division and ``reciprocal`` are IEEE.
# numpy's float32 operations are IEEE on every host, so these are the bytes CUDA writes. The last
# step, one float32 value to e4m3, is torch's cast here (checked against the e4m3 table by
# test_fp8; the arithmetic before it is what differs between devices): the table search over
# 13M values would take seconds.
NUM_KEYS = 102_400  # 1,600 pages of 64


def many_keys(n: int, d: int, seed: int) -> torch.Tensor:
    """bf16 [n, d]: normal rows, each scaled by 10**u, u uniform in [-4, 4)."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (8 * torch.rand(n, 1, generator=g) - 4)
    return (torch.randn(n, d, generator=g) * mag).to(torch.bfloat16)


def ceil_pow2_bits(s: np.ndarray) -> np.ndarray:
    """Smallest power of two ≥ positive normal float32 s, from its bits (DeepGEMM's ceil_to_ue8m0)."""
    bits = s.view(np.uint32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)
    return (exponent.astype(np.uint32) << 23).view(np.float32)


def cuda_cast(x: np.ndarray, ue8m0: bool, reciprocal: bool, floor_on_scale: bool = False):
    """(codes [n, 128] uint8, scales [n] float32) of float32 blocks x [n, 128], as CUDA rounds."""
    amax = np.abs(x).max(axis=1)
    if floor_on_scale:
        s = np.maximum(amax * RECIP_448, np.float32(1e-4))
    else:
        s = np.maximum(amax, np.float32(1e-4)) * RECIP_448
    if ue8m0:
        s = ceil_pow2_bits(s)
    q = x * (np.float32(1) / s)[:, None] if reciprocal else x / s[:, None]
    assert q.dtype == np.float32
    return torch.from_numpy(np.clip(q, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy(), s


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_act_quant_bytes_equal_the_cuda_arithmetic_on_100k_keys(scale_fmt):
    k = many_keys(NUM_KEYS, 128, seed=1)
    x_fp8, scale = oracle.act_quant(k, 128, scale_fmt)
    codes, s = cuda_cast(k.float().numpy(), scale_fmt == "ue8m0", reciprocal=False)
    assert np.array_equal(scale.numpy().reshape(-1).view(np.uint32), s.view(np.uint32))
    assert np.array_equal(t_bytes(x_fp8), codes)


def test_kv_cache_cast_to_fp8_equals_deepgemms_helper_as_run_on_cuda_on_100k_keys():
    # DeepGEMM tests/test_attention.py: sf = amax.clamp(1e-4) / 448.0; x * (1.0 / sf).
    k = many_keys(NUM_KEYS, 128, seed=2)
    got = oracle.kv_cache_cast_to_fp8(k.view(-1, 64, 1, 128)).numpy().reshape(-1, 64 * 132)
    codes, s = cuda_cast(k.float().numpy(), ue8m0=False, reciprocal=True)
    assert np.array_equal(got[:, 64 * 128 :].reshape(-1).view(np.float32).view(np.uint32),
                          s.view(np.uint32))
    assert np.array_equal(got[:, : 64 * 128].reshape(-1, 128), codes)
    # The division act_quant takes instead rounds the same but for a handful of bytes.
    divided, _ = cuda_cast(k.float().numpy(), ue8m0=False, reciprocal=False)
    assert (divided != codes).mean() < 1e-6


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_quantize_k_cache_bytes_equal_the_cuda_arithmetic_on_100k_tiles(scale_fmt):
    # FlashMLA tests/quant.py: amax.float() / 448.0, ue8m0 ceiling of max(that, 1e-4); x / s.
    kv = many_keys(NUM_KEYS // 4, 576, seed=3).view(-1, 64, 1, 576)
    got = oracle.quantize_k_cache(kv, scale_fmt).numpy().reshape(-1, 656)
    ue8m0 = scale_fmt == "ue8m0"
    tiles = kv.float().numpy().reshape(-1, 576)[:, :512].reshape(-1, 128)
    codes, s = cuda_cast(tiles, ue8m0, reciprocal=False, floor_on_scale=ue8m0)
    assert np.array_equal(got[:, 512:528].copy().view(np.uint32).reshape(-1), s.view(np.uint32))
    assert np.array_equal(got[:, :512].reshape(-1, 128), codes)


# ----------------------------------------------------------------------------- logits
def _ragged(requests):
    ks, ke, off = [], [], 0
    for prefix, extend in requests:
        for i in range(extend):
            ks.append(off)
            ke.append(off + prefix + i + 1)
        off += prefix + extend
    return torch.tensor(ks, dtype=torch.int32), torch.tensor(ke, dtype=torch.int32), off


def _logits_inputs(seed, S, H, S_kv):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, 128, generator=g).to(torch.float8_e4m3fn)
    k_fp8, k_scale = oracle.act_quant(torch.randn(S_kv, 128, generator=g) * 2, 128)
    return q, k_fp8, k_scale[:, 0], torch.randn(S, H, generator=g)


requests_st = st.lists(st.tuples(st.integers(0, 80), st.integers(1, 20)), min_size=1, max_size=3)


@given(requests=requests_st, H=st.sampled_from([4, 32]), seed=st.integers(0, 2**31 - 1))
def test_fp8_mqa_logits_equals_a_float64_loop_with_an_exact_inf_mask(requests, H, seed):
    ks, ke, S_kv = _ragged(requests)
    q, k_fp8, k_scale, w = _logits_inputs(seed, ks.shape[0], H, S_kv)
    col = np.arange(S_kv)
    visible = (col[None, :] >= ks.numpy()[:, None]) & (col[None, :] < ke.numpy()[:, None])
    expected = logits_loop64(fp8_values(q), fp8_values(k_fp8), k_scale.double().numpy(),
                             w.double().numpy(), visible)
    got = oracle.fp8_mqa_logits(q, (k_fp8, k_scale), w, ks, ke)
    assert got.dtype == torch.float32 and got.shape == (ks.shape[0], S_kv)
    assert np.array_equal(np.isneginf(got.numpy()), ~visible)
    np.testing.assert_allclose(got.numpy()[visible], expected[visible], rtol=2e-5, atol=1e-5)

    uncleaned = oracle.fp8_mqa_logits(q, (k_fp8, k_scale), w, ks, ke, clean_logits=False)
    assert torch.equal(uncleaned[torch.from_numpy(visible)], got[torch.from_numpy(visible)])
    assert bool(torch.isfinite(uncleaned).all())


@given(requests=requests_st, seed=st.integers(0, 2**31 - 1), extra=st.integers(0, 5))
def test_fp8_mqa_logits_compressed_entry_i_j_is_key_ks_plus_j(requests, seed, extra):
    ks, ke, S_kv = _ragged(requests)
    q, k_fp8, k_scale, w = _logits_inputs(seed, ks.shape[0], 4, S_kv)
    width = int((ke - ks).max()) + extra
    got = oracle.fp8_mqa_logits(q, (k_fp8, k_scale), w, ks, ke, False, max_seqlen_k=width)
    full = logits_loop64(fp8_values(q), fp8_values(k_fp8), k_scale.double().numpy(),
                         w.double().numpy(), np.ones((ks.shape[0], S_kv), dtype=bool))
    assert got.shape == (ks.shape[0], width)
    for i in range(ks.shape[0]):
        n = int(ke[i] - ks[i])
        np.testing.assert_allclose(got[i, :n].numpy(), full[i, int(ks[i]) : int(ke[i])],
                                   rtol=2e-5, atol=1e-5)
        assert bool(torch.isneginf(got[i, n:]).all())


def test_fp8_mqa_logits_compressed_mode_follows_upstream_preconditions():
    ks, ke, S_kv = _ragged([(10, 5)])
    q, k_fp8, k_scale, w = _logits_inputs(0, 5, 4, S_kv)
    with pytest.raises(ValueError, match="requires clean_logits=False"):
        oracle.fp8_mqa_logits(q, (k_fp8, k_scale), w, ks, ke, True, max_seqlen_k=15)
    with pytest.raises(ValueError, match="more than max_seqlen_k=14"):
        oracle.fp8_mqa_logits(q, (k_fp8, k_scale), w, ks, ke, False, max_seqlen_k=14)
    with pytest.raises(ValueError, match="kv must be the pair"):
        oracle.fp8_mqa_logits(q, k_fp8, w, ks, ke)


@pytest.mark.parametrize("block_size", [64, 32])
@pytest.mark.parametrize("next_n, lens", [
    (1, [1, 70, 130]),
    (2, [2, 64, 100]),
    (2, [[65, 66], [3, 129], [0, 1]]),
])
def test_fp8_paged_mqa_logits_equals_a_float64_loop_over_the_block_table(block_size, next_n, lens):
    g = torch.Generator().manual_seed(block_size + next_n)
    B, H, D = len(lens), 8, 128
    two_d = isinstance(lens[0], list)
    longest = [max(n) if two_d else n for n in lens]
    blocks = [-(-n // block_size) for n in longest]
    num_blocks = sum(blocks) + 2
    # The cache, assembled by hand from e4m3 codes and float32 scales.
    codes = encode_e4m3(np.clip(torch.randn(num_blocks * block_size, D, generator=g).numpy() * 100,
                               -448, 448))
    scales = np.abs(torch.randn(num_blocks * block_size, generator=g).numpy()).astype(np.float32)
    pages = index_k_pages_by_hand(codes, scales, block_size)
    # A block stride larger than the block, as upstream allows.
    padded = torch.zeros(num_blocks, block_size + 1, 1, D + 4, dtype=torch.uint8)
    padded[:, :block_size] = torch.from_numpy(pages).view(num_blocks, block_size, 1, D + 4)
    kv_cache = padded[:, :block_size]
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = np.zeros((B, max(blocks)), dtype=np.int32)
    used = 0
    for b, n in enumerate(blocks):
        table[b, :n] = perm[used : used + n]
        used += n
    q = torch.randn(B, next_n, H, D, generator=g).to(torch.float8_e4m3fn)
    w = torch.randn(B * next_n, H, generator=g)
    max_len = max(longest) + 7
    got = oracle.fp8_paged_mqa_logits(q, kv_cache, w, torch.tensor(lens, dtype=torch.int32),
                                      torch.from_numpy(table), max_len)
    assert got.shape == (B * next_n, max_len) and got.dtype == torch.float32
    k_vals, q_vals = E4M3[codes.astype(np.int64)], fp8_values(q)
    pos = np.arange(max_len)
    for b in range(B):
        slots = np.array([table[b, p // block_size] * block_size + p % block_size
                          for p in range(min(max_len, len(table[b]) * block_size))])
        for j in range(next_n):
            row = b * next_n + j
            sees = pos < lens[b][j] if two_d else pos <= lens[b] - next_n + j
            expected = np.full(max_len, NEG_INF)
            for p in np.nonzero(sees)[0]:
                s = slots[p]
                expected[p] = scales[s] * sum(
                    w[row, h].item() * max(float(q_vals[b, j, h] @ k_vals[s]), 0.0)
                    for h in range(H))
            assert np.array_equal(np.isneginf(got[row].numpy()), ~sees)
            np.testing.assert_allclose(got[row].numpy()[sees], expected[sees], rtol=2e-5, atol=1e-4)


# ----------------------------------------------------------------------------- top-k
def canonical_topk(logits, starts, ends, topk, base, pad):
    rows = []
    for m in range(logits.shape[0]):
        s, e = int(starts[m]), int(ends[m])
        if e - s <= topk:
            chosen = list(range(s, e))
        else:
            vals = logits[m].tolist()
            chosen = sorted(range(s, e), key=lambda j: (-vals[j], j))[:topk]
        if base == "relative":
            chosen = [j - s for j in chosen]
        rows.append(chosen + [pad] * (topk - len(chosen)))
    return rows


@given(
    data=st.data(),
    R=st.integers(1, 6),
    N=st.integers(1, 90),
    topk=st.integers(1, 40),
    levels=st.sampled_from([3, 1000]),
    convention=st.sampled_from([("relative", -1), ("absolute", 0), ("absolute", -7)]),
    seed=st.integers(0, 2**31 - 1),
)
def test_topk_per_row_equals_sorted_by_score_then_index(data, R, N, topk, levels, convention, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(0, levels, (R, N), generator=g).float() / 7  # ties when levels=3
    starts, ends = [], []
    for _ in range(R):
        s = data.draw(st.integers(0, N))
        starts.append(s)
        ends.append(data.draw(st.integers(s, N)))
    starts, ends = torch.tensor(starts, dtype=torch.int32), torch.tensor(ends, dtype=torch.int32)
    col = torch.arange(N)
    outside = (col < starts[:, None]) | (col >= ends[:, None])
    logits = logits.masked_fill(outside, float("nan"))  # never read
    base, pad = convention
    got = oracle.topk_per_row(logits, starts, ends, topk, base, pad)
    assert got.dtype == torch.int32 and got.shape == (R, topk)
    assert got.tolist() == canonical_topk(logits, starts, ends, topk, base, pad)


def test_topk_per_row_rejects_unknown_conventions():
    z = torch.zeros(1, 4)
    r0, r1 = torch.zeros(1, dtype=torch.int32), torch.full((1,), 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="base="):
        oracle.topk_per_row(z, r0, r1, 2, base="ragged")
    with pytest.raises(ValueError, match="pad="):
        oracle.topk_per_row(z, r0, r1, 2, pad=0.5)


def test_topk_transforms_equal_explicit_loops_and_keep_minus_one():
    g = torch.Generator().manual_seed(3)
    lens, topk = [70, 3, 130, 0], 8
    rows = [torch.randperm(n, generator=g)[: min(n, topk)].tolist() for n in lens]
    indices = torch.tensor([r + [-1] * (topk - len(r)) for r in rows], dtype=torch.int32)
    offsets = torch.tensor([0, 70, 73, 203], dtype=torch.int32)
    ragged = oracle.topk_transform_ragged(indices, offsets)
    assert ragged.tolist() == [[v + int(offsets[r]) if v >= 0 else -1 for v in row]
                               for r, row in enumerate(indices.tolist())]
    for page_size in (64, 1):
        pages = -(-max(lens) // page_size)
        table = torch.randperm(len(lens) * pages + 3, generator=g)[: len(lens) * pages]
        table = table.view(len(lens), pages).to(torch.int32)
        paged = oracle.topk_transform_paged(indices, table, page_size)
        assert paged.dtype == torch.int32
        assert paged.tolist() == [
            [int(table[r, v // page_size]) * page_size + v % page_size if v >= 0 else -1 for v in row]
            for r, row in enumerate(indices.tolist())
        ]


# ----------------------------------------------------------------------------- MLA cache
def _latent(seed: int, num_blocks: int, block_size: int = 64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, block_size, 1, 576, generator=g)
    kv *= torch.exp(2 * torch.randn(num_blocks, block_size, 1, 1, generator=g))
    kv[0, 1] = 0.0
    kv[0, 2, 0, :128] *= 1e-9  # a tile below the 1e-4 scale floor
    return kv.to(torch.bfloat16)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_quantize_k_cache_bytes_equal_the_656_byte_layout_assembled_by_hand(scale_fmt):
    kv = _latent(11, 2)
    got = oracle.quantize_k_cache(kv, scale_fmt)
    assert got.dtype == torch.uint8 and got.shape == (2, 64, 1, 656)
    x = kv.double().numpy().reshape(-1, 576)
    expected = np.zeros((x.shape[0], 656), dtype=np.uint8)
    for n, row in enumerate(x):
        for tile in range(4):
            chunk = row[128 * tile : 128 * (tile + 1)]
            codes, s = quantize_block(chunk, scale_fmt == "ue8m0", floor_on_scale=scale_fmt == "ue8m0")
            expected[n, 128 * tile : 128 * (tile + 1)] = codes
            expected[n, 512 + 4 * tile : 516 + 4 * tile] = np.frombuffer(s.tobytes(), np.uint8)
        expected[n, 528:] = bf16_bits(f32(row[512:])).view(np.uint8)
    assert np.array_equal(got.numpy().reshape(-1, 656), expected)


def test_quantize_k_cache_needs_bf16_for_the_656_byte_layout():
    with pytest.raises(ValueError, match="bfloat16"):
        oracle.quantize_k_cache(torch.zeros(1, 64, 1, 576))
    with pytest.raises(ValueError, match="576"):
        oracle.quantize_k_cache(torch.zeros(1, 64, 1, 512, dtype=torch.bfloat16))


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn])
def test_dequantize_k_cache_is_e4m3_times_scale_rounded_once_to_bf16(scale_fmt, dtype):
    k_cache = oracle.quantize_k_cache(_latent(12, 2), scale_fmt)
    raw = k_cache.numpy().reshape(-1, 656)
    got = oracle.dequantize_k_cache(k_cache.view(dtype))
    assert got.dtype == torch.bfloat16 and got.shape == (2, 64, 1, 576)
    expected = bf16_bits(f32(mla_rows_by_hand(raw)))
    assert np.array_equal(got.view(torch.int16).numpy().reshape(-1, 576).view(np.uint16), expected)


# ----------------------------------------------------------------------------- sparse MLA
@given(
    s_q=st.integers(1, 4),
    s_kv=st.integers(1, 40),
    topk=st.integers(1, 24),
    with_sink=st.booleans(),
    with_length=st.booleans(),
    convention=st.sampled_from([("e", "+inf"), ("2", "-inf"), ("2", "+inf")]),
    seed=st.integers(0, 2**31 - 1),
)
def test_flash_mla_sparse_fwd_equals_a_float64_loop(s_q, s_kv, topk, with_sink, with_length,
                                                    convention, seed):
    g = torch.Generator().manual_seed(seed)
    h, d_qk, d_v = 3, 24, 16
    q = torch.randn(s_q, h, d_qk, generator=g, dtype=torch.float64)
    kv = torch.randn(s_kv, 1, d_qk, generator=g, dtype=torch.float64)
    pool = torch.tensor([INT32_MIN, -123456, -1, s_kv, s_kv + 9, INT32_MAX] + list(range(s_kv)))
    indices = pool[torch.randint(0, len(pool), (s_q, 1, topk), generator=g)].to(torch.int32)
    indices[0, 0, :] = -1  # a lonely row
    sink = torch.randn(h, generator=g, dtype=torch.float64) if with_sink else None
    length = torch.randint(0, topk + 1, (s_q,), generator=g).to(torch.int32) if with_length else None
    sm_scale = 0.3
    out, mx, lse = oracle.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, sink, length, *convention)
    base, lonely = convention
    to_base = 1 / math.log(2) if base == "2" else 1.0
    for r in range(s_q):
        idx = indices[r, 0].numpy().astype(np.int64)
        valid = (idx >= 0) & (idx < s_kv)
        if length is not None:
            valid &= np.arange(topk) < int(length[r])
        keys = kv[np.clip(idx, 0, s_kv - 1), 0].numpy()
        e_out, e_mx, e_lse = attend64(q[r].numpy(), keys, valid, sm_scale, d_v,
                                      None if sink is None else sink.numpy())
        if not valid.any():
            assert bool((out[r] == 0).all())
            assert bool(torch.isneginf(mx[r]).all())
            assert bool((lse[r] == (POS_INF if lonely == "+inf" else NEG_INF)).all())
            continue
        np.testing.assert_allclose(out[r].numpy(), e_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(mx[r].numpy(), e_mx * to_base, rtol=1e-12)
        np.testing.assert_allclose(lse[r].numpy(), e_lse * to_base, rtol=1e-12)


def test_flash_mla_sparse_fwd_on_bf16_returns_float32_outputs_of_upstream_shapes():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 64, 576, generator=g).to(torch.bfloat16)
    kv = torch.randn(130, 1, 576, generator=g).to(torch.bfloat16)
    indices = torch.randperm(130, generator=g)[:128].view(1, 1, 128).expand(2, 1, 128).to(torch.int32)
    out, mx, lse = oracle.flash_mla_sparse_fwd(q, kv, indices.contiguous(), 1 / 16)
    assert (out.shape, mx.shape, lse.shape) == ((2, 64, 512), (2, 64), (2, 64))
    assert out.dtype == mx.dtype == lse.dtype == torch.float32


def peak_cpu_bytes(fn) -> int:
    """Largest total of live CPU allocations made while ``fn`` runs, from the profiler's
    allocation events (each ``[memory]`` event is one allocation, > 0, or free, < 0)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                profile_memory=True) as prof:
        fn()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events()
                    if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def _sparse_case(s_q: int, h: int, s_kv: int, topk: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s_q, h, 576, generator=g)
    kv = torch.randn(s_kv, 1, 576, generator=g)
    indices = torch.randint(-8, s_kv + 8, (s_q, 1, topk), generator=g).to(torch.int32)
    return q, kv, indices


def test_flash_mla_sparse_fwd_is_bitwise_independent_of_its_budget():
    q, kv, indices = _sparse_case(37, 4, 300, 96, seed=3)
    whole = oracle.flash_mla_sparse_fwd(q, kv, indices, 0.1)
    assert whole[0].shape == (37, 4, 512)
    for budget in (1, 3 * 96 * 576 * 8, 10 << 20, None):
        chunked = oracle.flash_mla_sparse_fwd(q, kv, indices, 0.1, budget_bytes=budget)
        for a, b in zip(chunked, whole):
            assert torch.equal(a, b), f"budget_bytes={budget}"


def test_flash_mla_sparse_fwd_peak_memory_is_its_outputs_plus_the_budget():
    # 2 heads, top-16: one 16-row tile's temporaries (about 1.6 MB) fit the 2 MiB budget.
    s_q, h = 1024, 2
    q, kv, indices = _sparse_case(s_q, h, 512, 16)
    outputs = s_q * h * (512 + 2) * 4  # out, max_logits, lse in float32
    budget = 2 << 20
    peak = peak_cpu_bytes(lambda: oracle.flash_mla_sparse_fwd(q, kv, indices, 0.1, budget_bytes=budget))
    assert peak <= outputs + budget, f"peak {peak / 2**20:.1f} MiB"
    print(f"\npeak {peak / 2**20:.2f} MiB for outputs {outputs / 2**20:.2f} MiB + budget 2 MiB")
    # One chunk holds all rows' gathered keys alone: 1024 × 16 × 576 float32 = 36 MiB.
    unbounded = peak_cpu_bytes(lambda: oracle.flash_mla_sparse_fwd(q, kv, indices, 0.1, budget_bytes=None))
    assert unbounded > outputs + 8 * budget


def test_flash_mla_sparse_fwd_below_one_tile_of_budget_holds_one_tile():
    # The smallest chunk is one 16-row tile (the products' fixed call shape): a 1-byte budget
    # peaks at the outputs plus that tile's temporaries, not at a larger chunk's.
    s_q, h, topk = 128, 16, 128
    q, kv, indices = _sparse_case(s_q, h, 512, topk)
    outputs = s_q * h * (512 + 2) * 4
    tile = 16 * (topk * 576 * 8 + 3 * h * topk * 4 + h * topk * 10 + 3 * topk * 8
                 + h * (2 * 576 + 512) * 4 + h * 576 * 10)
    peak = peak_cpu_bytes(lambda: oracle.flash_mla_sparse_fwd(q, kv, indices, 0.1, budget_bytes=1))
    assert peak <= outputs + tile, f"peak {peak / 2**20:.1f} MiB, one tile {tile / 2**20:.1f} MiB"
    unbounded = peak_cpu_bytes(lambda: oracle.flash_mla_sparse_fwd(q, kv, indices, 0.1, budget_bytes=None))
    assert unbounded > outputs + 2 * tile


@pytest.mark.cuda
def test_flash_mla_sparse_fwd_at_glm_shapes_on_cuda_stays_within_the_default_budget():
    # Issue 22: 32,768 rows × top-2048 × 64 heads in one chunk peaked at 145 GB.
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    s_q, s_kv, topk = 8192, 131_072, 2048
    q = (torch.randn(s_q, 64, 576, generator=g, device=dev) / 10).bfloat16()
    kv = (torch.randn(s_kv, 1, 576, generator=g, device=dev) / 10).bfloat16()
    indices = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, device=dev, dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, mx, lse = oracle.flash_mla_sparse_fwd(q, kv, indices, 1 / 16)
    torch.cuda.synchronize()
    outputs = sum(t.numel() * t.element_size() for t in (out, mx, lse))
    extra = torch.cuda.max_memory_allocated() - base - outputs
    assert extra <= oracle.SPARSE_BUDGET_BYTES, f"peak extra {extra / 2**20:.0f} MiB"


@pytest.mark.parametrize("with_sink, with_length", [(False, False), (True, True)])
def test_flash_mla_sparse_decode_equals_a_float64_loop_on_the_dequantized_cache(with_sink, with_length):
    g = torch.Generator().manual_seed(5)
    b, s_q, h, topk, num_blocks = 2, 2, 4, 16, 3
    k_cache = oracle.quantize_k_cache(_latent(6, num_blocks))
    q = torch.randn(b, s_q, h, 576, generator=g, dtype=torch.float64)
    slots = torch.stack([torch.randperm(num_blocks * 64, generator=g)[:topk]
                         for _ in range(b * s_q)]).view(b, s_q, topk)
    slots[0, 1, 5:] = -1
    slots[1, 0] = -1  # lonely
    indices = slots.to(torch.int32)
    sink = torch.randn(h, generator=g) if with_sink else None
    length = torch.tensor([topk, 6], dtype=torch.int32) if with_length else None
    sm_scale = 1 / 16
    out, lse = oracle.flash_mla_sparse_decode(q, k_cache, indices, sm_scale, 512, length, sink)
    assert out.shape == (b, s_q, h, 512) and lse.shape == (b, h, s_q)
    # The bf16 values of the dequantized cache, by hand.
    cache = bf16_bits(f32(mla_rows_by_hand(k_cache.numpy().reshape(-1, 656))))
    cache = (cache.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    for bi in range(b):
        for si in range(s_q):
            idx = indices[bi, si].numpy().astype(np.int64)
            valid = idx != -1
            if length is not None:
                valid &= np.arange(topk) < int(length[bi])
            e_out, _, e_lse = attend64(q[bi, si].numpy(), cache[np.clip(idx, 0, None)], valid,
                                       sm_scale, 512, None if sink is None else sink.double().numpy())
            if not valid.any():
                assert bool((out[bi, si] == 0).all()) and bool((lse[bi, :, si] == POS_INF).all())
                continue
            np.testing.assert_allclose(out[bi, si].numpy(), e_out, rtol=1e-10, atol=1e-12)
            np.testing.assert_allclose(lse[bi, :, si].numpy(), e_lse, rtol=1e-12)


def test_flash_mla_sparse_decode_treats_only_minus_one_as_invalid():
    k_cache = oracle.quantize_k_cache(_latent(8, 1))
    q = torch.randn(1, 1, 2, 576, dtype=torch.float64)
    for bad in (-2, 64, INT32_MAX):
        with pytest.raises(ValueError, match="neither -1 nor a slot"):
            oracle.flash_mla_sparse_decode(q, k_cache, torch.tensor([[[3, bad]]], dtype=torch.int32), 0.1)
    # Entries past topk_length are not read, whatever they hold.
    cut = oracle.flash_mla_sparse_decode(q, k_cache, torch.tensor([[[3, 9, INT32_MAX]]], dtype=torch.int32),
                                         0.1, topk_length=torch.tensor([2], dtype=torch.int32))
    full = oracle.flash_mla_sparse_decode(q, k_cache, torch.tensor([[[3, 9]]], dtype=torch.int32), 0.1)
    assert torch.equal(cut[0], full[0]) and torch.equal(cut[1], full[1])


# ----------------------------------------------------------------------------- metrics
@given(n=st.integers(1, 50), seed=st.integers(0, 2**31 - 1), noise=st.sampled_from([0.0, 1e-3, 1.0]))
def test_calc_diff_is_one_minus_twice_the_dot_over_the_sum_of_squares(n, seed, noise):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    y = (x + noise * torch.randn(n, generator=g)).to(torch.bfloat16)
    xs, ys = x.double().tolist(), y.double().tolist()
    expected = 1 - 2 * math.fsum(a * b for a, b in zip(xs, ys)) / math.fsum(a * a + b * b for a, b in zip(xs, ys))
    assert oracle.calc_diff(x, y) == pytest.approx(expected, abs=1e-15)


def test_calc_diff_edge_cases():
    x = torch.randn(7)
    assert oracle.calc_diff(x, x) == pytest.approx(0.0, abs=1e-16)
    assert oracle.calc_diff(torch.zeros(3), torch.zeros(3)) == 0.0
    with pytest.raises(ValueError, match="zero the masked"):
        oracle.calc_diff(torch.tensor([1.0, NEG_INF]), torch.tensor([1.0, NEG_INF]))
    with pytest.raises(ValueError, match="shapes differ"):
        oracle.calc_diff(torch.zeros(3), torch.zeros(4))


def test_check_allclose_passes_an_element_within_either_tolerance_and_fails_one_outside_both():
    ref = torch.tensor([[1.0, 100.0], [1e-7, -2.0]])
    ok = torch.tensor([[1.0 + 5e-4, 100.5], [3e-4, -2.0]])  # abs, rel, abs, exact
    r = oracle.check_allclose(ok, ref, abs_tol=8e-4, rel_tol=0.01, cos_diff_tol=1e-3)
    assert r.passed and r.num_failed == 0 and r.anomaly is None and r.first_failure is None
    assert r.max_abs_err == pytest.approx(0.5)
    assert r.max_rel_err == pytest.approx(3e-4 / (1e-7 + 1e-6) - 1e-7 / (1e-7 + 1e-6))
    bad = ok.clone()
    bad[1, 1] = -2.1  # abs 0.1 and rel 0.05: outside both
    r = oracle.check_allclose(bad, ref, abs_tol=8e-4, rel_tol=0.01, cos_diff_tol=1e-3)
    assert not r.passed and r.num_failed == 1 and r.first_failure == (1, 1)


def test_check_allclose_requires_inf_and_nan_at_the_same_positions():
    ref = torch.tensor([1.0, POS_INF, NEG_INF, float("nan")])
    r = oracle.check_allclose(ref.clone(), ref, 1e-6, 1e-6, 1e-7)
    assert r.passed and r.cos_diff == 0.0
    swapped = torch.tensor([1.0, NEG_INF, NEG_INF, float("nan")])
    r = oracle.check_allclose(swapped, ref, 1e-6, 1e-6, 1e-7)
    assert not r.passed and r.anomaly.startswith("+inf") and r.first_failure == (1,)


def test_check_allclose_cos_diff_is_the_formula_and_can_fail_alone():
    g = torch.Generator().manual_seed(2)
    ref = torch.randn(1000, generator=g, dtype=torch.float64)
    ans = ref * 1.01
    expected = 1 - 2 * math.fsum((ans * ref).tolist()) / math.fsum((ans * ans + ref * ref).tolist())
    r = oracle.check_allclose(ans, ref, abs_tol=1.0, rel_tol=1.0, cos_diff_tol=1e-9)
    assert r.cos_diff == pytest.approx(expected, rel=1e-9) and r.num_failed == 0 and not r.passed
    r = oracle.check_allclose(torch.full((3,), 1e-8), torch.zeros(3), 1e-6, 0.0, 0.0)
    assert r.passed and r.cos_diff == 0.0  # a (nearly) zero reference has cos_diff 0


def test_check_allclose_worst_element_is_the_value_that_decides_each_element():
    """worst_element < 1 iff no element fails; it is max over elements of min(abs_err / abs_tol,
    rel_err / rel_tol), here from a plain loop (the largest rel err sits at a small ref and
    passes by its abs err, so it decides nothing)."""
    ref = torch.tensor([1.0, 1e-3, 2.0, -4.0], dtype=torch.float64)
    ans = ref + torch.tensor([5e-4, 5e-4, 1e-2, 0.0], dtype=torch.float64)
    abs_tol, rel_tol = 1e-3, 1e-2
    worst = max(min(abs(a - r) / abs_tol, abs(a - r) / (abs(r) + 1e-6) / rel_tol)
                for a, r in zip(ans.tolist(), ref.tolist()))
    res = oracle.check_allclose(ans, ref, abs_tol, rel_tol, 1.0)
    assert res.worst_element == pytest.approx(worst, rel=1e-12)
    assert worst == pytest.approx(0.5)  # element 2: rel 0.005 / 0.01; element 1's rel err 0.5 passes on abs
    assert res.max_rel_err > rel_tol and res.num_failed == 0 and res.passed
    tight = oracle.check_allclose(ans, ref, abs_tol, 4e-3, 1.0)
    assert tight.worst_element == pytest.approx(1.25) and tight.num_failed == 1
