"""Triton indexer quantization: RoPE, the Hadamard rotation and FP8 ``act_quant`` in one pass,
and for the keys the index-K page write with them.

The contract of ``act_quant(hadamard_transform(rope(x), D**-0.5), D, scale_fmt)`` — the
indexer's ``_rope_then_rotate`` then ``act_quant`` (``glm_dsa.indexer.Indexer``) — bitwise: the
same float32 operations in the same order, each rounded where the reference rounds (the RoPE'd
and the rotated vector to ``x.dtype``, the quotient to e4m3 to nearest even). torch's form makes
some forty passes over the rows (the RoPE halves, seven butterfly stages, the casts, the scale
and the quotient); this reads each row once and writes its bytes and scale once. With pages and
slots given the bytes go straight into the index-K pages (``glm_dsa.kv_format.index_k_store``'s
layout) instead of a separate tensor.

Non-finite input is counted on the device and raised afterwards as ``act_quant`` raises it (one
host read of the count).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa import syncfree
from glm_dsa.fp8 import AMAX_FLOOR, FP8_E4M3_MAX
from glm_dsa.kernels.numerics import round_rne
from glm_dsa.kv_format import check_index_k_store
from glm_dsa.validate import need

__all__ = ["rope_hadamard_quant", "rope_hadamard_quant_store"]

_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)
_E4M3_MAX = tl.constexpr(FP8_E4M3_MAX)
ROWS = 32  # rows per program
NUM_WARPS = 4


@triton.jit
def _butterfly(y, R: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr):
    """One Sylvester stage: in each block of ``2·HALF`` columns, ``(a, b) → (a + b, a - b)``."""
    y = tl.reshape(y, [R, D // (2 * HALF), 2, HALF])
    a, b = tl.split(tl.permute(y, (0, 1, 3, 2)))
    y = tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2))
    return tl.reshape(y, [R, D])


@triton.jit
def _e4m3_bits(q):
    """float32 ``q`` (|q| ≤ 448) → its float8_e4m3fn bits as uint8, to nearest even; spelled out
    on the bits so that the GPU and Triton's interpreter (whose cast does not round) agree."""
    bits = q.to(tl.uint32, bitcast=True)
    sign = (bits >> 31) << 7
    a = tl.abs(q)
    abits = a.to(tl.uint32, bitcast=True)
    normal = (abits + 0x7FFFF + ((abits >> 20) & 1)) >> 20  # exponent and 3 mantissa bits
    normal = normal - ((127 - 7) << 3)
    # Below 2^-6: multiples of 2^-9, rounded to nearest even by the 2^23 shift trick.
    sub = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.uint32)
    code = tl.where(a >= 0.015625, normal, sub)
    return (code | sign).to(tl.uint8)


@triton.jit
def _rope_hadamard_quant_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, scale_ptr, slots_ptr, pages_ptr, page_scale_ptr, bad_ptr,
    n_rows, ROWS_PER_TOKEN: tl.constexpr, D: tl.constexpr, ROPE: tl.constexpr,
    INTERLEAVED: tl.constexpr, UE8M0: tl.constexpr, SCALE: tl.constexpr, LOG2_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr, WRITE_PAGES: tl.constexpr, R: tl.constexpr,
):
    rows = tl.program_id(0) * R + tl.arange(0, R)
    live = rows < n_rows
    rows64 = rows.to(tl.int64)
    tok = rows64 // ROWS_PER_TOKEN
    col = tl.arange(0, D)
    HALF: tl.constexpr = ROPE // 2
    # RoPE: column j < ROPE meets its partner p at the pair's angle; the first of a pair takes
    # a·c − b·s, the second a·s + b·c, with a the first and b the second (apply_rope).
    if INTERLEAVED:
        first = (col % 2) == 0
        partner = col ^ 1
        pair = col // 2
    else:
        first = col < HALF
        partner = tl.where(first, col + HALF, col - HALF)
        pair = col % HALF
    roped = col < ROPE
    partner = tl.where(roped, partner, col)
    mask = live[:, None]
    x_raw = tl.load(x_ptr + rows64[:, None] * D + col[None, :], mask=mask, other=0.0)
    x = x_raw.to(tl.float32)
    p = tl.load(x_ptr + rows64[:, None] * D + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    cs_off = tok[:, None] * HALF + tl.where(roped, pair, 0)[None, :]
    c = tl.load(cos_ptr + cs_off, mask=mask & roped[None, :], other=1.0)
    s = tl.load(sin_ptr + cs_off, mask=mask & roped[None, :], other=0.0)
    rot = tl.where(first[None, :], x * c - p * s, p * s + x * c)
    y = tl.where(roped[None, :], rot, x)
    y = round_rne(y, x_raw.dtype).to(tl.float32)  # apply_rope returns x.dtype
    for stage in tl.static_range(LOG2_D):
        y = _butterfly(y, R, D, 1 << stage)
    y = round_rne(y * SCALE, x_raw.dtype).to(tl.float32)  # hadamard_transform returns x.dtype
    # act_quant: one block of D per row.
    amax = tl.maximum(tl.max(tl.abs(y), axis=1), _AMAX_FLOOR)
    scale = amax * (1.0 / _E4M3_MAX)
    if UE8M0:  # the power-of-two ceiling (glm_dsa.fp8.ceil_pow2), on the bits
        sbits = scale.to(tl.uint32, bitcast=True)
        up = (sbits & 0x7F800000) + 0x800000
        scale = tl.where((sbits & 0x7FFFFF) == 0, sbits, up).to(tl.float32, bitcast=True)
    q = tl.math.div_rn(y, scale[:, None])
    q = tl.minimum(tl.maximum(q, -_E4M3_MAX), _E4M3_MAX)
    code = _e4m3_bits(q)
    # Non-finite input: count the rows (x - x is 0 only for finite x).
    bad = tl.sum(tl.where(live & (tl.sum((x - x != 0.0).to(tl.int32), axis=1) > 0), 1, 0), axis=0)
    tl.atomic_add(bad_ptr, bad)
    if WRITE_PAGES:
        slot = tl.load(slots_ptr + tok, mask=live, other=0)
        page, offset = slot // PAGE_SIZE, slot % PAGE_SIZE
        base = page * (PAGE_SIZE * (D + 4))
        tl.store(pages_ptr + base[:, None] + offset[:, None] * D + col[None, :], code, mask=mask)
        tl.store(page_scale_ptr + base // 4 + PAGE_SIZE * D // 4 + offset, scale, mask=live)
    else:
        tl.store(out_ptr + rows64[:, None] * D + col[None, :], code, mask=mask)
        tl.store(scale_ptr + rows64, scale, mask=live)


def _check(x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, scale_fmt: str | None) -> None:
    need(x.dim() in (2, 3) and x.is_contiguous() and x.dtype in (torch.bfloat16, torch.float16,
                                                                 torch.float32),
         f"x must be a contiguous bf16/fp16/fp32 [n, D] or [n, H, D], got {x.dtype} {tuple(x.shape)}")
    n, d = x.shape[0], x.shape[-1]
    need(d >= 2 and d & (d - 1) == 0, f"D={d} must be a power of two")
    need(0 < rope_dim <= d and rope_dim % 2 == 0, f"rope_dim={rope_dim} must be even and in (0, {d}]")
    need(cos.shape == sin.shape == (n, rope_dim // 2) and cos.dtype == sin.dtype == torch.float32,
         f"cos and sin must be float32 [{n}, {rope_dim // 2}], got {cos.dtype} {tuple(cos.shape)} "
         f"and {sin.dtype} {tuple(sin.shape)}")
    need(scale_fmt in (None, "ue8m0"), f"scale_fmt={scale_fmt!r} must be None or 'ue8m0'")


def _launch(x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool,
            scale_fmt: str | None, out: Tensor, scale: Tensor, slots: Tensor, pages: Tensor,
            page_scale: Tensor, page_size: int, write: bool) -> None:
    heads = 1 if x.dim() == 2 else x.shape[1]
    rows, d = x.shape[0] * heads, x.shape[-1]
    if not rows:
        return
    bad = torch.zeros(1, dtype=torch.int32, device=x.device)
    _rope_hadamard_quant_kernel[(triton.cdiv(rows, ROWS),)](
        x, cos.contiguous(), sin.contiguous(), out, scale, slots, pages, page_scale, bad, rows,
        ROWS_PER_TOKEN=heads, D=d, ROPE=rope_dim, INTERLEAVED=interleaved,
        UE8M0=scale_fmt == "ue8m0", SCALE=d**-0.5, LOG2_D=d.bit_length() - 1,
        PAGE_SIZE=page_size, WRITE_PAGES=write, R=ROWS, num_warps=NUM_WARPS,
        enable_fp_fusion=False,
    )
    # A device verdict: inside a captured step it is read once after the replay.
    syncfree.check(bad[0] == 0,
                   "act_quant got NaN or inf input; a non-finite value would give the whole block "
                   "(and the cache page it lands in) a garbage scale: fix the producer of x")


def rope_hadamard_quant(x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int, interleaved: bool,
                        scale_fmt: str | None) -> tuple[Tensor, Tensor]:
    """``act_quant(hadamard_transform(rope(x), D**-0.5), D, scale_fmt)`` of the indexer's rows.

    ``x: [n, D]`` or ``[n, H, D]`` bf16 / fp16 / fp32, contiguous, ``D`` a power of two; its
    first ``rope_dim`` dims are RoPE'd (``interleaved`` pairs ``(2i, 2i+1)``, else ``(i, i +
    rope_dim/2)``) with ``cos, sin: [n, rope_dim/2]`` float32 (``rope_cos_sin``, one row per
    token, shared by its heads). Returns ``(x_fp8 float8_e4m3fn like x, scale float32 [n, 1]
    or [n, H, 1])``.
    """
    _check(x, cos, sin, rope_dim, scale_fmt)
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
    unused = scale  # the page arguments, never read without WRITE_PAGES
    _launch(x, cos, sin, rope_dim, interleaved, scale_fmt, out.view(torch.uint8), scale, unused,
            unused, unused, 64, False)
    return out, scale


def rope_hadamard_quant_store(x: Tensor, cos: Tensor, sin: Tensor, rope_dim: int,
                              interleaved: bool, scale_fmt: str | None, pages: Tensor,
                              slots: Tensor, page_size: int = 64) -> None:
    """``rope_hadamard_quant`` of keys ``x: [n, D]`` written straight into index-K ``pages``
    (uint8 ``[num_pages, page_size · (D + 4)]``, contiguous) at ``slots`` (int64 ``[n]``,
    distinct, in range): ``index_k_store``'s bytes, with its checks; other slots untouched."""
    _check(x, cos, sin, rope_dim, scale_fmt)
    need(x.dim() == 2, f"keys must be [n, D], got {tuple(x.shape)}")
    n, d = x.shape
    check_index_k_store(pages, slots, n, d, page_size)  # so that bad slots never write
    need(pages.is_contiguous(), "pages must be contiguous")
    unused = slots  # the separate outputs, never written with WRITE_PAGES
    _launch(x, cos, sin, rope_dim, interleaved, scale_fmt, unused, unused, slots, pages,
            pages.view(torch.float32), page_size, True)
