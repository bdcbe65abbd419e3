"""Argument validation of the kernel contracts, shared by the oracle, the reference model,
``glm_dsa.kernels`` and ``glm_dsa.peers``.

One idiom: ``need(ok, message)`` raises ``ValueError(message)``, a one-line message naming the
argument, what it must be and what it got. Each ``check_*`` validates the arguments one
contract shares between its implementations, before any compute; cores called on checked
arguments do not check again. Range checks run on the device tensors (one synchronization for
the verdict), never by copying index vectors to the host.
"""

from __future__ import annotations

import torch
from torch import Tensor

from glm_dsa import syncfree
from glm_dsa.kv_format import index_k_page_bytes, mla_kv_row_bytes

__all__ = [
    "MAX_EXACT_DIM",
    "paged_row_ends",
    "need",
    "shape_of",
    "check_index_vector",
    "check_ranges",
    "check_logits_inputs",
    "check_ragged_logits_inputs",
    "check_indexer_topk_inputs",
    "check_paged_inputs",
    "check_paged_rows",
    "check_ragged_rows",
    "check_block_exponents",
    "check_mqa_logits_mode",
    "check_compressed_width",
    "check_paged_kv_cache",
    "check_slots_read",
    "check_pair",
    "check_sparse_inputs",
    "check_sparse_conventions",
    "check_q8kv8_scales",
    "check_fp8_pool_rows",
]

# Dot products of E4M3 vectors are exact in float64 up to this length (indexer._dot_products).
MAX_EXACT_DIM = 2**16


def need(ok: bool, msg: str) -> None:
    """``ValueError(msg)`` unless ``ok``."""
    if not ok:
        raise ValueError(msg)


def shape_of(t) -> str:
    """A tensor's shape as a tuple string, or the type name of what was passed instead."""
    return str(tuple(t.shape)) if isinstance(t, Tensor) else type(t).__name__


def check_ranges(ks: Tensor, ke: Tensor, num_cols: int, what: str) -> None:
    """Every row's window satisfies ``0 ≤ ks ≤ ke ≤ num_cols`` (``what`` names ``num_cols``);
    the first bad row is named."""
    bad = (ks < 0) | (ks > ke) | (ke > num_cols)

    def first_bad_row() -> str:
        m = int(bad.nonzero()[0, 0])
        return f"row {m}: [ks, ke) = [{int(ks[m])}, {int(ke[m])}) must satisfy 0 ≤ ks ≤ ke ≤ {what}={num_cols}"

    syncfree.check(~bad.any(), f"a row's [ks, ke) breaks 0 ≤ ks ≤ ke ≤ {what}={num_cols}", first_bad_row)


def check_index_vector(name: str, t: Tensor, n: int, device: torch.device) -> None:
    need(
        isinstance(t, Tensor) and t.dim() == 1 and t.shape[0] == n,
        f"{name} must be a 1-D tensor of {n} entries, got "
        f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}",
    )
    need(
        t.dtype in (torch.int32, torch.int64),
        f"{name} must be int32 (or int64), got {t.dtype}",
    )
    need(t.device == device, f"{name} is on {t.device}, the other inputs on {device}")


def check_logits_inputs(q_fp8, k_fp8, k_scale, weights) -> tuple[int, int, int, int]:
    need(
        q_fp8.dtype == torch.float8_e4m3fn and q_fp8.dim() == 3,
        f"q_fp8 must be float8_e4m3fn [S, H, D], got {q_fp8.dtype} {tuple(q_fp8.shape)}",
    )
    S, H, D = q_fp8.shape
    need(D <= MAX_EXACT_DIM, f"head dim D={D} exceeds {MAX_EXACT_DIM}, the exact-dot limit")
    need(
        k_fp8.dtype == torch.float8_e4m3fn and k_fp8.dim() == 2 and k_fp8.shape[1] == D,
        f"k_fp8 must be float8_e4m3fn [S_kv, D={D}], got {k_fp8.dtype} {tuple(k_fp8.shape)}",
    )
    S_kv = k_fp8.shape[0]
    need(
        k_scale is None or (k_scale.dtype == torch.float32 and tuple(k_scale.shape) == (S_kv,)),
        f"k_scale must be float32 [S_kv={S_kv}], got {getattr(k_scale, 'dtype', None)} {shape_of(k_scale)}",
    )
    need(
        weights.dtype in (torch.float32, torch.float64) and tuple(weights.shape) == (S, H),
        f"weights must be float32 (or float64) [S={S}, H={H}], got {weights.dtype} "
        f"{tuple(weights.shape)}",
    )
    dev = q_fp8.device
    for name, t in (("k_fp8", k_fp8), ("k_scale", k_scale), ("weights", weights)):
        if t is not None:
            need(t.device == dev, f"{name} is on {t.device}, q_fp8 on {dev}")
    return S, H, D, S_kv


def check_block_exponents(name: str, exponents, lead: tuple[int, ...], D: int, device) -> None:
    """``exponents`` are uint8 ue8m0 bytes ``[*lead, D / 32]`` (one per block of 32 elements,
    ``indexer.mx_mqa_logits``) on ``device``."""
    need(D % 32 == 0, f"head dim D={D} must be a multiple of 32 (one ue8m0 scale per 32 elements)")
    want = (*lead, D // 32)
    need(isinstance(exponents, Tensor) and exponents.dtype == torch.uint8
         and tuple(exponents.shape) == want,
         f"{name} must be uint8 ue8m0 exponent bytes {want}, got "
         f"{getattr(exponents, 'dtype', None)} {shape_of(exponents)}")
    need(exponents.device == device, f"{name} is on {exponents.device}, q on {device}")


def check_ragged_logits_inputs(q_fp8, k_fp8, k_scale, weights, ks, ke) -> None:
    """``mqa_logits``' inputs: the logits operands, then ``0 ≤ ks ≤ ke ≤ S_kv`` per row."""
    S, _, _, S_kv = check_logits_inputs(q_fp8, k_fp8, k_scale, weights)
    check_ragged_rows(ks, ke, S, S_kv, q_fp8.device)


def check_ragged_rows(ks: Tensor, ke: Tensor, S: int, S_kv: int, device) -> None:
    """``S`` rows' key windows: int32 ``[S]`` each, ``0 ≤ ks ≤ ke ≤ S_kv``."""
    check_index_vector("ks", ks, S, device)
    check_index_vector("ke", ke, S, device)
    check_ranges(ks, ke, S_kv, "S_kv")


def check_indexer_topk_inputs(q_fp8, weights, k_fp8, k_scale, ks, ke, topk) -> None:
    """``indexer_topk``'s inputs (every backend's): ``mqa_logits``' and a positive ``topk``."""
    check_ragged_logits_inputs(q_fp8, k_fp8, k_scale, weights, ks, ke)
    need(isinstance(topk, int) and topk >= 1, f"topk={topk!r} must be a positive int")


def paged_row_ends(context_lens: Tensor, next_n: int) -> Tensor:
    """int64 ``[B, next_n]``: how many positions row ``(b, j)`` of a paged call sees.
    ``context_lens [B]``: the last ``next_n`` context tokens are the step's queries, each seeing
    itself (``ctx_b - next_n + j + 1``, at least 0); ``[B, next_n]``: the values themselves."""
    ends = context_lens.long()
    if context_lens.dim() == 1:
        offsets = torch.arange(next_n, device=ends.device) - next_n + 1
        ends = (ends[:, None] + offsets).clamp_min(0)
    return ends


def check_paged_inputs(
    q_fp8, index_k_pages, weights, context_lens, block_table, max_context_len, page_size
) -> Tensor:
    """Check ``paged_mqa_logits``' inputs; returns each request's row ends, int64 ``[B, next_n]``
    on the inputs' device (row ``(b, j)`` sees positions ``< ends[b, j]``). The ends are checked
    there; only a failing row's numbers come to the host, to be named."""
    need(
        q_fp8.dtype == torch.float8_e4m3fn and q_fp8.dim() == 4,
        f"q_fp8 must be float8_e4m3fn [B, next_n, H, D], got {q_fp8.dtype} {tuple(q_fp8.shape)}",
    )
    B, next_n, H, D = q_fp8.shape
    page_bytes = index_k_page_bytes(page_size, D)
    need(
        index_k_pages.dtype == torch.uint8
        and index_k_pages.dim() == 2
        and index_k_pages.shape[1] == page_bytes,
        f"index_k_pages must be uint8 [num_pages, {page_bytes}] (page_size={page_size}, D={D}), "
        f"got {index_k_pages.dtype} {tuple(index_k_pages.shape)}",
    )
    need(index_k_pages.device == q_fp8.device,
         f"index_k_pages is on {index_k_pages.device}, q_fp8 on {q_fp8.device}")
    return check_paged_rows(B, next_n, H, weights, context_lens, block_table, max_context_len,
                            page_size, q_fp8.device)


def check_paged_rows(B: int, next_n: int, H: int, weights, context_lens, block_table,
                     max_context_len, page_size: int, dev) -> Tensor:
    """The per-row arguments of a paged logits call of ``B`` requests, ``next_n`` rows each,
    ``H`` heads (every key format's: ``check_paged_inputs``, the MX oracles): gates, context
    lengths, block table, output width; returns the row ends, int64 ``[B, next_n]`` on ``dev``
    (row ``(b, j)`` sees positions ``< ends[b, j]``), checked there."""
    need(
        weights.dtype in (torch.float32, torch.float64)
        and tuple(weights.shape) == (B * next_n, H),
        f"weights must be float32 [B * next_n={B * next_n}, H={H}], got {weights.dtype} "
        f"{tuple(weights.shape)}",
    )
    need(
        context_lens.dtype in (torch.int32, torch.int64)
        and tuple(context_lens.shape) in ((B,), (B, next_n)),
        f"context_lens must be int32 [B={B}] or [B, next_n={next_n}], got "
        f"{context_lens.dtype} {tuple(context_lens.shape)}",
    )
    need(
        block_table.dtype in (torch.int32, torch.int64)
        and block_table.dim() == 2
        and block_table.shape[0] == B,
        f"block_table must be int32 [B={B}, max_blocks], got {block_table.dtype} "
        f"{tuple(block_table.shape)}",
    )
    need(
        isinstance(max_context_len, int) and max_context_len >= 0,
        f"max_context_len={max_context_len!r} must be a non-negative int",
    )
    for name, t in (
        ("weights", weights),
        ("context_lens", context_lens),
        ("block_table", block_table),
    ):
        need(t.device == dev, f"{name} is on {t.device}, q on {dev}")
    ends = paged_row_ends(context_lens, next_n)
    bad = (ends < 0) | (ends > max_context_len)
    if bool(bad.any()):
        b, j = (int(v) for v in bad.nonzero()[0])
        raise ValueError(f"row (b={b}, j={j}) sees {int(ends[b, j])} tokens, outside [0, "
                         f"max_context_len={max_context_len}]")
    longest = ends.amax(dim=1) if next_n else ends.new_zeros(B)  # [B]
    short = -(-longest // page_size) > block_table.shape[1]
    if bool(short.any()):
        b = int(short.nonzero()[0, 0])
        raise ValueError(f"request {b} needs {-(-int(longest[b]) // page_size)} pages for {int(longest[b])} "
                         f"tokens; block_table has {block_table.shape[1]} columns")
    return ends


def check_mqa_logits_mode(kv, clean_logits: bool, max_seqlen_k: int) -> None:
    """The ``fp8_mqa_logits`` arguments beyond ``indexer.mqa_logits``'s (shared with kernels)."""
    need(
        isinstance(kv, (tuple, list)) and len(kv) == 2,
        "kv must be the pair (k_fp8 [S_kv, D] float8_e4m3fn, k_scale [S_kv] float32)",
    )
    need(
        isinstance(max_seqlen_k, int) and not isinstance(max_seqlen_k, bool) and max_seqlen_k >= 0,
        f"max_seqlen_k={max_seqlen_k!r} must be a non-negative int",
    )
    need(
        max_seqlen_k == 0 or not clean_logits,
        "fp8_mqa_logits with max_seqlen_k > 0 (compressed logits) requires clean_logits=False, "
        "as in DeepGEMM",
    )


def check_compressed_width(ks: Tensor, ke: Tensor, max_seqlen_k: int) -> None:
    """Every window fits the compressed output: ``ke − ks ≤ max_seqlen_k``."""
    lens = ke.long() - ks.long()
    if lens.numel():
        longest = int(lens.max())
        need(
            longest <= max_seqlen_k,
            f"a row has ke - ks = {longest} keys, more than max_seqlen_k={max_seqlen_k}; pass "
            "max_seqlen_k = max(ke - ks)",
        )


def check_paged_kv_cache(q: Tensor, kv_cache: Tensor) -> tuple[int, int, int]:
    """``(num_blocks, block_size, D)`` of ``fp8_paged_mqa_logits``' q ``[B, next_n, H, D]``
    float8_e4m3fn and kv_cache uint8 ``[num_blocks, block_size, 1, D + 4]``; ValueError else."""
    need(
        isinstance(q, Tensor) and q.dim() == 4 and q.dtype == torch.float8_e4m3fn,
        f"q must be [B, next_n, H, D] float8_e4m3fn, got {getattr(q, 'dtype', None)} {shape_of(q)}",
    )
    head_dim = q.shape[3]
    need(
        isinstance(kv_cache, Tensor)
        and kv_cache.dtype == torch.uint8
        and kv_cache.dim() == 4
        and kv_cache.shape[2] == 1
        and kv_cache.shape[3] == head_dim + 4,
        f"kv_cache must be uint8 [num_blocks, block_size, 1, D + 4 = {head_dim + 4}], got "
        f"{getattr(kv_cache, 'dtype', None)} {shape_of(kv_cache)}",
    )
    return kv_cache.shape[0], kv_cache.shape[1], head_dim


def check_slots_read(indices: Tensor, read: Tensor, num_slots: int) -> None:
    """Every index the kernel reads (``read``) is -1 or a slot of the cache."""
    bad = read & (indices != -1) & ((indices < 0) | (indices >= num_slots))
    if bool(bad.any()):
        pos = tuple(int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"indices{list(pos)} = {int(indices[pos])} is neither -1 nor a slot of the "
            f"{num_slots}-slot cache; mark unused entries with -1"
        )


def check_pair(x: Tensor, y: Tensor, what: str) -> None:
    need(
        isinstance(x, Tensor) and isinstance(y, Tensor),
        f"{what} compares two tensors, got {type(x).__name__} and {type(y).__name__}",
    )
    need(x.shape == y.shape, f"{what}: shapes differ, {tuple(x.shape)} vs {tuple(y.shape)}")


def check_sparse_inputs(q, kv, indices, d_v, attn_sink, topk_length) -> None:
    """``flash_mla_sparse_fwd``'s tensors. ``kv``: the floating ``[s_kv, 1, d_qk]`` rows, or None
    where a kernel reads packed rows whose layout its caller checks."""
    need(q.dim() == 3, f"q must be [s_q, h, d_qk], got shape {tuple(q.shape)}")
    s_q, h, d_qk = q.shape
    need(kv is None or (kv.dim() == 3 and kv.shape[1] == 1 and kv.shape[2] == d_qk),
         f"kv must be [s_kv, 1, d_qk={d_qk}] (one latent KV head shared by all query heads), "
         f"got shape {shape_of(kv)}")
    need(q.dtype.is_floating_point and (kv is None or kv.dtype.is_floating_point),
         f"q and kv must be floating (dequantize an FP8 cache first), got q {q.dtype} and "
         f"kv {None if kv is None else kv.dtype}")
    need(indices.dtype == torch.int32 and indices.dim() == 3 and indices.shape[:2] == (s_q, 1),
         f"indices must be int32 [s_q={s_q}, 1, topk], got {indices.dtype} {tuple(indices.shape)}")
    need(indices.shape[2] >= 1, "indices needs topk ≥ 1 columns; pad unused ones with -1")
    need(0 < d_v <= d_qk, f"d_v={d_v} must lie in [1, d_qk={d_qk}]: values are kv[..., :d_v]")
    need(attn_sink is None or (attn_sink.dtype.is_floating_point and attn_sink.shape == (h,)),
         f"attn_sink must be a floating [h={h}] tensor, got {getattr(attn_sink, 'dtype', None)} "
         f"{shape_of(attn_sink)}")
    need(topk_length is None or (topk_length.dtype == torch.int32 and topk_length.shape == (s_q,)),
         f"topk_length must be int32 [s_q={s_q}], got {getattr(topk_length, 'dtype', None)} "
         f"{shape_of(topk_length)}")


def check_sparse_conventions(lse_base, lonely_lse, budget_bytes) -> None:
    """The reference ``sparse_mla_fwd``'s convention switches and row-chunk budget."""
    need(lse_base in ("e", "2"),
         f"lse_base={lse_base!r} must be 'e' (newest FlashMLA) or '2' (Sep 2025)")
    need(lonely_lse in ("+inf", "-inf"),
         f"lonely_lse={lonely_lse!r} must be '+inf' (newest FlashMLA) or '-inf' (Sep 2025)")
    need(budget_bytes is None or (isinstance(budget_bytes, int) and budget_bytes >= 1),
         f"budget_bytes={budget_bytes!r} must be a positive int or None")


def check_q8kv8_scales(q_scale, kv_scale, attn_sink, topk_length,
                       dtypes: tuple[torch.dtype, ...]) -> None:
    """``sparse_mla_q8kv8_prefill_fwd``'s per-tensor scales, one-element tensors of ``dtypes``
    (the kernel takes float32, the oracle float64 too), and its full path's rule that
    ``attn_sink`` and ``topk_length`` come together."""
    for name, t in (("q_scale", q_scale), ("kv_scale", kv_scale)):
        need(isinstance(t, Tensor) and t.numel() == 1 and t.dtype in dtypes,
             f"{name} must be a one-element float32 tensor (one scale per tensor), got "
             f"{getattr(t, 'dtype', None)} {shape_of(t)}")
    need((attn_sink is None) == (topk_length is None),
         "attn_sink and topk_length go together (the kernel's full path takes both): pass both "
         "or neither")


def check_fp8_pool_rows(pool: Tensor, slots: Tensor, kv_lora_rank: int, rope_dim: int) -> None:
    """What the paged FP8-row kernels (``kernels.kv_requant``'s, ``kernels.kv_dequant``'s) read:
    ``pool`` uint8 ``[num_pages, page_size, row_bytes]`` of contiguous rows at 4-byte aligned
    addresses (their float32 tile scales), ``slots`` 1-D int64 on the pool's device."""
    row_bytes = mla_kv_row_bytes(kv_lora_rank, rope_dim, "fp8")
    need(pool.dtype == torch.uint8 and pool.dim() == 3 and pool.shape[2] == row_bytes,
         f"pool must be uint8 [num_pages, page_size, {row_bytes}], got {pool.dtype} of shape "
         f"{tuple(pool.shape)}")
    need(pool.stride(2) == 1 and pool.stride(1) % 4 == 0 and pool.stride(0) % 4 == 0
         and pool.data_ptr() % 4 == 0,
         f"pool rows must be contiguous bytes at 4-byte aligned addresses, got {pool.stride()}")
    need(slots.dim() == 1 and slots.dtype == torch.int64,
         f"slots must be 1-D int64, got {slots.dtype} of shape {tuple(slots.shape)}")
    need(slots.device == pool.device, f"slots on {slots.device}, pool on {pool.device}")
