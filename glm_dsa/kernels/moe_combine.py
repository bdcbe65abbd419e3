"""Triton MoE combine: each row's weighted expert outputs and its shared expert, in one pass.

The contract of ``glm_dsa.moe.combine_experts`` for bf16 / fp16 / fp32 outputs on CUDA. One
program per (row, column block) reads the row's ``top_k`` expert-output rows and its shared-expert
row once and writes the result once, where torch's eager form makes five passes per slot (the
gather, the cast, the product, the sum and its read back). The float32 additions are torch's, in
the same order (ascending positions, then the shared expert), each product rounded before it is
added (fp contraction off), so on CUDA the result is bitwise the reference's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.kernels.numerics import round_rne
from glm_dsa.validate import need

__all__ = ["combine_experts"]

# Columns per program: 4 warps × 32 threads × 8 elements.
BLOCK = 1024
NUM_WARPS = 4
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _combine_kernel(expert_ptr, position_ptr, weight_ptr, shared_ptr, mask_ptr, out_ptr, n_cols,
                    expert_stride, shared_stride, out_stride, TOP_K: tl.constexpr,
                    HAS_SHARED: tl.constexpr, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = col < n_cols
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    keep = True
    if HAS_MASK:
        keep = tl.load(mask_ptr + row) != 0
    if keep:  # a masked row's pairs were never computed: their rows are not read
        for slot in tl.static_range(TOP_K):
            p = tl.load(position_ptr + row * TOP_K + slot).to(tl.int64)
            w = tl.load(weight_ptr + row * TOP_K + slot)
            v = tl.load(expert_ptr + p * expert_stride + col, mask=inside, other=0.0)
            acc = acc + v.to(tl.float32) * w
        if HAS_SHARED:
            s = tl.load(shared_ptr + row * shared_stride + col, mask=inside, other=0.0)
            acc = acc + s.to(tl.float32)
    tl.store(out_ptr + row * out_stride + col, round_rne(acc, out_ptr.dtype.element_ty), mask=inside)


def combine_experts(expert_out: Tensor, position: Tensor, weights: Tensor, shared: Tensor | None,
                    row_mask: Tensor | None, out: Tensor) -> Tensor:
    """``out[t] = Σ_j weights[t, j] · expert_out[position[t, j]] (+ shared[t])``, 0 where
    ``row_mask`` is False: ``glm_dsa.moe.combine_experts`` (argument shapes there), float32
    weights, ``expert_out``, ``shared`` and ``out`` of one dtype of bf16 / fp16 / fp32, with unit
    column strides. Writes ``out`` and returns it."""
    need(out.dtype in _DTYPES and expert_out.dtype == out.dtype
         and (shared is None or shared.dtype == out.dtype),
         f"expert_out, shared and out must share one dtype of {_DTYPES}, got {expert_out.dtype}, "
         f"{None if shared is None else shared.dtype} and {out.dtype}")
    need(weights.dtype == torch.float32, f"weights must be float32, got {weights.dtype}")
    n, top_k = position.shape
    hidden = out.shape[1]
    for name, t in (("expert_out", expert_out), ("shared", shared), ("out", out)):
        need(t is None or t.stride(1) == 1, f"{name} needs a unit column stride, got "
             f"{None if t is None else t.stride()}")
    position, weights = position.contiguous(), weights.contiguous()
    mask = None if row_mask is None else row_mask.view(torch.uint8)
    if n and hidden:
        grid = (n, triton.cdiv(hidden, BLOCK))
        _combine_kernel[grid](
            expert_out, position, weights, out if shared is None else shared,
            out if mask is None else mask, out, hidden, expert_out.stride(0),
            0 if shared is None else shared.stride(0), out.stride(0), TOP_K=top_k,
            HAS_SHARED=shared is not None, HAS_MASK=mask is not None, BLOCK=BLOCK,
            num_warps=NUM_WARPS, enable_fp_fusion=False,
        )
    return out
