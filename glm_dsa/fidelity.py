"""Selection fidelity: how much of each layer's attention the DSA selection keeps.

DSA rests on two approximations: the indexer scores keys with FP8, Hadamard-rotated q/k and
keeps the top ``index_topk``, and shared layers reuse the top-k of the full layer before them.
``selection_fidelity`` runs the ordinary chunked prefill (``PrefillEngine``) and, for sampled
query rows of every kept layer, measures what that costs (docs/fidelity.md):

* **indexer precision**: recall of the FP8 indexer's top-k against the same indexer scored
  without FP8 rounding (float32: ``promote_types(dtype, float32)``), against that reference
  without the rotation (HF ``glm_moe_dsa``'s scoring; the rotation is orthonormal, so only
  rounding separates the two), and the recall an FP8 indexer *without* the rotation would have
  (what the rotation buys);
* **attention mass kept**: per query and head, the share of the dense causal softmax mass that
  falls on the selected keys, beside the best share any ``index_topk`` keys shared by the heads
  can hold (the top keys by head-mean dense mass); the gap is the selection's loss;
* **shared-layer reuse**: on a shared layer the same figures for the reused top-k, with the
  overlap between it and the layer's own best keys;
* **output error**: ``calc_diff`` of the sparse attention output (``o_proj`` applied) against
  the dense one on the sampled rows.

How the prefill is observed: a step observer (``glm_dsa.layer.StepObserver``) told each layer's
attention input, step by step, and each full layer's top-k. The layer's
numerics are untouched; afterwards each step's projections are recomputed from the captured
input with the same row blocks, so the KV rows (round-tripped through the cache format) and the
FP8 index keys are the ones the prefill attended over. Dense attention runs only for the sampled
rows, in row chunks bounded by ``budget_bytes``.
"""

from __future__ import annotations

import math
import time
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor

from glm_dsa.backend import Backend
from glm_dsa.cache import KVCache
from glm_dsa.fp8 import act_quant
from glm_dsa.hadamard import hadamard_transform
from glm_dsa.indexer import indexer_topk, topk_per_row
from glm_dsa.layer import DecoderLayer, DSAForCausalLM, StepObserver
from glm_dsa.oracle import calc_diff
from glm_dsa.budget import Budgets, rows_within
from glm_dsa.prefill import PrefillEngine, pages_for
from glm_dsa.report import table
from glm_dsa.validate import need

__all__ = [
    "RANDOM_WEIGHTS_NOTE",
    "MassResult",
    "sample_positions",
    "position_buckets",
    "topk_recall",
    "attention_mass",
    "selection_fidelity",
    "format_fidelity",
    "plot_fidelity",
]

RANDOM_WEIGHTS_NOTE = (
    "random weights: the mass figures are a self-test of the measurement, not a property of "
    "GLM-5.3; pass --weights with a checkpoint (and real token ids) for the model's own figures"
)

# Per-row figures of a layer, in the report's "rows" and the summaries' keys.
_RECALLS = ("recall_fp32", "recall_fp32_unrotated", "recall_fp8_unrotated", "recall_fp8_recomputed")


# ----------------------------------------------------------------------------- sampling
def sample_positions(num_tokens: int, rows: int, seed: int = 0) -> Tensor:
    """``min(rows, num_tokens)`` query positions spread over ``[0, num_tokens)``, int64
    ascending: one drawn uniformly (seeded) from each of ``rows`` stretches
    ``[i·n // rows, (i+1)·n // rows)``, so no two coincide."""
    need(isinstance(num_tokens, int) and num_tokens >= 1, f"num_tokens={num_tokens!r} must be ≥ 1")
    need(isinstance(rows, int) and rows >= 1, f"rows={rows!r} must be a positive int")
    if rows >= num_tokens:
        return torch.arange(num_tokens, dtype=torch.int64)
    edges = torch.arange(rows + 1, dtype=torch.int64) * num_tokens // rows
    u = torch.rand(rows, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return edges[:-1] + (u * (edges[1:] - edges[:-1])).long()


def position_buckets(num_tokens: int, index_topk: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` position ranges doubling from ``index_topk``: ``[0, k)`` (every key kept),
    ``[k, 2k)``, ``[2k, 4k)`` …, the last cut at ``num_tokens``."""
    edges, e = [0], index_topk
    while e < num_tokens:
        edges.append(e)
        e *= 2
    edges.append(num_tokens)
    return list(zip(edges[:-1], edges[1:]))


# ----------------------------------------------------------------------------- the math
def _key_mask(indices: Tensor, lengths: Tensor, width: int) -> Tensor:
    """bool ``[r, width]``: the keys ``0 ≤ idx < lengths[row]`` that ``indices [r, k]`` name
    (``-1`` padding, indices past the causal limit and repeats count once or not at all)."""
    valid = (indices >= 0) & (indices < lengths[:, None])
    idx = torch.where(valid, indices.long(), width)  # invalid entries land in a spare column
    mask = torch.zeros(indices.shape[0], width + 1, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, idx, True)[:, :width]


def topk_recall(topk: Tensor, reference: Tensor, lengths: Tensor) -> Tensor:
    """Per row, the share of ``reference``'s valid keys that ``topk`` also holds, float64 ``[r]``.

    Both are int ``[r, k]`` request-relative indices (``-1`` padding); a key counts only once
    and only if ``0 ≤ idx < lengths[row]``. A row whose reference names no valid key scores 1.
    """
    need(topk.dim() == 2 and reference.dim() == 2 and topk.shape[0] == reference.shape[0],
          f"topk and reference must be [r, k], got {tuple(topk.shape)} and {tuple(reference.shape)}")
    need(tuple(lengths.shape) == (topk.shape[0],), f"lengths must be [r={topk.shape[0]}]")
    width = int(lengths.max()) if lengths.numel() else 0
    a, b = _key_mask(topk, lengths, width), _key_mask(reference, lengths, width)
    both, want = (a & b).sum(dim=1).double(), b.sum(dim=1).double()
    return torch.where(want > 0, both / want.clamp_min(1), torch.ones_like(want))


class MassResult(NamedTuple):
    """``attention_mass``'s figures for ``r`` query rows of ``H`` heads.

    Attributes:
        kept: ``[r, H]`` share of the dense softmax mass on the selected keys.
        best: ``[r, H]`` share on the best ``index_topk`` keys shared by the heads (top by
            head-mean dense mass), so ``best.mean(1) ≥ kept.mean(1)`` for every row.
        overlap: float64 ``[r]`` share of the best keys that the selection holds.
        out_sparse: ``[r, H, d_v]`` attention over the selected keys (each once), the dense
            probabilities renormalized on them; 0 on a row with no valid selected key.
        out_dense: ``[r, H, d_v]`` attention over every causal key.
    """

    kept: Tensor
    best: Tensor
    overlap: Tensor
    out_sparse: Tensor
    out_dense: Tensor


def attention_mass(
    query: Tensor,
    kv: Tensor,
    lengths: Tensor,
    topk: Tensor,
    sm_scale: float,
    index_topk: int,
    d_v: int,
    budget_bytes: int | None = None,
) -> MassResult:
    """Dense causal attention of ``r`` query rows over one latent KV head, and the share of
    its mass that the selection ``topk`` keeps.

    Args:
        query: ``[r, H, d_qk]`` float (``[q_abs | q_pe]``, 576 wide for GLM-5.3).
        kv: ``[L, d_qk]`` float, the request's context rows in position order; values are
            ``kv[:, :d_v]``.
        lengths: int ``[r]``, row ``i`` sees keys ``[0, lengths[i])``, ``1 ≤ lengths ≤ L``.
        topk: int ``[r, k]`` selected keys, request-relative, ``-1`` padding; entries outside
            ``[0, lengths)`` and repeats are ignored.
        sm_scale: the softmax scale of ``query · kv``.
        index_topk: keys the best selection may keep.
        d_v: value width.
        budget_bytes: bound on a row chunk's ``[rows, H, L]`` temporaries (None: one chunk).

    Returns:
        ``MassResult`` in ``promote_types(query.dtype, kv.dtype, float32)``.
    """
    need(query.dim() == 3 and query.is_floating_point(),
          f"query must be floating [r, H, d_qk], got {query.dtype} {tuple(query.shape)}")
    r, heads, d_qk = query.shape
    need(kv.dim() == 2 and kv.shape[1] == d_qk and kv.is_floating_point(),
          f"kv must be floating [L, d_qk={d_qk}], got {kv.dtype} {tuple(kv.shape)}")
    need(lengths.dtype in (torch.int32, torch.int64) and tuple(lengths.shape) == (r,),
          f"lengths must be int [r={r}], got {lengths.dtype} {tuple(lengths.shape)}")
    need(r == 0 or (int(lengths.min()) >= 1 and int(lengths.max()) <= kv.shape[0]),
          f"lengths must lie in [1, L={kv.shape[0]}]")
    need(topk.dtype in (torch.int32, torch.int64) and topk.dim() == 2 and topk.shape[0] == r,
          f"topk must be int [r={r}, k], got {topk.dtype} {tuple(topk.shape)}")
    need(isinstance(index_topk, int) and index_topk >= 1, f"index_topk={index_topk!r} must be ≥ 1")
    need(isinstance(d_v, int) and 0 < d_v <= d_qk, f"d_v={d_v!r} must lie in [1, d_qk={d_qk}]")
    need(math.isfinite(sm_scale), f"sm_scale={sm_scale} must be finite")
    need(budget_bytes is None or (isinstance(budget_bytes, int) and budget_bytes >= 1),
          f"budget_bytes={budget_bytes!r} must be a positive int or None")
    for name, t in (("kv", kv), ("lengths", lengths), ("topk", topk)):
        need(t.device == query.device, f"{name} is on {t.device}, query on {query.device}")
    return _attention_mass(query, kv, lengths.long(), topk, sm_scale, index_topk, d_v, budget_bytes)


def _attention_mass(query, kv, lengths, topk, sm_scale, index_topk, d_v, budget_bytes) -> MassResult:
    """``attention_mass`` on checked inputs, row chunk by row chunk."""
    r, heads, _ = query.shape
    cdt = torch.promote_types(torch.promote_types(query.dtype, kv.dtype), torch.float32)
    dev = query.device
    kept, best = (torch.empty(r, heads, dtype=cdt, device=dev) for _ in range(2))
    out_sparse, out_dense = (torch.empty(r, heads, d_v, dtype=cdt, device=dev) for _ in range(2))
    overlap = torch.empty(r, dtype=torch.float64, device=dev)
    width = int(lengths.max()) if r else 0
    # The scores, their exponentials and two masked copies of [rows, H, width].
    per_row = 4 * heads * max(width, 1) * cdt.itemsize
    rows = r if budget_bytes is None else rows_within(budget_bytes, per_row)
    keys = kv.to(cdt)
    for r0 in range(0, r, rows):
        r1 = min(r, r0 + rows)
        lens = lengths[r0:r1]
        w = int(lens.max())
        visible = torch.arange(w, device=dev)[None, :] < lens[:, None]                  # [c, w]
        scores = torch.einsum("chd,ld->chl", query[r0:r1].to(cdt), keys[:w]).mul_(sm_scale)
        probs = scores.masked_fill_(~visible[:, None, :], -math.inf).softmax(dim=-1)   # [c, H, w]
        selected = _key_mask(topk[r0:r1], lens, w)
        on_selected = probs * selected[:, None, :]
        kept[r0:r1] = on_selected.sum(dim=-1)
        # The best keys shared by the heads: top by head-mean mass, invisible keys last.
        head_mean = probs.mean(dim=1).masked_fill_(~visible, -1.0)
        top = head_mean.topk(min(index_topk, w), dim=-1).indices
        best_keys = torch.zeros_like(visible).scatter_(1, top, True) & visible
        best[r0:r1] = (probs * best_keys[:, None, :]).sum(dim=-1)
        overlap[r0:r1] = (selected & best_keys).sum(dim=1).double() / best_keys.sum(dim=1).double()
        values = keys[:w, :d_v]
        out_dense[r0:r1] = torch.einsum("chl,lv->chv", probs, values)
        norm = kept[r0:r1].masked_fill(kept[r0:r1] == 0, 1.0)                           # lonely row: 0
        out_sparse[r0:r1] = torch.einsum("chl,lv->chv", on_selected, values) / norm[..., None]
        del scores, probs, on_selected, head_mean
    return MassResult(kept, best, overlap, out_sparse, out_dense)


def _relu_scores(q: Tensor, weights: Tensor, k: Tensor, lengths: Tensor, budget_bytes: int) -> Tensor:
    """Unquantized indexer scores ``sum_h weights[r, h] · relu(q[r, h] · k[j])`` ``[r, L]`` in
    ``promote_types(q, float32)``, ``-inf`` for ``j ≥ lengths[r]``; row chunks bounded by
    ``budget_bytes``."""
    r, heads, _ = q.shape
    cdt = torch.promote_types(q.dtype, torch.float32)
    width = int(lengths.max())
    out = torch.full((r, width), -math.inf, dtype=cdt, device=q.device)
    rows = rows_within(budget_bytes, 2 * heads * width * cdt.itemsize)
    keys = k[:width].to(cdt)
    for r0 in range(0, r, rows):
        r1 = min(r, r0 + rows)
        s = torch.einsum("chd,ld->chl", q[r0:r1].to(cdt), keys).relu_()
        tile = (s * weights[r0:r1, :, None].to(cdt)).sum(dim=1)
        visible = torch.arange(width, device=q.device)[None, :] < lengths[r0:r1, None]
        out[r0:r1] = tile.masked_fill_(~visible, -math.inf)
    return out


# ----------------------------------------------------------------------------- observing a prefill
class _Capture(StepObserver):
    """Records, step by step, each layer's attention input (``input_layernorm``'s output) and,
    for the sampled positions, the top-k each full layer's indexer returned (``selected``).

    One request without prefix-cache hits, so a layer's steps concatenate to positions ``0 … n−1``.
    """

    def __init__(self, model: DSAForCausalLM, positions: Tensor) -> None:
        self.positions = positions
        self.inputs: dict[int, list[Tensor]] = {}
        self.selected: dict[int, list[Tensor]] = {}
        self._start: dict[int, int] = {}
        for layer in model.model.layers:
            assert isinstance(layer, DecoderLayer)  # nn.ModuleList types its items as nn.Module
            self.inputs[layer.layer_idx] = []
            if layer.is_full:
                self.selected[layer.layer_idx] = []

    def attention_input(self, layer: DecoderLayer, h_in: Tensor) -> None:
        i = layer.layer_idx
        self._start[i] = sum(h.shape[0] for h in self.inputs[i])
        self.inputs[i].append(h_in.detach())

    def topk(self, layer: DecoderLayer, topk_indices: Tensor) -> None:
        start = self._start[layer.layer_idx]
        pos = self.positions[(self.positions >= start) & (self.positions < start + topk_indices.shape[0])]
        self.selected[layer.layer_idx].append(topk_indices[(pos - start).to(topk_indices.device)].detach())


def _step_positions(steps: list[Tensor], device: torch.device) -> list[Tensor]:
    """int64 positions of each captured step's rows."""
    out, p0 = [], 0
    for h in steps:
        out.append(torch.arange(p0, p0 + h.shape[0], dtype=torch.int64, device=device))
        p0 += h.shape[0]
    return out


# ----------------------------------------------------------------------------- one layer
class _IndexerInputs(NamedTuple):
    """A full layer's indexer inputs, recomputed: every position's keys and the sampled rows'
    queries and gates (``weights_proj`` output, before any scale)."""

    k_unrotated: Tensor   # [n, D], RoPE'd, unquantized
    k_fp8: Tensor         # [n, D] float8_e4m3fn, what the prefill scored
    k_scale: Tensor       # [n] float32
    q_unrotated: Tensor   # [r, H, D], RoPE'd, unquantized
    q_fp8: Tensor         # [r, H, D] float8_e4m3fn, what the prefill scored
    weights_fp8: Tensor   # [r, H], the prefill's head gates (q scale folded in)
    gates: Tensor         # [r, H] in the compute dtype


class _Replay(NamedTuple):
    """A layer's projections recomputed from its captured input."""

    kv_latent: Tensor     # [n, kv_lora_rank + rope], every position
    q_nope: Tensor        # [r, H, qk_nope_head_dim], the sampled rows
    q_pe: Tensor          # [r, H, qk_rope_head_dim]
    indexer_inputs: _IndexerInputs | None  # not ``index``: that would shadow ``tuple.index``


def _replay(layer: DecoderLayer, steps: list[Tensor], positions: Tensor) -> _Replay:
    """Project each captured step of ``layer``'s attention input in one call, as the prefill
    did (the same rows per GEMM, so bitwise its projections), keeping every position's latent
    row and the sampled ``positions``' queries."""
    attn, ind = layer.self_attn, layer.self_attn.indexer
    cdt = torch.promote_types(steps[0].dtype, torch.float32)
    parts: dict[str, list[Tensor]] = {}

    def keep(**tensors: Tensor) -> None:
        for name, t in tensors.items():
            parts.setdefault(name, []).append(t)

    for h, pos in zip(steps, _step_positions(steps, steps[0].device)):
        proj = attn.project(h, pos)
        rows = positions[(positions >= pos[0]) & (positions <= pos[-1])] - pos[0]
        keep(kv_latent=proj.kv_latent, q_nope=proj.q_nope[rows], q_pe=proj.q_pe[rows])
        if ind is not None:
            k_fp8, k_scale = act_quant(ind.project_k(h, pos), ind.head_dim, layer.config.scale_fmt)
            q_fp8, weights_fp8 = ind.project_q(h, proj.q_latent, pos)
            q = rearrange(ind.wq_b(proj.q_latent[rows]), "n (h d) -> n h d", h=ind.n_heads)
            keep(k_unrotated=ind.rope(ind.k_norm(ind.wk(h)), pos), k_fp8=k_fp8, k_scale=k_scale[:, 0],
                 q_unrotated=ind.rope(q, pos[rows]), q_fp8=q_fp8[rows], weights_fp8=weights_fp8[rows],
                 # weights_proj as project_q runs it (a float64 GEMM rounded once), no q scale
                 gates=F.linear(h[rows].double(), ind.weights_proj.weight.double()).to(cdt))
    whole = {name: torch.cat(ts) for name, ts in parts.items()}
    index = _IndexerInputs(*(whole[f] for f in _IndexerInputs._fields)) if ind is not None else None
    return _Replay(whole["kv_latent"], whole["q_nope"], whole["q_pe"], index)


def _layer_figures(layer: DecoderLayer, steps: list[Tensor], positions: Tensor, topk: Tensor,
                   cache: KVCache, budget_bytes: int) -> dict[str, Tensor]:
    """The per-row figures of one layer: ``steps`` is its captured attention input (the
    prefill's steps in order), ``positions`` int64 ``[r]`` the sampled rows (model's device),
    ``topk [r, k]`` the selection they attended over. Keys starting with ``_`` are the
    per-head and output tensors the summaries need."""
    cfg, attn = layer.config, layer.self_attn
    act = steps[0].dtype
    cdt = torch.promote_types(act, torch.float32)
    lengths = positions + 1
    with torch.no_grad():
        rep = _replay(layer, steps, positions)
        # Through the cache format, as the prefill's attention read them.
        slots = torch.arange(rep.kv_latent.shape[0], dtype=torch.int64, device=positions.device)
        cache.write_mla(layer.layer_idx, slots, rep.kv_latent)
        kv = cache.read_mla(layer.layer_idx, slots, act)
        w = rearrange(attn.kv_b_proj.weight.to(cdt), "(h d) c -> h d c", h=cfg.num_attention_heads)
        w_uk, w_uv = w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim:]   # [H, nope | v, kv_lora]
        q_abs = torch.einsum("rhd,hdc->rhc", rep.q_nope.to(cdt), w_uk)
        query = torch.cat([q_abs, rep.q_pe.to(cdt)], dim=-1)                       # [r, H, 576]
        mass = _attention_mass(query, kv, lengths, topk, cfg.softmax_scale, cfg.index_topk,
                               cfg.kv_lora_rank, budget_bytes)
        out = {}
        for name, o_lat in (("sparse", mass.out_sparse), ("dense", mass.out_dense)):
            o = torch.einsum("rhc,hvc->rhv", o_lat, w_uv)
            out[name] = F.linear(rearrange(o, "r h v -> r (h v)"), attn.o_proj.weight.to(cdt))
        figures = {
            "mass_kept": mass.kept.mean(dim=1), "mass_kept_worst_head": mass.kept.amin(dim=1),
            "mass_best": mass.best.mean(dim=1), "overlap": mass.overlap,
            "calc_diff": torch.tensor([calc_diff(a, b) for a, b in zip(out["sparse"], out["dense"])],
                                      dtype=torch.float64),
            "_out_sparse": out["sparse"], "_out_dense": out["dense"], "_kept": mass.kept, "_best": mass.best,
        }
        if rep.indexer_inputs is not None:
            figures.update(_indexer_recalls(rep.indexer_inputs, topk, lengths, layer.config, budget_bytes))
    return figures


def _indexer_recalls(t: _IndexerInputs, topk: Tensor, lengths: Tensor, cfg, budget_bytes: int) -> dict[str, Tensor]:
    """Recall of the prefill's FP8 top-k ``topk`` against the unquantized references (rotated,
    and not), of an FP8 indexer without the rotation against the rotated reference, and of the
    prefill's top-k against the FP8 top-k recomputed from ``t`` (1 when the observer saw what the
    prefill ran, with the reference backend)."""
    k, d, heads = cfg.index_topk, cfg.index_head_dim, cfg.index_n_heads
    zeros = torch.zeros_like(lengths, dtype=torch.int32)
    ends = lengths.to(torch.int32)
    cdt = t.gates.dtype
    w_ref = t.gates * heads**-0.5 * d**-0.5

    def unquantized_topk(q: Tensor, keys: Tensor) -> Tensor:
        return topk_per_row(_relu_scores(q, w_ref, keys, lengths, budget_bytes), zeros, ends, k)

    def rotate(x: Tensor) -> Tensor:
        return hadamard_transform(x.to(cdt), d**-0.5)

    ref = unquantized_topk(rotate(t.q_unrotated), rotate(t.k_unrotated))
    ref_unrotated = unquantized_topk(t.q_unrotated, t.k_unrotated)
    q8, q_scale = act_quant(t.q_unrotated, d, cfg.scale_fmt)
    k8, k_scale = act_quant(t.k_unrotated, d, cfg.scale_fmt)
    w8 = (w_ref * q_scale[..., 0].to(cdt)).to(t.weights_fp8.dtype)
    unrotated_fp8 = indexer_topk(q8, w8, k8, k_scale[:, 0], zeros, ends, k, budget_bytes)
    recomputed = indexer_topk(t.q_fp8, t.weights_fp8, t.k_fp8, t.k_scale, zeros, ends, k, budget_bytes)
    return {
        "recall_fp32": topk_recall(topk, ref, lengths),
        "recall_fp32_unrotated": topk_recall(topk, ref_unrotated, lengths),
        "recall_fp8_unrotated": topk_recall(unrotated_fp8, ref, lengths),
        "recall_fp8_recomputed": topk_recall(topk, recomputed, lengths),
    }


# ----------------------------------------------------------------------------- the driver
def selection_fidelity(
    model: DSAForCausalLM,
    inputs: Tensor,
    rows: int = 256,
    seed: int = 0,
    chunked_prefill_size: int = 32768,
    kv_dtype: str = "fp8",
    backend: str | Backend = "reference",
    budget_bytes: Budgets | int | None = None,
) -> dict:
    """Prefill ``inputs`` and measure every layer's selection on ``rows`` sampled positions.

    Args:
        model: the layer stack (weights in their final dtype and device).
        inputs: one prompt, int64 token ids ``[n]`` or the first kept layer's input hidden states
            ``[n, hidden]`` (``PrefillEngine.add_request``'s ``input_hidden``).
        rows: query rows to sample (``sample_positions``, seeded by ``seed``).
        chunked_prefill_size, kv_dtype, backend: as ``PrefillEngine``'s.
        budget_bytes: the prefill's budgets (``PrefillEngine``'s argument: a ``Budgets``, one
            int for all, or None for ``Budgets.default`` on the model's device); their logits
            budget also bounds the measurement's row chunks.

    Returns:
        A JSON-ready dict: ``tokens``, ``seconds`` (``prefill`` and ``measurement``, wall),
        ``positions`` (the sampled rows), ``buckets``
        (``position_buckets``), and ``layers``, one per layer with ``layer``, ``kind``
        (``full`` / ``shared``), ``topk_from``, ``rows`` (per-row figures in ``positions``
        order: the recalls on full layers, ``mass_kept`` and ``mass_best`` as head means,
        ``mass_kept_worst_head``, ``overlap``, ``calc_diff``) and ``summary`` (one entry per
        bucket, then ``all``). docs/fidelity.md defines each figure.
    """
    cfg = model.config
    hidden = inputs.is_floating_point()
    need((inputs.dim() == 2 if hidden else inputs.dtype == torch.int64 and inputs.dim() == 1)
          and inputs.shape[0] >= 1,
          f"inputs must be non-empty int64 token ids [n] or hidden states [n, hidden], got {inputs.dtype} "
          f"{tuple(inputs.shape)}")
    need(isinstance(rows, int) and rows >= 1, f"rows={rows!r} must be a positive int")
    device = next(model.parameters()).device
    budgets = budget_bytes if isinstance(budget_bytes, Budgets) else Budgets.default(device, budget_bytes)
    n = inputs.shape[0]
    positions = sample_positions(n, rows, seed)
    pos_dev = positions.to(device)
    capture = _Capture(model, pos_dev)
    engine = PrefillEngine.for_prompts(model, [n], kv_dtype=kv_dtype,
                                       chunked_prefill_size=chunked_prefill_size, budget_bytes=budgets,
                                       prefix_caching=False, compute_logits=False, backend=backend,
                                       observer=capture)
    if hidden:
        engine.add_request(None, input_hidden=inputs)
    else:
        engine.add_request(inputs)
    t0 = _now(device)
    engine.run()
    t1 = _now(device)
    backend_name = engine.backend.name
    del engine
    for i, steps in capture.inputs.items():
        seen = sum(h.shape[0] for h in steps)
        if seen != n:
            raise RuntimeError(f"layer {i}'s observer saw {seen} rows of a {n}-token prefill")
    cache = KVCache(cfg, pages_for([n], cfg.page_size), kv_dtype, device)
    buckets = position_buckets(n, cfg.index_topk)
    layers = []
    for layer in model.model.layers:
        assert isinstance(layer, DecoderLayer)  # nn.ModuleList types its items as nn.Module
        i = layer.layer_idx
        source = cfg.topk_source(i)
        topk = torch.cat(capture.selected[source])
        figures = _layer_figures(layer, capture.inputs.pop(i), pos_dev, topk, cache, budgets.logits_bytes)
        layers.append({
            "layer": i, "kind": "full" if source == i else "shared", "topk_from": source,
            "rows": {k: v.double().cpu().tolist() for k, v in figures.items() if not k.startswith("_")},
            "summary": _summaries(figures, positions, buckets),
        })
    return {"config": cfg.name, "tokens": n, "index_topk": cfg.index_topk, "seed": seed,
            "chunk": chunked_prefill_size, "kv_dtype": kv_dtype, "backend": backend_name,
            "device": str(device), "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "seconds": {"prefill": t1 - t0, "measurement": _now(device) - t1},
            "positions": positions.tolist(), "buckets": [list(b) for b in buckets], "layers": layers}


def _now(device: torch.device) -> float:
    """Wall seconds, after the device's queued work (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def _summaries(fig: dict[str, Tensor], positions: Tensor, buckets: list[tuple[int, int]]) -> list[dict]:
    """Mean and worst of each figure over the rows of each bucket, then over all rows
    (``positions`` ``[lo, hi)``; ``hi`` of ``all`` is one past the last position)."""
    out = []
    ranges = [(lo, hi, f"{lo}-{hi - 1}") for lo, hi in buckets] + [(0, buckets[-1][1], "all")]
    for lo, hi, label in ranges:
        rows = ((positions >= lo) & (positions < hi)).nonzero().flatten()
        if rows.numel() == 0:
            continue
        dev_rows = rows.to(fig["_kept"].device)
        kept, best = fig["_kept"][dev_rows], fig["_best"][dev_rows]
        s: dict[str, Any] = {"positions": label, "lo": lo, "hi": hi, "rows": rows.numel(),
                             "mass_kept_mean": float(kept.mean()), "mass_kept_worst": float(kept.min()),
                             "mass_best_mean": float(best.mean()), "mass_best_worst": float(best.min()),
                             "overlap_mean": float(fig["overlap"][dev_rows].mean()),
                             "calc_diff": calc_diff(fig["_out_sparse"][dev_rows], fig["_out_dense"][dev_rows]),
                             "calc_diff_worst_row": float(fig["calc_diff"][rows].max())}
        s["mass_gap_mean"] = s["mass_best_mean"] - s["mass_kept_mean"]
        for name in _RECALLS:
            if name in fig:
                vals = fig[name][dev_rows]
                s[f"{name}_mean"], s[f"{name}_worst"] = float(vals.mean()), float(vals.min())
        out.append(s)
    return out


# ----------------------------------------------------------------------------- rendering
def _pair(s: dict, name: str) -> str:
    return f"{s[name + '_mean']:.4f} / {s[name + '_worst']:.4f}"


def format_fidelity(report: dict) -> str:
    """One table per layer, one line per position bucket and ``all`` (cells ``mean / worst``)."""
    blocks = []
    if report.get("random_weights"):
        blocks.append(f"note: {RANDOM_WEIGHTS_NOTE}")
    for lay in report["layers"]:
        full = lay["kind"] == "full"
        title = (f"layer {lay['layer']} (full: its own FP8 indexer)" if full else
                 f"layer {lay['layer']} (shared: reuses layer {lay['topk_from']}'s top-k)")
        headers = ["positions", "rows"]
        if full:
            headers += ["recall vs fp32", "recall vs fp32 unrotated", "recall of fp8 without rotation"]
        headers += ["mass kept", "best possible", "gap", "overlap with best", "out calc_diff",
                    "worst row"]
        rows = []
        for s in lay["summary"]:
            row = [s["positions"], str(s["rows"])]
            if full:
                row += [_pair(s, "recall_fp32"), _pair(s, "recall_fp32_unrotated"),
                        _pair(s, "recall_fp8_unrotated")]
            row += [_pair(s, "mass_kept"), _pair(s, "mass_best"), f"{s['mass_gap_mean']:.4f}",
                    f"{s['overlap_mean']:.4f}", f"{s['calc_diff']:.3e}", f"{s['calc_diff_worst_row']:.3e}"]
            rows.append(row)
        blocks.append(table(title + "; cells: mean / worst", headers, rows))
    return "\n\n".join(blocks)


def plot_fidelity(report: dict, path: str) -> None:
    """Mass kept (head mean, per sampled row) against the keys the row sees (position + 1, log
    scale), one series per layer with its best possible share dashed, and ``index_topk / L``
    (what a shuffled selection keeps) in grey; written as PNG to ``path`` (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    keys = [p + 1 for p in report["positions"]]
    k = report["index_topk"]
    ax.plot(keys, [min(1.0, k / n) for n in keys], "-", color="grey", linewidth=0.8,
            label="index_topk / L (shuffled)")
    for lay in report["layers"]:
        line, = ax.plot(keys, lay["rows"]["mass_kept"], ".", markersize=3,
                        label=f"layer {lay['layer']} ({lay['kind']}) kept")
        ax.plot(keys, lay["rows"]["mass_best"], "--", linewidth=0.8, color=line.get_color(),
                label=f"layer {lay['layer']} best possible")
    ax.set_xscale("log")
    ax.set_xlabel("keys the query sees, L = position + 1")
    ax.set_ylabel("share of dense attention mass")
    title = f"attention mass kept: {report['config']}, {report['tokens']} tokens, top-{k}"
    if report.get("random_weights"):
        title += "\n(random weights: a self-test, not a property of GLM-5.3)"
    ax.set_title(title, fontsize=9)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120, format="png")
    plt.close(fig)
