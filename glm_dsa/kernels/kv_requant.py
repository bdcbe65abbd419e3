"""Triton requantization of FP8 MLA KV rows to one per-tensor scale, read from the paged pool.

``mla_kv_per_tensor_fp8_paged(pool, slots)`` is, bit for bit (bytes and scale),
``kv_format.mla_kv_per_tensor_fp8(kv_format.mla_kv_load(pool, slots))``: the FP8-query mode's
per-step operand. The torch form gathers the rows and makes several passes with float32
temporaries of ``[n, R + P]`` (4.6 KB a context token at GLM-5.3's widths); here two kernels:

1. ``_scale_kernel`` reads only each row's tile scales and RoPE values (144 of its 656 bytes)
   and folds ``max(tile scales, raw_scale(|k_pe|))`` into one float32 by an atomic max on its
   bits (non-negative floats order as their int32 bits, so the result is exact and the same
   for every order of the programs). ``raw_scale`` is monotonic, so the max of the products is
   the product of the max, as the torch form takes it.
2. ``_requant_kernel`` takes ``ceil_pow2`` of that maximum and writes each row's 576 e4m3 bytes:
   ``e4m3 * (tile_scale / scale)`` and ``k_pe / scale``, clamped to ±448, rounded to nearest
   even. ``scale`` is a power of two, so multiplying by ``1 / scale`` (exact) rounds as the
   torch division does.

Triton 3.6's interpreter misrounds some float32 -> e4m3 casts, so there the rounding is spelled
out on the bits (``_e4m3_code``); on the GPU it is the hardware's ``cvt.rn``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.fp8 import AMAX_FLOOR, FP8_E4M3_MAX, raw_scale
from glm_dsa.kv_format import MLA_TILE
from glm_dsa.validate import check_fp8_pool_rows

__all__ = ["mla_kv_per_tensor_fp8_paged"]

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
SCALE_ROWS = 128  # rows per program of the scale reduction: one atomic per 18 KB read
REQUANT_ROWS = 8  # rows per program of the requantization: 5 KB in, 4.5 KB out
NUM_WARPS = 4


@triton.jit
def _row_bases(pool_ptr, slots_ptr, rows, n, page_size, stride_page, stride_slot):
    """Byte pointers ``[ROWS, 1]`` to the pool rows of ``slots[rows]`` and the rows' mask."""
    inside = rows < n
    slot = tl.load(slots_ptr + rows, mask=inside, other=0)
    base = pool_ptr + (slot // page_size) * stride_page + (slot % page_size) * stride_slot
    return base[:, None], inside[:, None]


@triton.jit
def _scale_kernel(pool_ptr, slots_ptr, amax_ptr, n, page_size, stride_page, stride_slot,
                  recip_448, R: tl.constexpr, TILES: tl.constexpr, P: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    base, inside = _row_bases(pool_ptr, slots_ptr, rows, n, page_size, stride_page, stride_slot)
    t = tl.arange(0, BLOCK_T)[None, :]
    tile_scale = tl.load((base + R + 4 * t).to(tl.pointer_type(tl.float32)),
                         mask=inside & (t < TILES), other=0.0)
    p = tl.arange(0, BLOCK_P)[None, :]
    k_pe = tl.load((base + R + 4 * TILES + 2 * p).to(tl.pointer_type(tl.bfloat16)),
                   mask=inside & (p < P), other=0.0).to(tl.float32)
    largest = tl.maximum(tl.max(tl.max(tile_scale, axis=1), axis=0),
                         tl.max(tl.max(tl.abs(k_pe) * recip_448, axis=1), axis=0))
    tl.atomic_max(amax_ptr, largest.to(tl.int32, bitcast=True))


@triton.jit
def _e4m3_code(x):
    """Float32 ``x`` in [-448, 448] -> its e4m3fn byte (uint8), to nearest even, on the bits."""
    bits = x.to(tl.int32, bitcast=True)
    sign = ((bits >> 24) & 0x80).to(tl.uint8)
    a = bits & 0x7FFFFFFF
    # Normal range (>= 2^-6): drop 20 mantissa bits to nearest even; a carry moves the exponent.
    normal = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = normal - (120 << 3)  # exponent bias 127 -> 7
    # Subnormal range: multiples of 2^-9; adding 2^23 rounds to an integer, to nearest even.
    q = tl.abs(x) * 512.0
    sub = ((q + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= (121 << 23), normal, sub)
    return code.to(tl.uint8) | sign


@triton.jit
def _to_e4m3(x, INTERPRET: tl.constexpr):
    """Float32 ``x`` in [-448, 448] -> e4m3 bytes, to nearest even: the GPU's ``cvt.rn``, or in
    the interpreter (whose cast misrounds some values) ``_e4m3_code``."""
    if INTERPRET:
        return _e4m3_code(x)
    return x.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)


@triton.jit
def _requant_kernel(pool_ptr, slots_ptr, amax_ptr, out_ptr, scale_ptr, n, page_size,
                    stride_page, stride_slot, R: tl.constexpr, TILES: tl.constexpr,
                    P: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr,
                    ROWS: tl.constexpr, INTERPRET: tl.constexpr):
    pid = tl.program_id(0)
    # ceil_pow2 of the largest raw scale on its bits: a positive normal float32.
    largest = tl.load(amax_ptr)
    exponent = ((largest >> 23) & 0xFF) + ((largest & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    inv_scale = tl.div_rn(tl.full((), 1.0, tl.float32), scale)
    if pid == 0:
        tl.store(scale_ptr, scale)
    rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
    base, inside = _row_bases(pool_ptr, slots_ptr, rows, n, page_size, stride_page, stride_slot)
    out_row = out_ptr + rows[:, None] * (R + P)
    c = tl.arange(0, BLOCK_R)[None, :]
    in_c = inside & (c < R)
    payload = tl.load(base + c, mask=in_c, other=0).to(tl.float8e4nv, bitcast=True)
    tile_scale = tl.load((base + R + 4 * (c // 128)).to(tl.pointer_type(tl.float32)),
                         mask=in_c, other=0.0)
    latent = payload.to(tl.float32) * (tile_scale * inv_scale)
    p = tl.arange(0, BLOCK_P)[None, :]
    in_p = inside & (p < P)
    k_pe = tl.load((base + R + 4 * TILES + 2 * p).to(tl.pointer_type(tl.bfloat16)),
                   mask=in_p, other=0.0).to(tl.float32) * inv_scale
    latent = tl.minimum(tl.maximum(latent, -448.0), 448.0)
    k_pe = tl.minimum(tl.maximum(k_pe, -448.0), 448.0)
    tl.store(out_row + c, _to_e4m3(latent, INTERPRET), mask=in_c)
    tl.store(out_row + R + p, _to_e4m3(k_pe, INTERPRET), mask=in_p)


def mla_kv_per_tensor_fp8_paged(pool: Tensor, slots: Tensor, kv_lora_rank: int = 512,
                                rope_dim: int = 64) -> tuple[Tensor, Tensor]:
    """The rows of ``slots`` in an FP8 pool requantized with one scale, straight from the pool:
    ``pool`` uint8 ``[num_pages, page_size, row_bytes]`` (FlashMLA's 656-byte rows for R=512,
    P=64; unit byte stride), ``slots`` int64 ``[n]`` in ``[0, num_pages * page_size)`` (not
    checked: the batch's own slot mapping) -> ``(kv_fp8`` float8_e4m3fn ``[n, R + P]``,
    ``scale`` float32 ``[1])``, bitwise ``mla_kv_per_tensor_fp8(mla_kv_load(pool, slots))``."""
    check_fp8_pool_rows(pool, slots, kv_lora_rank, rope_dim)
    n, page_size = slots.shape[0], pool.shape[1]
    tiles = kv_lora_rank // MLA_TILE
    floor = torch.full((1,), AMAX_FLOOR, dtype=torch.float32, device=pool.device)
    amax = raw_scale(floor).view(torch.int32)  # the torch form's floor on the tile scales
    kv_fp8 = torch.empty((n, kv_lora_rank + rope_dim), dtype=torch.float8_e4m3fn,
                         device=pool.device)
    scale = torch.empty(1, dtype=torch.float32, device=pool.device)
    slots = slots.contiguous()
    geometry = (n, page_size, pool.stride(0), pool.stride(1))
    widths = dict(R=kv_lora_rank, TILES=tiles, P=rope_dim,
                  BLOCK_P=triton.next_power_of_2(rope_dim))
    if n:
        _scale_kernel[(triton.cdiv(n, SCALE_ROWS),)](
            pool, slots, amax, *geometry, 1.0 / FP8_E4M3_MAX, **widths,
            BLOCK_T=triton.next_power_of_2(tiles), ROWS=SCALE_ROWS, num_warps=NUM_WARPS)
    # One program even for no rows: it writes the scale.
    _requant_kernel[(max(triton.cdiv(n, REQUANT_ROWS), 1),)](
        pool, slots, amax, kv_fp8.view(torch.uint8), scale, *geometry, **widths,
        BLOCK_R=triton.next_power_of_2(kv_lora_rank), ROWS=REQUANT_ROWS, INTERPRET=_INTERPRET,
        num_warps=NUM_WARPS)
    return kv_fp8, scale
