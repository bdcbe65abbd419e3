"""Sparse MLA prefill forward for sm_90 in Gluon: a warp-specialized ``flash_mla_sparse_fwd``.

Same contract as ``glm_dsa.kernels.sparse_mla`` (and ``glm_dsa.oracle.flash_mla_sparse_fwd``):
natural-log ``max_logits`` / ``lse``, indices ``< 0`` or ``>= s_kv`` and columns ``>=
topk_length[row]`` skipped (never read), lonely rows ``out = 0``, ``max_logits = -inf``, ``lse =
+inf``, ``attn_sink`` only in the final normalisation. Shapes it runs: bf16 q ``[s_q, h_q,
576]`` with ``h_q`` a multiple of 64, bf16 rows ``[s_kv, 576]`` (``d_v`` 512) at any row stride
(a paged pool read in place through slot numbers), any ``topk``. ``sparse_mla.py`` dispatches
here on sm_90 with a tested Triton (``sparse_mla.GLUON_TESTED_TRITON``) and runs its Triton kernel otherwise.

Schedule (one CTA per query token and 64-head group; h_q 128 is two neighbouring CTAs that
gather the same rows, the second from L2):

- **Gather partition** (4 warps, few registers): 16-byte ``cp.async`` of Q ``[64, 576]`` once,
  then of each 64-key tile of indexed rows into a 2-stage ring (``k_lat [2, 64, 512]`` and
  ``k_rope [2, 64, 64]``, 144 KB). An invalid or masked index becomes a zero-filled row (``cp.async``
  with source size 0: nothing is read). Each thread's copies complete into an mbarrier with a
  no-increment arrive: ``q_ready`` guards Q, ``ready[s]`` (128 arrivals) guards stage ``s``.
  Before refilling stage ``s`` it waits on ``empty[s]``.
- **Attend partition** (the default 8 warps = 2 warpgroups, ``warps_per_cta = [4, 2]``): per
  tile ``S = Q · Kᵀ`` (``[64 heads, 64 keys]``, the latent and RoPE parts chained into one
  accumulator; each warpgroup scores 32 of the keys), masked by the indices' validity, online
  softmax in base 2 with ``sm_scale · log2 e`` folded in. The row max and sum span both
  warpgroups: Gluon's cross-warp reduction exchanges them through shared memory. P is rounded to
  bf16 (as FlashMLA does) into a shared ``[64, 64]`` tile, then ``O += P · V`` with V the first
  512 columns of the same stage; each warpgroup owns 256 of the 512 output columns
  (``64 x 256`` float32, 128 registers a thread). A partition barrier after the value GEMM
  makes both warpgroups done with the stage and the P tile before ``empty[s]`` is signalled and
  the next P is written.

Shared memory: Q 72 KB + ring 144 KB + P 8 KB = 224 KB of the 227 KB an sm_90 block may take.
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

__all__ = ["flash_mla_sparse_fwd_gluon", "compile_sm90", "CONFIG"]

_LOG2E = math.log2(math.e)
BLOCK_H = 64      # heads per CTA: the wgmma M
BLOCK_K = 64      # keys per tile
D_V, D_TAIL = 512, 64
# The launch configuration, as data (see the module docstring for the schedule).
CONFIG = {"stages": 2, "num_warps": 8, "gather_warps": 4, "gather_regs": 48}


@gluon.jit
def _gather_partition(q_ptr, kv_ptr, idx_ptr, len_ptr, q_lat, q_rope, k_lat, k_rope,
                      q_ready, ready, empty, s_kv, topk, stride_qs, stride_qh, stride_kv,
                      stride_is, h_groups,
                      HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr,
                      D_V: gl.constexpr, D_TAIL: gl.constexpr, STAGES: gl.constexpr,
                      WARPS: gl.constexpr):
    """Q once, then each tile's indexed rows into ring stage ``i % STAGES`` (cp.async)."""
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H
    # 8 threads x 16 bytes cover a 128-byte segment of a row.
    lay: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [WARPS, 1], [1, 0])
    rows = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, lay))
    c_lat = gl.arange(0, D_V, layout=gl.SliceLayout(0, lay))
    c_rope = gl.arange(0, D_TAIL, layout=gl.SliceLayout(0, lay))

    q_rows = q_ptr + qi * stride_qs + (head0 + rows).to(gl.int64)[:, None] * stride_qh
    async_copy.async_copy_global_to_shared(q_lat, q_rows + c_lat[None, :])
    async_copy.async_copy_global_to_shared(q_rope, q_rows + D_V + c_rope[None, :])
    async_copy.mbarrier_arrive(q_ready, increment_count=False)

    n_cols = topk
    if HAS_LEN:
        n_cols = gl.minimum(gl.load(len_ptr + qi), topk)
    idx_row = idx_ptr + qi * stride_is
    for i in range(gl.cdiv(n_cols, BLOCK_K)):
        s = i % STAGES
        mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
        cols = i * BLOCK_K + rows
        t = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
        ok = (t >= 0) & (t < s_kv)
        base = kv_ptr + gl.where(ok, t, 0).to(gl.int64)[:, None] * stride_kv
        async_copy.async_copy_global_to_shared(k_lat.index(s), base + c_lat[None, :],
                                               mask=ok[:, None], eviction_policy="evict_last")
        async_copy.async_copy_global_to_shared(k_rope.index(s), base + D_V + c_rope[None, :],
                                               mask=ok[:, None], eviction_policy="evict_last")
        async_copy.mbarrier_arrive(ready.index(s), increment_count=False)


@gluon.jit
def _scores(q_lat, q_rope, k_lat_s, k_rope_s, layout: gl.constexpr, BLOCK_H: gl.constexpr,
            BLOCK_K: gl.constexpr):
    """``Q · Kᵀ`` of one stage, float32 ``[BLOCK_H, BLOCK_K]``: latent then RoPE part."""
    s = gl.zeros([BLOCK_H, BLOCK_K], gl.float32, layout)
    s = warpgroup_mma(q_lat, k_lat_s.permute((1, 0)), s, is_async=True)
    s = warpgroup_mma(q_rope, k_rope_s.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _online_softmax(s, valid, m_i, l_i, scale_log2):
    """One tile's step of the base-2 online softmax: ``(p, alpha, m_new, l_new)``."""
    s = gl.where(valid[None, :], s * scale_log2, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    # Until a head has seen a valid key its max is -inf; shifting by 0 keeps exp2 NaN-free.
    m_shift = gl.where(m_new == float("-inf"), 0.0, m_new)
    p = gl.exp2(s - m_shift[:, None])
    alpha = gl.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


@gluon.jit
def _attend_partition(idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                      q_lat, q_rope, k_lat, k_rope, p_smem, q_ready, ready, empty,
                      s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh, h_groups,
                      HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr, BLOCK_H: gl.constexpr,
                      BLOCK_K: gl.constexpr, D_V: gl.constexpr, STAGES: gl.constexpr):
    """Scores, online softmax and ``P · V`` per stage; the normalised output at the end."""
    LOG2E: gl.constexpr = 1.4426950408889634
    LN2: gl.constexpr = 0.6931471805599453
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, BLOCK_K // 2, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                       instr_shape=[16, D_V // 2, 16])
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    pid = gl.program_id(0)
    qi = (pid // h_groups).to(gl.int64)
    head0 = (pid % h_groups) * BLOCK_H

    n_cols = topk
    if HAS_LEN:
        n_cols = gl.minimum(gl.load(len_ptr + qi), topk)
    idx_row = idx_ptr + qi * stride_is
    key_cols = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, s_layout))
    m_i = gl.full([BLOCK_H], float("-inf"), gl.float32, row_s)
    l_i = gl.zeros([BLOCK_H], gl.float32, row_s)
    acc = gl.zeros([BLOCK_H, D_V], gl.float32, o_layout)
    mbarrier.wait(q_ready, 0)
    fence_async_shared()
    for i in range(gl.cdiv(n_cols, BLOCK_K)):
        s = i % STAGES
        cols = i * BLOCK_K + key_cols
        t = gl.load(idx_row + cols, mask=cols < n_cols, other=-1)
        valid = (t >= 0) & (t < s_kv)
        mbarrier.wait(ready.index(s), (i // STAGES) & 1)
        fence_async_shared()
        scores = _scores(q_lat, q_rope, k_lat.index(s), k_rope.index(s), s_layout, BLOCK_H,
                         BLOCK_K)
        p, alpha, m_i, l_i = _online_softmax(scores, valid, m_i, l_i, scale_log2)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # the whole P tile is written before either warpgroup reads it
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        acc = warpgroup_mma(p_smem, k_lat.index(s), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # both warpgroups are done with stage s and the P tile
        mbarrier.arrive(empty.index(s), count=1)

    heads_s = head0 + gl.arange(0, BLOCK_H, layout=row_s)
    m_shift = gl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i
    if HAS_SINK:
        denom += gl.exp2(gl.load(sink_ptr + heads_s) * LOG2E - m_shift)
    denom = gl.where(denom == 0.0, 1.0, denom)  # lonely row, no sink: out = 0 / 1
    out = acc / gl.convert_layout(denom, row_o)[:, None]
    heads_o = head0 + gl.arange(0, BLOCK_H, layout=row_o)
    cols_o = gl.arange(0, D_V, layout=gl.SliceLayout(0, o_layout))
    out_rows = out_ptr + qi * stride_os + heads_o.to(gl.int64)[:, None] * stride_oh
    gl.store(out_rows + cols_o[None, :], out.to(gl.bfloat16))
    lonely = l_i == 0.0
    lse = gl.where(lonely, float("inf"), (m_i + gl.log2(gl.where(lonely, 1.0, l_i))) * LN2)
    gl.store(max_ptr + qi * h_q + heads_s, m_i * LN2)
    gl.store(lse_ptr + qi * h_q + heads_s, lse)


@gluon.jit
def _sparse_mla_fwd_gluon_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr,
    s_kv, h_q, topk, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    HAS_SINK: gl.constexpr, HAS_LEN: gl.constexpr,
    BLOCK_H: gl.constexpr, BLOCK_K: gl.constexpr, D_V: gl.constexpr, D_TAIL: gl.constexpr,
    STAGES: gl.constexpr, GATHER_WARPS: gl.constexpr, GATHER_REGS: gl.constexpr,
):
    h_groups = h_q // BLOCK_H
    swz: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q_lat = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_V], swz)
    q_rope = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, D_TAIL], swz)
    k_lat = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, D_V], swz)
    k_rope = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BLOCK_K, D_TAIL], swz)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_H, BLOCK_K], swz)
    q_ready = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_ready, count=GATHER_WARPS * 32)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=GATHER_WARPS * 32)
        mbarrier.init(empty.index(s), count=1)
    gl.warp_specialize([
        (_attend_partition, (idx_ptr, len_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr,
                             q_lat, q_rope, k_lat, k_rope, p_smem, q_ready, ready, empty,
                             s_kv, h_q, topk, scale_log2, stride_is, stride_os, stride_oh,
                             h_groups, HAS_SINK, HAS_LEN, BLOCK_H, BLOCK_K, D_V, STAGES)),
        (_gather_partition, (q_ptr, kv_ptr, idx_ptr, len_ptr, q_lat, q_rope, k_lat, k_rope,
                             q_ready, ready, empty, s_kv, topk, stride_qs, stride_qh, stride_kv,
                             stride_is, h_groups, HAS_LEN, BLOCK_H, BLOCK_K, D_V, D_TAIL, STAGES,
                             GATHER_WARPS)),
    ], [GATHER_WARPS], [GATHER_REGS])


def compile_sm90(has_sink: bool, has_len: bool):
    """Compile the kernel for sm_90 ahead of time, no GPU needed (for offline checks of shared
    memory, registers and spills: ``ptxas -v`` on ``.asm["ptx"]``). Pointers and strides are
    marked 16-divisible, as the JIT marks GLM-5.3's on the GPU. Returns Triton's compiled
    kernel. Must run without ``TRITON_INTERPRET`` (the interpreter replaces ``gl`` builtins).
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    kernel = _sparse_mla_fwd_gluon_kernel
    ptrs = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "out_ptr": "*bf16",
            "max_ptr": "*fp32", "lse_ptr": "*fp32", "sink_ptr": "*fp32", "len_ptr": "*i32"}
    strides = ["stride_qs", "stride_qh", "stride_kv", "stride_is", "stride_os", "stride_oh"]
    consts = {"HAS_SINK": has_sink, "HAS_LEN": has_len, "BLOCK_H": BLOCK_H, "BLOCK_K": BLOCK_K,
              "D_V": D_V, "D_TAIL": D_TAIL, "STAGES": CONFIG["stages"],
              "GATHER_WARPS": CONFIG["gather_warps"], "GATHER_REGS": CONFIG["gather_regs"]}
    sig = {**ptrs, "s_kv": "i32", "h_q": "i32", "topk": "i32", "scale_log2": "fp32",
           **{n: "i32" for n in strides}, **{n: "constexpr" for n in consts}}
    order = list(sig)
    if order != list(kernel.arg_names):
        raise RuntimeError(f"compile_sm90's signature {order} is not the kernel's "
                           f"{list(kernel.arg_names)}")
    aligned = [order.index(n) for n in [*ptrs, *strides]]
    src = GluonASTSource(kernel, sig, {(order.index(n),): v for n, v in consts.items()},
                         attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 128),
                          options={"num_warps": CONFIG["num_warps"]})


def flash_mla_sparse_fwd_gluon(q: Tensor, kv_rows: Tensor, stride_kv: int, s_kv: int,
                               indices: Tensor, sm_scale: float, attn_sink: Tensor | None,
                               topk_length: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """The bare launch over checked inputs (``sparse_mla.flash_mla_sparse_fwd`` checks them).

    q: bf16 ``[s_q, h_q, 576]`` (``h_q % 64 == 0``, last dim contiguous); kv_rows: bf16 rows of
    576 at row stride ``stride_kv`` elements, ``s_kv`` of them; indices: int32 ``[s_q, 1,
    topk]``; attn_sink float ``[h_q]`` or None; topk_length int32 ``[s_q]`` or None.
    Returns ``(out [s_q, h_q, 512] bf16, max_logits [s_q, h_q], lse [s_q, h_q])``.
    """
    s_q, h_q, _ = q.shape
    topk = indices.shape[2]
    out = torch.empty((s_q, h_q, D_V), dtype=torch.bfloat16, device=q.device)
    max_logits = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    if s_q == 0:
        return out, max_logits, lse
    sink = None if attn_sink is None else attn_sink.to(torch.float32).contiguous()
    lengths = None if topk_length is None else topk_length.contiguous()
    idx = indices[:, 0, :]
    cfg = CONFIG
    _sparse_mla_fwd_gluon_kernel[(s_q * (h_q // BLOCK_H),)](
        q, kv_rows, idx, out, max_logits, lse,
        sink if sink is not None else max_logits, lengths if lengths is not None else idx,
        s_kv, h_q, topk, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), stride_kv, idx.stride(0), out.stride(0), out.stride(1),
        HAS_SINK=sink is not None, HAS_LEN=lengths is not None,
        BLOCK_H=BLOCK_H, BLOCK_K=BLOCK_K, D_V=D_V, D_TAIL=D_TAIL,
        STAGES=cfg["stages"], GATHER_WARPS=cfg["gather_warps"], GATHER_REGS=cfg["gather_regs"],
        num_warps=cfg["num_warps"],
    )
    return out, max_logits, lse
