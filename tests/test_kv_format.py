"""KV-cache byte layouts against bytes assembled here with numpy / struct.

Index-K page (docs/conventions.md §4): ``[page_size × head_dim e4m3][page_size × float32 scale]``.
FlashMLA V32_FP8Sparse row (docs/conventions.md §6): ``[512 e4m3][4 × float32][64 × bf16]``.
"""

import math
import struct

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from formats import E4M3, bf16_bits, encode_e4m3, f32, smallest_pow2_at_least
from glm_dsa.kv_format import (
    index_k_load,
    index_k_page_bytes,
    index_k_store,
    mla_kv_dequantize,
    mla_kv_load,
    mla_kv_pack_bf16,
    mla_kv_quantize,
    mla_kv_row_bytes,
    mla_kv_store,
    mla_kv_unpack_bf16,
)

POISON = 0xA5


def bf16_round(v: float) -> float:
    """Nearest bf16 (8 significant bits) of a normal float64 value, ties to even."""
    if v == 0.0:
        return v
    _, e = math.frexp(v)  # |v| in [2**(e-1), 2**e): the last kept bit weighs 2**(e-8)
    ulp = 2.0 ** (e - 8)
    return round(v / ulp) * ulp  # exact division by a power of two; round() ties to even


def bf16_bits_of(t: torch.Tensor) -> np.ndarray:
    """bf16 bit patterns of the values of t, each rounded once from its own precision."""
    if t.dtype != torch.float64:
        return bf16_bits(t.to(torch.float32).numpy())
    rounded = np.array([bf16_round(v) for v in t.numpy().reshape(-1)]).reshape(t.shape)
    return bf16_bits(rounded.astype(np.float32))  # exact: already bf16 values


def bf16_value(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ------------------------------------------------------------------ index-K pages
def test_index_k_page_is_8448_bytes_for_64_tokens_of_128():
    assert index_k_page_bytes() == 8448 == 64 * 128 + 64 * 4
    assert index_k_page_bytes(page_size=32, head_dim=64) == 32 * 64 + 32 * 4


def random_index_k(n: int, head_dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (n, head_dim), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, generator=g, dtype=torch.float32) * 2.0 ** float(torch.randint(-30, 30, ()))
    return payload.view(torch.float8_e4m3fn), scales


@given(
    num_pages=st.integers(1, 4),
    page_size=st.sampled_from([1, 4, 16, 64]),
    head_dim=st.sampled_from([16, 128]),
    batches=st.integers(1, 3),
    fill=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_index_k_store_writes_exactly_the_slot_bytes_in_any_order(
    num_pages, page_size, head_dim, batches, fill, seed
):
    num_slots = num_pages * page_size
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(num_slots, generator=g)[: max(1, int(fill * num_slots))]
    row = page_size * (head_dim + 4)
    pages = torch.full((num_pages, row), POISON, dtype=torch.uint8)
    expected = bytearray([POISON]) * (num_pages * row)
    written = np.zeros(num_pages * row, dtype=bool)
    # Several store calls, each in random slot order.
    for part in torch.tensor_split(chosen, batches):
        k_fp8, k_scale = random_index_k(part.numel(), head_dim, seed + part.numel())
        index_k_store(pages, part, k_fp8, k_scale, page_size=page_size)
        for t, slot in enumerate(part.tolist()):
            page, offset = divmod(slot, page_size)
            start = page * row + offset * head_dim
            expected[start : start + head_dim] = k_fp8[t].view(torch.uint8).numpy().tobytes()
            written[start : start + head_dim] = True
            start = page * row + page_size * head_dim + 4 * offset
            expected[start : start + 4] = struct.pack("<f", float(k_scale[t]))
            written[start : start + 4] = True
    got = pages.numpy().reshape(-1)
    assert got.tobytes() == bytes(expected)
    assert (got[~written] == POISON).all()

    # Loading parses the same bytes back, read here with numpy.
    k_fp8, k_scale = index_k_load(pages, chosen, head_dim=head_dim, page_size=page_size)
    assert k_fp8.dtype == torch.float8_e4m3fn and k_scale.dtype == torch.float32
    for t, slot in enumerate(chosen.tolist()):
        page, offset = divmod(slot, page_size)
        buf = bytes(expected[page * row : (page + 1) * row])
        assert k_fp8[t].view(torch.uint8).numpy().tobytes() == buf[offset * head_dim : (offset + 1) * head_dim]
        scale_at = page_size * head_dim + 4 * offset
        assert float(k_scale[t]) == struct.unpack("<f", buf[scale_at : scale_at + 4])[0]


def test_index_k_load_allows_repeated_slots():
    pages = torch.full((2, index_k_page_bytes()), POISON, dtype=torch.uint8)
    k_fp8, k_scale = random_index_k(2, 128, 3)
    index_k_store(pages, torch.tensor([70, 5]), k_fp8, k_scale)
    got_fp8, got_scale = index_k_load(pages, torch.tensor([5, 70, 5]))
    assert torch.equal(got_fp8.view(torch.uint8), k_fp8.view(torch.uint8)[[1, 0, 1]])
    assert torch.equal(got_scale, k_scale[[1, 0, 1]])


def test_index_k_store_rejects_bad_input():
    pages = torch.zeros(2, index_k_page_bytes(), dtype=torch.uint8)
    k_fp8, k_scale = random_index_k(2, 128, 0)
    with pytest.raises(ValueError, match="slot 128 is outside the pool of 128 slots"):
        index_k_store(pages, torch.tensor([3, 128]), k_fp8, k_scale)
    with pytest.raises(ValueError, match="slot -1 is outside"):
        index_k_store(pages, torch.tensor([-1, 3]), k_fp8, k_scale)
    with pytest.raises(ValueError, match="slot 200 is outside"):
        index_k_load(pages, torch.tensor([200]))
    with pytest.raises(ValueError, match="distinct"):
        index_k_store(pages, torch.tensor([3, 3]), k_fp8, k_scale)
    with pytest.raises(ValueError, match="int64"):
        index_k_store(pages, torch.tensor([3, 4], dtype=torch.int32), k_fp8, k_scale)
    with pytest.raises(ValueError, match="k_fp8 must be float8_e4m3fn"):
        index_k_store(pages, torch.tensor([3, 4]), k_fp8.float(), k_scale)
    with pytest.raises(ValueError, match="k_fp8 must be float8_e4m3fn"):
        index_k_store(pages, torch.tensor([3, 4]), k_fp8.view(torch.uint8), k_scale)
    with pytest.raises(ValueError, match="k_scale must be float32 \\[2\\]"):
        index_k_store(pages, torch.tensor([3, 4]), k_fp8, k_scale.double())
    with pytest.raises(ValueError, match="k_scale must be float32 \\[2\\]"):
        index_k_store(pages, torch.tensor([3, 4]), k_fp8, k_scale[:, None])
    with pytest.raises(ValueError, match="uint8 \\[num_pages, 8448\\]"):
        index_k_store(pages.view(torch.int8), torch.tensor([3, 4]), k_fp8, k_scale)
    with pytest.raises(ValueError, match="uint8 \\[num_pages, 8448\\]"):
        index_k_store(pages[:, :8447], torch.tensor([3, 4]), k_fp8, k_scale)
    with pytest.raises(ValueError, match="slots has 1 entries for 2 tokens"):
        index_k_store(pages, torch.tensor([3]), k_fp8, k_scale)
    assert (pages == 0).all()  # nothing was written by a rejected call


# ------------------------------------------------------------------ MLA KV rows
def test_mla_row_bytes_match_flashmla():
    assert mla_kv_row_bytes() == 656 == 512 + 4 * 4 + 2 * 64
    assert mla_kv_row_bytes(kv_dtype="bf16") == 1152 == 2 * 576
    assert mla_kv_row_bytes(128, 16) == 128 + 4 + 32
    with pytest.raises(ValueError, match="multiple of 128"):
        mla_kv_row_bytes(96, 64)
    with pytest.raises(ValueError, match="'fp8' or 'bf16'"):
        mla_kv_row_bytes(kv_dtype="fp16")


def random_latent(n: int, rank: int, rope: int, dtype, seed: int, zero_tile: bool):
    g = torch.Generator().manual_seed(seed)
    spread = 10.0 ** (-5 * torch.rand(n, rank, generator=g, dtype=torch.float64))
    c = torch.randn(n, rank, generator=g, dtype=torch.float64) * spread * 10.0 ** float(
        torch.randint(-4, 4, (), generator=g)
    )
    if zero_tile:
        c[0, :128] = 0.0
        if n > 1:
            c[-1, -128:] *= 1e-4  # amax / 448 below the 1e-4 floor of the ue8m0 scale
    k_pe = torch.randn(n, rope, generator=g, dtype=torch.float64) * 3
    return c.to(dtype), k_pe.to(dtype)


def expected_fp8_rows(c: torch.Tensor, k_pe: torch.Tensor, scale_fmt) -> bytes:
    """FlashMLA V32_FP8Sparse rows, byte by byte (compute in float32, or float64 for float64).

    ``amax / 448`` is ``amax`` times 1/448 rounded to the compute dtype (``rnd``); a float32
    product is exact in float64, so ``rnd`` of it is the float32 product.
    """
    out = bytearray()
    cv = c.to(torch.float64).numpy()
    pe = bf16_bits_of(k_pe)
    fp32_compute = c.dtype != torch.float64
    rnd = f32 if fp32_compute else float  # rounding of one arithmetic result
    floor = rnd(1e-4)
    for r in range(cv.shape[0]):
        payload, scales = [], []
        for tile in cv[r].reshape(-1, 128):
            amax = float(np.abs(tile).max())
            if scale_fmt == "ue8m0":
                s = smallest_pow2_at_least(max(rnd(amax * rnd(1 / 448.0)), floor))
            else:
                s = f32(rnd(max(amax, floor) * rnd(1 / 448.0)))
            quotient = tile / s
            if fp32_compute:
                quotient = np.float32(quotient).astype(np.float64)  # the float32 division
            payload.append(encode_e4m3(np.clip(quotient, -448.0, 448.0)))
            scales.append(s)
        out += np.concatenate(payload).tobytes()
        out += struct.pack(f"<{len(scales)}f", *scales)
        out += pe[r].astype("<u2").tobytes()
    return bytes(out)


@given(
    n=st.integers(1, 4),
    rank=st.sampled_from([128, 512]),
    rope=st.sampled_from([16, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
    scale_fmt=st.sampled_from(["ue8m0", None]),
    zero_tile=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_quantize_assembles_flashmla_fp8_rows(n, rank, rope, dtype, scale_fmt, zero_tile, seed):
    c, k_pe = random_latent(n, rank, rope, dtype, seed, zero_tile)
    rows = mla_kv_quantize(c, k_pe, scale_fmt=scale_fmt)
    assert rows.dtype == torch.uint8 and rows.shape == (n, rank + 4 * rank // 128 + 2 * rope)
    assert rows.numpy().tobytes() == expected_fp8_rows(c, k_pe, scale_fmt)


def test_mla_ue8m0_floor_applies_to_the_scale_not_to_amax():
    # FlashMLA tests/quant.py: 2**ceil(log2(max(amax / 448, 1e-4))); 1e-4 lies in (2**-14, 2**-13].
    c = torch.zeros(1, 512)
    c[0, 128:256] = 1e-3
    rows = mla_kv_quantize(c, torch.zeros(1, 64))
    assert struct.unpack("<4f", rows[0, 512:528].numpy().tobytes()) == (2.0**-13,) * 4
    rows = mla_kv_quantize(c, torch.zeros(1, 64), scale_fmt=None)
    lo, hi = (f32(f32(a) * f32(1 / 448)) for a in (1e-4, 1e-3))
    expected = (lo, hi, lo, lo)
    assert struct.unpack("<4f", rows[0, 512:528].numpy().tobytes()) == expected


@given(
    n=st.integers(1, 4),
    rank=st.sampled_from([128, 512]),
    rope=st.sampled_from([16, 64]),
    scale_fmt=st.sampled_from(["ue8m0", None]),
    zero_tile=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_dequantize_reads_payload_times_tile_scale_and_bf16_rope(n, rank, rope, scale_fmt, zero_tile, seed):
    c, k_pe = random_latent(n, rank, rope, torch.float32, seed, zero_tile)
    rows = mla_kv_quantize(c, k_pe, scale_fmt=scale_fmt)
    out = mla_kv_dequantize(rows, kv_lora_rank=rank, rope_dim=rope)
    assert out.dtype == torch.float32 and out.shape == (n, rank + rope)
    raw = rows.numpy()
    tiles = rank // 128
    payload = E4M3[raw[:, :rank]].reshape(n, tiles, 128)
    scales = np.frombuffer(raw[:, rank : rank + 4 * tiles].tobytes(), dtype="<f4").reshape(n, tiles, 1)
    rope_vals = bf16_value(np.frombuffer(raw[:, rank + 4 * tiles :].tobytes(), dtype="<u2").reshape(n, rope))
    expected = np.concatenate([np.float32(payload * scales).reshape(n, rank), rope_vals], axis=1)
    np.testing.assert_array_equal(out.numpy(), expected.astype(np.float32))
    # In bf16: the float32 values rounded once (to nearest even), not rounded twice.
    in_bf16 = mla_kv_dequantize(rows, kv_lora_rank=rank, rope_dim=rope, dtype=torch.bfloat16)
    assert in_bf16.dtype == torch.bfloat16
    assert torch.equal(in_bf16, torch.from_numpy(expected.astype(np.float32)).to(torch.bfloat16))
    # Round trip: each latent value within half an e4m3 step (plus the float32 division) of c.
    cv = c.double().numpy().reshape(n, tiles, 128)
    v = cv / scales
    _, exp = np.frexp(np.maximum(np.abs(v), 2.0**-6))
    half_step = np.where(np.abs(v) >= 2.0**-6, np.ldexp(1.0, exp - 4), 2.0**-9) / 2
    err = np.abs(out.double().numpy()[:, :rank].reshape(n, tiles, 128) - cv)
    assert (err <= scales * (half_step + np.abs(v) * 2.0**-22)).all()


@given(
    n=st.integers(0, 4),
    rank=st.sampled_from([128, 512]),
    rope=st.sampled_from([16, 64]),
    dtype=st.sampled_from([torch.bfloat16, torch.float32, torch.float64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_bf16_rows_are_little_endian_bf16_of_c_then_k_pe(n, rank, rope, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(n, rank, generator=g, dtype=torch.float64).to(dtype)
    k_pe = torch.randn(n, rope, generator=g, dtype=torch.float64).to(dtype)
    rows = mla_kv_pack_bf16(c, k_pe)
    assert rows.dtype == torch.uint8 and rows.shape == (n, 2 * (rank + rope))
    expected = np.concatenate([bf16_bits_of(c), bf16_bits_of(k_pe)], axis=1).astype("<u2")
    assert rows.numpy().tobytes() == expected.tobytes()
    unpacked = mla_kv_unpack_bf16(rows, kv_lora_rank=rank, rope_dim=rope)
    assert unpacked.dtype == torch.bfloat16 and unpacked.shape == (n, rank + rope)
    got_bits = np.frombuffer(rows.numpy().tobytes(), dtype="<u2").reshape(n, rank + rope)
    np.testing.assert_array_equal(unpacked.to(torch.float64).numpy(), bf16_value(got_bits))
    ref = torch.cat([c, k_pe], dim=1).to(torch.float64).numpy()
    assert (np.abs(bf16_value(got_bits) - ref) <= np.abs(ref) * 2.0**-8).all()  # half a bf16 ulp


@given(
    num_pages=st.integers(1, 3),
    page_size=st.sampled_from([1, 4, 64]),
    kv_dtype=st.sampled_from(["fp8", "bf16"]),
    batches=st.integers(1, 3),
    fill=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**31 - 1),
)
def test_mla_store_writes_exactly_the_slot_rows_in_any_order(num_pages, page_size, kv_dtype, batches, fill, seed):
    row_bytes = mla_kv_row_bytes(512, 64, kv_dtype)
    num_slots = num_pages * page_size
    g = torch.Generator().manual_seed(seed)
    chosen = torch.randperm(num_slots, generator=g)[: max(1, int(fill * num_slots))]
    pool = torch.full((num_pages, page_size, row_bytes), POISON, dtype=torch.uint8)
    expected = np.full((num_pages * page_size, row_bytes), POISON, dtype=np.uint8)
    for part in torch.tensor_split(chosen, batches):
        rows = torch.randint(0, 256, (part.numel(), row_bytes), generator=g, dtype=torch.uint8)
        mla_kv_store(pool, part, rows)
        for t, slot in enumerate(part.tolist()):
            expected[slot] = rows[t].numpy()  # flat slot = page * page_size + offset
    assert pool.numpy().tobytes() == expected.tobytes()
    loaded = mla_kv_load(pool, chosen)
    assert loaded.dtype == torch.uint8
    np.testing.assert_array_equal(loaded.numpy(), expected[chosen.numpy()])


def test_mla_rejects_bad_input():
    c, k_pe = torch.randn(2, 512), torch.randn(2, 64)
    bad = c.clone()
    bad[1, 7] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        mla_kv_quantize(bad, k_pe)
    with pytest.raises(ValueError, match="multiple of 128"):
        mla_kv_quantize(torch.randn(2, 500), k_pe)
    with pytest.raises(ValueError, match="same n"):
        mla_kv_quantize(c, k_pe[:1])
    with pytest.raises(ValueError, match="scale_fmt"):
        mla_kv_quantize(c, k_pe, scale_fmt="fp32")
    rows = mla_kv_quantize(c, k_pe)
    with pytest.raises(ValueError, match="uint8 \\[n, 656\\]"):
        mla_kv_dequantize(rows[:, :655])
    with pytest.raises(ValueError, match="uint8 \\[n, 1152\\]"):
        mla_kv_unpack_bf16(rows)
    pool = torch.zeros(1, 64, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="slot 64 is outside the pool of 64 slots"):
        mla_kv_store(pool, torch.tensor([0, 64]), rows)
    with pytest.raises(ValueError, match="slot 64 is outside"):
        mla_kv_load(pool, torch.tensor([64]))
    with pytest.raises(ValueError, match="distinct"):
        mla_kv_store(pool, torch.tensor([1, 1]), rows)
    with pytest.raises(ValueError, match="uint8 \\[n, 656\\]"):
        mla_kv_store(pool, torch.tensor([0, 1]), rows.view(torch.int8))
    with pytest.raises(ValueError, match="uint8 \\[num_pages, page_size, row_bytes\\]"):
        mla_kv_store(pool.view(64, 656), torch.tensor([0, 1]), rows)
    assert (pool == 0).all()


def test_float64_latent_is_rounded_once_to_bf16():
    # 1 + 2**-8 + 2**-40 lies just above the bf16 midpoint between 1 and 1 + 2**-7; through
    # float32 it would become the midpoint and tie to even, 1.0.
    c = torch.full((1, 128), 1 + 2**-8 + 2**-40, dtype=torch.float64)
    k_pe = torch.full((1, 16), -(1 + 2**-8 + 2**-40), dtype=torch.float64)
    values = mla_kv_unpack_bf16(mla_kv_pack_bf16(c, k_pe), 128, 16).double()
    assert (values[0, :128] == 1 + 2**-7).all() and (values[0, 128:] == -(1 + 2**-7)).all()
    rows = mla_kv_quantize(c, k_pe)
    assert (mla_kv_dequantize(rows, 128, 16)[0, 128:] == -(1 + 2**-7)).all()
