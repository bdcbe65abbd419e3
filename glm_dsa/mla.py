"""Multi-head latent attention (MLA): the absorbed sparse form and the expanded one-shot form.

Keys and values of MLA live in a per-token latent row ``[c | k_pe]`` (``kv_lora_rank +
qk_rope_head_dim`` = 576 for GLM-5.3). Two equivalent ways to attend over it:

* **Absorbed** (what FlashMLA's sparse kernels run): fold ``W_UK`` into the query,
  ``q_abs = q_nope @ W_UK`` ``[n, H, kv_lora]``, attend with the 576-dim query ``[q_abs | q_pe]``
  over the selected latent rows with a single shared KV head, take the first ``kv_lora`` dims of
  the same rows as values, and unfold ``W_UV`` after the softmax. ``kv_b_proj`` never runs.
* **Expanded** (the MHA one-shot prefill): ``k_nope, v = kv_b_proj(c)`` per head, ``k = [k_nope |
  k_pe]``, plain causal multi-head attention. Used when the longest context of the batch is short
  (``dense_attn_kv_len_threshold``), where the top-k covers every key anyway.

``kv_b_proj.weight`` ``[H * (nope + v), kv_lora]`` viewed as ``[H, nope + v, kv_lora]`` gives
``W_UK = [:, :nope]`` and ``W_UV = [:, nope:]``. Both forms compute the same function; the
tests prove it against an independent dense attention.

Precision: attention math runs in ``torch.promote_types(dtype, float32)`` of its inputs (float32
for bf16/fp32, float64 for float64), matching FlashMLA's float32 accumulation and letting float64
tests reach ~1e-12. On CUDA the products with bf16 operands (cache rows, bf16 weights) run on
bf16 tensor cores with float32 output, a float32 operand split exactly into three bf16 parts
(``split_bf16x3``), so they keep float32 accuracy at tensor-core speed.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

from glm_dsa import invariant
from glm_dsa.batch import ForwardBatch
from glm_dsa.budget import attention_rows, rows_within
from glm_dsa.config import DSAConfig
from glm_dsa.indexer import Indexer
from glm_dsa.invariant import BATCH_TILE, batch_tiled
from glm_dsa.norm import RMSNorm
from glm_dsa.rope import apply_rope, rope_cos_sin
from glm_dsa.validate import check_sparse_conventions, check_sparse_inputs, need

__all__ = ["sparse_mla_fwd", "dense_causal_mha", "MLAProjection", "MLA"]

_LOG2E = math.log2(math.e)

# Largest score temporary of one dense_causal_mha chunk, in bytes. The MHA path only runs for
# contexts of ≤ 2048 tokens, so this bounds a chunk at a few hundred query rows for 64 heads
# while keeping the per-chunk GEMMs large.
_DENSE_SCORE_BYTES = 1 << 28


def _compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    out = torch.float32
    for d in dtypes:
        out = torch.promote_types(out, d)
    return out


def split_bf16x3(a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """float32 ``a`` → bf16 ``(a1, a2, a3)`` with ``a1 + a2 + a3 == a`` exactly.

    ``a1`` is ``a`` rounded to bf16's 8 significant bits, ``a2`` the rounded remainder, ``a3``
    what is left: 3 × 8 bits hold float32's 24 (round-to-nearest leaves each remainder within
    half a unit of the previous part, so nothing is lost), and bf16 has float32's exponent
    range. Exact unless a remainder falls below bf16's normal range (|a| < 2**-110 or so).
    """
    if a.dtype != torch.float32:
        raise ValueError(f"split_bf16x3 takes float32, got {a.dtype}")
    a1 = a.to(torch.bfloat16)
    # Mixed float32 - bf16 arithmetic promotes in the kernel: no float32 copies of the parts.
    rest = a - a1
    a2 = rest.to(torch.bfloat16)
    a3 = rest.sub_(a2).to(torch.bfloat16)
    return a1, a2, a3


def _bmm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` (batched) accumulated in float32 or wider, as a float32 GEMM of the values would.

    ``a``: ``[batch, m, k]`` bf16, float32 or float64; ``b``: ``[batch, k, n]``. The result is in
    ``promote_types(a, b, float32)``. On CUDA, for bf16 ``b`` and bf16 or float32 ``a``, it runs
    on bf16 tensor cores with float32 output: a float32 ``a`` is split exactly into three bf16
    parts (``split_bf16x3``) whose products are summed. A product of two bf16 values is exact in
    float32, so the result is the float32 GEMM's up to summation order, not a bf16 GEMM's
    (which would round ``a``). Elsewhere it is a plain GEMM in the promoted dtype.
    """
    cdt = _compute_dtype(a.dtype, b.dtype)
    if a.is_cuda and b.dtype == torch.bfloat16 and cdt == torch.float32:
        if a.dtype == torch.bfloat16:
            return torch.bmm(a, b, out_dtype=torch.float32)
        parts = split_bf16x3(a.float())
        out = torch.bmm(parts[0], b, out_dtype=torch.float32)
        for part in parts[1:]:
            out += torch.bmm(part, b, out_dtype=torch.float32)
        return out
    return torch.bmm(a.to(cdt), b.to(cdt))


def _absorb(x: Tensor, w: Tensor, keys: Tensor, bmm: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """Per-head product ``x [r, H, a] @ w [H, a, b]`` → ``[r, H, b]`` by ``bmm``; tiled on the
    rows (on the tokens' ``keys`` off CUDA) in batch-invariant mode (``glm_dsa.invariant``)."""
    def product(t: Tensor) -> Tensor:
        return bmm(t.transpose(0, 1), w).transpose(0, 1)

    return invariant.row_wise(product, x, keys)


def sparse_mla_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
    lse_base: str = "e",
    lonely_lse: str = "+inf",
    budget_bytes: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sparse MLA attention with FlashMLA's ``flash_mla_sparse_fwd`` contract.

    Args:
        q: ``[s_q, h, d_qk]`` float (576 = ``[q_abs 512 | q_pe 64]`` for GLM-5.3).
        kv: ``[s_kv, 1, d_qk]`` float; the values are ``kv[..., :d_v]``. Gathered rows are
            cast to the compute dtype chunk by chunk, so a bf16 cache is never copied whole.
        indices: int32 ``[s_q, 1, topk]``, rows of ``kv``. Invalid, hence ignored: ``idx < 0``,
            ``idx >= s_kv``, or column ``>= topk_length[row]``. A valid index listed twice
            is attended twice (FlashMLA gathers, it does not deduplicate).
        sm_scale: softmax scale applied to ``q · kv`` (the MLA scale, not ``d_qk**-0.5``).
        d_v: value width.
        attn_sink: optional ``[h]`` float logit of an extra value-less key per head: the output
            is normalised by ``logaddexp(lse, attn_sink)``; the returned ``lse`` excludes it.
        topk_length: optional int32 ``[s_q]`` number of leading index columns each row uses.
        lse_base: ``"e"`` natural-log ``max_logits``/``lse`` (newest kernel); ``"2"`` both in
            base 2, i.e. of ``P * log2(e)`` (September 2025 kernel).
        lonely_lse: ``lse`` of a row with no valid index: ``"+inf"`` (newest) or ``"-inf"``.
        budget_bytes: bound, in bytes, on the temporaries of one row chunk: the gathered keys
            (in kv's dtype and in the compute dtype), the scores and their exponentials, the
            index masks, the chunk's query and output (``budget.attention_rows``). ``None``: one chunk.
            A chunk is a whole number of ``BATCH_TILE``-row tiles (``glm_dsa.invariant``), and
            the per-row products always run ``BATCH_TILE`` rows per call, so the results are
            bitwise independent of the budget. Peak memory: inputs, outputs and
            ``budget_bytes`` (or one tile's temporaries, ``BATCH_TILE`` rows, if larger).

    Returns:
        ``(out [s_q, h, d_v], max_logits [s_q, h], lse [s_q, h])`` in the compute dtype
        (``promote_types(q.dtype, kv.dtype, float32)``), where ``P = (q · kv[idx]) * sm_scale`` with
        ``-inf`` at invalid positions, ``max_logits = max P``, ``lse = logsumexp P`` and
        ``out = exp(P - lse) @ kv[idx, :d_v]`` (computed as FlashMLA does: ``exp(P - max)`` times
        the values, divided by its row sum). A row with no valid index gives ``out = 0``,
        ``max_logits = -inf`` and ``lse`` per ``lonely_lse``.
    """
    check_sparse_inputs(q, kv, indices, d_v, attn_sink, topk_length)
    check_sparse_conventions(lse_base, lonely_lse, budget_bytes)
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale={sm_scale} must be finite")
    s_q, h, d_qk = q.shape
    rows_per_chunk = attention_rows(s_q, indices.shape[2], d_qk, d_v, h, kv.dtype,
                                    _compute_dtype(q.dtype, kv.dtype), budget_bytes)
    out, max_logits, lse = _sparse_mla(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                       lonely_lse == "+inf", rows_per_chunk)
    if lse_base == "2":
        max_logits.mul_(_LOG2E)
        lse.mul_(_LOG2E)
    return out, max_logits, lse


def _sparse_mla(q: Tensor, kv: Tensor, indices: Tensor, sm_scale: float, d_v: int,
                attn_sink: Tensor | None, topk_length: Tensor | None, lonely_lse_inf: bool,
                rows_per_chunk: int) -> tuple[Tensor, Tensor, Tensor]:
    """``sparse_mla_fwd`` on checked inputs, natural-log statistics, ``rows_per_chunk`` query
    rows at a time (see ``_sparse_mla_rows``)."""
    s_q, h, d_qk = q.shape
    s_kv, topk = kv.shape[0], indices.shape[2]
    cdt = _compute_dtype(q.dtype, kv.dtype)
    out = torch.empty((s_q, h, d_v), dtype=cdt, device=q.device)
    max_logits = torch.empty((s_q, h), dtype=cdt, device=q.device)
    lse = torch.empty((s_q, h), dtype=cdt, device=q.device)
    # Invalid indices read row 0 with weight 0. That is harmless unless row 0 is non-finite (a
    # NaN-poisoned slot, say): 0 * NaN would survive the -inf mask, so then their rows are zeroed.
    # An empty kv makes every index invalid: they read a zero row.
    kv_rows = kv[:, 0, :] if s_kv else kv.new_zeros(1, d_qk)        # [s_kv, d_qk]
    row0_finite = bool(torch.isfinite(kv_rows[0]).all())
    if invariant.active():  # every op on one tile's shape, the reductions included
        rows_per_chunk = BATCH_TILE
    column = torch.arange(topk, device=q.device)
    sink = None if attn_sink is None else attn_sink.to(cdt)
    for r0 in range(0, s_q, rows_per_chunk):
        r1 = min(s_q, r0 + rows_per_chunk)
        # Padded to whole batch tiles (lonely rows: no valid index), so the products' calls
        # all have BATCH_TILE items whatever the chunk.
        pad = -(r1 - r0) % BATCH_TILE
        idx = F.pad(indices[r0:r1, 0, :].to(torch.int64), (0, 0, 0, pad))  # [r + pad, topk]
        valid = (idx >= 0) & (idx < s_kv)
        if topk_length is not None:
            valid &= column[None, :] < F.pad(topk_length[r0:r1], (0, pad))[:, None]
        valid[r1 - r0 :] = False
        q_rows = q[r0:r1] if not pad else torch.cat([q[r0:r1], q.new_zeros(pad, h, d_qk)])
        rows = _sparse_mla_rows(q_rows, kv_rows, idx, valid, sm_scale, d_v, sink, row0_finite,
                                lonely_lse_inf)
        out[r0:r1], max_logits[r0:r1], lse[r0:r1] = (t[: r1 - r0] for t in rows)
        del idx, valid, rows  # before the next chunk's, or two chunks' temporaries coexist
    return out, max_logits, lse


def _sparse_mla_rows(q, kv_rows, idx, valid, sm_scale, d_v, sink, row0_finite, lonely_lse_inf):
    """One row chunk: ``q [r, h, d_qk]`` over the rows ``idx [r, topk]`` of ``kv_rows
    [s_kv, d_qk]`` where ``valid``; returns ``(out [r, h, d_v], max_logits [r, h], lse [r, h])``."""
    h = q.shape[1]
    # Gathered in the cache's dtype: _bmm_f32 takes bf16 rows as they are.
    keys = kv_rows[torch.where(valid, idx, 0)]                      # [r, topk, d_qk]
    if not row0_finite:
        keys.masked_fill_(~valid[..., None], 0)
    # In fixed batch tiles: a one-row chunk would otherwise run multi-threaded and round apart.
    scores = batch_tiled(_bmm_f32, q, keys.transpose(1, 2))         # [r, h, topk]
    scores.mul_(sm_scale).masked_fill_(~valid[:, None, :], -math.inf)
    row_max = scores.amax(dim=-1)                                   # [r, h], -inf on lonely rows
    # exp(P - max) ≤ 1. Lonely rows subtract 0 rather than -inf: weights 0, not NaN.
    shift = row_max.masked_fill(row_max == -math.inf, 0.0)
    weights = scores.sub_(shift[..., None]).exp_()                  # [r, h, topk]
    total = weights.sum(dim=-1)                                     # [r, h], ≥ 1 unless lonely
    row_lse = shift + total.log()                                   # -inf on lonely rows
    denom = total if sink is None else total + torch.exp(sink - shift)
    denom.masked_fill_(denom == 0, 1.0)                             # lonely, no sink: out = 0 / 1
    # Normalised after the value GEMM, as FlashMLA does: [r, h, d_v] divisions, not
    # [r, h, topk]. Multiplying by all d_qk columns and slicing costs (d_qk - d_v)/d_v more
    # FLOPs but no contiguous copy of the [rows, topk, d_v] values.
    out = batch_tiled(_bmm_f32, weights, keys)[..., :d_v].div_(denom[..., None])
    if lonely_lse_inf:
        row_lse = row_lse.masked_fill(~valid.any(dim=-1, keepdim=True).expand(-1, h), math.inf)
    return out, row_max, row_lse


def _row_chunks(ks: list[int], ke: list[int], heads: int, itemsize: int):
    """Yield ``(r0, r1)`` row ranges sharing one ``ks`` whose ``[r, heads, span]`` scores fit
    ``_DENSE_SCORE_BYTES``; consecutive rows of one request share ``ks``, so this is per request."""
    n, r0 = len(ks), 0
    while r0 < n:
        seg_end = r0 + 1
        while seg_end < n and ks[seg_end] == ks[r0]:
            seg_end += 1
        span = max(1, max(ke[r0:seg_end]) - ks[r0])
        step = rows_within(_DENSE_SCORE_BYTES, heads * span * itemsize)
        for c0 in range(r0, seg_end, step):
            yield c0, min(seg_end, c0 + step)
        r0 = seg_end


def dense_causal_mha(q: Tensor, k: Tensor, v: Tensor, ks: Tensor, ke: Tensor, sm_scale: float) -> Tensor:
    """Dense multi-head attention where query row ``m`` sees key rows ``[ks[m], ke[m])``.

    Args:
        q: ``[n, h, d_qk]`` float; k: ``[S_kv, h, d_qk]``; v: ``[S_kv, h, d_v]``; one dtype.
        ks, ke: int32 ``[n]`` with ``0 ≤ ks ≤ ke ≤ S_kv`` (``ForwardBatch.ks``/``ke``).
        sm_scale: softmax scale of ``q · k``.

    Returns:
        ``[n, h, d_v]`` in ``promote_types(q.dtype, float32)``: ``softmax(q·kᵀ·sm_scale)`` over
        the visible rows, times ``v``; an empty range gives 0. Rows are processed per request
        in chunks whose score matrix stays under 256 MiB.
    """
    if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
        raise ValueError(
            f"q, k, v must be [n, h, d_qk], [S_kv, h, d_qk], [S_kv, h, d_v]; got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    n, h, d_qk = q.shape
    s_kv = k.shape[0]
    if k.shape[1:] != (h, d_qk) or v.shape[:2] != (s_kv, h):
        raise ValueError(
            f"k must be [S_kv, h={h}, d_qk={d_qk}] and v [S_kv, h={h}, d_v] with the same S_kv; "
            f"got k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not q.dtype.is_floating_point or not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share one floating dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("ks", ks), ("ke", ke)):
        if t.dtype != torch.int32 or t.shape != (n,):
            raise ValueError(f"{name} must be int32 [n={n}], got {t.dtype} {tuple(t.shape)}")
    if n and bool(((ks < 0) | (ks > ke) | (ke > s_kv)).any()):
        raise ValueError(f"every row needs 0 ≤ ks ≤ ke ≤ S_kv={s_kv}")
    if not math.isfinite(sm_scale):
        raise ValueError(f"sm_scale={sm_scale} must be finite")

    cdt = _compute_dtype(q.dtype)
    out = torch.zeros((n, h, v.shape[2]), dtype=cdt, device=q.device)
    ks_list, ke_list = ks.tolist(), ke.tolist()
    for r0, r1 in _row_chunks(ks_list, ke_list, h, cdt.itemsize):
        c0, c1 = ks_list[r0], max(ke_list[r0:r1])
        if c1 <= c0:
            continue
        q_h = q[r0:r1].to(cdt).transpose(0, 1)                      # [h, r, d_qk]
        k_h = k[c0:c1].to(cdt).permute(1, 2, 0)                     # [h, d_qk, c]
        v_h = v[c0:c1].to(cdt).transpose(0, 1)                      # [h, c, d_v]
        scores = torch.bmm(q_h, k_h).mul_(sm_scale)                 # [h, r, c]
        column = torch.arange(c0, c1, device=q.device)
        visible = column[None, :] < ke[r0:r1, None]                 # ks[r] == c0 in this chunk
        scores.masked_fill_(~visible[None], -math.inf)
        norm = torch.logsumexp(scores, dim=-1, keepdim=True)
        norm.masked_fill_(norm == -math.inf, math.inf)              # empty row: weights 0, not NaN
        probs = scores.sub_(norm).exp_()
        out[r0:r1] = torch.bmm(probs, v_h).transpose(0, 1)
    return out


@dataclass
class MLAProjection:
    """The per-token projections of one MLA layer (activation dtype).

    Attributes:
        q_latent: ``[n, q_lora_rank]``, ``q_a_layernorm(q_a_proj(x))``; also the indexer's input.
        q_nope: ``[n, H, qk_nope_head_dim]``.
        q_pe: ``[n, H, qk_rope_head_dim]``, RoPE applied.
        kv_latent: ``[n, kv_lora_rank + qk_rope_head_dim]`` = ``[kv_a_layernorm(c) | roped k_pe]``,
            the row the KV cache stores.
    """

    q_latent: Tensor
    q_nope: Tensor
    q_pe: Tensor
    kv_latent: Tensor


class MLA(nn.Module):
    """MLA attention of one DSA layer, with Hugging Face parameter names.

    Weights: ``q_a_proj [q_lora, hidden]``, ``q_a_layernorm`` (RMSNorm, ``rms_norm_eps``),
    ``q_b_proj [H*(nope+rope), q_lora]``, ``kv_a_proj_with_mqa [kv_lora+rope, hidden]``,
    ``kv_a_layernorm`` (RMSNorm, ``rms_norm_eps``; HF uses 1e-6 here, see docs/conventions.md §9),
    ``kv_b_proj [H*(nope+v), kv_lora]``, ``o_proj [hidden, H*v]``; no biases. ``indexer``: the
    layer's DSA ``Indexer`` on full layers (HF's ``self_attn.indexer.*``), None on shared layers,
    which reuse an earlier full layer's top-k.

    The caller owns the KV cache: ``project`` gives the new tokens' latent rows, the caller writes
    them and gathers every request's context back as ``kv_context`` (``batch.kv_slots`` order),
    then ``attend`` runs the form the batch calls for.
    """

    def __init__(self, config: DSAConfig, has_indexer: bool = False):
        super().__init__()
        self.config = config
        cfg = config
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, cfg.num_attention_heads * cfg.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(cfg.hidden_size, cfg.kv_latent_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.rms_norm_eps)
        self.kv_b_proj = nn.Linear(
            cfg.kv_lora_rank, cfg.num_attention_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.v_head_dim, cfg.hidden_size, bias=False)
        self.indexer = Indexer(config) if has_indexer else None

    def project(self, x: Tensor, positions: Tensor) -> MLAProjection:
        """Queries and latent KV rows of ``x [n, hidden]`` at int64 ``positions [n]``."""
        cfg = self.config
        if x.dim() != 2 or x.shape[1] != cfg.hidden_size:
            raise ValueError(f"x must be [n, hidden={cfg.hidden_size}], got {tuple(x.shape)}")
        if x.dtype != self.q_a_proj.weight.dtype:
            raise ValueError(
                f"x is {x.dtype} but the weights are {self.q_a_proj.weight.dtype}; cast one of them"
            )
        if positions.dtype != torch.int64 or positions.shape != (x.shape[0],):
            raise ValueError(
                f"positions must be int64 [n={x.shape[0]}], got {positions.dtype} "
                f"{tuple(positions.shape)}"
            )
        heads = cfg.num_attention_heads
        q_latent = self.q_a_layernorm(invariant.linear(x, self.q_a_proj.weight, positions))
        q = invariant.linear(q_latent, self.q_b_proj.weight, positions)
        q = rearrange(q, "n (h d) -> n h d", h=heads)  # d = nope + rope
        q_nope, q_pe = q.split([cfg.qk_nope_head_dim, cfg.qk_rope_head_dim], dim=-1)
        kv_a = invariant.linear(x, self.kv_a_proj_with_mqa.weight, positions)
        c_kv, k_pe = kv_a.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        c_kv = self.kv_a_layernorm(c_kv)
        cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                                dtype=_compute_dtype(x.dtype))
        q_pe = apply_rope(q_pe, cos, sin, interleaved=cfg.rope_interleave)
        k_pe = apply_rope(k_pe, cos, sin, interleaved=cfg.rope_interleave)
        return MLAProjection(q_latent, q_nope, q_pe, torch.cat([c_kv, k_pe], dim=-1))

    def use_mha(self, batch: ForwardBatch) -> bool:
        """True when the expanded one-shot form runs: every context is short enough that the
        top-k keeps all its keys (``max_kv_len ≤ min(dense_attn_kv_len_threshold, index_topk)``).
        Never in batch-invariant mode: the choice follows the batch's longest context, and the
        two forms round differently."""
        cfg = self.config
        if invariant.active():
            return False
        return batch.max_kv_len <= min(cfg.dense_attn_kv_len_threshold, cfg.index_topk)

    def _check_context(self, proj: MLAProjection, kv_context: Tensor, batch: ForwardBatch) -> torch.dtype:
        cfg = self.config
        s_kv = batch.kv_slots.numel()
        if kv_context.dim() != 2 or kv_context.shape != (s_kv, cfg.kv_latent_dim):
            raise ValueError(
                f"kv_context must be [S_kv={s_kv}, {cfg.kv_latent_dim}] (one latent row per "
                f"batch.kv_slots entry), got {tuple(kv_context.shape)}"
            )
        if not kv_context.dtype.is_floating_point:
            raise ValueError(
                f"kv_context must be floating (dequantize or unpack the cache first), got "
                f"{kv_context.dtype}"
            )
        if proj.q_nope.shape[0] != batch.num_tokens:
            raise ValueError(
                f"proj has {proj.q_nope.shape[0]} tokens but the batch has {batch.num_tokens}"
            )
        return _compute_dtype(proj.q_nope.dtype, kv_context.dtype)

    def _kv_b_weight(self, dtype: torch.dtype) -> Tensor:
        """``kv_b_proj.weight`` as ``[H, nope + v, kv_lora]`` in ``dtype``."""
        return rearrange(self.kv_b_proj.weight.to(dtype), "(h d) c -> h d c",
                         h=self.config.num_attention_heads)

    def forward_absorbed(
        self,
        proj: MLAProjection,
        kv_context: Tensor,
        batch: ForwardBatch,
        topk_indices: Tensor,
        budget_bytes: int | None = None,
    ) -> Tensor:
        """Absorbed sparse attention over the top-k latent rows -> ``[n, hidden]``.

        Args:
            proj: the ``n`` query tokens' projections.
            kv_context: ``[S_kv, kv_lora + rope]`` float, the gathered context rows in
                ``batch.kv_slots`` order (dequantized FP8 or unpacked bf16 cache).
            batch: ragged metadata; row ``m`` may see ``[ks[m], ke[m])``.
            topk_indices: int32 ``[n, topk]`` request-relative; entries outside
                ``[0, ke - ks)`` are ignored, so an index past the causal limit is never read.
            budget_bytes: bound on the temporaries of a row chunk (``budget.attention_rows``,
                the gathered keys included); the whole pipeline runs in row chunks of that
                size, which changes only the GEMMs' row blocking (last-bit differences).
        """
        cfg = self.config
        self._check_context(proj, kv_context, batch)
        kv = kv_context[:, None, :]                                             # [S_kv, 1, 576]

        def attend_rows(query: Tensor, rows: Tensor) -> Tensor:
            return sparse_mla_fwd(query, kv, rows[:, None, :], cfg.softmax_scale,
                                  d_v=cfg.kv_lora_rank)[0]

        return self.forward_sparse(proj, batch, topk_indices, attend_rows, None, budget_bytes,
                                   gathered_dtype=kv_context.dtype)

    def forward_paged(
        self,
        proj: MLAProjection,
        pool: Tensor,
        batch: ForwardBatch,
        topk_indices: Tensor,
        paged_sparse_mla: Callable[..., tuple[Tensor, Tensor, Tensor]],
        budget_bytes: int | None = None,
    ) -> Tensor:
        """Absorbed sparse attention reading the selected rows straight from the KV pool -> ``[n, hidden]``.

        The fast form of ``forward_absorbed`` (``glm_dsa.backend``): the top-k indices become
        global slot numbers (``batch.kv_slots``), and ``paged_sparse_mla`` reads those rows of
        ``pool`` (this layer's ``KVCache.mla`` tensor: FP8 rows, or bf16 / fp32 latents) without
        gathering the context. Queries run in the pool's dtype (bf16 for an FP8 pool under bf16
        activations, float32 otherwise), the absorption GEMMs as plain GEMMs in that dtype.

        Args:
            pool: ``[num_pages, page_size, row]`` uint8 (FP8 rows), bfloat16 or float32.
            topk_indices: int32 ``[n, topk]`` request-relative, as in ``forward_absorbed``.
            paged_sparse_mla: ``(query, pool, slots, sm_scale, d_v) -> (out, max_logits, lse)``.
            budget_bytes: bound on a row chunk's queries and outputs (``budget.attention_rows``).
        """
        cfg = self.config
        need(pool.dtype in (torch.uint8, torch.bfloat16, torch.float32),
             f"the paged sparse attention reads fp8, bf16 or fp32 KV pools, not {pool.dtype}")
        act = proj.q_latent.dtype
        qdt = pool.dtype if pool.dtype.is_floating_point else (
            torch.bfloat16 if act == torch.bfloat16 else torch.float32)
        last_slot = max(batch.kv_slots.numel() - 1, 0)

        def attend_rows(query: Tensor, rows: Tensor) -> Tensor:
            slots = batch.kv_slots[rows.long().clamp(0, last_slot)]
            slots = slots.masked_fill(rows < 0, -1).to(torch.int32)              # [r, topk]
            return paged_sparse_mla(query, pool, slots, cfg.softmax_scale, cfg.kv_lora_rank)[0]

        return self.forward_sparse(proj, batch, topk_indices, attend_rows, qdt, budget_bytes)

    def forward_sparse(
        self,
        proj: MLAProjection,
        batch: ForwardBatch,
        topk_indices: Tensor,
        attend_rows: Callable[[Tensor, Tensor], Tensor],
        query_dtype: torch.dtype | None,
        budget_bytes: int | None,
        gathered_dtype: torch.dtype | None = None,
    ) -> Tensor:
        """The absorbed pipeline, row chunk by row chunk, with the sparse attention passed in.

        Per chunk of ``budget.attention_rows`` query rows: ``q_abs = q_nope @ W_UK``, the query
        ``[q_abs | q_pe]``, the top-k as rows of the context (``ks + index`` inside the causal
        limit, ``-1`` elsewhere), ``o_lat = attend_rows(query [r, H, 576], rows int32 [r, topk])``
        ``[r, H, kv_lora]``, then ``W_UV`` and ``o_proj``. Every attention form runs this loop.

        Args:
            query_dtype: None for float32-accurate products (``_bmm_f32``, the reference: the
                query in ``promote_types(activations, context, float32)``); else plain GEMMs with
                the query and weights in that dtype (the kernels' bf16 or float32 query).
            gathered_dtype: the dtype of a context ``attend_rows`` gathers (its keys count in
                the budget), or None where a kernel reads the rows in place.
        """
        cfg = self.config
        n = batch.num_tokens
        need(topk_indices.dtype == torch.int32 and topk_indices.dim() == 2
             and topk_indices.shape[0] == n,
             f"topk_indices must be int32 [n={n}, topk], got {topk_indices.dtype} "
             f"{tuple(topk_indices.shape)}")
        act = proj.q_latent.dtype
        if query_dtype is None:
            qdt = _compute_dtype(proj.q_nope.dtype, gathered_dtype or act)
            # In the weight's own dtype: _bmm_f32 multiplies bf16 weights on tensor cores exactly.
            w = self._kv_b_weight(self.kv_b_proj.weight.dtype)
            bmm = _bmm_f32
        else:
            qdt = query_dtype
            w = self._kv_b_weight(qdt)

            def bmm(a: Tensor, b: Tensor) -> Tensor:
                return torch.bmm(a.to(qdt), b)
        w_uk = w[:, : cfg.qk_nope_head_dim]                                      # [H, nope, kv_lora]
        w_uv_t = w[:, cfg.qk_nope_head_dim :].transpose(1, 2)                    # [H, kv_lora, v]
        out = torch.empty((n, cfg.hidden_size), dtype=act, device=proj.q_latent.device)
        # Whole pipeline per row chunk, so q_abs, the query and o (a few GB each for a 32K-token
        # chunk of 64 heads) are bounded by the budget as well as any gather.
        rows = attention_rows(n, topk_indices.shape[1], cfg.kv_latent_dim, cfg.kv_lora_rank,
                              cfg.num_attention_heads, gathered_dtype, qdt, budget_bytes)
        rows = invariant.whole_tiles(rows, n, proj.q_latent.device)
        for r0 in range(0, n, rows):
            r1 = min(n, r0 + rows)
            keys = batch.positions[r0:r1]
            q_abs = _absorb(proj.q_nope[r0:r1], w_uk, keys, bmm)                   # [r, H, kv_lora]
            query = torch.cat([q_abs, proj.q_pe[r0:r1].to(qdt)], dim=-1)           # [r, H, 576]
            rel = topk_indices[r0:r1]
            ks, ke = batch.ks[r0:r1, None], batch.ke[r0:r1, None]
            inside = (rel >= 0) & (rel < ke - ks)                                   # causal limit
            context_rows = (rel + ks).masked_fill_(~inside, -1).to(torch.int32)    # [r, topk]
            o_lat = attend_rows(query, context_rows)                                # [r, H, kv_lora]
            o = _absorb(o_lat, w_uv_t, keys, bmm)                                   # [r, H, v]
            out[r0:r1] = invariant.linear(rearrange(o, "r h v -> r (h v)").to(act), self.o_proj.weight,
                                          keys)
            del q_abs, query, rel, inside, context_rows, o_lat, o
        return out

    def forward_mha(self, proj: MLAProjection, kv_context: Tensor, batch: ForwardBatch) -> Tensor:
        """Expanded attention: ``kv_b_proj`` on every context row, dense causal MHA -> ``[n, hidden]``.

        ``kv_context`` is as in ``forward_absorbed``; every row sees all of ``[ks, ke)``.
        """
        cfg = self.config
        cdt = self._check_context(proj, kv_context, batch)
        s_kv, heads = kv_context.shape[0], cfg.num_attention_heads
        ctx = kv_context.to(cdt)
        c_kv, k_pe = ctx.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
        kv = torch.einsum("sc,hdc->shd", c_kv, self._kv_b_weight(cdt))         # [S_kv, H, nope+v]
        k_nope, v = kv.split([cfg.qk_nope_head_dim, cfg.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None, :].expand(s_kv, heads, cfg.qk_rope_head_dim)], dim=-1)
        q = torch.cat([proj.q_nope, proj.q_pe], dim=-1).to(cdt)               # [n, H, qk_head]
        o = dense_causal_mha(q, k, v, batch.ks, batch.ke, cfg.softmax_scale)
        return self.o_proj(rearrange(o, "n h v -> n (h v)").to(proj.q_latent.dtype))

    def attend(
        self,
        proj: MLAProjection,
        kv_context: Tensor,
        batch: ForwardBatch,
        topk_indices: Tensor,
        budget_bytes: int | None = None,
    ) -> Tensor:
        """``forward_mha`` when ``use_mha(batch)``, else ``forward_absorbed`` -> ``[n, hidden]``."""
        if self.use_mha(batch):
            return self.forward_mha(proj, kv_context, batch)
        return self.forward_absorbed(proj, kv_context, batch, topk_indices, budget_bytes)
