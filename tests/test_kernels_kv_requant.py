"""The paged per-tensor FP8 requantization (glm_dsa.kernels.kv_requant) against the torch form it
replaces, ``mla_kv_per_tensor_fp8(mla_kv_load(pool, slots))``: the e4m3 bytes and the scale,
bitwise.

Pools of random rows: every finite e4m3 payload code (subnormals included), tile scales far
apart (powers of two from 2^-40 to 2^12, and non-powers), RoPE values spread over e4m3's
subnormal and normal range after the scale, all-zero rows. On the CPU the kernels run in
Triton's interpreter (tests/conftest.py); the ``cuda`` test runs GLM-5.3's rows at 200K tokens.
"""

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa.kernels.kv_requant import mla_kv_per_tensor_fp8_paged  # noqa: E402
from glm_dsa.kv_format import mla_kv_load, mla_kv_per_tensor_fp8, mla_kv_row_bytes  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
_NAN_CODES = (0x7F, 0xFF)


def _pool(num_pages, page_size, rank, rope, seed, tile_exp=(-40, 12), rope_exp=(-30, 4),
          pow2_tiles=True, zero_rows=3):
    """A random FP8 pool uint8 ``[num_pages, page_size, row_bytes]``: finite payload codes,
    tile scales ``2^k`` (or ``2^k`` times a mantissa), RoPE values ``±2^u`` in bf16."""
    g = torch.Generator().manual_seed(seed)
    n, tiles = num_pages * page_size, rank // 128
    payload = torch.randint(0, 256, (n, rank), generator=g, dtype=torch.uint8)
    for code in _NAN_CODES:
        payload[payload == code] = code - 1
    exps = torch.randint(tile_exp[0], tile_exp[1] + 1, (n, tiles), generator=g)
    tile_scale = torch.ldexp(torch.ones(n, tiles), exps)
    if not pow2_tiles:
        tile_scale = tile_scale * (1 + torch.rand(n, tiles, generator=g))
    u = torch.rand(n, rope, generator=g) * (rope_exp[1] - rope_exp[0]) + rope_exp[0]
    sign = torch.randint(0, 2, (n, rope), generator=g) * 2 - 1
    k_pe = (sign * torch.exp2(u)).to(torch.bfloat16)
    rows = torch.cat((payload, tile_scale.view(torch.uint8), k_pe.view(torch.uint8)), dim=1)
    rows[torch.randperm(n, generator=g)[:zero_rows]] = 0
    assert rows.shape[1] == mla_kv_row_bytes(rank, rope, "fp8")
    return rows.reshape(num_pages, page_size, -1), g


def _slots(num_slots, n, g):
    """n slots in random order, some repeated (a load may read a slot twice)."""
    slots = torch.randperm(num_slots, generator=g)[:n]
    slots[-2:] = slots[:2]
    return slots


def _check(pool, slots, rank, rope):
    want, want_scale = mla_kv_per_tensor_fp8(mla_kv_load(pool, slots), rank, rope)
    got, got_scale = mla_kv_per_tensor_fp8_paged(pool, slots, rank, rope)
    assert got.dtype == torch.float8_e4m3fn and got.shape == want.shape
    assert got_scale.dtype == torch.float32 and got_scale.shape == (1,)
    assert torch.equal(got_scale.view(torch.int32), want_scale.view(torch.int32)), (
        got_scale, want_scale)
    diff = (got.view(torch.uint8) != want.view(torch.uint8)).nonzero()
    assert diff.numel() == 0, f"{diff.shape[0]} bytes differ, first at {diff[:4].tolist()}"


@pytest.mark.parametrize("rank,rope,page_size,pow2_tiles", [
    (128, 16, 4, True),     # tiny: one tile, RoPE narrower than a block
    (256, 24, 8, False),    # non-power-of-two RoPE width, tile scales off the powers of two
    (512, 64, 16, True),    # GLM-5.3's 656-byte rows
])
def test_matches_torch_form(rank, rope, page_size, pow2_tiles):
    pool, g = _pool(12, page_size, rank, rope, seed=rank + rope, pow2_tiles=pow2_tiles)
    _check(pool.to(DEV), _slots(12 * page_size, 9 * page_size + 3, g).to(DEV), rank, rope)


def test_rope_sets_the_scale():
    # Small tile scales: the RoPE amax sets the scale; the latent spans e4m3's subnormals.
    pool, g = _pool(6, 16, 512, 64, seed=7, tile_exp=(-12, -2), rope_exp=(-12, 9))
    _check(pool.to(DEV), _slots(96, 70, g).to(DEV), 512, 64)


def test_zero_rows_and_no_rows():
    pool = torch.zeros(2, 4, mla_kv_row_bytes(128, 16, "fp8"), dtype=torch.uint8, device=DEV)
    _check(pool, torch.tensor([3, 0, 7, 3], device=DEV), 128, 16)  # every max at its floor
    _check(pool, torch.empty(0, dtype=torch.int64, device=DEV), 128, 16)


def test_bad_input_is_refused():
    pool = torch.zeros(2, 4, mla_kv_row_bytes(128, 16, "fp8"), dtype=torch.uint8, device=DEV)
    slots = torch.tensor([0, 1], device=DEV)
    with pytest.raises(ValueError, match="pool must be uint8"):
        mla_kv_per_tensor_fp8_paged(pool, slots, 256, 16)
    with pytest.raises(ValueError, match="slots must be 1-D int64"):
        mla_kv_per_tensor_fp8_paged(pool, slots.int(), 128, 16)
    with pytest.raises(ValueError, match="multiple of 128"):
        mla_kv_per_tensor_fp8_paged(pool, slots, 100, 16)


@pytest.mark.cuda
def test_matches_torch_form_cuda_glm_widths():
    pool, g = _pool(3200, 64, 512, 64, seed=11, zero_rows=50)
    slots = _slots(3200 * 64, 200_000, g)
    _check(pool.cuda(), slots.cuda(), 512, 64)
    pool, g = _pool(64, 64, 512, 64, seed=12, tile_exp=(-12, -2), rope_exp=(-12, 9))
    _check(pool.cuda(), _slots(64 * 64, 4000, g).cuda(), 512, 64)
