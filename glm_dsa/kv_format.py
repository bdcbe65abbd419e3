"""Byte layouts of the two KV caches, as uint8 tensors (little-endian, as on every GPU host).

Index-K page (DeepGEMM / SGLang / vLLM; docs/conventions.md §4): one page of ``page_size`` tokens is
``page_size * head_dim`` e4m3 bytes (token t at ``t * head_dim``) followed by ``page_size``
float32 scales (token t at ``page_size * head_dim + 4 t``): 8448 bytes for 64 × 128.

MLA KV row (FlashMLA ``V32_FP8Sparse``; docs/conventions.md §6): per token ``R`` e4m3 bytes of the
latent ``c`` in tiles of 128, then ``R / 128`` float32 tile scales, then the ``P`` RoPE values
``k_pe`` in bf16: 656 bytes for R = 512, P = 64. The bf16 alternative is ``[c | k_pe]`` in
bf16: 1152 bytes.

MXFP4 index-K page (DeepGEMM 54e2261 ``tests/test_attention.py`` ``kv_cache_cast_to_fp4``, the
SM100 ``fp8_fp4_paged_mqa_logits`` cache): one page is ``page_size * head_dim / 2`` bytes of
e2m1 codes, two per byte (element 2i in the low nibble, 2i + 1 in the high one; token t at
``t * head_dim / 2``), then ``page_size`` int32 words of ue8m0 block scales, one exponent byte
per block of 32 elements, little-endian (block j of token t at byte
``page_size * head_dim / 2 + 4 t + j``; 64 dims leave bytes 2, 3 at 127 = 1.0): 68 bytes per
128-dim token, 4352 per 64-token page. SGLang's writer (``store_fp4_index_k_cache``,
sgl-project/sglang 1875c52 ``python/sglang/kernels/ops/attention/dsv4/fp4_indexer.py``) puts
the same bytes at the same places; its scale floors ``amax / 6`` rather than ``amax`` at 1e-4
(``scale_floor="scale"``), and its ``rne=True`` takes midpoints to the even code (``ties="even"``).

MXFP8 index-K page (DeepGEMM 559d79f, #377, ``tests/test_attention.py``
``kv_cache_cast_to_mxfp8``): the FP8 page's shape (``page_size * head_dim`` e4m3 bytes, then
``page_size`` 4-byte words: 132 bytes per 128-dim token) with one ue8m0 exponent byte per block
of 32 elements in each word, as in the MXFP4 page, instead of one float32 scale per token.

A slot is ``page * page_size + offset``, the physical token index into a paged pool.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_dsa import syncfree
from glm_dsa.fp8 import AMAX_FLOOR, FP8_E4M3_MAX, act_quant, ceil_pow2, narrow_cast, raw_scale

__all__ = [
    "MLA_KV_FORMATS",
    "MX_BLOCK",
    "FP4_FLOORS",
    "FP4_TIES",
    "mxfp4_quantize",
    "mxfp4_dequantize",
    "e2m1_to_e4m3",
    "mxfp8_quantize",
    "ue8m0_bytes",
    "index_k_page_split",
    "index_k_page_bytes",
    "index_k_store",
    "index_k_load",
    "mla_kv_unsupported",
    "mla_kv_row_bytes",
    "mla_kv_quantize",
    "mla_kv_dequantize",
    "mla_kv_pack_bf16",
    "mla_kv_unpack_bf16",
    "mla_kv_store",
    "mla_kv_load",
    "mla_kv_per_tensor_fp8",
]

# The main-KV row formats a server stores (byte layouts above); the cache also keeps plain
# float32 / float64 rows for tests (glm_dsa.cache.KV_DTYPES).
MLA_KV_FORMATS = ("fp8", "bf16")
MLA_TILE = 128
_SCALE_BYTES = 4  # float32
_BF16_BYTES = 2


def _check_positive(**sizes: int) -> None:
    for name, v in sizes.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}={v!r} must be a positive integer")


def _check_slots(slots: Tensor, num_slots: int) -> None:
    if slots.dtype != torch.int64 or slots.dim() != 1:
        raise ValueError(
            f"slots must be a 1-D int64 tensor, got {slots.dtype} of shape {tuple(slots.shape)}"
        )
    if slots.numel() == 0:
        return

    def the_bad_slot() -> str:
        lo = int(slots.min())
        bad = lo if lo < 0 else int(slots.max())
        return (f"slot {bad} is outside the pool of {num_slots} slots [0, {num_slots}); "
                "allocate more pages or fix the slot mapping")

    syncfree.check((slots.min() >= 0) & (slots.max() < num_slots),
                   f"a slot is outside the pool of {num_slots} slots [0, {num_slots}); "
                   "allocate more pages or fix the slot mapping", the_bad_slot)


def _check_unique(slots: Tensor) -> None:
    # Two writes to one slot would leave whichever the backend happened to apply last.
    ordered = slots.sort().values
    syncfree.check((ordered[1:] != ordered[:-1]).all(),
                   "slots to store must be distinct; one slot was written twice")


# ------------------------------------------------------------------ index-K pages
def index_k_page_bytes(page_size: int = 64, head_dim: int = 128) -> int:
    """Bytes of one index-K page: ``page_size * (head_dim + 4)`` (8448 for 64 × 128)."""
    _check_positive(page_size=page_size, head_dim=head_dim)
    return page_size * (head_dim + _SCALE_BYTES)


def _check_pages(pages: Tensor, page_size: int, head_dim: int) -> None:
    row = index_k_page_bytes(page_size, head_dim)
    if pages.dtype != torch.uint8 or pages.dim() != 2 or pages.shape[1] != row:
        raise ValueError(
            f"index-K pages must be uint8 [num_pages, {row}] for page_size={page_size}, "
            f"head_dim={head_dim}; got {pages.dtype} of shape {tuple(pages.shape)}"
        )


def index_k_page_split(pages: Tensor, page_size: int, payload_bytes: int) -> tuple[Tensor, Tensor]:
    """Views of paged index keys laid out as DeepGEMM lays every format out (FP8, MXFP8,
    MXFP4): per page, ``page_size`` payloads of ``payload_bytes`` bytes, then ``page_size``
    4-byte scale words. pages: uint8 ``[num_pages, page_size * (payload_bytes + 4)]`` (any
    page stride). Returns ``(payload uint8 [num_pages, page_size, payload_bytes], words uint8
    [num_pages, page_size, 4])``, sharing the pages' storage."""
    num_pages, split = pages.shape[0], page_size * payload_bytes
    payload = pages[:, :split].unflatten(1, (page_size, payload_bytes))
    words = pages[:, split:].unflatten(1, (page_size, _SCALE_BYTES))
    return payload, words


def _index_k_views(pages: Tensor, page_size: int, head_dim: int) -> tuple[Tensor, Tensor]:
    """Views of index-K pages: the fp8 payloads uint8 ``[num_pages, page_size, head_dim]`` and the
    scales float32 ``[num_pages, page_size]``, sharing the pages' storage. Indexing them by
    ``(page, offset)`` moves one row per token (an index per byte would cost 8 bytes per byte)."""
    payload, words = index_k_page_split(pages, page_size, head_dim)
    return payload, words.view(torch.float32)[..., 0]


def check_index_k_store(pages: Tensor, slots: Tensor, n: int, head_dim: int, page_size: int) -> None:
    """What storing ``n`` tokens' index keys at ``slots`` needs (``index_k_store``'s checks, for
    every writer of the pages): uint8 pages of this layout, ``n`` distinct in-range int64 slots."""
    _check_pages(pages, page_size, head_dim)
    _check_slots(slots, pages.shape[0] * page_size)
    if slots.shape[0] != n:
        raise ValueError(f"slots has {slots.shape[0]} entries for {n} tokens of k_fp8")
    _check_unique(slots)


def index_k_store(
    pages: Tensor, slots: Tensor, k_fp8: Tensor, k_scale: Tensor, page_size: int = 64
) -> None:
    """Write tokens' index keys into their slots, in place; bytes of other slots are untouched.

    pages: uint8 [num_pages, page_size * (head_dim + 4)]; slots: int64 [n], distinct, in
    ``[0, num_pages * page_size)``; k_fp8: float8_e4m3fn [n, head_dim]; k_scale: float32 [n].
    """
    if k_fp8.dtype != torch.float8_e4m3fn or k_fp8.dim() != 2:
        raise ValueError(
            f"k_fp8 must be float8_e4m3fn [n, head_dim], got {k_fp8.dtype} of shape "
            f"{tuple(k_fp8.shape)}"
        )
    n, head_dim = k_fp8.shape
    if k_scale.dtype != torch.float32 or tuple(k_scale.shape) != (n,):
        raise ValueError(
            f"k_scale must be float32 [{n}] (one scale per token), got {k_scale.dtype} of "
            f"shape {tuple(k_scale.shape)}"
        )
    check_index_k_store(pages, slots, n, head_dim, page_size)
    payload, scale = _index_k_views(pages, page_size, head_dim)
    page, offset = slots // page_size, slots % page_size
    payload[page, offset] = k_fp8.view(torch.uint8)
    scale[page, offset] = k_scale


def index_k_load(
    pages: Tensor, slots: Tensor, head_dim: int = 128, page_size: int = 64
) -> tuple[Tensor, Tensor]:
    """Read tokens' index keys from their slots.

    pages: uint8 [num_pages, page_size * (head_dim + 4)]; slots: int64 [n] (repeats allowed).
    Returns ``(k_fp8 [n, head_dim] float8_e4m3fn, k_scale [n] float32)``, fresh tensors.
    """
    _check_pages(pages, page_size, head_dim)
    _check_slots(slots, pages.shape[0] * page_size)
    payload, scale = _index_k_views(pages, page_size, head_dim)
    page, offset = slots // page_size, slots % page_size
    return payload[page, offset].view(torch.float8_e4m3fn), scale[page, offset]


# ------------------------------------------------------------------ MLA KV rows
def mla_kv_unsupported(kv_lora_rank: int, kv_dtype: str) -> str | None:
    """Why the main-KV format ``kv_dtype`` cannot hold a latent of ``kv_lora_rank`` values, or
    None: the FP8 row cuts ``c`` into tiles of 128 with one scale each, so it needs whole tiles.
    The one rule the cache, the ledger and the command line apply."""
    if kv_dtype == "fp8" and kv_lora_rank % MLA_TILE != 0:
        return f"kv_lora_rank={kv_lora_rank} must be a multiple of {MLA_TILE} for the FP8 KV cache (one scale per tile of 128)"
    return None


def mla_kv_row_bytes(kv_lora_rank: int = 512, rope_dim: int = 64, kv_dtype: str = "fp8") -> int:
    """Bytes per token of the MLA KV cache: 656 (``"fp8"``, R=512, P=64) or 1152 (``"bf16"``)."""
    _check_positive(kv_lora_rank=kv_lora_rank, rope_dim=rope_dim)
    if kv_dtype == "fp8":
        if (why := mla_kv_unsupported(kv_lora_rank, kv_dtype)) is not None:
            raise ValueError(why)
        return kv_lora_rank + _SCALE_BYTES * (kv_lora_rank // MLA_TILE) + _BF16_BYTES * rope_dim
    if kv_dtype == "bf16":
        return _BF16_BYTES * (kv_lora_rank + rope_dim)
    raise ValueError(f"kv_dtype={kv_dtype!r} must be 'fp8' or 'bf16' (MLA_KV_FORMATS)")


def _check_latent(c: Tensor, k_pe: Tensor) -> None:
    if not (c.is_floating_point() and k_pe.is_floating_point()):
        raise ValueError(f"c and k_pe must be floating point, got {c.dtype} and {k_pe.dtype}")
    if c.dim() != 2 or k_pe.dim() != 2 or c.shape[0] != k_pe.shape[0]:
        raise ValueError(
            f"c must be [n, R] and k_pe [n, P] with the same n; got {tuple(c.shape)} and "
            f"{tuple(k_pe.shape)}"
        )
    if c.shape[1] == 0 or k_pe.shape[1] == 0:
        raise ValueError("c and k_pe must have a non-empty last dim")


def _bf16_bytes(t: Tensor) -> Tensor:
    """[n, k] -> uint8 [n, 2k]: the values rounded to bf16 (nearest even), little-endian."""
    return narrow_cast(t, torch.bfloat16).contiguous().view(torch.uint8)


def mla_kv_quantize(c: Tensor, k_pe: Tensor, scale_fmt: str | None = "ue8m0") -> Tensor:
    """Pack latent rows into FlashMLA's FP8 layout.

    c: [n, R] floating, ``R % 128 == 0``, finite; k_pe: [n, P] floating (rounded to bf16).
    Per token and tile of 128, with ``amax / 448`` taken as ``amax × fl(1/448)`` (``raw_scale``,
    what FlashMLA's ``tests/quant.py`` computes on CUDA): ``"ue8m0"``:
    ``s = 2**ceil(log2(max(amax / 448, 1e-4)))`` (newest FlashMLA ``tests/quant.py``; note the
    floor applies to ``s``, not to amax as in ``act_quant``); ``None``:
    ``s = max(amax, 1e-4) / 448``. Payload ``clamp(c / s, ±448)`` as e4m3, computed in
    ``promote_types(c.dtype, float32)`` with the float32 ``s``. The bytes are identical on CPU
    and CUDA.
    Returns uint8 [n, R + 4 * R / 128 + 2 * P].
    """
    _check_latent(c, k_pe)
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt={scale_fmt!r} must be None (fp32 amax/448) or 'ue8m0'")
    n, rank = c.shape
    mla_kv_row_bytes(rank, k_pe.shape[1], "fp8")  # validates the tile multiple
    syncfree.check(torch.isfinite(c).all(), "mla_kv_quantize got NaN or inf in c; fix the producer of the latent")
    compute = torch.promote_types(c.dtype, torch.float32)
    tiles = c.to(compute).reshape(n, rank // MLA_TILE, MLA_TILE)
    amax = tiles.abs().amax(dim=-1)
    if scale_fmt == "ue8m0":
        scale = ceil_pow2(raw_scale(amax).clamp_min(AMAX_FLOOR))
    else:
        scale = raw_scale(amax.clamp_min(AMAX_FLOOR))
    scale = scale.to(torch.float32)
    payload = (tiles / scale.to(compute).unsqueeze(-1)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    payload = narrow_cast(payload, torch.float8_e4m3fn).reshape(n, rank)
    return torch.cat(
        (payload.view(torch.uint8), scale.view(torch.uint8), _bf16_bytes(k_pe)), dim=-1
    )


def _check_rows(rows: Tensor, row_bytes: int, what: str) -> None:
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] != row_bytes:
        raise ValueError(
            f"{what} rows must be uint8 [n, {row_bytes}], got {rows.dtype} of shape "
            f"{tuple(rows.shape)}"
        )


def mla_kv_dequantize(rows: Tensor, kv_lora_rank: int = 512, rope_dim: int = 64,
                      dtype: torch.dtype = torch.float32) -> Tensor:
    """Unpack FP8 rows to ``dtype`` [n, R + P]: ``[e4m3 * tile scale | k_pe]``, the product in
    float32 and rounded once to ``dtype`` (``dtype=torch.bfloat16`` gives the bits of the float32
    result ``.to(torch.bfloat16)``, through one float32 ``[n, R]`` temporary instead of three)."""
    _check_rows(rows, mla_kv_row_bytes(kv_lora_rank, rope_dim, "fp8"), "FP8 MLA KV")
    if not dtype.is_floating_point:
        raise ValueError(f"dtype={dtype} must be a floating dtype")
    n = rows.shape[0]
    tiles = kv_lora_rank // MLA_TILE
    rows = rows.contiguous()
    payload = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn)
    scale_end = kv_lora_rank + _SCALE_BYTES * tiles
    scale = rows[:, kv_lora_rank:scale_end].contiguous().view(torch.float32)  # [n, tiles]
    k_pe = rows[:, scale_end:].view(torch.bfloat16)
    out = torch.empty((n, kv_lora_rank + rope_dim), dtype=dtype, device=rows.device)
    c = payload.to(torch.float32).reshape(n, tiles, MLA_TILE).mul_(scale.unsqueeze(-1))
    out[:, :kv_lora_rank] = c.reshape(n, kv_lora_rank)
    out[:, kv_lora_rank:] = k_pe
    return out


def mla_kv_per_tensor_fp8(rows: Tensor, kv_lora_rank: int = 512,
                          rope_dim: int = 64) -> tuple[Tensor, Tensor]:
    """FP8 rows requantized with one scale for them all (the Q8KV8 kernels' operand):
    uint8 ``[n, row_bytes]`` -> ``(kv_fp8`` float8_e4m3fn ``[n, R + P]``, ``scale`` float32
    ``[1])`` with ``kv_fp8 * scale ≈ mla_kv_dequantize(rows)``.

    The scale comes from the stored tile scales and the RoPE amax, without reading the payload:
    ``ceil_pow2(max(tile scales, raw_scale(amax |k_pe|)))``, which bounds every value by 448.
    The latent is rounded twice (once into its tile, once here): with power-of-two tile scales
    (``ue8m0``, the cache's) ``tile_scale / scale`` is a power of two, so a payload moves exactly
    unless it falls below e4m3's normal range (2^-6), where it loses low mantissa bits (or
    flushes to 0 below 2^-10) — in tiles whose scale is far below the largest. The bf16 RoPE
    values are rounded to e4m3 once. Float32 temporaries of ``[n, R + P]``.
    """
    _check_rows(rows, mla_kv_row_bytes(kv_lora_rank, rope_dim, "fp8"), "FP8 MLA KV")
    n = rows.shape[0]
    tiles = kv_lora_rank // MLA_TILE
    rows = rows.contiguous()
    payload = rows[:, :kv_lora_rank].contiguous().view(torch.float8_e4m3fn)
    scale_end = kv_lora_rank + _SCALE_BYTES * tiles
    tile_scale = rows[:, kv_lora_rank:scale_end].contiguous().view(torch.float32)  # [n, tiles]
    k_pe = rows[:, scale_end:].contiguous().view(torch.bfloat16).to(torch.float32)  # [n, P]
    floor = torch.full((1,), AMAX_FLOOR, dtype=torch.float32, device=rows.device)
    rope_amax = torch.cat((k_pe.abs().flatten(), floor)).amax()
    largest_tile = torch.cat((tile_scale.flatten(), raw_scale(floor))).amax()
    scale = ceil_pow2(torch.maximum(largest_tile, raw_scale(rope_amax))).reshape(1)
    out = torch.empty((n, kv_lora_rank + rope_dim), dtype=torch.float32, device=rows.device)
    c = payload.to(torch.float32).reshape(n, tiles, MLA_TILE).mul_((tile_scale / scale)[..., None])
    out[:, :kv_lora_rank] = c.reshape(n, kv_lora_rank)
    out[:, kv_lora_rank:] = k_pe / scale
    return out.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn), scale


def mla_kv_pack_bf16(c: Tensor, k_pe: Tensor) -> Tensor:
    """``[c | k_pe]`` rounded to bf16 as bytes: c [n, R], k_pe [n, P] -> uint8 [n, 2 (R + P)]."""
    _check_latent(c, k_pe)
    return torch.cat((_bf16_bytes(c), _bf16_bytes(k_pe)), dim=-1)


def mla_kv_unpack_bf16(rows: Tensor, kv_lora_rank: int = 512, rope_dim: int = 64) -> Tensor:
    """uint8 [n, 2 (R + P)] -> bfloat16 [n, R + P]."""
    _check_rows(rows, mla_kv_row_bytes(kv_lora_rank, rope_dim, "bf16"), "bf16 MLA KV")
    return rows.contiguous().view(torch.bfloat16)


def _check_pool(pool: Tensor) -> None:
    if pool.dtype != torch.uint8 or pool.dim() != 3:
        raise ValueError(
            f"MLA KV pool must be uint8 [num_pages, page_size, row_bytes], got {pool.dtype} of "
            f"shape {tuple(pool.shape)}"
        )


def mla_kv_store(pool: Tensor, slots: Tensor, rows: Tensor) -> None:
    """Write rows into their slots, in place; other slots' bytes are untouched.

    pool: uint8 [num_pages, page_size, row_bytes]; slots: int64 [n], distinct, in
    ``[0, num_pages * page_size)``; rows: uint8 [n, row_bytes].
    """
    _check_pool(pool)
    num_pages, page_size, row_bytes = pool.shape
    _check_rows(rows, row_bytes, "MLA KV")
    _check_slots(slots, num_pages * page_size)
    if slots.shape[0] != rows.shape[0]:
        raise ValueError(f"slots has {slots.shape[0]} entries for {rows.shape[0]} rows")
    _check_unique(slots)
    pool[slots // page_size, slots % page_size] = rows


def mla_kv_load(pool: Tensor, slots: Tensor) -> Tensor:
    """Read rows from their slots: pool uint8 [num_pages, page_size, row_bytes] -> uint8 [n, row_bytes]."""
    _check_pool(pool)
    num_pages, page_size, _ = pool.shape
    _check_slots(slots, num_pages * page_size)
    return pool[slots // page_size, slots % page_size]


# ------------------------------------------------------------------------- MX index keys
MX_BLOCK = 32  # elements per ue8m0 scale (DeepGEMM's gran_k=32 for MXFP4 and MXFP8 index keys)
FP4_E2M1_MAX = 6.0
# e2m1 magnitudes by code 0-7, and the midpoints between neighbours: a value on a midpoint
# takes the smaller code (DeepGEMM's _quantize_to_fp4_e2m1 counts strict ``>``), not the
# even one a hardware cvt.rn would take.
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_UE8M0_ONE = 127  # the exponent byte of 1.0
# Where the 1e-4 floor of an MXFP4 scale applies: to amax (DeepGEMM's helper,
# ``max(amax, 1e-4) / 6``) or to the scale (SGLang's writer, ``max(amax / 6, 1e-4)``).
FP4_FLOORS = ("amax", "scale")
# A value on a midpoint of the e2m1 grid: the smaller magnitude (DeepGEMM's helper, SGLang's
# default) or the even code (SGLang's rne=True, a hardware cvt.rn).
FP4_TIES = ("smaller", "even")


def _ceil_exponent(s: Tensor) -> Tensor:
    """int32 biased exponent of the smallest power of two ``>= s`` (float32, positive, finite),
    clamped to [1, 254] as DeepGEMM's ``ceil_to_ue8m0``: the exponent field, plus one if any
    mantissa bit is set."""
    bits = s.view(torch.int32)
    return (((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(torch.int32)).clamp(1, 254)


def _packed_words(exponent: Tensor) -> Tensor:
    """uint8 ``[n, 4 * ceil(blocks / 4)]``: the block exponents, padded with 127 (1.0) to whole
    int32 words (upstream pads with 1.0 so ``pack_ue8m0_to_int`` takes 32 or 64 dims)."""
    n, blocks = exponent.shape
    out = torch.full((n, -(-blocks // 4) * 4), _UE8M0_ONE, dtype=torch.uint8, device=exponent.device)
    out[:, :blocks] = exponent.to(torch.uint8)
    return out


def mxfp4_quantize(x: Tensor, scale_floor: str = "amax", ties: str = "smaller") -> tuple[Tensor, Tensor]:
    """``deep_gemm.utils.per_token_cast_to_fp4(x, use_ue8m0=True, gran_k=32,
    use_packed_ue8m0=True)`` (DeepGEMM 54e2261 ``deep_gemm/utils/math.py``), as bytes.

    Per block of 32 along the last dim: ``s = 2**ceil(log2(max(amax, 1e-4) / 6))`` (ue8m0,
    exponent clamped to [1, 254]); each ``x / s`` (exact: s is a power of two) to the nearest
    e2m1 value, a midpoint to the smaller magnitude, saturating at 6; ``-0`` written as ``+0``.
    ``scale_floor="scale"`` floors the scale instead, ``s = 2**ceil(log2(max(amax / 6,
    1e-4)))``, and ``ties="even"`` takes a midpoint to the even code: SGLang's writer and its
    ``rne=True`` (``FP4_FLOORS``, ``FP4_TIES``).

    x: ``[n, d]`` floating, d a multiple of 32 (64 or 128 upstream).
    Returns ``(codes uint8 [n, d / 2]``, two per byte, element 2i low;
    ``exponents uint8 [n, 4 * ceil(d / 128)]``, one byte per block, padded with 127 to whole
    int32 words).
    """
    if scale_floor not in FP4_FLOORS or ties not in FP4_TIES:
        raise ValueError(f"scale_floor={scale_floor!r}, ties={ties!r}: scale_floor is one of "
                         f"{FP4_FLOORS}, ties one of {FP4_TIES}")
    n, d = x.shape
    blocks = x.float().reshape(n, d // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(-1)
    raw = (amax.clamp_min(AMAX_FLOOR) / FP4_E2M1_MAX if scale_floor == "amax"
           else (amax / FP4_E2M1_MAX).clamp_min(AMAX_FLOOR))
    exponent = _ceil_exponent(raw)
    scaled = blocks * (1.0 / (exponent << 23).view(torch.float32))[..., None]
    midpoints = torch.tensor(_E2M1_MIDPOINTS, device=x.device)
    # The midpoints below |x| (strictly, or at or below it for "even"): the code's magnitude.
    magnitude = torch.bucketize(scaled.abs(), midpoints, right=ties == "even").to(torch.uint8)
    if ties == "even":  # on a midpoint the count is the upper code: an odd one steps down
        on_midpoint = torch.isin(scaled.abs(), midpoints)
        magnitude -= (on_midpoint & (magnitude % 2 == 1)).to(torch.uint8)
    codes = magnitude | (((scaled < 0) & (magnitude != 0)).to(torch.uint8) << 3)
    codes = codes.reshape(n, d // 2, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed, _packed_words(exponent)


def _e4m3_of_code_bytes() -> Tensor:
    """uint8 ``[256, 2]``: the e4m3 bytes of a code byte's two elements (low nibble first)."""
    magnitude = torch.tensor(_E2M1).to(torch.float8_e4m3fn).view(torch.uint8)  # codes 0-7
    nibble = torch.arange(16)
    e4m3 = magnitude[nibble & 7] | torch.where((nibble >= 8) & (nibble != 8), 0x80, 0).to(torch.uint8)
    byte = torch.arange(256)
    return torch.stack([e4m3[byte & 0x0F], e4m3[byte >> 4]], dim=-1)


_E4M3_OF_CODE_BYTE = _e4m3_of_code_bytes()


def e2m1_to_e4m3(codes: Tensor, d: int) -> Tensor:
    """float8_e4m3fn ``[n, d]`` of packed e2m1 codes (uint8 or int8 ``[n, d / 2]``, element 2i
    in the low nibble): every e2m1 value is an e4m3 value, so this is exact (``-0`` becomes
    ``+0``, as DeepGEMM's ``cast_back_from_fp4`` reads it)."""
    raw = codes.view(torch.uint8)
    table = _E4M3_OF_CODE_BYTE.to(codes.device)
    return table[raw.long()].reshape(raw.shape[0], d).view(torch.float8_e4m3fn)


def mxfp4_dequantize(codes: Tensor, exponents: Tensor, d: int) -> Tensor:
    """float32 ``[n, d]`` of ``mxfp4_quantize``'s bytes: e2m1 value × 2**(exponent − 127)
    (DeepGEMM's ``cast_back_from_fp4``)."""
    scale = torch.exp2(exponents[:, : d // MX_BLOCK].float() - _UE8M0_ONE)
    return e2m1_to_e4m3(codes, d).float() * scale.repeat_interleave(MX_BLOCK, dim=1)


def ue8m0_bytes(scale: Tensor) -> Tensor:
    """uint8 exponent bytes of float32 power-of-two scales ``[n, blocks]``, padded with 127 to
    whole int32 words (``deep_gemm.utils.pack_ue8m0_to_int``)."""
    return _packed_words((scale.contiguous().view(torch.int32) >> 23) & 0xFF)


def mxfp8_quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """``deep_gemm.utils.per_token_cast_to_fp8(x, use_ue8m0=True, gran_k=32,
    use_packed_ue8m0=True)`` (DeepGEMM 559d79f, #377, ``deep_gemm/utils/math.py``), as bytes:
    per block of 32, ``s = 2**ceil(log2(max(amax, 1e-4) × fl32(1/448)))`` and the payload
    ``x × (1/s)`` rounded to e4m3 (``fp8.act_quant(x, 32, "ue8m0", reciprocal=True)``: the
    helper's bytes on CUDA, where ``amax / 448.0`` is that product).

    x: ``[n, d]`` floating, d a multiple of 32 (32, 64 or 128 upstream).
    Returns ``(payload float8_e4m3fn [n, d], exponents uint8 [n, 4 * ceil(d / 128)])``.
    """
    payload, scale = act_quant(x, MX_BLOCK, "ue8m0", reciprocal=True)
    return payload, ue8m0_bytes(scale)
