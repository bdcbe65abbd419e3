"""FP8-query × FP8-KV sparse MLA prefill (SGLang's Q8KV8) in Triton, with the sm_90 Gluon dispatch.

The contract is ``glm_dsa.oracle.sparse_mla_q8kv8_prefill_fwd``: e4m3 ``q [s_q, h_q, d_qk]`` and
``kv [s_kv, 1, d_qk]`` (576-byte rows, the RoPE dims quantized with the rest) with one float32
scale each, read in the kernel from one-element device tensors (no host sync, so a step that
computes them on the device can be captured in a CUDA graph).

The Triton kernel is ``kernels.sparse_mla``'s schedule (one program per query token and
``BLOCK_H`` heads, keys on the score GEMM's M, online base-2 softmax, the next tile's rows
prefetched into L2) with both products in FP8: ``s^T = K · q^T`` on the e4m3 payloads with
float32 accumulation (exact: a product of two e4m3 values fits float32's mantissa, and the sums
are float32's), then scaled once by ``sm_scale · q_scale · kv_scale · log2(e)``; the softmax
weights ``exp2(s - m)`` are rounded to e4m3 (to nearest even) for ``P · V`` on the e4m3 values,
as SGLang's kernel does, and the output is multiplied by ``kv_scale`` at the end. The row sum
``l`` adds the unrounded float32 weights. That rounding is what ``Q8KV8_OUT_TOL`` allows for.

Triton 3.6's interpreter multiplies e4m3 operands exactly (float32 products of the decoded
values; checked against ``q.float() @ k.float()``), so the CPU interpreter runs the same FP8
dots; only its float32 -> e4m3 cast misrounds some values (even with ``rtne``), so there the
softmax weights are rounded on their bits first. GPUs before sm_89 have no e4m3 type and no
FP8 MMA: there the kernel reads the bytes, decodes them to fp16 (exact) and rounds the weights
on their bits, for the same products.

On an sm_90 GPU with a Triton in ``sparse_mla.GLUON_TESTED_TRITON``, calls at GLM-5.3's shape
(``h_q`` a multiple of 64, ``d_qk`` 576, ``d_v`` 512, 16-byte aligned rows) run the Gluon kernel
``kernels.sparse_mla_q8kv8_gluon.sparse_mla_q8kv8_fwd_gluon``; every other call runs the Triton
kernel here. The choice is logged once per reason (logger ``glm_dsa.kernels``).
"""

from __future__ import annotations

import importlib.util
import logging
import math
import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from glm_dsa.kernels.launch import launch_buffers
from glm_dsa.kernels.numerics import round_rne
from glm_dsa.kernels.sparse_mla import (
    DeviceFacts,
    device_refusal,
    online_softmax_t,
    prefetch_ahead,
    row_length,
    softmax_denominator,
    store_max_lse,
)
from glm_dsa.validate import check_q8kv8_scales, check_sparse_inputs, need, shape_of

__all__ = ["sparse_mla_q8kv8_prefill_fwd", "q8kv8_shape_refusal"]

_LOG2E = math.log2(math.e)
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_GLUON_MODULE = "glm_dsa.kernels.sparse_mla_q8kv8_gluon"
_log = logging.getLogger("glm_dsa.kernels")
_LOGGED: set[str] = set()

# As sparse_mla's tiling, for the GPUs that do not take the Gluon kernel. The e4m3 key tile is
# half the bf16 one (q 36 KB + 128 keys 72 KB), and the P·V product needs at least 32 keys
# (an 8-bit MMA's K). Offline sm_90 compiles (triton 3.6, ptxas -v; no GPU): 255 registers
# and a spill stack of 80 / 112 bytes for the 64-head tiles at chunk 128 / 64 (116 / 110 KB
# shared memory), 16 / 400 bytes for the 16-head tiles of 32 / 64 keys. 64-key tiles of 64
# heads on 4 warps spilled 936 bytes (the float32 accumulator alone is 256 registers a thread).
_GPU_CONFIGS = [
    triton.Config({"BLOCK_H": bh, "BLOCK_K": bk, "D_CHUNK": dc}, num_warps=w, num_stages=1)
    for bh, bk, dc, w in (
        (64, 128, 128, 8),
        (64, 128, 64, 8),
        (16, 32, 64, 4),  # small configs (h_q <= 16) only
        (16, 64, 64, 4),
    )
]
_INTERPRET_CONFIGS = [
    triton.Config({"BLOCK_H": 16, "BLOCK_K": 16, "D_CHUNK": 64}, num_warps=4, num_stages=1)
]


@triton.jit
def _operand(x, FP8_NATIVE: tl.constexpr, WIDE: tl.constexpr):
    """A GEMM operand from loaded e4m3 values: as they are, or (bytes, before sm_89) decoded to
    ``WIDE`` (fp16, which holds every e4m3 value exactly; NaN codes aside: the quantizers clamp)."""
    if FP8_NATIVE:
        y = x
    else:
        b = x.to(tl.int32)
        e = (b >> 3) & 15
        m = (b & 7).to(tl.float32)
        # (8 + m) * 2^(e - 10) for normals, the power of two built from its bits; m * 2^-9 below.
        mag = tl.where(e == 0, m * 0.001953125,
                       (8.0 + m) * ((e + 117) << 23).to(tl.float32, bitcast=True))
        y = tl.where((b & 128) != 0, -mag, mag).to(WIDE)
    return y


@triton.jit
def _e4m3_grid(p):
    """Float32 ``p`` in [0, 1] rounded to the nearest e4m3 value (ties to even), still float32:
    3 mantissa bits for normals (>= 2^-6), multiples of 2^-9 below (rounded by adding and
    removing 1.5 * 2^23)."""
    bits = p.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    tiny = ((p * 512.0 + 12582912.0) - 12582912.0) * 0.001953125
    return tl.where(p < 0.015625, tiny, normal)


@triton.jit
def _round_e4m3(p, FP8_NATIVE: tl.constexpr, WIDE: tl.constexpr, INTERPRET: tl.constexpr):
    """Softmax weights ``p`` in [0, 1] rounded to e4m3, to nearest even, as a GEMM operand: the
    GPU's ``cvt.rn``; before sm_89 (no e4m3 type) and in the interpreter (whose float32 -> e4m3
    cast misrounds some values; it casts e4m3 values exactly) spelled out, ``_e4m3_grid``."""
    if FP8_NATIVE and not INTERPRET:
        y = p.to(tl.float8e4nv, fp_downcast_rounding="rtne")
    elif FP8_NATIVE:
        y = _e4m3_grid(p).to(tl.float8e4nv)
    else:
        y = _e4m3_grid(p).to(WIDE)
    return y


def _log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        _log.info(message)


def _prune_configs(configs, named_args, **kwargs):
    """Keep the configs whose head block suits h_q: 16 for h_q <= 16, else 64."""
    wanted = 16 if named_args["h_q"] <= 16 else 64
    return [c for c in configs if c.kwargs["BLOCK_H"] == wanted] or configs


@triton.autotune(
    configs=_INTERPRET_CONFIGS if _INTERPRET else _GPU_CONFIGS,
    key=["h_q", "topk", "D_V", "D_TAIL", "HAS_LEN"],
    prune_configs_by={"early_config_prune": _prune_configs},
    cache_results=True,
)
@triton.jit
def _sparse_mla_q8kv8_kernel(
    q_ptr, kv_ptr, idx_ptr, out_ptr, max_ptr, lse_ptr, sink_ptr, len_ptr, q_scale_ptr,
    kv_scale_ptr, s_kv, h_q, topk, sm_scale_log2,
    stride_qs, stride_qh, stride_kv, stride_is, stride_os, stride_oh,
    D_V: tl.constexpr, D_TAIL: tl.constexpr, BLOCK_DT: tl.constexpr,
    HAS_SINK: tl.constexpr, HAS_LEN: tl.constexpr, STATIC_TOPK: tl.constexpr,
    PREFETCH: tl.constexpr, ROW_BYTES: tl.constexpr, FP8_NATIVE: tl.constexpr, WIDE: tl.constexpr,
    INTERPRET: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, D_CHUNK: tl.constexpr,
):
    N_CHUNK: tl.constexpr = (D_V + D_CHUNK - 1) // D_CHUNK
    num_hb = tl.cdiv(h_q, BLOCK_H)
    pid = tl.program_id(0)
    qi = (pid // num_hb).to(tl.int64)
    offs_h = (pid % num_hb) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_mask = offs_h < h_q
    offs_c = tl.arange(0, D_CHUNK)
    offs_t = tl.arange(0, BLOCK_DT)
    t_mask = offs_t < D_TAIL
    kv_scale = tl.load(kv_scale_ptr)
    # One factor takes the e4m3 scores to base-2 logits: sm_scale, both tensor scales, log2(e).
    score_scale = sm_scale_log2 * tl.load(q_scale_ptr) * kv_scale

    q_rows = q_ptr + qi * stride_qs + offs_h[:, None] * stride_qh
    q_chunks = ()
    acc = ()
    for c in tl.static_range(N_CHUNK):
        cm = c * D_CHUNK + offs_c < D_V
        q_c = tl.load(q_rows + c * D_CHUNK + offs_c[None, :], mask=h_mask[:, None] & cm[None, :],
                      other=0.0)
        q_chunks = q_chunks + (_operand(q_c, FP8_NATIVE, WIDE),)  # type: ignore[assignment]
        acc = acc + (tl.zeros([BLOCK_H, D_CHUNK], tl.float32),)  # type: ignore[assignment]
    q_pe = _operand(tl.load(q_rows + D_V + offs_t[None, :],
                            mask=h_mask[:, None] & t_mask[None, :], other=0.0), FP8_NATIVE, WIDE)

    n_cols = row_length(len_ptr, qi, topk, HAS_LEN)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)  # running max of base-2 logits
    l_i = tl.zeros([BLOCK_H], tl.float32)
    idx_rows = idx_ptr + qi * stride_is + tl.arange(0, BLOCK_K)
    for start in tl.range(0, STATIC_TOPK if STATIC_TOPK > 0 else n_cols, BLOCK_K):
        idx = tl.load(idx_rows + start, mask=start + tl.arange(0, BLOCK_K) < n_cols, other=-1)
        valid = (idx >= 0) & (idx < s_kv)
        rows = kv_ptr + tl.where(valid, idx, 0).to(tl.int64) * stride_kv     # [BLOCK_K]
        if PREFETCH:
            prefetch_ahead(kv_ptr, idx_rows, start, n_cols, s_kv, stride_kv, BLOCK_K, ROW_BYTES)
        k_chunks = ()
        st = tl.zeros([BLOCK_K, BLOCK_H], tl.float32)
        for c in tl.static_range(N_CHUNK):
            cm = c * D_CHUNK + offs_c < D_V
            k_c = _operand(tl.load(rows[:, None] + c * D_CHUNK + offs_c[None, :],
                                   mask=valid[:, None] & cm[None, :], other=0.0), FP8_NATIVE, WIDE)
            k_chunks = k_chunks + (k_c,)  # type: ignore[assignment]
            st = tl.dot(k_c, tl.trans(q_chunks[c]), st)
        if D_TAIL > 0:
            k_pe = tl.load(rows[:, None] + D_V + offs_t[None, :],
                           mask=valid[:, None] & t_mask[None, :], other=0.0)
            st = tl.dot(_operand(k_pe, FP8_NATIVE, WIDE), tl.trans(q_pe), st)
        pt, alpha, m_new, l_i = online_softmax_t(st, valid, m_i, l_i, score_scale)
        # Weights in [0, 1] to e4m3 for the second FP8 GEMM (SGLang's kernel does the same).
        p = tl.trans(_round_e4m3(pt, FP8_NATIVE, WIDE, INTERPRET))                    # [BLOCK_H, BLOCK_K]
        new_acc = ()
        for c in tl.static_range(N_CHUNK):
            new_acc = new_acc + (tl.dot(p, k_chunks[c], acc[c] * alpha[:, None]),)  # type: ignore[assignment]
        acc = new_acc
        m_i = m_new

    denom = softmax_denominator(l_i, m_i, sink_ptr, offs_h, h_mask, HAS_SINK)
    out_rows = out_ptr + qi * stride_os + offs_h[:, None] * stride_oh
    for c in tl.static_range(N_CHUNK):
        cm = c * D_CHUNK + offs_c < D_V
        out = round_rne(acc[c] * (kv_scale / denom)[:, None], out_ptr.dtype.element_ty)
        tl.store(out_rows + c * D_CHUNK + offs_c[None, :], out, mask=h_mask[:, None] & cm[None, :])
    store_max_lse(max_ptr, lse_ptr, qi, h_q, offs_h, h_mask, m_i, l_i)


def q8kv8_shape_refusal(h_q: int, d_qk: int, d_v: int) -> str | None:
    """Why Q8KV8 attention of ``h_q`` heads and ``d_qk`` / ``d_v`` dims cannot take the Gluon
    kernel, whatever its device and layout (None when it can)."""
    if h_q % 64 or d_qk != 576 or d_v != 512:
        return (f"h_q {h_q}, d_qk {d_qk}, d_v {d_v} (the Q8KV8 Gluon kernel: h_q % 64 == 0, "
                "576 / 512)")
    return None


def _gluon_unsuitable(q: Tensor, kv: Tensor, d_v: int) -> str | None:
    """Why this checked call cannot take the Gluon kernel (None when it can): the device,
    the shape, the module, the layout."""
    why = device_refusal(DeviceFacts.of(q.device)) or q8kv8_shape_refusal(q.shape[1], q.shape[2],
                                                                           d_v)
    if why:
        return why
    if importlib.util.find_spec(_GLUON_MODULE) is None:
        return f"no module {_GLUON_MODULE}"
    # 16-byte cp.async: e4m3 strides are bytes.
    if not q.is_contiguous() or kv.stride(0) % 16 or q.data_ptr() % 16 or kv.data_ptr() % 16:
        return f"q not contiguous or kv rows not 16-byte aligned (stride {kv.stride(0)})"
    return None


def _check_inputs(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink,
                  topk_length) -> None:
    for name, t in (("q", q), ("kv", kv)):
        need(isinstance(t, Tensor) and t.dtype == torch.float8_e4m3fn,
             f"{name} must be float8_e4m3fn (quantize it with glm_dsa.fp8.per_tensor_quant), got "
             f"{getattr(t, 'dtype', None)} {shape_of(t)}")
    check_sparse_inputs(q, kv, indices, d_v, attn_sink, topk_length)
    check_q8kv8_scales(q_scale, kv_scale, attn_sink, topk_length, (torch.float32,))
    need(math.isfinite(sm_scale), f"sm_scale={sm_scale} must be finite")
    tensors = [t for t in (kv, indices, q_scale, kv_scale, attn_sink, topk_length) if t is not None]
    need(all(t.device == q.device for t in tensors),
         f"q, kv, indices, the scales, attn_sink and topk_length must be on one device (q on "
         f"{q.device}); move them with .to(q.device)")
    need(q.stride(-1) == 1 and kv.stride(-1) == 1 and indices.stride(-1) == 1,
         "q, kv and indices need a contiguous last dim; call .contiguous()")


def _launch_triton(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length):
    s_q, h_q, d_qk = q.shape
    topk = indices.shape[2]
    d_tail = d_qk - d_v
    out, max_logits, lse, sink, lengths, idx = launch_buffers(q, d_v, indices, attn_sink,
                                                              topk_length)
    out = torch.empty(out.shape, dtype=torch.bfloat16, device=q.device)
    if s_q == 0:
        return out, max_logits, lse
    row_bytes = kv.shape[-1]
    native = _fp8_native(q.device)
    if not native:  # e4m3 bytes, decoded in the kernel
        q, kv = q.view(torch.uint8), kv.view(torch.uint8)
    grid = lambda meta: (s_q * triton.cdiv(h_q, meta["BLOCK_H"]),)  # noqa: E731
    _sparse_mla_q8kv8_kernel[grid](
        q, kv, idx, out, max_logits, lse,
        sink if sink is not None else max_logits, lengths if lengths is not None else idx,
        q_scale, kv_scale, kv.shape[0], h_q, topk, sm_scale * _LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), idx.stride(0), out.stride(0), out.stride(1),
        D_V=d_v, D_TAIL=d_tail,
        # An 8-bit MMA's K is 32 at least: the RoPE tail is padded to it (masked loads).
        BLOCK_DT=max(32, triton.next_power_of_2(d_tail)),
        HAS_SINK=sink is not None, HAS_LEN=lengths is not None,
        # Triton 3.6's interpreter cannot take a runtime loop bound under numpy >= 2.4.
        STATIC_TOPK=topk if _INTERPRET else 0,
        # The L2 bulk prefetch is sm_90's (16-byte aligned rows of a multiple of 16 bytes).
        PREFETCH=(not _INTERPRET and row_bytes % 16 == 0 and kv.stride(0) % 16 == 0
                  and torch.cuda.get_device_capability(q.device) >= (9, 0)),
        ROW_BYTES=row_bytes, FP8_NATIVE=native,
        # The byte path's products in fp16 (exact, float32 sums); the interpreter's fp16 dot
        # sums in fp16, so there (where the byte path is only tested) float32, exact as well.
        WIDE=tl.float32 if _INTERPRET else tl.float16, INTERPRET=_INTERPRET,
    )
    return out, max_logits, lse


def _fp8_native(device: torch.device) -> bool:
    """Whether Triton takes e4m3 tensors here: sm_89 and later, and the interpreter. Before
    sm_89 (no e4m3 type, no FP8 MMA) the kernel reads the bytes and multiplies in fp16."""
    return _INTERPRET or device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)


def sparse_mla_q8kv8_prefill_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    q_scale: Tensor,
    kv_scale: Tensor,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """SGLang's ``sparse_mla_q8kv8_prefill_fwd``: sparse MLA prefill on e4m3 q and kv.

    ``P = (q · kv[idx]) * q_scale * kv_scale * sm_scale`` over the valid indices of each row;
    ``out = softmax(P) @ kv[idx, :d_v] * kv_scale`` with the softmax weights in e4m3,
    normalised by ``logaddexp(lse, attn_sink)`` when a sink is given.

    Args:
        q: float8_e4m3fn ``[s_q, h_q, d_qk]`` (GLM-5.3: h_q 64, d_qk 576; 512 without RoPE).
        kv: float8_e4m3fn ``[s_kv, 1, d_qk]``, any row stride; values are ``kv[..., :d_v]``.
        indices: int32 ``[s_q, 1, topk]`` rows of kv; ``< 0`` or ``>= s_kv`` are skipped.
        sm_scale: softmax scale of the dequantized scores (the MLA scale).
        q_scale, kv_scale: float32 one-element tensors on q's device: the values are
            ``q.float() * q_scale`` and ``kv.float() * kv_scale``.
        d_v: value width (512).
        attn_sink: float ``[h_q]`` and topk_length: int32 ``[s_q]``, both or neither.

    Returns:
        ``(out [s_q, h_q, d_v]`` bfloat16, ``max_logits [s_q, h_q]`` float32, ``lse [s_q, h_q]``
        float32, natural log``)``. A row with no valid index: ``out = 0``, ``max_logits =
        -inf``, ``lse = +inf``.
    """
    _check_inputs(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink, topk_length)
    why_not = _gluon_unsuitable(q, kv, d_v)
    if why_not is None:
        from glm_dsa.kernels.sparse_mla_q8kv8_gluon import sparse_mla_q8kv8_fwd_gluon

        _log_once(f"Q8KV8 sparse MLA: Gluon sm_90 kernel (triton {triton.__version__})")
        return sparse_mla_q8kv8_fwd_gluon(q, kv[:, 0], kv.stride(0), kv.shape[0], indices,
                                          sm_scale, q_scale, kv_scale, attn_sink, topk_length)
    _log_once(f"Q8KV8 sparse MLA: Triton kernel ({why_not})")
    return _launch_triton(q, kv, indices, sm_scale, q_scale, kv_scale, d_v, attn_sink,
                          topk_length)
