"""Walsh–Hadamard transform against the explicit Sylvester matrix built here in float64."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm_dsa.hadamard import hadamard_transform


def sylvester(d: int) -> np.ndarray:
    """H[i, j] = (-1)**popcount(i & j), float64 [d, d]."""
    return np.array([[(-1.0) ** bin(i & j).count("1") for j in range(d)] for i in range(d)])


UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float64: 2.0**-53, torch.bfloat16: 2.0**-8}


def random_input(shape, dtype, seed, noncontiguous: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if noncontiguous:
        # The transposed view has the last dim strided.
        x = torch.randn(shape[-1], *shape[:-1], generator=g, dtype=torch.float64).movedim(0, -1)
    else:
        x = torch.randn(shape, generator=g, dtype=torch.float64)
    return x.to(dtype)


@given(
    log2_d=st.integers(0, 8),
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    scale=st.sampled_from([1.0, 0.5, -3.0, None]),
    seed=st.integers(0, 2**31 - 1),
    noncontiguous=st.booleans(),
)
def test_equals_the_explicit_sylvester_matrix(log2_d, lead, dtype, scale, seed, noncontiguous):
    d = 2**log2_d
    scale = d**-0.5 if scale is None else scale
    x = random_input((*lead, d), dtype, seed, noncontiguous)
    out = hadamard_transform(x, scale)
    assert out.dtype == dtype and out.shape == x.shape

    xv = x.to(torch.float64).numpy().reshape(-1, d)
    expected = xv @ sylvester(d).T * scale
    # Error bound of a log2(d)-stage butterfly plus the scale multiply in the compute dtype
    # (unit roundoff u), then one rounding to the output dtype.
    u = UNIT_ROUNDOFF[torch.promote_types(dtype, torch.float32)]
    row_l1 = np.abs(xv).sum(axis=-1, keepdims=True)
    bound = 1.001 * (log2_d + 1) * u * row_l1 * abs(scale) + UNIT_ROUNDOFF[dtype] * np.abs(expected)
    got = out.to(torch.float64).numpy().reshape(-1, d)
    assert (np.abs(got - expected) <= bound).all()


@given(log2_d=st.integers(0, 9), rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_orthonormal_transform_is_its_own_inverse(log2_d, rows, seed):
    d = 2**log2_d
    x = torch.randn(rows, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    twice = hadamard_transform(hadamard_transform(x, d**-0.5), d**-0.5)
    torch.testing.assert_close(twice, x, rtol=0, atol=1e-12)


@given(log2_d=st.integers(0, 9), rows=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_orthonormal_transform_preserves_dot_products(log2_d, rows, seed):
    d = 2**log2_d
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, d, generator=g, dtype=torch.float64)
    k = torch.randn(rows, d, generator=g, dtype=torch.float64)
    hq, hk = hadamard_transform(q, d**-0.5), hadamard_transform(k, d**-0.5)
    dots, expected = (hq * hk).sum(-1), (q * k).sum(-1)
    scale = q.norm(dim=-1) * k.norm(dim=-1)
    assert ((dots - expected).abs() <= 1e-12 * scale).all()


def test_first_basis_vector_maps_to_all_ones_and_second_alternates():
    e = torch.zeros(2, 8)
    e[0, 0] = 1.0
    e[1, 1] = 1.0
    out = hadamard_transform(e)
    assert out[0].tolist() == [1.0] * 8
    assert out[1].tolist() == [1.0, -1.0] * 4


def test_indexer_scale_keeps_the_norm_of_a_128_vector():
    x = torch.randn(5, 128, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    y = hadamard_transform(x, 128**-0.5)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1), rtol=1e-13, atol=0)
    ones = torch.ones(128, dtype=torch.float64)
    assert math.isclose(float(hadamard_transform(ones, 128**-0.5)[0]), math.sqrt(128), rel_tol=1e-15)


@pytest.mark.parametrize("d", [3, 6, 12, 100, 127])
def test_non_power_of_two_dim_raises(d):
    with pytest.raises(ValueError, match="not a power of two"):
        hadamard_transform(torch.randn(2, d))


def test_integer_or_scalar_input_raises():
    with pytest.raises(ValueError, match="floating-point"):
        hadamard_transform(torch.ones(2, 8, dtype=torch.int64))
    with pytest.raises(ValueError, match="at least one dim"):
        hadamard_transform(torch.tensor(1.0))
