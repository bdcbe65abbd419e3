"""Sparse MLA prefill forward for sm_90 in Gluon: warp-specialized ``flash_mla_sparse_fwd``.

Same contract as ``glm_dsa.kernels.sparse_mla`` (and ``glm_dsa.oracle.flash_mla_sparse_fwd``):
natural-log ``max_logits`` / ``lse``, indices ``< 0`` or ``>= s_kv`` and columns ``>=
topk_length[row]`` skipped (never read), lonely rows ``out = 0``, ``max_logits = -inf``,
``lse = +inf``, ``attn_sink`` only in the final normalisation. It runs bf16 queries ``[s_q,
h_q, 576]`` with ``h_q`` a multiple of 64, any ``topk``, over bf16 rows ``[s_kv, 576]`` or the
FP8 pool's 656-byte rows (``kv_format``: 512 e4m3 bytes, 4 float32 tile scales, 64 bf16 RoPE
values), at any 16-aligned row stride: a paged pool is read in place through slot numbers.
``sparse_mla.py`` dispatches here on sm_90 with a tested Triton (``GLUON_TESTED_TRITON``).

Schedule: one CTA per query token and 64-head group (h_q 128 is two neighbouring CTAs that
gather the same rows, the second mostly from L2), three partitions of one warpgroup each.

- **Gather** (4 warps, 72 registers). 16-byte ``cp.async`` of Q ``[64, 576]`` once, then of
  each 64-key tile of indexed rows into a 2-stage ring; Q and a stage are three column
  blocks: latent 0-255 (``*_l``), latent 256-511 (``*_r``), RoPE 512-575 (``*_p``). An
  invalid or masked index becomes a zero-filled row (source size 0: nothing is read). Each
  thread's copies complete into an mbarrier by a no-increment arrive (128 arrivals):
  ``q_ready`` guards Q, ``ready[s]`` stage ``s``'s first latent block and ``ready[STAGES +
  s]`` the rest, so the scores start on the first block while the rest lands (FlashMLA's
  half-tile barriers). Before refilling stage ``s`` it waits on ``empty[s]`` (2 arrivals, one
  per compute warpgroup). Indices are loaded a tile ahead, so their latency hides behind
  that wait. With a ``CONFIG["gather_hint"]`` the row copies (not Q's) carry an L2 hint
  (FlashMLA's evict_last policy and 256-byte prefetch, or one of the two), which a PTX pass
  adds (``ptx_hints``: Triton 3.6 cannot express it).
- **Softmax warpgroup** (the default partition). ``S = Q · Kᵀ`` of the stage (``[64 heads,
  64 keys]``, one full-width wgmma chain over the three blocks), masked by the indices'
  validity, online softmax in base 2 with ``sm_scale · log2 e`` folded into the exponent's
  FFMA (``s · scale − m``, FlashMLA's form; the max is taken over the unscaled scores). A row
  lives in one warp's quad, so its max and sum need no shared memory; this warpgroup owns the
  running max and sum, so no max is exchanged. P, rounded to bf16 as FlashMLA does, overwrites the
  stage's RoPE block (read only by the scores, which are done: FlashMLA's overlay) and the
  rescale factor goes to ``alpha_smem[s]``; a partition barrier, then ``p_ready[s]`` hands
  both over. Then ``O_l = alpha · O_l + P · V_l`` (output columns 0-255) and an arrive on
  ``empty[s]``. At the end it writes the denominators to ``denom_smem`` (``done``), its half of
  the output, ``max_logits`` and ``lse``.
- **Value warpgroup** (4 warps, 168 registers). Waits ``p_ready[s]``, ``O_r = alpha · O_r +
  P · V_r`` (columns 256-511; its GEMM overlaps the softmax warpgroup's next scores), arrives
  on ``empty[s]``; after ``done``, writes its half of the output.

FP8 rows (``_sparse_mla_fwd_fp8_gluon_kernel``): the ring holds the raw rows (e4m3 bytes,
scales tile-major, and the bf16 RoPE block in ``k_p[s]``, where P later goes), 40 KB a
stage; the gather warpgroup dequantizes a stage (``e4m3 · scale`` in float32, rounded once to
bf16: bitwise ``oracle.dequantize_k_cache``) into one bf16 working tile ``w_l | w_r`` that both
compute warpgroups read, guarded by ``work[0]`` (written, 1 arrival) and ``work[1]`` (free, 2
arrivals). A stage's bytes are refilled right after their dequantization (``ready[s]``), its
RoPE block once ``empty[s]`` frees it (``ready[STAGES + s]``, which only the scores wait for).
With one working tile a tile's dequantization waits for the previous tile's last MMA and the
next tile's scores wait for it: the two run in series (1.5x the bf16 time, runs A-D).
The in-place form (``CONFIG["fp8_form"]`` "in_place", the default since runs N and O timed
it; ``_sparse_mla_fwd_fp8_in_place_gluon_kernel``) keeps two bf16 working stages instead of a
raw ring: a tile's e4m3 bytes land over its own stage's right half (the same 32 KB,
chunk-major), are dequantized there (the left half first, then the right half over the bytes
it has read, a partition barrier between), and the compute warpgroups run the bf16 form's
partitions over the stages, so a tile's dequantization overlaps the MMAs of the tile before
(``_gather_fp8_in_place_partition``). Its results are the ring form's bits.

Each accumulator half is ``64 x 256`` float32 (128 registers a thread). Shared memory: bf16
217 KB (Q 72 + ring 144 + factors), FP8 219 KB (Q 72 + ring 82 + working tile 64; in place:
Q 72 + two stages 144 + scales 2),
of the 227 KB an sm_90 block may take. The split (one warpgroup scores, both multiply by V) is
TileLang's ``sparse_mla_fwd_pipelined``: its softmax warpgroup's chain (scores 4.7 MFLOP,
softmax, P · V_l 2.1 MFLOP a tile) is the critical path while the value warpgroup (2.1) idles.

Seesaw (``CONFIG["schedule"]`` "seesaw", or "by_heads" at h_q 128, bf16 rows; ``_sparse_mla_fwd_seesaw_gluon_kernel``,
FlashMLA's SM90 schedule): both compute warpgroups score, warpgroup 0 the even tiles (stage 0),
warpgroup 1 the odd ones (stage 1), 216 registers each. The running max is one chain through
both: warpgroup 0's max after tile ``2r`` goes to warpgroup 1 (``m_ready[0]``), whose max after
tile ``2r + 1`` comes back (``m_ready[1]``) before warpgroup 0's tile ``2r + 2``; the GEMMs of
the two overlap, only the row maxima are serial. Each owns half the output columns and adds
both tiles of a round: its own P from registers (RS wgmma), the peer's P from the stage's RoPE
block (SS; ``p_ready``), rescaling its accumulator and its partial sum at every step of the
chain; the two partial sums meet at the end (``fin``). A stage's halves are freed separately
(0-255 and 256-575), so the gather refills each as soon as its readers are done. Per round each
warpgroup does 8.9 MFLOP (one scores, two half P · V) against the split's 13.6 on the softmax
warpgroup. Shared memory as the split's (217 KB).

``CONFIG`` is the launch configuration; what its choices were measured at is in
bench/RESULTS.md (the Gluon variants table).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.language.nvidia.ampere import async_copy

from glm_dsa.kernels import ptx_hints
from glm_dsa.kernels.aot import compile_gluon_sm90
from glm_dsa.kernels.launch import launch_buffers

__all__ = ["flash_mla_sparse_fwd_gluon", "compile_sm90", "CONFIG", "row_length", "online_softmax",
           "softmax_denominator", "store_max_lse"]

_LOG2E = math.log2(math.e)
BLOCK_H = 64      # heads per CTA: the wgmma M
BLOCK_K = 64      # keys per tile
D_V, D_TAIL = 512, 64
# The launch configuration (see the module docstring). "prefetch": tiles ahead whose rows the
# gather warpgroup asks L2 for while it waits (0: none). Registers: 4 warps of 72 (gather) and
# 168 (value) leave the softmax warpgroup 256; 8 gather warps do not fit (the wgmma accumulator
# needs > 128 registers a thread at 512 threads). Compiled offline for sm_90 (compile_sm90 +
# ptxas -v): no spills in either form; the FP8 gather spilled 44 bytes at 48 registers.
# "schedule": "split" (the softmax and the value warpgroup above), "seesaw" (FlashMLA's: the
# two compute warpgroups score alternate tiles, ``_sparse_mla_fwd_seesaw_gluon_kernel``; bf16
# rows only, always 2 stages, "value_regs" unused) or "by_heads": the seesaw from 128 heads
# (two 64-head CTAs a query), the split below — on one H200 (2026-12-04, run C, 16,384 queries,
# top-2048) the seesaw ran 0.97-0.98x FlashMLA at h_q 128 against the split's 0.85-0.89x, and
# 0.91-0.94x at h_q 64 against the split's 0.90-0.98x; "seesaw_regs" is its odd warpgroup's
# register budget (the even one, the default partition, gets the rest: FlashMLA's 216 / 216 /
# 72); "seesaw_early_scores": warpgroup 0 issues its next tile's scores behind its last P · V
# of a round instead of after it (FlashMLA's order). "gather_hint": the L2 hint on the K/V
# row copies (all three forms; ``ptx_hints``: Triton 3.6 drops async_copy's eviction_policy on
# sm_90, so a PTX pass adds it): "none", "evict_last_256b" (FlashMLA's evict_last policy and
# 256-byte L2 prefetch), "evict_last" or "256b" (one half of it each). Timed on one H200
# (2026-12-04, runs H and I, bench/probes/2026-12-04-h200-hint.py): within 1.3 % of "none" at
# h_q 128, +0-12 % with "evict_last_256b" at h_q 64, still 0.90-0.95x FlashMLA, so "none".
# "fp8_form": the FP8-row kernel, "ring" or "in_place" (two working stages, module docstring):
# on one H100 (2026-12-07, runs N and O, issue 42's six rows) in place 1.20-1.42x the bf16 time,
# the ring 1.29-1.58x, the same bits, so "in_place".
CONFIG: dict[str, Any] = {"stages": 2, "num_warps": 4, "gather_warps": 4, "gather_regs": 72, "value_regs": 168,
          "prefetch": 0, "schedule": "by_heads", "seesaw_regs": 216,
          "seesaw_early_scores": True, "gather_hint": "none", "fp8_form": "in_place"}
# CONFIG was chosen on one H200 (triton 3.6.0) against the variants in bench/RESULTS.md's
# Gluon variants table (runs R1, R1b).


@gluon.jit
def _prefetch_tile(kv_ptr, idx_row, cols, n_cols, s_kv, stride_kv, ROW_BYTES: gl.constexpr):
    """Ask L2 for the valid rows among columns ``cols`` of the index row (one bulk prefetch a
    row, which does not wait for the data)."""
    t = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
    ok = (t >= 0) & (t < s_kv)
    rows = kv_ptr + gl.where(ok, t, 0).to(gl.int64) * stride_kv
    size = gl.full(cols.shape, ROW_BYTES, gl.int32, cols.type.layout)
    gl.inline_asm_elementwise("@$3 cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                              "=r,l,r,b", [rows, size, ok], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _gather_policy(POLICY: gl.constexpr):
    """The L2 policy for the gather's row copies: ``POLICY`` (``ptx_hints.policy_asm``) as inline
    asm, which the PTX pass finds by its marker and hands to the masked cp.async of the
    kernel; nothing when ``POLICY`` is "" (gather_hint "none")."""
    if POLICY != "":
        gl.inline_asm_elementwise(POLICY, "=l", [], dtype=gl.int64, is_pure=False, pack=1)


@gluon.jit
def row_length(len_ptr, qi, topk, HAS_LEN: gl.constexpr):
    """How many of the row's ``topk`` columns count: ``min(topk_length[qi], topk)``."""
    n_cols = topk
    if HAS_LEN:
        n_cols = gl.minimum(gl.load(len_ptr + qi), topk)
    return n_cols


@gluon.jit
def _copy_q(q_ptr, qi, head0, stride_qs, stride_qh, q_l, q_r, q_p, q_ready,
            BLOCK_H: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of query ``qi``'s heads ``head0 ...`` into ``q_l | q_r | q_p``, completing
    ``q_ready`` (a no-increment arrive per thread)."""
    HALF: gl.constexpr = D_V // 2
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    c_half = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay))[None, :]
    c_rope = gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, lay))[None, :]
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, lay))
    q_rows = q_ptr + qi * stride_qs + heads.to(gl.int64)[:, None] * stride_qh
    async_copy.async_copy_global_to_shared(q_l, q_rows + c_half)
    async_copy.async_copy_global_to_shared(q_r, q_rows + HALF + c_half)
    async_copy.async_copy_global_to_shared(q_p, q_rows + D_V + c_rope)
    async_copy.mbarrier_arrive(q_ready, increment_count=False)


@gluon.jit
def _gather_partition(q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, k_l, k_r, k_p,
                      q_ready, ready, empty, s_kv, topk, stride_qs, stride_qh, stride_kv,
                      stride_is, h_groups,
                      HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                      D_V: gl.constexpr, D_TAIL: gl.constexpr, STAGES: gl.constexpr,
                      WARPS: gl.constexpr, PREFETCH: gl.constexpr, ROW_BYTES: gl.constexpr,
                      GATHER_POLICY: gl.constexpr):
    """Q once, then each tile's indexed rows into ring stage ``i % STAGES`` (cp.async)."""
    HALF: gl.constexpr = D_V // 2
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    # 8 threads x 16 bytes cover a 128-byte segment of a row.
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
    c_half = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay))[None, :]
    c_rope = gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, lay))[None, :]
    _copy_q(q_ptr, qi, head0, stride_qs, stride_qh, q_l, q_r, q_p, q_ready, BLOCK_H, D_V,
            D_TAIL, WARPS)
    _gather_policy(GATHER_POLICY)
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    idx_row = idx_ptr + qi * stride_is
    pf_lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    pf_rows = gl.arange(0, BLOCK_K, layout=pf_lay)
    # Each tile's indices are loaded one tile ahead, so their latency hides behind a wait.
    t_next = gl.load(idx_row + rows, mask=rows < n_cols, other=-1)
    for i in range(gl.cdiv(n_cols, BLOCK_K)):
        s = i % STAGES
        if PREFETCH > 0:  # rows PREFETCH tiles ahead into L2 while the ring is full
            _prefetch_tile(kv_ptr, idx_row, (i + PREFETCH) * BLOCK_K + pf_rows, n_cols, s_kv,
                           stride_kv, ROW_BYTES)
        t = t_next
        cols = (i + 1) * BLOCK_K + rows
        t_next = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
        ok = ((t >= 0) & (t < s_kv))[:, None]
        base = kv_ptr + gl.where(ok, t[:, None], 0).to(gl.int64) * stride_kv
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        async_copy.async_copy_global_to_shared(k_l.index(s), base + c_half, mask=ok)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        async_copy.async_copy_global_to_shared(k_r.index(s), base + HALF + c_half, mask=ok)
        async_copy.async_copy_global_to_shared(k_p.index(s), base + D_V + c_rope, mask=ok)
        async_copy.mbarrier_arrive(ready.index(STAGES + s), increment_count=False)


@gluon.constexpr_function
def _ring_bytes_layout(WARPS):
    """The ring form's e4m3 copies: a row's 512 bytes across 16 lanes, 16 bytes a copy."""
    return gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])


@gluon.constexpr_function
def _chunk_layout(WARPS):
    """A ``[BLOCK_K, 64]`` column chunk of e4m3 bytes: 16 bytes a lane, a 128-byte line per
    8 lanes (two 64-byte rows: no bank conflicts unswizzled). The in-place form copies and
    reads each chunk in it, so its rows need 2 indices a lane."""
    return gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])


@gluon.jit
def _fp8_tile_indices(idx_row, i, n_cols, BLOCK_K: gl.constexpr, D_V: gl.constexpr,
                      WARPS: gl.constexpr, lay8: gl.constexpr):
    """Tile ``i``'s indices (-1 past ``n_cols``) in the three layouts its copies use: e4m3
    bytes (rows of ``lay8``), scales (tile-major, one per tile and key), RoPE values."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    lays: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    c8 = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay8))
    cs = i * BLOCK_K + gl.arange(0, (D_V // 128) * BLOCK_K, layout=lays) % BLOCK_K
    cr = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
    return (gl.load(idx_row + c8, mask=c8 < n_cols, other=-1),
            gl.load(idx_row + cs, mask=cs < n_cols, other=-1),
            gl.load(idx_row + cr, mask=cr < n_cols, other=-1))


@gluon.jit
def _gather_fp8_issue(kv_ptr, t8, ts, s_kv, stride_kv, r8_s, rs_s,
                      BLOCK_K: gl.constexpr, D_V: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of a tile's e4m3 bytes and float32 tile scales (rows ``t8`` / ``ts``,
    zero-filled where the index is invalid) into ring stage ``r8_s`` / ``rs_s``."""
    lay8: gl.constexpr = _ring_bytes_layout(WARPS)
    ok = ((t8 >= 0) & (t8 < s_kv))[:, None]
    base = kv_ptr + gl.where(ok, t8[:, None], 0).to(gl.int64) * stride_kv
    async_copy.async_copy_global_to_shared(
        r8_s, base + gl.arange(0, D_V, layout=gl.SliceLayout(0, lay8))[None, :], mask=ok)
    # Scales tile-major, element tile * BLOCK_K + key: the dequantization reads one tile's
    # scale for every key (4-byte copies).
    e = gl.arange(0, (D_V // 128) * BLOCK_K, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    oks = (ts >= 0) & (ts < s_kv)
    scales = (kv_ptr + gl.where(oks, ts, 0).to(gl.int64) * stride_kv
              + D_V).to(gl.pointer_type(gl.float32)) + e // BLOCK_K
    async_copy.async_copy_global_to_shared(rs_s, scales, mask=oks)


@gluon.jit
def _gather_fp8_rope(kv_ptr, tr, s_kv, stride_kv, k_p_s, D_V: gl.constexpr,
                     D_TAIL: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of a tile's bf16 RoPE values (rows ``tr``; after the bytes and the scales)."""
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    ok = ((tr >= 0) & (tr < s_kv))[:, None]
    rope = (kv_ptr + gl.where(ok, tr[:, None], 0).to(gl.int64) * stride_kv
            + D_V + 4 * (D_V // 128)).to(gl.pointer_type(gl.bfloat16))
    async_copy.async_copy_global_to_shared(
        k_p_s, rope + gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, lay))[None, :], mask=ok)


@gluon.jit
def _dequantize(r8_s, rs_s, w_l, w_r, D_V: gl.constexpr, BLOCK_K: gl.constexpr,
                WARPS: gl.constexpr):
    """``e4m3 * tile scale`` in float32, rounded once to bf16, from ring stage ``r8_s`` (its
    scales ``rs_s``, tile-major) into the working tile ``w_l | w_r``, 64 columns at a time."""
    lay: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    HALF: gl.constexpr = D_V // 2
    for c in gl.static_range(D_V // 64):
        k = _dequantize_chunk(r8_s, rs_s, c, BLOCK_K, lay)
        if c * 64 < HALF:
            w_l.slice(c * 64, 64, dim=1).store(k)
        else:
            w_r.slice(c * 64 - HALF, 64, dim=1).store(k)


@gluon.jit
def _dequantize_chunk(r8_s, rs_s, c: gl.constexpr, BLOCK_K: gl.constexpr, lay: gl.constexpr):
    """Columns ``[64 c, 64 c + 64)`` of a stage's keys, bf16 ``[BLOCK_K, 64]``: the e4m3 bytes
    of ``r8_s`` times their tile's float32 scale (``rs_s``, tile-major), rounded once."""
    raw = r8_s.slice(c * 64, 64, dim=1).load(lay)
    return _scaled(raw, rs_s, c, BLOCK_K, lay)


@gluon.jit
def _scaled(raw, rs_s, c: gl.constexpr, BLOCK_K: gl.constexpr, lay: gl.constexpr):
    """``raw`` (column chunk ``c``'s e4m3 bytes, ``[BLOCK_K, 64]`` in ``lay``) times its tile
    scale in float32, rounded once to bf16 (bitwise ``oracle.dequantize_k_cache``)."""
    scale = rs_s.slice(c * 64 // 128 * BLOCK_K, BLOCK_K).load(gl.SliceLayout(1, lay))
    return (raw.to(gl.float8e4nv, bitcast=True).to(gl.float32) * scale[:, None]).to(gl.bfloat16)


@gluon.jit
def _raw_view(w_r_s, BLOCK_K: gl.constexpr, D_V: gl.constexpr):
    """The in-place form's raw stage over the bf16 right half ``w_r_s`` (``[BLOCK_K, D_V / 2]``,
    32 KB): the tile's e4m3 bytes chunk-major, ``[D_V / 64 * BLOCK_K, 64]``, so column chunk
    ``c`` (bytes ``64 c … 64 c + 63`` of every row) is the 4 KB at ``4 KB · c``. A 64-column
    block ``j`` of ``w_r_s`` is the 8 KB at ``8 KB · j`` (NVMMA layouts stack their 128-byte
    swizzle atoms block by block): writing block ``j`` overwrites chunks ``2j`` and ``2j + 1``."""
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=1, order=[1, 0])
    return w_r_s._reinterpret(gl.uint8, [D_V // 64 * BLOCK_K, 64], flat)


@gluon.jit
def _gather_fp8_in_place_issue(kv_ptr, tb, ts, s_kv, stride_kv, raw, rs_s,
                               BLOCK_K: gl.constexpr, D_V: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of a tile's e4m3 bytes, chunk by chunk, into ``raw`` (``_raw_view``) and its
    float32 tile scales into ``rs_s`` (rows ``tb`` / ``ts``, zero-filled where invalid)."""
    lay: gl.constexpr = _chunk_layout(WARPS)
    ok = ((tb >= 0) & (tb < s_kv))[:, None]
    base = (kv_ptr + gl.where(ok, tb[:, None], 0).to(gl.int64) * stride_kv
            + gl.arange(0, 64, layout=gl.SliceLayout(0, lay))[None, :])
    for c in gl.static_range(D_V // 64):
        async_copy.async_copy_global_to_shared(raw.slice(c * BLOCK_K, BLOCK_K), base + c * 64,
                                               mask=ok)
    e = gl.arange(0, (D_V // 128) * BLOCK_K, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    oks = (ts >= 0) & (ts < s_kv)
    scales = (kv_ptr + gl.where(oks, ts, 0).to(gl.int64) * stride_kv
              + D_V).to(gl.pointer_type(gl.float32)) + e // BLOCK_K
    async_copy.async_copy_global_to_shared(rs_s, scales, mask=oks)


@gluon.jit
def _chunk(raw, c: gl.constexpr, BLOCK_K: gl.constexpr, lay: gl.constexpr):
    """Column chunk ``c``'s e4m3 bytes of the in-place raw stage, ``[BLOCK_K, 64]``."""
    return raw.slice(c * BLOCK_K, BLOCK_K).load(lay)


@gluon.jit
def _dequantize_in_place(w_l_s, w_r_s, rs_s, D_V: gl.constexpr, BLOCK_K: gl.constexpr,
                         WARPS: gl.constexpr):
    """The in-place form's dequantization of a stage whose e4m3 bytes lie over ``w_r_s``
    (``_raw_view``): chunks 0-3 into ``w_l_s``; then chunks 4 and 5 into blocks 0 and 1 of
    ``w_r_s`` (over chunks 0-3) and 6 and 7 into blocks 2 and 3 (over chunks 4-7), each pair
    loaded by every thread before a partition barrier lets any thread overwrite its bytes."""
    lay: gl.constexpr = _chunk_layout(WARPS)
    gl.static_assert(D_V == 512, "eight 64-column chunks")
    raw = _raw_view(w_r_s, BLOCK_K, D_V)
    for c in gl.static_range(4):
        w_l_s.slice(c * 64, 64, dim=1).store(_scaled(_chunk(raw, c, BLOCK_K, lay), rs_s, c,
                                                     BLOCK_K, lay))
    b4 = _chunk(raw, 4, BLOCK_K, lay)
    b5 = _chunk(raw, 5, BLOCK_K, lay)
    gl.thread_barrier()  # chunks 0-3 read by every thread: blocks 0 and 1 may take their bytes
    w_r_s.slice(0, 64, dim=1).store(_scaled(b4, rs_s, 4, BLOCK_K, lay))
    w_r_s.slice(64, 64, dim=1).store(_scaled(b5, rs_s, 5, BLOCK_K, lay))
    b6 = _chunk(raw, 6, BLOCK_K, lay)
    b7 = _chunk(raw, 7, BLOCK_K, lay)
    gl.thread_barrier()  # chunks 4-7 read by every thread: blocks 2 and 3 may take theirs
    w_r_s.slice(128, 64, dim=1).store(_scaled(b6, rs_s, 6, BLOCK_K, lay))
    w_r_s.slice(192, 64, dim=1).store(_scaled(b7, rs_s, 7, BLOCK_K, lay))


@gluon.jit
def _gather_fp8_partition(q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, r8, rs, k_p, w_l, w_r,
                          q_ready, ready, empty, work, s_kv, topk, stride_qs, stride_qh,
                          stride_kv, stride_is, h_groups,
                          HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                          D_V: gl.constexpr, D_TAIL: gl.constexpr, STAGES: gl.constexpr,
                          WARPS: gl.constexpr, PREFETCH: gl.constexpr, ROW_BYTES: gl.constexpr,
                          GATHER_POLICY: gl.constexpr):
    """FP8 rows: Q once; per tile the e4m3 bytes and scales into ring stage ``s`` (as soon as
    the previous use of that stage is dequantized), the RoPE values into ``k_p[s]`` (once both
    warpgroups freed it), then the dequantization into the working tile when it is free."""
    lay8: gl.constexpr = _ring_bytes_layout(WARPS)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    _copy_q(q_ptr, qi, head0, stride_qs, stride_qh, q_l, q_r, q_p, q_ready, BLOCK_H, D_V,
            D_TAIL, WARPS)
    _gather_policy(GATHER_POLICY)
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    idx_row = idx_ptr + qi * stride_is
    n_tiles = gl.cdiv(n_cols, BLOCK_K)
    pf_rows = gl.arange(0, BLOCK_K, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    if n_tiles > 0:
        t8, ts, tr = _fp8_tile_indices(idx_row, 0, n_cols, BLOCK_K, D_V, WARPS, lay8)
        _gather_fp8_issue(kv_ptr, t8, ts, s_kv, stride_kv, r8.index(0), rs.index(0), BLOCK_K,
                          D_V, WARPS)
        async_copy.mbarrier_arrive(ready.index(0), increment_count=False)
        _gather_fp8_rope(kv_ptr, tr, s_kv, stride_kv, k_p.index(0), D_V, D_TAIL, WARPS)
        async_copy.mbarrier_arrive(ready.index(STAGES), increment_count=False)
    # The next tile's indices, loaded an iteration ahead so their latency hides behind waits.
    t8, ts, tr = _fp8_tile_indices(idx_row, 1, n_cols, BLOCK_K, D_V, WARPS, lay8)
    for i in range(n_tiles):
        s = i % STAGES
        nxt = (i + 1) % STAGES
        if PREFETCH > 0:
            _prefetch_tile(kv_ptr, idx_row, (i + 1 + PREFETCH) * BLOCK_K + pf_rows, n_cols, s_kv,
                           stride_kv, ROW_BYTES)
        if i + 1 < n_tiles:  # stage nxt's bytes were dequantized last iteration
            _gather_fp8_issue(kv_ptr, t8, ts, s_kv, stride_kv, r8.index(nxt), rs.index(nxt),
                              BLOCK_K, D_V, WARPS)
            async_copy.mbarrier_arrive(ready.index(nxt), increment_count=False)
        t8_2, ts_2, tr_2 = _fp8_tile_indices(idx_row, i + 2, n_cols, BLOCK_K, D_V, WARPS, lay8)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        mbarrier.wait(work.index(1), (i & 1) ^ 1)
        _dequantize(r8.index(s), rs.index(s), w_l, w_r, D_V, BLOCK_K, WARPS)
        fence_async_shared()
        gl.thread_barrier()  # the whole tile is written (and stage s read) before the hand-over
        mbarrier.arrive(work.index(0), count=1)
        if i + 1 < n_tiles:
            mbarrier.wait(empty.index(nxt), (((i + 1) // STAGES) & 1) ^ 1)
            _gather_fp8_rope(kv_ptr, tr, s_kv, stride_kv, k_p.index(nxt), D_V, D_TAIL, WARPS)
            async_copy.mbarrier_arrive(ready.index(STAGES + nxt), increment_count=False)
        t8, ts, tr = t8_2, ts_2, tr_2


@gluon.jit
def _gather_fp8_in_place_partition(q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, rs, k_p,
                                   w_l, w_r, q_ready, ready, empty, landed, s_kv, topk,
                                   stride_qs, stride_qh, stride_kv, stride_is, h_groups,
                                   HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr,
                                   BLOCK_K: gl.constexpr, D_V: gl.constexpr,
                                   D_TAIL: gl.constexpr, WARPS: gl.constexpr,
                                   PREFETCH: gl.constexpr, ROW_BYTES: gl.constexpr,
                                   GATHER_POLICY: gl.constexpr):
    """FP8 rows, two working stages: Q once; tile ``i``'s e4m3 bytes land over ``w_r[i % 2]``
    (with its scales and RoPE values, ``landed``), are dequantized there (``ready``, both
    parts at once), and only then is tile ``i + 1`` asked for, once ``empty`` frees its stage:
    the dequantization of a tile overlaps the MMAs of the one before."""
    lay: gl.constexpr = _chunk_layout(WARPS)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    _copy_q(q_ptr, qi, head0, stride_qs, stride_qh, q_l, q_r, q_p, q_ready, BLOCK_H, D_V,
            D_TAIL, WARPS)
    _gather_policy(GATHER_POLICY)
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    idx_row = idx_ptr + qi * stride_is
    n_tiles = gl.cdiv(n_cols, BLOCK_K)
    pf_rows = gl.arange(0, BLOCK_K, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    if n_tiles > 0:
        tb, ts, tr = _fp8_tile_indices(idx_row, 0, n_cols, BLOCK_K, D_V, WARPS, lay)
        _gather_fp8_in_place_issue(kv_ptr, tb, ts, s_kv, stride_kv,
                                   _raw_view(w_r.index(0), BLOCK_K, D_V), rs.index(0), BLOCK_K,
                                   D_V, WARPS)
        _gather_fp8_rope(kv_ptr, tr, s_kv, stride_kv, k_p.index(0), D_V, D_TAIL, WARPS)
        async_copy.mbarrier_arrive(landed.index(0), increment_count=False)
    tb, ts, tr = _fp8_tile_indices(idx_row, 1, n_cols, BLOCK_K, D_V, WARPS, lay)
    for i in range(n_tiles):
        s = i % 2
        nxt = (i + 1) % 2
        if PREFETCH > 0:
            _prefetch_tile(kv_ptr, idx_row, (i + 1 + PREFETCH) * BLOCK_K + pf_rows, n_cols, s_kv,
                           stride_kv, ROW_BYTES)
        mbarrier.wait(landed.index(s), (i // 2) & 1)
        _dequantize_in_place(w_l.index(s), w_r.index(s), rs.index(s), D_V, BLOCK_K, WARPS)
        fence_async_shared()
        gl.thread_barrier()  # the whole tile is written before the hand-over
        mbarrier.arrive(ready.index(s), count=1)
        mbarrier.arrive(ready.index(2 + s), count=1)
        if i + 1 < n_tiles:
            # After the dequantization, not before: stage nxt is freed only when tile i - 1's
            # MMAs are done, and tile i's, which come next, need this dequantization.
            mbarrier.wait(empty.index(nxt), (((i + 1) // 2) & 1) ^ 1)
            _gather_fp8_in_place_issue(kv_ptr, tb, ts, s_kv, stride_kv,
                                       _raw_view(w_r.index(nxt), BLOCK_K, D_V), rs.index(nxt),
                                       BLOCK_K, D_V, WARPS)
            _gather_fp8_rope(kv_ptr, tr, s_kv, stride_kv, k_p.index(nxt), D_V, D_TAIL, WARPS)
            async_copy.mbarrier_arrive(landed.index(nxt), increment_count=False)
        tb, ts, tr = _fp8_tile_indices(idx_row, i + 2, n_cols, BLOCK_K, D_V, WARPS, lay)


@gluon.jit
def _scores(q_l, q_r, q_p, k_l_s, k_r_s, k_p_s, ready_l, phase_l, ready_r, phase_r,
            layout: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr):
    """``Q · Kᵀ`` of one stage, float32 ``[BLOCK_H, BLOCK_K]``: the three column blocks, the
    first as soon as ``ready_l`` completes its phase ``phase_l``, the others after
    ``ready_r``."""
    s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout)
    mbarrier.wait(ready_l, phase_l)
    fence_async_shared()  # cp.async's writes before the wgmma's (async proxy) reads
    s = warpgroup_mma(q_l, k_l_s.permute((1, 0)), s, is_async=True)
    mbarrier.wait(ready_r, phase_r)
    fence_async_shared()
    s = warpgroup_mma(q_r, k_r_s.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_p, k_p_s.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def online_softmax(s, valid, m_i, l_i, scale_log2):
    """One tile's step of the base-2 online softmax: ``(p, alpha, m_new, l_new)``; ``m`` is in
    scaled units (``max(s) · scale_log2``, the same value as the max of the scaled scores)."""
    # Masked unscaled: ``s · scale_log2 − m`` is then one FFMA a score (FlashMLA's form).
    s = gl.where(valid[None, :], s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)
    # Until a head has seen a valid key its max is -inf; shifting by 0 keeps exp2 NaN-free.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s * scale_log2 - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def softmax_denominator(l_i, m_i, sink_ptr, heads, HAS_SINK: gl.constexpr):
    """The softmax denominator of heads ``heads`` (``[BLOCK_H]``): the row sum ``l_i`` (base 2,
    shifted by the running max ``m_i``) plus the sink's ``exp(attn_sink)`` at that shift; 1 for
    a lonely row without a sink, so that ``out = 0 / 1``."""
    LOG2E: gl.constexpr = 1.4426950408889634
    m_shift = _shift(m_i)
    denom = l_i
    if HAS_SINK:
        denom += gl.exp2(gl.load(sink_ptr + heads) * LOG2E - m_shift)
    return gl.where(denom == 0.0, 1.0, denom)


@gluon.jit
def store_max_lse(max_ptr, lse_ptr, qi, h_q, heads, m_i, l_i):
    """Natural-log ``max_logits`` and ``lse`` of query ``qi``'s heads ``heads`` from the base-2
    running max ``m_i`` and row sum ``l_i``; a lonely row (``l_i == 0``) gets ``lse = +inf``."""
    LN2: gl.constexpr = 0.6931471805599453
    lonely = l_i == 0.0
    lse = gl.where(lonely, float("inf"), (m_i + gl.log2(gl.where(lonely, 1.0, l_i))) * LN2)
    gl.store(max_ptr + qi * h_q + heads, m_i * LN2)
    gl.store(lse_ptr + qi * h_q + heads, lse)


@gluon.jit
def _pv(p_s, v_s, acc, alpha):
    """``alpha · acc + P · V`` for one stage (P and V in shared memory)."""
    acc = acc * alpha[:, None]
    acc = warpgroup_mma(p_s, v_s, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _store_half(out_ptr, acc, denom, qi, head0, col0, stride_os, stride_oh,
                layout: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr):
    """``acc / denom`` as bf16 into output columns ``[col0, col0 + HALF)``."""
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    rows = out_ptr + qi * stride_os + heads.to(gl.int64)[:, None] * stride_oh
    gl.store(rows + cols[None, :], (acc / denom[:, None]).to(gl.bfloat16))


@gluon.jit
def _softmax_partition(idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                       q_l, q_r, q_p, k_l, k_r, k_p, alpha_smem, denom_smem,
                       q_ready, ready, empty, p_ready, done, work,
                       s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh, h_groups,
                       HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr,
                       BLOCK_K: gl.constexpr, D_V: gl.constexpr, STAGES: gl.constexpr,
                       KV_FP8: gl.constexpr):
    """Scores, online softmax, P and alpha for the value warpgroup, ``O_l``; lse at the end.
    bf16 rows: latent blocks ``k_l[s]``, ``k_r[s]``. FP8 rows: ``k_l``, ``k_r`` are the one
    dequantized working tile, guarded by ``work[0]`` (ready) and ``work[1]`` (free)."""
    HALF: gl.constexpr = D_V // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H

    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    idx_row = idx_ptr + qi * stride_is
    key_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    mbarrier.wait(q_ready, 0)
    fence_async_shared()
    t_next = gl.load(idx_row + key_cols, mask=key_cols < n_cols, other=-1)
    for i in range(gl.cdiv(n_cols, BLOCK_K)):
        s = i % STAGES
        valid = (t_next >= 0) & (t_next < s_kv)
        cols = (i + 1) * BLOCK_K + key_cols  # the next tile's, a tile ahead
        t_next = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
        ph = (i // STAGES) & 1
        if KV_FP8:
            v_l = k_l
            scores = _scores(q_l, q_r, q_p, k_l, k_r, k_p.index(s), work.index(0), i & 1,
                             ready.index(STAGES + s), ph, s_layout, BLOCK_H, BLOCK_K)
        else:
            v_l = k_l.index(s)
            scores = _scores(q_l, q_r, q_p, k_l.index(s), k_r.index(s), k_p.index(s),
                             ready.index(s), ph, ready.index(STAGES + s), ph, s_layout,
                             BLOCK_H, BLOCK_K)
        p, alpha, m_i, l_i = online_softmax(scores, valid, m_i, l_i, scale_log2)
        # P over the stage's RoPE block (read only by the scores, which are done).
        k_p.index(s).store(p.to(gl.bfloat16))
        alpha_smem.index(s).store(alpha)
        fence_async_shared()
        gl.thread_barrier()  # every thread's P and alpha are written before the hand-over
        mbarrier.arrive(p_ready.index(s), count=1)
        acc = _pv(k_p.index(s), v_l, acc, gl.convert_layout(alpha, row_o))
        if KV_FP8:
            mbarrier.arrive(work.index(1), count=1)
        mbarrier.arrive(empty.index(s), count=1)

    heads = head0 + gl.arange(0, BLOCK_H, layout=row_s)
    denom = softmax_denominator(l_i, m_i, sink_ptr, heads, HAS_SINK)
    denom_smem.store(denom)
    gl.thread_barrier()
    mbarrier.arrive(done, count=1)
    _store_half(out_ptr, acc, gl.convert_layout(denom, row_o), qi, head0, 0, stride_os,
                stride_oh, o_layout, BLOCK_H, HALF)
    store_max_lse(max_ptr, lse_ptr, qi, h_q, heads, m_i, l_i)


@gluon.jit
def _value_partition(len_ptr, out_ptr, k_r, k_p, alpha_smem, denom_smem, ready, empty,
                     p_ready, done, work, topk, stride_os, stride_oh, h_groups,
                     HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                     D_V: gl.constexpr, STAGES: gl.constexpr, KV_FP8: gl.constexpr):
    """``O_r = alpha · O_r + P · V_r`` per stage; its half of the output at the end (``k_r``
    as in ``_softmax_partition``)."""
    HALF: gl.constexpr = D_V // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    for i in range(gl.cdiv(n_cols, BLOCK_K)):
        s = i % STAGES
        ph = (i // STAGES) & 1
        if KV_FP8:
            mbarrier.wait(work.index(0), i & 1)
            v_r = k_r
        else:
            mbarrier.wait(ready.index(STAGES + s), ph)
            v_r = k_r.index(s)
        mbarrier.wait(p_ready.index(s), ph)
        fence_async_shared()
        alpha = alpha_smem.index(s).load(row_o)
        acc = _pv(k_p.index(s), v_r, acc, alpha)
        if KV_FP8:
            mbarrier.arrive(work.index(1), count=1)
        mbarrier.arrive(empty.index(s), count=1)
    mbarrier.wait(done, 0)
    _store_half(out_ptr, acc, denom_smem.load(row_o), qi, head0, HALF, stride_os, stride_oh,
                o_layout, BLOCK_H, HALF)


@gluon.jit
def _barriers(STAGES: gl.constexpr, GATHER_WARPS: gl.constexpr,
              READY_ARRIVALS: gl.constexpr):
    """The mbarriers of the split forms (see the module docstring), initialised: ``q_ready``,
    ``done``, ``ready [2 * STAGES]`` (a stage's two parts; ``READY_ARRIVALS``: one no-increment
    arrive a gather thread, or 1 where the gather partition arrives once), ``empty``,
    ``p_ready``, ``work [2]`` (the FP8 ring form's working tile: written, free)."""
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    done = gl.allocate_shared_memory(gl.int64, [1], bar)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], bar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    p_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    work = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    mbarrier.init(q_ready, count=GATHER_WARPS * 32)  # a no-increment arrive per gather thread
    mbarrier.init(done, count=1)
    mbarrier.init(work.index(0), count=1)
    mbarrier.init(work.index(1), count=2)  # the softmax and the value warpgroup
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=READY_ARRIVALS)
        mbarrier.init(ready.index(STAGES + s), count=READY_ARRIVALS)
        mbarrier.init(empty.index(s), count=2)
        mbarrier.init(p_ready.index(s), count=1)
    return q_ready, done, ready, empty, p_ready, work


@gluon.jit
def _sparse_mla_fwd_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr,
    s_kv, h_q, topk, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
    STAGES: gl.constexpr, GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr,
    VALUE_REGS: gl.constexpr, PREFETCH: gl.constexpr, GATHER_POLICY: gl.constexpr,
):
    HALF: gl.constexpr = D_V // 2
    h_groups = h_q // BLOCK_H
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_l = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], swz)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], swz)
    q_p = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_TAIL], swz)
    k_l = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, HALF], swz)
    k_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, HALF], swz)
    k_p = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, D_TAIL], swz)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H], flat)
    denom_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    q_ready, done, ready, empty, p_ready, work = _barriers(STAGES, GATHER_WARPS,
                                                           GATHER_WARPS * 32)
    gl.warp_specialize([
        (_softmax_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                              q_l, q_r, q_p, k_l, k_r, k_p, alpha_smem, denom_smem,
                              q_ready, ready, empty, p_ready, done, work,
                              s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh,
                              h_groups, HAS_SINK, HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES, False)),
        (_value_partition, (len_ptr, out_ptr, k_r, k_p, alpha_smem, denom_smem, ready, empty,
                            p_ready, done, work, topk, stride_os, stride_oh, h_groups,
                            HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES, False)),
        (_gather_partition, (q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, k_l, k_r, k_p,
                             q_ready, ready, empty, s_kv, topk, stride_qs, stride_qh, stride_kv,
                             stride_is, h_groups, HAS_LEN, BLOCK_H, BLOCK_K, D_V, D_TAIL, STAGES,
                             GATHER_WARPS, PREFETCH, (D_V + D_TAIL) * 2, GATHER_POLICY)),
    ], [4, GATHER_WARPS], [VALUE_REGS, GATHER_REGS])


@gluon.jit
def _sparse_mla_fwd_fp8_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr,
    s_kv, h_q, topk, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
    STAGES: gl.constexpr, GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr,
    VALUE_REGS: gl.constexpr, PREFETCH: gl.constexpr, GATHER_POLICY: gl.constexpr,
):
    """The FP8-row form: a ring of raw rows (e4m3 bytes, scales, RoPE) and one dequantized
    bf16 working tile that both compute warpgroups read (``_gather_fp8_partition``)."""
    HALF: gl.constexpr = D_V // 2
    h_groups = h_q // BLOCK_H
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    bytes_swz: gl.constexpr = gl.SwizzledSharedLayout(vec=16, per_phase=1, max_phase=8,
                                                       order=[1, 0])
    q_l = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], swz)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], swz)
    q_p = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_TAIL], swz)
    r8 = gl.allocate_shared_memory(gl.uint8, [STAGES, BLOCK_K, D_V], bytes_swz)
    rs = gl.allocate_shared_memory(gl.float32, [STAGES, (D_V // 128) * BLOCK_K], flat)
    k_p = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, D_TAIL], swz)
    w_l = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_K, HALF], swz)
    w_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_K, HALF], swz)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H], flat)
    denom_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    q_ready, done, ready, empty, p_ready, work = _barriers(STAGES, GATHER_WARPS,
                                                           GATHER_WARPS * 32)
    gl.warp_specialize([
        (_softmax_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                              q_l, q_r, q_p, w_l, w_r, k_p, alpha_smem, denom_smem,
                              q_ready, ready, empty, p_ready, done, work,
                              s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh,
                              h_groups, HAS_SINK, HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES, True)),
        (_value_partition, (len_ptr, out_ptr, w_r, k_p, alpha_smem, denom_smem, ready, empty,
                            p_ready, done, work, topk, stride_os, stride_oh, h_groups,
                            HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES, True)),
        (_gather_fp8_partition, (q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, r8, rs, k_p,
                                 w_l, w_r, q_ready, ready, empty, work, s_kv, topk, stride_qs,
                                 stride_qh, stride_kv, stride_is, h_groups, HAS_LEN, BLOCK_H,
                                 BLOCK_K, D_V, D_TAIL, STAGES, GATHER_WARPS, PREFETCH,
                                 D_V + 4 * (D_V // 128) + 2 * D_TAIL, GATHER_POLICY)),
    ], [4, GATHER_WARPS], [VALUE_REGS, GATHER_REGS])


@gluon.jit
def _sparse_mla_fwd_fp8_in_place_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr,
    s_kv, h_q, topk, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
    STAGES: gl.constexpr, GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr,
    VALUE_REGS: gl.constexpr, PREFETCH: gl.constexpr, GATHER_POLICY: gl.constexpr,
):
    """The FP8-row form with two working stages (``CONFIG["fp8_form"]`` "in_place"): a tile's
    raw bytes land over its own stage and are dequantized there, so the compute warpgroups
    run the bf16 form's partitions over bf16 stages (``_gather_fp8_in_place_partition``)."""
    HALF: gl.constexpr = D_V // 2
    gl.static_assert(STAGES == 2, "two working stages fill shared memory")
    h_groups = h_q // BLOCK_H
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    q_l = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], swz)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, HALF], swz)
    q_p = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_TAIL], swz)
    w_l = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, HALF], swz)
    w_r = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, HALF], swz)
    k_p = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, D_TAIL], swz)
    rs = gl.allocate_shared_memory(gl.float32, [STAGES, (D_V // 128) * BLOCK_K], flat)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_H], flat)
    denom_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    q_ready, done, ready, empty, p_ready, work = _barriers(STAGES, GATHER_WARPS, 1)
    landed = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(landed.index(s), count=GATHER_WARPS * 32)  # a no-increment arrive a thread
    gl.warp_specialize([
        (_softmax_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                              q_l, q_r, q_p, w_l, w_r, k_p, alpha_smem, denom_smem,
                              q_ready, ready, empty, p_ready, done, work,
                              s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh,
                              h_groups, HAS_SINK, HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES, False)),
        (_value_partition, (len_ptr, out_ptr, w_r, k_p, alpha_smem, denom_smem, ready, empty,
                            p_ready, done, work, topk, stride_os, stride_oh, h_groups,
                            HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES, False)),
        (_gather_fp8_in_place_partition, (q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, rs,
                                          k_p, w_l, w_r, q_ready, ready, empty, landed, s_kv,
                                          topk, stride_qs, stride_qh, stride_kv, stride_is,
                                          h_groups, HAS_LEN, BLOCK_H, BLOCK_K, D_V, D_TAIL,
                                          GATHER_WARPS, PREFETCH,
                                          D_V + 4 * (D_V // 128) + 2 * D_TAIL, GATHER_POLICY)),
    ], [4, GATHER_WARPS], [VALUE_REGS, GATHER_REGS])


@gluon.jit
def _gather_seesaw_partition(q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, k_l, k_r, k_p,
                             q_ready, ready, empty, s_kv, topk, stride_qs, stride_qh, stride_kv,
                             stride_is, h_groups,
                             HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr,
                             BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
                             WARPS: gl.constexpr, PREFETCH: gl.constexpr,
                             ROW_BYTES: gl.constexpr, GATHER_POLICY: gl.constexpr):
    """Q once, then tile ``i``'s rows into stage ``i % 2``: the latent block 0-255 as soon as
    ``empty[s]`` frees it (``ready[s]``), the block 256-575 as soon as ``empty[2 + s]`` does
    (``ready[2 + s]``); the two halves of a stage are freed at different times."""
    HALF: gl.constexpr = D_V // 2
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
    c_half = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay))[None, :]
    c_rope = gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, lay))[None, :]
    _copy_q(q_ptr, qi, head0, stride_qs, stride_qh, q_l.index(0), q_r.index(0), q_p.index(0),
            q_ready, BLOCK_H, D_V, D_TAIL, WARPS)
    _gather_policy(GATHER_POLICY)
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    idx_row = idx_ptr + qi * stride_is
    pf_rows = gl.arange(0, BLOCK_K, layout=gl.BlockedLayout([1], [32], [WARPS], [0]))
    t_next = gl.load(idx_row + rows, mask=rows < n_cols, other=-1)
    for i in range(gl.cdiv(n_cols, BLOCK_K)):
        s = i % 2
        ph = ((i // 2) & 1) ^ 1
        if PREFETCH > 0:
            _prefetch_tile(kv_ptr, idx_row, (i + PREFETCH) * BLOCK_K + pf_rows, n_cols, s_kv,
                           stride_kv, ROW_BYTES)
        t = t_next
        cols = (i + 1) * BLOCK_K + rows
        t_next = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
        ok = ((t >= 0) & (t < s_kv))[:, None]
        base = kv_ptr + gl.where(ok, t[:, None], 0).to(gl.int64) * stride_kv
        mbarrier.wait(empty.index(s), ph)
        async_copy.async_copy_global_to_shared(k_l.index(s), base + c_half, mask=ok)
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
        mbarrier.wait(empty.index(2 + s), ph)
        async_copy.async_copy_global_to_shared(k_r.index(s), base + HALF + c_half, mask=ok)
        async_copy.async_copy_global_to_shared(k_p.index(s), base + D_V + c_rope, mask=ok)
        async_copy.mbarrier_arrive(ready.index(2 + s), increment_count=False)


@gluon.jit
def _tile_valid(idx_row, tile, key_cols, n_cols, s_kv, BLOCK_K: gl.constexpr):
    """Which of tile ``tile``'s keys count (index in ``[0, s_kv)``, column ``< n_cols``); loaded
    just before the tile's scores, whose wgmma hides the latency, so no index stays live
    across the P · V products."""
    cols = tile * BLOCK_K + key_cols
    t = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
    return (t >= 0) & (t < s_kv)


@gluon.jit
def _stage_of(r, s: gl.constexpr):
    """Stage ``s`` as a value the compiler cannot prove constant across rounds (``s + 0``
    through inline PTX that reads round ``r``): otherwise the loop-invariant shared memory
    descriptors of all 36 score wgmma (and the P · V ones) are hoisted out of the loop and
    spill at 216 registers; recomputed per round they cost a few uniform adds."""
    return s + gl.inline_asm_elementwise("mov.u32 $0, 0; // $1", "=r,r", [r], dtype=gl.int32,
                                         is_pure=True, pack=1)


@gluon.jit
def _chain_max(scores, valid, m_prev, scale_log2, m_slot, m_bar):
    """The masked scores (unscaled: the exponent's FFMA scales them, as in ``online_softmax``)
    and the running max after them in scaled units, ``max(m_prev, row max · scale_log2)``,
    published to the peer warpgroup through ``m_slot`` (``m_bar``) before the exponentials."""
    s = gl.where(valid[None, :], scores, float("-inf"))
    m_new = gl.maximum(m_prev, gl.max(s, axis=1) * scale_log2)
    m_slot.store(m_new)
    gl.thread_barrier()  # every thread's part of the max is written before the hand-over
    mbarrier.arrive(m_bar, count=1)
    return s, m_new


@gluon.jit
def _shift(m):
    """A running max as an exponent shift: -inf (no valid key yet) shifts by 0, NaN-free."""
    return gl.where(m == float("-inf"), 0.0, m)


@gluon.jit
def _publish_p(p, p_slot, p_bar):
    """P rounded to bf16 (FlashMLA's rounding) into ``p_slot`` for the peer's SS wgmma."""
    pb = p.to(gl.bfloat16)
    p_slot.store(pb)
    fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(p_bar, count=1)
    return pb


@gluon.jit
def _pv_rs(pb, v_s, acc, a_layout: gl.constexpr):
    """``acc + P · V``, P (bf16 ``[64, 64]``) from registers."""
    acc = warpgroup_mma(gl.convert_layout(pb, a_layout), v_s, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _pv_ss(p_s, v_s, acc):
    """``acc + P · V``, the peer's P from shared memory."""
    acc = warpgroup_mma(p_s, v_s, acc, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _peer_pv(p_s, v_s, acc, v_ready, p_bar, ph):
    """``acc + P' · V`` once the peer's P (``p_bar``) and V's block (``v_ready``) are in."""
    mbarrier.wait(v_ready, ph)
    mbarrier.wait(p_bar, ph)
    fence_async_shared()
    return _pv_ss(p_s, v_s, acc)


@gluon.jit
def _seesaw_finish(out_ptr, max_ptr, lse_ptr, sink_ptr, acc, m_i, l_i, l_smem, fin, qi, head0,
                   h_q, stride_os, stride_oh, WG: gl.constexpr, s_layout: gl.constexpr,
                   o_layout: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr,
                   HAS_SINK: gl.constexpr):
    """Both warpgroups end at the same running max ``m_i``; the denominator is the sum of their
    partial sums (exchanged through ``l_smem``, ``fin``), then warpgroup ``WG`` writes its half
    of the output (and warpgroup 0 ``max_logits`` and ``lse``)."""
    LOG2E: gl.constexpr = 1.4426950408889634
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    l_smem.index(WG).store(l_i)
    gl.thread_barrier()
    mbarrier.arrive(fin, count=1)
    mbarrier.wait(fin, 0)
    l_sum = l_i + l_smem.index(1 - WG).load(row_s)
    heads = head0 + gl.arange(0, BLOCK_H, layout=row_s)
    # softmax_denominator's sum, spelled out: that helper takes the shift before the sink's load,
    # which would reorder this kernel's PTX against the code that was timed.
    denom = l_sum
    if HAS_SINK:
        denom += gl.exp2(gl.load(sink_ptr + heads) * LOG2E - _shift(m_i))
    denom = gl.where(denom == 0.0, 1.0, denom)  # lonely row, no sink: out = 0 / 1
    _store_half(out_ptr, acc, gl.convert_layout(denom, row_o), qi, head0, WG * HALF, stride_os,
                stride_oh, o_layout, BLOCK_H, HALF)
    if WG == 0:
        store_max_lse(max_ptr, lse_ptr, qi, h_q, heads, m_i, l_sum)


@gluon.jit
def _scores_behind(acc, q_l, q_r, q_p, k_l_s, k_r_s, k_p_s, ready_l, ready_r, phase, free_a,
                   free_b, layout: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr):
    """The next tile's scores issued behind the in-flight P · V ``acc`` (FlashMLA's order, so
    the tensor cores never wait on this warpgroup's softmax): the first latent block as soon as
    ``ready_l`` lands, then ``acc``'s wait, which frees its stage's blocks (``free_a``,
    ``free_b``), then the other blocks after ``ready_r``. Returns ``(acc, scores)``."""
    s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout)
    mbarrier.wait(ready_l, phase)
    fence_async_shared()
    s = warpgroup_mma(q_l, k_l_s.permute((1, 0)), s, is_async=True)
    acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc,))  # groups complete in order
    mbarrier.arrive(free_a, count=1)
    mbarrier.arrive(free_b, count=1)
    mbarrier.wait(ready_r, phase)
    fence_async_shared()
    s = warpgroup_mma(q_r, k_r_s.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_p, k_p_s.permute((1, 0)), s, is_async=True)
    return acc, warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _seesaw_start(idx_ptr, len_ptr, q_ready, topk, stride_is, h_groups, s_layout: gl.constexpr,
                  o_layout: gl.constexpr, HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr,
                  BLOCK_K: gl.constexpr, HALF: gl.constexpr):
    """A seesaw warpgroup's start, once Q has landed (``q_ready``): its query ``qi``, first head
    ``head0``, the row's column and tile counts, index row and key columns, and the empty
    softmax state and accumulator. Returns ``(qi, head0, n_cols, n_tiles, idx_row, key_cols,
    m_i, l_i, acc)``."""
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    n_tiles = gl.cdiv(n_cols, BLOCK_K)
    idx_row = idx_ptr + qi * stride_is
    key_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    mbarrier.wait(q_ready, 0)
    fence_async_shared()
    return qi, head0, n_cols, n_tiles, idx_row, key_cols, m_i, l_i, acc


@gluon.jit
def _seesaw_even_partition(idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                           q_l, q_r, q_p, k_l, k_r, k_p, m_smem, l_smem,
                           q_ready, ready, empty, p_ready, m_ready, fin,
                           s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh,
                           h_groups, HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
                           BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr,
                           EARLY: gl.constexpr):
    """Warpgroup 0 (the default partition), output columns 0-255. Round ``r``: scores of tile
    ``2r`` (stage 0), the chained max after them to warpgroup 1, P to ``k_p[0]``, ``O_l +=
    P · V_l[0]`` (P from registers); then, at warpgroup 1's max of tile ``2r + 1``, ``O_l +=
    P' · V_l[1]`` (its P from ``k_p[1]``). With ``EARLY`` the scores of tile ``2r + 2`` are
    issued while that last product runs (``_scores_behind``)."""
    HALF: gl.constexpr = D_V // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    qi, head0, n_cols, n_tiles, idx_row, key_cols, m_i, l_i, acc = _seesaw_start(
        idx_ptr, len_ptr, q_ready, topk, stride_is, h_groups, s_layout, o_layout, HAS_LEN,
        BLOCK_H, BLOCK_K, HALF)
    if EARLY:  # round 0's scores; each round issues the next round's
        valid = _tile_valid(idx_row, 0, key_cols, n_cols, s_kv, BLOCK_K)
        scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_layout)
        if n_tiles > 0:
            scores = _scores(q_l.index(0), q_r.index(0), q_p.index(0), k_l.index(0),
                             k_r.index(0), k_p.index(0), ready.index(0), 0, ready.index(2), 0,
                             s_layout, BLOCK_H, BLOCK_K)
    for r in range(gl.cdiv(n_tiles, 2)):
        ph = r & 1
        st0 = _stage_of(r, 0)
        st1 = _stage_of(r, 1)
        if not EARLY:
            valid = _tile_valid(idx_row, 2 * r, key_cols, n_cols, s_kv, BLOCK_K)
            scores = _scores(q_l.index(st0), q_r.index(st0), q_p.index(st0), k_l.index(st0),
                             k_r.index(st0), k_p.index(st0), ready.index(0), ph, ready.index(2),
                             ph, s_layout, BLOCK_H, BLOCK_K)
        s, m_a = _chain_max(scores, valid, m_i, scale_log2, m_smem.index(0), m_ready.index(0))
        p = gl.exp2(s * scale_log2 - _shift(m_a)[:, None])
        alpha = gl.exp2(m_i - _shift(m_a))
        l_i = l_i * alpha + gl.sum(p, axis=1)
        pb = _publish_p(p, k_p.index(st0), p_ready.index(0))  # over the RoPE block: scores done
        acc = _pv_rs(pb, k_l.index(st0), acc * gl.convert_layout(alpha, row_o)[:, None], a_layout)
        mbarrier.arrive(empty.index(0), count=1)
        m_i = m_a
        if 2 * r + 1 < n_tiles:
            mbarrier.wait(m_ready.index(1), ph)
            m_b = m_smem.index(1).load(row_s)
            alpha = gl.exp2(m_a - _shift(m_b))
            l_i = l_i * alpha
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            mbarrier.wait(ready.index(1), ph)
            mbarrier.wait(p_ready.index(1), ph)
            fence_async_shared()
            if EARLY:
                if 2 * r + 2 < n_tiles:
                    acc = warpgroup_mma(k_p.index(st1), k_l.index(st1), acc, is_async=True)
                    valid = _tile_valid(idx_row, 2 * r + 2, key_cols, n_cols, s_kv, BLOCK_K)
                    acc, scores = _scores_behind(
                        acc, q_l.index(st0), q_r.index(st0), q_p.index(st0), k_l.index(st0),
                        k_r.index(st0), k_p.index(st0), ready.index(0), ready.index(2), ph ^ 1,
                        empty.index(1), empty.index(3), s_layout, BLOCK_H, BLOCK_K)
                else:
                    acc = _pv_ss(k_p.index(st1), k_l.index(st1), acc)
                    mbarrier.arrive(empty.index(1), count=1)
                    mbarrier.arrive(empty.index(3), count=1)
            else:
                acc = _pv_ss(k_p.index(st1), k_l.index(st1), acc)
                mbarrier.arrive(empty.index(1), count=1)
                mbarrier.arrive(empty.index(3), count=1)
            m_i = m_b
    _seesaw_finish(out_ptr, max_ptr, lse_ptr, sink_ptr, acc, m_i, l_i, l_smem, fin, qi, head0,
                   h_q, stride_os, stride_oh, 0, s_layout, o_layout, BLOCK_H, HALF, HAS_SINK)


@gluon.jit
def _seesaw_odd_partition(idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                          q_l, q_r, q_p, k_l, k_r, k_p, m_smem, l_smem,
                          q_ready, ready, empty, p_ready, m_ready, fin,
                          s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh,
                          h_groups, HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
                          BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr):
    """Warpgroup 1, output columns 256-511. Round ``r``: scores of tile ``2r + 1`` (stage 1),
    at warpgroup 0's max of tile ``2r`` the chained max after them back to it, P to ``k_p[1]``;
    then ``O_r += P' · V_r[0]`` (warpgroup 0's P from ``k_p[0]``) and ``O_r += P · V_r[1]``
    (P from registers). A round without tile ``2r + 1`` (odd tile count) only adds ``P'``."""
    HALF: gl.constexpr = D_V // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_K, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    qi, head0, n_cols, n_tiles, idx_row, key_cols, m_i, l_i, acc = _seesaw_start(
        idx_ptr, len_ptr, q_ready, topk, stride_is, h_groups, s_layout, o_layout, HAS_LEN,
        BLOCK_H, BLOCK_K, HALF)
    for r in range(gl.cdiv(n_tiles, 2)):
        ph = r & 1
        st0 = _stage_of(r, 0)
        st1 = _stage_of(r, 1)
        if 2 * r + 1 < n_tiles:
            valid = _tile_valid(idx_row, 2 * r + 1, key_cols, n_cols, s_kv, BLOCK_K)
            scores = _scores(q_l.index(st0), q_r.index(st0), q_p.index(st0), k_l.index(st1),
                             k_r.index(st1), k_p.index(st1), ready.index(1), ph, ready.index(3),
                             ph, s_layout, BLOCK_H, BLOCK_K)
            mbarrier.wait(m_ready.index(0), ph)
            m_a = m_smem.index(0).load(row_s)
            s, m_b = _chain_max(scores, valid, m_a, scale_log2, m_smem.index(1),
                                m_ready.index(1))
            p = gl.exp2(s * scale_log2 - _shift(m_b)[:, None])
            alpha = gl.exp2(m_i - _shift(m_a))
            alpha_b = gl.exp2(m_a - _shift(m_b))
            l_i = (l_i * alpha) * alpha_b + gl.sum(p, axis=1)
            pb = _publish_p(p, k_p.index(st1), p_ready.index(1))  # wanted first by warpgroup 0
            acc = _peer_pv(k_p.index(st0), k_r.index(st0), acc * gl.convert_layout(
                alpha, row_o)[:, None], ready.index(2), p_ready.index(0), ph)
            mbarrier.arrive(empty.index(2), count=1)
            acc = _pv_rs(pb, k_r.index(st1), acc * gl.convert_layout(alpha_b, row_o)[:, None],
                         a_layout)
            mbarrier.arrive(empty.index(3), count=1)
            m_i = m_b
        else:
            mbarrier.wait(m_ready.index(0), ph)
            m_a = m_smem.index(0).load(row_s)
            alpha = gl.exp2(m_i - _shift(m_a))
            l_i = l_i * alpha
            acc = _peer_pv(k_p.index(st0), k_r.index(st0), acc * gl.convert_layout(
                alpha, row_o)[:, None], ready.index(2), p_ready.index(0), ph)
            mbarrier.arrive(empty.index(2), count=1)
            m_i = m_a
    _seesaw_finish(out_ptr, max_ptr, lse_ptr, sink_ptr, acc, m_i, l_i, l_smem, fin, qi, head0,
                   h_q, stride_os, stride_oh, 1, s_layout, o_layout, BLOCK_H, HALF, HAS_SINK)


@gluon.jit
def _sparse_mla_fwd_seesaw_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr,
    s_kv, h_q, topk, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
    GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr, SEESAW_REGS: gl.constexpr,
    PREFETCH: gl.constexpr, EARLY_SCORES: gl.constexpr, GATHER_POLICY: gl.constexpr,
):
    """FlashMLA's seesaw over bf16 rows: warpgroups 0 and 1 score the even and odd tiles
    (stages 0 and 1) and chain the running max through ``m_smem``; each owns half the output
    columns. Barriers: ``ready[s]`` / ``ready[2 + s]`` stage ``s``'s latent 0-255 / 256-575
    landed; ``empty[s]`` / ``empty[2 + s]`` freed (the first three by one warpgroup, ``empty[3]``
    by both: P of tile ``2r + 1`` sits in it and both multiply by it); ``m_ready[w]``,
    ``p_ready[w]`` warpgroup ``w``'s max and P of the round; ``fin`` both partial sums."""
    HALF: gl.constexpr = D_V // 2
    h_groups = h_q // BLOCK_H
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    # Q as one-stage rings, so that the compute warpgroups index it per round (_stage_of).
    q_l = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, HALF], swz)
    q_r = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, HALF], swz)
    q_p = gl.allocate_shared_memory(gl.bfloat16, [1, BLOCK_H, D_TAIL], swz)
    k_l = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_K, HALF], swz)
    k_r = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_K, HALF], swz)
    k_p = gl.allocate_shared_memory(gl.bfloat16, [2, BLOCK_K, D_TAIL], swz)
    m_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], flat)
    l_smem = gl.allocate_shared_memory(gl.float32, [2, BLOCK_H], flat)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    fin = gl.allocate_shared_memory(gl.int64, [1], bar)
    ready = gl.allocate_shared_memory(gl.int64, [4, 1], bar)
    empty = gl.allocate_shared_memory(gl.int64, [4, 1], bar)
    p_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    m_ready = gl.allocate_shared_memory(gl.int64, [2, 1], bar)
    mbarrier.init(q_ready, count=GATHER_WARPS * 32)  # a no-increment arrive per gather thread
    mbarrier.init(fin, count=2)
    for j in gl.static_range(4):
        mbarrier.init(ready.index(j), count=GATHER_WARPS * 32)
        mbarrier.init(empty.index(j), count=2 if j == 3 else 1)
    for w in gl.static_range(2):
        mbarrier.init(p_ready.index(w), count=1)
        mbarrier.init(m_ready.index(w), count=1)
    gl.warp_specialize([
        (_seesaw_even_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, q_l,
                                  q_r, q_p, k_l, k_r, k_p, m_smem, l_smem, q_ready, ready, empty,
                                  p_ready, m_ready, fin, s_kv, h_q, topk, scale_log2, stride_is,
                                  stride_os, stride_oh, h_groups, HAS_SINK, HAS_LEN, BLOCK_H,
                                  BLOCK_K, D_V, EARLY_SCORES)),
        (_seesaw_odd_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, q_l,
                                 q_r, q_p, k_l, k_r, k_p, m_smem, l_smem, q_ready, ready, empty,
                                 p_ready, m_ready, fin, s_kv, h_q, topk, scale_log2, stride_is,
                                 stride_os, stride_oh, h_groups, HAS_SINK, HAS_LEN, BLOCK_H,
                                 BLOCK_K, D_V)),
        (_gather_seesaw_partition, (q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, k_l, k_r,
                                    k_p, q_ready, ready, empty, s_kv, topk, stride_qs,
                                    stride_qh, stride_kv, stride_is, h_groups, HAS_LEN, BLOCK_H,
                                    BLOCK_K, D_V, D_TAIL, GATHER_WARPS, PREFETCH,
                                    (D_V + D_TAIL) * 2, GATHER_POLICY)),
    ], [4, GATHER_WARPS], [SEESAW_REGS, GATHER_REGS])


def compile_sm90(has_sink: bool, has_len: bool, fp8: bool = False,
                 schedule: str | None = None, h_q: int = 64, gather_hint: str | None = None,
                 fp8_form: str | None = None):
    """Compile the kernel (the FP8-row form with ``fp8``, ``fp8_form`` "ring" or "in_place";
    over bf16 rows the ``schedule``, "split" or "seesaw", ``CONFIG``'s for ``h_q`` heads when
    None; ``gather_hint`` and ``fp8_form`` CONFIG's when None) for sm_90 ahead of time, no GPU
    needed (for
    offline checks of shared memory, registers and spills: ``ptxas -v`` on ``.asm["ptx"]``).
    Pointers and strides are marked 16-divisible, as the JIT marks GLM-5.3's on the GPU.
    Returns Triton's compiled kernel. Must run without ``TRITON_INTERPRET`` (the interpreter
    replaces ``gl`` builtins).
    """
    cfg = {**CONFIG, **({} if schedule is None else {"schedule": schedule}),
           **({} if gather_hint is None else {"gather_hint": gather_hint}),
           **({} if fp8_form is None else {"fp8_form": fp8_form})}
    kernel, constexprs = _kernel(cfg, fp8, h_q)
    _install_hint(cfg)
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*u8" if fp8 else "*bf16", "idx_ptr": "*i32",
            "out_ptr": "*bf16", "max_ptr": "*fp32", "lse_ptr": "*fp32", "sink_ptr": "*fp32",
            "len_ptr": "*i32"}
    strides = ["stride_qs", "stride_qh", "stride_kv", "stride_is", "stride_os", "stride_oh"]
    consts = {"HAS_SINK": has_sink, "HAS_LEN": has_len, **constexprs}
    sig = {**ptrs, "s_kv": "i32", "h_q": "i32", "topk": "i32", "scale_log2": "fp32",
           **{n: "i32" for n in strides}}
    # The FP8 row stride (656 bytes) is a multiple of 16, not of 16 elements of 16 bits.
    return compile_gluon_sm90(kernel, sig, consts, [*ptrs, *strides], CONFIG["num_warps"])


def _kernel(cfg: dict, fp8: bool, h_q: int):
    """The kernel ``cfg`` selects for ``h_q`` heads and its configuration constexprs."""
    schedule = cfg["schedule"]
    if schedule not in ("split", "seesaw", "by_heads"):
        raise ValueError(f"schedule must be 'split', 'seesaw' or 'by_heads', got {schedule!r}")
    if schedule == "by_heads":
        schedule = "seesaw" if h_q >= 2 * BLOCK_H else "split"
    common = {"BLOCK_H": BLOCK_H, "BLOCK_K": BLOCK_K, "D_V": D_V,
              "D_TAIL": D_TAIL}
    policy = {"GATHER_POLICY": ptx_hints.policy_asm(cfg["gather_hint"])}
    if schedule == "seesaw" and not fp8:
        if cfg["stages"] != 2:
            raise ValueError(f"the seesaw schedule has 2 stages (one a warpgroup), got "
                             f"{cfg['stages']}")
        return _sparse_mla_fwd_seesaw_gluon_kernel, {
            **common, "GATHER_WARPS": cfg["gather_warps"], "GATHER_REGS": cfg["gather_regs"],
            "SEESAW_REGS": cfg["seesaw_regs"], "PREFETCH": cfg["prefetch"],
            "EARLY_SCORES": cfg["seesaw_early_scores"], **policy}
    if fp8 and cfg["fp8_form"] not in ("ring", "in_place"):
        raise ValueError(f"fp8_form must be 'ring' or 'in_place', got {cfg['fp8_form']!r}")
    if fp8 and cfg["fp8_form"] == "in_place" and cfg["stages"] != 2:
        raise ValueError(f"the in-place FP8 form has 2 stages (shared memory holds two), got "
                         f"{cfg['stages']}")
    kernel = ({"ring": _sparse_mla_fwd_fp8_gluon_kernel,
               "in_place": _sparse_mla_fwd_fp8_in_place_gluon_kernel}[cfg["fp8_form"]] if fp8
              else _sparse_mla_fwd_gluon_kernel)
    return kernel, {**common, "STAGES": cfg["stages"],
                    "GATHER_WARPS": cfg["gather_warps"], "GATHER_REGS": cfg["gather_regs"],
                    "VALUE_REGS": cfg["value_regs"], "PREFETCH": cfg["prefetch"], **policy}


# The PTX entries (Triton names them after the function) that the gather hint's pass may
# rewrite, each only where it carries the marker.
_HINTED_ENTRIES = tuple(k.__name__ for k in (_sparse_mla_fwd_gluon_kernel,
                                             _sparse_mla_fwd_fp8_gluon_kernel,
                                             _sparse_mla_fwd_fp8_in_place_gluon_kernel,
                                             _sparse_mla_fwd_seesaw_gluon_kernel))
_HINT_CHECKED: set[str] = set()


def _install_hint(cfg: dict) -> None:
    """The PTX pass, before any compile of a hinted form (``ptx_hints.install``, idempotent)."""
    if cfg["gather_hint"] != "none":
        ptx_hints.install(_HINTED_ENTRIES)


def _check_hinted(compiled, hint: str) -> None:
    """Raise unless ``compiled`` (a hinted form, once per binary) has hinted copies: a binary
    cached without the pass (another hook replaced it) must not run as if it were hinted. A
    cache that keeps binaries only (``TRITON_STORE_BINARY_ONLY``) has no PTX to look at."""
    key = compiled.hash
    ptx = compiled.asm.get("ptx")
    if key in _HINT_CHECKED or ptx is None:
        return
    if not ptx_hints.hinted_copies(ptx).get(ptx_hints.HINTS[hint][0]):
        raise ptx_hints.HintError(f"{compiled.name}: gather_hint {hint!r} asked, but its PTX "
                                  "has no hinted cp.async (compiled without ptx_hints' pass?)")
    sass = _sass(compiled.asm.get("cubin"))
    bad = ptx_hints.undefined_uniform_reads(sass) if sass is not None else []
    if bad:
        raise ptx_hints.HintError(f"{compiled.name}: gather_hint {hint!r}: ptxas's binary has "
                                  f"{len(bad)} LDGSTS reading a uniform register nothing "
                                  f"writes (would trap as an illegal instruction): {bad[0]}")
    _HINT_CHECKED.add(key)


def _sass(cubin: bytes | None) -> str | None:
    """nvdisasm's text of ``cubin`` (Triton's nvdisasm); None without a cubin or nvdisasm."""
    import os
    import subprocess
    import tempfile

    from triton import knobs

    try:
        tool = knobs.nvidia.nvdisasm.path
    except Exception:  # noqa: BLE001 - no nvdisasm: the PTX checks stand alone
        return None
    if not cubin or not tool or not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        run = subprocess.run([tool, "-c", f.name], capture_output=True, text=True)
    return run.stdout if run.returncode == 0 else None


def flash_mla_sparse_fwd_gluon(q: Tensor, kv_rows: Tensor, stride_kv: int, s_kv: int,
                               indices: Tensor, sm_scale: float, attn_sink: Tensor | None,
                               topk_length: Tensor | None, config: dict | None = None,
                               fp8: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """The bare launch over checked inputs (``sparse_mla.flash_mla_sparse_fwd`` and
    ``sparse_mla_fwd_fp8`` check them).

    q: bf16 ``[s_q, h_q, 576]`` (``h_q % 64 == 0``, last dim contiguous); kv_rows: bf16 rows
    of 576 at row stride ``stride_kv`` elements, or with ``fp8`` uint8 656-byte rows
    (``kv_format``'s FP8 layout) at ``stride_kv`` bytes (a multiple of 16); ``s_kv`` rows;
    indices: int32 ``[s_q, 1, topk]``; attn_sink float ``[h_q]`` or None; topk_length int32
    ``[s_q]`` or None; config: entries overriding ``CONFIG`` (for measurements).
    Returns ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q], lse [s_q, h_q])``.
    """
    cfg = CONFIG if config is None else {**CONFIG, **config}
    s_q, h_q, _ = q.shape
    kernel, constexprs = _kernel(cfg, fp8, h_q)
    topk = indices.shape[2]
    out, max_logits, lse, sink, lengths, idx = launch_buffers(q, D_V, indices, attn_sink,
                                                              topk_length)
    if s_q == 0:
        return out, max_logits, lse
    _install_hint(cfg)
    grid = (s_q * (h_q // BLOCK_H),)
    args = (q, kv_rows, idx, out, max_logits, lse,
            sink if sink is not None else max_logits, lengths if lengths is not None else idx,
            s_kv, h_q, topk, sm_scale * _LOG2E,
            q.stride(0), q.stride(1), stride_kv, idx.stride(0), out.stride(0), out.stride(1))
    kwargs = dict(HAS_SINK=sink is not None, HAS_LEN=lengths is not None, **constexprs,
                  num_warps=cfg["num_warps"])
    if cfg["gather_hint"] != "none":  # checked before its first launch: a bad binary traps
        compiled = kernel.run(*args, grid=grid, warmup=True, **kwargs)
        if compiled is not None:  # None: compiling elsewhere
            _check_hinted(compiled, cfg["gather_hint"])
    kernel[grid](*args, **kwargs)
    return out, max_logits, lse
