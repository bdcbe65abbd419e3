"""float32 helpers the Triton kernels share, the same on the GPU and in Triton's interpreter.

* ``exp_f32``: libdevice's ``expf`` on the GPU (torch's CUDA ``exp``); numpy's in the
  interpreter, which has no libdevice (it may differ from torch's CPU ``exp`` in the last bit).
* ``round_rne``: float32 to a narrower float dtype, to nearest even. The GPU's ``cvt.rn``; the
  interpreter's own cast to bf16 truncates, so there the rounding is spelled out on the bits
  (finite values).
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

__all__ = ["exp_f32", "round_rne"]

if os.environ.get("TRITON_INTERPRET") == "1":

    @triton.jit
    def exp_f32(x):
        return tl.exp(x)

    @triton.jit
    def round_rne(x, dtype: tl.constexpr):
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
            return bits.to(tl.uint16).to(tl.bfloat16, bitcast=True)
        return x.to(dtype)

else:
    from triton.language.extra import libdevice

    @triton.jit
    def exp_f32(x):
        return libdevice.exp(x)

    @triton.jit
    def round_rne(x, dtype: tl.constexpr):
        return x.to(dtype)
