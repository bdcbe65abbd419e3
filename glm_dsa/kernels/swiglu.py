"""Triton SwiGLU: ``silu(gate) * up`` in float32, rounded once to the output dtype, in one pass.

The contract of ``glm_dsa.moe.swiglu`` for bf16 / fp16 / fp32 rows on CUDA. torch's eager form
reads and writes the ``[m, I]`` operands five times (two casts, ``silu``, the product, the
rounding); this kernel reads ``gate`` and ``up`` once and writes the result once. ``silu`` is
``g / (1 + exp(-g))`` with libdevice's ``expf`` and a correctly rounded division, torch's CUDA
formula (``ActivationSiluKernel.cu``); Triton's interpreter has no libdevice, so there it uses
numpy's ``exp``, which can differ from torch's CPU ``exp`` in the last bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.kernels.numerics import exp_f32, round_rne
from glm_dsa.validate import need

__all__ = ["swiglu"]

# Columns per program: 4 warps × 32 threads × 8 elements (one 16-byte bf16 vector each).
BLOCK = 1024
NUM_WARPS = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _swiglu_kernel(gate_ptr, up_ptr, out_ptr, n_cols, gate_stride, up_stride, out_stride,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < n_cols
    g = tl.load(gate_ptr + row * gate_stride + col, mask=inside, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * up_stride + col, mask=inside, other=0.0).to(tl.float32)
    silu = tl.math.div_rn(g, 1.0 + exp_f32(-g))
    tl.store(out_ptr + row * out_stride + col, round_rne(silu * u, out_ptr.dtype.element_ty), mask=inside)


def swiglu(gate: Tensor, up: Tensor, dtype: torch.dtype) -> Tensor:
    """``silu(gate) * up`` in float32, rounded once to ``dtype``: ``[m, I]`` each → ``[m, I]``.

    ``gate`` and ``up``: 2-D, one dtype of bf16 / fp16 / fp32, unit column stride (row strides
    free, so both may be column halves of one ``[m, 2I]`` GEMM output), on one CUDA device (or
    the CPU under Triton's interpreter). ``dtype``: the result's, one of the same three.
    """
    need(gate.dim() == 2 and gate.shape == up.shape,
         f"gate and up must be 2-D of one shape, got {tuple(gate.shape)} and {tuple(up.shape)}")
    need(gate.dtype == up.dtype and gate.dtype in _DTYPES and dtype in _DTYPES,
         f"gate, up and dtype must be one of {_DTYPES}, got {gate.dtype}, {up.dtype}, {dtype}")
    need(gate.device == up.device, f"gate is on {gate.device}, up on {up.device}")
    need(gate.stride(1) == 1 and up.stride(1) == 1,
         f"gate and up need unit column strides, got {gate.stride()} and {up.stride()}")
    m, n_cols = gate.shape
    out = torch.empty(m, n_cols, dtype=dtype, device=gate.device)
    if m and n_cols:
        grid = (m, triton.cdiv(n_cols, BLOCK))
        _swiglu_kernel[grid](gate, up, out, n_cols, gate.stride(0), up.stride(0), out.stride(0),
                             BLOCK=BLOCK, num_warps=NUM_WARPS)
    return out
