"""Triton FP8 MQA logits: DeepGEMM's ``fp8_mqa_logits`` and ``fp8_paged_mqa_logits``.

``out[i, j] = k_scale[j] * sum_h weights[i, h] * relu(q[i, h] · k[j])`` for ``j ∈ [ks[i], ke[i])``
in one kernel, with the signatures, shapes and conventions of ``glm_dsa.oracle``'s functions of
the same names. The ``[S, H, N]`` per-head scores never leave registers.

Tiling (as DeepGEMM's sm90 kernel and TileLang's ``fp8_lighting_indexer``): a program owns
``BLOCK_M`` query rows and loads their ``[BLOCK_M·H, D]`` fp8 queries once; it loops over key
tiles of ``BLOCK_N`` and computes ``k_tile [BLOCK_N, D] @ qᵀ`` (fp8 × fp8 → fp32, wgmma on
Hopper; D is one K step). Keys are the M side of the MMA and the heads its N side, so the head
reduction runs along the accumulator's columns, not across warps. ``BLOCK_Q = BLOCK_M·H``
(heads padded to a power of two) is the MMA's N.

Column order: Hopper's accumulator gives a thread the columns whose index bits 0 and 3 up are
its own registers, bits 1–2 its quad's four lanes. With ``HEAD_MAJOR_ROWS`` = 4 rows a block
or more the columns are head-major — column ``((r_hi·HP/2 + h_hi)·4 + r_lo)·2 + h_lo`` holds
row ``4·r_hi + r_lo``'s head ``2·h_hi + h_lo``: the lane bits pick rows, a row's heads all lie in
one thread's registers, and the head sum is a run of explicit FMAs (``_gated_sum``) in the order
of those registers (the same at every head-major block) with no shuffles, its logit held by one
thread (row-major, ``r·HP + h``, the quad's lanes split a row's heads: two shuffle rounds, and
each logit held four times over, so the epilogue after the sum ran four times; offline sm_90
compiles at H = 32: the candidate loop 679 → 499 instructions a thread a key tile, the logits
loop 489 → 400 at ``BLOCK_Q`` 256 and 553 → 466 at 128). Smaller blocks stay
row-major, and ``one_head_order`` keeps the tuner to configs of one order for a head count, so
that a (row, key) gets the same bits whichever config runs (docs/determinism.md).

Work skipping: a program computes only the key tiles that meet the union of its rows' windows
(causal prefill: about half the pairs); the rest of its columns are filled with ``-inf`` when
``clean_logits`` (a store, no loads). The grid is (row blocks, column splits): the row blocks are
launched heaviest-first (causal rows are longer the later they are) and the columns are split
only when there are too few row blocks to fill the GPU. The logits kernel splits all the keys
(each split fills its own columns); the candidate kernel, which fills nothing, splits only the
tiles that meet its row block's windows.

The candidate kernel's stores and atomics: on NVIDIA GPUs inline PTX (``PTX_EPILOGUE``), on the
tile's MMA layout. Triton gives every memory op on a tensor of pointers a coalescing layout of
its own and converts the values into it through shared memory, with a barrier of the program
each time: the candidate kernel converted twice a key tile (the kept mask before its atomics,
the slots and keys before its stores), so every warp waited at each tile for the slowest warp's
atomic round trip. The interpreter takes Triton's ops (the same entries; a CUDA test compares
both forms). The logits kernels keep Triton's stores: their tiles' logits are dense rows, which
the coalescing layout writes in fewer requests (the PTX form ran 1.04× slower at 128 × 128 tiles,
run Z3).

On sm_90, ``glm_dsa.kernels.mqa_logits_gluon`` is a warp-specialized Gluon form of the logits and
candidate kernels (same contracts); it is not dispatched from here: measured on one H200 it ran
at 0.90–0.97× this kernel (bench/RESULTS.md, issue 43).

Numerics: each fp8 dot product is accumulated in float32 by the tensor core (exact for
D = 128 products on the interpreter; Hopper's fp8 wgmma adds with a narrower accumulator), then
ReLU, gate, a head sum in the reduction's order, key scale. Checked against the oracle with
DeepGEMM's ``calc_diff``, not bitwise.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.kernels.topk import COUNTERS, order_keys
from glm_dsa.validate import (
    check_compressed_width,
    check_index_vector,
    check_logits_inputs,
    check_mqa_logits_mode,
    check_paged_inputs,
    check_paged_kv_cache,
    check_ranges,
    need,
)

# The candidate kernel bumps column 0 of each row's counters (glm_dsa.kernels.topk's layout).
_COUNTERS = tl.constexpr(COUNTERS)

__all__ = ["fp8_mqa_logits", "fp8_paged_mqa_logits", "launch_mqa_candidates", "CONFIGS",
           "CANDIDATE_CONFIGS", "INTERPRET_CONFIGS",
           "logits_config_of", "one_head_order", "HEAD_MAJOR_ROWS"]

# Autotune space, tuned for the GLM-5.3 indexer on one H200 (H = 32, D = 128, 4K–32K query rows
# × 128K–1M keys, causal). BLOCK_Q = BLOCK_M · H is the MMA's N (TileLang uses 128 // H rows);
# BLOCK_N keys are its M: 64 per warpgroup, so BLOCK_N = 128 wants 8 warps or two M repeats of
# 4. The fp32 accumulator is BLOCK_N · BLOCK_Q / (32 · num_warps) registers per thread (≤ 128).
CONFIGS = [
    {"BLOCK_Q": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3},
    {"BLOCK_Q": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_Q": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 3},
    {"BLOCK_Q": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 4},
    {"BLOCK_Q": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
    {"BLOCK_Q": 256, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_Q": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4},
    # Candidates not yet measured (ratio to DeepGEMM 0.91 with the above): deeper pipelines.
    {"BLOCK_Q": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4},
    {"BLOCK_Q": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 5},
    {"BLOCK_Q": 128, "BLOCK_N": 256, "num_warps": 8, "num_stages": 5},
]
# The candidate kernel (``launch_mqa_candidates``) keeps the logits kernel's tiles. On the
# indexer's 32,768 × 1,015,808 chunk (H200, 2026-12-01, bench/RESULTS.md issue 30): 392 ms,
# 429 ms, and 519 ms for BLOCK_Q 128 / BLOCK_N 128 / 8 warps, dropped (each config tried costs
# a few seconds of first-call tuning per shape class at this size). 128 × 128 with 4 warps, the
# logits kernel's pick at 4,096 × 131,072: 8.3 ms against 5.4 there, 321 against 271 ms at
# 32,768 × 1M (H100, 2026-12-07, run T), and its keys not the logits kernel's bits: dropped.
# A tile's kept entries are stored one tile later, so that the slot atomics' round trip runs
# under the next tile's MMA. With Triton's own atomics and stores that bought nothing (run T:
# within 1-3 % of storing at once, both tuned), because each tile's layout conversions made the
# whole program wait for every warp's atomics; with the PTX epilogue it takes 11-16 % off the
# kernel at the shipped tiles (H100, 2026-12-07, run Z3: 4,096 × 131,072 5.42 → 4.56 ms,
# 16,384 × 131,072 19.68 → 18.35, 4,096 × 1M 41.68 → 38.16), and storing at once was dropped.
CANDIDATE_CONFIGS = [
    {"BLOCK_Q": 256, "BLOCK_N": 64, "num_warps": 4, "num_stages": 4},
    {"BLOCK_Q": 256, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
]
# Triton's CPU interpreter (TRITON_INTERPRET=1, the CI tests) runs programs one after another
# in numpy: one config (the candidate kernel's too), small tiles so that masking and splits are
# exercised at small shapes.
INTERPRET_CONFIGS = [{"BLOCK_Q": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}]
# Column splits are added until there are about this many programs per SM.
PROGRAMS_PER_SM = 2
# The interpreter has no SMs; this many programs make small tests split their columns.
INTERPRET_PROGRAMS = 4
# Largest padded head count: the MMA's N side holds at least one row's heads.
MAX_HEADS = 256
# Rows a block needs for head-major columns (module docstring): a quad's 4 lanes, one row each.
HEAD_MAJOR_ROWS = 4
_HEAD_MAJOR_ROWS = tl.constexpr(HEAD_MAJOR_ROWS)

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# The candidate kernel's stores and atomics as inline PTX on NVIDIA GPUs (``_store_candidates``);
# the interpreter (and ROCm) take Triton's own.
_PTX_EPILOGUE = not _INTERPRET and torch.version.hip is None
_INTERPRETED = tl.constexpr(_INTERPRET)


def _configs(table: list[dict], interpret_table: list[dict]) -> list[triton.Config]:
    """``triton.Config``s of a table (``interpret_table`` on the interpreter): every key but
    ``num_warps`` and ``num_stages`` is a constexpr of the kernel."""
    return [
        triton.Config({k: v for k, v in c.items() if k not in ("num_warps", "num_stages")},
                      num_warps=c["num_warps"], num_stages=c["num_stages"])
        for c in (interpret_table if _INTERPRET else table)
    ]


def logits_config_of(candidate_config: triton.Config) -> triton.Config:
    """The logits kernel's config with a candidate config's tiles and steps (its logits, so
    the rows ``indexer_topk`` redoes are scored as the candidate kernel scored them)."""
    tiles = {k: candidate_config.kwargs[k] for k in ("BLOCK_Q", "BLOCK_N")}
    return triton.Config(tiles, num_warps=candidate_config.num_warps,
                         num_stages=candidate_config.num_stages)


# ----------------------------------------------------------------------------- device code
@triton.jit
def _row_block_window(ks, ke, n_keys):
    """Union ``[lo, hi)`` of the non-empty windows of a row block (``lo ≥ hi`` when none)."""
    nonempty = ke > ks
    lo = tl.min(tl.where(nonempty, ks, n_keys), axis=0)
    hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
    return lo, hi


@triton.jit
def _dim_mask(row_ok, d, D: tl.constexpr, DP: tl.constexpr):
    """``[rows, DP]`` load mask. Without padding it is constant along the dims, which keeps
    the loads vectorized (16-byte cp.async) and so pipelinable."""
    if DP == D:
        return tl.broadcast_to(row_ok[:, None], (row_ok.shape[0], DP))
    return row_ok[:, None] & (d[None, :] < D)


@triton.jit
def _load_queries(q_ptr, w_ptr, rows, row_ok, H: tl.constexpr, D: tl.constexpr,
                  HP: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr):
    """The block's queries ``[BLOCK_M·HP, DP]`` fp8 and gates ``[BLOCK_M·HP]`` fp32, zero-padded,
    in the MMA's column order: head-major with ``HEAD_MAJOR_ROWS`` rows or more and two heads or
    more (column ``((r_hi·HP/2 + h_hi)·4 + r_lo)·2 + h_lo`` is
    row ``4·r_hi + r_lo``'s head ``2·h_hi + h_lo``) or row-major (``r·HP + h``).

    Padded heads and dims load zeros: relu(0) · 0 adds nothing to any logit.
    """
    i = tl.arange(0, BLOCK_M * HP)
    if (BLOCK_M >= _HEAD_MAJOR_ROWS) & (HP >= 2):
        h = (i // 8) % (HP // 2) * 2 + i % 2
        blocks: tl.constexpr = (BLOCK_M // 4, 1, 4, 1)
        spread: tl.constexpr = (BLOCK_M // 4, HP // 2, 4, 2)
        row = tl.reshape(tl.broadcast_to(tl.reshape(rows, blocks), spread), (BLOCK_M * HP,))
        ok = tl.reshape(tl.broadcast_to(tl.reshape(row_ok, blocks), spread), (BLOCK_M * HP,))
    else:
        h = i % HP
        row = tl.reshape(tl.broadcast_to(rows[:, None], (BLOCK_M, HP)), (BLOCK_M * HP,))
        ok = tl.reshape(tl.broadcast_to(row_ok[:, None], (BLOCK_M, HP)), (BLOCK_M * HP,))
    ok = ok & (h < H)
    d = tl.arange(0, DP)
    q_row = row.to(tl.int64) * H + h
    q = tl.load(q_ptr + q_row[:, None] * D + d[None, :], mask=_dim_mask(ok, d, D, DP), other=0.0)
    w = tl.load(w_ptr + q_row, mask=ok, other=0.0)
    return q, w


@triton.jit
def _gated_sum(acc, acc_gate, relu, gate):
    """The head sum's step: ``acc · acc_gate + relu · gate`` as one explicit fma, and gate 1
    for the partial sum. A head's ``(relu, gate)`` pair enters unmultiplied, so the first step
    is ``fma(relu₁, gate₁, relu₀ · gate₀)`` and every later one ``fma(reluᵢ, gateᵢ, acc)``
    (``acc · 1`` folds). With ``tl.sum`` of the products LLVM fused one of the first two products
    into the first add, and which one followed the code around the sum: the candidate kernel
    with the PTX epilogue took the other product than the logits kernel for some rows, and
    their logits differed by an ULP (run Z2, bench/RESULTS.md)."""
    return tl.fma(relu, gate, acc * acc_gate), tl.full(acc.shape, 1.0, acc.dtype)


@triton.jit
def _rows_by_heads(x, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, HP: tl.constexpr):
    """A tile's ``[BLOCK_N, BLOCK_M·HP]`` MMA columns as ``[BLOCK_N, BLOCK_M, HP]`` (row, head),
    undoing the head-major column order (module docstring)."""
    if (BLOCK_M >= _HEAD_MAJOR_ROWS) & (HP >= 2):
        x = tl.permute(tl.reshape(x, (BLOCK_N, BLOCK_M // 4, HP // 2, 4, 2)), (0, 1, 3, 2, 4))
    return tl.reshape(x, (BLOCK_N, BLOCK_M, HP))


@triton.jit
def _tile_logits(k, k_scale, q, w, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                 HP: tl.constexpr):
    """``[BLOCK_N, BLOCK_M]``: ``k_scale · Σ_h w · relu(k · q_h)`` for one key tile, the heads
    summed in one order whatever the tile or the kernel (module docstring)."""
    s = tl.maximum(tl.dot(k, tl.trans(q)), 0.0)  # [BLOCK_N, BLOCK_M·HP] fp32
    s = _rows_by_heads(s, BLOCK_N, BLOCK_M, HP)
    g = _rows_by_heads(tl.broadcast_to(w[None, :], (BLOCK_N, BLOCK_M * HP)), BLOCK_N, BLOCK_M, HP)
    if _INTERPRETED:
        # numpy sums in its own order, and a combine function runs element by element there.
        return tl.sum(s * g, axis=2) * k_scale[:, None]
    total, gate = tl.reduce((s, g), 2, _gated_sum)
    # One head: the reduction returns its pair unmultiplied; more: gate 1, which folds.
    return total * gate * k_scale[:, None]


@triton.jit
def _fill(out_ptr, out_stride, rows, row_ok, t0, t1, n_out, BLOCK_N: tl.constexpr,
          BLOCK_M: tl.constexpr):
    """``-inf`` into output columns of key tiles ``[t0, t1)`` of the block's rows."""
    fill = tl.full((BLOCK_N, BLOCK_M), float("-inf"), tl.float32)
    for t in range(t0, t1):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
        ptrs = out_ptr + rows[None, :].to(tl.int64) * out_stride + cols[:, None]
        tl.store(ptrs, fill, mask=row_ok[None, :] & (cols[:, None] < n_out))


@triton.jit
def _split_range(n_tiles, lo, hi, BLOCK_N: tl.constexpr):
    """This program's key tiles: its split ``[s0, s1)`` and the computed part ``[c0, c1)``."""
    per_split = tl.cdiv(n_tiles, tl.num_programs(1))
    s0 = tl.program_id(1) * per_split
    s1 = tl.minimum(s0 + per_split, n_tiles)
    c0 = tl.minimum(tl.maximum(lo // BLOCK_N, s0), s1)
    c1 = tl.maximum(tl.minimum(tl.cdiv(hi, BLOCK_N), s1), c0)
    return s0, s1, c0, c1


@triton.jit
def _window_split(lo, hi, BLOCK_N: tl.constexpr):
    """This program's key tiles ``[c0, c1)``: those meeting its row block's windows ``[lo, hi)``
    (``_row_block_window``), split evenly across the grid's column splits, so that a block whose
    rows see a few of the keys (a later request of a batch) still spreads them over every split."""
    t0 = lo // BLOCK_N
    t1 = tl.maximum(tl.cdiv(hi, BLOCK_N), t0)
    per_split = tl.cdiv(t1 - t0, tl.num_programs(1))
    c0 = tl.minimum(t0 + tl.program_id(1) * per_split, t1)
    return c0, tl.minimum(c0 + per_split, t1)


@triton.jit
def _row_block(q_ptr, w_ptr, ks_ptr, ke_ptr, S, n_keys, H: tl.constexpr, D: tl.constexpr,
               HP: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's row block (heaviest first: causal windows grow with the row): its rows,
    their windows and the union ``[lo, hi)`` of them (``_row_block_window``), queries and gates."""
    pid_m = tl.num_programs(0) - 1 - tl.program_id(0)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S
    ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
    ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
    lo, hi = _row_block_window(ks, ke, n_keys)
    q, w = _load_queries(q_ptr, w_ptr, rows, row_ok, H, D, HP, DP, BLOCK_M)
    return rows, row_ok, ks, ke, lo, hi, q, w


@triton.jit
def _key_tile(k_ptr, k_scale_ptr, q, w, t, n_keys, D: tl.constexpr, DP: tl.constexpr,
              HP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tile ``t`` of contiguous keys: its columns, their in-range mask and its logits
    ``[BLOCK_N, BLOCK_M]``."""
    cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_keys
    d = tl.arange(0, DP)
    k = tl.load(k_ptr + cols[:, None].to(tl.int64) * D + d[None, :],
                mask=_dim_mask(col_ok, d, D, DP), other=0.0)
    k_scale = tl.load(k_scale_ptr + cols, mask=col_ok, other=0.0)
    return cols, col_ok, _tile_logits(k, k_scale, q, w, BLOCK_N, BLOCK_M, HP)


@triton.jit
def _mqa_logits_kernel(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    S, n_keys, n_out, out_stride, size_class,
    H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    CLEAN: tl.constexpr, COMPRESSED: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_M: tl.constexpr = max(BLOCK_Q // HP, 1)
    rows, row_ok, ks, ke, lo, hi, q, w = _row_block(
        q_ptr, w_ptr, ks_ptr, ke_ptr, S, n_keys, H, D, HP, DP, BLOCK_M, BLOCK_N)
    s0, s1, c0, c1 = _split_range(tl.cdiv(n_keys, BLOCK_N), lo, hi, BLOCK_N)
    row_off = rows.to(tl.int64) * out_stride
    for t in tl.range(c0, c1):
        cols, col_ok, logits = _key_tile(k_ptr, k_scale_ptr, q, w, t, n_keys, D, DP, HP, BLOCK_M,
                                         BLOCK_N)
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        if COMPRESSED:
            # Row i's column j holds key ks[i] + j; only its window is written.
            ptrs = out_ptr + row_off[None, :] + (cols[:, None] - ks[None, :])
            tl.store(ptrs, logits, mask=inside & row_ok[None, :])
        else:
            if CLEAN:
                logits = tl.where(inside, logits, float("-inf"))
            ptrs = out_ptr + row_off[None, :] + cols[:, None]
            tl.store(ptrs, logits, mask=row_ok[None, :] & col_ok[:, None])
    if CLEAN:
        _fill(out_ptr, out_stride, rows, row_ok, s0, c0, n_out, BLOCK_N, BLOCK_M)
        _fill(out_ptr, out_stride, rows, row_ok, c1, s1, n_out, BLOCK_N, BLOCK_M)


@triton.jit
def _paged_mqa_logits_kernel(
    q_ptr, kv_ptr, kv_scale_ptr, w_ptr, ends_ptr, block_table_ptr, out_ptr,
    next_n, n_out, out_stride, block_stride, block_table_stride, size_class,
    H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    PAGE: tl.constexpr, CLEAN: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    BLOCK_M: tl.constexpr = max(BLOCK_Q // HP, 1)
    pid = tl.num_programs(0) - 1 - tl.program_id(0)
    blocks_per_request = tl.cdiv(next_n, BLOCK_M)
    b = pid // blocks_per_request
    j = (pid % blocks_per_request) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = j < next_n
    rows = b * next_n + j
    ends = tl.load(ends_ptr + rows, mask=row_ok, other=0)
    starts = tl.zeros_like(ends)
    lo, hi = _row_block_window(starts, ends, n_out)
    s0, s1, c0, c1 = _split_range(tl.cdiv(n_out, BLOCK_N), lo, hi, BLOCK_N)
    q, w = _load_queries(q_ptr, w_ptr, rows, row_ok, H, D, HP, DP, BLOCK_M)
    d = tl.arange(0, DP)
    row_off = rows.to(tl.int64) * out_stride
    for t in tl.range(c0, c1):
        pos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        pos_ok = pos < hi
        page = tl.load(block_table_ptr + b * block_table_stride + pos // PAGE, mask=pos_ok,
                       other=0).to(tl.int64)
        # Page layout: PAGE × D fp8 bytes, then PAGE float32 scales.
        base = page * block_stride + (pos % PAGE) * D
        k = tl.load(kv_ptr + base[:, None] + d[None, :], mask=_dim_mask(pos_ok, d, D, DP),
                    other=0.0)
        k_scale = tl.load(kv_scale_ptr + (page * block_stride + PAGE * D) // 4 + pos % PAGE,
                          mask=pos_ok, other=0.0)
        logits = _tile_logits(k, k_scale, q, w, BLOCK_N, BLOCK_M, HP)
        if CLEAN:
            logits = tl.where(pos[:, None] < ends[None, :], logits, float("-inf"))
        ptrs = out_ptr + row_off[None, :] + pos[:, None]
        tl.store(ptrs, logits, mask=row_ok[None, :] & (pos[:, None] < n_out))
    if CLEAN:
        _fill(out_ptr, out_stride, rows, row_ok, s0, c0, n_out, BLOCK_N, BLOCK_M)
        _fill(out_ptr, out_stride, rows, row_ok, c1, s1, n_out, BLOCK_N, BLOCK_M)


@triton.jit
def _mqa_candidates_kernel(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, thr_ptr, cand_key_ptr, cand_idx_ptr,
    counters_ptr, S, n_keys, size_class, cand,
    H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr, DP: tl.constexpr,
    PTX_EPILOGUE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``_mqa_logits_kernel``'s logits, kept only where they reach the row's threshold.

    Entry ``(i, j)`` of row i's window with ``not (logit < thr[i])`` (NaN included) is appended
    to row i's candidate buffer of ``cand`` slots (its order key as int32 bits and
    ``j − ks[i]``) at a slot taken from ``counters[i, 0]`` by an atomic add. Entries past
    ``cand`` are counted but not written, so the count tells the caller the buffer overflowed.
    Nothing else is stored: the logits never reach memory. A tile's kept entries are stored in
    the next tile's step, after its MMA is issued (``CANDIDATE_CONFIGS``).
    """
    BLOCK_M: tl.constexpr = max(BLOCK_Q // HP, 1)
    # No -inf fill here: a program's tiles are its windows' share, not a share of all keys.
    rows, row_ok, ks, ke, lo, hi, q, w = _row_block(
        q_ptr, w_ptr, ks_ptr, ke_ptr, S, n_keys, H, D, HP, DP, BLOCK_M, BLOCK_N)
    c0, c1 = _window_split(lo, hi, BLOCK_N)
    thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0)
    cand_off = rows.to(tl.int64) * cand
    count_ptrs = counters_ptr + tl.broadcast_to(rows[None, :] * _COUNTERS, (BLOCK_N, BLOCK_M))
    # The previous tile's kept entries, their slots still in flight: ``cand`` in the slot of an
    # entry not kept, so that one int32 tile carries both.
    held_slot = tl.full((BLOCK_N, BLOCK_M), cand, dtype=tl.int32)
    held_key = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32)
    for t in tl.range(c0, c1):
        cols, col_ok, logits = _key_tile(k_ptr, k_scale_ptr, q, w, t, n_keys, D, DP, HP, BLOCK_M,
                                         BLOCK_N)
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        take = inside & ~(logits < thr[None, :])  # [BLOCK_N, BLOCK_M]
        key = order_keys(logits).to(tl.int32, bitcast=True)
        # Written after this tile's MMA: the slots came back while it ran.
        _store_candidates(cand_key_ptr, cand_idx_ptr, cand_off, cand, held_slot, held_key,
                          cols[:, None] - BLOCK_N - ks[None, :], PTX_EPILOGUE)
        # One atomic per kept entry, none for the rest: no reduction across warps per tile.
        held_slot, held_key = _take_slots(count_ptrs, take, cand, PTX_EPILOGUE), key
    _store_candidates(cand_key_ptr, cand_idx_ptr, cand_off, cand, held_slot, held_key,
                      c1 * BLOCK_N - BLOCK_N + tl.arange(0, BLOCK_N)[:, None] - ks[None, :],
                      PTX_EPILOGUE)


@triton.jit
def _take_slots(count_ptrs, take, cand, PTX_EPILOGUE: tl.constexpr):
    """Each kept entry's slot, an atomic add on its row's counter; ``cand`` where not kept
    (``[BLOCK_N, BLOCK_M]``). ``PTX_EPILOGUE``: the atomic as inline PTX in the tile's own
    layout (below)."""
    if PTX_EPILOGUE:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.s32 p, $2, 0; mov.u32 $0, $3; "
            "@p atom.relaxed.gpu.global.add.u32 $0, [$1], 1; }",
            "=r,l,r,r", [count_ptrs, take.to(tl.int32), tl.full(take.shape, cand, tl.int32)],
            dtype=tl.int32, is_pure=False, pack=1)
    return tl.where(take, tl.atomic_add(count_ptrs, 1, mask=take, sem="relaxed"), cand)


@triton.jit
def _store_candidates(cand_key_ptr, cand_idx_ptr, cand_off, cand, slot, key, col,
                      PTX_EPILOGUE: tl.constexpr):
    """A tile's kept entries into their rows' buffers at ``slot`` (``[BLOCK_N, BLOCK_M]``;
    ``cand`` or more: not kept, or past the buffer's slots, counted but dropped).

    ``PTX_EPILOGUE``: the stores as inline PTX. Triton gives the pointers of each load, store
    or atomic a coalescing layout of its own and converts the values into it through shared
    memory, with a barrier of the whole program each time; a tile's candidates are a few
    scattered entries, which no layout coalesces, so the PTX stores (and ``_take_slots``'s
    atomic) stay in the MMA's layout and each warp goes on at its own pace.
    """
    at = cand_off[None, :] + slot
    if PTX_EPILOGUE:
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.lt.s32 p, $1, $2; @p st.global.b32 [$3], $4; "
            "@p st.global.b32 [$5], $6; mov.u32 $0, 0; }",
            "=r,r,r,l,r,l,r",
            [slot, tl.full(slot.shape, cand, tl.int32), cand_key_ptr + at, key, cand_idx_ptr + at,
             col],
            dtype=tl.int32, is_pure=False, pack=1)
    else:
        ok = slot < cand
        tl.store(cand_key_ptr + at, key, mask=ok)
        tl.store(cand_idx_ptr + at, col, mask=ok)


def one_head_order(configs, named_args, **kwargs):
    """The configs whose head sum runs in one order for these heads (``HP`` padded heads): the
    head-major ones (``HEAD_MAJOR_ROWS`` rows a block or more) where any is, else all, so that
    every config the tuner may pick gives a (row, key) the same logit bits."""
    hp = kwargs["HP"]
    head_major = [c for c in configs if hp >= 2 and c.kwargs["BLOCK_Q"] // hp >= HEAD_MAJOR_ROWS]
    return head_major or configs


_KEY = ["HP", "DP", "size_class"]
_PRUNE = {"early_config_prune": one_head_order}
# cache_results: the choices are kept in Triton's cache directory beside the compiled kernels, so
# a later process on the same GPU and Triton skips the timing runs (seconds of a short prefill).
_mqa_logits_tuned = triton.autotune(configs=_configs(CONFIGS, INTERPRET_CONFIGS), key=_KEY,
                                    prune_configs_by=_PRUNE, cache_results=True)(_mqa_logits_kernel)
_paged_mqa_logits_tuned = triton.autotune(configs=_configs(CONFIGS, INTERPRET_CONFIGS), key=_KEY,
                                          prune_configs_by=_PRUNE, cache_results=True)(
    _paged_mqa_logits_kernel)
# Tuning runs the kernel several times: its slot counters are zeroed before each run.
_mqa_candidates_tuned = triton.autotune(
    configs=_configs(CANDIDATE_CONFIGS, INTERPRET_CONFIGS), key=_KEY,
    prune_configs_by=_PRUNE, reset_to_zero=["counters_ptr"], cache_results=True,
)(_mqa_candidates_kernel)


# ----------------------------------------------------------------------------- host side
def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _size_class(rows: int, cols: int) -> int:
    """Autotune bucket: problems within a factor of 16 in ``rows × cols`` share a config."""
    return (rows * cols).bit_length() // 4


def check_cuda_tensor(t: Tensor) -> None:
    need(
        _INTERPRET or t.is_cuda,
        f"the Triton kernels need CUDA tensors, got {t.device}; on the CPU set "
        "TRITON_INTERPRET=1 before triton is imported (or use glm_dsa.oracle)",
    )


def check_kernel_shapes(H: int, D: int, weights: Tensor) -> None:
    need(D % 16 == 0 and D >= 16, f"head dim D={D} must be a positive multiple of 16")
    need(1 <= H <= MAX_HEADS, f"H={H} heads: the kernel supports 1 … {MAX_HEADS}")
    need(weights.dtype == torch.float32, f"weights must be float32, got {weights.dtype}")


def _grid(row_blocks, n_tiles, device: torch.device):
    """(row blocks, column splits) with about ``PROGRAMS_PER_SM`` programs per SM."""
    if _INTERPRET:
        target = INTERPRET_PROGRAMS
    else:
        target = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count

    def grid(meta):
        m = row_blocks(max(meta["BLOCK_Q"] // meta["HP"], 1))
        n = n_tiles(meta["BLOCK_N"])
        return (m, max(1, min(n, triton.cdiv(target, max(m, 1)))))

    return grid


def launch_mqa_logits(
    q_fp8: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    clean_logits: bool,
    max_seqlen_k: int,
) -> Tensor:
    """Unchecked launch: ``[S, S_kv]`` logits (``[S, max_seqlen_k]`` when ``max_seqlen_k > 0``).

    The caller has validated every argument; ``ks``/``ke`` int32, ``weights`` float32.
    """
    S, H, D = q_fp8.shape
    n_keys = k_fp8.shape[0]
    compressed = max_seqlen_k > 0
    n_out = max_seqlen_k if compressed else n_keys
    if compressed:
        # Only the windows are written; the rest of the compressed rows is -inf.
        out = torch.full((S, n_out), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    else:
        # clean_logits: the kernel writes every entry; else outside the windows is unspecified.
        out = torch.empty((S, n_out), dtype=torch.float32, device=q_fp8.device)
    if S == 0 or n_out == 0:
        return out
    grid = _grid(lambda bm: triton.cdiv(S, bm), lambda bn: triton.cdiv(n_keys, bn), q_fp8.device)
    _mqa_logits_tuned[grid](
        q_fp8.contiguous(), k_fp8.contiguous(), k_scale.contiguous(), weights.contiguous(),
        ks.to(torch.int32).contiguous(), ke.to(torch.int32).contiguous(), out,
        S, n_keys, n_out, out.stride(0), _size_class(S, n_keys),
        H=H, D=D, HP=_pow2(H), DP=_pow2(max(D, 32)),
        CLEAN=bool(clean_logits) and not compressed, COMPRESSED=compressed,
    )
    return out


def launch_mqa_candidates(
    q_fp8: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    weights: Tensor,
    ks: Tensor,
    ke: Tensor,
    thresholds: Tensor,
    counters: Tensor,
    cand: int,
) -> tuple[Tensor, Tensor]:
    """Unchecked launch of the candidate kernel: the logits of ``launch_mqa_logits`` that are
    not below their row's threshold, appended per row.

    Args:
        q_fp8, k_fp8, k_scale, weights, ks, ke: as ``launch_mqa_logits`` (int32 windows).
        thresholds: float32 ``[S]``; ``-inf`` keeps the whole window.
        counters: int32 ``[S, topk.COUNTERS]``, column 0 zero on entry; on return it holds each row's
            candidate count (all of them, also those past ``cand``).
        cand: slots per row.

    Returns:
        ``(keys, columns)``, int32 ``[S, cand]`` each: the candidates' order keys (as int32 bits,
        ``glm_dsa.kernels.topk``'s key order) and columns relative to ``ks``, in no set order;
        the first ``min(count, cand)`` slots of a row are written.
    """
    S, H, D = q_fp8.shape
    n_keys = k_fp8.shape[0]
    keys = torch.empty((S, cand), dtype=torch.int32, device=q_fp8.device)
    cols = torch.empty((S, cand), dtype=torch.int32, device=q_fp8.device)
    if S == 0 or n_keys == 0:
        return keys, cols
    grid = _grid(lambda bm: triton.cdiv(S, bm), lambda bn: triton.cdiv(n_keys, bn), q_fp8.device)
    _mqa_candidates_tuned[grid](
        q_fp8.contiguous(), k_fp8.contiguous(), k_scale.contiguous(), weights.contiguous(),
        ks, ke, thresholds, keys, cols, counters, S, n_keys, _size_class(S, n_keys), cand,
        H=H, D=D, HP=_pow2(H), DP=_pow2(max(D, 32)), PTX_EPILOGUE=_PTX_EPILOGUE,
    )  # fmt: skip
    return keys, cols


def fp8_mqa_logits(
    q: Tensor,
    kv: tuple[Tensor, Tensor],
    weights: Tensor,
    cu_seqlen_ks: Tensor,
    cu_seqlen_ke: Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> Tensor:
    """``deep_gemm.fp8_mqa_logits`` in Triton; the contract of ``glm_dsa.oracle.fp8_mqa_logits``.

    Args:
        q: ``[S, H, D]`` float8_e4m3fn, ``D`` a multiple of 16, ``H ≤ 256``.
        kv: ``(k_fp8 [S_kv, D] float8_e4m3fn, k_scale [S_kv] float32)``.
        weights: ``[S, H]`` float32 (q scale folded in).
        cu_seqlen_ks, cu_seqlen_ke: int32 ``[S]``, row i's keys ``[ks[i], ke[i])``.
        clean_logits: ``-inf`` outside ``[ks, ke)``; when False those entries are unspecified
            (uninitialized memory, as upstream).
        max_seqlen_k: 0 for ``[S, S_kv]``; ``> 0``: compressed ``[S, max_seqlen_k]`` with
            ``out[i, j] ↔ key ks[i] + j``, requires ``clean_logits=False`` and every
            ``ke − ks ≤ max_seqlen_k``; entries ``j ≥ ke[i] − ks[i]`` are ``-inf``.

    Returns:
        float32 ``[S, S_kv]`` (or ``[S, max_seqlen_k]``).
    """
    check_mqa_logits_call(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, max_seqlen_k)
    return launch_mqa_logits(
        q, kv[0], kv[1], weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits, max_seqlen_k
    )


def check_mqa_logits_call(q: Tensor, kv: tuple[Tensor, Tensor], weights: Tensor,
                          cu_seqlen_ks: Tensor, cu_seqlen_ke: Tensor, clean_logits: bool,
                          max_seqlen_k: int) -> None:
    """``fp8_mqa_logits``'s checks of its arguments (the launches' precondition; the Gluon
    kernel's tests check through it too)."""
    check_mqa_logits_mode(kv, clean_logits, max_seqlen_k)
    k_fp8, k_scale = kv
    S, H, D, S_kv = check_logits_inputs(q, k_fp8, k_scale, weights)
    check_kernel_shapes(H, D, weights)
    check_cuda_tensor(q)
    check_index_vector("cu_seqlen_ks", cu_seqlen_ks, S, q.device)
    check_index_vector("cu_seqlen_ke", cu_seqlen_ke, S, q.device)
    check_ranges(cu_seqlen_ks, cu_seqlen_ke, S_kv, "S_kv")
    if max_seqlen_k > 0:
        check_compressed_width(cu_seqlen_ks, cu_seqlen_ke, max_seqlen_k)


def fp8_paged_mqa_logits(
    q: Tensor,
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool = True,
) -> Tensor:
    """``deep_gemm.fp8_paged_mqa_logits`` in Triton; contract of ``glm_dsa.oracle``'s function.

    Args:
        q: ``[B, next_n, H, D]`` float8_e4m3fn.
        kv_cache: uint8 ``[num_blocks, block_size, 1, D + 4]``, per block the
            ``block_size × D`` e4m3 bytes then ``block_size`` float32 scales (8448 bytes for
            64 × 128); blocks contiguous inside, any block stride that is a multiple of 4.
        weights: ``[B * next_n, H]`` float32.
        context_lens: int32 ``[B]`` (row ``(b, j)`` sees ``0 … ctx_b − next_n + j``) or
            ``[B, next_n]`` (row ``(b, j)`` sees positions ``< context_lens[b, j]``).
        block_table: int32 ``[B, max_blocks]``.
        max_context_len: output width in tokens.
        clean_logits: ``-inf`` outside each row's positions, else unspecified there.

    Returns:
        float32 ``[B * next_n, max_context_len]``.
    """
    num_blocks, page, D = check_paged_kv_cache(q, kv_cache)
    need(
        kv_cache[0].is_contiguous() and kv_cache.stride(0) % 4 == 0,
        "kv_cache blocks must be contiguous inside, with a block stride that is a multiple of "
        f"4 bytes; got strides {kv_cache.stride()}",
    )
    # The reference's checks, on the blocks viewed as its [num_blocks, page bytes] pages.
    ends = check_paged_inputs(q, kv_cache.flatten(1), weights, context_lens, block_table,
                              max_context_len, page)
    B, next_n, H = q.shape[:3]
    check_kernel_shapes(H, D, weights)
    check_cuda_tensor(q)
    if ends.numel():
        # The kernel reads pages through the table unchecked: an entry out of range would
        # read another allocation's bytes, so every entry a row can reach is checked here.
        need_blocks = int(ends.max(dim=1).values.add(page - 1).floor_divide(page).max())
        used = block_table.long()[:, :need_blocks]
        need(
            bool(((used >= 0) & (used < num_blocks)).all()),
            f"block_table holds a page outside [0, {num_blocks}) within a request's context",
        )

    R = B * next_n
    table = block_table.to(torch.int32).contiguous()
    out = torch.empty((R, max_context_len), dtype=torch.float32, device=q.device)
    if R == 0 or max_context_len == 0:
        return out
    grid = _grid(
        lambda bm: B * triton.cdiv(next_n, bm),
        lambda bn: triton.cdiv(max_context_len, bn),
        q.device,
    )
    _paged_mqa_logits_tuned[grid](
        q.contiguous(), kv_cache.view(torch.float8_e4m3fn), kv_cache.view(torch.float32),
        weights.contiguous(), ends.reshape(R).to(torch.int32), table, out,
        next_n, max_context_len, out.stride(0), kv_cache.stride(0), table.stride(0),
        _size_class(R, max_context_len),
        H=H, D=D, HP=_pow2(H), DP=_pow2(max(D, 32)), PAGE=page, CLEAN=bool(clean_logits),
    )
    return out
