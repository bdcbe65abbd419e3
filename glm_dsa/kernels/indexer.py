"""Fast indexer top-k: a candidate filter in the logits kernel's epilogue, then an exact select.

The contract of ``glm_dsa.indexer.indexer_topk`` (request-relative int32 ``[S, topk]``, ``-1``
padding, a row with ``≤ topk`` keys gives ``0 … len − 1``) except the order inside a row, which
is ascending (ties at the k-th value go to the lowest columns, as in the reference, and the
select sorts what it writes: neither set nor order depends on the order the kernels' threads
append candidates in, so every run, eager or captured, writes the same bits). The float32
logits of a row never reach memory. Per launch:

0. **windows**: one small kernel turns the rows' ``[ks, ke)`` into the scored windows and
   their sample's, and zeroes the rows' counters;
1. **sample**: the logits kernel on every ``stride``-th key of the call (``sample_stride``:
   ``topk / SAMPLE_HITS`` keys, more where that would sample over ``SAMPLE`` keys), so that
   about ``SAMPLE_HITS`` sampled keys of any row lie above its k-th score
   (``glm_dsa.kernels.topk``'s analysis);
2. **thresholds**: for each row whose window has more than ``cand`` keys, the sample's score
   that about ``TARGET_FACTOR · topk`` keys of the window are expected to reach; ``-inf``
   (keep every key) for shorter windows;
3. **candidates**: the logits kernel over every key, its epilogue appending the entries not
   below the row's threshold (NaN included) to a per-row buffer of
   ``cand = min(CAND_FACTOR · topk, S_kv)`` slots;
4. **select**: the radix select of ``glm_dsa.kernels.topk`` on each row's candidates, then
   each row's picks sorted by a kernel of its own (one warp a row).

The candidates are every key of the row at or above its threshold, so when there are at least
``topk`` of them they hold every key scoring at or above the k-th best, and the select is an
exact top-k of the kernel's own float32 logits. How good the sample is decides only the speed:
a row whose candidates cannot hold its top-k (fewer than ``topk``: the threshold came out too
high; more than ``cand``: heavy ties) is redone after the last launch by full logits and the
radix select over the row (``select_in_chunks``), in the reference's budgeted row chunks.
The launches are row chunks of ``candidate_rows`` rows, each over every key of the call (the
candidate kernel computes only the tiles that meet a row block's windows), so nothing is read on
the host between the input checks and the last launch: the call's host reads are the checks'
and one after the launches (whether any row is redone or read a NaN; the redone rows' own loop
and the NaN's row, named, only when one is). At 4,096 rows the reference's plan, which reads
each chunk's span first, left the GPU idle through ~0.5 ms of host work (bench/RESULTS.md).
The price: the sample's stride follows ``S_kv``, not the rows' span, so in a batch of more than
``SAMPLE · min_sample_stride(topk)`` keys (1M at topk 2,048) a row whose window is much shorter
than the batch gets fewer sampled keys than its span would have given it — a noisier threshold,
possibly more redone rows; never another result.

Memory: a launch holds its rows' sample logits (4 bytes × ≤ ``SAMPLE``), candidate buffers
(8 bytes × ``cand``) and 36 bytes of counters, threshold, flag and windows, plus the sampled
keys;
``candidate_rows`` keeps that within the bytes SGLang's rule lets the chunk's float32 logits
hold (``4 · max_logit_rows · S_kv``), so the logits budget stays an upper bound on the
indexer's temporaries. At GLM-5.3's 32,768-token chunk over ~1M keys that is 128 KiB a row,
4.3 GB for the whole chunk in one launch under the H200's 6.0 GB budget.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa import budget, syncfree
from glm_dsa.kernels.mqa_logits import (
    check_cuda_tensor,
    check_kernel_shapes,
    launch_mqa_candidates,
    launch_mqa_logits,
)
from glm_dsa.kernels.topk import (
    CAND_FACTOR,
    COUNTERS,
    NANS_COLUMN,
    SAMPLE,
    launch_select,
    launch_select_candidates,
    launch_thresholds,
    min_sample_stride,
    raise_on_nan,
)
from glm_dsa.row_chunks import RowChunk, chunked_topk, prefix_indices
from glm_dsa.validate import check_indexer_topk_inputs

__all__ = ["indexer_topk", "select_in_chunks", "candidate_rows", "candidate_row_bytes",
           "sample_stride", "launch_windows"]

# Per row beside the sample and the candidates: int32 counters, float32 threshold, int32 flag,
# and the windows kernel's five int32.
_ROW_EXTRA_BYTES = 4 * COUNTERS + 4 + 4 + 5 * 4
_COUNTERS = tl.constexpr(COUNTERS)


def sample_stride(span: int, topk: int) -> int:
    """Keys between two sampled ones over a launch's ``span`` columns: as many as the
    threshold's quality allows (``min_sample_stride``), more where the sample would exceed
    ``SAMPLE`` keys."""
    return max(-(-span // SAMPLE), min_sample_stride(topk))


def candidate_row_bytes(num_k: int, topk: int) -> int:
    """Bytes one query row holds during a launch over ``num_k`` keys: its sample logits,
    candidate keys and columns, counters, threshold and redo flag."""
    return 4 * min(SAMPLE, num_k) + 8 * min(CAND_FACTOR * topk, num_k) + _ROW_EXTRA_BYTES


def candidate_rows(num_q: int, num_k: int, D: int, topk: int, budget_bytes: int) -> int:
    """Query rows per launch: as many as fit the bytes the logits budget lets ``num_q × num_k``
    float32 logits hold (``4 · max_logit_rows · num_k``, SGLang's rule), after the sampled keys
    (``D + 4`` bytes each); at least one."""
    logits_bytes = 4 * budget.max_logit_rows(num_q, num_k, budget_bytes) * num_k
    sampled_keys = min(SAMPLE, num_k) * (D + 4)
    return budget.rows_within(logits_bytes - sampled_keys, candidate_row_bytes(num_k, topk), num_q)


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
    """Top-k keys of every query row: candidates filtered in the Triton logits kernel, then an
    exact radix select on them (module docstring).

    Args:
        q_fp8: ``[S, H, D]`` float8_e4m3fn; ``weights``: ``[S, H]`` float32 head gates.
        k_fp8: ``[S_kv, D]`` float8_e4m3fn; ``k_scale``: ``[S_kv]`` float32.
        ks, ke: int32 ``[S]``, row ``m`` may select keys ``[ks[m], ke[m])``.
        topk: indices per row (``index_topk``).
        budget_bytes: bytes the float32 logits may take at once (``logits_budget_bytes``); an
            upper bound on the temporaries here (``candidate_rows``).

    Returns:
        int32 ``[S, topk]`` relative to ``ks``, ``-1`` padded, ascending within a row; the set
        is the reference's top-k of the kernel's float32 logits (lowest columns on ties).

    Raises:
        ValueError: on bad arguments (before any launch), or NaN among the logits of a row
            with more than ``topk`` keys (after every launch, naming the row).
    """
    check_indexer_topk_inputs(q_fp8, weights, k_fp8, k_scale, ks, ke, topk)
    check_kernel_shapes(q_fp8.shape[1], q_fp8.shape[2], weights)
    check_cuda_tensor(q_fp8)
    if syncfree.active():
        # Which rows the candidate filter must redo is read on the host (``nonzero``), which a
        # captured step cannot do: there every row chunk takes the logits and the radix select.
        return select_in_chunks(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes,
                                _full_logits(q_fp8, weights, k_fp8, k_scale))
    S, _, D = q_fp8.shape
    S_kv, dev = k_fp8.shape[0], q_fp8.device
    out = torch.empty((S, topk), dtype=torch.int32, device=dev)
    if S == 0 or S_kv <= topk:
        # Every row keeps all its keys: no scores needed (SGLang's skip path).
        out[:] = prefix_indices(ke.long() - ks.long(), topk)
        return out
    # Written for every row by its launch: the select's redo flags, the windows kernel's zeroed
    # counters (candidates appended, then the select's NaN count).
    redo = torch.empty(S, dtype=torch.int32, device=dev)
    counters = torch.empty((S, COUNTERS), dtype=torch.int32, device=dev)
    cand = min(CAND_FACTOR * topk, S_kv)
    sample = None
    if S_kv > cand:
        stride = sample_stride(S_kv, topk)
        sample = _Sample(k_fp8[::stride].contiguous(), k_scale[::stride].contiguous(), stride)
    rows = candidate_rows(S, S_kv, D, topk, budget_bytes)
    for r0 in range(0, S, rows):
        r1 = min(S, r0 + rows)
        _launch(q_fp8[r0:r1], weights[r0:r1], k_fp8, k_scale, ks[r0:r1], ke[r0:r1], topk, cand,
                sample, out[r0:r1], redo[r0:r1], counters[r0:r1])  # fmt: skip
    nans = counters[:, NANS_COLUMN]
    # The call's one read after its launches: whether any row is redone or read a NaN.
    any_redo, any_nan = torch.stack((redo.amax(), nans.amax())).tolist()
    if any_redo:
        again = redo.nonzero().flatten()
        q_again, w_again = q_fp8[again], weights[again]
        out[again], nans[again] = _select_in_chunks(
            q_again, w_again, k_fp8, k_scale, ks[again], ke[again], topk, budget_bytes,
            _full_logits(q_again, w_again, k_fp8, k_scale),
        )  # fmt: skip
    if any_redo or any_nan:
        raise_on_nan(nans)
    return out


class _Sample(NamedTuple):
    """Every ``stride``-th key of the call (sample ``j`` is key ``j · stride``), contiguous."""

    k_fp8: Tensor
    k_scale: Tensor
    stride: int


@triton.jit
def _windows_kernel(ks_ptr, ke_ptr, win_ptr, counters_ptr, R, topk, cand, stride,
                    BLOCK: tl.constexpr):
    """``launch_windows``' five int32 rows of ``win [5, R]``; the rows' counters zeroed."""
    r = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = r < R
    start = tl.load(ks_ptr + r, mask=ok, other=0).to(tl.int32)
    end = tl.load(ke_ptr + r, mask=ok, other=0).to(tl.int32)
    n = end - start
    # A row that keeps all its keys is not scored: an empty window in the kernels.
    end = tl.where(n > topk, end, start)
    # Sample j is key j · stride: row windows [⌈start / stride⌉, ⌈end / stride⌉), empty for a
    # row whose window fits the candidate buffer (its threshold is -inf).
    s_start = (start + stride - 1) // stride
    s_end = tl.where(n > cand, (end + stride - 1) // stride, s_start)
    tl.store(win_ptr + r, start, mask=ok)
    tl.store(win_ptr + R + r, end, mask=ok)
    tl.store(win_ptr + 2 * R + r, n, mask=ok)
    tl.store(win_ptr + 3 * R + r, s_start, mask=ok)
    tl.store(win_ptr + 4 * R + r, s_end, mask=ok)
    for c in tl.static_range(_COUNTERS):
        tl.store(counters_ptr + r * _COUNTERS + c, 0, mask=ok)


_WINDOW_ROWS = 1024


def launch_windows(ks: Tensor, ke: Tensor, counters: Tensor, topk: int, cand: int, stride: int
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """A launch's row windows in one kernel, on checked windows ``0 ≤ ks ≤ ke`` (integer
    ``[R]``): int32 ``[R]`` each, ``(starts, ends, lens, s_starts, s_ends)`` — the scored window
    ``[ks, ke)``, or ``[ks, ks)`` for a row of ``≤ topk`` keys; ``ke − ks``; the row's window in
    the sample of every ``stride``-th key, ``[⌈ks / stride⌉, ⌈ends / stride⌉)``, empty for a
    row of ``≤ cand`` keys. ``counters`` (int32 ``[R, COUNTERS]``, contiguous) is zeroed."""
    R = ks.shape[0]
    win = torch.empty((5, R), dtype=torch.int32, device=ks.device)
    if R:
        _windows_kernel[(triton.cdiv(R, _WINDOW_ROWS),)](
            ks, ke, win, counters, R, topk, cand, stride, BLOCK=_WINDOW_ROWS)
    starts, ends, lens, s_starts, s_ends = win
    return starts, ends, lens, s_starts, s_ends


def _launch(q_fp8: Tensor, weights: Tensor, k_fp8: Tensor, k_scale: Tensor, ks: Tensor,
            ke: Tensor, topk: int, cand: int, sample: _Sample | None, out: Tensor, redo: Tensor,
            counters: Tensor) -> None:
    """Steps 1–4 for one row chunk (``R`` rows, windows ``[ks, ke)`` over all the call's keys),
    written into the call's rows ``out [R, topk]``, ``redo [R]`` and ``counters [R,
    COUNTERS]`` (``launch_select_candidates``). Every launch spans all ``S_kv`` keys, which
    stand in for the longest window in the sample's stride and the candidate slots ``cand``:
    no host read of the rows' span (the candidate kernel computes only the tiles meeting a row
    block's windows). ``sample``: None when every window fits ``cand`` (thresholds ``-inf``)."""
    R, dev = q_fp8.shape[0], q_fp8.device
    starts, ends, lens, s_starts, s_ends = launch_windows(
        ks, ke, counters, topk, cand, sample.stride if sample is not None else 1)
    if sample is not None:
        logits = launch_mqa_logits(q_fp8, sample.k_fp8, sample.k_scale, weights, s_starts,
                                   s_ends, clean_logits=False, max_seqlen_k=0)  # fmt: skip
        thresholds = launch_thresholds(logits, s_starts, s_ends, lens, topk, cand)
        del logits
    else:
        thresholds = torch.full((R,), float("-inf"), dtype=torch.float32, device=dev)
    keys, cols = launch_mqa_candidates(q_fp8, k_fp8, k_scale, weights, starts, ends, thresholds,
                                       counters, cand)  # fmt: skip
    launch_select_candidates(keys, cols, counters, lens, topk, out=out, redo=redo)


def _full_logits(q_fp8: Tensor, weights: Tensor, k_fp8: Tensor, k_scale: Tensor
                 ) -> Callable[[RowChunk], Tensor]:
    """``chunk_logits`` of the Triton logits kernel: a row chunk's float32 logits over its span."""

    def chunk_logits(chunk: RowChunk) -> Tensor:
        r0, r1, lo, hi = chunk.r0, chunk.r1, chunk.lo, chunk.hi
        return launch_mqa_logits(
            q_fp8[r0:r1], k_fp8[lo:hi], k_scale[lo:hi], weights[r0:r1],
            chunk.starts.to(torch.int32), chunk.ends.to(torch.int32), clean_logits=False,
            max_seqlen_k=0,
        )  # fmt: skip

    return chunk_logits


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
    """``row_chunks.chunked_topk`` with the radix select on each chunk's float32 logits
    ``chunk_logits(chunk)`` ``[r1 − r0, ≥ hi − lo]`` (entries outside each row's window unread),
    on checked arguments; ValueError afterwards on NaN inside a row that was read. The peers
    backend runs it on DeepGEMM's logits; ``indexer_topk`` on the rows it redoes."""
    out, nans = _select_in_chunks(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes,
                                  chunk_logits)  # fmt: skip
    # One wait for the whole call, not one per row chunk: the host keeps queueing chunks.
    raise_on_nan(nans)
    return out


def _select_in_chunks(q_fp8: Tensor, weights: Tensor, k_fp8: Tensor, k_scale: Tensor, ks: Tensor,
                      ke: Tensor, topk: int, budget_bytes: int,
                      chunk_logits: Callable[[RowChunk], Tensor]) -> tuple[Tensor, Tensor]:
    """``select_in_chunks`` without the NaN check: ``(indices, nans)``, nans int32 ``[S]``."""
    nans = torch.zeros(q_fp8.shape[0], dtype=torch.int32, device=q_fp8.device)

    def chunk_topk(chunk: RowChunk) -> Tensor:
        picked, nans[chunk.r0:chunk.r1] = launch_select(chunk_logits(chunk), chunk.starts, chunk.ends, topk)
        return picked

    out = chunked_topk(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes, chunk_topk)
    return out, nans
