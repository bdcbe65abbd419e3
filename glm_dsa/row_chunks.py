"""The budgeted row-chunk loop of the indexer top-k, shared by the reference
(``glm_dsa.indexer.indexer_topk``), the Triton backend (``glm_dsa.kernels.indexer``) and the peers
backend: they differ only in how a chunk is scored and selected.

It sits below its users (it imports neither the model nor the kernels), so the kernels reach
it without importing the reference indexer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from glm_dsa import budget, syncfree

__all__ = ["RowChunk", "chunked_topk", "prefix_indices"]


def prefix_indices(lens: Tensor, topk: int) -> Tensor:
    """int32 ``[R, topk]``: ``0 … len − 1`` then ``-1`` (rows with no more than topk keys)."""
    ar = torch.arange(topk, device=lens.device)
    return torch.where(ar < lens[:, None], ar, -1).to(torch.int32)


class RowChunk(NamedTuple):
    """Rows ``[r0, r1)`` of a budgeted row chunk over key columns ``[lo, hi)``; each row's window
    ``[starts, ends)`` relative to ``lo`` (int64 ``[r1 − r0]``, on the device)."""

    r0: int
    r1: int
    lo: int
    hi: int
    starts: Tensor
    ends: Tensor


def chunked_topk(
    q_fp8: Tensor,
    weights: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    ks: Tensor,
    ke: Tensor,
    topk: int,
    budget_bytes: int,
    chunk_topk: Callable[[RowChunk], Tensor],
    rows: int | None = None,
) -> Tensor:
    """The budgeted row-chunk loop of ``indexer_topk``, with the per-chunk scoring passed in.

    On arguments the caller has checked (``validate.check_indexer_topk_inputs``): for each
    chunk of at most ``rows`` rows (``max_logit_rows`` when None; a scoring that holds less
    than the float32 logits may take more) either fills ``0 … len − 1`` (every row keeps all
    its keys) or calls ``chunk_topk(RowChunk)``, which returns int32 ``[r1 − r0, topk]``
    relative to ``starts``. The reference and the Triton backend share this loop and differ
    only in ``chunk_topk``; whatever it allocates (the chunk's logits) is freed before the next
    chunk.
    """
    S, S_kv = q_fp8.shape[0], k_fp8.shape[0]
    if rows is None:
        rows = budget.max_logit_rows(S, S_kv, budget_bytes)
    out = torch.empty((S, topk), dtype=torch.int32, device=q_fp8.device)
    if syncfree.active():
        return _chunked_topk_by_sizes(ks, ke, S_kv, topk, rows, out, chunk_topk)
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        chunk_ks, chunk_ke = ks[r0:r1].long(), ke[r0:r1].long()
        lens = chunk_ke - chunk_ks
        # Column span of the chunk's non-empty rows: one host sync of three numbers per chunk.
        nonempty = lens > 0
        longest, lo, hi = torch.stack([
            lens.max(), torch.where(nonempty, chunk_ks, S_kv).min(),
            torch.where(nonempty, chunk_ke, 0).max(),
        ]).tolist()
        if longest <= topk:
            # Every row keeps all its keys: no scores needed (SGLang's skip path).
            out[r0:r1] = prefix_indices(lens, topk)
            continue
        # Empty rows get an empty range inside the span.
        starts = (chunk_ks - lo).clamp(0, hi - lo)
        ends = torch.where(nonempty, chunk_ke - lo, starts)
        out[r0:r1] = chunk_topk(RowChunk(r0, r1, lo, hi, starts, ends))
    return out


def _chunked_topk_by_sizes(ks: Tensor, ke: Tensor, S_kv: int, topk: int, rows: int, out: Tensor,
                           chunk_topk: Callable[[RowChunk], Tensor]) -> Tensor:
    """``chunked_topk``'s loop planned from the sizes alone (``glm_dsa.syncfree``): each chunk
    spans every key column ``[0, S_kv)`` rather than its rows' span, and is scored unless no
    row can have more than ``topk`` keys (``S_kv ≤ topk``). Each row's result is the eager
    loop's: the same windows, relative to column 0 (the eager span also starts there for a
    batch's first request), and a row with ``≤ topk`` keys gives ``0 … len − 1`` either way."""
    if S_kv <= topk:
        out[:] = prefix_indices(ke.long() - ks.long(), topk)
        return out
    for r0 in range(0, ks.shape[0], rows):
        r1 = min(ks.shape[0], r0 + rows)
        out[r0:r1] = chunk_topk(RowChunk(r0, r1, 0, S_kv, ks[r0:r1].long(), ke[r0:r1].long()))
    return out
