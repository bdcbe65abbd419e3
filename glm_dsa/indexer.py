"""The DSA lightning indexer: FP8 scoring of every earlier key, then a top-k per query row.

For each query token the indexer scores all keys of its context with a cheap FP8 multi-head
dot product and keeps the ``index_topk`` best; sparse MLA then attends only to those. Its
``n × L`` scoring is the one quadratic term of the prefill, and the float32 logits of a long
prefill do not fit in memory at once (a 32K chunk over a 1M prefix is 137 GB), so the rows are
cut into chunks that fit a byte budget (SGLang's rule, docs/conventions.md §12) and the top-k is taken
chunk by chunk. Results never depend on the chunking: scores are computed the same way in
every chunk and the top-k order is canonical (score descending, index ascending on ties).

The pure functions mirror the upstream kernels a user checks against us:
DeepGEMM ``fp8_mqa_logits`` (``mqa_logits``), ``fp8_paged_mqa_logits``
(``paged_mqa_logits``), SGLang ``fast_topk_v2`` / vLLM ``top_k_per_row`` (``topk_per_row``)
and the ragged / paged index transforms. Each checks its inputs once, then calls a bare core
(``_mqa_logits``, ``_paged_mqa_logits``, ``_topk``); the row-chunk loop of ``indexer_topk``
calls the cores. ``Indexer`` owns the weights (HF names) and calls ``indexer_topk``, the one
place the scoring runs.

Exactness: a dot product of two E4M3 vectors is exact in float64, so each logit is a fixed
function of its inputs (exact dot, then float32 ReLU, gate, head sum in a fixed order, key
scale). Logits are bitwise identical for every tiling, row chunking and device (CPU and CUDA
checked equal on an H200), which is what makes the top-k independent of the memory budget.

Memory: no function materializes the ``[S, H, S_kv]`` per-head scores; scores are computed for
``[rows, H, cols]`` tiles of at most ``TILE_BYTES`` and reduced over heads at once, so the peak
is the logits being returned plus one tile.
"""

from __future__ import annotations

from collections.abc import Callable
import torch
from einops import rearrange
from torch import Tensor, nn

from glm_dsa import fused, invariant
from glm_dsa.batch import INDEX_K_ALLGATHER, ForwardBatch, RowGather
from glm_dsa.budget import rows_within
from glm_dsa.config import DSAConfig
from glm_dsa.fp8 import act_quant
from glm_dsa.hadamard import hadamard_transform
from glm_dsa.kv_format import MX_BLOCK, index_k_load, index_k_page_bytes, index_k_store
from glm_dsa.norm import LayerNorm
from glm_dsa.row_chunks import RowChunk, chunked_topk, prefix_indices
from glm_dsa.rope import apply_rope, rope_cos_sin
from glm_dsa.validate import (
    MAX_EXACT_DIM,
    check_block_exponents,
    check_index_vector,
    check_indexer_topk_inputs,
    check_logits_inputs,
    check_paged_inputs,
    check_paged_rows,
    check_ragged_logits_inputs,
    check_ragged_rows,
    check_ranges,
    need,
    shape_of,
)

__all__ = [
    "TILE_BYTES",
    "mqa_logits",
    "paged_mqa_logits",
    "mx_mqa_logits",
    "mx_paged_mqa_logits",
    "topk_per_row",
    "topk_transform_ragged",
    "topk_transform_paged",
    "indexer_topk",
    "Indexer",
]

# Bound, in bytes, on each temporary the scoring and top-k loops allocate beside the logits
# (the [rows * H, cols] score tile, the top-k masks). Large enough for efficient GEMMs.
TILE_BYTES = 256 * 2**20


# Score tiles span a multiple of this many key columns, at most _MAX_TILE_COLS unless the tile
# has so few rows that wider tiles are needed to keep the GEMMs large.
_COL_ALIGN = 16
_MAX_TILE_COLS = 1024


# ----------------------------------------------------------------------------- logits
def _tile_shape(S: int, H: int, itemsize: int) -> tuple[int, int]:
    """(rows, cols) of one score tile: ``rows * H * cols * itemsize`` ≲ ``TILE_BYTES``."""
    elems = rows_within(TILE_BYTES, itemsize)  # elements: rows of one
    cols = max(_COL_ALIGN, min(_MAX_TILE_COLS, elems // H) // _COL_ALIGN * _COL_ALIGN)
    rows = max(1, min(S, elems // (H * cols)))
    if rows == S:
        # Few rows: widen the tile so the GEMMs stay large.
        cols = max(cols, elems // (S * H) // _COL_ALIGN * _COL_ALIGN)
    return rows, cols


def _column_span(ks: list[int], ke: list[int]) -> tuple[int, int]:
    """The union ``[min ks, max ke)`` of the non-empty rows (``(0, 0)`` if all are empty)."""
    spans = [(s, e) for s, e in zip(ks, ke) if e > s]
    if not spans:
        return 0, 0
    return min(s for s, _ in spans), max(e for _, e in spans)


def _dot_operand(x_fp8: Tensor) -> Tensor:
    """E4M3 values as float64, the GEMM operand of ``_dot_products``."""
    return x_fp8.to(torch.float64)


def _dot_products(q: Tensor, k: Tensor, dtype: torch.dtype) -> Tensor:
    """``q [M, D] @ k [T, D]ᵀ`` → ``[M, T]``, exact, then rounded once to ``dtype``.

    Every E4M3 value is a multiple of 2**-9 below 2**9, so each product is a multiple of
    2**-18 below 2**18 and any sum of ``D ≤ 2**16`` of them fits float64's 53 bits: the float64
    GEMM is exact whatever its summation order or blocking. The logits therefore do not depend
    on tile shapes, row chunks or the device.
    """
    return (q @ k.t()).to(dtype)


def _block_scaled(x_fp8: Tensor, exponents: Tensor) -> Tensor:
    """float64 ``[n, D]`` element values ``x_fp8 × 2**(e − 127)`` of block-scaled (MX) operands,
    one ue8m0 byte ``e`` per block of 32 (``exponents`` uint8 ``[n, D / 32]``): exact, the
    scale built from its exponent bits."""
    scale = ((exponents.to(torch.int64) + (1023 - 127)) << 52).view(torch.float64)  # [n, D/32]
    blocks = x_fp8.to(torch.float64).unflatten(-1, (-1, MX_BLOCK))
    return (blocks * scale[..., None]).flatten(-2)


def _block_dot_products(q: Tensor, k: Tensor, dtype: torch.dtype) -> Tensor:
    """``q [M, D] @ k [T, D]ᵀ`` of block-scaled operands (``_block_scaled``), block by block:
    within a block of 32 every q element shares one power of two and every k element another,
    so each block's dot is exact in float64 (as ``_dot_products``); the blocks' dots are added
    in block order, then rounded once to ``dtype``. Neither depends on tiling or device."""
    qb = rearrange(q, "m (b e) -> b m e", e=MX_BLOCK).contiguous()
    kb = rearrange(k, "t (b e) -> b e t", e=MX_BLOCK).contiguous()
    dots = torch.bmm(qb, kb)  # [blocks, M, T], each exact
    acc = dots[0]
    for b in range(1, dots.shape[0]):
        acc += dots[b]
    return acc.to(dtype)


def _weighted_relu_head_sum(scores: Tensor, weights: Tensor) -> Tensor:
    """``sum_h weights[r, h] * relu(scores[r, h, c])`` → ``[r, c]``, heads added in a fixed tree.

    scores: ``[r, H, c]`` (consumed in place); weights: ``[r, H]``. Plain elementwise float ops
    (no fused multiply-add, no library reduction whose order could follow the shape), and the
    heads are added pairwise in an order that depends on H only, so each output element is
    rounded the same way for any tile shape and on any device.
    """
    scores.relu_().mul_(weights[:, :, None])
    n = scores.shape[1]
    while n > 1:
        half = n // 2
        # Fold the last `half` heads onto the first `half` (the middle head of an odd n waits).
        scores[:, :half].add_(scores[:, n - half : n])
        n -= half
    return scores[:, 0]


def mqa_logits(
    q_fp8: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    clean_logits: bool = True,
) -> Tensor:
    """Weighted-ReLU MQA logits of ragged query rows (DeepGEMM ``fp8_mqa_logits``).

    ``I[m, n] = k_scale[n] * sum_h weights[m, h] * relu(q_fp8[m, h] · k_fp8[n])`` for the
    columns ``[ks[m], ke[m])``. Each dot product is exact and rounded once to float32; the
    ReLU, gates, head sum (a fixed pairwise order) and key scale are float32 operations. Every
    logit is thus a fixed function of its inputs, independent of chunking, tiling and device.

    Args:
        q_fp8: ``[S, H, D]`` float8_e4m3fn (its scale is folded into ``weights``).
        k_fp8: ``[S_kv, D]`` float8_e4m3fn; ``k_scale``: ``[S_kv]`` float32, one per key.
        weights: ``[S, H]`` float32 head gates (float64 also accepted: then the logits are
            float64, for tests that need ~1e-12).
        ks, ke: int32 ``[S]``, the valid columns ``[ks[m], ke[m])`` of each row,
            ``0 ≤ ks ≤ ke ≤ S_kv``.
        clean_logits: fill ``-inf`` outside ``[ks, ke)``. When False those entries are
            unspecified, as in DeepGEMM; here they hold deterministic values (the unmasked
            formula inside the column span that was computed, 0 beyond it).

    Returns:
        ``[S, S_kv]`` float32 (float64 for float64 weights).
    """
    check_ragged_logits_inputs(q_fp8, k_fp8, k_scale, weights, ks, ke)
    return _mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke, ks.tolist(), ke.tolist(), clean_logits)


def mx_mqa_logits(
    q_fp8: Tensor,
    q_exponents: Tensor,
    k_fp8: Tensor,
    k_exponents: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    clean_logits: bool = True,
) -> Tensor:
    """Weighted-ReLU MQA logits of block-scaled (MX) queries and keys (DeepGEMM 559d79f
    ``fp8_fp4_mqa_logits`` with ``q = (fp, sf)``: MXFP8, and MXFP4 once its e2m1 codes are read
    as the e4m3 values they equal, ``kv_format.e2m1_to_e4m3``).

    ``I[m, n] = sum_h weights[m, h] * relu(sum_b 2**(qe[m, h, b] + ke[n, b] − 254) ·
    (q_fp8[m, h, b] · k_fp8[n, b]))`` over blocks ``b`` of 32 elements, for the columns
    ``[ks[m], ke[m])``. Each block's dot is exact, the blocks are added in order in float64 and
    rounded once to float32; the rest as ``mqa_logits`` (there is no key scale: it is in the
    exponents), so every logit is a fixed function of its inputs.

    Args:
        q_fp8: ``[S, H, D]`` float8_e4m3fn element values; ``q_exponents``: uint8 ue8m0 bytes
            ``[S, H, D / 32]`` (the first ``D / 32`` bytes of each int32 ``q_sf`` word).
        k_fp8: ``[S_kv, D]`` float8_e4m3fn; ``k_exponents``: uint8 ``[S_kv, D / 32]``.
        weights, ks, ke, clean_logits: as ``mqa_logits`` (float64 weights give float64 logits).

    Returns:
        ``[S, S_kv]`` float32 (float64 for float64 weights).
    """
    S, H, D, S_kv = check_logits_inputs(q_fp8, k_fp8, None, weights)
    check_block_exponents("q_exponents", q_exponents, (S, H), D, q_fp8.device)
    check_block_exponents("k_exponents", k_exponents, (S_kv,), D, q_fp8.device)
    check_ragged_rows(ks, ke, S, S_kv, q_fp8.device)
    return _mqa_logits(q_fp8, k_fp8, None, weights, ks, ke, ks.tolist(), ke.tolist(), clean_logits,
                       q_exp=q_exponents, k_exp=k_exponents)


def _mqa_logits(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor | None, weights: Tensor, ks: Tensor,
                ke: Tensor, ks_host: list[int], ke_host: list[int], clean_logits: bool,
                q_exp: Tensor | None = None, k_exp: Tensor | None = None) -> Tensor:
    """``mqa_logits`` on checked inputs; ``ks_host``, ``ke_host`` are ``ks``, ``ke`` as lists
    (the caller's one host sync). Scores ``[rows, H, cols]`` tile by tile, never the whole
    ``[S, H, S_kv]``. With block exponents (``q_exp [S, H, D/32]``, ``k_exp [S_kv, D/32]``,
    ``k_scale`` None) the dots are ``_block_dot_products`` (``mx_mqa_logits``)."""
    S, H, D = q_fp8.shape
    S_kv, dev = k_fp8.shape[0], q_fp8.device
    dtype = torch.promote_types(weights.dtype, torch.float32)
    fill = float("-inf") if clean_logits else 0.0
    logits = torch.full((S, S_kv), fill, dtype=dtype, device=dev)
    blocked = k_exp is not None
    # Per score element: the float64 GEMM output(s) and the rounded copy.
    rows, cols = _tile_shape(S, H, (16 if blocked else 8) + dtype.itemsize)
    q2d = rearrange(q_fp8, "s h d -> (s h) d")
    q_exp2d = None if q_exp is None else rearrange(q_exp, "s h b -> (s h) b")
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        lo, hi = _column_span(ks_host[r0:r1], ke_host[r0:r1])
        if lo == hi:
            continue
        q_rows = q2d[r0 * H : r1 * H]
        # [r * H, D]
        q_op = _block_scaled(q_rows, q_exp2d[r0 * H : r1 * H]) if q_exp2d is not None else _dot_operand(q_rows)
        w = weights[r0:r1].to(dtype)  # [r, H]
        row_ks, row_ke = ks[r0:r1, None], ke[r0:r1, None]
        for c0 in range(lo, hi, cols):
            c1 = min(hi, c0 + cols)
            if k_exp is not None:
                scores = _block_dot_products(q_op, _block_scaled(k_fp8[c0:c1], k_exp[c0:c1]), dtype)
            else:
                scores = _dot_products(q_op, _dot_operand(k_fp8[c0:c1]), dtype)  # [r * H, c]
            scores = rearrange(scores, "(r h) c -> r h c", h=H)
            tile = _weighted_relu_head_sum(scores, w)  # [r, c]
            # The key scale is applied after ReLU and the head sum, as the kernel does
            # (equivalent: scales are positive).
            if k_scale is not None:
                tile.mul_(k_scale[c0:c1].to(dtype))
            if clean_logits:
                col = torch.arange(c0, c1, device=dev)
                tile.masked_fill_((col < row_ks) | (col >= row_ke), float("-inf"))
            logits[r0:r1, c0:c1] = tile
            del scores, tile
    return logits


def paged_mqa_logits(
    q_fp8: Tensor,
    index_k_pages: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
    page_size: int = 64,
) -> Tensor:
    """Weighted-ReLU MQA logits read through a block table (DeepGEMM ``fp8_paged_mqa_logits``).

    Same formula as ``mqa_logits``; request ``b``'s keys are the tokens at positions
    ``0, 1, …`` of its pages ``block_table[b, pos // page_size]`` in the index-K cache.

    Args:
        q_fp8: ``[B, next_n, H, D]`` float8_e4m3fn.
        index_k_pages: uint8 ``[num_pages, page_size * (D + 4)]`` (8448 bytes for 64 × 128).
        weights: ``[B * next_n, H]`` float32 (float64 accepted, as in ``mqa_logits``).
        context_lens: int32 ``[B]``: row ``(b, j)`` sees positions ``0 … ctx_b − next_n + j``;
            or int32 ``[B, next_n]``: row ``(b, j)`` sees positions ``< context_lens[b, j]``.
        block_table: int32 ``[B, max_blocks]``, physical page of each logical page.
        max_context_len: width of the output in tokens; every row's range must fit in it.
        clean_logits: ``-inf`` outside each row's range (else unspecified, see ``mqa_logits``).

    Returns:
        ``[B * next_n, max_context_len]`` float32 (float64 for float64 weights).
    """
    ends = check_paged_inputs(
        q_fp8, index_k_pages, weights, context_lens, block_table, max_context_len, page_size
    )
    D = q_fp8.shape[3]

    def keys(slots: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        return (*index_k_load(index_k_pages, slots, D, page_size), None)

    return _paged_mqa_logits(
        q_fp8, None, keys, weights, ends.tolist(), block_table, max_context_len, clean_logits,
        page_size
    )


def mx_paged_mqa_logits(
    q_fp8: Tensor,
    q_exponents: Tensor,
    k_fp8: Tensor,
    k_exponents: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
) -> Tensor:
    """``mx_mqa_logits`` read through a block table (DeepGEMM 559d79f ``fp8_fp4_paged_mqa_logits``
    with ``q = (fp, sf)``), on the pages' element values and exponents.

    Args:
        q_fp8: ``[B, next_n, H, D]`` float8_e4m3fn; ``q_exponents``: uint8 ``[B, next_n, H, D/32]``.
        k_fp8: ``[num_pages, page_size, D]`` float8_e4m3fn; ``k_exponents``: uint8
            ``[num_pages, page_size, D / 32]`` (``kv_format.index_k_page_split`` of the cache).
        weights, context_lens, block_table, max_context_len, clean_logits: as
            ``paged_mqa_logits``.

    Returns:
        ``[B * next_n, max_context_len]`` float32 (float64 for float64 weights).
    """
    need(isinstance(q_fp8, Tensor) and q_fp8.dtype == torch.float8_e4m3fn and q_fp8.dim() == 4,
         f"q_fp8 must be float8_e4m3fn [B, next_n, H, D], got {getattr(q_fp8, 'dtype', None)} "
         f"{shape_of(q_fp8)}")
    B, next_n, H, D = q_fp8.shape
    need(isinstance(k_fp8, Tensor) and k_fp8.dtype == torch.float8_e4m3fn and k_fp8.dim() == 3
         and k_fp8.shape[2] == D,
         f"k_fp8 must be float8_e4m3fn [num_pages, page_size, D={D}], got "
         f"{getattr(k_fp8, 'dtype', None)} {shape_of(k_fp8)}")
    num_pages, page_size = k_fp8.shape[:2]
    check_block_exponents("q_exponents", q_exponents, (B, next_n, H), D, q_fp8.device)
    check_block_exponents("k_exponents", k_exponents, (num_pages, page_size), D, q_fp8.device)
    need(k_fp8.device == q_fp8.device, f"k_fp8 is on {k_fp8.device}, q_fp8 on {q_fp8.device}")
    ends = check_paged_rows(B, next_n, H, weights, context_lens, block_table, max_context_len,
                            page_size, q_fp8.device)

    def keys(slots: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        page, offset = slots // page_size, slots % page_size
        return k_fp8[page, offset], None, k_exponents[page, offset]

    return _paged_mqa_logits(q_fp8, q_exponents, keys, weights, ends.tolist(), block_table,
                             max_context_len, clean_logits, page_size)


def _paged_mqa_logits(q_fp8: Tensor, q_exp: Tensor | None,
                      keys: Callable[[Tensor], tuple[Tensor, Tensor | None, Tensor | None]],
                      weights: Tensor, ends: list[list[int]], block_table: Tensor,
                      max_context_len: int, clean_logits: bool, page_size: int) -> Tensor:
    """The paged logits on checked inputs: per request, gather its keys through the block
    table (``keys(slots)`` → ``(k_fp8, k_scale, k_exponents)`` of those slots, the format's
    reader) and score its ``next_n`` rows (row ``(b, j)`` over positions ``< ends[b][j]``)."""
    B, next_n, H, D = q_fp8.shape
    dev = q_fp8.device
    dtype = torch.promote_types(weights.dtype, torch.float32)
    fill = float("-inf") if clean_logits else 0.0
    logits = torch.full((B * next_n, max_context_len), fill, dtype=dtype, device=dev)
    for b, row_ends in enumerate(ends):
        n_ctx = max(row_ends)
        if n_ctx == 0:
            continue
        pos = torch.arange(n_ctx, device=dev)
        slots = block_table[b, pos // page_size].long() * page_size + pos % page_size
        k_fp8, k_scale, k_exp = keys(slots)  # [n_ctx, D], [n_ctx] or [n_ctx, D / 32]
        rows = slice(b * next_n, (b + 1) * next_n)
        zeros = [0] * next_n
        logits[rows, :n_ctx] = _mqa_logits(
            q_fp8[b], k_fp8, k_scale, weights[rows],
            torch.tensor(zeros, dtype=torch.int32, device=dev),
            torch.tensor(row_ends, dtype=torch.int32, device=dev),
            zeros, row_ends, clean_logits, q_exp=None if q_exp is None else q_exp[b], k_exp=k_exp,
        )
    return logits


# ----------------------------------------------------------------------------- top-k
def _canonical_topk(vals: Tensor, starts: Tensor, ends: Tensor, k: int, rows: Tensor) -> Tensor:
    """Absolute column indices int64 ``[b, k]`` of the k best valid entries of each row.

    Every row has more than k valid columns ``[start, end)``; ``rows`` names the rows in
    error messages. Order: score descending, column ascending on ties. ``torch.topk`` breaks
    ties arbitrarily, so its set is kept only where it is unambiguous (exactly k entries ≥ the
    k-th value); elsewhere the tie at the k-th value is filled by the lowest valid columns.
    """
    b, n = vals.shape
    col = torch.arange(n, device=vals.device)
    valid = (col >= starts[:, None]) & (col < ends[:, None])
    # Adding +0.0 turns -0.0 into +0.0, so that no sort (radix sorts compare bits) can tell
    # the two zeros apart.
    masked = vals.masked_fill(~valid, float("-inf")).add_(0.0)
    if bool(masked.isnan().any()):
        bad = int(rows[masked.isnan().any(dim=1)][0])
        raise ValueError(f"logits row {bad} holds NaN inside [row_start, row_end)")
    top_vals, idx = masked.topk(k, dim=1, sorted=False)
    kth = top_vals.amin(dim=1, keepdim=True)  # [b, 1]
    tied = ((masked >= kth).sum(dim=1) > k).nonzero().flatten()
    if tied.numel():
        # Masked columns are -inf too: only valid columns may fill the tie at the k-th value.
        m, v = masked[tied], valid[tied]
        above = m > kth[tied]
        tie = (m == kth[tied]) & v
        need = k - above.sum(dim=1, keepdim=True)
        take = above | (tie & (tie.cumsum(dim=1, dtype=torch.int32) <= need))
        idx[tied] = take.nonzero()[:, 1].view(-1, k)
    idx = idx.sort(dim=1).values  # columns ascending, so the stable sort below breaks ties
    order = masked.gather(1, idx).sort(dim=1, descending=True, stable=True).indices
    return idx.gather(1, order)


def topk_per_row(logits: Tensor, row_starts: Tensor, row_ends: Tensor, topk: int) -> Tensor:
    """The ``topk`` best columns of each row within ``[row_starts[r], row_ends[r])``.

    Mirrors SGLang ``fast_topk_v2`` / vLLM ``top_k_per_row_prefill`` with a canonical order.

    Args:
        logits: ``[R, N]`` float32 (or float64); entries outside the row's range are never read
            for selection, whatever they hold.
        row_starts, row_ends: int32 ``[R]``, ``0 ≤ start ≤ end ≤ N``.
        topk: number of indices per row.

    Returns:
        int32 ``[R, topk]`` relative to ``row_starts``. With ``len = end − start``: if
        ``len ≤ topk``, exactly ``0 … len − 1`` then ``-1`` (SGLang's fast path, in index
        order, scores not read); otherwise the ``topk`` best, score descending, index ascending
        on ties.

    Raises:
        ValueError: on NaN inside the range of a row whose scores are read.
    """
    need(
        logits.dim() == 2 and logits.dtype in (torch.float32, torch.float64),
        f"logits must be float32 [R, N], got {logits.dtype} {tuple(logits.shape)}",
    )
    need(isinstance(topk, int) and topk >= 1, f"topk={topk!r} must be a positive int")
    R, N = logits.shape
    dev = logits.device
    check_index_vector("row_starts", row_starts, R, dev)
    check_index_vector("row_ends", row_ends, R, dev)
    check_ranges(row_starts, row_ends, N, "N")
    return _topk(logits, row_starts.long(), row_ends.long(), topk)


def _topk(logits: Tensor, starts: Tensor, ends: Tensor, topk: int) -> Tensor:
    """``topk_per_row`` on checked inputs (``starts``, ``ends`` int64 ``[R]``): rows with at most
    ``topk`` keys take them all in order; longer rows are ranked in blocks of rows."""
    N = logits.shape[1]
    out = prefix_indices(ends - starts, topk)
    long_rows = ((ends - starts) > topk).nonzero().flatten()
    # The [block, N] temporaries (row copy, masked copy, masks) stay within TILE_BYTES.
    block = rows_within(TILE_BYTES, 16 * max(N, 1))
    for i in range(0, long_rows.numel(), block):
        rows = long_rows[i : i + block]
        idx = _canonical_topk(logits[rows], starts[rows], ends[rows], topk, rows)
        out[rows] = (idx - starts[rows, None]).to(torch.int32)
    return out


def topk_transform_ragged(indices: Tensor, offsets: Tensor) -> Tensor:
    """Request-relative → ragged row: ``indices[r, i] + offsets[r]``; ``-1`` stays ``-1``.

    The transform of SGLang ``fast_topk_transform_ragged_fused`` (``topk_indices_offset``); the
    result indexes the ``kv`` fed to ``flash_mla_sparse_fwd``. ``oracle`` exports it as is.

    Args:
        indices: int32 ``[R, topk]``, request-relative (``-1`` padding).
        offsets: int ``[R]``, each row's request offset in the concatenated KV buffer
            (``cu_seqlens_k[request of row]``; SGLang ``topk_indices_offset``).

    Returns:
        int32 ``[R, topk]``.
    """
    need(
        indices.dim() == 2 and indices.dtype in (torch.int32, torch.int64),
        f"indices must be int32 [R, topk], got {indices.dtype} {tuple(indices.shape)}",
    )
    check_index_vector("offsets", offsets, indices.shape[0], indices.device)
    need(bool((indices >= -1).all()), "indices may hold -1 (padding) but no other negative")
    out = indices.long() + offsets.long()[:, None]
    return torch.where(indices < 0, -1, out).to(torch.int32)


def topk_transform_paged(indices: Tensor, page_table: Tensor, page_size: int = 64) -> Tensor:
    """Request-relative → physical slot: ``page_table[r, i // ps] * ps + i % ps``; ``-1`` kept.

    vLLM ``triton_convert_req_index_to_global_index`` (``page_size=64``), FlashMLA
    ``tests/quant.py`` ``abs_indices2indices_in_kvcache`` (its ``block_size``), and SGLang
    ``fast_topk_transform_fused`` (``page_table_size_1``: ``page_size=1``); the result is the
    ``indices`` of ``flash_mla_sparse_decode``. ``oracle`` exports it as is.

    Args:
        indices: int32 ``[R, topk]``, request-relative (``-1`` padding).
        page_table: int32 ``[R, max_pages]``, the physical pages of each row's request.
        page_size: tokens per page.

    Returns:
        int32 ``[R, topk]`` physical slots (vLLM ``convert_req_index_to_global_index``).
    """
    need(
        indices.dim() == 2 and indices.dtype in (torch.int32, torch.int64),
        f"indices must be int32 [R, topk], got {indices.dtype} {tuple(indices.shape)}",
    )
    need(
        page_table.dim() == 2
        and page_table.shape[0] == indices.shape[0]
        and page_table.dtype in (torch.int32, torch.int64),
        f"page_table must be int32 [R={indices.shape[0]}, max_pages], got "
        f"{page_table.dtype} {tuple(page_table.shape)}",
    )
    need(page_table.device == indices.device, "page_table and indices are on different devices")
    need(isinstance(page_size, int) and page_size > 0, f"page_size={page_size!r} must be > 0")
    need(bool((indices >= -1).all()), "indices may hold -1 (padding) but no other negative")
    valid = indices >= 0
    page = torch.where(valid, indices.long() // page_size, 0)
    need(
        bool((page < page_table.shape[1]).all()),
        f"an index points past the {page_table.shape[1]} pages of its page_table row",
    )
    slot = page_table.long().gather(1, page) * page_size + indices.long() % page_size
    return torch.where(valid, slot, -1).to(torch.int32)


def indexer_topk(
    q_fp8: Tensor,
    weights: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    ks: Tensor,
    ke: Tensor,
    topk: int,
    budget_bytes: int,
) -> Tensor:
    """Top-k keys of every query row, logits computed in row chunks that fit ``budget_bytes``.

    At most ``max_logit_rows(S, S_kv, budget_bytes)`` rows of logits exist at once, each only
    over the columns its chunk can see; the top-k of each chunk is taken before the next chunk
    is scored. The result does not depend on the budget.

    Args:
        q_fp8: ``[S, H, D]`` float8_e4m3fn; ``weights``: ``[S, H]`` float32 head gates.
        k_fp8: ``[S_kv, D]`` float8_e4m3fn; ``k_scale``: ``[S_kv]`` float32 (the gathered context).
        ks, ke: int32 ``[S]``, row ``m`` may select keys ``[ks[m], ke[m])``.
        topk: indices per row (``index_topk``).
        budget_bytes: bytes the float32 logits may take (``logits_budget_bytes`` on CUDA).

    Returns:
        int32 ``[S, topk]`` relative to ``ks`` (request-relative), canonical order, ``-1`` pad.
    """
    check_indexer_topk_inputs(q_fp8, weights, k_fp8, k_scale, ks, ke, topk)

    def chunk_topk(chunk: RowChunk) -> Tensor:
        r0, r1, lo, hi = chunk.r0, chunk.r1, chunk.lo, chunk.hi
        logits = _mqa_logits(
            q_fp8[r0:r1], k_fp8[lo:hi], k_scale[lo:hi], weights[r0:r1], chunk.starts, chunk.ends,
            chunk.starts.tolist(), chunk.ends.tolist(),
            clean_logits=False,  # _topk reads only [start, end)
        )
        return _topk(logits, chunk.starts, chunk.ends, topk)

    return chunked_topk(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes, chunk_topk)


# ----------------------------------------------------------------------------- module
class Indexer(nn.Module):
    """The DSA indexer of one full layer (HF names under ``self_attn.indexer``).

    ``wq_b``: ``Linear(q_lora_rank, H * D)`` on the normed q latent MLA also uses; ``wk``:
    ``Linear(hidden, D)``; ``k_norm``: LayerNorm with bias, eps ``index_k_norm_eps``, float32
    math; ``weights_proj``: ``Linear(hidden, H)`` run in float32. Each head vector is split
    ``[rope | nope]`` (rope part first), RoPE'd (interleaved for GLM, half-split for DS-V3.2),
    Hadamard-rotated (orthonormal) and quantized to FP8: q per (token, head), k per token.
    """

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.n_heads = config.index_n_heads
        self.head_dim = config.index_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.wq_b = nn.Linear(config.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(config.hidden_size, self.head_dim, bias=False)
        self.k_norm = LayerNorm(self.head_dim, eps=config.index_k_norm_eps)
        self.weights_proj = nn.Linear(config.hidden_size, self.n_heads, bias=False)

    def _check_tokens(self, x: Tensor, positions: Tensor, q_latent: Tensor | None = None) -> None:
        """``x [n, hidden]``, ``positions`` int64 ``[n]`` and, when given, ``q_latent``."""
        n = x.shape[0] if x.dim() == 2 else -1
        need(
            x.dim() == 2 and x.shape[1] == self.config.hidden_size,
            f"x must be [n, hidden_size={self.config.hidden_size}], got {tuple(x.shape)}",
        )
        need(
            positions.dtype == torch.int64 and tuple(positions.shape) == (n,),
            f"positions must be int64 [{n}], got {positions.dtype} {tuple(positions.shape)}",
        )
        if q_latent is not None:
            need(
                tuple(q_latent.shape) == (n, self.config.q_lora_rank),
                f"q_latent must be [n={n}, q_lora_rank={self.config.q_lora_rank}], got "
                f"{tuple(q_latent.shape)}",
            )

    def rope(self, x: Tensor, positions: Tensor) -> Tensor:
        """``[n, ..., D]``: RoPE on the first ``rope_dim`` dims, no rotation (``glm_dsa.fidelity``
        scores these unrotated vectors to show what the rotation is for)."""
        cfg = self.config
        cos, sin = rope_cos_sin(
            positions,
            self.rope_dim,
            cfg.rope_theta,
            cfg.rope_scaling,
            dtype=torch.promote_types(x.dtype, torch.float32),
        )
        x_pe, x_nope = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        x_pe = apply_rope(x_pe, cos, sin, interleaved=cfg.indexer_rope_interleave)
        return torch.cat([x_pe, x_nope], dim=-1)

    def _rope_then_rotate(self, x: Tensor, positions: Tensor) -> Tensor:
        """``[n, ..., D]``: RoPE on the first ``rope_dim`` dims, then the Hadamard rotation."""
        return hadamard_transform(self.rope(x, positions), self.head_dim**-0.5)

    def project_k(self, x: Tensor, positions: Tensor) -> Tensor:
        """``x [n, hidden]``, ``positions`` int64 ``[n]`` → unquantized key ``[n, D]`` (x.dtype)."""
        self._check_tokens(x, positions)
        return self._key(x, positions)

    def _key(self, x: Tensor, positions: Tensor) -> Tensor:
        return self._rope_then_rotate(self._normed_key(x, positions), positions)

    def _normed_key(self, x: Tensor, positions: Tensor) -> Tensor:
        return self.k_norm(invariant.linear(x, self.wk.weight, positions))

    def _cos_sin(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        cfg = self.config
        return rope_cos_sin(positions, self.rope_dim, cfg.rope_theta, cfg.rope_scaling,
                            dtype=torch.float32)

    def _rotated_fp8(self, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """``act_quant(_rope_then_rotate(x))`` of ``[n, D]`` or ``[n, H, D]`` rows, one block of
        ``D`` each: ``(fp8 like x, float32 scale [..., 1])``. The active fused pass where it
        takes the call (``glm_dsa.fused``: on CUDA one Triton pass, bitwise this), else torch."""
        cfg = self.config
        fast = fused.index_quant(x, lambda: self._cos_sin(positions), self.rope_dim,
                                 cfg.indexer_rope_interleave, cfg.scale_fmt)
        if fast is not None:
            return fast
        return act_quant(self._rope_then_rotate(x, positions), self.head_dim, cfg.scale_fmt)

    def _store_keys(self, k_normed: Tensor, positions: Tensor, pages: Tensor, slots: Tensor) -> None:
        """The normed keys ``[n, D]`` RoPE'd, rotated, quantized and written at ``slots``."""
        cfg = self.config
        if fused.index_quant_store(k_normed, lambda: self._cos_sin(positions), self.rope_dim,
                                   cfg.indexer_rope_interleave, cfg.scale_fmt, pages, slots,
                                   cfg.page_size):
            return
        k_fp8, k_scale = self._rotated_fp8(k_normed, positions)
        index_k_store(pages, slots, k_fp8, k_scale[:, 0], cfg.page_size)

    def project_q(self, x: Tensor, q_latent: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and head gates.

        Args:
            x: ``[n, hidden]`` (the attention input); ``q_latent``: ``[n, q_lora_rank]``, the
                normed latent ``q_a_layernorm(q_a_proj(x))``; ``positions``: int64 ``[n]``.

        Returns:
            ``q_fp8 [n, H, D]`` float8_e4m3fn and ``weights [n, H]`` =
            ``weights_proj(x) · H^-0.5 · q_scale · D^-0.5`` in float32 (float64 for float64 x).
        """
        self._check_tokens(x, positions, q_latent)
        return self._query(x, q_latent, positions)

    def _query(self, x: Tensor, q_latent: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
        q = invariant.linear(q_latent, self.wq_b.weight, positions)
        q = rearrange(q, "n (h d) -> n h d", h=self.n_heads)
        q_fp8, q_scale = self._rotated_fp8(q, positions)  # scale [n, H, 1]
        dtype = torch.promote_types(x.dtype, torch.float32)
        # weights_proj(x.float()), computed as a float64 GEMM rounded once: immune to TF32 and
        # to how many rows the GEMM is given (CPU GEMMs round a row differently for few rows)
        # except where the float64 sum lies within its rounding of a float32 midpoint; row-tiled
        # in batch-invariant mode, which removes that too.
        gates = invariant.linear(x.double(), self.weights_proj.weight.double(), positions)
        gates = gates.to(dtype)  # [n, H]
        weights = gates * self.n_heads**-0.5 * q_scale[..., 0].to(dtype) * self.head_dim**-0.5
        return q_fp8, weights

    def forward(
        self,
        x: Tensor,
        q_latent: Tensor,
        batch: ForwardBatch,
        index_k_pages: Tensor,
        budget_bytes: int,
        cp_chunk: RowGather | None = None,
        topk_fn: Callable[..., Tensor] = indexer_topk,
    ) -> Tensor:
        """Top-k context rows of every query token of a ragged batch.

        Quantizes this step's keys and writes them to ``index_k_pages`` at ``batch.out_slots``
        **before** scoring, then reads the whole context back from the pages
        (``batch.kv_slots``), so the chunk's own keys are scored in FP8 exactly like the cached
        prefix (a prefix-cache hit is simply a longer prefix).

        Args:
            x: ``[n, hidden]``; ``q_latent``: ``[n, q_lora_rank]``; ``batch``: the step metadata.
            index_k_pages: uint8 ``[num_pages, page_size * (D + 4)]``, updated in place.
            budget_bytes: bytes the float32 logits may take at once.
            cp_chunk: context parallel (None: one rank). ``x`` and ``batch`` are then this
                rank's rows; the chunk's unquantized keys are gathered from every rank and stored at
                the whole chunk's slots, so every rank holds the full index-K cache.
            topk_fn: ``indexer_topk`` or a backend's function of the same contract
                (``glm_dsa.backend``).

        Returns:
            int32 ``[n, index_topk]``, request-relative (relative to ``batch.ks``), ``-1`` pad.
        """
        cfg = self.config
        self._check_tokens(x, batch.positions, q_latent)
        if cp_chunk is None:
            self._store_keys(self._normed_key(x, batch.positions), batch.positions, index_k_pages,
                             batch.out_slots)
        else:  # every rank's unquantized keys, gathered, then quantized and stored
            k = cp_chunk.gather(self._key(x, batch.positions), INDEX_K_ALLGATHER)
            k_fp8, k_scale = act_quant(k, self.head_dim, cfg.scale_fmt)  # scale [n, 1]
            index_k_store(index_k_pages, cp_chunk.out_slots, k_fp8, k_scale[:, 0], cfg.page_size)
        ctx_fp8, ctx_scale = index_k_load(
            index_k_pages, batch.kv_slots, self.head_dim, cfg.page_size
        )
        q_fp8, weights = self._query(x, q_latent, batch.positions)
        return topk_fn(
            q_fp8, weights, ctx_fp8, ctx_scale, batch.ks, batch.ke, cfg.index_topk, budget_bytes
        )
