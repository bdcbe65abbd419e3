"""RoPE tables and rotation against an explicit complex multiply written here in float64."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm_dsa.config import YarnScaling, get_config
from glm_dsa.rope import apply_rope, rope_cos_sin, rope_inv_freq

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def ref_inv_freq(rotary_dim: int, theta: float, yarn: YarnScaling | None) -> np.ndarray:
    """Per-pair frequency, one pair at a time in float64 (YaRN per DeepSeek-V3.2 / HF)."""
    if yarn is not None:
        def correction_dim(rotations: float) -> float:
            wavelengths = yarn.original_max_position_embeddings / (rotations * 2 * math.pi)
            return rotary_dim * math.log(wavelengths) / (2 * math.log(theta))

        low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(correction_dim(yarn.beta_slow)), rotary_dim - 1)
        width = (high - low) if high != low else 0.001
    out = []
    for i in range(rotary_dim // 2):
        freq = theta ** (-2 * i / rotary_dim)
        if yarn is not None:
            ramp = min(max((i - low) / width, 0.0), 1.0)  # 0: keep, 1: interpolate by factor
            freq = ramp * (freq / yarn.factor) + (1 - ramp) * freq
        out.append(freq)
    return np.array(out)


def ref_attention_factor(yarn: YarnScaling | None) -> float:
    if yarn is None or yarn.factor <= 1:
        return 1.0
    return (0.1 * yarn.mscale * math.log(yarn.factor) + 1) / (
        0.1 * yarn.mscale_all_dim * math.log(yarn.factor) + 1
    )


def ref_rope(x: np.ndarray, angles: np.ndarray, factor: float, interleaved: bool) -> np.ndarray:
    """x [n, ..., d] float64, angles [n, d/2]: pair (a, b) as a + ib times factor * e^(i angle)."""
    d = x.shape[-1]
    if interleaved:
        z = x[..., 0::2] + 1j * x[..., 1::2]
    else:
        z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    rot = (factor * np.exp(1j * angles)).reshape(angles.shape[0], *([1] * (x.ndim - 2)), d // 2)
    w = z * rot
    out = np.empty_like(x)
    if interleaved:
        out[..., 0::2], out[..., 1::2] = w.real, w.imag
    else:
        out[..., : d // 2], out[..., d // 2 :] = w.real, w.imag
    return out


def pair_l1(x: np.ndarray, interleaved: bool) -> np.ndarray:
    """|a| + |b| of each element's pair, laid out like x."""
    d = x.shape[-1]
    if interleaved:
        s = np.abs(x[..., 0::2]) + np.abs(x[..., 1::2])
        return np.repeat(s, 2, axis=-1)
    s = np.abs(x[..., : d // 2]) + np.abs(x[..., d // 2 :])
    return np.concatenate([s, s], axis=-1)


YARNS = [
    None,
    YarnScaling(),  # DeepSeek-V3.2: factor 40, original 4096, beta 32 / 1, mscale 1 / 1
    YarnScaling(factor=8.0, original_max_position_embeddings=2048, beta_fast=16.0,
                beta_slow=2.0, mscale=0.707, mscale_all_dim=1.0),
]

positions_st = st.lists(st.integers(0, 2**20), min_size=1, max_size=6)


@given(
    positions=positions_st,
    rotary_dim=st.sampled_from([2, 4, 16, 64]),
    theta=st.sampled_from([10_000.0, 8_000_000.0, 500.0]),
    yarn=st.sampled_from(YARNS),
)
def test_tables_are_cos_and_sin_of_position_times_frequency(positions, rotary_dim, theta, yarn):
    pos = torch.tensor(positions, dtype=torch.int64)
    cos, sin = rope_cos_sin(pos, rotary_dim, theta, yarn, dtype=torch.float64)
    assert cos.shape == sin.shape == (len(positions), rotary_dim // 2)
    angles = np.array(positions, dtype=np.float64)[:, None] * ref_inv_freq(rotary_dim, theta, yarn)
    af = ref_attention_factor(yarn)
    # The angle itself carries a few ulps of |angle|.
    tol = 8 * 2.0**-53 * (np.abs(angles) + 1) * af
    assert (np.abs(cos.numpy() - af * np.cos(angles)) <= tol).all()
    assert (np.abs(sin.numpy() - af * np.sin(angles)) <= tol).all()


@given(
    positions=positions_st,
    mid=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    rotary_dim=st.sampled_from([2, 8, 64]),
    interleaved=st.booleans(),
    x_dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    table_dtype=st.sampled_from([torch.float64, torch.float32]),
    yarn=st.sampled_from(YARNS),
    seed=st.integers(0, 2**31 - 1),
)
def test_both_conventions_equal_the_complex_multiply(
    positions, mid, rotary_dim, interleaved, x_dtype, table_dtype, yarn, seed
):
    n, theta = len(positions), 10_000.0
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, *mid, rotary_dim, generator=g, dtype=torch.float64).to(x_dtype)
    pos = torch.tensor(positions, dtype=torch.int64)
    cos, sin = rope_cos_sin(pos, rotary_dim, theta, yarn, dtype=table_dtype)
    out = apply_rope(x, cos, sin, interleaved)
    assert out.dtype == x_dtype and out.shape == x.shape

    xv = x.to(torch.float64).numpy()
    angles = np.array(positions, dtype=np.float64)[:, None] * ref_inv_freq(rotary_dim, theta, yarn)
    af = ref_attention_factor(yarn)
    expected = ref_rope(xv, angles, af, interleaved)
    # Tables rounded to their dtype and two products and a sum in the compute dtype (4 u),
    # angle error of a few float64 ulps of |angle|, then one rounding to x's dtype.
    u = max(UNIT_ROUNDOFF[table_dtype], UNIT_ROUNDOFF[torch.promote_types(x_dtype, torch.float32)])
    max_angle = float(np.abs(angles).max()) + 1
    bound = pair_l1(xv, interleaved) * af * (4 * u + 8 * 2.0**-53 * max_angle) + UNIT_ROUNDOFF[
        x_dtype
    ] * np.abs(expected)
    assert (np.abs(out.to(torch.float64).numpy() - expected) <= bound).all()


def test_half_split_pairs_i_with_i_plus_half_and_interleaved_pairs_neighbours():
    # A quarter turn (angle pi/2) maps pair (a, b) to (-b, a).
    cos, sin = torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 2, dtype=torch.float64)
    x = torch.tensor([[1.0, 2.0, 3.0, 4.0]], dtype=torch.float64)
    assert apply_rope(x, cos, sin, interleaved=True).tolist() == [[-2.0, 1.0, -4.0, 3.0]]
    assert apply_rope(x, cos, sin, interleaved=False).tolist() == [[-3.0, -4.0, 1.0, 2.0]]


@given(
    positions=positions_st,
    heads=st.integers(1, 3),
    interleaved=st.booleans(),
    yarn=st.sampled_from(YARNS),
    seed=st.integers(0, 2**31 - 1),
)
def test_rotation_scales_each_vector_norm_by_the_attention_factor(positions, heads, interleaved, yarn, seed):
    x = torch.randn(len(positions), heads, 64, generator=torch.Generator().manual_seed(seed),
                    dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.tensor(positions), 64, 10_000.0, yarn, dtype=torch.float64)
    out = apply_rope(x, cos, sin, interleaved)
    expected = x.norm(dim=-1) * ref_attention_factor(yarn)
    torch.testing.assert_close(out.norm(dim=-1), expected, rtol=1e-13, atol=0)


@given(
    m=st.integers(0, 2**20),
    n=st.integers(0, 2**20),
    shift=st.integers(0, 2**20),
    rotary_dim=st.sampled_from([2, 16, 64]),
    interleaved=st.booleans(),
    yarn=st.sampled_from(YARNS[:2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_query_key_product_depends_only_on_the_position_difference(
    m, n, shift, rotary_dim, interleaved, yarn, seed
):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, rotary_dim, generator=g, dtype=torch.float64).expand(2, -1)
    k = torch.randn(1, rotary_dim, generator=g, dtype=torch.float64).expand(2, -1)
    cq, sq = rope_cos_sin(torch.tensor([m, m + shift]), rotary_dim, 10_000.0, yarn, torch.float64)
    ck, sk = rope_cos_sin(torch.tensor([n, n + shift]), rotary_dim, 10_000.0, yarn, torch.float64)
    dots = (apply_rope(q, cq, sq, interleaved) * apply_rope(k, ck, sk, interleaved)).sum(-1)
    # Angles up to 2**21 rad carry ~2**21 * 2**-52 absolute error each.
    tol = 1e-8 * float(q[0].norm() * k[0].norm())
    assert abs(float(dots[0] - dots[1])) <= tol


@given(
    start=st.integers(0, 10_000),
    length=st.integers(1, 40),
    cp=st.integers(1, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_every_pth_token_gets_the_rows_of_the_full_table(start, length, cp, seed):
    full = torch.arange(start, start + length, dtype=torch.int64)
    cos, sin = rope_cos_sin(full, 64, 8_000_000.0)
    perm = torch.randperm(length, generator=torch.Generator().manual_seed(seed))
    for rank in range(cp):
        picked = full[rank::cp]
        c, s = rope_cos_sin(picked, 64, 8_000_000.0)
        assert torch.equal(c, cos[rank::cp]) and torch.equal(s, sin[rank::cp])
    c, s = rope_cos_sin(full[perm], 64, 8_000_000.0)
    assert torch.equal(c, cos[perm]) and torch.equal(s, sin[perm])


def test_noncontiguous_x_rotates_like_its_contiguous_copy():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(6, 4, 64, generator=g)[::2, 1:3]
    cos, sin = rope_cos_sin(torch.tensor([5, 900, 17]), 64, 10_000.0)
    for interleaved in (True, False):
        assert torch.equal(apply_rope(x, cos, sin, interleaved),
                           apply_rope(x.contiguous(), cos, sin, interleaved))


def test_deepseek_v32_yarn_keeps_pairs_up_to_10_and_interpolates_from_23():
    # corr(beta) = 64 ln(4096 / (2 pi beta)) / (2 ln 1e4): corr(32) = 10.47, corr(1) = 22.51,
    # so low = floor = 10 and high = ceil = 23.
    config = get_config("deepseek-v3.2")
    inv_freq = rope_inv_freq(config.qk_rope_head_dim, config.rope_theta, config.rope_scaling)
    plain = np.array([1e4 ** (-2 * i / 64) for i in range(32)])
    np.testing.assert_allclose(inv_freq[:11].numpy(), plain[:11], rtol=1e-15)
    np.testing.assert_allclose(inv_freq[23:].numpy(), plain[23:] / 40, rtol=1e-15)
    middle = inv_freq[11:23].numpy()
    assert ((middle < plain[11:23]) & (middle > plain[11:23] / 40)).all()
    np.testing.assert_allclose(
        inv_freq.numpy(), ref_inv_freq(64, 1e4, config.rope_scaling), rtol=1e-14
    )
    assert ref_attention_factor(config.rope_scaling) == 1.0


def test_glm_tables_have_no_scaling():
    config = get_config("glm-5.3")
    cos, sin = rope_cos_sin(torch.tensor([0, 1]), config.qk_rope_head_dim, config.rope_theta,
                            config.rope_scaling, dtype=torch.float64)
    assert cos.shape == (2, 32)
    assert (cos[0] == 1).all() and (sin[0] == 0).all()
    assert math.isclose(float(cos[1, 1]), math.cos(8e6 ** (-2 / 64)), rel_tol=1e-15)


def test_bad_input_raises():
    cos, sin = rope_cos_sin(torch.tensor([1, 2]), 8, 10_000.0)
    with pytest.raises(ValueError, match="d = 2 \\* 4 = 8"):
        apply_rope(torch.randn(2, 3, 6), cos, sin, interleaved=True)
    with pytest.raises(ValueError, match="n = 2"):
        apply_rope(torch.randn(3, 8), cos, sin, interleaved=True)
    with pytest.raises(ValueError, match="both be \\[n, d/2\\]"):
        apply_rope(torch.randn(2, 8), cos, sin[:, :2], interleaved=False)
    with pytest.raises(ValueError, match="int64"):
        rope_cos_sin(torch.tensor([1, 2], dtype=torch.int32), 8, 10_000.0)
    with pytest.raises(ValueError, match="even"):
        rope_cos_sin(torch.tensor([1, 2]), 7, 10_000.0)
    with pytest.raises(ValueError, match="rope_theta"):
        rope_cos_sin(torch.tensor([1, 2]), 8, 1.0)
