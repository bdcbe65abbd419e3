"""Kernel-shaped reference functions: one per upstream kernel contract.

A kernel author calls these with the kernel's own arguments (names, shapes, dtypes and
conventions of the upstream function named in each docstring) and compares the result with
the kernel's own metric (``calc_diff`` for DeepGEMM, ``check_allclose`` for FlashMLA, a set
comparison for top-k, bitwise for byte formats). Each function is a thin adapter: it reshapes
or reinterprets the arguments and picks a convention, then calls the pure functions the model
itself runs (``glm_dsa.fp8``, ``hadamard``, ``kv_format``, ``indexer``, ``mla``), so there is
one definition of every formula.

Outputs are float32 "truth" (float64 for float64 inputs) where the kernel would round to bf16.
Where upstream conventions changed between versions, the version is an explicit argument
(``lse_base``, ``lonely_lse``, ``scale_fmt``, ``base``, ``pad``); the snapshots (Sources in
docs/conventions.md): DeepGEMM 80ceeb2 (Sep 2025), 38f8ef7 (Nov 2025), 54e2261, and 559d79f
(#377, Jul 2026, the MXFP8 indexer; read from a fork carrying the upstream commit) for the MX
entry points; FlashMLA c28eca9 (Sep 2025), 9241ae3 (newest); tile-ai/tilelang a35008a;
fast-hadamard-transform e7706fa; DeepSeek-V3.2-Exp 3b99a53; SGLang 1875c52 for its FP4 index-K
writer, otherwise SGLang and vLLM unpinned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from glm_dsa import fp8, hadamard, indexer, mla
from glm_dsa.indexer import topk_transform_paged, topk_transform_ragged
from glm_dsa.validate import (
    check_compressed_width,
    check_mqa_logits_mode,
    check_pair,
    check_paged_kv_cache,
    check_q8kv8_scales,
    check_slots_read,
    need,
    paged_row_ends,
    shape_of,
)
from glm_dsa.kv_format import (
    MX_BLOCK,
    index_k_page_bytes,
    index_k_store,
    mla_kv_dequantize,
    mla_kv_quantize,
    mla_kv_row_bytes,
    e2m1_to_e4m3,
    index_k_page_split,
    mxfp4_quantize,
    mxfp8_quantize,
)

__all__ = [
    "hadamard_transform",
    "act_quant",
    "kv_cache_cast_to_fp8",
    "kv_cache_cast_to_fp4",
    "kv_cache_cast_to_mxfp8",
    "fp8_mqa_logits",
    "fp8_paged_mqa_logits",
    "fp8_fp4_mqa_logits",
    "fp8_fp4_paged_mqa_logits",
    "index_format",
    "topk_per_row",
    "fp8_mqa_topk",
    "fp8_paged_mqa_topk",
    "topk_transform_ragged",
    "topk_transform_paged",
    "quantize_k_cache",
    "dequantize_k_cache",
    "flash_mla_sparse_fwd",
    "sparse_mla_q8kv8_prefill_fwd",
    "flash_mla_sparse_decode",
    "flash_mla_sparse_decode_bf16",
    "calc_diff",
    "AllcloseResult",
    "check_allclose",
]

# FlashMLA V32_FP8Sparse: a 576-dim latent row = 512 quantized NoPE dims + 64 bf16 RoPE dims.
MLA_NOPE_DIM = 512
MLA_ROPE_DIM = 64
MLA_DIM = MLA_NOPE_DIM + MLA_ROPE_DIM
MLA_ROW_BYTES = mla_kv_row_bytes(MLA_NOPE_DIM, MLA_ROPE_DIM, "fp8")  # 656

# Temporaries of one row chunk of the sparse attention oracles, in bytes: a GLM-5.3 call (64
# heads, top-2048, bf16 kv) then runs 99 query rows per chunk (11 MB per row), large enough for
# the GEMMs; one call at 32,768 rows in a single chunk peaked at 145 GB.
SPARSE_BUDGET_BYTES = 1 << 30

# FlashMLA kernelkit: rel_err = |ans - ref| / (|ref| + 1e-6).
_REL_ERR_FLOOR = 1e-6
# FlashMLA kernelkit: cos_diff is 0 when the reference is (nearly) all zero.
_COS_REF_FLOOR = 1e-12


# ------------------------------------------------------------------------- numerics
def hadamard_transform(x: Tensor, scale: float = 1.0) -> Tensor:
    """``fast_hadamard_transform.hadamard_transform(x, scale)`` (fast-hadamard-transform e7706fa).

    ``(H @ x) * scale`` over the last dim in Sylvester order, ``H[i, j] = (-1)**popcount(i & j)``,
    unnormalized unless ``scale`` normalizes it (the V3.2 / GLM indexer uses ``128**-0.5``).
    As upstream, a last dim that is not a power of two is zero-padded to the next one and the
    result truncated back. Computed in float32 (float64 for float64 input), returned in
    ``x.dtype``; the same contract as ``sgl_kernel.hadamard_transform``.

    x: ``[..., dim]`` floating. Returns ``[..., dim]`` in ``x.dtype``.
    """
    need(isinstance(x, Tensor) and x.dim() >= 1, f"x must be a tensor [..., dim], got {shape_of(x)}")
    d = x.shape[-1]
    need(d >= 1, "x has an empty last dim; there is nothing to transform")
    padded = 1 << (d - 1).bit_length()
    if padded == d:
        return hadamard.hadamard_transform(x, scale)
    return hadamard.hadamard_transform(F.pad(x, (0, padded - d)), scale)[..., :d]


def act_quant(x: Tensor, block_size: int = 128, scale_fmt: str | None = None) -> tuple[Tensor, Tensor]:
    """``act_quant(x, block_size, scale_fmt)`` of DeepSeek-V3.2-Exp ``inference/kernel.py`` (3b99a53).

    Per block of ``block_size`` along the last dim: ``amax = max(|x|, 1e-4)``,
    ``s = amax / 448`` (``scale_fmt=None``) or ``2**ceil(log2(amax / 448))`` (``"ue8m0"``),
    ``x_fp8 = clamp(x / s, ±448)`` rounded to e4m3. ``amax / 448`` is ``amax × fl(1/448)``,
    as the V3.2 kernel computes it (``amax * fp8_max_inv``); the quotient ``x / s`` is taken in
    float32 (float64 for float64 input) with the float32 ``s`` that is returned. The bytes are
    the same on CPU and CUDA.

    x: ``[..., d]`` floating, ``d % block_size == 0``, finite.
    Returns ``(x_fp8 [..., d] float8_e4m3fn, scale [..., d // block_size] float32)``.
    """
    return fp8.act_quant(x, block_size, scale_fmt)


# ------------------------------------------------------------------------- index-K cache
def kv_cache_cast_to_fp8(k: Tensor) -> Tensor:
    """``kv_cache_cast_to_fp8(x)`` of DeepGEMM ``tests/test_attention.py`` (80ceeb2 … 54e2261).

    Quantizes index keys per token (one block of ``head_dim``) with DeepGEMM's test recipe,
    ``sf = max(amax, 1e-4) / 448`` as float32 (no ue8m0 rounding), and lays each block of
    ``block_size`` tokens out as DeepGEMM's paged index-K cache: the ``block_size × head_dim``
    e4m3 bytes (token t at ``t * head_dim``) then the ``block_size`` float32 scales (token t at
    ``block_size * head_dim + 4 t``); 8448 bytes per 64 × 128 block.

    The arithmetic is the helper's as PyTorch runs it on CUDA, on every device:
    ``sf = amax × fl32(1/448)`` (CUDA turns ``amax / 448.0`` into that product; the CPU would
    divide, which changes the last bit of about half the scales) and the payload
    ``x × fl32(1/sf)`` rounded to e4m3 (the helper's ``x * (1.0 / sf)``). So the bytes equal
    DeepGEMM's helper on CUDA exactly, and this function's own bytes are the same on CPU and
    CUDA. (``act_quant`` divides, ``x / sf``, as the V3.2 kernel does; on random bf16 keys
    about 1e-7 of the payload bytes differ from this multiply by the reciprocal.)

    k: ``[num_blocks, block_size, 1, head_dim]`` floating (bf16 in DeepGEMM's test).
    Returns uint8 ``[num_blocks, block_size, 1, head_dim + 4]`` (the fp8_paged_mqa_logits cache).
    """
    need(
        isinstance(k, Tensor) and k.dim() == 4 and k.shape[2] == 1,
        f"k must be [num_blocks, block_size, 1, head_dim] (one KV head), got {shape_of(k)}",
    )
    num_blocks, block_size, _, head_dim = k.shape
    need(num_blocks >= 1 and block_size >= 1, f"k has no tokens: shape {shape_of(k)}")
    k_fp8, k_scale = fp8.act_quant(
        k.reshape(num_blocks * block_size, head_dim), head_dim, None, reciprocal=True
    )
    pages = torch.zeros(
        (num_blocks, index_k_page_bytes(block_size, head_dim)), dtype=torch.uint8, device=k.device
    )
    slots = torch.arange(num_blocks * block_size, device=k.device)
    index_k_store(pages, slots, k_fp8, k_scale[:, 0], block_size)
    return pages.view(num_blocks, block_size, 1, head_dim + 4)


def _mx_pages(payload: Tensor, exponents: Tensor, num_blocks: int, block_size: int) -> Tensor:
    """uint8 ``[num_blocks, block_size, 1, payload_bytes + 4]``: each block's payloads
    (``[num_blocks * block_size, payload_bytes]`` uint8), then its exponent words."""
    need(exponents.shape[1] == 4, "one int32 of scales per token holds 4 blocks of 32: head_dim ≤ 128")
    pages = torch.cat([payload.reshape(num_blocks, -1), exponents.reshape(num_blocks, -1)], dim=1)
    return pages.view(num_blocks, block_size, 1, payload.shape[1] + 4)


def _check_index_keys(k: Tensor, head_dims: tuple[int, ...], what: str) -> tuple[int, int, int]:
    need(
        isinstance(k, Tensor) and k.dim() == 4 and k.shape[2] == 1,
        f"k must be [num_blocks, block_size, 1, head_dim] (one KV head), got {shape_of(k)}",
    )
    num_blocks, block_size, _, head_dim = k.shape
    need(head_dim in head_dims,
         f"head_dim={head_dim}: the {what} index-K cache takes {', '.join(map(str, head_dims))} dims")
    return num_blocks, block_size, head_dim


def kv_cache_cast_to_fp4(k: Tensor, scale_floor: str = "amax", ties: str = "smaller") -> Tensor:
    """``kv_cache_cast_to_fp4(x)`` of DeepGEMM 54e2261 ``tests/test_attention.py`` (renamed
    ``kv_cache_cast_to_mxfp4`` in 559d79f): the MXFP4 index-K cache of the SM100
    ``fp8_fp4_paged_mqa_logits`` (``kv_format`` has the layout).

    Each key is quantized by ``per_token_cast_to_fp4(use_ue8m0=True, gran_k=32,
    use_packed_ue8m0=True)`` (``kv_format.mxfp4_quantize``: ue8m0 scale
    ``2**ceil(log2(max(amax, 1e-4) / 6))`` per 32 elements, e2m1 codes, midpoints to the
    smaller magnitude) and each block of ``block_size`` tokens laid out as its
    ``block_size × D / 2`` code bytes then ``block_size`` int32 words of packed exponents:
    ``D / 2 + 4`` bytes per token (68 for D = 128). Upstream's helper also returns the
    dequantized keys; ``kv_format.mxfp4_dequantize`` gives them.

    SGLang's 68-byte index-K cache (``store_fp4_index_k_cache``, sgl-project/sglang 1875c52
    ``python/sglang/kernels/ops/attention/dsv4/fp4_indexer.py``, which #30546 ports to the
    GLM-5.x / V3.2 indexer, read by DeepGEMM's kernel) has this byte layout; its quantizer
    floors the scale, ``max(amax / 6, 1e-4)``, not amax (``scale_floor="scale"``, the
    ``sglang`` convention: different bytes only for blocks with amax < 6e-4, an all-zero key's
    exponent byte 114 instead of 112), and with ``rne=True`` takes midpoints to the even code
    (``ties="even"``).

    k: ``[num_blocks, block_size, 1, head_dim]`` floating (bf16 upstream), head_dim 64 or 128.
    Returns uint8 ``[num_blocks, block_size, 1, head_dim / 2 + 4]``.
    """
    num_blocks, block_size, head_dim = _check_index_keys(k, (64, 128), "MXFP4")
    codes, exponents = mxfp4_quantize(k.reshape(num_blocks * block_size, head_dim), scale_floor, ties)
    return _mx_pages(codes, exponents, num_blocks, block_size)


def kv_cache_cast_to_mxfp8(k: Tensor) -> Tensor:
    """``kv_cache_cast_to_mxfp8(x)`` of DeepGEMM 559d79f (#377, "Support MXFP8 indexer")
    ``tests/test_attention.py``: the MXFP8 index-K cache of the SM100 ``fp8_fp4_paged_mqa_logits``.

    Each key is quantized by ``per_token_cast_to_fp8(use_ue8m0=True, gran_k=32,
    use_packed_ue8m0=True)`` (``kv_format.mxfp8_quantize``: ue8m0 scale
    ``2**ceil(log2(max(amax, 1e-4) / 448))`` per 32 elements, payload ``x × (1/s)`` in e4m3)
    and each block of ``block_size`` tokens laid out as its ``block_size × D`` e4m3 bytes then
    ``block_size`` int32 words of exponent bytes (32 or 64 dims pad the word with 127 = 1.0):
    ``D + 4`` bytes per token, the FP8 cache's size (132 for D = 128) with ue8m0 exponents
    where ``kv_cache_cast_to_fp8`` has a float32 scale. Upstream's helper also returns the
    dequantized keys (``e4m3 × 2**(e − 127)`` per block).

    k: ``[num_blocks, block_size, 1, head_dim]`` floating (bf16 upstream), head_dim 32, 64 or 128.
    Returns uint8 ``[num_blocks, block_size, 1, head_dim + 4]``.
    """
    num_blocks, block_size, head_dim = _check_index_keys(k, (32, 64, 128), "MXFP8")
    payload, exponents = mxfp8_quantize(k.reshape(num_blocks * block_size, head_dim))
    return _mx_pages(payload.view(torch.uint8), exponents, num_blocks, block_size)


# ------------------------------------------------------------------------- indexer logits
def fp8_mqa_logits(
    q: Tensor,
    kv: tuple[Tensor, Tensor],
    weights: Tensor,
    cu_seqlen_ks: Tensor,
    cu_seqlen_ke: Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> Tensor:
    """``deep_gemm.fp8_mqa_logits`` with the Nov-2025 (38f8ef7) signature; newest (54e2261) keeps it.

    ``out[i, j] = kv[1][j] * sum_h weights[i, h] * relu(q[i, h] · kv[0][j])`` for
    ``j ∈ [ks[i], ke[i])``, each dot product exact, the rest in float32 (the DeepGEMM README
    formula; its newest test's "simulated" reference on the dequantized inputs).

    Args:
        q: ``[S, H, D]`` float8_e4m3fn (no q scale: it is folded into ``weights``).
        kv: ``(k_fp8 [S_kv, D] float8_e4m3fn, k_scale [S_kv] float32)``.
        weights: ``[S, H]`` float32.
        cu_seqlen_ks, cu_seqlen_ke: int32 ``[S]``, row i's keys ``[ks[i], ke[i])``.
        clean_logits: ``-inf`` outside ``[ks, ke)``. Upstream leaves those entries as garbage
            when False; here they hold the unmasked formula (0 outside the computed span).
        max_seqlen_k: 0 for the ``[S, S_kv]`` output. ``> 0`` selects the compressed output
            ``[S, max_seqlen_k]`` with ``out[i, j] ↔ key ks[i] + j``; as upstream it requires
            ``clean_logits=False`` and every ``ke - ks ≤ max_seqlen_k``; entries
            ``j ≥ ke[i] - ks[i]`` are unspecified upstream and ``-inf`` here.

    Returns:
        float32 ``[S, S_kv]``, or ``[S, max_seqlen_k]`` in compressed mode.
    """
    check_mqa_logits_mode(kv, clean_logits, max_seqlen_k)
    k_fp8, k_scale = kv
    if max_seqlen_k == 0:
        return indexer.mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits)
    full = indexer.mqa_logits(q, k_fp8, k_scale, weights, cu_seqlen_ks, cu_seqlen_ke, True)
    return _compressed(full, cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)


def _compressed(full: Tensor, ks: Tensor, ke: Tensor, max_seqlen_k: int) -> Tensor:
    """The compressed logits ``[S, max_seqlen_k]`` of cleaned ``full`` ``[S, S_kv]``: entry
    ``(i, j)`` is key ``ks[i] + j``, ``-inf`` from ``ke[i] - ks[i]`` on."""
    check_compressed_width(ks, ke, max_seqlen_k)
    lens = ke.long() - ks.long()
    col = torch.arange(max_seqlen_k, device=full.device)
    rows, cols = (col[None, :] < lens[:, None]).nonzero(as_tuple=True)
    out = torch.full((full.shape[0], max_seqlen_k), -math.inf, dtype=full.dtype, device=full.device)
    out[rows, cols] = full[rows, ks.long()[rows] + cols]
    return out


def fp8_paged_mqa_logits(
    q: Tensor,
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
) -> Tensor:
    """``deep_gemm.fp8_paged_mqa_logits`` with the Nov-2025 (38f8ef7) semantics.

    Upstream also takes ``schedule_meta`` (from ``get_paged_mqa_logits_metadata``) between
    ``block_table`` and ``max_context_len``: it only balances load across SMs, so it is not an
    argument here. Upstream's default is ``clean_logits=False`` and the newest version accepts
    only 2-D ``context_lens`` (which it never cleans); this oracle accepts both and cleans on
    request.

    Args:
        q: ``[B, next_n, H, D]`` float8_e4m3fn.
        kv_cache: uint8 ``[num_blocks, block_size, 1, D + 4]``: per block the
            ``block_size × D`` e4m3 bytes then ``block_size`` float32 scales
            (``kv_cache_cast_to_fp8``); any block stride.
        weights: ``[B * next_n, H]`` float32.
        context_lens: int32 ``[B]``: row ``(b, j)`` sees positions ``0 … ctx_b − next_n + j``;
            or int32 ``[B, next_n]``: row ``(b, j)`` sees positions ``< context_lens[b, j]``
            (DeepGEMM 54e2261 reads KV blocks only up to ``context_lens[b, next_n − 1]``, so
            there the last column must be the request's longest, as MTP makes it).
        block_table: int32 ``[B, max_blocks]``, the physical block of each logical block.
        max_context_len: output width in tokens.
        clean_logits: ``-inf`` outside each row's positions (else unspecified upstream; here
            the unmasked formula inside the request's context, 0 beyond).

    Returns:
        float32 ``[B * next_n, max_context_len]``.
    """
    num_blocks, block_size, head_dim = check_paged_kv_cache(q, kv_cache)
    # A block's bytes in row-major [block_size, D + 4] order are the page layout itself.
    pages = kv_cache.reshape(num_blocks, block_size * (head_dim + 4))
    return indexer.paged_mqa_logits(
        q, pages, weights, context_lens, block_table, max_context_len, clean_logits, block_size
    )


# ------------------------------------------------------------------------- MX indexer logits (SM100)
# The head dims DeepGEMM 559d79f takes per format (csrc/apis/attention.hpp: FP4 64 / 128,
# e4m3 32 / 64 / 128); one int32 word of exponent bytes per row holds four blocks of 32.
MX_HEAD_DIMS = {"mxfp8": (32, 64, 128), "mxfp4": (64, 128)}
LOGITS_DTYPES = (torch.float32, torch.bfloat16)
_MX_ELEMENT = {"mxfp8": torch.float8_e4m3fn, "mxfp4": torch.int8}


def index_format(q: tuple[Tensor, Tensor | None]) -> str:
    """``"fp8"``, ``"mxfp8"`` or ``"mxfp4"``: the key format a ``fp8_fp4_*mqa_logits`` call
    uses, read from ``q = (q_fp, q_sf)`` as DeepGEMM reads it (packed FP4 is int8 and needs
    ``q_sf``; e4m3 with ``q_sf`` is MXFP8, without it FP8 with the q scale in the gates)."""
    need(isinstance(q, (tuple, list)) and len(q) == 2,
         "q must be the pair (q_fp, q_sf): q_sf int32 for MXFP8 / MXFP4, None for FP8")
    q_fp, q_sf = q
    need(isinstance(q_fp, Tensor) and q_fp.dtype in (torch.float8_e4m3fn, torch.int8),
         f"q[0] must be float8_e4m3fn (FP8, MXFP8) or int8 packed e2m1 (MXFP4, DeepGEMM's "
         f"kPackedFP4), got {getattr(q_fp, 'dtype', type(q_fp).__name__)}")
    if q_fp.dtype == torch.int8:
        need(q_sf is not None, "q = (packed FP4, None): MXFP4 queries need their int32 ue8m0 scales q_sf")
        return "mxfp4"
    return "fp8" if q_sf is None else "mxfp8"


def _mx_dim(fmt: str, q_fp: Tensor, dims: int) -> int:
    need(q_fp.dim() == dims, f"q[0] must have {dims} dims, got {shape_of(q_fp)}")
    d = q_fp.shape[-1] * (2 if fmt == "mxfp4" else 1)
    need(d in MX_HEAD_DIMS[fmt], f"head_dim={d}: {fmt} takes {', '.join(map(str, MX_HEAD_DIMS[fmt]))}")
    return d


def _exponents(words: Tensor, d: int, name: str) -> Tensor:
    """The ue8m0 bytes of each row's int32 scale word (uint8 ``[..., 4]``, little-endian) that
    its ``d / 32`` blocks use: uint8 ``[..., d / 32]``."""
    exps = words[..., : d // MX_BLOCK].contiguous()
    need(not bool((exps == 255).any()),
         f"{name} holds the exponent byte 255, NaN in ue8m0: a writer clamps exponents to [1, 254]")
    return exps


def _mx_values(fp: Tensor, fmt: str, lead: tuple[int, ...], d: int, name: str) -> Tensor:
    """float8_e4m3fn ``[*lead, d]`` element values of ``fp`` (e4m3, or packed e2m1 codes)."""
    width = d // 2 if fmt == "mxfp4" else d
    need(isinstance(fp, Tensor) and fp.dtype == _MX_ELEMENT[fmt] and tuple(fp.shape) == (*lead, width),
         f"{name} must be {_MX_ELEMENT[fmt]} {(*lead, width)} ({fmt}), got "
         f"{getattr(fp, 'dtype', None)} {shape_of(fp)}")
    return fp if fmt == "mxfp8" else e2m1_to_e4m3(fp.reshape(-1, width), d).reshape(*lead, d)


def _mx_operand(fp: Tensor, sf: Tensor | None, fmt: str, lead: tuple[int, ...], d: int, name: str
                ) -> tuple[Tensor, Tensor]:
    """(element values e4m3 ``[*lead, d]``, exponent bytes uint8 ``[*lead, d / 32]``) of an
    MX operand ``(fp, sf)``, ``sf`` int32 ``[*lead]`` (four packed ue8m0 bytes per row)."""
    if not (isinstance(sf, Tensor) and sf.dtype == torch.int32 and tuple(sf.shape) == lead):
        raise ValueError(f"{name}[1] must be int32 {lead} (one word of four ue8m0 bytes per row), "
                         f"got {getattr(sf, 'dtype', None)} {shape_of(sf)}")
    words = sf.contiguous().view(torch.uint8).reshape(*lead, 4)
    return _mx_values(fp, fmt, lead, d, f"{name}[0]"), _exponents(words, d, f"{name}[1]")


def _check_logits_dtype(logits_dtype: torch.dtype) -> None:
    need(logits_dtype in LOGITS_DTYPES,
         f"logits_dtype={logits_dtype!r} must be torch.float32 or torch.bfloat16, as DeepGEMM's")


def fp8_fp4_mqa_logits(
    q: tuple[Tensor, Tensor | None],
    kv: tuple[Tensor, Tensor],
    weights: Tensor,
    cu_seq_len_k_start: Tensor,
    cu_seq_len_k_end: Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
    logits_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``deep_gemm.fp8_fp4_mqa_logits`` (54e2261: FP8 and MXFP4; 559d79f, #377: MXFP8 too),
    the ragged indexer logits in every key format; ``index_format`` reads which from ``q``.

    * FP8: ``q = (q_fp8 [S, H, D] e4m3, None)``, ``kv = (k_fp8 [S_kv, D] e4m3, k_scale [S_kv]
      float32)``: ``fp8_mqa_logits`` (q's scale in the gates).
    * MXFP8: ``q = (q_fp8 [S, H, D] e4m3, q_sf [S, H] int32)``, ``kv = (k_fp8 [S_kv, D],
      kv_sf [S_kv] int32)``, D 32 / 64 / 128; MXFP4: the same with int8 packed e2m1 codes
      ``[S, H, D / 2]`` and ``[S_kv, D / 2]`` (element 2i in the low nibble), D 64 / 128. Each
      int32 is four ue8m0 bytes, block j of 32 elements in byte j (little-endian; bytes past
      ``D / 32`` are padding, 127 from upstream's writers): the values are
      ``element × 2**(byte − 127)`` (DeepGEMM's test: ``cast_back_from_fp4`` /
      ``cast_back_from_fp8``; its reference then runs on those values). ``indexer.mx_mqa_logits``:
      ``out[i, j] = sum_h weights[i, h] * relu(q[i, h] · kv[j])`` on the values, each block's
      dot exact, the blocks summed in float64, the rest in float32. ``weights`` are the plain
      gates (the q scale is in ``q_sf``).

    Args:
        cu_seq_len_k_start, cu_seq_len_k_end: int32 ``[S]``, row i's keys ``[ks[i], ke[i])``.
        clean_logits, max_seqlen_k: as ``fp8_mqa_logits``.
        logits_dtype: ``torch.float32`` or ``torch.bfloat16``, the dtype the kernel writes; the
            oracle returns the float32 truth either way (the bf16 bound judges bf16 logits).
        weights: ``[S, H]`` float32 (float64 gives float64 logits; DeepGEMM's SM100 bf16 gates
            are exact in float32: pass ``weights.float()``).

    Returns:
        float32 ``[S, S_kv]``, or ``[S, max_seqlen_k]`` in compressed mode.
    """
    fmt = index_format(q)
    check_mqa_logits_mode(kv, clean_logits, max_seqlen_k)
    _check_logits_dtype(logits_dtype)
    q_fp, q_sf = q
    ks, ke = cu_seq_len_k_start, cu_seq_len_k_end
    if fmt == "fp8":
        return fp8_mqa_logits(q_fp, kv, weights, ks, ke, clean_logits, max_seqlen_k)
    d = _mx_dim(fmt, q_fp, 3)
    S, H = q_fp.shape[:2]
    need(isinstance(kv[0], Tensor) and kv[0].dim() == 2,
         f"kv[0] must be [S_kv, {d // 2 if fmt == 'mxfp4' else d}] ({fmt}), got {shape_of(kv[0])}")
    S_kv = kv[0].shape[0]
    q_vals, q_exp = _mx_operand(q_fp, q_sf, fmt, (S, H), d, "q")
    k_vals, k_exp = _mx_operand(kv[0], kv[1], fmt, (S_kv,), d, "kv")
    if max_seqlen_k == 0:
        return indexer.mx_mqa_logits(q_vals, q_exp, k_vals, k_exp, weights, ks, ke, clean_logits)
    full = indexer.mx_mqa_logits(q_vals, q_exp, k_vals, k_exp, weights, ks, ke, True)
    return _compressed(full, ks, ke, max_seqlen_k)


def fp8_fp4_paged_mqa_logits(
    q: tuple[Tensor, Tensor | None],
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
    logits_dtype: torch.dtype = torch.float32,
) -> Tensor:
    """``deep_gemm.fp8_fp4_paged_mqa_logits`` (54e2261: FP8 and MXFP4; 559d79f, #377: MXFP8),
    the paged indexer logits in every key format (``index_format`` reads it from ``q``).

    * FP8: ``q = (q_fp8 [B, next_n, H, D], None)``, the 132-byte cache of
      ``kv_cache_cast_to_fp8``: ``fp8_paged_mqa_logits``.
    * MXFP8 / MXFP4: ``q = (q_fp [B, next_n, H, D or D / 2], q_sf [B, next_n, H] int32)`` and
      ``kv_cache`` uint8 ``[num_blocks, block_kv, 1, D + 4]`` (``kv_cache_cast_to_mxfp8``) or
      ``[num_blocks, block_kv, 1, D / 2 + 4]`` (``kv_cache_cast_to_fp4``): per block the
      ``block_kv`` payloads, then ``block_kv`` int32 words of exponent bytes (upstream finds
      them at ``block_kv · payload`` bytes into the block; any block stride). block_kv is 32,
      64 or 128 upstream (SM100); the oracle takes any.

    ``indices`` (SM100's varlen mode) and ``schedule_meta`` are not arguments: the first groups
    the rows of one request for the scheduler (each row still has its own ``context_lens`` entry
    and block-table row, as upstream's test repeats them), the second balances load. Upstream
    defaults to ``clean_logits=False`` and takes only 2-D ``context_lens``; this oracle takes
    both forms and cleans on request (the ``deepgemm`` convention pins False), as
    ``fp8_paged_mqa_logits``. ``logits_dtype`` as ``fp8_fp4_mqa_logits``.

    Returns:
        float32 ``[B * next_n, max_context_len]``.
    """
    fmt = index_format(q)
    _check_logits_dtype(logits_dtype)
    q_fp, q_sf = q
    if fmt == "fp8":
        return fp8_paged_mqa_logits(q_fp, kv_cache, weights, context_lens, block_table,
                                    max_context_len, clean_logits)
    d = _mx_dim(fmt, q_fp, 4)
    B, next_n, H, width = q_fp.shape
    need(isinstance(kv_cache, Tensor) and kv_cache.dtype == torch.uint8 and kv_cache.dim() == 4
         and kv_cache.shape[2] == 1 and kv_cache.shape[3] == width + 4,
         f"kv_cache must be uint8 [num_blocks, block_kv, 1, {width + 4}] ({fmt}, head_dim {d}), got "
         f"{getattr(kv_cache, 'dtype', None)} {shape_of(kv_cache)}")
    num_blocks, block_kv = kv_cache.shape[:2]
    q_vals, q_exp = _mx_operand(q_fp, q_sf, fmt, (B, next_n, H), d, "q")
    payload, words = index_k_page_split(kv_cache.reshape(num_blocks, -1), block_kv, width)
    k_exp = _exponents(words, d, "kv_cache's exponent words")
    if fmt == "mxfp8":
        k_vals = payload.contiguous().view(torch.float8_e4m3fn)
    else:
        k_vals = e2m1_to_e4m3(payload.reshape(-1, width), d).reshape(num_blocks, block_kv, d)
    return indexer.mx_paged_mqa_logits(q_vals, q_exp, k_vals, k_exp, weights, context_lens,
                                       block_table, max_context_len, clean_logits)


# ------------------------------------------------------------------------- top-k
def topk_per_row(
    logits: Tensor,
    row_starts: Tensor,
    row_ends: Tensor,
    topk: int,
    base: str = "relative",
    pad: int = -1,
) -> Tensor:
    """Top-k columns of each row within ``[row_starts[r], row_ends[r])``.

    Mirrors SGLang ``sgl_kernel.fast_topk_v2`` and vLLM ``top_k_per_row_prefill`` /
    ``top_k_per_row_decode`` (``base="relative"``, ``pad=-1``) and TileLang a35008a
    ``examples/deepseek_v32/topk_selector.py`` ``tl_topk`` (``base="absolute"``, ``pad=0``).
    Kernels order their output freely and break ties arbitrarily, so compare as sets per row
    (equal-valued swaps allowed); this oracle's order is canonical: a row with
    ``len = end − start ≤ topk`` gives all its columns in index order (scores not read),
    otherwise the ``topk`` best by score descending, index ascending on ties. Entries outside a
    row's range are never read.

    Args:
        logits: ``[R, N]`` float32.
        row_starts, row_ends: int32 ``[R]``, ``0 ≤ start ≤ end ≤ N``.
        topk: indices per row.
        base: ``"relative"`` (index − row_start) or ``"absolute"`` (column index).
        pad: value of the ``topk − min(topk, len)`` unused entries at the end of each row.

    Returns:
        int32 ``[R, topk]``.
    """
    need(base in ("relative", "absolute"), f"base={base!r} must be 'relative' or 'absolute'")
    need(isinstance(pad, int) and not isinstance(pad, bool), f"pad={pad!r} must be an int")
    rel = indexer.topk_per_row(logits, row_starts, row_ends, topk)
    out = rel.long()
    if base == "absolute":
        out = out + row_starts.long()[:, None]
    return torch.where(rel >= 0, out, pad).to(torch.int32)


def fp8_mqa_topk(
    q: Tensor,
    kv: tuple[Tensor, Tensor],
    weights: Tensor,
    cu_seqlen_ks: Tensor,
    cu_seqlen_ke: Tensor,
    topk: int,
) -> Tensor:
    """The ragged (prefill) indexer end to end: ``fp8_mqa_logits`` and each row's top-k keys.

    What a fused score + top-k prefill kernel computes without writing the logits (LiteTopK,
    vllm-project/vllm #48726 and sglang #32094 / #40461; vLLM RFC #53563's exact fused SM90
    indexer, whose baseline is ``fp8_mqa_logits`` then ``top_k_per_row_prefill``): row ``i``
    scores keys ``[ks[i], ke[i])`` and keeps its ``topk`` best. Indices are relative to
    ``ks[i]``, as ``top_k_per_row_prefill`` and SGLang's ``fast_topk_v2`` return them; the
    metric is ``topk_margin``, as for ``fp8_paged_mqa_topk`` (a fused kernel ranks its own
    float32 scores, so near-ties within float32 rounding may come out either way).

    Args:
        q, kv, weights, cu_seqlen_ks, cu_seqlen_ke: as ``fp8_mqa_logits`` (q ``[S, H, D]``
            e4m3, kv ``(k_fp8 [S_kv, D] e4m3, k_scale [S_kv] float32)``, weights ``[S, H]``
            float32 with q's scale folded in, ks / ke int32 ``[S]``).
        topk: keys per row.

    Returns:
        int32 ``[S, topk]``: key positions relative to ``ks`` (``0 … ke − ks − 1``), ``-1``
        padded; a row with ``ke − ks ≤ topk`` lists ``0 … ke − ks − 1``.
    """
    need(isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1,
         f"topk={topk!r} must be a positive int")
    logits = fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke)
    return indexer.topk_per_row(logits, cu_seqlen_ks, cu_seqlen_ke, topk)


def fp8_paged_mqa_topk(
    q: Tensor,
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    topk: int,
) -> Tensor:
    """The paged indexer end to end: ``fp8_paged_mqa_logits`` and each row's top-k positions.

    What a fused score + top-k kernel computes (flashinfer-bench's ``dsa_topk_indexer_fp8_*``
    definitions, SGLang's and vLLM's decode indexers): the logits of every position a row sees,
    then its ``topk`` best positions. Such a kernel scores in its own float32 order, so two
    positions whose logits lie closer than that order's rounding may come out either way; the
    contract's metric (``topk_margin``) accepts any member whose exact score is within a stated
    tolerance of the k-th best, and this oracle's order is canonical (``topk_per_row``).

    Args:
        q, kv_cache, weights, context_lens, block_table: as ``fp8_paged_mqa_logits``.
        topk: positions per row.

    Returns:
        int32 ``[B * next_n, topk]``: positions in the request (``0 … len − 1``), ``-1`` padded;
        a row that sees ``len ≤ topk`` positions lists ``0 … len − 1``.
    """
    need(isinstance(topk, int) and not isinstance(topk, bool) and topk >= 1,
         f"topk={topk!r} must be a positive int")
    num_blocks, block_size, head_dim = check_paged_kv_cache(q, kv_cache)
    ends = visible_lens(context_lens, q.shape[1])
    width = -(-max(int(ends.max()), 1) // block_size) * block_size
    logits = fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, width)
    return indexer.topk_per_row(logits, torch.zeros_like(ends), ends, topk)


def visible_lens(context_lens: Tensor, next_n: int) -> Tensor:
    """int32 ``[B * next_n]``: how many positions row ``(b, j)`` of a paged call sees
    (``validate.paged_row_ends`` flattened: ``ctx_b − next_n + j + 1`` for 1-D ``context_lens``,
    ``context_lens[b, j]`` for 2-D)."""
    return paged_row_ends(context_lens, next_n).clamp_min(0).reshape(-1).to(torch.int32)


# ------------------------------------------------------------------------- FP8 MLA cache
def _as_bytes(t: Tensor, name: str) -> Tensor:
    """uint8 view of a 1-byte tensor: FlashMLA accepts the 656-byte cache as fp8, int8 or uint8."""
    need(
        isinstance(t, Tensor) and t.dtype in (torch.uint8, torch.int8, torch.float8_e4m3fn),
        f"{name} must be uint8, int8 or float8_e4m3fn bytes, got {getattr(t, 'dtype', type(t).__name__)}",
    )
    return t.view(torch.uint8)


def quantize_k_cache(kv: Tensor, scale_fmt: str | None = "ue8m0") -> Tensor:
    """FlashMLA ``tests/quant.py`` ``quantize_k_cache(k, FP8KVCacheLayout.V32_FP8Sparse)``.

    Per token 656 bytes: the 512 NoPE values as e4m3 in 4 tiles of 128, then the 4 float32 tile
    scales, then the 64 RoPE values as bf16, unquantized. Tile scale: newest FlashMLA (9241ae3,
    ``scale_fmt="ue8m0"``) ``s = 2**ceil(log2(max(amax / 448, 1e-4)))``; Sep 2025 (c28eca9)
    used the raw ``amax / 448`` (``scale_fmt=None``; here floored at ``1e-4 / 448`` so an
    all-zero tile does not divide by zero). ``amax / 448`` is ``amax × fl32(1/448)``, what
    upstream's ``.float() / 448.0`` gives on CUDA. Payload ``x / s`` rounded to e4m3. The bytes
    are the same on CPU and CUDA.

    kv: bfloat16 ``[num_blocks, block_size, 1, 576]`` (FlashMLA writes the RoPE part in the
    input's dtype, so only bf16 input gives the 656-byte layout).
    Returns uint8 ``[num_blocks, block_size, 1, 656]`` (FlashMLA returns the same bytes typed
    float8_e4m3fn; its kernels accept either).
    """
    need(
        isinstance(kv, Tensor) and kv.dim() == 4 and kv.shape[2] == 1 and kv.shape[3] == MLA_DIM,
        f"kv must be [num_blocks, block_size, 1, {MLA_DIM}], got {shape_of(kv)}",
    )
    need(
        kv.dtype == torch.bfloat16,
        f"kv must be bfloat16 for the 656-byte layout (its RoPE part is stored as bf16), got "
        f"{kv.dtype}",
    )
    num_blocks, block_size = kv.shape[:2]
    rows = kv.reshape(num_blocks * block_size, MLA_DIM)
    packed = mla_kv_quantize(rows[:, :MLA_NOPE_DIM], rows[:, MLA_NOPE_DIM:], scale_fmt)
    return packed.view(num_blocks, block_size, 1, MLA_ROW_BYTES)


def dequantize_k_cache(k_cache: Tensor) -> Tensor:
    """FlashMLA ``tests/quant.py`` ``dequantize_k_cache(k_cache, FP8KVCacheLayout.V32_FP8Sparse)``.

    NoPE: ``e4m3 * tile scale`` in float32, rounded once to bf16; RoPE: the stored bf16 values.
    With power-of-two (ue8m0) scales this equals the decode kernel's ``bf16(fp8) * bf16(scale)``.

    k_cache: ``[num_blocks, block_size, 1, 656]`` uint8 / int8 / float8_e4m3fn bytes.
    Returns bfloat16 ``[num_blocks, block_size, 1, 576]``.
    """
    raw = _as_bytes(k_cache, "k_cache")
    need(
        raw.dim() == 4 and raw.shape[2] == 1 and raw.shape[3] == MLA_ROW_BYTES,
        f"k_cache must be [num_blocks, block_size, 1, {MLA_ROW_BYTES}], got {shape_of(raw)}",
    )
    num_blocks, block_size = raw.shape[:2]
    rows = raw.reshape(num_blocks * block_size, MLA_ROW_BYTES)
    latent = mla_kv_dequantize(rows, MLA_NOPE_DIM, MLA_ROPE_DIM, torch.bfloat16)
    return latent.view(num_blocks, block_size, 1, MLA_DIM)


# ------------------------------------------------------------------------- sparse MLA
def flash_mla_sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
    lse_base: str = "e",
    lonely_lse: str = "+inf",
    budget_bytes: int = SPARSE_BUDGET_BYTES,
) -> tuple[Tensor, Tensor, Tensor]:
    """``flash_mla.flash_mla_sparse_fwd`` (sparse prefill), newest FlashMLA (9241ae3) by default.

    ``P = (q · kv[idx]) * sm_scale``, ``-inf`` where ``idx < 0``, ``idx ≥ s_kv`` or the column
    is ``≥ topk_length[row]``; ``max_logits = max P``, ``lse = logsumexp P``,
    ``out = exp(P − logaddexp(lse, attn_sink)) @ kv[idx, :d_v]`` (FlashMLA ``tests/ref.py``).
    A row with no valid index: ``out = 0``, ``max_logits = −inf``, ``lse = +inf``.
    The September-2025 kernel (c28eca9) is ``lse_base="2", lonely_lse="-inf"``: ``max_logits``
    and ``lse`` of ``P · log2(e)`` in base 2, and ``lse = −inf`` for a lonely row (the README
    still documents base 2). ``attn_sink`` and ``topk_length`` appeared after Sep 2025.

    Args:
        q: ``[s_q, h_q, d_qk]`` (bf16 upstream; 576 = 512 latent + 64 RoPE).
        kv: ``[s_kv, 1, d_qk]``; values are ``kv[..., :d_v]``.
        indices: int32 ``[s_q, 1, topk]``, rows of ``kv``.
        sm_scale: the MLA softmax scale (not ``d_qk**-0.5``).
        d_v: value width (512).
        attn_sink: optional float32 ``[h_q]``; topk_length: optional int32 ``[s_q]``.
        lse_base: ``"e"`` (newest) or ``"2"`` (Sep 2025); lonely_lse: ``"+inf"`` or ``"-inf"``.
        budget_bytes: not an upstream argument. Rows are attended in chunks whose temporaries
            (gathered keys, scores, masks) fit this many bytes, so the peak memory is the
            inputs, the outputs and at most ``budget_bytes`` more (one tile's temporaries if
            that is larger: 16 rows of ``topk · d_qk`` keys and ``h_q · topk`` scores, 173 MB
            for GLM-5.3 with a bf16 kv, 394 MB in float64). The results do not depend on it,
            bit for bit, on every MKL path (the products run 16 rows per call).

    Returns:
        ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])`` in float32 (float64
        for float64 inputs); upstream returns ``out`` in bf16.
    """
    return mla.sparse_mla_fwd(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length, lse_base, lonely_lse, budget_bytes
    )


def sparse_mla_q8kv8_prefill_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    q_scale: Tensor,
    kv_scale: Tensor,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
    budget_bytes: int = SPARSE_BUDGET_BYTES,
) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's FP8-query × FP8-KV sparse MLA prefill (Q8KV8), ``sparse_mla_q8kv8_prefill_fwd``.

    sgl-project/sglang #25751 (SM90 kernel), served since #30514 as ``--dsa-prefill-backend
    flashmla_sparse_q8``: ``python/sglang/jit_kernel/sparse_mla_q8kv8_prefill_sm90.py`` and its
    test ``tests/test_sparse_mla_q8kv8_prefill_sm90.py`` (read 2026-12-02). Both operands are
    e4m3 payloads with one float32 scale each for the whole tensor: the values are
    ``q.float() * q_scale`` and ``kv.float() * kv_scale`` (the RoPE dims quantized with the
    rest, unlike the 656-byte cache), and the attention is ``flash_mla_sparse_fwd``'s on those
    dequantized values (FlashMLA 9241ae3's conventions: natural-log ``lse``, a row with no
    valid index gives ``out = 0``, ``max_logits = −inf``, ``lse = +inf``; indices ``< 0`` or
    ``≥ s_kv`` skipped). This is the "dequantized-FP8 float32 reference" SGLang measures the
    kernel against; the kernel also rounds the softmax weights to e4m3 for its second FP8 GEMM,
    which is what the contract's tolerance on ``out`` allows for (``Q8KV8_OUT_TOL``).

    Args:
        q: float8_e4m3fn ``[s_q, h_q, d_qk]`` (d_qk 576, or 512 without RoPE).
        kv: float8_e4m3fn ``[s_kv, 1, d_qk]``; values are ``kv[..., :d_v]``.
        indices: int32 ``[s_q, 1, topk]`` (the kernel takes topk a multiple of 128).
        sm_scale: the softmax scale, applied to the dequantized scores.
        q_scale, kv_scale: float32 one-element tensors (float64 gives float64 outputs).
        d_v: 512 (the only value the kernel takes).
        attn_sink: float32 ``[h_q]`` and topk_length: int32 ``[s_q]``, both or neither (the
            kernel's full path takes the two together).
        budget_bytes: as ``flash_mla_sparse_fwd``.

    Returns:
        ``(out [s_q, h_q, d_v], max_logits [s_q, h_q], lse [s_q, h_q])`` in float32 (float64
        with float64 scales); the kernel returns ``out`` in bf16.
    """
    for name, t in (("q", q), ("kv", kv)):
        need(isinstance(t, Tensor) and t.dtype == torch.float8_e4m3fn and t.dim() == 3,
             f"{name} must be float8_e4m3fn with 3 dims, got {getattr(t, 'dtype', None)} {shape_of(t)}")
    check_q8kv8_scales(q_scale, kv_scale, attn_sink, topk_length, (torch.float32, torch.float64))
    dtype = torch.float64 if torch.float64 in (q_scale.dtype, kv_scale.dtype) else torch.float32
    q_values = q.to(dtype) * q_scale.to(dtype).reshape(())
    kv_values = kv.to(dtype) * kv_scale.to(dtype).reshape(())
    return mla.sparse_mla_fwd(q_values, kv_values, indices, sm_scale, d_v, attn_sink, topk_length,
                              budget_bytes=budget_bytes)


def flash_mla_sparse_decode(
    q: Tensor,
    k_cache: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Tensor | None = None,
    attn_sink: Tensor | None = None,
    budget_bytes: int = SPARSE_BUDGET_BYTES,
) -> tuple[Tensor, Tensor]:
    """``flash_mla.flash_mla_with_kvcache`` in sparse FP8 mode (``is_fp8_kvcache=True``,
    ``indices`` given), newest FlashMLA (9241ae3); FlashMLA ``tests/ref.py``
    ``ref_sparse_attn_decode``.

    Attention is computed on the dequantized cache (``dequantize_k_cache``), which isolates a
    kernel's error from the quantization error, as FlashMLA's test does. ``indices`` are
    physical slots ``block * block_size + offset`` (``topk_transform_paged``). Only ``-1`` is
    invalid (and columns ``≥ topk_length[b]``, which are not read); any other value outside
    ``[0, num_blocks * block_size)`` is a ValueError (the kernel would read out of bounds).
    ``attn_sink`` scales the output by ``exp(lse) / (exp(lse) + exp(sink))`` and is not part of
    the returned ``lse``. A row with no valid index: ``out = 0``, ``lse = +inf``. The block
    table, cache lengths and scheduler metadata of the upstream call do not affect the sparse
    result, so they are not arguments.

    Args:
        q: ``[b, s_q, h_q, 576]`` (bf16 upstream).
        k_cache: ``[num_blocks, block_size, 1, 656]`` bytes (``quantize_k_cache``).
        indices: int32 ``[b, s_q, topk]`` physical slots, ``-1`` padding.
        sm_scale: the MLA softmax scale.
        d_v: value width (512).
        topk_length: optional int32 ``[b]``, leading index columns used per batch entry.
        attn_sink: optional float32 ``[h_q]``.
        budget_bytes: bound on the attention's temporaries, as in ``flash_mla_sparse_fwd``
            (the dequantized bf16 cache, input-sized, comes on top).

    Returns:
        ``(out [b, s_q, h_q, d_v], lse [b, h_q, s_q])`` in float32 (float64 for float64 q);
        natural-log ``lse``; upstream returns ``out`` in bf16.
    """
    return _sparse_decode(q, dequantize_k_cache(k_cache), indices, sm_scale, d_v, topk_length,
                          attn_sink, "e", "+inf", budget_bytes)


def flash_mla_sparse_decode_bf16(
    q: Tensor,
    k_cache: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    topk_length: Tensor | None = None,
    attn_sink: Tensor | None = None,
    lse_base: str = "e",
    lonely_lse: str = "+inf",
    budget_bytes: int = SPARSE_BUDGET_BYTES,
) -> tuple[Tensor, Tensor]:
    """Sparse MLA decode over a bf16 paged cache: ``flash_mla.flash_mla_with_kvcache``'s sparse
    interface with ``is_fp8_kvcache=False``, FlashMLA 9241ae3 ``tests/ref.py``
    ``ref_sparse_attn_decode`` on the cache as it is (no quantization).

    FlashMLA 9241ae3 builds its sparse decode kernels for the FP8 layouts only
    (``csrc/api/sparse_decode.h``: V32 and MODEL1 caches); a bf16 cache is what
    flashinfer-bench's DSA decode definitions and contest kernels read (``[c | k_pe]`` rows of
    576 bf16 values, 1152 bytes, ``kv_format.mla_kv_pack_bf16``). The contract is
    ``flash_mla_sparse_decode``'s with that cache: ``indices`` are physical slots
    ``block * block_size + offset`` (any ``block_size``), only ``-1`` is padding (any other
    value outside the cache is a ValueError), columns ``≥ topk_length[b]`` are not read (so
    whatever those slots hold, NaN included, does not matter), ``attn_sink`` scales the output by
    ``exp(lse) / (exp(lse) + exp(sink))`` and is not in ``lse``, a query with no valid slot gives
    ``out = 0`` and ``lse = +inf``. ``lse_base="2", lonely_lse="-inf"`` is the convention of
    flashinfer-bench's DSA definitions (``flashinfer`` here, as ``flash_mla_sparse_fwd``'s
    ``sep2025``).

    Args:
        q: ``[b, s_q, h_q, 576]`` (bf16 upstream; float64 gives float64 outputs).
        k_cache: ``[num_blocks, block_size, 1, 576]`` bf16 (float32 / float64 accepted).
        indices, sm_scale, d_v, topk_length, attn_sink, budget_bytes: as
            ``flash_mla_sparse_decode``.
        lse_base: ``"e"`` or ``"2"``; lonely_lse: ``"+inf"`` or ``"-inf"``.

    Returns:
        ``(out [b, s_q, h_q, d_v], lse [b, h_q, s_q])`` in float32 (float64 for float64 inputs);
        upstream kernels return ``out`` in bf16.
    """
    need(isinstance(k_cache, Tensor) and k_cache.is_floating_point() and k_cache.dim() == 4
         and k_cache.shape[2] == 1 and k_cache.shape[3] == MLA_DIM,
         f"k_cache must be a bf16 [num_blocks, block_size, 1, {MLA_DIM}] cache (dequantize an FP8 "
         f"one, or use flash_mla_sparse_decode), got {getattr(k_cache, 'dtype', None)} {shape_of(k_cache)}")
    return _sparse_decode(q, k_cache, indices, sm_scale, d_v, topk_length, attn_sink, lse_base,
                          lonely_lse, budget_bytes)


def _sparse_decode(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int,
                   topk_length: Tensor | None, attn_sink: Tensor | None, lse_base: str,
                   lonely_lse: str, budget_bytes: int) -> tuple[Tensor, Tensor]:
    """The sparse decode of either cache, on its rows ``kv [num_blocks, block_size, 1, 576]``."""
    need(
        isinstance(q, Tensor) and q.dim() == 4 and q.shape[3] == MLA_DIM,
        f"q must be [b, s_q, h_q, {MLA_DIM}], got {shape_of(q)}",
    )
    b, s_q, h_q, _ = q.shape
    num_slots = kv.shape[0] * kv.shape[1]
    need(
        isinstance(indices, Tensor)
        and indices.dtype == torch.int32
        and indices.dim() == 3
        and indices.shape[:2] == (b, s_q),
        f"indices must be int32 [b={b}, s_q={s_q}, topk], got {getattr(indices, 'dtype', None)} "
        f"{shape_of(indices)}",
    )
    topk = indices.shape[2]
    read = torch.ones_like(indices, dtype=torch.bool)
    row_lengths = None
    if topk_length is not None:
        need(
            isinstance(topk_length, Tensor)
            and topk_length.dtype == torch.int32
            and topk_length.shape == (b,),
            f"topk_length must be int32 [b={b}] (one length per batch entry), got "
            f"{getattr(topk_length, 'dtype', None)} {shape_of(topk_length)}",
        )
        column = torch.arange(topk, device=indices.device)
        read = (column[None, None, :] < topk_length[:, None, None]).expand(b, s_q, topk)
        row_lengths = topk_length.repeat_interleave(s_q)
    check_slots_read(indices, read, num_slots)
    out, _, lse = mla.sparse_mla_fwd(
        q.reshape(b * s_q, h_q, MLA_DIM),
        kv.reshape(num_slots, 1, MLA_DIM),
        indices.reshape(b * s_q, 1, topk),
        sm_scale,
        d_v,
        attn_sink,
        row_lengths,
        lse_base,
        lonely_lse,
        budget_bytes=budget_bytes,
    )
    return out.view(b, s_q, h_q, d_v), lse.view(b, s_q, h_q).transpose(1, 2).contiguous()


# ------------------------------------------------------------------------- metrics
def calc_diff(x: Tensor, y: Tensor) -> float:
    """DeepGEMM ``deep_gemm.testing.calc_diff``: ``1 − 2 Σxy / Σ(x² + y²)`` in float64.

    0 for identical tensors; about half the mean squared relative error for small errors.
    Upstream tests zero the ``-inf`` mask in both tensors first (after checking the masks are
    equal); so must the caller: non-finite input is a ValueError. Two all-zero tensors give 0
    (upstream: NaN).
    """
    check_pair(x, y, "calc_diff")
    x64, y64 = x.double(), y.double()
    need(
        bool(torch.isfinite(x64).all() and torch.isfinite(y64).all()),
        "calc_diff needs finite tensors: check the -inf masks are equal, then zero the masked "
        "entries in both (as DeepGEMM's tests do)",
    )
    denominator = float((x64 * x64 + y64 * y64).sum())
    if denominator == 0.0:
        return 0.0
    return 1.0 - 2.0 * float((x64 * y64).sum()) / denominator


@dataclass(frozen=True)
class AllcloseResult:
    """Outcome of ``check_allclose``; ``passed`` is the verdict, the rest says why.

    Attributes:
        passed: every element within tolerance, special values in the same places, and
            ``|cos_diff| ≤ cos_diff_tol``.
        cos_diff: ``1 − 2 Σ ans·ref / Σ(ans² + ref²)`` after zeroing ±inf/NaN (0 when
            ``Σ ref² < 1e-12``).
        max_abs_err, max_rel_err: largest ``|ans − ref|`` and ``|ans − ref| / (|ref| + 1e-6)``.
        num_failed: elements with ``abs_err ≥ abs_tol`` and ``rel_err ≥ rel_tol``.
        anomaly: first mismatch of +inf / −inf / NaN positions, as text; None if they match.
        first_failure: index of the first element (row-major) that fails either test; None.
        worst_element: the element test's deciding value, ``max min(abs_err / abs_tol,
            rel_err / rel_tol)`` (a zero tolerance counts as ∞): an element fails iff its value
            is ≥ 1, so ``num_failed == 0`` iff this is < 1. The largest ``abs_err`` and the
            largest ``rel_err`` usually sit at different elements and do not decide.
    """

    passed: bool
    cos_diff: float
    max_abs_err: float
    max_rel_err: float
    num_failed: int
    anomaly: str | None
    first_failure: tuple[int, ...] | None
    worst_element: float = 0.0


def _first_index(mask: Tensor) -> tuple[int, ...] | None:
    hits = mask.nonzero()
    return tuple(int(v) for v in hits[0]) if hits.shape[0] else None


def check_allclose(
    ans: Tensor, ref: Tensor, abs_tol: float, rel_tol: float, cos_diff_tol: float
) -> AllcloseResult:
    """FlashMLA ``tests/kernelkit/compare.py`` ``check_is_allclose`` (9241ae3), as a result.

    +inf, −inf and NaN must sit at the same positions in ``ans`` and ``ref``; they are then
    zeroed. An element passes if ``|ans − ref| < abs_tol`` or
    ``|ans − ref| / (|ref| + 1e-6) < rel_tol``; the tensors pass if every element does and
    ``|cos_diff| ≤ cos_diff_tol``. Computed in float64 (upstream: float32 errors, float64
    cos_diff); ``ans`` and ``ref`` may differ in dtype (upstream requires one dtype).

    FlashMLA's tolerances: sparse prefill ``out`` 8e-4 / 3.01/128 / 7e-6, ``max_logits`` and
    ``lse`` 1e-6 / 2.01/65536 / 1e-7; sparse decode ``out`` 1e-3 / 2.01/128 / 5e-6, ``lse``
    1e-6 / 8.01/65536 / 1e-7.
    """
    check_pair(ans, ref, "check_allclose")
    for name, tol in (("abs_tol", abs_tol), ("rel_tol", rel_tol), ("cos_diff_tol", cos_diff_tol)):
        need(
            isinstance(tol, (int, float)) and math.isfinite(tol) and tol >= 0,
            f"{name}={tol!r} must be a finite non-negative number",
        )
    a, r = ans.double().clone(), ref.double().clone()
    anomaly, first_anomaly = None, None
    for label, is_special in (
        ("+inf", lambda t: torch.isposinf(t)),
        ("-inf", lambda t: torch.isneginf(t)),
        ("NaN", lambda t: torch.isnan(t)),
    ):
        a_mask, r_mask = is_special(a), is_special(r)
        mismatch = a_mask ^ r_mask
        if anomaly is None and bool(mismatch.any()):
            first_anomaly = _first_index(mismatch)
            anomaly = (
                f"{label} at {int(a_mask.sum())} positions in ans, {int(r_mask.sum())} in ref; "
                f"first difference at {first_anomaly}"
            )
        a.masked_fill_(a_mask, 0.0)
        r.masked_fill_(r_mask, 0.0)
    abs_err = (a - r).abs()
    rel_err = abs_err / (r.abs() + _REL_ERR_FLOOR)
    failed = (abs_err >= abs_tol) & (rel_err >= rel_tol)
    ref_sq = float((r * r).sum())
    cos_diff = 0.0 if ref_sq < _COS_REF_FLOOR else 1.0 - 2.0 * float((a * r).sum()) / (
        ref_sq + float((a * a).sum())
    )
    first_failure = _first_index(failed)
    if first_anomaly is not None and (first_failure is None or first_anomaly < first_failure):
        first_failure = first_anomaly
    num_failed = int(failed.sum())
    empty = abs_err.numel() == 0

    def over(err: Tensor, tol: float) -> Tensor:  # err in units of its tolerance
        return err / tol if tol > 0 else torch.full_like(err, math.inf)

    worst = torch.minimum(over(abs_err, abs_tol), over(rel_err, rel_tol))
    return AllcloseResult(
        passed=anomaly is None and num_failed == 0 and abs(cos_diff) <= cos_diff_tol,
        cos_diff=cos_diff,
        max_abs_err=0.0 if empty else float(abs_err.max()),
        max_rel_err=0.0 if empty else float(rel_err.max()),
        num_failed=num_failed,
        anomaly=anomaly,
        first_failure=first_failure,
        worst_element=0.0 if empty else float(worst.max()),
    )
