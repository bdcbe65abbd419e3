"""FP8 e4m3 block quantization (act_quant / act_dequant) against the e4m3 format definition.

The expected values come from the OCP FP8 e4m3fn definition written out below (1 sign bit,
4 exponent bits with bias 7, 3 mantissa bits, no infinities, S.1111.111 = NaN), never from
torch's float8 cast.
"""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from formats import E4M3, encode_e4m3, e4m3_half_step, f32, smallest_pow2_at_least
from glm_dsa.fp8 import AMAX_FLOOR, FP8_E4M3_MAX, act_dequant, act_quant, ceil_pow2, narrow_cast


DTYPES = [torch.bfloat16, torch.float32, torch.float64]


def random_x(shape, dtype, seed, zero_block: int | None, block_size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(shape, generator=g, dtype=torch.float64)
    # Spread magnitudes over six decades inside a block, so that small elements land in the
    # e4m3 subnormal range relative to the block's amax.
    spread = 10.0 ** (-6 * torch.rand(shape, generator=g, dtype=torch.float64))
    magnitude = 10.0 ** float(torch.randint(-7, 5, (), generator=g))
    x = base * spread * magnitude
    if zero_block is not None:
        x.view(-1, block_size)[zero_block % x.view(-1, block_size).shape[0]] = 0.0
    return x.to(dtype)


def expected_scales(x: torch.Tensor, block_size: int, scale_fmt) -> np.ndarray:
    """Per-block scales from the recipe, in plain float64 / struct rounding.

    ``amax / 448`` is the product with 1/448 rounded to the compute dtype: a product of two
    float32 values is exact in float64, so rounding it once gives the float32 product.
    """
    xs = x.to(torch.float64).numpy().reshape(-1, block_size)
    fp32_compute = x.dtype != torch.float64
    floor = f32(AMAX_FLOOR) if fp32_compute else AMAX_FLOOR
    out = []
    for block in xs:
        amax = max(float(np.abs(block).max()), floor)
        raw = f32(amax * f32(1 / 448.0)) if fp32_compute else amax * (1 / 448.0)
        out.append(smallest_pow2_at_least(raw) if scale_fmt == "ue8m0" else f32(raw))
    return np.array(out)


shapes = st.tuples(
    st.lists(st.integers(1, 3), min_size=0, max_size=2),  # leading dims
    st.integers(1, 3),  # blocks per row
    st.sampled_from([32, 64, 128]),  # block size
)


@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    scale_fmt=st.sampled_from([None, "ue8m0"]),
    seed=st.integers(0, 2**31 - 1),
    zero_block=st.none() | st.integers(0, 50),
)
def test_dequantized_error_is_within_half_an_e4m3_step(shape, dtype, scale_fmt, seed, zero_block):
    lead, blocks, bs = shape
    x = random_x((*lead, blocks * bs), dtype, seed, zero_block, bs)
    x_fp8, scale = act_quant(x, block_size=bs, scale_fmt=scale_fmt)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (*lead, blocks)

    s = np.repeat(scale.to(torch.float64).numpy().reshape(-1), bs)
    xv = x.to(torch.float64).numpy().reshape(-1)
    decoded = E4M3[x_fp8.view(torch.uint8).numpy().reshape(-1)] * s  # exact in float64
    assert np.isfinite(decoded).all()
    v = xv / s
    # s is amax / 448 rounded to float32, so |x / s| may exceed 448 by float32's roundoff;
    # that excess is clamped away. x / s is itself rounded in the compute dtype (roundoff u)
    # before the single e4m3 rounding.
    assert np.abs(v).max() <= FP8_E4M3_MAX * (1 + 2.0**-23)
    u = 2.0**-53 if dtype == torch.float64 else 2.0**-24
    clamped = np.maximum(np.abs(v) - FP8_E4M3_MAX, 0.0)
    bound = s * (e4m3_half_step(v) + np.abs(v) * 2 * u + clamped)
    assert (np.abs(decoded - xv) <= bound).all()


@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    scale_fmt=st.sampled_from([None, "ue8m0"]),
    seed=st.integers(0, 2**31 - 1),
    zero_block=st.none() | st.integers(0, 50),
)
def test_scales_follow_the_amax_recipe(shape, dtype, scale_fmt, seed, zero_block):
    lead, blocks, bs = shape
    x = random_x((*lead, blocks * bs), dtype, seed, zero_block, bs)
    _, scale = act_quant(x, block_size=bs, scale_fmt=scale_fmt)
    got = scale.to(torch.float64).numpy().reshape(-1)
    np.testing.assert_array_equal(got, expected_scales(x, bs, scale_fmt))
    assert np.isfinite(got).all() and (got > 0).all()


@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    zero_block=st.none() | st.integers(0, 50),
)
def test_ue8m0_scales_are_powers_of_two_at_least_the_raw_scale(shape, dtype, seed, zero_block):
    lead, blocks, bs = shape
    x = random_x((*lead, blocks * bs), dtype, seed, zero_block, bs)
    _, raw = act_quant(x, block_size=bs, scale_fmt=None)
    _, pow2 = act_quant(x, block_size=bs, scale_fmt="ue8m0")
    for r, p in zip(raw.reshape(-1).tolist(), pow2.reshape(-1).tolist()):
        mantissa, _ = math.frexp(p)
        assert mantissa == 0.5, f"{p} is not a power of two"
        assert r <= p < 2 * r


@given(
    rows=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    scale_fmt=st.sampled_from([None, "ue8m0"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_payload_is_x_over_s_rounded_once_to_nearest_even(rows, dtype, scale_fmt, seed):
    x = random_x((rows, 128), dtype, seed, None, 128)
    x_fp8, scale = act_quant(x, scale_fmt=scale_fmt)
    s = scale.to(torch.float64).numpy()  # [rows, 1]
    quotient = x.to(torch.float64).numpy() / s
    if dtype != torch.float64:
        quotient = np.float32(quotient).astype(np.float64)  # = the float32 division
    expected = encode_e4m3(np.clip(quotient, -448.0, 448.0))
    np.testing.assert_array_equal(x_fp8.view(torch.uint8).numpy(), expected)


@given(
    rows=st.integers(1, 4),
    dtype=st.sampled_from(DTYPES),
    scale_fmt=st.sampled_from([None, "ue8m0"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_reciprocal_payload_is_x_times_the_rounded_reciprocal_of_s(rows, dtype, scale_fmt, seed):
    x = random_x((rows, 128), dtype, seed, None, 128)
    x_fp8, scale = act_quant(x, scale_fmt=scale_fmt, reciprocal=True)
    _, divided_scale = act_quant(x, scale_fmt=scale_fmt)
    assert torch.equal(scale, divided_scale)
    s = scale.to(torch.float64).numpy()  # [rows, 1]
    if dtype == torch.float64:
        product = x.numpy() * (1.0 / s)
    else:  # float32 reciprocal, then the float32 product (exact in float64, rounded once)
        product = np.float32(x.to(torch.float32).numpy().astype(np.float64) * np.float32(1.0 / s))
    expected = encode_e4m3(np.clip(np.asarray(product, np.float64), -448.0, 448.0))
    np.testing.assert_array_equal(x_fp8.view(torch.uint8).numpy(), expected)


def test_all_zero_block_gets_the_floor_scale_and_zero_payload():
    x = torch.zeros(2, 256)
    x[1, 128:] = 1.0
    x_fp8, scale = act_quant(x, scale_fmt=None)
    assert float(scale[0, 0]) == f32(f32(1e-4) * f32(1 / 448.0))
    assert (x_fp8[0].view(torch.uint8) == 0).all()
    _, scale = act_quant(x, scale_fmt="ue8m0")
    # 1e-4 / 448 = 2.23e-7 lies in (2**-23, 2**-22].
    assert float(scale[0, 0]) == 2.0**-22
    assert float(scale[1, 1]) == 2.0**-8  # 1 / 448 lies in (2**-9, 2**-8]


def test_a_block_with_amax_448_keeps_exact_values():
    x = torch.tensor([448.0, -448.0, 1.0, 0.5, 2.0**-9, 0.0, 3.5, -240.0] * 16)
    x_fp8, scale = act_quant(x, scale_fmt=None)
    assert float(scale[0]) == 1.0
    np.testing.assert_array_equal(E4M3[x_fp8.view(torch.uint8).numpy()], x.numpy())


@given(
    shape=shapes,
    scale_fmt=st.sampled_from([None, "ue8m0"]),
    seed=st.integers(0, 2**31 - 1),
)
def test_dequant_is_payload_times_block_scale_in_float32(shape, scale_fmt, seed):
    lead, blocks, bs = shape
    x = random_x((*lead, blocks * bs), torch.float32, seed, None, bs)
    x_fp8, scale = act_quant(x, block_size=bs, scale_fmt=scale_fmt)
    out = act_dequant(x_fp8, scale, block_size=bs)
    assert out.dtype == torch.float32 and out.shape == x.shape
    s = np.repeat(scale.to(torch.float64).numpy().reshape(-1), bs)
    expected = np.float32(E4M3[x_fp8.view(torch.uint8).numpy().reshape(-1)] * s)
    np.testing.assert_array_equal(out.numpy().reshape(-1), expected)


def test_ceil_pow2_is_exact_just_above_a_power_of_two():
    above = torch.tensor([np.nextafter(np.float32(2.0**-10), np.float32(1.0))], dtype=torch.float32)
    assert float(ceil_pow2(above)[0]) == 2.0**-9
    exact = torch.tensor([2.0**-10, 1.0, 3.0, 0.75], dtype=torch.float64)
    assert ceil_pow2(exact).tolist() == [2.0**-10, 1.0, 4.0, 1.0]


def test_float64_is_rounded_once_not_through_float32():
    # 1 + 1/16 + 2**-30 lies just above the e4m3 midpoint between 1 and 1.125: nearest is
    # 1.125. Through float32 it first becomes the midpoint 1.0625, which ties to even, 1.0.
    x = torch.tensor([1 + 2**-4 + 2**-30, -(1 + 2**-4 + 2**-30), 1 + 2**-4], dtype=torch.float64)
    codes = narrow_cast(x, torch.float8_e4m3fn).view(torch.uint8).tolist()
    assert [E4M3[c] for c in codes] == [1.125, -1.125, 1.0]
    # Same for bf16 (8 significant bits): 1 + 2**-8 + 2**-40 must round up to 1 + 2**-7.
    y = torch.tensor([1 + 2**-8 + 2**-40, 1 + 2**-8, 1 + 3 * 2**-8], dtype=torch.float64)
    assert narrow_cast(y, torch.bfloat16).double().tolist() == [1 + 2**-7, 1.0, 1 + 2**-6]
    block = torch.full((128,), 1 + 2**-4 + 2**-30, dtype=torch.float64)
    block[0] = 448.0  # scale exactly 1
    x_fp8, scale = act_quant(block)
    assert float(scale[0]) == 1.0 and E4M3[x_fp8.view(torch.uint8)[1].item()] == 1.125


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_finite_input_raises(bad, dtype):
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[2, 200] = bad
    with pytest.raises(ValueError, match="NaN or inf"):
        act_quant(x)


def test_last_dim_not_a_multiple_of_the_block_raises():
    with pytest.raises(ValueError, match="not a multiple of block_size=128"):
        act_quant(torch.randn(2, 100))
    with pytest.raises(ValueError, match="block_size"):
        act_quant(torch.randn(2, 128), block_size=0)


def test_bad_scale_fmt_and_dtypes_raise():
    with pytest.raises(ValueError, match="scale_fmt"):
        act_quant(torch.randn(1, 128), scale_fmt="e8m0")
    with pytest.raises(ValueError, match="floating-point"):
        act_quant(torch.ones(1, 128, dtype=torch.int32))
    x_fp8, scale = act_quant(torch.randn(2, 256))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        act_dequant(x_fp8.view(torch.uint8), scale)
    with pytest.raises(ValueError, match="float32"):
        act_dequant(x_fp8, scale.double())
    with pytest.raises(ValueError, match="must be \\(2, 2\\)"):
        act_dequant(x_fp8, scale[:, :1])
