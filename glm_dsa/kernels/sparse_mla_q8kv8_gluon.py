"""FP8-query x FP8-KV sparse MLA prefill for sm_90 in Gluon (SGLang's Q8KV8): both GEMMs on e4m3.

Contract: ``glm_dsa.oracle.sparse_mla_q8kv8_prefill_fwd``. q e4m3 ``[s_q, h_q, 576]`` (``h_q`` a
multiple of 64), kv e4m3 rows of 576 bytes at a 16-aligned row stride, one float32 scale each
(read in the kernel, no host sync), the RoPE dims quantized with the rest. Natural-log
``max_logits`` / ``lse``; indices ``< 0`` or ``>= s_kv`` and columns ``>= topk_length[row]``
skipped (never read); lonely rows ``out = 0``, ``max_logits = -inf``, ``lse = +inf``;
``attn_sink`` only in the final normalisation. The softmax weights go to the second GEMM in e4m3
(what ``Q8KV8_OUT_TOL`` allows for); their sum, hence ``lse``, stays float32.

Schedule: one CTA per query token and 64-head group, three partitions of one warpgroup each, as
``sparse_mla_gluon`` (whose FlashMLA conventions it keeps), with what FP8 wgmma changes:

- **Gather** (4 warps). 16-byte ``cp.async`` of Q ``[64, 576]`` once, then of each 64-key tile
  of indexed rows into a ``STAGES``-deep ring of K tiles (latent 0-255 ``k_l``, 256-511 ``k_r``,
  RoPE ``k_p``), ``STAGES - 1`` tiles ahead; an invalid or masked index is a zero-filled row
  (source size 0: nothing read). Completion by no-increment arrives (128 a barrier):
  ``ready[s]`` the first latent block, ``ready[STAGES + s]`` the rest. FP8 wgmma takes B
  K-major only, so ``P · V`` needs ``Vᵀ [512, keys]`` with the keys contiguous, while the
  gathered tile is ``[keys, 512]``: once a tile has landed this warpgroup transposes its latent
  bytes (registers, 128 columns at a time) into ``vt[v]`` of a ``V_STAGES`` ring, then arrives on
  ``vt_ready[v]``; the transpose overlaps the tile's scores and softmax.
- **Softmax warpgroup** (the default partition). ``S = Q · Kᵀ`` (``[64 heads, 64 keys]``, e4m3
  x e4m3 wgmma with Kᵀ a permuted view of the K-major tile; partial sums promoted to float32
  after 256 and 320 products, as DeepGEMM promotes, since Hopper's FP8 accumulation keeps
  ~14 bits), then ``empty[s]`` frees the K stage. Scores times ``q_scale · kv_scale · sm_scale ·
  log2 e`` (one factor), online softmax in base 2 (a row lives in one warp's quad). P rounded to
  e4m3 goes to ``p_smem[v]`` and the rescale factor to ``alpha_smem[v]`` (after ``vt_empty[v]``
  says both readers of that slot are done), ``p_ready[v]`` hands both over; then ``O_l = alpha ·
  O_l + P · V_l`` (columns 0-255) once ``vt_ready[v]``, and an arrive on ``vt_empty[v]``. At the
  end ``kv_scale / denominator`` to ``denom_smem`` (``done``), its half of the output times
  that, ``max_logits`` and ``lse``.
- **Value warpgroup** (4 warps). Waits ``p_ready[v]`` and ``vt_ready[v]``, ``O_r = alpha · O_r +
  P · V_r`` (columns 256-511, overlapping the softmax warpgroup's next scores), arrives on
  ``vt_empty[v]``; after ``done``, its half of the output.

Registers (``setmaxnreg``, 512 a thread over the three): gather 72, value 168 (its ``64 x
256`` float32 accumulator is 128 a thread), softmax 256 (its accumulator, the scores' two
promotion chains of 32 each, the softmax state); ptxas -v: no spills. Shared memory
(``CONFIG``: 3 K stages, 2 Vᵀ stages): Q 36 KB + K ring 3 x 36 KB + Vᵀ ring 2 x 32 KB + P 2 x 4
KB + factors = 217 KB of the 227 KB an sm_90 block may take. The K ring is deeper than the Vᵀ
ring because a K stage is free after the scores and the transpose, a Vᵀ stage only after both
``P · V`` products. Shared-memory traffic a tile (the likely limit, 128 bytes a clock): the
scores' wgmma read Q and K (72 KB), ``P · V`` 40 KB, the gather writes 36 KB, the transpose
reads and writes 32 KB each at two accesses a wavefront (a 4-byte store of 4 keys cannot reach
all 32 banks in a 64-byte-row swizzle), 280 KB in all.

Schedule forms (``CONFIG`` keys, off by default until timed; same shared memory):

- ``lookahead`` (FlashAttention-3's intra-warpgroup pipelining): the softmax warpgroup issues
  tile ``i + 1``'s scores before tile ``i``'s softmax, so the tensor cores work through the
  softmax math instead of idling; the chains (64 registers in flight beside the accumulator)
  retire with tile ``i``'s ``P · V_l``. The next tile's indices are loaded after the softmax so
  that their registers do not add to that peak.
- ``split_transpose``: the gather warpgroup transposes only ``k_l`` (``Vᵀ`` columns 0-255); the
  value warpgroup, otherwise idle between its products, transposes ``k_r`` (columns 256-511,
  the only ones it reads) of tile ``i + 1`` while its ``P · V_r`` of tile ``i`` runs, and frees
  the K stage with the scores (``empty`` counts 2). Needs ``v_stages >= 2``. With ``lookahead``
  too, ptxas spills at 72 / 168 registers: ``gather_regs`` 64 / ``value_regs`` 176 do not.
"""

from __future__ import annotations

import math

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

from glm_dsa.kernels.aot import compile_gluon_sm90
from glm_dsa.kernels.sparse_mla_gluon import (
    online_softmax,
    row_length,
    softmax_denominator,
    store_max_lse,
)

__all__ = ["sparse_mla_q8kv8_fwd_gluon", "compile_sm90", "CONFIG"]

_LOG2E = math.log2(math.e)
BLOCK_H = 64      # heads per CTA: the wgmma M
BLOCK_K = 64      # keys per tile
D_V, D_TAIL = 512, 64
# The launch configuration (see the module docstring): K ring depth, Vᵀ ring depth, warps, the
# partitions' register budgets and the schedule forms. Chosen on one H200 (2026-12-04, run C,
# bench/probes/2026-12-04-h200-q8-time.py, 16,384 queries x top-2048 over 131,072 keys): both
# forms on, 8 registers moved from the gather to the value warpgroup (they spill at 72 / 168):
# 538 / 542 TFLOP/s at h_q 64 / 128, against 518 / 502 with both off and 511-542 / 511-532 for
# either alone (with 3 or 2 K stages).
CONFIG = {"stages": 3, "v_stages": 2, "num_warps": 4, "gather_warps": 4, "gather_regs": 64,
          "value_regs": 176, "lookahead": True, "split_transpose": True}


@gluon.jit
def _tile_indices(idx_row, i, n_cols, BLOCK_K: gl.constexpr, WARPS: gl.constexpr):
    """Tile ``i``'s indices (-1 past ``n_cols``) in the layouts of its latent and RoPE copies."""
    lay_l: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
    lay_p: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    c_l = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay_l))
    c_p = i * BLOCK_K + gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay_p))
    return (gl.load(idx_row + c_l, mask=c_l < n_cols, other=-1),
            gl.load(idx_row + c_p, mask=c_p < n_cols, other=-1))


@gluon.jit
def _copy_rows(base_l, base_p, ok_l, ok_p, dst_l, dst_r, dst_p, ready_l, ready_r,
               D_V: gl.constexpr, D_TAIL: gl.constexpr, WARPS: gl.constexpr):
    """cp.async of 576-byte rows (row pointers ``base_l`` / ``base_p`` in the two copy layouts,
    zero-filled where not ``ok``; None: all rows) into ``dst_l | dst_r | dst_p``; the first
    block completes ``ready_l``, the rest ``ready_r`` (no-increment arrives)."""
    HALF: gl.constexpr = D_V // 2
    # 16 threads x 16 bytes cover a 256-byte latent half of a row, 4 threads its RoPE bytes.
    lay_l: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
    lay_p: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    c_half = gl.arange(0, HALF, layout=gl.SliceLayout(0, lay_l))[None, :]
    c_rope = gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, lay_p))[None, :]
    async_copy.async_copy_global_to_shared(dst_l, base_l + c_half, mask=ok_l)
    async_copy.mbarrier_arrive(ready_l, increment_count=False)
    async_copy.async_copy_global_to_shared(dst_r, base_l + HALF + c_half, mask=ok_l)
    async_copy.async_copy_global_to_shared(dst_p, base_p + D_V + c_rope, mask=ok_p)
    async_copy.mbarrier_arrive(ready_r, increment_count=False)


@gluon.jit
def _issue_tile(kv_ptr, t_l, t_p, s_kv, stride_kv, k_l_s, k_r_s, k_p_s, ready_l, ready_r,
                D_V: gl.constexpr, D_TAIL: gl.constexpr, WARPS: gl.constexpr):
    """One tile's indexed rows (indices ``t_l`` / ``t_p``, see ``_tile_indices``) into a K stage."""
    ok_l = ((t_l >= 0) & (t_l < s_kv))[:, None]
    ok_p = ((t_p >= 0) & (t_p < s_kv))[:, None]
    base_l = kv_ptr + gl.where(ok_l, t_l[:, None], 0).to(gl.int64) * stride_kv
    base_p = kv_ptr + gl.where(ok_p, t_p[:, None], 0).to(gl.int64) * stride_kv
    _copy_rows(base_l, base_p, ok_l, ok_p, k_l_s, k_r_s, k_p_s, ready_l, ready_r, D_V, D_TAIL,
               WARPS)


@gluon.jit
def _transpose_v(src, vt_cols, COLS: gl.constexpr, WARPS: gl.constexpr):
    """``Vᵀ`` of ``COLS`` latent columns: ``src`` ``[keys, COLS]`` (a K stage's ``k_l`` or
    ``k_r``) into ``vt_cols`` (``[COLS, keys]``), 128 columns at a time: each thread reads 4 keys
    x 16 bytes (16-byte loads) and writes them as 16 columns x 4 keys (4-byte stores). Lanes span
    64 keys and two columns 16 apart, warps the columns: of the layouts with these vectors, the
    fewest bank conflicts found (``gl.bank_conflicts``: one extra access a wavefront, loads and
    stores)."""
    lay: gl.constexpr = gl.BlockedLayout([4, 16], [16, 2], [1, WARPS], [1, 0])
    for c in gl.static_range(COLS // 128):
        x = src.slice(c * 128, 128, dim=1).load(lay)
        vt_cols.slice(c * 128, 128, dim=0).store(gl.permute(x, (1, 0)))


@gluon.jit
def _gather_partition(q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, k_l, k_r, k_p, vt,
                      q_ready, ready, empty, vt_ready, vt_empty, s_kv, topk, stride_qs,
                      stride_qh, stride_kv, stride_is, h_groups,
                      HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                      D_V: gl.constexpr, D_TAIL: gl.constexpr, STAGES: gl.constexpr,
                      V_STAGES: gl.constexpr, SPLIT_T: gl.constexpr, WARPS: gl.constexpr):
    """Q once; each tile into K stage ``i % STAGES``, ``STAGES - 1`` tiles ahead; each landed
    tile's ``Vᵀ`` into ``vt[i % V_STAGES]`` (``SPLIT_T``: only its columns 0-255)."""
    LAG: gl.constexpr = STAGES - 1
    HALF: gl.constexpr = D_V // 2
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    lay_l: gl.constexpr = gl.BlockedLayout([1, 16], [2, 16], [WARPS, 1], [1, 0])
    lay_p: gl.constexpr = gl.BlockedLayout([1, 16], [8, 4], [WARPS, 1], [1, 0])
    h_l = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, lay_l))
    h_p = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, lay_p))
    q_row = q_ptr + qi * stride_qs
    _copy_rows(q_row + h_l.to(gl.int64)[:, None] * stride_qh,
               q_row + h_p.to(gl.int64)[:, None] * stride_qh, None, None, q_l, q_r, q_p,
               q_ready, q_ready, D_V, D_TAIL, WARPS)

    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    n_tiles = gl.cdiv(n_cols, BLOCK_K)
    idx_row = idx_ptr + qi * stride_is
    for j in gl.static_range(LAG):
        if j < n_tiles:
            t_l, t_p = _tile_indices(idx_row, j, n_cols, BLOCK_K, WARPS)
            _issue_tile(kv_ptr, t_l, t_p, s_kv, stride_kv, k_l.index(j), k_r.index(j),
                        k_p.index(j), ready.index(j), ready.index(STAGES + j), D_V, D_TAIL,
                        WARPS)
    # The indices of the tile issued next, loaded an iteration ahead so their latency hides
    # behind the transpose.
    t_l, t_p = _tile_indices(idx_row, LAG, n_cols, BLOCK_K, WARPS)
    for i in range(n_tiles):
        nxt = i + LAG
        if nxt < n_tiles:
            sn = nxt % STAGES
            mbarrier.wait(empty.index(sn), ((nxt // STAGES) & 1) ^ 1)
            _issue_tile(kv_ptr, t_l, t_p, s_kv, stride_kv, k_l.index(sn), k_r.index(sn),
                        k_p.index(sn), ready.index(sn), ready.index(STAGES + sn), D_V, D_TAIL,
                        WARPS)
        t_l, t_p = _tile_indices(idx_row, nxt + 1, n_cols, BLOCK_K, WARPS)
        s = i % STAGES
        v = i % V_STAGES
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if not SPLIT_T:
            mbarrier.wait(ready.index(STAGES + s), (i // STAGES) & 1)
        mbarrier.wait(vt_empty.index(v), ((i // V_STAGES) & 1) ^ 1)
        _transpose_v(k_l.index(s), vt.index(v).slice(0, HALF, dim=0), HALF, WARPS)
        if not SPLIT_T:
            _transpose_v(k_r.index(s), vt.index(v).slice(HALF, HALF, dim=0), HALF, WARPS)
        fence_async_shared()  # the generic-proxy writes before the wgmma's (async proxy) reads
        # Every gather thread's part is written (and the K stage read, before a later refill).
        gl.thread_barrier()
        mbarrier.arrive(vt_ready.index(v), count=1)


@gluon.jit
def _issue_scores(q_l, q_r, q_p, k_l_s, k_r_s, k_p_s, ready_l, ready_r, phase, landed,
                  layout: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr):
    """Issues ``Q · Kᵀ`` of one K stage in e4m3 (float32 ``[BLOCK_H, BLOCK_K]``, payload units)
    as two asynchronous accumulator chains (256 and 320 products; ``_scores`` waits and sums
    them): the first latent block once ``ready_l`` completes ``phase``, the rest after
    ``ready_r``. Hopper's FP8 accumulation keeps ~14 bits, so partial sums are promoted in
    float32 as DeepGEMM does (``max_num_imprecise_acc`` would add them between asynchronous
    wgmmas without a wait, which ptxas serializes). ``landed`` false: the stage is never filled
    (a look-ahead past the last tile), nothing is awaited and the chains are garbage."""
    zero = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout)
    if landed:
        mbarrier.wait(ready_l, phase)
        fence_async_shared()  # cp.async's writes before the wgmma's (async proxy) reads
    s_l = warpgroup_mma(q_l, k_l_s.permute((1, 0)), zero, is_async=True)
    if landed:
        mbarrier.wait(ready_r, phase)
        fence_async_shared()
    s_r = warpgroup_mma(q_r, k_r_s.permute((1, 0)), zero, is_async=True)
    s_r = warpgroup_mma(q_p, k_p_s.permute((1, 0)), s_r, is_async=True)
    return s_l, s_r


@gluon.jit
def _scores(q_l, q_r, q_p, k_l_s, k_r_s, k_p_s, ready_l, ready_r, phase,
            layout: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr):
    """``Q · Kᵀ`` of one K stage (``_issue_scores``), waited and summed."""
    s_l, s_r = _issue_scores(q_l, q_r, q_p, k_l_s, k_r_s, k_p_s, ready_l, ready_r, phase, True,
                             layout, BLOCK_H, BLOCK_K)
    s_l, s_r = warpgroup_mma_wait(num_outstanding=0, deps=(s_l, s_r))
    return s_l + s_r


@gluon.jit
def _issue_pv(p_s, vt_half, acc, alpha):
    """Issues ``alpha · acc + P · V`` in e4m3 (P ``[heads, keys]``, ``vt_half`` ``[cols, keys]``,
    both with the keys contiguous: K-major, as FP8 wgmma needs); asynchronous."""
    acc = acc * alpha[:, None]
    return warpgroup_mma(p_s, vt_half.permute((1, 0)), acc, is_async=True)


@gluon.jit
def _pv(p_s, vt_half, acc, alpha):
    """``alpha · acc + P · V`` (``_issue_pv``), waited."""
    acc = _issue_pv(p_s, vt_half, acc, alpha)
    return warpgroup_mma_wait(num_outstanding=0, deps=(acc,))


@gluon.jit
def _store_half(out_ptr, acc, factor, qi, head0, col0, stride_os, stride_oh,
                layout: gl.constexpr, BLOCK_H: gl.constexpr, HALF: gl.constexpr):
    """``acc · factor`` (a factor per head) as bf16 into output columns ``[col0, col0 + HALF)``."""
    heads = head0 + gl.arange(0, BLOCK_H, layout=gl.SliceLayout(1, layout))
    cols = col0 + gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    rows = out_ptr + qi * stride_os + heads.to(gl.int64)[:, None] * stride_oh
    gl.store(rows + cols[None, :], (acc * factor[:, None]).to(gl.bfloat16))


@gluon.jit
def _softmax_partition(idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, q_scale_ptr,
                       kv_scale_ptr, q_l, q_r, q_p, k_l, k_r, k_p, vt, p_smem, alpha_smem,
                       denom_smem, q_ready, ready, empty, vt_ready, vt_empty, p_ready, done,
                       s_kv, h_q, topk, sm_scale_log2, stride_is, stride_os, stride_oh,
                       h_groups, HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
                       BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr,
                       STAGES: gl.constexpr, V_STAGES: gl.constexpr, LOOKAHEAD: gl.constexpr):
    """Scores, online softmax, P and alpha for the value warpgroup, ``O_l``; lse at the end.
    ``LOOKAHEAD`` (FlashAttention-3's intra-warpgroup pipelining): tile ``i + 1``'s scores are
    issued before tile ``i``'s softmax, so the tensor cores work through the softmax math; they
    complete with tile ``i``'s ``P · V_l`` (one wait for both, wgmma groups retire in order)."""
    HALF: gl.constexpr = D_V // 2
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_K, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 32])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    kv_scale = gl.load(kv_scale_ptr)
    scale_log2 = gl.load(q_scale_ptr) * kv_scale * sm_scale_log2

    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    idx_row = idx_ptr + qi * stride_is
    key_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    mbarrier.wait(q_ready, 0)
    fence_async_shared()
    t_next = gl.load(idx_row + key_cols, mask=key_cols < n_cols, other=-1)
    n_tiles = gl.cdiv(n_cols, BLOCK_K)
    if LOOKAHEAD:
        scores = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, s_layout)
        if n_tiles > 0:
            scores = _scores(q_l, q_r, q_p, k_l.index(0), k_r.index(0), k_p.index(0),
                             ready.index(0), ready.index(STAGES), 0, s_layout, BLOCK_H, BLOCK_K)
            mbarrier.arrive(empty.index(0), count=1)
    for i in range(n_tiles):
        s = i % STAGES
        v = i % V_STAGES
        valid = (t_next >= 0) & (t_next < s_kv)
        if LOOKAHEAD:
            sn = (i + 1) % STAGES
            s_l, s_r = _issue_scores(q_l, q_r, q_p, k_l.index(sn), k_r.index(sn), k_p.index(sn),
                                     ready.index(sn), ready.index(STAGES + sn),
                                     ((i + 1) // STAGES) & 1, i + 1 < n_tiles, s_layout,
                                     BLOCK_H, BLOCK_K)
        else:
            cols = (i + 1) * BLOCK_K + key_cols  # the next tile's, a tile ahead
            t_next = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
            scores = _scores(q_l, q_r, q_p, k_l.index(s), k_r.index(s), k_p.index(s),
                             ready.index(s), ready.index(STAGES + s), (i // STAGES) & 1,
                             s_layout, BLOCK_H, BLOCK_K)
            mbarrier.arrive(empty.index(s), count=1)
        # Scaled before the softmax, not in its exponent's FFMA: with the next tile's scores in
        # flight (LOOKAHEAD) the folded form spills (ptxas, 168 registers).
        p, alpha, m_i, l_i = online_softmax(scores * scale_log2, valid, m_i, l_i, 1.0)
        vph = (i // V_STAGES) & 1
        mbarrier.wait(vt_empty.index(v), vph ^ 1)  # both P · V of this slot's last tile done
        p_smem.index(v).store(p.to(gl.float8e4nv))
        alpha_smem.index(v).store(alpha)
        fence_async_shared()
        gl.thread_barrier()  # every thread's P and alpha are written before the hand-over
        mbarrier.arrive(p_ready.index(v), count=1)
        if LOOKAHEAD:
            # Loaded after the softmax, not before: its registers are not live through it
            # beside the next tile's scores.
            cols = (i + 1) * BLOCK_K + key_cols
            t_next = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
        mbarrier.wait(vt_ready.index(v), vph)
        acc = _issue_pv(p_smem.index(v), vt.index(v).slice(0, HALF, dim=0), acc,
                        gl.convert_layout(alpha, row_o))
        if LOOKAHEAD:
            acc, s_l, s_r = warpgroup_mma_wait(num_outstanding=0, deps=(acc, s_l, s_r))
            scores = s_l + s_r
            if i + 1 < n_tiles:
                mbarrier.arrive(empty.index(sn), count=1)
        else:
            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(vt_empty.index(v), count=1)

    heads = head0 + gl.arange(0, BLOCK_H, layout=row_s)
    factor = kv_scale / softmax_denominator(l_i, m_i, sink_ptr, heads, HAS_SINK)  # V was multiplied in payload units
    denom_smem.store(factor)
    gl.thread_barrier()
    mbarrier.arrive(done, count=1)
    _store_half(out_ptr, acc, gl.convert_layout(factor, row_o), qi, head0, 0, stride_os,
                stride_oh, o_layout, BLOCK_H, HALF)
    store_max_lse(max_ptr, lse_ptr, qi, h_q, heads, m_i, l_i)


@gluon.jit
def _transpose_own(k_r_s, vt_r, ready_r, empty_s, phase, HALF: gl.constexpr):
    """The value warpgroup's ``Vᵀ`` of a K stage's ``k_r`` (once ``ready_r`` completes
    ``phase``) into ``vt_r``; then its arrive on ``empty_s`` (the stage's other reader is the
    scores)."""
    mbarrier.wait(ready_r, phase)
    _transpose_v(k_r_s, vt_r, HALF, 4)
    fence_async_shared()  # the generic-proxy writes before the wgmma's (async proxy) reads
    gl.thread_barrier()  # every thread's part is written before this warpgroup's P · V_r
    mbarrier.arrive(empty_s, count=1)


@gluon.jit
def _value_partition(len_ptr, out_ptr, k_r, vt, p_smem, alpha_smem, denom_smem, ready, empty,
                     vt_ready, vt_empty, p_ready, done, topk, stride_os, stride_oh, h_groups,
                     HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                     D_V: gl.constexpr, STAGES: gl.constexpr, V_STAGES: gl.constexpr,
                     SPLIT_T: gl.constexpr):
    """``O_r = alpha · O_r + P · V_r`` per tile; its half of the output at the end. ``SPLIT_T``:
    this warpgroup transposes ``V_r`` itself (``k_r`` of a K stage into ``vt[v]``'s columns
    256-511, then its arrive on ``empty``), tile ``i + 1``'s while tile ``i``'s ``P · V_r`` runs
    (hence ``V_STAGES >= 2``), halving the gather warpgroup's transpose."""
    HALF: gl.constexpr = D_V // 2
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HALF, 32])
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)
    n_tiles = gl.cdiv(n_cols, BLOCK_K)
    acc = gl.zeros([BLOCK_H, HALF], gl.float32, o_layout)
    if SPLIT_T:
        if n_tiles > 0:
            _transpose_own(k_r.index(0), vt.index(0).slice(HALF, HALF, dim=0),
                           ready.index(STAGES), empty.index(0), 0, HALF)
    for i in range(n_tiles):
        v = i % V_STAGES
        vph = (i // V_STAGES) & 1
        mbarrier.wait(p_ready.index(v), vph)
        if not SPLIT_T:
            mbarrier.wait(vt_ready.index(v), vph)
        fence_async_shared()
        alpha = alpha_smem.index(v).load(row_o)
        acc = _issue_pv(p_smem.index(v), vt.index(v).slice(HALF, HALF, dim=0), acc, alpha)
        if SPLIT_T:
            if i + 1 < n_tiles:
                sn = (i + 1) % STAGES
                vt_next = vt.index((i + 1) % V_STAGES).slice(HALF, HALF, dim=0)
                _transpose_own(k_r.index(sn), vt_next, ready.index(STAGES + sn), empty.index(sn),
                               ((i + 1) // STAGES) & 1, HALF)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(vt_empty.index(v), count=1)
    mbarrier.wait(done, 0)
    _store_half(out_ptr, acc, denom_smem.load(row_o), qi, head0, HALF, stride_os, stride_oh,
                o_layout, BLOCK_H, HALF)


@gluon.jit
def _sparse_mla_q8kv8_fwd_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr, q_scale_ptr,
    kv_scale_ptr, s_kv, h_q, topk, sm_scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
    STAGES: gl.constexpr, V_STAGES: gl.constexpr, LOOKAHEAD: gl.constexpr,
    SPLIT_T: gl.constexpr, GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr,
    VALUE_REGS: gl.constexpr,
):
    HALF: gl.constexpr = D_V // 2
    h_groups = h_q // BLOCK_H
    # 8-bit operands: 256-byte rows in 128-byte swizzle atoms, 64-byte rows (RoPE, P, Vᵀ) in
    # 64-byte ones.
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    swz64: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=64, element_bitwidth=8, rank=2)
    flat: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_l = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, HALF], swz)
    q_r = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, HALF], swz)
    q_p = gl.allocate_shared_memory(gl.float8e4nv, [BLOCK_H, D_TAIL], swz64)
    k_l = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_K, HALF], swz)
    k_r = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_K, HALF], swz)
    k_p = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_K, D_TAIL], swz64)
    vt = gl.allocate_shared_memory(gl.float8e4nv, [V_STAGES, D_V, BLOCK_K], swz64)
    p_smem = gl.allocate_shared_memory(gl.float8e4nv, [V_STAGES, BLOCK_H, BLOCK_K], swz64)
    alpha_smem = gl.allocate_shared_memory(gl.float32, [V_STAGES, BLOCK_H], flat)
    denom_smem = gl.allocate_shared_memory(gl.float32, [BLOCK_H], flat)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    done = gl.allocate_shared_memory(gl.int64, [1], bar)
    ready = gl.allocate_shared_memory(gl.int64, [2 * STAGES, 1], bar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    vt_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    vt_empty = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    p_ready = gl.allocate_shared_memory(gl.int64, [V_STAGES, 1], bar)
    # Two no-increment arrives per gather thread (Q's first latent block, then the rest).
    mbarrier.init(q_ready, count=2 * GATHER_WARPS * 32)
    mbarrier.init(done, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=GATHER_WARPS * 32)
        mbarrier.init(ready.index(STAGES + s), count=GATHER_WARPS * 32)
        # The scores, and with SPLIT_T the value warpgroup's transpose (the gather's own
        # transpose precedes its refill).
        if SPLIT_T:
            mbarrier.init(empty.index(s), count=2)
        else:
            mbarrier.init(empty.index(s), count=1)
    for v in gl.static_range(V_STAGES):
        mbarrier.init(vt_ready.index(v), count=1)
        mbarrier.init(vt_empty.index(v), count=2)  # the softmax and the value warpgroup
        mbarrier.init(p_ready.index(v), count=1)
    gl.warp_specialize([
        (_softmax_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, q_scale_ptr,
                              kv_scale_ptr, q_l, q_r, q_p, k_l, k_r, k_p, vt, p_smem, alpha_smem,
                              denom_smem, q_ready, ready, empty, vt_ready, vt_empty, p_ready,
                              done, s_kv, h_q, topk, sm_scale_log2, stride_is, stride_os,
                              stride_oh, h_groups, HAS_SINK, HAS_LEN, BLOCK_H, BLOCK_K, D_V,
                              STAGES, V_STAGES, LOOKAHEAD)),
        (_value_partition, (len_ptr, out_ptr, k_r, vt, p_smem, alpha_smem, denom_smem, ready,
                            empty, vt_ready, vt_empty, p_ready, done, topk, stride_os,
                            stride_oh, h_groups, HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES,
                            V_STAGES, SPLIT_T)),
        (_gather_partition, (q_ptr, kv_ptr, idx_ptr, len_ptr, q_l, q_r, q_p, k_l, k_r, k_p, vt,
                             q_ready, ready, empty, vt_ready, vt_empty, s_kv, topk, stride_qs,
                             stride_qh, stride_kv, stride_is, h_groups, HAS_LEN, BLOCK_H,
                             BLOCK_K, D_V, D_TAIL, STAGES, V_STAGES, SPLIT_T, GATHER_WARPS)),
    ], [4, GATHER_WARPS], [VALUE_REGS, GATHER_REGS])


def _constexprs(cfg: dict) -> dict:
    if cfg["split_transpose"] and cfg["v_stages"] < 2:
        raise ValueError(f"split_transpose needs v_stages >= 2, got {cfg['v_stages']}")
    return {"BLOCK_H": BLOCK_H, "BLOCK_K": BLOCK_K, "D_V": D_V, "D_TAIL": D_TAIL,
            "STAGES": cfg["stages"], "V_STAGES": cfg["v_stages"],
            "LOOKAHEAD": cfg["lookahead"], "SPLIT_T": cfg["split_transpose"],
            "GATHER_WARPS": cfg["gather_warps"], "GATHER_REGS": cfg["gather_regs"],
            "VALUE_REGS": cfg["value_regs"]}


def compile_sm90(has_sink: bool, has_len: bool, config: dict | None = None):
    """Compile the kernel for sm_90 ahead of time, no GPU needed (for offline checks of shared
    memory, registers and spills: ``ptxas -v`` on ``.asm["ptx"]``); ``config`` overrides
    entries of ``CONFIG``. Pointers and strides are marked 16-divisible, as the JIT marks
    GLM-5.3's on the GPU. Returns Triton's compiled kernel. Must run without
    ``TRITON_INTERPRET`` (the interpreter replaces ``gl`` builtins).
    """
    kernel = _sparse_mla_q8kv8_fwd_gluon_kernel
    cfg = CONFIG if config is None else {**CONFIG, **config}
    ptrs = {"q_ptr": "*fp8e4nv", "kv_ptr": "*fp8e4nv", "idx_ptr": "*i32", "out_ptr": "*bf16",
            "max_ptr": "*fp32", "lse_ptr": "*fp32", "sink_ptr": "*fp32", "len_ptr": "*i32",
            "q_scale_ptr": "*fp32", "kv_scale_ptr": "*fp32"}
    strides = ["stride_qs", "stride_qh", "stride_kv", "stride_is", "stride_os", "stride_oh"]
    consts = {"HAS_SINK": has_sink, "HAS_LEN": has_len, **_constexprs(cfg)}
    sig = {**ptrs, "s_kv": "i32", "h_q": "i32", "topk": "i32", "sm_scale_log2": "fp32",
           **{n: "i32" for n in strides}}
    return compile_gluon_sm90(kernel, sig, consts, [*ptrs, *strides], cfg["num_warps"])


def sparse_mla_q8kv8_fwd_gluon(q: Tensor, kv_rows: Tensor, stride_kv: int, s_kv: int,
                               indices: Tensor, sm_scale: float, q_scale: Tensor,
                               kv_scale: Tensor, attn_sink: Tensor | None,
                               topk_length: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The bare launch over checked inputs (``sparse_mla_q8kv8.sparse_mla_q8kv8_prefill_fwd``
    checks them).

    q: float8_e4m3fn ``[s_q, h_q, 576]`` contiguous (``h_q % 64 == 0``); kv_rows: e4m3 (or a
    uint8 view) whose row ``r`` starts at element ``r * stride_kv`` (a multiple of 16 bytes),
    576 bytes a row (latent 512, RoPE 64); ``s_kv`` rows; indices: int32 ``[s_q, 1, topk]``
    (last dim contiguous); sm_scale: on the dequantized scores; q_scale / kv_scale: float32
    one-element tensors on q's device (read in the kernel); attn_sink float ``[h_q]`` or None; topk_length int32
    ``[s_q]`` or None. Returns ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q] float32,
    lse [s_q, h_q] float32)``.
    """
    s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    out = torch.empty((s_q, h_q, D_V), dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    sink = None if attn_sink is None else attn_sink.to(torch.float32).contiguous()
    lengths = None if topk_length is None else topk_length.contiguous()
    idx = indices[:, 0, :]
    if s_q == 0:
        return out, max_logits, lse
    if kv_rows.dtype == torch.uint8:
        kv_rows = kv_rows.view(torch.float8_e4m3fn)
    _sparse_mla_q8kv8_fwd_gluon_kernel[(s_q * (h_q // BLOCK_H),)](
        q, kv_rows, idx, out, max_logits, lse,
        sink if sink is not None else max_logits, lengths if lengths is not None else idx,
        q_scale, kv_scale, s_kv, h_q, topk, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), stride_kv, idx.stride(0), out.stride(0), out.stride(1),
        HAS_SINK=sink is not None, HAS_LEN=lengths is not None, **_constexprs(CONFIG),
        num_warps=CONFIG["num_warps"],
    )
    return out, max_logits, lse
