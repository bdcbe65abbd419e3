"""Walsh–Hadamard transform over the last dim, in Sylvester (natural) order.

``H[i, j] = (-1)**popcount(i & j)``; ``hadamard_transform(x, scale) = (H @ x) * scale`` with the
meaning of ``fast_hadamard_transform.hadamard_transform``. The indexer uses
``scale = d**-0.5`` (orthonormal, its own inverse, preserves dot products).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["hadamard_transform"]


def hadamard_transform(x: Tensor, scale: float = 1.0) -> Tensor:
    """``(H_d @ x) * scale`` over the last dim of x.

    x: [..., d] floating, d a power of two. Computed as the O(d log d) butterfly
    ``[a + b, a - b]`` in ``promote_types(x.dtype, float32)``; returned in ``x.dtype``.
    """
    if not x.is_floating_point():
        raise ValueError(f"hadamard_transform needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("hadamard_transform needs at least one dim (the transformed last dim)")
    d = x.shape[-1]
    if d < 1 or d & (d - 1) != 0:
        raise ValueError(
            f"last dim {d} is not a power of two; zero-pad it to "
            f"{1 << max(d - 1, 0).bit_length()} before the Hadamard transform"
        )
    compute = torch.promote_types(x.dtype, torch.float32)
    y = x.to(compute).reshape(-1, d)
    half = 1
    while half < d:
        # Pair element j with j + half inside each block of 2 * half: H_2n = [[H, H], [H, -H]].
        pairs = y.reshape(-1, d // (2 * half), 2, half)
        a, b = pairs[:, :, 0, :], pairs[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).reshape(-1, d)
        half *= 2
    return (y * scale).reshape(x.shape).to(x.dtype)
