"""FP8 MQA logits for sm_90 in Gluon: warp-specialized ``fp8_mqa_logits`` and candidate filter.

Same contracts and outputs as ``glm_dsa.kernels.mqa_logits.launch_mqa_logits`` (ragged rows,
``glm_dsa.oracle.fp8_mqa_logits``: ``out[i, j] = k_scale[j] · Σ_h w[i, h] · relu(q[i, h] ·
k[j])`` for ``j ∈ [ks[i], ke[i])``, ``-inf`` elsewhere with ``clean_logits``, or the compressed
``[S, max_seqlen_k]`` rows) and ``launch_mqa_candidates`` (the logits not below a row's
threshold appended to its candidate slots, ``glm_dsa.kernels.topk``'s order keys). It takes
``D = 128`` and a power-of-two ``H`` from 8 to 128 (``gluon_refusal``). It is not dispatched
by default: on one H200 it ran at 0.90–0.97× the Triton kernel and 0.89–0.93× DeepGEMM
(bench/RESULTS.md, issue 43), so ``mqa_logits`` keeps the Triton kernel everywhere.

Schedule: one CTA per (row block, column split), the Triton kernel's grid (row blocks heaviest
first, columns split only when there are too few row blocks for the SMs) and work skipping:
only the key tiles that meet the union of the block's windows are read; the other columns of
the split get ``-inf`` stores. A row block is ``ROW_GROUPS · 128 / H`` rows: ``ROW_GROUPS``
groups of ``QN = 128`` (query, head) pairs. ``CONSUMERS`` warpgroups (2 or 4) each take one
row group against ``WG_N = BLOCK_N · ROW_GROUPS / CONSUMERS`` keys (64 or 128) of every key
tile. Three partitions:

- **Loader** (``LOADER_WARPS`` warps, ``LOADER_REGS`` registers). TMA of the block's queries
  ``[ROW_GROUPS · QN, 128]`` once (``q_ready``), then per key tile of ``BLOCK_N`` keys into
  stage ``t % STAGES`` of a ring (``ready[s]``, expect-tx; keys past the end zero-filled by
  the TMA unit), once ``empty[s]`` says every consumer is done with the stage.
- **Consumer warpgroups** (the default partition and workers of ``CONSUMER_REGS``). Consumer
  ``c`` computes its ``k [WG_N, 128] @ q_gᵀ [128, QN]`` (fp8 wgmma, keys on the M side as
  DeepGEMM), waits for it, frees the stage and runs the epilogue in registers: ReLU, gate,
  head sum (inside a thread and its quad: the ``QN`` columns are ``128 / H`` rows of ``H``
  heads), the key scales (loaded from global a tile ahead), then a direct store (the window
  mask only on tiles that cross a row's window edge) or the candidate filter (one relaxed
  atomic per kept entry). The row groups share each key tile, so a key is read once per
  ``ROW_GROUPS · 128 / H`` rows (with 2, half DeepGEMM's L2 traffic per FLOP). With ``TURNS``
  the consumers issue their wgmmas in a ring (``turn[c]``: consumer ``c`` issues once consumer
  ``c - 1`` has issued its own), so their MMAs queue back to back and each one's epilogue runs
  during the others' MMAs. With ``SMEM_GATES`` each consumer keeps its 32 gates a thread in
  shared memory and reads them back before each epilogue, so they are not live through the
  loop.

``CONFIG`` (two consumers, 128-key tiles, turns) is the schedule measured in issue 43's runs 1
and 2. ``FOUR_CONSUMERS`` is DeepGEMM's consumer shape on our row sharing: four consumers of
64 keys × 128 pairs (two row groups × two key halves of a 128-key tile), 64 accumulator
registers each, gates in shared memory. 640 threads leave 96 registers a thread at launch
(Triton's budget: 480 a thread-slot of a warpgroup), so the workers get 112 and the default
partition 120, the loader 24 (DeepGEMM's math warpgroups have 112).

Registers (ptxas -v at sm_90a): ``CONFIG`` 168 a thread at launch; setmaxnreg gives the
worker consumer 216 and the loader 40, the default partition the rest. ``FOUR_CONSUMERS`` 96
at launch, the workers 112, the default partition 120, the loader 24. Neither spills at H 32,
64 and 128 in any mode (clean, unclean, compressed, candidates), except ``FOUR_CONSUMERS``'
H 32 candidates (16 bytes stored); at H 8 clean ``CONFIG`` spills 532 bytes (448 before the
four-consumer change, which took H 16 candidates from 64 to none), ``FOUR_CONSUMERS`` 1,384
(and 52 for H 16 candidates). What keeps the four consumers within 112: the gates in shared
memory, the rows' windows and thresholds read in the epilogue, int32 offsets from the block's
first row, and the ``-inf`` fill of the split's columns outside the windows before the loop
(no accumulator live). Shared memory: ``CONFIG`` 98,576 bytes (queries 32 KB, ring 4 × 16 KB,
barriers), the candidate form 102,496 (the atomics' scratch); ``FOUR_CONSUMERS`` 100,664 (the
gates' 2 KB).

Measured and dropped (4,096 × 131,072, H 32; bench/RESULTS.md): a 16-byte ``cp.async`` loader
(with its ``fence.proxy.async`` before each wgmma): 5.35 ms with the turns (run 1), as TMA's
5.39 (run 2), and 6.45 against TMA's 6.23 with ping-pong; ping-pong accumulators (each
consumer issues tile i + 1's wgmma before tile i's epilogue; 64-key tiles, 8 stages, two
accumulators of 64 registers) 6.23 ms against 5.39 for the turns.
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from glm_dsa.kernels.aot import compile_gluon_sm90
from glm_dsa.kernels.topk import COUNTERS

__all__ = ["launch_mqa_logits_gluon", "launch_mqa_candidates_gluon", "gluon_refusal",
           "shape_refusal", "compile_sm90", "CONFIG", "FOUR_CONSUMERS"]

QN = 128  # (query, head) pairs per consumer warpgroup: the wgmma's N
HEAD_DIM = 128  # D: one 128-byte swizzled row, one wgmma K chain of 4 × 32
_QN = gl.constexpr(QN)
# The candidate epilogue bumps column 0 of each row's counters (glm_dsa.kernels.topk's layout).
_COUNTERS = gl.constexpr(COUNTERS)
# The launch configuration (the fastest of the variants measured; module docstring). Registers:
# the default partition (consumer 0) takes 248, so the worker consumer and the loader share the
# rest of a warpgroup's 512 (65,536 a CTA).
CONFIG = {"consumers": 2, "row_groups": 2, "block_n": 128, "stages": 4, "turns": True,
          "smem_gates": False, "loader_warps": 4, "loader_regs": 40, "consumer_regs": 216}
# Issue 43's four-warpgroup schedule (module docstring), DeepGEMM's consumer tile: each consumer
# 64 keys of a 128-key tile against one of the two row groups; 112 registers the workers, the
# default partition the rest (120).
FOUR_CONSUMERS = {"consumers": 4, "smem_gates": True, "loader_regs": 24, "consumer_regs": 112}


def shape_refusal(H: int, D: int) -> str | None:
    """Why ``H`` heads of ``D`` dims cannot take the Gluon kernel (None when they can)."""
    if D != HEAD_DIM:
        return f"D={D} (the Gluon kernel is D={HEAD_DIM})"
    if H < 8 or H > QN or H & (H - 1):
        return f"H={H} (the Gluon kernel takes a power of two from 8 to {QN})"
    return None


def gluon_refusal(q_fp8: Tensor, k_fp8: Tensor) -> str | None:
    """Why a call with these queries and keys cannot take the Gluon kernel (None when it can):
    the Gluon sparse MLA's device rule (``sparse_mla.device_refusal``: an sm_90 GPU, a tested
    Triton, not the interpreter), ``shape_refusal``, contiguous 16-byte aligned q and k (TMA)."""
    from glm_dsa.kernels.sparse_mla import DeviceFacts, device_refusal

    why = device_refusal(DeviceFacts.of(q_fp8.device))
    if why is None:
        why = shape_refusal(q_fp8.shape[1], q_fp8.shape[2])
    if why is None and not (q_fp8.is_contiguous() and k_fp8.is_contiguous()):
        why = "q or k not contiguous"
    if why is None and (q_fp8.data_ptr() % 16 or k_fp8.data_ptr() % 16):
        why = "q or k not 16-byte aligned"
    return why


# ----------------------------------------------------------------------------- device code
@gluon.jit
def _block(ks_ptr, ke_ptr, S, n_keys, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
           WARPS: gl.constexpr):
    """This CTA's first row (heaviest block first), its split ``[s0, s1)`` of key tiles and
    the part ``[c0, c1)`` that meets its rows' windows; every partition computes the same."""
    lay: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    row0 = (gl.num_programs(0) - 1 - gl.program_id(0)) * BLOCK_M
    rows = row0 + gl.arange(0, BLOCK_M, layout=lay)
    ok = rows < S
    ks = gl.load(ks_ptr + rows, mask=ok, other=0)
    ke = gl.load(ke_ptr + rows, mask=ok, other=0)
    nonempty = ke > ks
    lo = gl.min(gl.where(nonempty, ks, n_keys), axis=0)
    hi = gl.max(gl.where(nonempty, ke, 0), axis=0)
    n_tiles = gl.cdiv(n_keys, BLOCK_N)
    per_split = gl.cdiv(n_tiles, gl.num_programs(1))
    s0 = gl.program_id(1) * per_split
    s1 = gl.minimum(s0 + per_split, n_tiles)
    c0 = gl.minimum(gl.maximum(lo // BLOCK_N, s0), s1)
    c1 = gl.maximum(gl.minimum(gl.cdiv(hi, BLOCK_N), s1), c0)
    return row0, s0, s1, c0, c1


@gluon.jit
def _loader(q_desc, k_desc, ks_ptr, ke_ptr, q_smem, k_smem, q_ready, ready, empty, S, n_keys,
            H: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            STAGES: gl.constexpr, ROW_GROUPS: gl.constexpr, WARPS: gl.constexpr):
    """TMA of the block's queries once (``ROW_GROUPS`` boxes of ``QN`` (query, head) rows),
    then of the key tiles ``[c0, c1)`` into the ring."""
    row0, s0, s1, c0, c1 = _block(ks_ptr, ke_ptr, S, n_keys, BLOCK_M, BLOCK_N, WARPS)
    # Rows past the end of q or k are zero-filled by the TMA unit (and counted in the bytes).
    mbarrier.expect(q_ready, ROW_GROUPS * _QN * D)
    for g in gl.static_range(ROW_GROUPS):
        tma.async_copy_global_to_shared(q_desc, [row0 * H + g * _QN, 0], q_ready,
                                        q_smem.index(g))
    for i in range(c1 - c0):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        mbarrier.expect(ready.index(s), BLOCK_N * D)
        tma.async_copy_global_to_shared(k_desc, [(c0 + i) * BLOCK_N, 0], ready.index(s),
                                        k_smem.index(s))


@gluon.jit
def _fill(out_ptr, out_stride, row0, S, t0, t1, n_out, BLOCK_N: gl.constexpr, KEY0: gl.constexpr,
          WG_N: gl.constexpr, ROWS: gl.constexpr, lay: gl.constexpr):
    """``-inf`` into the output columns ``[KEY0, KEY0 + WG_N)`` of key tiles ``[t0, t1)`` of
    rows ``row0 + [0, ROWS)`` (a consumer's part of each tile), in the epilogue's
    ``[WG_N, ROWS]`` layout ``lay`` (no registers beyond the epilogue's)."""
    fill = gl.full([WG_N, ROWS], float("-inf"), gl.float32, lay)
    keys = KEY0 + gl.arange(0, WG_N, layout=gl.SliceLayout(1, lay))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, lay))
    base = out_ptr + row0.to(gl.int64) * out_stride
    row_ok = (row0 + r < S)[None, :]
    for t in range(t0, t1):
        cols = t * BLOCK_N + keys
        gl.store(base + r[None, :] * out_stride + cols[:, None], fill,
                 mask=row_ok & (cols < n_out)[:, None])


@gluon.jit
def _scales(k_scale_ptr, key0, n_keys, WG_N: gl.constexpr, layout: gl.constexpr):
    """The scales of keys ``[key0, key0 + WG_N)`` (0 past the end), in the accumulator's row
    layout."""
    cols = key0 + gl.arange(0, WG_N, layout=layout)
    return gl.load(k_scale_ptr + cols, mask=cols < n_keys, other=0.0)


@gluon.jit
def _order_keys(x):
    """``glm_dsa.kernels.topk.order_keys`` as int32 bits: uint32 keys in the order of the
    float32 scores ``x`` (``-0.0`` as ``+0.0``)."""
    bits = (x + 0.0).to(gl.uint32, bitcast=True)
    flip = gl.where((bits >> 31) == 1, 0xFFFFFFFF, 0x80000000).to(gl.uint32)
    return (bits ^ flip).to(gl.int32, bitcast=True)


@gluon.jit
def _epilogue(acc, w, scale, key0, row0, ks_rows, ke_rows, lo_in, hi_in, src, dst, S, n_keys,
              out_stride, cand, H: gl.constexpr, WG_N: gl.constexpr, red_lay: gl.constexpr,
              CLEAN: gl.constexpr, COMPRESSED: gl.constexpr, CANDIDATES: gl.constexpr):
    """The logits of keys ``[key0, key0 + WG_N)`` from their scores ``acc [WG_N, QN]``: ReLU,
    gate, head sum (in the thread and its quad), key scale; then stored (window-masked), or
    with ``CANDIDATES`` those of the window not below the row's threshold appended to the row's
    candidates.

    Rows ``row0 + [0, 128 / H)`` (``ks_rows``, ``ke_rows``: their windows, for ``COMPRESSED``);
    ``src``: ``(ks_ptr, ke_ptr, thr_ptr, counters_ptr)``,
    ``dst``: ``(out_ptr, cand_key_ptr, cand_idx_ptr)``. A tile inside every row's window
    (``[lo_in, hi_in)``, nearly every tile of a causal chunk) takes no window masks. The rows'
    windows and thresholds are read here (L1 hits) rather than held across the loop: four
    consumers have 112-120 registers each, 96 of them the accumulator and the gates."""
    ROWS: gl.constexpr = _QN // H
    p = gl.maximum(acc, 0.0) * w[None, :]
    logits = gl.sum(gl.reshape(p, [WG_N, ROWS, H]), axis=2)
    logits = logits * gl.convert_layout(scale, gl.SliceLayout(1, red_lay))[:, None]
    cols = key0 + gl.arange(0, WG_N, layout=gl.SliceLayout(1, red_lay))
    r = gl.arange(0, ROWS, layout=gl.SliceLayout(0, red_lay))
    rows = row0 + r
    row_ok = rows < S
    interior = (key0 >= lo_in) & (key0 + WG_N <= hi_in)
    if CANDIDATES:
        thr = gl.load(src[2] + rows, mask=row_ok, other=0.0)
        reach = ~(logits < thr[None, :])  # NaN is kept
        if interior:
            take = reach
        else:
            # Rows past S have empty windows (ks = ke = 0).
            ks = gl.load(src[0] + rows, mask=row_ok, other=0)
            ke = gl.load(src[1] + rows, mask=row_ok, other=0)
            take = reach & (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        # One atomic per kept entry, none for the rest.
        one = gl.full([WG_N, ROWS], 1, gl.int32, red_lay)
        count_ptrs = src[3] + row0 * _COUNTERS + r * _COUNTERS
        slot = gl.atomic_add(count_ptrs[None, :] + gl.zeros_like(cols)[:, None], one, mask=take,
                             sem="relaxed")
        ok = take & (slot < cand)
        # Slots from the block's first row fit int32 (128 / H rows of cand < 2³¹ / 16).
        first = row0.to(gl.int64) * cand
        at = r[None, :] * cand + slot
        ks = gl.load(src[0] + rows, mask=row_ok, other=0)
        gl.store(dst[1] + first + at, _order_keys(logits), mask=ok)
        gl.store(dst[2] + first + at, cols[:, None] - ks[None, :], mask=ok)
    else:
        # Offsets from the block's first row fit int32: 128 / H rows of at most 2³¹ / 16.
        base = dst[0] + row0.to(gl.int64) * out_stride
        offs = r[None, :] * out_stride + cols[:, None]
        if COMPRESSED:
            # Row i's column j holds key ks[i] + j; only its window is written.
            ks = ks_rows
            ptrs = base + (offs - ks[None, :])
        else:
            ptrs = base + offs
        if interior:
            gl.store(ptrs, logits)
        else:
            if COMPRESSED:
                ks_edge = ks
                ke = ke_rows
            else:
                ks_edge = gl.load(src[0] + rows, mask=row_ok, other=0)
                ke = gl.load(src[1] + rows, mask=row_ok, other=0)
            inside = (cols[:, None] >= ks_edge[None, :]) & (cols[:, None] < ke[None, :])
            if COMPRESSED:
                gl.store(ptrs, logits, mask=inside & row_ok[None, :])
            else:
                if CLEAN:
                    logits = gl.where(inside, logits, float("-inf"))
                gl.store(ptrs, logits, mask=row_ok[None, :] & (cols < n_keys)[:, None])


@gluon.jit
def _consumer(k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem, k_smem,
              w_smem, q_ready, ready, empty, turn, S, n_keys, n_out, out_stride, cand,
              C: gl.constexpr, H: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
              STAGES: gl.constexpr, CONSUMERS: gl.constexpr, ROW_GROUPS: gl.constexpr,
              TURNS: gl.constexpr, SMEM_GATES: gl.constexpr, CLEAN: gl.constexpr,
              COMPRESSED: gl.constexpr, CANDIDATES: gl.constexpr):
    """Consumer ``C``: row group ``g = C % ROW_GROUPS`` (the block's rows ``[g · 128 / H,
    (g + 1) · 128 / H)``) against key group ``C // ROW_GROUPS`` of each tile (its ``WG_N``
    keys from ``KEY0``)."""
    ROWS: gl.constexpr = _QN // H
    WG_N: gl.constexpr = BLOCK_N * ROW_GROUPS // CONSUMERS
    G: gl.constexpr = C % ROW_GROUPS
    KEY0: gl.constexpr = (C // ROW_GROUPS) * WG_N
    acc_lay: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, _QN, 32])
    key_lay: gl.constexpr = gl.SliceLayout(1, acc_lay)
    row0, s0, s1, c0, c1 = _block(ks_ptr, ke_ptr, S, n_keys, BLOCK_M, BLOCK_N, 4)
    row0 += G * ROWS
    # Gates in the accumulator's column layout: column n is row n // H, head n % H.
    n = gl.arange(0, _QN, layout=gl.SliceLayout(0, acc_lay))
    w = gl.load(w_ptr + (row0 * H + n).to(gl.int64), mask=row0 + n // H < S, other=0.0)
    if SMEM_GATES:
        # Each thread reads back what it wrote (the replicas write equal values): no barrier.
        w_smem.index(C).store(w)
    zero = gl.zeros([WG_N, _QN], gl.float32, acc_lay)
    # The epilogue's [WG_N, ROWS] layout: the head sum's (columns stay in their threads).
    red_lay: gl.constexpr = gl.sum(gl.reshape(zero, [WG_N, ROWS, H]), axis=2).type.layout
    rows = row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(0, red_lay))
    ks = gl.load(ks_ptr + rows, mask=rows < S, other=0)
    ke = gl.load(ke_ptr + rows, mask=rows < S, other=0)
    # Keys inside every row's window (an empty range unless all ROWS rows are real).
    lo_in = gl.max(ks, axis=0)
    hi_in = gl.where(row0 + ROWS <= S, gl.min(ke, axis=0), 0)
    src = (ks_ptr, ke_ptr, thr_ptr, counters_ptr)
    if CLEAN:
        # The split's columns outside the block's windows, before the loop (while the first
        # tiles load, and with no accumulator live).
        _fill(dst[0], out_stride, row0, S, s0, c0, n_out, BLOCK_N, KEY0, WG_N, ROWS, red_lay)
        _fill(dst[0], out_stride, row0, S, c1, s1, n_out, BLOCK_N, KEY0, WG_N, ROWS, red_lay)
    q_c = q_smem.index(G).permute((1, 0))  # [D, QN], K-major
    mbarrier.wait(q_ready, 0)
    # With TURNS the consumers issue their wgmmas in a ring (turn[C], see the module
    # docstring): consumer 0's first tile goes first, then each issues once the one before it
    # has issued.
    scale_n = _scales(k_scale_ptr, c0 * BLOCK_N + KEY0, n_keys, WG_N, key_lay)
    for i in range(c1 - c0):
        s = i % STAGES
        key0 = (c0 + i) * BLOCK_N + KEY0
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        if TURNS:
            phase = i & 1
            if C == 0:
                phase = phase ^ 1
            mbarrier.wait(turn.index(C), phase)
        k_c = k_smem.index(s)
        if WG_N < BLOCK_N:
            k_c = k_c.slice(KEY0, WG_N)
        acc = warpgroup_mma(k_c, q_c, zero, use_acc=False, is_async=True)
        if TURNS:
            mbarrier.arrive(turn.index((C + 1) % CONSUMERS), count=1)
        # The next tile's scales are loaded while this tile's wgmma runs.
        scale = scale_n
        scale_n = _scales(k_scale_ptr, key0 + BLOCK_N, n_keys, WG_N, key_lay)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        mbarrier.arrive(empty.index(s), count=1)
        if SMEM_GATES:
            gates = w_smem.index(C).load(gl.SliceLayout(0, acc_lay))
        else:
            gates = w
        _epilogue(acc, gates, scale, key0, row0, ks, ke, lo_in, hi_in, src, dst, S, n_keys,
                  out_stride, cand, H, WG_N, red_lay, CLEAN, COMPRESSED, CANDIDATES)


@gluon.jit
def _mqa_gluon_kernel(
    q_desc, k_desc, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, thr_ptr,
    cand_key_ptr, cand_idx_ptr, counters_ptr, S, n_keys, n_out, out_stride, cand,
    H: gl.constexpr, D: gl.constexpr, CLEAN: gl.constexpr, COMPRESSED: gl.constexpr,
    CANDIDATES: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CONSUMERS: gl.constexpr, ROW_GROUPS: gl.constexpr, TURNS: gl.constexpr,
    SMEM_GATES: gl.constexpr, LOADER_WARPS: gl.constexpr, LOADER_REGS: gl.constexpr,
    CONSUMER_REGS: gl.constexpr,
):
    """The logits (into ``out``), or with ``CANDIDATES`` the candidates (``launch_mqa_candidates``'
    contract: ``cand_key``, ``cand_idx`` and ``counters``; ``out`` unused)."""
    BLOCK_M: gl.constexpr = ROW_GROUPS * _QN // H
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    bar: gl.constexpr = mbarrier.MBarrierLayout()
    q_smem = gl.allocate_shared_memory(gl.float8e4nv, [ROW_GROUPS, _QN, D], swz)
    k_smem = gl.allocate_shared_memory(gl.float8e4nv, [STAGES, BLOCK_N, D], swz)
    # The gates' copy per consumer (SMEM_GATES), read back before each epilogue.
    w_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, _QN],
                                       gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    q_ready = gl.allocate_shared_memory(gl.int64, [1], bar)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], bar)
    turn = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], bar)
    mbarrier.init(q_ready, count=1)  # the loader's arrive with the TMA byte count
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # every consumer
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(turn.index(c), count=1)
    dst = (out_ptr, cand_key_ptr, cand_idx_ptr)
    # warp_specialize takes literal partition lists: one per consumer count.
    if CONSUMERS == 4:
        gl.warp_specialize([
            (_consumer, (k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem,
                         k_smem, w_smem, q_ready, ready, empty, turn, S, n_keys, n_out,
                         out_stride, cand, 0, H, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                         ROW_GROUPS, TURNS, SMEM_GATES, CLEAN, COMPRESSED, CANDIDATES)),
            (_consumer, (k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem,
                         k_smem, w_smem, q_ready, ready, empty, turn, S, n_keys, n_out,
                         out_stride, cand, 1, H, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                         ROW_GROUPS, TURNS, SMEM_GATES, CLEAN, COMPRESSED, CANDIDATES)),
            (_consumer, (k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem,
                         k_smem, w_smem, q_ready, ready, empty, turn, S, n_keys, n_out,
                         out_stride, cand, 2, H, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                         ROW_GROUPS, TURNS, SMEM_GATES, CLEAN, COMPRESSED, CANDIDATES)),
            (_consumer, (k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem,
                         k_smem, w_smem, q_ready, ready, empty, turn, S, n_keys, n_out,
                         out_stride, cand, 3, H, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                         ROW_GROUPS, TURNS, SMEM_GATES, CLEAN, COMPRESSED, CANDIDATES)),
            (_loader, (q_desc, k_desc, ks_ptr, ke_ptr, q_smem, k_smem, q_ready, ready, empty, S,
                       n_keys, H, D, BLOCK_M, BLOCK_N, STAGES, ROW_GROUPS, LOADER_WARPS)),
        ], [4, 4, 4, LOADER_WARPS], [CONSUMER_REGS, CONSUMER_REGS, CONSUMER_REGS, LOADER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem,
                         k_smem, w_smem, q_ready, ready, empty, turn, S, n_keys, n_out,
                         out_stride, cand, 0, H, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                         ROW_GROUPS, TURNS, SMEM_GATES, CLEAN, COMPRESSED, CANDIDATES)),
            (_consumer, (k_scale_ptr, w_ptr, ks_ptr, ke_ptr, dst, thr_ptr, counters_ptr, q_smem,
                         k_smem, w_smem, q_ready, ready, empty, turn, S, n_keys, n_out,
                         out_stride, cand, 1, H, BLOCK_M, BLOCK_N, STAGES, CONSUMERS,
                         ROW_GROUPS, TURNS, SMEM_GATES, CLEAN, COMPRESSED, CANDIDATES)),
            (_loader, (q_desc, k_desc, ks_ptr, ke_ptr, q_smem, k_smem, q_ready, ready, empty, S,
                       n_keys, H, D, BLOCK_M, BLOCK_N, STAGES, ROW_GROUPS, LOADER_WARPS)),
        ], [4, LOADER_WARPS], [CONSUMER_REGS, LOADER_REGS])


# ----------------------------------------------------------------------------- host side
def _config(config: dict | None) -> dict:
    """``CONFIG`` with the entries of ``config``; a one-line ``ValueError`` for a schedule the
    kernel does not have."""
    cfg = CONFIG if config is None else {**CONFIG, **config}
    unknown = set(cfg) - set(CONFIG)
    if unknown:
        raise ValueError(f"unknown mqa_logits_gluon config entries {sorted(unknown)}")
    consumers, groups, block_n = cfg["consumers"], cfg["row_groups"], cfg["block_n"]
    if consumers not in (2, 4) or groups not in (1, 2, 4) or consumers % groups:
        raise ValueError(f"consumers={consumers}, row_groups={groups}: need 2 or 4 consumers, "
                         "a row group count dividing them")
    if block_n > 256 or block_n * groups // consumers not in (64, 128):
        raise ValueError(f"block_n={block_n}: a consumer's part (block_n · row_groups / "
                         "consumers) must be 64 or 128 keys, a tile at most 256 (TMA box)")
    return cfg


def _constexprs(cfg: dict) -> dict:
    return {"BLOCK_N": cfg["block_n"], "STAGES": cfg["stages"],
            "CONSUMERS": cfg["consumers"], "ROW_GROUPS": cfg["row_groups"],
            "TURNS": cfg["turns"], "SMEM_GATES": cfg["smem_gates"],
            "LOADER_WARPS": cfg["loader_warps"], "LOADER_REGS": cfg["loader_regs"],
            "CONSUMER_REGS": cfg["consumer_regs"]}


def _smem_layout():
    return gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)


def compile_sm90(H: int = 32, clean: bool = True, compressed: bool = False,
                 candidates: bool = False, config: dict | None = None):
    """Compile the kernel for sm_90 ahead of time, no GPU needed (offline checks of shared
    memory, registers and spills: ``ptxas -v`` on ``.asm["ptx"]``). Pointers marked 16-aligned,
    as the JIT marks GLM-5.3's on the GPU. Must run without ``TRITON_INTERPRET``."""
    kernel = _mqa_gluon_kernel
    cfg = _config(config)
    descs = {"q_desc": f"tensordesc<fp8e4nv[{QN}, {HEAD_DIM}],{_smem_layout()!r}>",
             "k_desc": f"tensordesc<fp8e4nv[{cfg['block_n']}, {HEAD_DIM}],{_smem_layout()!r}>"}
    ptrs = {"k_scale_ptr": "*fp32", "w_ptr": "*fp32", "ks_ptr": "*i32", "ke_ptr": "*i32",
                 "out_ptr": "*fp32", "thr_ptr": "*fp32", "cand_key_ptr": "*i32",
                 "cand_idx_ptr": "*i32", "counters_ptr": "*i32"}
    consts = {"H": H, "D": HEAD_DIM, "CLEAN": clean and not compressed and not candidates,
              "COMPRESSED": compressed and not candidates, "CANDIDATES": candidates,
              **_constexprs(cfg)}
    sig = {**descs, **ptrs, "S": "i32", "n_keys": "i32", "n_out": "i32",
           "out_stride": "i32", "cand": "i32"}
    return compile_gluon_sm90(kernel, sig, consts, list(ptrs), 4)


def _launch(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor, ks: Tensor,
            ke: Tensor, out: Tensor, n_out: int, clean: bool, compressed: bool,
            candidates: tuple[Tensor, Tensor, Tensor, Tensor, int] | None, cfg: dict):
    """The grid and the launch (``candidates``: thresholds, keys, columns, counters, slots;
    ``cfg``: a checked ``_config``)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    S, H, D = q_fp8.shape
    n_keys = k_fp8.shape[0]
    row_blocks = triton.cdiv(S, cfg["row_groups"] * QN // H)
    n_tiles = triton.cdiv(n_keys, cfg["block_n"])
    # One CTA a SM (registers): columns are split only when the row blocks do not fill them.
    sms = torch.cuda.get_device_properties(q_fp8.device).multi_processor_count
    splits = max(1, min(n_tiles, triton.cdiv(sms, row_blocks)))
    q_rows = q_fp8.view(S * H, D)
    q_desc = TensorDescriptor.from_tensor(q_rows, [QN, D], _smem_layout())
    k_desc = TensorDescriptor.from_tensor(k_fp8, [cfg["block_n"], D], _smem_layout())
    ks32, ke32 = ks.to(torch.int32).contiguous(), ke.to(torch.int32).contiguous()
    thr, cand_keys, cand_cols, counters, cand = candidates or (weights, ks32, ks32, ks32, 0)
    _mqa_gluon_kernel[(row_blocks, splits)](
        q_desc, k_desc, k_scale.contiguous(), weights.contiguous(), ks32, ke32,
        out, thr, cand_keys, cand_cols, counters, S, n_keys, n_out, out.stride(0), cand,
        H=H, D=D, CLEAN=clean, COMPRESSED=compressed, CANDIDATES=candidates is not None,
        **_constexprs(cfg), num_warps=4,
    )


def launch_mqa_logits_gluon(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor, weights: Tensor,
                            ks: Tensor, ke: Tensor, clean_logits: bool, max_seqlen_k: int,
                            config: dict | None = None) -> Tensor:
    """``launch_mqa_logits`` (same unchecked contract: validated arguments, int32 windows,
    float32 weights) on the Gluon kernel; ``shape_refusal(H, D)`` must be None and q, k
    contiguous with 16-byte aligned bases. ``config``: entries overriding ``CONFIG`` (for
    measurements)."""
    cfg = _config(config)
    S = q_fp8.shape[0]
    n_keys = k_fp8.shape[0]
    compressed = max_seqlen_k > 0
    n_out = max_seqlen_k if compressed else n_keys
    if compressed:
        out = torch.full((S, n_out), float("-inf"), dtype=torch.float32, device=q_fp8.device)
    else:
        out = torch.empty((S, n_out), dtype=torch.float32, device=q_fp8.device)
    if S == 0 or n_out == 0 or n_keys == 0:
        return out
    _launch(q_fp8, k_fp8, k_scale, weights, ks, ke, out, n_out,
            bool(clean_logits) and not compressed, compressed, None, cfg)
    return out


def launch_mqa_candidates_gluon(q_fp8: Tensor, k_fp8: Tensor, k_scale: Tensor,
                                weights: Tensor, ks: Tensor, ke: Tensor, thresholds: Tensor,
                                counters: Tensor, cand: int, config: dict | None = None
                                ) -> tuple[Tensor, Tensor]:
    """``launch_mqa_candidates`` (its unchecked contract, int32 windows) on the Gluon kernel:
    the logits not below their row's threshold appended to the row's ``cand`` slots, counted in
    ``counters[:, 0]``; returns ``(keys, columns)``. As ``launch_mqa_logits_gluon`` for
    ``shape_refusal``, alignment and ``config``."""
    cfg = _config(config)
    S = q_fp8.shape[0]
    keys = torch.empty((S, cand), dtype=torch.int32, device=q_fp8.device)
    cols = torch.empty((S, cand), dtype=torch.int32, device=q_fp8.device)
    if S == 0 or k_fp8.shape[0] == 0:
        return keys, cols
    _launch(q_fp8, k_fp8, k_scale, weights, ks, ke, keys, 0, False, False,
            (thresholds.contiguous(), keys, cols, counters, cand), cfg)
    return keys, cols
