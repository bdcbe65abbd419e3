"""FP8 e4m3 block quantization with the semantics of DeepSeek-V3.2's ``act_quant``.

Each block of ``block_size`` consecutive elements along the last dim gets one float32 scale
``s``; the stored value is ``clamp(x / s, -448, 448)`` cast to ``float8_e4m3fn`` (round to
nearest even), and ``x ≈ x_fp8 * s``. See docs/conventions.md §2.

Every rounding is spelled out so that the bytes are the same on every device. The raw scale is
``amax × fl(1/448)``, a product with 1/448 rounded once to the compute dtype (``raw_scale``):
that is what DeepSeek-V3.2's TileLang ``act_quant`` computes (``amax * fp8_max_inv``) and what
upstream's ``amax / 448.0`` computes on CUDA, where PyTorch turns division by a CPU scalar into
multiplication by its reciprocal rounded to the compute dtype (``BinaryDivTrueKernel.cu``) while
the CPU divides. Divisions here are tensor by tensor on one device: IEEE quotients on both.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_dsa import syncfree

__all__ = [
    "FP8_E4M3_MAX",
    "AMAX_FLOOR",
    "raw_scale",
    "act_quant",
    "act_dequant",
    "per_tensor_quant",
    "ceil_pow2",
    "narrow_cast",
]

FP8_E4M3_MAX = 448.0
# An all-zero block would otherwise get scale 0 and a 0/0 payload.
AMAX_FLOOR = 1e-4

_SCALE_FMTS = (None, "ue8m0")


def raw_scale(amax: Tensor) -> Tensor:
    """``amax × fl(1/448)`` in ``amax.dtype`` (float32 or float64): the same bits on every device.

    ``1/448`` is rounded once to ``amax.dtype`` and held in a tensor on ``amax``'s device, so the
    product is one IEEE multiplication on CPU and CUDA alike. It differs from the quotient
    ``amax / 448`` by at most one ulp (in about half of the blocks of random data).
    """
    # A fill on the device, not a host-to-device copy (which a CUDA graph cannot capture).
    recip = torch.full((), 1.0 / FP8_E4M3_MAX, dtype=amax.dtype, device=amax.device)
    return amax * recip


def ceil_pow2(s: Tensor) -> Tensor:
    """The smallest power of two ``>= s`` for positive finite ``s``, exactly, in ``s.dtype``.

    Uses the binary exponent (``frexp``) rather than ``ceil(log2(s))``: a rounded ``log2`` of a
    value just above a power of two can land on the integer and give a scale below ``s``.
    """
    mantissa, exponent = torch.frexp(s)  # s = mantissa * 2**exponent, mantissa in [0.5, 1)
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(s), exponent)


def narrow_cast(x: Tensor, dtype: torch.dtype) -> Tensor:
    """Round ``x`` to a dtype of at most float32 precision once, to nearest even.

    torch casts float64 to bf16 / e4m3 through float32, which can round twice (a value just
    above a bf16 midpoint becomes the midpoint, then rounds to even). For float64 input we
    first round to float32 *to odd* (truncate, then set the last bit if inexact): with more
    than two spare bits, nearest-even from there equals nearest-even from the float64 value.
    """
    if x.dtype != torch.float64:
        return x.to(dtype)
    f = x.to(torch.float32)
    away = f.to(torch.float64).abs() > x.abs()
    f = torch.where(away, torch.nextafter(f, torch.zeros_like(f)), f)  # now truncated
    inexact = (f.to(torch.float64) != x).to(torch.int32)
    return (f.view(torch.int32) | inexact).view(torch.float32).to(dtype)


def _check_block(d: int, block_size: int) -> None:
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size={block_size!r} must be a positive integer")
    if d % block_size != 0:
        raise ValueError(
            f"last dim {d} is not a multiple of block_size={block_size}; pad the last dim to "
            f"{-(-d // block_size) * block_size} or pick a block size that divides it"
        )


def act_quant(
    x: Tensor, block_size: int = 128, scale_fmt: str | None = None, reciprocal: bool = False
) -> tuple[Tensor, Tensor]:
    """Quantize ``x`` to e4m3 with one scale per block of ``block_size`` along the last dim.

    x: [..., d] bf16 / fp16 / fp32 / fp64, ``d % block_size == 0``, all finite.
    Per block, in the compute dtype ``promote_types(x.dtype, float32)``:
    ``amax = max(|x|.max(), 1e-4)``; ``s = amax × fl(1/448)`` (``scale_fmt=None``,
    :func:`raw_scale`) or its power-of-two ceiling (``scale_fmt="ue8m0"``), returned rounded to
    float32; ``x_fp8 = clamp(x / s, ±448)`` with that float32 ``s``, rounded once to e4m3.
    ``reciprocal=True`` takes ``x × fl(1/s)`` instead of ``x / s`` (DeepGEMM's Python cast
    helpers); the two differ only where they straddle an e4m3 rounding boundary (about 1e-7 of
    the bytes of random bf16 data with raw scales, never with power-of-two ones).
    The bytes are identical on CPU and CUDA.
    Returns ``(x_fp8 [..., d] float8_e4m3fn, scale [..., d // block_size] float32)``.
    """
    if not x.is_floating_point():
        raise ValueError(f"act_quant needs a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("act_quant needs at least one dim (the quantized last dim)")
    if scale_fmt not in _SCALE_FMTS:
        raise ValueError(f"scale_fmt={scale_fmt!r} must be None (fp32 amax/448) or 'ue8m0'")
    d = x.shape[-1]
    _check_block(d, block_size)
    syncfree.check(
        torch.isfinite(x).all(),
        "act_quant got NaN or inf input; a non-finite value would give the whole block "
        "(and the cache page it lands in) a garbage scale: fix the producer of x",
    )
    compute = torch.promote_types(x.dtype, torch.float32)
    blocks = x.to(compute).reshape(*x.shape[:-1], d // block_size, block_size)
    amax = blocks.abs().amax(dim=-1).clamp_min(AMAX_FLOOR)
    raw = raw_scale(amax)
    scale = (ceil_pow2(raw) if scale_fmt == "ue8m0" else raw).to(torch.float32)
    s = scale.to(compute).unsqueeze(-1)
    scaled = blocks * torch.reciprocal(s) if reciprocal else blocks / s
    x_fp8 = narrow_cast(scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX), torch.float8_e4m3fn)
    return x_fp8.reshape(x.shape), scale


def act_dequant(x_fp8: Tensor, scale: Tensor, block_size: int = 128) -> Tensor:
    """``x_fp8 * scale`` blockwise, the inverse of :func:`act_quant` up to rounding.

    x_fp8: [..., d] float8_e4m3fn; scale: [..., d // block_size] float32.
    Returns float32 [..., d] (the product is rounded to float32).
    """
    if x_fp8.dtype != torch.float8_e4m3fn:
        raise ValueError(f"x_fp8 must be float8_e4m3fn, got {x_fp8.dtype}")
    if scale.dtype != torch.float32:
        raise ValueError(f"scale must be float32, got {scale.dtype}")
    if x_fp8.dim() == 0:
        raise ValueError("x_fp8 needs at least one dim (the quantized last dim)")
    d = x_fp8.shape[-1]
    _check_block(d, block_size)
    expected = (*x_fp8.shape[:-1], d // block_size)
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"scale has shape {tuple(scale.shape)}; for x_fp8 {tuple(x_fp8.shape)} and "
            f"block_size={block_size} it must be {expected}"
        )
    blocks = x_fp8.to(torch.float32).reshape(*expected, block_size)
    return (blocks * scale.unsqueeze(-1)).reshape(x_fp8.shape)


def per_tensor_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """One e4m3 scale for the whole tensor (SGLang's Q8KV8 operands): ``x`` of any shape ->
    ``(x_fp8`` float8_e4m3fn of ``x``'s shape, ``scale`` float32 ``[1])`` with ``scale =
    raw_scale(max(amax(|x|), AMAX_FLOOR))`` and ``x ≈ x_fp8 * scale``.

    The scale stays on the device (no host sync; the Q8KV8 kernels read it there). The payload
    is ``clamp(x / scale, ±448)`` computed in float32 and rounded once (one float32 temporary
    of ``x``'s size).
    """
    amax = x.abs().amax().to(torch.float32) if x.numel() else torch.zeros((), device=x.device)
    scale = raw_scale(amax.clamp_min(AMAX_FLOOR)).reshape(1)
    x_fp8 = (x.to(torch.float32) / scale).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return x_fp8.to(torch.float8_e4m3fn), scale
