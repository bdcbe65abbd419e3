"""Triton dequantization of FP8 MLA KV rows to bf16, read from the paged pool.

``mla_kv_dequantize_paged(pool, slots)`` is, bit for bit,
``kv_format.mla_kv_dequantize(kv_format.mla_kv_load(pool, slots), dtype=torch.bfloat16)``: the
bf16 rows ``[c | k_pe]`` the bf16 Gluon sparse MLA reads when the cache is FP8. The torch form
gathers the rows, then makes several passes with a float32 ``[n, R]`` temporary (2 KB a context
token at GLM-5.3's widths, on top of the 656-byte gather and the 1,152-byte result); here one
kernel reads each row's 656 bytes from its page and writes its 1,152: ``e4m3 * tile_scale`` in
float32 (one rounding, the torch form's), rounded once to bf16 (nearest even), and the stored
bf16 RoPE values copied.

Triton 3.6's interpreter truncates float32 -> bf16 casts, so there the rounding is spelled out
on the bits (``_bf16_bits``, torch's ``round_to_nearest_even``, NaN as ``0x7FC0``); on the GPU it
is the hardware's ``cvt.rn``. Not yet dispatched: the triton backend still calls
``KVCache.read_mla`` (the torch form) until this kernel has run on the H200.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.kv_format import MLA_TILE
from glm_dsa.validate import check_fp8_pool_rows

__all__ = ["mla_kv_dequantize_paged"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROWS = 8  # rows per program: 5 KB in, 9 KB out
NUM_WARPS = 4


@triton.jit
def _bf16_bits(x):
    """Float32 ``x`` -> its bf16 bits (int16), to nearest even on the bits; NaN as ``0x7FC0``."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)


@triton.jit
def _to_bf16_bits(x, INTERPRET: tl.constexpr):
    """Float32 ``x`` -> bf16 bits (int16), to nearest even: the GPU's ``cvt.rn``, or in the
    interpreter (whose cast truncates) ``_bf16_bits``."""
    if INTERPRET:
        return _bf16_bits(x)
    return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.int16, bitcast=True)


@triton.jit
def _dequant_kernel(pool_ptr, slots_ptr, out_ptr, n, page_size, stride_page, stride_slot,
                    R: tl.constexpr, TILE: tl.constexpr, TILES: tl.constexpr,
                    P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                    ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    inside = (rows < n)[:, None]
    slot = tl.load(slots_ptr + rows, mask=rows < n, other=0)
    base = (pool_ptr + (slot // page_size) * stride_page + (slot % page_size) * stride_slot)[:, None]
    out_row = out_ptr + rows[:, None] * (R + P)
    c = tl.arange(0, BLOCK_R)[None, :]
    in_c = inside & (c < R)
    payload = tl.load(base + c, mask=in_c, other=0).to(tl.float8e4nv, bitcast=True)
    tile_scale = tl.load((base + R + 4 * (c // TILE)).to(tl.pointer_type(tl.float32)),
                         mask=in_c, other=0.0)
    latent = payload.to(tl.float32) * tile_scale
    tl.store(out_row + c, _to_bf16_bits(latent, INTERPRET), mask=in_c)
    p = tl.arange(0, BLOCK_P)[None, :]
    in_p = inside & (p < P)
    k_pe = tl.load((base + R + 4 * TILES + 2 * p).to(tl.pointer_type(tl.int16)), mask=in_p,
                   other=0)
    tl.store(out_row + R + p, k_pe, mask=in_p)


def mla_kv_dequantize_paged(pool: Tensor, slots: Tensor, kv_lora_rank: int = 512,
                            rope_dim: int = 64) -> Tensor:
    """The rows of ``slots`` in an FP8 pool as bf16, straight from the pool: ``pool`` uint8
    ``[num_pages, page_size, row_bytes]`` (FlashMLA's 656-byte rows for R=512, P=64; unit byte
    stride), ``slots`` int64 ``[n]`` in ``[0, num_pages * page_size)`` (not checked: the batch's
    own slot mapping) -> bf16 ``[n, R + P]``, bitwise
    ``mla_kv_dequantize(mla_kv_load(pool, slots), R, P, torch.bfloat16)``."""
    check_fp8_pool_rows(pool, slots, kv_lora_rank, rope_dim)
    n = slots.shape[0]
    out = torch.empty((n, kv_lora_rank + rope_dim), dtype=torch.bfloat16, device=pool.device)
    if n:
        _dequant_kernel[(triton.cdiv(n, ROWS),)](
            pool, slots.contiguous(), out.view(torch.int16), n, pool.shape[1], pool.stride(0),
            pool.stride(1), R=kv_lora_rank, TILE=MLA_TILE, TILES=kv_lora_rank // MLA_TILE, P=rope_dim,
            BLOCK_R=triton.next_power_of_2(kv_lora_rank),
            BLOCK_P=triton.next_power_of_2(rope_dim), ROWS=ROWS, INTERPRET=_INTERPRET,
            num_warps=NUM_WARPS)
    return out
