"""Fast indexer top-k: Triton logits in budgeted row chunks, then a per-row selection.

The contract of ``glm_dsa.indexer.indexer_topk`` (request-relative int32 ``[S, topk]``, ``-1``
padding, a row with ``≤ topk`` keys gives ``0 … len − 1``) except the order inside a row, which
is free (set semantics, as every upstream top-k kernel). Logits are computed by
``fp8_mqa_logits``'s kernel chunk by chunk within the same byte budget as the reference, so the
peak is one chunk's float32 logits plus the inputs (and the select's candidate buffer,
``CAND_FACTOR · topk`` keys and columns per row: 96 KiB a row at ``topk`` = 2048). Selection is
the radix select of ``glm_dsa.kernels.topk``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from glm_dsa.indexer import RowChunk, chunked_topk
from glm_dsa.kernels.mqa_logits import check_device, check_kernel_shapes, launch_mqa_logits
from glm_dsa.kernels.topk import launch_select, raise_on_nan
from glm_dsa.validate import check_indexer_topk_inputs

__all__ = ["indexer_topk", "select_in_chunks"]


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
    """Top-k keys of every query row with the Triton logits kernel, in budgeted row chunks.

    Args:
        q_fp8: ``[S, H, D]`` float8_e4m3fn; ``weights``: ``[S, H]`` float32 head gates.
        k_fp8: ``[S_kv, D]`` float8_e4m3fn; ``k_scale``: ``[S_kv]`` float32.
        ks, ke: int32 ``[S]``, row ``m`` may select keys ``[ks[m], ke[m])``.
        topk: indices per row (``index_topk``).
        budget_bytes: bytes the float32 logits may take at once (``logits_budget_bytes``).

    Returns:
        int32 ``[S, topk]`` relative to ``ks``, ``-1`` padded, any order within a row.
    """
    check_indexer_topk_inputs(q_fp8, weights, k_fp8, k_scale, ks, ke, topk)
    check_kernel_shapes(q_fp8.shape[1], q_fp8.shape[2], weights)
    check_device(q_fp8)

    def chunk_logits(chunk: RowChunk) -> Tensor:
        r0, r1, lo, hi = chunk.r0, chunk.r1, chunk.lo, chunk.hi
        return launch_mqa_logits(
            q_fp8[r0:r1], k_fp8[lo:hi], k_scale[lo:hi], weights[r0:r1],
            chunk.starts.to(torch.int32), chunk.ends.to(torch.int32), clean_logits=False,
            max_seqlen_k=0,
        )  # fmt: skip

    return select_in_chunks(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes, chunk_logits)


def select_in_chunks(
    q_fp8: Tensor,
    weights: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    ks: Tensor,
    ke: Tensor,
    topk: int,
    budget_bytes: int,
    chunk_logits: Callable[[RowChunk], Tensor],
) -> Tensor:
    """``indexer.chunked_topk`` with the radix select on each chunk's float32 logits
    ``chunk_logits(chunk)`` ``[r1 − r0, ≥ hi − lo]`` (entries outside each row's window unread),
    on checked arguments; ValueError afterwards on NaN inside a row that was read. The Triton
    and peers backends differ only in ``chunk_logits``."""
    nans = torch.zeros(q_fp8.shape[0], dtype=torch.int32, device=q_fp8.device)

    def chunk_topk(chunk: RowChunk) -> Tensor:
        picked, nans[chunk.r0:chunk.r1] = launch_select(chunk_logits(chunk), chunk.starts, chunk.ends, topk)
        return picked

    out = chunked_topk(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes, chunk_topk)
    # One wait for the whole call, not one per row chunk: the host keeps queueing chunks.
    raise_on_nan(nans)
    return out
