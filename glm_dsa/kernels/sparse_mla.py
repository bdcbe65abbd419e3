"""Sparse MLA prefill forward in Triton: FlashMLA's ``flash_mla_sparse_fwd`` on gathered rows.

One program owns one query token and ``BLOCK_H`` of its heads. It keeps ``q`` on chip (shared
memory, the B operand of the score GEMM) and walks the token's ``topk`` indices in tiles of
``BLOCK_K``: each tile gathers ``BLOCK_K`` rows of the latent cache (index -> row pointer) in
column chunks of ``D_CHUNK``, scores them transposed, ``s^T = K · q^T`` (``[BLOCK_K, BLOCK_H]``,
latent chunks then the RoPE part; keys on the GEMM's M so the two warpgroups score different
keys), and accumulates ``P·V`` per value chunk, where V is the first ``d_v`` columns of the same
gathered rows (no second gather). Softmax is online, in base 2 with ``log2(e)`` folded into the
scale. On the GPU the next tile's rows are prefetched into L2 while a tile computes.

Two entry points share the kernel:

- ``flash_mla_sparse_fwd(q, kv, indices, ...)``: bf16 or float32 ``kv [s_kv, 1, d_qk]``. A bf16
  paged pool is read in place when ``indices`` are slot numbers: pass the pool viewed as
  ``[num_slots, 1, 576]``; nothing is gathered or copied outside the kernel.
- ``sparse_mla_fwd_fp8(q, kv_rows, indices, ...)``: the FP8 pool's 656-byte rows
  (FlashMLA ``V32_FP8Sparse``: 512 e4m3 bytes, 4 float32 tile scales, 64 bf16 RoPE values;
  ``glm_dsa.kv_format.mla_kv_quantize``), dequantized in the kernel as ``e4m3 * scale`` in
  float32 rounded once to the compute dtype (bitwise ``oracle.dequantize_k_cache`` for bf16).

Outputs follow the newest FlashMLA (``glm_dsa.oracle.flash_mla_sparse_fwd``): natural-log
``max_logits`` and ``lse``; indices ``< 0`` or ``>= s_kv`` (slots) and columns
``>= topk_length[row]`` are skipped (never read); a row with no valid index gives ``out = 0``,
``max_logits = -inf``, ``lse = +inf``; ``attn_sink`` enters only the final normalisation.

On an sm_90 GPU with a Triton whose Gluon API was tested (``GLUON_TESTED_TRITON``), calls
with bf16 queries at GLM-5.3's shape (``h_q`` a multiple of 64, ``d_qk`` 576, ``d_v`` 512,
16-aligned strides), over bf16 or FP8 rows, run the warp-specialized Gluon kernels of
``glm_dsa.kernels.sparse_mla_gluon``; every other call (other GPUs, other Triton versions, the
CPU interpreter, float32, small configs) runs the Triton kernel here. The choice is logged
once per reason (logger ``glm_dsa.kernels``).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.kernels.launch import launch_buffers
from glm_dsa.kernels.numerics import round_rne
from glm_dsa.kv_format import MLA_TILE, mla_kv_row_bytes
from glm_dsa.validate import check_sparse_inputs

__all__ = ["flash_mla_sparse_fwd", "sparse_mla_fwd_fp8", "GLUON_TESTED_TRITON",
           "gluon_unavailable", "gluon_unsuitable", "DeviceFacts", "GluonCall", "device_refusal",
           "shape_refusal", "rows_refusal", "call_refusal", "launch_flags", "prefetch_rows",
           "prefetch_ahead", "row_length", "online_softmax_t", "softmax_denominator",
           "store_max_lse"]

_LOG2E = math.log2(math.e)
_LN2 = math.log(2.0)

# Tiling, as data, for the H200 (sm_90, 227 KB shared memory per block) at GLM-5.3's shape
# (h_q 64, d_qk 576, d_v 512, top-2048). Scores are computed transposed (keys on the GEMM's M,
# see the kernel). The kernel is bound by the latency of the row gather (2.36 MB per query): a
# 128-key tile in one buffer (q 72 KB + keys 144 KB = 216 KB; num_stages 1) leaves one block
# per SM, and the next tile's rows are prefetched into L2 while this tile computes. D_CHUNK is
# the width of the column chunks the key tile is gathered, dequantized and multiplied in.
# Measured on one H200 on 2026-12-01 (scripts/bench_sparse_mla.py, 32,768 queries over 131,072
# keys): bf16 48.2 ms with chunk 128, 56.6 ms with 64; FP8 rows 65.7 / 59.0 ms. Double-buffered
# 64-key tiles (num_stages 2, 225 KB; Triton's chained-dot rule then computes each score tile
# on both warpgroups) ran 68-70 ms bf16 and 81-96 ms FP8, and were dropped. Offline sm_90
# compiles (no GPU): 255 registers, spill stack 72 / 424 bytes (bf16 / FP8) at chunk 128 and
# 16 / 40 at chunk 64. Autotune (keyed on KV_FP8) picks per form.
_GPU_CONFIGS = [
    triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "D_CHUNK": dc}, num_warps=w, num_stages=1)
    for bh, bk, dc, w in (
        (64, 128, 128, 8),
        (64, 128, 64, 8),
        (16, 64, 128, 4),  # small configs (h_q <= 16) only
        (16, 64, 64, 4),
    )
]
# The interpreter (CPU CI) runs one small tile; its cost is per program, not per FLOP.
_INTERPRET_CONFIGS = [
    triton.Config({"BLOCK_H": 16, "BLOCK_K": 16, "D_CHUNK": 64}, num_warps=4, num_stages=1)
]
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_log = logging.getLogger("glm_dsa.kernels")
# Triton versions whose Gluon API the sm_90 kernel was compiled and run with (the H200's). Gluon
# is experimental and its signatures move between releases (warp_specialize's did), so any
# other version takes the Triton kernel until the Gluon one is tested there.
GLUON_TESTED_TRITON = ("3.6.0",)
_LOGGED: set[str] = set()


@dataclass(frozen=True)
class DeviceFacts:
    """What the Gluon dispatch reads about the place a call runs (``DeviceFacts.of``), so that
    the rules below are pure functions a CPU test can drive with any GPU's facts.

    Attributes:
        interpret: Triton's CPU interpreter is on (``TRITON_INTERPRET=1``).
        device_type: ``torch.device.type`` of the call's tensors.
        capability: ``(major, minor)`` of a CUDA device; ``(0, 0)`` elsewhere (and not asked
            for under the interpreter).
        triton_version: ``triton.__version__``.
    """

    interpret: bool
    device_type: str
    capability: tuple[int, int]
    triton_version: str

    @classmethod
    def of(cls, device: torch.device) -> DeviceFacts:
        cuda = device.type == "cuda" and not _INTERPRET
        major, minor = torch.cuda.get_device_capability(device) if cuda else (0, 0)
        return cls(_INTERPRET, device.type, (major, minor), triton.__version__)


@dataclass(frozen=True)
class GluonCall:
    """The facts of one sparse MLA call the Gluon kernel's guards read (``GluonCall.of``).

    Attributes:
        q_dtype, kv_dtype: the query's and the rows' dtypes (uint8 for FP8 rows).
        fp8: the rows are FP8 ``V32_FP8Sparse`` rows.
        h_q, d_qk, d_v: query heads, score and value widths.
        strides: ``(q.stride(0), q.stride(1), stride_kv)``, in elements (bytes for FP8 rows).
        data_ptrs: the base addresses of q and the rows, in bytes.
    """

    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    fp8: bool
    h_q: int
    d_qk: int
    d_v: int
    strides: tuple[int, int, int]
    data_ptrs: tuple[int, int]

    @classmethod
    def of(cls, q: Tensor, kv_rows: Tensor, stride_kv: int, d_v: int, fp8: bool) -> GluonCall:
        return cls(q.dtype, kv_rows.dtype, fp8, q.shape[1], q.shape[2], d_v,
                   (q.stride(0), q.stride(1), stride_kv), (q.data_ptr(), kv_rows.data_ptr()))


def device_refusal(facts: DeviceFacts) -> str | None:
    """Why the Gluon sm_90 kernel cannot run where ``facts`` say (None when it can): the CPU
    interpreter, another device or GPU generation, or an untested Triton."""
    if facts.interpret:
        return "the CPU interpreter"
    if facts.device_type != "cuda":
        return f"device {facts.device_type}"
    cap = facts.capability
    if cap != (9, 0):
        return f"sm_{cap[0]}{cap[1]} (the Gluon kernel is sm_90 only)"
    if facts.triton_version not in GLUON_TESTED_TRITON:
        return (f"triton {facts.triton_version} (the Gluon kernel was tested with "
                f"{', '.join(GLUON_TESTED_TRITON)})")
    return None


def shape_refusal(dtype: torch.dtype, h_q: int, d_qk: int, d_v: int) -> str | None:
    """Why ``dtype`` queries of ``h_q`` heads and ``d_qk`` / ``d_v`` dims cannot take the Gluon
    kernel, whatever its rows and device (None when they can)."""
    if dtype != torch.bfloat16:
        return f"{dtype} activations (the Gluon kernel is bf16)"
    if h_q % 64 or d_qk != 576 or d_v != 512:
        return f"h_q {h_q}, d_qk {d_qk}, d_v {d_v} (the Gluon kernel: h_q % 64 == 0, 576 / 512)"
    return None


def rows_refusal(call: GluonCall) -> str | None:
    """Why this call's rows or layout cannot take the Gluon kernel, whatever its shapes and
    device (None when they can)."""
    if not call.fp8 and call.kv_dtype != torch.bfloat16:
        return f"{call.kv_dtype} rows (the Gluon kernel is bf16)"
    # 16-byte cp.async: strides in elements (bytes for FP8 rows) multiples of 16.
    if any(st % 16 for st in call.strides) or any(p % 16 for p in call.data_ptrs):
        return f"strides {call.strides} or base pointers not 16-aligned"
    return None


def call_refusal(facts: DeviceFacts, call: GluonCall) -> str | None:
    """The first of ``device_refusal``, ``shape_refusal`` and ``rows_refusal`` that refuses
    the call (None: it takes the Gluon kernel)."""
    return (device_refusal(facts) or shape_refusal(call.q_dtype, call.h_q, call.d_qk, call.d_v)
            or rows_refusal(call))


def gluon_unavailable(device: torch.device) -> str | None:
    """``device_refusal`` of ``device``'s facts."""
    return device_refusal(DeviceFacts.of(device))


def gluon_unsuitable(device: torch.device, dtype: torch.dtype, h_q: int, d_qk: int,
                     d_v: int) -> str | None:
    """Why sparse MLA of ``dtype`` queries with ``h_q`` heads and ``d_qk`` / ``d_v`` dims on
    ``device`` cannot take the Gluon kernel, whatever its rows (None when it can):
    ``gluon_unavailable``, then ``shape_refusal``. The one rule: each call's dispatch here and
    the triton backend's choice for an FP8 pool both read it."""
    return gluon_unavailable(device) or shape_refusal(dtype, h_q, d_qk, d_v)


def _gluon_unsuitable(q: Tensor, kv_rows: Tensor, stride_kv: int, indices: Tensor, d_v: int,
                      fp8: bool) -> str | None:
    """Why this call cannot take the Gluon kernel (None when it can): ``call_refusal`` on the
    device's facts."""
    return (gluon_unsuitable(q.device, q.dtype, q.shape[1], q.shape[2], d_v)
            or rows_refusal(GluonCall.of(q, kv_rows, stride_kv, d_v, fp8)))


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        _log.info(message)


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs whose head block suits h_q: 16 for h_q <= 16, else 64 (h_q 128 runs
    two head blocks per query, launched side by side so their gathers share L2)."""
    wanted = 16 if named_args["h_q"] <= 16 else 64
    kept = [c for c in configs if c.kwargs["BLOCK_H"] == wanted]
    return kept or configs


@triton.jit
def prefetch_rows(rows, ROW_BYTES: tl.constexpr):
    """Ask L2 for the ``ROW_BYTES``-byte rows at ``rows`` (pointers, ``[BLOCK_K]``, 16-byte
    aligned): one bulk prefetch per row, which does not wait for the data."""
    size = tl.full(rows.shape, ROW_BYTES, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0;",
                              "=r,l,r", [rows, size], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_ahead(kv_ptr, idx_rows, start, n_cols, s_kv, stride_kv, BLOCK_K: tl.constexpr,
                   ROW_BYTES: tl.constexpr):
    """The valid rows of the next tile (index columns ``start + BLOCK_K ...``; ``idx_rows`` the
    row's ``[BLOCK_K]`` index pointers) into L2 while this tile computes (``prefetch_rows``)."""
    cols_ahead = start + BLOCK_K + tl.arange(0, BLOCK_K)
    idx_ahead = tl.load(idx_rows + start + BLOCK_K, mask=cols_ahead < n_cols, other=-1)
    ok_ahead = (idx_ahead >= 0) & (idx_ahead < s_kv)
    prefetch_rows(kv_ptr + tl.where(ok_ahead, idx_ahead, 0).to(tl.int64) * stride_kv, ROW_BYTES)


@triton.jit
def row_length(len_ptr, qi, topk, HAS_LEN: tl.constexpr):
    """How many of the row's ``topk`` columns count: ``min(topk_length[qi], topk)``."""
    n_cols = topk
    if HAS_LEN:
        n_cols = tl.minimum(tl.load(len_ptr + qi), topk)
    return n_cols


@triton.jit
def online_softmax_t(st, valid, m_i, l_i, scale_log2):
    """One tile's step of the base-2 online softmax on transposed scores ``st`` (``[BLOCK_K,
    BLOCK_H]``, keys on axis 0; ``valid`` ``[BLOCK_K]``), ``scale_log2`` taking them to base-2
    logits: ``(pt, alpha, m_new, l_new)``, ``pt`` transposed as ``st``; ``m`` in scaled units
    (``max(st) · scale_log2``, the max of the scaled scores: the scale is positive)."""
    # Masked unscaled: ``st · scale_log2 − m`` is then one FMA a score (FlashMLA's form).
    st = tl.where(valid[:, None], st, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(st, axis=0) * scale_log2)
    # Until a head has seen a valid key its max is -inf; shifting by 0 keeps exp2 NaN-free.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    pt = tl.exp2(st * scale_log2 - m_shift[None, :])
    alpha = tl.exp2(m_i - m_shift)
    return pt, alpha, m_new, l_i * alpha + tl.sum(pt, axis=0)


@triton.jit
def softmax_denominator(l_i, m_i, sink_ptr, offs_h, h_mask, HAS_SINK: tl.constexpr):
    """The softmax denominator of heads ``offs_h`` (``[BLOCK_H]``, ``h_mask`` the real ones): the
    row sum ``l_i`` (base 2, shifted by the running max ``m_i``) plus the sink's
    ``exp(attn_sink)`` at that shift; 1 for a lonely row without a sink, so that ``out = 0 / 1``."""
    LOG2E: tl.constexpr = 1.4426950408889634
    m_shift = tl.where(m_i == float("-inf"), 0.0, m_i)
    denom = l_i
    if HAS_SINK:
        sink = tl.load(sink_ptr + offs_h, mask=h_mask, other=0.0)
        denom += tl.exp2(sink * LOG2E - m_shift)
    return tl.where(denom == 0.0, 1.0, denom)


@triton.jit
def store_max_lse(max_ptr, lse_ptr, qi, h_q, offs_h, h_mask, m_i, l_i):
    """Natural-log ``max_logits`` and ``lse`` of query ``qi``'s heads ``offs_h`` from the base-2
    running max ``m_i`` and row sum ``l_i``; a lonely row (``l_i == 0``) gets ``lse = +inf``."""
    LN2: tl.constexpr = 0.6931471805599453
    lonely = l_i == 0.0
    lse = tl.where(lonely, float("inf"), (m_i + tl.log2(tl.where(lonely, 1.0, l_i))) * LN2)
    tl.store(max_ptr + qi * h_q + offs_h, m_i * LN2, mask=h_mask)
    tl.store(lse_ptr + qi * h_q + offs_h, lse, mask=h_mask)


# One kernel body of ~120 lines: the loop's phases (gather, scores, online softmax, P·V) share
# per-chunk tuples of q, keys and accumulators, and read top to bottom as the algorithm does.
@triton.autotune(
    configs=_INTERPRET_CONFIGS if _INTERPRET else _GPU_CONFIGS,
    key=["h_q", "topk", "D_V", "D_TAIL", "KV_FP8", "HAS_LEN"],
    prune_configs_by={"early_config_prune": _prune_configs},
    cache_results=True,  # kept beside the compiled kernels, as mqa_logits' choices are
)
@triton.jit
def _sparse_mla_fwd_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr,
    s_kv, h_q, topk, scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DT: tl.constexpr,
    KV_FP8: tl.constexpr, HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, STATIC_TOPK: tl.constexpr,
    PREFETCH: tl.constexpr, ROW_BYTES: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, D_CHUNK: tl.constexpr,
):
    N_CHUNK: tl.constexpr = (D_V + D_CHUNK - 1) // D_CHUNK
    # Head blocks of one query are neighbours in launch order: they gather the same rows.
    num_hb = tl.cdiv(h_q, BLOCK_H)
    pid = tl.program_id(0)
    qi = (pid // num_hb).to(tl.int64)
    offs_h = (pid % num_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < h_q
    offs_c = tl.arange(0, D_CHUNK)
    offs_t = tl.arange(0, BLOCK_DT)
    t_mask = offs_t < D_TAIL
    act_dtype = q_ptr.dtype.element_ty

    # q and the accumulator live as D_CHUNK-wide column chunks (a tuple): the key tile is
    # gathered, dequantized and handed to the GEMMs one chunk at a time.
    q_rows = q_ptr + qi * stride_qs + offs_h[:, None] * stride_qh
    q_chunks = ()
    acc = ()
    for c in tl.static_range(N_CHUNK):
        cm = c * D_CHUNK + offs_c < D_V
        q_c = tl.load(q_rows + c * D_CHUNK + offs_c[None, :], mask=h_mask[:, None] & cm[None, :],
                      other=0.0)
        q_chunks = q_chunks + (q_c.to(DOT_DTYPE),)  # type: ignore[assignment]
        acc = acc + (tl.zeros([BLOCK_H, D_CHUNK], tl.float32),)  # type: ignore[assignment]
    q_pe = tl.load(q_rows + D_V + offs_t[None, :], mask=h_mask[:, None] & t_mask[None, :],
                   other=0.0).to(DOT_DTYPE)

    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of scaled logits, base 2
    l_i = tl.zeros([BLOCK_H], tl.float32)
    # Triton 3.6's interpreter cannot take a runtime loop bound under numpy >= 2.4; there the
    # loop runs to topk and the `cols < n_cols` mask drops the rest.
    idx_rows = idx_ptr + qi * stride_is + tl.arange(0, BLOCK_K)
    for start in tl.range(0, STATIC_TOPK if STATIC_TOPK > 0 else n_cols, BLOCK_K):
        idx = tl.load(idx_rows + start, mask=start + tl.arange(0, BLOCK_K) < n_cols, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv_ptr + tl.where(valid, idx, 0).to(tl.int64) * stride_kv     # [BLOCK_K]
        if PREFETCH:
            prefetch_ahead(kv_ptr, idx_rows, start, n_cols, s_kv, stride_kv, BLOCK_K, ROW_BYTES)
        # Scores transposed, keys on the GEMM's M: s^T = K · q^T, [BLOCK_K, BLOCK_H]. With
        # 128-key tiles each warpgroup scores its own 64 keys for all heads, so no score is
        # computed twice (with heads on M, Triton would give both warpgroups the whole tile).
        k_chunks = ()
        st = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
        for c in tl.static_range(N_CHUNK):
            cm = c * D_CHUNK + offs_c < D_V
            if KV_FP8:
                # Row bytes: [0, D_V) e4m3 | D_V / 128 float32 tile scales | D_TAIL bf16 (RoPE);
                # a chunk lies within one 128-byte scale tile.
                k8 = tl.load(rows[:, None] + c * D_CHUNK + offs_c[None, :], mask=valid[:, None],
                             other=0)
                sc = tl.load((rows + D_V).to(tl.pointer_type(tl.float32)) + c * D_CHUNK // 128,
                             mask=valid, other=0.0)
                k_f32 = k8.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc[:, None]
                k_c = round_rne(k_f32, act_dtype)
            else:
                k_c = tl.load(rows[:, None] + c * D_CHUNK + offs_c[None, :],
                              mask=valid[:, None] & cm[None, :], other=0.0)
            k_c = k_c.to(DOT_DTYPE)
            k_chunks = k_chunks + (k_c,)  # type: ignore[assignment]
            st = tl.dot(k_c, tl.trans(q_chunks[c]), st, input_precision=PRECISION)
        if D_TAIL > 0:
            if KV_FP8:
                pe_ptr = (rows + D_V + 4 * (D_V // 128)).to(tl.pointer_type(tl.bfloat16))
            else:
                pe_ptr = rows + D_V
            k_pe = tl.load(pe_ptr[:, None] + offs_t[None, :],
                           mask=valid[:, None] & t_mask[None, :], other=0.0)
            st = tl.dot(k_pe.to(act_dtype).to(DOT_DTYPE), tl.trans(q_pe), st,
                        input_precision=PRECISION)
        pt, alpha, m_new, l_i = online_softmax_t(st, valid, m_i, l_i, scale_log2)
        # P is rounded to the cache dtype for the value GEMM, as FlashMLA does; P·V takes
        # P from shared memory, each warpgroup a half of every value chunk over all keys.
        p = tl.trans(round_rne(pt, act_dtype).to(DOT_DTYPE))  # [BLOCK_H, BLOCK_K]
        new_acc = ()
        for c in tl.static_range(N_CHUNK):
            new_acc = new_acc + (tl.dot(p, k_chunks[c], acc[c] * alpha[:, None],  # type: ignore[assignment]
                                        input_precision=PRECISION),)
        acc = new_acc
        m_i = m_new

    denom = softmax_denominator(l_i, m_i, sink_ptr, offs_h, h_mask, HAS_SINK)
    out_rows = out_ptr + qi * stride_os + offs_h[:, None] * stride_oh
    for c in tl.static_range(N_CHUNK):
        cm = c * D_CHUNK + offs_c < D_V
        out = round_rne(acc[c] / denom[:, None], out_ptr.dtype.element_ty)
        tl.store(out_rows + c * D_CHUNK + offs_c[None, :], out, mask=h_mask[:, None] & cm[None, :])
    store_max_lse(max_ptr, lse_ptr, qi, h_q, offs_h, h_mask, m_i, l_i)


def _check_kernel_inputs(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float) -> None:
    if q.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"q must be bfloat16 or float32, got {q.dtype}")
    if not (math.isfinite(sm_scale) and sm_scale > 0):
        # The kernels take the row max of the unscaled scores (the scale folded into the
        # exponent's FMA): the max of the scaled ones only for a positive scale.
        raise ValueError(f"sm_scale={sm_scale} must be finite and positive (a softmax scale)")
    if kv.device != q.device or indices.device != q.device:
        raise ValueError(
            f"q, kv and indices must be on one device, got {q.device}, {kv.device}, "
            f"{indices.device}"
        )
    if q.stride(-1) != 1 or kv.stride(-1) != 1 or indices.stride(-1) != 1:
        raise ValueError("q, kv and indices need a contiguous last dim; call .contiguous()")


def _launch(q, kv_rows, stride_kv, s_kv, indices, sm_scale, d_v, attn_sink, topk_length, fp8):
    why_not = _gluon_unsuitable(q, kv_rows, stride_kv, indices, d_v, fp8)
    if why_not is None:
        from glm_dsa.kernels.sparse_mla_gluon import flash_mla_sparse_fwd_gluon

        _log_once(f"sparse MLA: Gluon sm_90 kernel, {'FP8' if fp8 else 'bf16'} rows "
                  f"(triton {triton.__version__})")
        return flash_mla_sparse_fwd_gluon(q, kv_rows, stride_kv, s_kv, indices, sm_scale,
                                          attn_sink, topk_length, fp8=fp8)
    _log_once(f"sparse MLA: Triton kernel ({why_not})")
    return _launch_triton(q, kv_rows, stride_kv, s_kv, indices, sm_scale, d_v, attn_sink,
                          topk_length, fp8)


def _launch_triton(q, kv_rows, stride_kv, s_kv, indices, sm_scale, d_v, attn_sink, topk_length,
                   fp8):
    s_q, h_q, d_qk = q.shape
    topk = indices.shape[2]
    d_tail = d_qk - d_v
    out, max_logits, lse, sink, lengths, idx = launch_buffers(q, d_v, indices, attn_sink,
                                                              topk_length)
    if s_q == 0:
        return out, max_logits, lse
    row_bytes = kv_rows.shape[-1] * kv_rows.element_size()
    grid = lambda meta: (s_q * triton.cdiv(h_q, meta["BLOCK_H"]),)  # noqa: E731
    _sparse_mla_fwd_kernel[grid](
        q, kv_rows, idx, out, max_logits, lse,
        sink if sink is not None else max_logits, lengths if lengths is not None else idx,
        s_kv, h_q, topk, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), stride_kv, idx.stride(0), out.stride(0), out.stride(1),
        D_V=d_v, D_TAIL=d_tail, KV_FP8=fp8, HAS_SINK=sink is not None,
        HAS_LEN=lengths is not None,
        **launch_flags(_INTERPRET, q.dtype, topk, d_tail, row_bytes,
                       (9, 0) if _INTERPRET else torch.cuda.get_device_capability(q.device)),
    )
    return out, max_logits, lse


def launch_flags(interpret: bool, q_dtype: torch.dtype, topk: int, d_tail: int,
                 row_bytes: int, capability: tuple[int, int] = (9, 0)) -> dict:
    """The Triton kernel's compile-time choices that depend on where it runs: under the
    interpreter or not, on a GPU of compute ``capability``, for ``q_dtype`` queries over
    ``topk`` indices, ``d_tail`` score-only columns and rows of ``row_bytes`` bytes."""
    return dict(
        BLOCK_DT=max(16, triton.next_power_of_2(d_tail)),
        # Triton 3.6's interpreter multiplies bf16 as raw integers: there the GEMMs take the
        # (exact) float32 upcast of the bf16 operands. On the GPU the cast is a no-op.
        DOT_DTYPE=tl.float32 if interpret or q_dtype == torch.float32 else tl.bfloat16,
        PRECISION="ieee" if q_dtype == torch.float32 else "tf32",
        STATIC_TOPK=topk if interpret else 0,
        # The interpreter has no PTX; prefetching changes no value. The bulk prefetch takes
        # 16-byte aligned rows of a multiple of 16 bytes (656-byte FP8 rows are; the 164-byte rows
        # of a 128 + 16 latent are not, and faulted with a misaligned address on the H200). It is
        # an sm_90 instruction: ptxas refuses it for sm_80.
        PREFETCH=not interpret and capability >= (9, 0) and row_bytes % 16 == 0,
        ROW_BYTES=row_bytes,
    )


def flash_mla_sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashMLA ``flash_mla_sparse_fwd`` (newest conventions) on a bf16 or float32 cache.

    ``P = (q · kv[idx]) * sm_scale`` over the valid indices of each row; ``out = softmax(P)
    @ kv[idx, :d_v]`` normalised by ``logaddexp(lse, attn_sink)`` when a sink is given.
    For a paged bf16 pool ``[num_pages, page_size, 576]`` pass ``pool.view(-1, 1, 576)`` and
    slot numbers as ``indices`` (``page_table[req, i // page_size] * page_size + i %
    page_size``): the kernel reads the selected rows straight from the pool.

    Args:
        q: ``[s_q, h_q, d_qk]`` bfloat16 (float32 for small-config tests; GEMMs then in
            IEEE float32). GLM-5.3: h_q 64, d_qk 576 = 512 latent + 64 RoPE.
        kv: ``[s_kv, 1, d_qk]`` bfloat16 or float32, cast to q's dtype for the GEMMs; values
            are ``kv[..., :d_v]``. Any row stride; the last dim contiguous.
        indices: int32 ``[s_q, 1, topk]`` rows of kv; ``< 0`` or ``>= s_kv`` are skipped.
        sm_scale: softmax scale of ``q · kv`` (the MLA scale, not ``d_qk**-0.5``).
        d_v: value width (512); ``d_qk - d_v`` trailing dims take part in scores only.
        attn_sink: optional float ``[h_q]`` logit of a value-less key per head.
        topk_length: optional int32 ``[s_q]``: row r uses its first ``topk_length[r]`` columns.

    Returns:
        ``(out [s_q, h_q, d_v]`` in q's dtype, ``max_logits [s_q, h_q]`` float32,
        ``lse [s_q, h_q]`` float32, natural log``)``. A row with no valid index: ``out = 0``,
        ``max_logits = -inf``, ``lse = +inf``.
    """
    check_sparse_inputs(q, kv, indices, d_v, attn_sink, topk_length)
    _check_kernel_inputs(q, kv, indices, sm_scale)
    if kv.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(
            f"kv must be bfloat16 or float32, got {kv.dtype}; for the FP8 pool use "
            "sparse_mla_fwd_fp8"
        )
    if kv.dtype != q.dtype:
        raise ValueError(f"q ({q.dtype}) and kv ({kv.dtype}) must share a dtype")
    return _launch(q, kv, kv.stride(0), kv.shape[0], indices, sm_scale, d_v, attn_sink,
                   topk_length, fp8=False)


def sparse_mla_fwd_fp8(
    q: Tensor,
    kv_rows: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """``flash_mla_sparse_fwd`` reading FlashMLA's FP8 ``V32_FP8Sparse`` rows from the pool.

    Row layout (``kv_format.mla_kv_quantize``): ``d_v`` e4m3 bytes in tiles of 128, then
    ``d_v / 128`` float32 tile scales, then ``d_qk - d_v`` bf16 RoPE values (656 bytes for
    512 + 64). The kernel dequantizes each gathered row as ``e4m3 * scale`` in float32, rounded
    once to q's dtype, so the result is the plain kernel on ``oracle.dequantize_k_cache`` rows.

    Args:
        q: ``[s_q, h_q, d_qk]`` bfloat16 (or float32).
        kv_rows: ``[num_slots, row_bytes]`` uint8 (or float8_e4m3fn / int8 bytes): the paged
            pool ``[num_pages, page_size, 656]`` viewed as ``[-1, 656]``.
        indices: int32 ``[s_q, 1, topk]`` global slot numbers (``page * page_size + offset``);
            ``-1`` padding; any slot outside ``[0, num_slots)`` is skipped.
        sm_scale, d_v, attn_sink, topk_length: as ``flash_mla_sparse_fwd``; ``d_v`` is the
            latent rank ``R`` of the rows (``R / 128`` a power of two).

    Returns:
        As ``flash_mla_sparse_fwd``.
    """
    if kv_rows.dtype in (torch.int8, torch.float8_e4m3fn):
        kv_rows = kv_rows.view(torch.uint8)
    if kv_rows.dtype != torch.uint8 or kv_rows.dim() != 2:
        raise ValueError(
            f"kv_rows must be uint8 [num_slots, row_bytes] (the pool viewed as [-1, 656]), got "
            f"{kv_rows.dtype} {tuple(kv_rows.shape)}"
        )
    if q.dim() != 3:
        raise ValueError(f"q must be [s_q, h, d_qk], got shape {tuple(q.shape)}")
    d_qk = q.shape[2]
    tiles = d_v // MLA_TILE
    if d_v % MLA_TILE or tiles & (tiles - 1) or not 0 < d_v < d_qk:
        raise ValueError(
            f"d_v={d_v} must be 128 times a power of two and below d_qk={d_qk} for FP8 rows"
        )
    row_bytes = mla_kv_row_bytes(d_v, d_qk - d_v, "fp8")
    if kv_rows.shape[1] != row_bytes or kv_rows.stride(0) % 4:
        raise ValueError(
            f"kv_rows must have {row_bytes} bytes per row (d_v={d_v}, rope {d_qk - d_v}) at a "
            f"row stride that is a multiple of 4, got {tuple(kv_rows.shape)} stride "
            f"{kv_rows.stride()}"
        )
    # The rows' layout is checked above; the shared contract checks the rest.
    check_sparse_inputs(q, None, indices, d_v, attn_sink, topk_length)
    _check_kernel_inputs(q, kv_rows, indices, sm_scale)
    return _launch(q, kv_rows, kv_rows.stride(0), kv_rows.shape[0], indices, sm_scale, d_v,
                   attn_sink, topk_length, fp8=True)
