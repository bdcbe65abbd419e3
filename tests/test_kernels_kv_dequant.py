"""The paged FP8 -> bf16 dequantization (glm_dsa.kernels.kv_dequant) against the torch form it
stands for, ``mla_kv_dequantize(mla_kv_load(pool, slots), dtype=torch.bfloat16)``: bitwise.

The pools are test_kernels_kv_requant's (every finite e4m3 code, tile scales from 2^-40 to 2^12
and off the powers of two, RoPE values over a wide range, all-zero rows), plus rows whose
products sit exactly halfway between two bf16 values (ties to even, both ways). On the CPU the
kernel runs in Triton's interpreter (tests/conftest.py); the ``cuda`` test runs GLM-5.3's rows
at 200K tokens.
"""

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa.kernels.kv_dequant import mla_kv_dequantize_paged  # noqa: E402
from glm_dsa.kv_format import mla_kv_dequantize, mla_kv_load, mla_kv_row_bytes  # noqa: E402
from test_kernels_kv_requant import _pool, _slots  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _check(pool, slots, rank, rope):
    want = mla_kv_dequantize(mla_kv_load(pool, slots), rank, rope, torch.bfloat16)
    got = mla_kv_dequantize_paged(pool, slots, rank, rope)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    diff = (got.view(torch.int16) != want.view(torch.int16)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} values differ, first at {diff[:4].tolist()}"


@pytest.mark.parametrize("rank,rope,page_size,pow2_tiles", [
    (128, 16, 4, True),     # tiny: one tile, RoPE narrower than a block
    (256, 24, 8, False),    # non-power-of-two RoPE width, tile scales off the powers of two
    (512, 64, 16, False),   # GLM-5.3's 656-byte rows, products that round into bf16
    (512, 64, 16, True),
])
def test_matches_torch_form(rank, rope, page_size, pow2_tiles):
    pool, g = _pool(12, page_size, rank, rope, seed=rank + rope + pow2_tiles, pow2_tiles=pow2_tiles)
    _check(pool.to(DEV), _slots(12 * page_size, 9 * page_size + 3, g).to(DEV), rank, rope)


def test_products_halfway_between_bf16_values_round_to_even():
    """Payload 1.0 (e4m3 0x38) times tile scales whose low 16 bits are 0x8000: the product is
    the scale, exactly halfway; an even bf16 below rounds down, an odd one up (a truncating
    cast gets the second wrong, a round-half-up one the first)."""
    rank, rope, page_size = 128, 16, 4
    row_bytes = mla_kv_row_bytes(rank, rope, "fp8")
    scales = torch.tensor([0x3F808000, 0x3F818000, 0x4000_8000, 0x3F7F8000],
                          dtype=torch.int32).view(torch.float32)
    rows = torch.zeros(page_size, row_bytes, dtype=torch.uint8)
    rows[:, :rank] = 0x38
    rows[:, rank:rank + 4] = scales.view(torch.uint8).reshape(page_size, 4)
    want = mla_kv_dequantize(rows, rank, rope, torch.bfloat16)[:, 0].view(torch.int16)
    assert want.tolist() == [0x3F80, 0x3F82, 0x4000, 0x3F80]  # the torch form rounds to even
    pool = rows.reshape(1, page_size, row_bytes).to(DEV)
    _check(pool, torch.arange(page_size, device=DEV), rank, rope)


def test_zero_rows_and_no_rows():
    pool = torch.zeros(2, 4, mla_kv_row_bytes(128, 16, "fp8"), dtype=torch.uint8, device=DEV)
    _check(pool, torch.tensor([3, 0, 7, 3], device=DEV), 128, 16)
    _check(pool, torch.empty(0, dtype=torch.int64, device=DEV), 128, 16)


def test_bad_input_is_refused():
    pool = torch.zeros(2, 4, mla_kv_row_bytes(128, 16, "fp8"), dtype=torch.uint8, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="pool must be uint8"):
        mla_kv_dequantize_paged(pool, slots, 256, 16)
    with pytest.raises(ValueError, match="slots must be 1-D int64"):
        mla_kv_dequantize_paged(pool, slots.int(), 128, 16)
    with pytest.raises(ValueError, match="multiple of 128"):
        mla_kv_dequantize_paged(pool, slots, 100, 16)


@pytest.mark.cuda
def test_matches_torch_form_cuda_glm_widths():
    pool, g = _pool(3200, 64, 512, 64, seed=13, zero_rows=50, pow2_tiles=False)
    _check(pool.cuda(), _slots(3200 * 64, 200_000, g).cuda(), 512, 64)
    pool, g = _pool(64, 64, 512, 64, seed=14)
    _check(pool.cuda(), _slots(64 * 64, 4000, g).cuda(), 512, 64)
