"""RMSNorm and LayerNorm over the last dim, with float32 (or float64) math.

The row means are ``glm_dsa.invariant.row_mean``: ``Tensor.mean`` unless batch-invariant mode
fixes their summation order."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from glm_dsa.invariant import row_mean

__all__ = ["rms_norm", "layer_norm", "RMSNorm", "LayerNorm"]


def _check(x: Tensor, name: str, param: Tensor) -> None:
    if not x.is_floating_point():
        raise ValueError(f"norm input must be floating point, got {x.dtype}")
    if x.dim() == 0 or param.dim() != 1 or param.shape[0] != x.shape[-1]:
        raise ValueError(
            f"{name} has shape {tuple(param.shape)}; it must be [d] with d = x.shape[-1] of "
            f"x {tuple(x.shape)}"
        )


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dim.

    x: [..., d]; weight: [d]. Computed in ``promote_types(x.dtype, float32)`` (the weight is
    applied before the one rounding back); returned in ``x.dtype``.
    """
    _check(x, "weight", weight)
    if not eps > 0:
        raise ValueError(f"eps={eps!r} must be > 0")
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    inv_rms = torch.rsqrt(row_mean(xc.square()) + eps)
    return (xc * inv_rms * weight.to(compute)).to(x.dtype)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last dim (biased variance).

    x: [..., d]; weight, bias: [d]. Computed in ``promote_types(x.dtype, float32)``;
    returned in ``x.dtype``.
    """
    _check(x, "weight", weight)
    _check(x, "bias", bias)
    if not eps > 0:
        raise ValueError(f"eps={eps!r} must be > 0")
    compute = torch.promote_types(x.dtype, torch.float32)
    xc = x.to(compute)
    mean = row_mean(xc)
    centered = xc - mean
    inv_std = torch.rsqrt(row_mean(centered.square()) + eps)
    return (centered * inv_std * weight.to(compute) + bias.to(compute)).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm with a learned ``weight`` [dim] (initialised to ones)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


class LayerNorm(nn.Module):
    """LayerNorm with a learned ``weight`` (ones) and ``bias`` (zeros), each [dim]."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)
