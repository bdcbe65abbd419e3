"""Triton exact top-k per row: ``topk_per_row`` by sample threshold and radix select.

The contract of ``glm_dsa.oracle.topk_per_row`` with its defaults (``base="relative"``,
``pad=-1``) except the order inside a row: ascending columns, where the oracle's is by score.
The set is the oracle's: ties at the k-th value go to the lowest columns, so unlike SGLang's
``fast_topk_v2`` or TileLang's ``topk_selector`` it does not depend on the order threads run in;
nor, once sorted in the program, does the row's order (the attention over it sums in it).

One program per row. Scores become order-preserving uint32 keys (a float's bits with the sign
bit set when positive, all bits flipped when negative; ``-0.0`` is first made ``+0.0``), so
float order is integer order and the k-th best score is found exactly by a radix select:
rounds of a histogram over the next digit below the prefix fixed so far (``RADIX_BITS``: four
of 256 bins; a candidate buffer ``CANDIDATE_RADIX_BITS``: the top 2 bits, then five of 64
bins), keeping the bin where the count from the top reaches ``k``. The k-th key and how many
of its ties to take are then exact. When fewer ties are taken than there are, a second radix
select over the tied keys' columns finds the highest column taken (the lowest columns win, as
in the oracle's stable order); a last pass emits every key above the k-th and the ties up to
that column.

Over a long row that select would read the row five times. Instead (about 1.1 reads):
  1. sample the keys at a fixed stride and radix-select the threshold ``T`` that about
     ``TARGET_FACTOR · k`` keys of the row are expected to reach (a strided sample is unbiased
     whatever the scores' order along the row). The stride is ``k / SAMPLE_HITS`` keys, or
     more where that would sample over ``SAMPLE`` keys: the sample is as small as the
     threshold's quality allows, not a fixed size (at 131K columns 1,024 keys, not 8,192);
  2. one pass appends every key ``≥ T`` and its column to a per-row candidate buffer of
     ``CAND_FACTOR · k`` slots;
  3. if the row had between ``k`` and ``CAND_FACTOR · k`` such keys, the exact select runs on
     the buffer (it holds every key ≥ the k-th best); otherwise (a sample that missed, heavy
     ties) it runs on the row itself — slower, never wrong.
With a 2.5 k target the sample puts fewer than k keys above ``T`` when at least 2.5 r of its
r-expected points lie above the true k-th key, ``r = k / stride``: Poisson(16) ≥ 40 at every row
length up to ``SAMPLE · k / SAMPLE_HITS`` columns (1M at k = 2048), 3.3e-7 per row; longer
rows sample ``SAMPLE`` keys, with fewer expected hits.

NaN inside a row that is read (``len > k``) is counted by the kernel and raises ValueError
afterwards, as the oracle does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa import syncfree
from glm_dsa.validate import check_index_vector, check_ranges, need

__all__ = ["topk_per_row", "select_rows", "launch_select", "launch_thresholds",
           "launch_select_candidates", "order_keys", "key_value", "SAMPLE", "TARGET_FACTOR",
           "CAND_FACTOR", "BLOCK", "COUNTERS", "NANS_COLUMN", "RADIX_BITS", "SAMPLE_HITS",
           "CANDIDATE_BLOCK", "CANDIDATE_RADIX_BITS", "min_sample_stride"]

# Most keys a row's strided sample takes (held by one program across its radix rounds).
SAMPLE = 8192
# Sample points expected above a row's k-th key: the stride is at most k / SAMPLE_HITS.
SAMPLE_HITS = 16
# The threshold aims at this many keys per k; the candidate buffer holds CAND_FACTOR · k.
TARGET_FACTOR = 2.5
CAND_FACTOR = 6
# Key bits a radix round fixes: 8, four rounds of 256 bins, for a row or a strided sample.
# Triton's histogram takes one warp ballot per digit bit, then per lane an AND per bit and a
# popcount for each of its ``2^bits / 32`` bins (at least one), and merges the warps' counts by
# shared-memory atomics, ``2^bits / 32`` a thread: fewer bits make a round cheaper but add
# rounds (offline sm_90 compiles, bench/probes/2026-12-07e-offline-select.py: seven 5-bit rounds
# issue ~1.27x the instructions of four 8-bit ones over a 4,096-key block, with 14 atomics
# against 64).
RADIX_BITS = 8
# Columns per loop step of a program: 8 warps × 32 threads × 16 float32 (four 16-byte loads).
BLOCK = 4096
NUM_WARPS = 8
# The candidate select's block and digit: its buffers hold ~2.5 topk keys (~5,000), which a
# 4,096-key block covers in two steps, the second mostly masked lanes. On one H100 (2026-12-07,
# run Y4, bench/probes/2026-12-07e-select-digits.py: 4,096 rows of ~5,900 candidates), ms:
# 4,096 / 8 bits 1.12, 2,048 / 5 1.00, 1,024 / 8 0.97, 1,024 / 6 0.89, 512 / 6 0.86 (not
# taken: 3 % for twice the loop steps).
CANDIDATE_BLOCK = 1024
CANDIDATE_RADIX_BITS = 6
# Warps of the program that sorts a candidate row's picked columns (``_sort_rows_kernel``).
# Inside the select's 8-warp program the sort's bitonic network crossed warps through shared
# memory, with a barrier a step: 0.34 of the select's 1.12 ms at 4,096 rows (run O). Offline
# sm_90 compiles of the sort of 2,048 columns (Triton 3.6): one warp issues 13.8K warp
# instructions a row with no barrier and no spill; 2 / 4 / 8 warps 17.7K / 21.5K / 25.2K with
# 17 / 32 / 44 barriers. On an H100 (run S8a, bench/probes/2026-12-07g-select-sort.py, 4,096 x
# 131,072) the select with its sort: 0.807 ms at 1 warp, 0.930 / 1.239 / 0.970 at 2 / 4 / 8,
# 0.915 with the sort inside the select's program.
SORT_WARPS = 1
# Per-row int32 counters: candidates appended, NaNs read.
_CANDS, _NANS = (tl.constexpr(i) for i in range(2))
COUNTERS = 2
NANS_COLUMN = _NANS.value
_COUNTERS = tl.constexpr(COUNTERS)


@triton.jit
def order_keys(x):
    """uint32 keys with the order of the float32 scores ``x`` (``-0.0`` as ``+0.0``)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    # All ones for a negative score (its sign bit, shifted arithmetically), the sign bit else.
    return (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def key_value(key):
    """The float32 score of an order key of ``order_keys`` (its inverse, ``-0.0`` aside)."""
    flip = tl.where((key >> 31) == 1, 0x80000000, 0xFFFFFFFF).to(tl.uint32)
    return (key ^ flip).to(tl.float32, bitcast=True)


@triton.jit
def _load_block(src, idx_src, offs, first, end, ncols, stride, FROM_ROW: tl.constexpr):
    """Keys, columns, valid mask and NaN mask of the elements ``offs`` of a source.

    Sources: the row (``src`` its column 0, ``stride == 1``; valid columns ``[first, end)``,
    returned relative to ``first``), the row's strided sample (``src`` its first valid column,
    element ``i`` at ``i · stride``, valid ``i < end``), or a candidate buffer (``src`` keys as
    int32 bits, ``idx_src`` their columns, valid ``i < end``; a NaN there is reported too). Row blocks start at multiples of
    the block and are loaded up to ``ncols``, not only inside the window, so that the loads stay
    16-byte vectors; what lies outside ``[first, end)`` is loaded but never used.
    """
    valid = (offs >= first) & (offs < end)
    if FROM_ROW:
        if stride == 1:  # a literal at every call but the sample's
            x = tl.load(src + offs, mask=offs < ncols, other=0.0)
        else:
            x = tl.load(src + offs.to(tl.int64) * stride, mask=valid, other=0.0)
        key = order_keys(x)
        idx = offs - first
        nan = valid & (x != x)
    else:
        key = tl.load(src + offs, mask=valid, other=0).to(tl.uint32, bitcast=True)
        idx = tl.load(idx_src + offs, mask=valid, other=0)
        x = key_value(key)
        nan = valid & (x != x)
    return key, idx, valid, nan


@triton.jit
def _radix_round(hist, prefix, need, DIGIT: tl.constexpr):
    """One radix round over a ``2^DIGIT``-bin histogram of the next digit: the bin where the
    count from the top reaches ``need``, appended to ``prefix``; ``need`` less the keys above
    that bin; and the bin's count (after the last round: the keys equal to the selected one)."""
    bins = tl.arange(0, 1 << DIGIT)
    at_least = tl.cumsum(hist, 0, reverse=True)  # keys whose digit is ≥ the bin's
    digit = tl.sum((at_least >= need).to(tl.int32), 0) - 1
    need -= tl.sum(tl.where(bins > digit, hist, 0), 0)
    prefix = (prefix << DIGIT) | digit.to(tl.uint32)
    return prefix, need, tl.sum(tl.where(bins == digit, hist, 0), 0)


@triton.jit
def _kth_key(src, idx_src, first, end, ncols, stride, k, FROM_ROW: tl.constexpr,
             BLOCK: tl.constexpr, DIGIT: tl.constexpr):
    """The k-th largest key of a source (``1 ≤ k ≤`` its size), how many keys equal to it are
    in the top k, and how many the source holds (rounds of ``DIGIT``-bit digits)."""
    prefix = tl.zeros((), dtype=tl.uint32)
    need = k
    # Digits of DIGIT bits from bit 0 up; the first round takes the top bits left over.
    TOP: tl.constexpr = DIGIT * ((32 + DIGIT - 1) // DIGIT - 1)
    for SHIFT in tl.static_range(TOP, -1, -DIGIT):
        hist = tl.zeros([1 << DIGIT], dtype=tl.int32)
        for blk in range(first // BLOCK, tl.cdiv(end, BLOCK)):
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            key, idx, valid, nan = _load_block(src, idx_src, offs, first, end, ncols, stride,
                                               FROM_ROW)
            if SHIFT < TOP:
                valid = valid & ((key >> (SHIFT + DIGIT)) == prefix)
            hist += tl.histogram(((key >> SHIFT) & ((1 << DIGIT) - 1)).to(tl.int32), 1 << DIGIT,
                                 mask=valid)
        prefix, need, ties = _radix_round(hist, prefix, need, DIGIT)
    return prefix, need, ties


@triton.jit
def _last_tie_column(src, idx_src, first, end, ncols, kth, need, FROM_ROW: tl.constexpr,
                     BLOCK: tl.constexpr, DIGIT: tl.constexpr):
    """The ``need``-th lowest column among a source's keys equal to ``kth`` (``1 ≤ need ≤``
    their number): a radix select, as ``_kth_key``, on ``0x7FFFFFFF − column``."""
    prefix = tl.zeros((), dtype=tl.uint32)
    TOP: tl.constexpr = DIGIT * ((32 + DIGIT - 1) // DIGIT - 1)
    for SHIFT in tl.static_range(TOP, -1, -DIGIT):
        hist = tl.zeros([1 << DIGIT], dtype=tl.int32)
        for blk in range(first // BLOCK, tl.cdiv(end, BLOCK)):
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            key, idx, valid, nan = _load_block(src, idx_src, offs, first, end, ncols, 1, FROM_ROW)
            flipped = (0x7FFFFFFF - idx).to(tl.uint32, bitcast=True)
            tie = valid & (key == kth)
            if SHIFT < TOP:
                tie = tie & ((flipped >> (SHIFT + DIGIT)) == prefix)
            hist += tl.histogram(((flipped >> SHIFT) & ((1 << DIGIT) - 1)).to(tl.int32),
                                 1 << DIGIT, mask=tie)
        prefix, need, _ = _radix_round(hist, prefix, need, DIGIT)
    return 0x7FFFFFFF - prefix.to(tl.int32, bitcast=True)


@triton.jit
def _emit(src, idx_src, first, end, ncols, kth, need, ties, out, nans, topk,
          FROM_ROW: tl.constexpr, BLOCK: tl.constexpr, TOPK: tl.constexpr, DIGIT: tl.constexpr,
          SORT: tl.constexpr):
    """Write every column whose key is above ``kth``, and the ``need`` lowest of the ``ties``
    columns whose key equals it: in ascending column order (``TOPK``: ``topk`` rounded up to a
    power of two), or with ``SORT`` off in the source's order, for ``_sort_rows_kernel``."""
    last_tie = tl.full((), 0x7FFFFFFF, tl.int32)
    if need < ties:
        last_tie = _last_tie_column(src, idx_src, first, end, ncols, kth, need, FROM_ROW, BLOCK,
                                    DIGIT)
    emitted = tl.zeros((), dtype=tl.int32)
    for blk in range(first // BLOCK, tl.cdiv(end, BLOCK)):
        offs = blk * BLOCK + tl.arange(0, BLOCK)
        key, idx, valid, nan = _load_block(src, idx_src, offs, first, end, ncols, 1, FROM_ROW)
        nans += tl.sum(nan.to(tl.int32), 0)
        take = (valid & ((key > kth) | ((key == kth) & (idx <= last_tie)))).to(tl.int32)
        # Slots by a prefix sum, in the source's order: no atomics on one counter per row.
        tl.store(out + emitted + tl.cumsum(take, 0) - take, idx, mask=take != 0)
        emitted += tl.sum(take, 0)
    if SORT:
        # A row is read in ascending column order and so written; a candidate buffer is in the
        # order the atomics that filled it ran, which differs run to run: sorted, the row is
        # the same bits every run, and so is the attention summed over it.
        tl.debug_barrier()
        col = tl.arange(0, TOPK)
        picked = tl.load(out + col, mask=col < topk, other=0x7FFFFFFF)
        before = tl.load(out + col - 1, mask=(col >= 1) & (col < topk), other=-1)
        if tl.sum((picked < before).to(tl.int32), 0) > 0:
            tl.debug_barrier()
            tl.store(out + col, tl.sort(picked), mask=col < topk)
    return nans


@triton.jit
def _store_prefix(out, n, topk, BLOCK: tl.constexpr):
    """A row that keeps every key: ``0 … n − 1`` then ``-1`` into its ``topk`` slots."""
    for s in range(0, topk, BLOCK):
        col = s + tl.arange(0, BLOCK)
        tl.store(out + col, tl.where(col < n, col, -1), mask=col < topk)


@triton.jit
def _topk_kernel(
    x_ptr, stride_row, ncols, starts_ptr, ends_ptr, out_ptr, cand_key_ptr, cand_idx_ptr,
    counters_ptr, topk, target, min_stride, CAND: tl.constexpr, SAMPLE: tl.constexpr,
    BLOCK: tl.constexpr, TOPK: tl.constexpr, DIGIT: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(starts_ptr + row).to(tl.int32)
    end = tl.load(ends_ptr + row).to(tl.int32)
    n = end - start
    out = out_ptr + row * topk
    counters = counters_ptr + row * _COUNTERS
    x = x_ptr + row * stride_row
    nans = tl.zeros((), dtype=tl.int32)
    if n <= topk:
        # Every key is kept: 0 … n − 1 then -1, scores not read.
        _store_prefix(out, n, topk, BLOCK)
    else:
        from_row = n <= CAND
        if not from_row:
            stride = tl.maximum(tl.cdiv(n, SAMPLE), min_stride)
            n_sample = tl.cdiv(n, stride)
            rank = tl.minimum(tl.maximum(tl.cdiv(target * n_sample, n), 1), n_sample)
            threshold, _, _ = _kth_key(x + start, x, 0, n_sample, ncols, stride, rank, True,
                                       BLOCK, DIGIT)
            keys = cand_key_ptr + row * CAND
            cols = cand_idx_ptr + row * CAND
            zero = tl.zeros([BLOCK], dtype=tl.int32)
            for blk in range(start // BLOCK, tl.cdiv(end, BLOCK)):
                offs = blk * BLOCK + tl.arange(0, BLOCK)
                key, idx, valid, nan = _load_block(x, x, offs, start, end, ncols, 1, True)
                nans += tl.sum(nan.to(tl.int32), 0)
                hit = valid & (key >= threshold)
                # An atomic a kept key, not a prefix sum a block: on one H200 (2026-12-04, run
                # G) the scan's barriers over every 4,096 keys cost more than the atomics of
                # the few kept (the composition's select over 1M-key rows 9 % slower).
                slot = tl.atomic_add(counters + _CANDS + zero, 1, mask=hit, sem="relaxed")
                hit = hit & (slot < CAND)
                tl.store(keys + slot, key.to(tl.int32, bitcast=True), mask=hit)
                tl.store(cols + slot, idx, mask=hit)
            tl.debug_barrier()  # the buffer is read back by other threads of the program
            found = tl.atomic_add(counters + _CANDS, 0)
            if (found >= topk) & (found <= CAND):
                kth, need, ties = _kth_key(keys, cols, 0, found, CAND, 1, topk, False, BLOCK,
                                           DIGIT)
                nans = _emit(keys, cols, 0, found, CAND, kth, need, ties, out, nans, topk, False,
                             BLOCK, TOPK, DIGIT, True)
            else:
                from_row = True
        if from_row:
            kth, need, ties = _kth_key(x, x, start, end, ncols, 1, topk, True, BLOCK, DIGIT)
            nans = _emit(x, x, start, end, ncols, kth, need, ties, out, nans, topk, True, BLOCK,
                         TOPK, DIGIT, True)
    tl.store(counters + _NANS, nans)


@triton.jit
def _threshold_kernel(
    x_ptr, stride_row, ncols, starts_ptr, ends_ptr, lens_ptr, thr_ptr, target, cand,
    BLOCK: tl.constexpr, DIGIT: tl.constexpr,
):  # fmt: skip
    """Row r's threshold from its sample ``x[r, starts[r]:ends[r]]`` of a ``lens[r]``-key
    window: the sample's ``⌈target · n_sample / len⌉``-th best score, which about ``target``
    keys of the window reach; ``-inf`` (keep every key) when ``len ≤ cand`` or the sample is
    empty."""
    row = tl.program_id(0).to(tl.int64)
    start = tl.load(starts_ptr + row).to(tl.int32)
    end = tl.load(ends_ptr + row).to(tl.int32)
    n = tl.load(lens_ptr + row).to(tl.int32)
    n_sample = end - start
    thr = tl.full((), float("-inf"), tl.float32)
    if (n > cand) & (n_sample > 0):
        rank = tl.minimum(tl.maximum(tl.cdiv(target * n_sample, n), 1), n_sample)
        key, _, _ = _kth_key(x_ptr + row * stride_row, x_ptr, start, end, ncols, 1, rank, True,
                             BLOCK, DIGIT)
        thr = key_value(key)
    tl.store(thr_ptr + row, thr)


@triton.jit
def _select_candidates_kernel(
    cand_key_ptr, cand_idx_ptr, counters_ptr, lens_ptr, out_ptr, redo_ptr, topk, cand,
    BLOCK: tl.constexpr, TOPK: tl.constexpr, DIGIT: tl.constexpr,
):  # fmt: skip
    """Row r's exact top-k from its candidates (``counters[r, 0]`` of them, every key of the
    row at or above a threshold), or ``redo[r] = 1`` when they cannot hold it: fewer than
    ``topk`` (the threshold was too high) or more than ``cand`` (the buffer overflowed)."""
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(lens_ptr + row).to(tl.int32)
    out = out_ptr + row * topk
    counters = counters_ptr + row * _COUNTERS
    nans = tl.zeros((), dtype=tl.int32)
    redo = tl.zeros((), dtype=tl.int32)
    if n <= topk:
        _store_prefix(out, n, topk, BLOCK)
    else:
        found = tl.load(counters + _CANDS)
        if (found >= topk) & (found <= cand):
            keys = cand_key_ptr + row * cand
            cols = cand_idx_ptr + row * cand
            kth, need, ties = _kth_key(keys, cols, 0, found, cand, 1, topk, False, BLOCK, DIGIT)
            nans = _emit(keys, cols, 0, found, cand, kth, need, ties, out, nans, topk, False,
                         BLOCK, TOPK, DIGIT, False)
        else:
            redo += 1
    tl.store(counters + _NANS, nans)
    tl.store(redo_ptr + row, redo)


@triton.jit
def _sort_rows_kernel(out_ptr, lens_ptr, topk, TOPK: tl.constexpr):
    """Row r's ``topk`` columns in ascending order, for a row of more than ``topk`` keys (a
    shorter row holds ``0 … len − 1`` then ``-1``, already in order; a row the select flagged
    for redoing is sorted too, and overwritten after)."""
    row = tl.program_id(0).to(tl.int64)
    if tl.load(lens_ptr + row) > topk:
        col = tl.arange(0, TOPK)
        out = out_ptr + row * topk + col
        picked = tl.load(out, mask=col < topk, other=0x7FFFFFFF)
        tl.store(out, tl.sort(picked), mask=col < topk)


def min_sample_stride(topk: int) -> int:
    """The least sample stride (keys) for ``topk``: ``SAMPLE_HITS`` points expected above the
    k-th key of any row (module docstring)."""
    return max(topk // SAMPLE_HITS, 1)


def launch_thresholds(sample: Tensor, starts: Tensor, ends: Tensor, lens: Tensor, topk: int,
                      cand: int) -> Tensor:
    """float32 ``[R]`` candidate thresholds (``_threshold_kernel``) from the float32 sample
    logits ``[R, n]`` (row r's valid sample ``[starts[r], ends[r])`` of a window of ``lens[r]``
    keys), aiming at ``TARGET_FACTOR · topk`` keys per row."""
    R = sample.shape[0]
    thr = torch.empty(R, dtype=torch.float32, device=sample.device)
    if R:
        # A sample is ~1K keys a row at 131K (``min_sample_stride``): a 4,096-key block would
        # make each radix round's histogram mostly masked lanes. The threshold is exact at any
        # block, so the block follows the sample, one warp per 512 keys.
        block = min(max(triton.next_power_of_2(sample.shape[1]), 256), BLOCK)
        _threshold_kernel[(R,)](
            sample, sample.stride(0), sample.shape[1], starts, ends, lens, thr,
            int(TARGET_FACTOR * topk), cand, BLOCK=block, DIGIT=RADIX_BITS,
            num_warps=max(block // 512, 1),
        )  # fmt: skip
    return thr


def launch_select_candidates(keys: Tensor, cols: Tensor, counters: Tensor, lens: Tensor,
                             topk: int, out: Tensor | None = None, redo: Tensor | None = None,
                             ) -> tuple[Tensor, Tensor, Tensor]:
    """Top-k of each row from ``launch_mqa_candidates``' buffers: ``(indices, redo, nans)``.

    ``indices``: int32 ``[R, topk]`` relative to the window start, ascending, ``-1`` padded (a
    row with ``lens ≤ topk`` gives ``0 … len − 1``); valid where ``redo`` (int32 ``[R]``) is 0.
    Two launches: the select writes a row's picks in its buffer's order, ``_sort_rows_kernel``
    sorts them in a program of ``SORT_WARPS`` warps. ``nans``:
    int32 ``[R]``, the NaNs among a row's candidates (column 1 of ``counters``, written here).
    ``counters``: int32 ``[R, COUNTERS]``, column 0 the candidate counts. ``out`` and ``redo``,
    when given (contiguous, of those shapes), are written in place of new tensors: a row chunk
    writes straight into its rows of the whole call's.
    """
    R, cand = keys.shape
    dev = keys.device
    if out is None:
        out = torch.empty((R, topk), dtype=torch.int32, device=dev)
    if redo is None:
        redo = torch.empty(R, dtype=torch.int32, device=dev)
    if R:
        _select_candidates_kernel[(R,)](
            keys, cols, counters, lens, out, redo, topk, cand, BLOCK=CANDIDATE_BLOCK,
            TOPK=triton.next_power_of_2(topk), DIGIT=CANDIDATE_RADIX_BITS, num_warps=NUM_WARPS,
        )  # fmt: skip
        _sort_rows_kernel[(R,)](out, lens, topk, TOPK=triton.next_power_of_2(topk),
                                num_warps=SORT_WARPS)
    return out, redo, counters[:, _NANS.value]


def launch_select(logits: Tensor, starts: Tensor, ends: Tensor, topk: int) -> tuple[Tensor, Tensor]:
    """The kernel on checked inputs, without waiting for it: ``(indices, nans)``.

    ``indices``: int32 ``[R, topk]`` relative to ``starts``, ``-1`` padded; ``nans``: int32
    ``[R]``, the NaNs met inside each row that was read (a row with more than ``topk`` keys).
    ``logits``: float32 ``[R, N]``; ``starts``/``ends``: integer ``[R]`` with
    ``0 ≤ start ≤ end ≤ N``; entries outside ``[start, end)`` are never read.
    """
    R = logits.shape[0]
    dev = logits.device
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty((R, topk), dtype=torch.int32, device=dev)
    counters = torch.zeros((R, COUNTERS), dtype=torch.int32, device=dev)
    if R == 0:
        return out, counters[:, _NANS.value]
    cand = CAND_FACTOR * topk
    cand_key = torch.empty((R, cand), dtype=torch.int32, device=dev)
    cand_idx = torch.empty((R, cand), dtype=torch.int32, device=dev)
    _topk_kernel[(R,)](
        logits, logits.stride(0), logits.shape[1], starts, ends, out, cand_key, cand_idx, counters,
        topk, int(TARGET_FACTOR * topk), min_sample_stride(topk), CAND=cand, SAMPLE=SAMPLE,
        BLOCK=BLOCK, TOPK=triton.next_power_of_2(topk), DIGIT=RADIX_BITS, num_warps=NUM_WARPS,
    )  # fmt: skip
    return out, counters[:, _NANS.value]


def raise_on_nan(nans: Tensor, first_row: int = 0) -> None:
    """ValueError naming the first row (``first_row`` + its index) whose ``nans`` count is not 0."""
    bad = nans > 0
    syncfree.check(~bad.any(), "logits hold NaN inside [row_start, row_end) of a row",
                   lambda: f"logits row {first_row + int(bad.nonzero()[0, 0])} holds NaN inside "
                           "[row_start, row_end)")


def select_rows(logits: Tensor, starts: Tensor, ends: Tensor, topk: int) -> Tensor:
    """``launch_select``, then a ValueError on NaN inside a row with more than ``topk`` keys."""
    out, nans = launch_select(logits, starts, ends, topk)
    raise_on_nan(nans)
    return out


def topk_per_row(logits: Tensor, row_starts: Tensor, row_ends: Tensor, topk: int) -> Tensor:
    """The ``topk`` best columns of each row within ``[row_starts[r], row_ends[r])``, ascending.

    Args:
        logits: float32 ``[R, N]``; entries outside a row's range are never read.
        row_starts, row_ends: int32 ``[R]``, ``0 ≤ start ≤ end ≤ N``.
        topk: indices per row.

    Returns:
        int32 ``[R, topk]`` relative to ``row_starts``: a row with ``len ≤ topk`` gives
        ``0 … len − 1`` then ``-1``; otherwise its ``topk`` best columns in ascending order, the
        lowest columns among those tied at the k-th score (the oracle's set).

    Raises:
        ValueError: on bad arguments, or NaN inside the range of a row whose scores are read.
    """
    need(
        logits.dim() == 2 and logits.dtype == torch.float32,
        f"logits must be float32 [R, N], got {logits.dtype} {tuple(logits.shape)}",
    )
    need(isinstance(topk, int) and topk >= 1, f"topk={topk!r} must be a positive int")
    R, N = logits.shape
    check_index_vector("row_starts", row_starts, R, logits.device)
    check_index_vector("row_ends", row_ends, R, logits.device)
    check_ranges(row_starts, row_ends, N, "N")
    return select_rows(logits, row_starts, row_ends, topk)
