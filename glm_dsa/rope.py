"""Rotary position embedding: cos/sin tables (optionally YaRN-scaled) and the rotation.

Pair conventions: ``interleaved=True`` rotates ``(x[2i], x[2i+1])`` (GLM, every MLA), and
``interleaved=False`` rotates ``(x[i], x[i + d/2])`` (the DeepSeek-V3.2 indexer). Pair ``i``
turns by ``position * inv_freq[i]`` with ``inv_freq[i] = theta**(-2i / rotary_dim)``.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from glm_dsa.config import YarnScaling

__all__ = ["rope_inv_freq", "rope_cos_sin", "apply_rope"]


def _yarn_correction_dim(num_rotations: float, dim: int, base: float, original_len: int) -> float:
    """The (fractional) rotary dim whose wavelength fits ``num_rotations`` times in ``original_len``."""
    return dim * math.log(original_len / (num_rotations * 2 * math.pi)) / (2 * math.log(base))


def rope_inv_freq(
    rotary_dim: int, rope_theta: float, rope_scaling: YarnScaling | None = None
) -> Tensor:
    """Per-pair angular frequencies, float64 [rotary_dim // 2] (radians per position).

    With YaRN (DeepSeek-V3.2 / Hugging Face ``_compute_yarn_parameters``): pairs below
    ``low = floor(corr(beta_fast))`` keep their frequency, pairs above
    ``high = ceil(corr(beta_slow))`` are divided by ``factor``, and a linear ramp blends
    between them; ``low``/``high`` are clamped to ``[0, rotary_dim - 1]``.
    """
    if not isinstance(rotary_dim, int) or rotary_dim < 2 or rotary_dim % 2 != 0:
        raise ValueError(f"rotary_dim={rotary_dim!r} must be a positive even integer (RoPE rotates pairs)")
    if not rope_theta > 1.0:
        raise ValueError(f"rope_theta={rope_theta!r} must be > 1")
    half = rotary_dim // 2
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim
    inv_freq = rope_theta ** (-exponents)
    if rope_scaling is None:
        return inv_freq
    y = rope_scaling
    low: float = math.floor(
        _yarn_correction_dim(y.beta_fast, rotary_dim, rope_theta, y.original_max_position_embeddings)
    )
    high: float = math.ceil(
        _yarn_correction_dim(y.beta_slow, rotary_dim, rope_theta, y.original_max_position_embeddings)
    )
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # the upstream guard against a zero-width ramp
    ramp = ((torch.arange(half, dtype=torch.float64) - low) / (high - low)).clamp(0.0, 1.0)
    keep = 1.0 - ramp  # weight of the unscaled (extrapolated) frequency
    return inv_freq / y.factor * (1.0 - keep) + inv_freq * keep


@functools.lru_cache(maxsize=64)
def _inv_freq_on(rotary_dim: int, rope_theta: float, rope_scaling: YarnScaling | None,
                 device: torch.device) -> Tensor:
    """``rope_inv_freq`` on ``device``, copied there once: a step captured in a CUDA graph may not
    copy from the host."""
    return rope_inv_freq(rotary_dim, rope_theta, rope_scaling).to(device)


def rope_cos_sin(
    positions: Tensor,
    rotary_dim: int,
    rope_theta: float,
    rope_scaling: YarnScaling | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Tensor, Tensor]:
    """cos and sin of ``positions[n] * inv_freq[i]``, each [n, rotary_dim // 2] in ``dtype``.

    positions: int64 [n], any order, gaps allowed (context parallel hands over every p-th
    token). Angles are computed in float64 and rounded once to ``dtype``. With YaRN, both
    tables are multiplied by ``mscale(mscale) / mscale(mscale_all_dim)`` (1 for DeepSeek-V3.2).
    """
    if positions.dtype != torch.int64 or positions.dim() != 1:
        raise ValueError(
            f"positions must be a 1-D int64 tensor, got {positions.dtype} of shape "
            f"{tuple(positions.shape)}"
        )
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating-point dtype")
    inv_freq = _inv_freq_on(rotary_dim, rope_theta, rope_scaling, positions.device)
    angles = positions.to(torch.float64).unsqueeze(-1) * inv_freq  # [n, rotary_dim // 2]
    cos, sin = angles.cos(), angles.sin()
    if rope_scaling is not None:
        attention_factor = rope_scaling.mscale_value(rope_scaling.mscale) / rope_scaling.mscale_value(
            rope_scaling.mscale_all_dim
        )
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    """Rotate the pairs of ``x``'s last dim by the angles whose cos/sin are given.

    x: [n, ..., d] with ``d == 2 * cos.shape[-1]``; cos, sin: [n, d // 2], broadcast over the
    middle dims. ``interleaved=True`` pairs ``(2i, 2i+1)``; ``False`` pairs ``(i, i + d/2)``.
    Pair ``(a, b)`` becomes ``(a cos - b sin, a sin + b cos)``. Computed in
    ``promote_types(x.dtype, float32)``; returned in ``x.dtype``.
    """
    if not x.is_floating_point():
        raise ValueError(f"apply_rope needs a floating-point x, got {x.dtype}")
    if cos.dim() != 2 or cos.shape != sin.shape:
        raise ValueError(
            f"cos and sin must both be [n, d/2]; got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if x.dim() < 2 or x.shape[0] != cos.shape[0] or x.shape[-1] != 2 * cos.shape[-1]:
        raise ValueError(
            f"x {tuple(x.shape)} must be [n, ..., d] with n = {cos.shape[0]} and "
            f"d = 2 * {cos.shape[-1]} = {2 * cos.shape[-1]} to match cos/sin {tuple(cos.shape)}"
        )
    compute = torch.promote_types(x.dtype, torch.float32)
    table_shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
    c = cos.to(compute).reshape(table_shape)
    s = sin.to(compute).reshape(table_shape)
    xc = x.to(compute)
    half = cos.shape[-1]
    if interleaved:
        a, b = xc[..., 0::2], xc[..., 1::2]
        out = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xc[..., :half], xc[..., half:]
        out = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return out.to(x.dtype)
