"""RMSNorm and LayerNorm against explicit float64 loops written here."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm_dsa.norm import LayerNorm, RMSNorm, layer_norm, rms_norm

UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def ref_rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    for r, row in enumerate(x.reshape(-1, x.shape[-1])):
        rms = math.sqrt(sum(v * v for v in row) / len(row) + eps)
        out.reshape(-1, x.shape[-1])[r] = [v / rms * wi for v, wi in zip(row, w)]
    return out


def ref_layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float) -> np.ndarray:
    out = np.empty_like(x)
    for r, row in enumerate(x.reshape(-1, x.shape[-1])):
        mean = sum(row) / len(row)
        var = sum((v - mean) ** 2 for v in row) / len(row)  # biased, as every LayerNorm
        std = math.sqrt(var + eps)
        out.reshape(-1, x.shape[-1])[r] = [(v - mean) / std * wi + bi for v, wi, bi in zip(row, w, b)]
    return out


def bound(expected: np.ndarray, d: int, dtype: torch.dtype, extra: np.ndarray) -> np.ndarray:
    """Sums over d in the compute dtype (about d u relative) then one rounding to dtype."""
    u = UNIT_ROUNDOFF[torch.promote_types(dtype, torch.float32)]
    return (2 * d + 10) * u * extra + UNIT_ROUNDOFF[dtype] * np.abs(expected)


cases = dict(
    lead=st.lists(st.integers(1, 3), min_size=1, max_size=2),
    d=st.sampled_from([1, 4, 64, 128]),
    dtype=st.sampled_from([torch.float64, torch.float32, torch.bfloat16]),
    eps=st.sampled_from([1e-6, 1e-5, 1e-2]),
    magnitude=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**31 - 1),
)


@given(**cases)
def test_rms_norm_equals_the_float64_formula(lead, d, dtype, eps, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    w = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    out = rms_norm(x, w, eps)
    assert out.dtype == dtype and out.shape == x.shape
    xv, wv = x.to(torch.float64).numpy(), w.to(torch.float64).numpy()
    expected = ref_rms_norm(xv, wv, eps)
    # Relative error of each output is O(d u) of |x / rms * w|.
    got = out.to(torch.float64).numpy()
    assert (np.abs(got - expected) <= bound(expected, d, dtype, np.abs(expected))).all()


@given(**cases)
def test_layer_norm_equals_the_float64_formula(lead, d, dtype, eps, magnitude, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*lead, d, generator=g, dtype=torch.float64) * magnitude + magnitude).to(dtype)
    w = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(d, generator=g, dtype=torch.float64).to(dtype)
    out = layer_norm(x, w, b, eps)
    assert out.dtype == dtype and out.shape == x.shape
    xv, wv, bv = (t.to(torch.float64).numpy() for t in (x, w, b))
    expected = ref_layer_norm(xv, wv, bv, eps)
    # The mean is subtracted in the compute dtype: its error is O(d u) of the row's max |x|,
    # amplified by 1/std and |w|.
    xmax = np.abs(xv).max(axis=-1, keepdims=True)
    std = np.sqrt(xv.var(axis=-1, keepdims=True) + eps)
    extra = (xmax / std + 1) * np.abs(wv) + np.abs(bv)
    got = out.to(torch.float64).numpy()
    assert (np.abs(got - expected) <= bound(expected, d, dtype, extra)).all()


def test_layer_norm_of_one_to_four_matches_the_hand_computation():
    # mean 2.5, biased variance 1.25: (x - 2.5) / sqrt(1.25) = [-3, -1, 1, 3] / sqrt(5).
    x = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64)
    out = layer_norm(x, torch.ones(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64), 1e-300)
    expected = [v / math.sqrt(5) for v in (-3.0, -1.0, 1.0, 3.0)]
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-15)


def test_rms_norm_of_threes_and_fours_matches_the_hand_computation():
    # rms of (3, 4, 3, 4) is sqrt(12.5); eps 1e-300 vanishes.
    x = torch.tensor([3.0, 4.0, 3.0, 4.0], dtype=torch.float64)
    out = rms_norm(x, torch.full((4,), 2.0, dtype=torch.float64), 1e-300)
    np.testing.assert_allclose(out.numpy(), [2 * v / math.sqrt(12.5) for v in (3, 4, 3, 4)], rtol=1e-15)


def test_bf16_input_is_normalised_in_float32_before_one_rounding():
    # A row whose squares overflow bf16's 8-bit mantissa sum if accumulated in bf16.
    g = torch.Generator().manual_seed(11)
    x = torch.randn(4, 4096, generator=g).to(torch.bfloat16)
    w = torch.ones(4096, dtype=torch.bfloat16)
    out = rms_norm(x, w, 1e-5)
    expected = ref_rms_norm(x.double().numpy(), np.ones(4096), 1e-5)
    # Exactly one bf16 rounding of a float32-accurate value: within half a bf16 ulp + slack.
    assert (np.abs(out.double().numpy() - expected) <= (2.0**-8 + 2.0**-16) * np.abs(expected)).all()


def test_modules_own_hf_named_parameters_and_call_the_functions():
    rms, ln = RMSNorm(16, eps=1e-5), LayerNorm(16, eps=1e-6)
    assert set(dict(rms.named_parameters())) == {"weight"}
    assert set(dict(ln.named_parameters())) == {"weight", "bias"}
    assert (rms.weight == 1).all() and (ln.weight == 1).all() and (ln.bias == 0).all()
    assert rms.weight.dtype == torch.float32
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        rms.weight.copy_(torch.randn(16, generator=g))
        ln.weight.copy_(torch.randn(16, generator=g))
        ln.bias.copy_(torch.randn(16, generator=g))
    x = torch.randn(3, 16, generator=g)
    with torch.no_grad():
        assert torch.equal(rms(x), rms_norm(x, rms.weight, 1e-5))
        assert torch.equal(ln(x), layer_norm(x, ln.weight, ln.bias, 1e-6))


def test_bad_input_raises():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match="weight has shape \\(7,\\)"):
        rms_norm(x, torch.ones(7), 1e-5)
    with pytest.raises(ValueError, match="bias has shape \\(8, 1\\)"):
        layer_norm(x, torch.ones(8), torch.zeros(8, 1), 1e-5)
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, torch.ones(8), 0.0)
    with pytest.raises(ValueError, match="floating point"):
        rms_norm(torch.ones(2, 8, dtype=torch.int64), torch.ones(8), 1e-5)
