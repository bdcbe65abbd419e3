"""noaux_tc mixture of experts: sigmoid router with a selection-only bias, routed experts run
as grouped GEMMs, a shared expert, and the dense MLP of the first layers (docs/conventions.md §8).

Weight names follow the Hugging Face checkpoints under ``model.layers.{i}.mlp.``:
``gate.weight``, ``gate.e_score_correction_bias``, ``experts.{e}.{gate,up,down}_proj.weight``,
``shared_experts.{gate,up,down}_proj.weight``; a dense layer's ``MLP`` owns
``{gate,up,down}_proj.weight`` directly. The routed experts are stored stacked, as transformers
5.x keeps them (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``), and
their state dict translates to and from the per-expert checkpoint names.

"Compute dtype" is ``torch.promote_types(x.dtype, torch.float32)``: float32 for bf16/fp32
activations (the DeepSeek/HF convention ``x.float() @ gate.weight.float().T``), float64 for
float64 activations so that float64 tests reach ~1e-12.

A layer's MoE runs in row blocks whose temporaries fit the step's MoE budget
(``glm_dsa.budget.moe_rows``). Its SwiGLU, combine and row gather go through
``glm_dsa.fused`` (on CUDA single Triton passes under every built-in backend), and nothing in
it reads the device from the host, so a CUDA graph can capture it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glm_dsa import fused, invariant
from glm_dsa.budget import moe_rows
from glm_dsa.config import DSAConfig

__all__ = ["route", "MLP", "swiglu", "combine_experts", "experts_grouped_mm", "experts_loop",
           "fused_grouped_mm", "fused_grouped_mm_on",
           "experts_row_tiled", "Experts", "MoEGate", "MoE"]

# Keeps an all-zero score row from dividing by zero; the value HF and vLLM use.
_NORM_EPS = 1e-20

# The dtypes F.grouped_mm accepts (float64 raises); other dtypes run the experts in a loop.
GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _check_rows(x: Tensor, hidden_size: int | None, row_mask: Tensor | None) -> None:
    """x must be ``[n, hidden_size]`` floating (any width when None); row_mask ``[n]`` bool."""
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(
            f"x must be a 2-D floating tensor [n, hidden], got shape {tuple(x.shape)} "
            f"dtype {x.dtype}"
        )
    if hidden_size is not None and x.shape[1] != hidden_size:
        raise ValueError(f"x has hidden size {x.shape[1]}, expected {hidden_size}")
    if row_mask is not None and (row_mask.dtype != torch.bool or row_mask.shape != (x.shape[0],)):
        raise ValueError(
            f"row_mask must be a bool tensor of shape [{x.shape[0]}] (one flag per row of x), "
            f"got shape {tuple(row_mask.shape)} dtype {row_mask.dtype}"
        )


def _stable_top(scores: Tensor, k: int) -> Tensor:
    """Column indices of the k largest entries of each row: score descending, index ascending
    on ties (a stable sort), so the choice never depends on the backend's top-k tie-breaking.
    float32 rows on CUDA take ``_packed_top``, the same indices from a top-k instead of a sort."""
    if scores.is_cuda and scores.dtype == torch.float32:
        return _packed_top(scores, k)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


def _packed_top(scores: Tensor, k: int) -> Tensor:
    """``_stable_top`` of float32 ``scores [n, E]`` (no NaN) by ``torch.topk`` over distinct
    int64 keys: the score's order-preserving int32 image in the high word (``-0.0`` taken as
    ``+0.0``), ``E - 1 - column`` in the low one, so that ties go to the lower column and the
    result is unique — a top-k's tie-breaking has nothing to choose."""
    bits = (scores + 0.0).view(torch.int32)
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-int order = float order
    column = torch.arange(scores.shape[-1], device=scores.device)
    keys = (ordered.to(torch.int64) << 32) | (scores.shape[-1] - 1 - column)
    return scores.shape[-1] - 1 - (keys.topk(k, dim=-1).values & 0xFFFFFFFF)


def route(
    x: Tensor,
    gate_weight: Tensor,
    e_score_correction_bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    row_mask: Tensor | None = None,
    row_keys: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """noaux_tc routing of each row of ``x`` to ``top_k`` experts.

    ``x: [n, hidden]`` float; ``gate_weight: [E, hidden]`` (any float dtype, upcast to the
    compute dtype); ``e_score_correction_bias: [E]`` float32 or float64 (a bf16 bias has
    already lost the precision that decides expert choice, so it is refused);
    ``row_mask: [n]`` bool or None; ``row_keys: [n]`` int, the rows' positions (needed in
    batch-invariant mode, ``glm_dsa.invariant``, where the router GEMM is row-tiled on them).

    In the compute dtype: ``s = sigmoid(x @ gate_weight.T)``; selection scores ``s + bias``.
    With ``n_group > 1`` the experts form ``n_group`` contiguous groups, each group is scored
    by the sum of its two largest selection scores, and only the ``topk_group`` best groups
    stay candidates. Experts of dropped groups are excluded outright, as DeepSeek's ``-inf``
    fill does; HF's and older vLLM's fill with 0.0 gives the same choice whenever the
    ``top_k``-th kept selection score is positive. The ``top_k`` experts with the largest
    selection scores are chosen. Ties, of groups or of experts, go to the lower index, and
    ``topk_ids`` is ordered by selection score descending, so the result is deterministic.
    The bias only selects: ``topk_weights`` are the unbiased ``s`` of the chosen experts,
    divided by ``(sum + 1e-20)`` when ``norm_topk_prob``, times ``routed_scaling_factor``.

    Returns ``(topk_ids int64 [n, top_k], topk_weights [n, top_k])`` with the weights in the
    compute dtype (float32 unless ``x`` is float64). Rows with ``row_mask`` False get ids -1
    and weights 0.
    """
    _check_route_inputs(x, gate_weight, e_score_correction_bias, top_k, n_group, topk_group, row_mask)
    return _route(x, gate_weight, e_score_correction_bias, top_k, n_group, topk_group,
                  norm_topk_prob, routed_scaling_factor, row_mask, row_keys)


def _check_route_inputs(x, gate_weight, e_score_correction_bias, top_k, n_group, topk_group,
                        row_mask) -> None:
    _check_rows(x, None, row_mask)
    hidden = x.shape[1]
    if (
        gate_weight.dim() != 2
        or gate_weight.shape[1] != hidden
        or not gate_weight.is_floating_point()
    ):
        raise ValueError(
            f"gate_weight must be a floating [E, {hidden}] tensor, got shape "
            f"{tuple(gate_weight.shape)} dtype {gate_weight.dtype}"
        )
    num_experts = gate_weight.shape[0]
    if e_score_correction_bias.shape != (num_experts,) or e_score_correction_bias.dtype not in (
        torch.float32,
        torch.float64,
    ):
        raise ValueError(
            f"e_score_correction_bias must be a float32 (or float64) tensor of shape "
            f"[{num_experts}], got shape {tuple(e_score_correction_bias.shape)} dtype "
            f"{e_score_correction_bias.dtype}; load it from the checkpoint's float32 tensor"
        )
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group={n_group} must be ≥ 1 and divide the {num_experts} experts")
    group_size = num_experts // n_group
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must lie in [1, n_group={n_group}]")
    if n_group > 1 and group_size < 2:
        raise ValueError(
            f"group-limited routing sums each group's top-2 scores, but n_group={n_group} leaves "
            f"{group_size} expert per group"
        )
    candidates = topk_group * group_size if n_group > 1 else num_experts
    if not 1 <= top_k <= candidates:
        raise ValueError(
            f"top_k={top_k} must lie in [1, {candidates}] (the experts in the kept groups)"
        )


def _route(x: Tensor, gate_weight: Tensor, bias: Tensor, top_k: int, n_group: int, topk_group: int,
           norm_topk_prob: bool, scale: float, row_mask: Tensor | None,
           row_keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``route`` on checked inputs (``bias``: the score correction; ``scale``: the routed
    scaling factor)."""
    n, num_experts = x.shape[0], gate_weight.shape[0]
    group_size = num_experts // n_group
    cd = _compute_dtype(x.dtype)
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and gate_weight.dtype == x.dtype:
        # The same float32 GEMM of exact products (a bf16·bf16 product fits float32) on the
        # tensor cores, float32 out, instead of casting x to float32 for cuBLAS's SIMT kernel:
        # only the float32 summation order differs (as between any two cuBLAS kernels).
        def scores_of(t: Tensor) -> Tensor:
            return torch.sigmoid(torch.mm(t, gate_weight.T, out_dtype=torch.float32))
    else:
        w = gate_weight.to(cd)
        x = x.to(cd)

        def scores_of(t: Tensor) -> Tensor:
            return torch.sigmoid(F.linear(t, w))
    # In batch-invariant mode the sigmoid runs inside the row tiles too: its SIMD and scalar-tail
    # paths round apart on the CPU.
    scores = invariant.row_wise(scores_of, x, row_keys)  # [n, E] in cd
    selection = scores + bias.to(cd)  # [n, E]
    if n_group > 1:
        grouped = selection.view(n, n_group, group_size)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, G]
        kept = torch.zeros(n, n_group, dtype=torch.bool, device=x.device)
        kept.scatter_(1, _stable_top(group_scores, topk_group), True)
        selection = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(n, num_experts)
    topk_ids = _stable_top(selection, top_k)  # [n, top_k]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (invariant.row_sum(topk_weights)[:, None] + _NORM_EPS)
    topk_weights = topk_weights * scale
    if row_mask is not None:
        topk_ids = topk_ids.masked_fill(~row_mask[:, None], -1)
        topk_weights = topk_weights.masked_fill(~row_mask[:, None], 0.0)
    return topk_ids, topk_weights


class MLP(nn.Module):
    """SwiGLU feed-forward ``down(silu(gate x) * up x)``, bias-free: an expert, the shared
    expert, or the dense MLP of layers below ``first_k_dense_replace``.

    ``silu`` and the product run in the compute dtype and are cast back to ``x.dtype`` before
    ``down_proj`` (DeepSeek's ``Expert``): ``[..., hidden] -> [..., hidden]`` in ``x.dtype``.
    ``row_keys``: int ``[n]`` positions of a 2-D ``x``'s rows, needed in batch-invariant mode.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor, row_keys: Tensor | None = None) -> Tensor:
        weight = self.gate_proj.weight
        if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
            raise ValueError(
                f"MLP expects [..., {weight.shape[1]}] {weight.dtype} input, got shape "
                f"{tuple(x.shape)} dtype {x.dtype}; cast the module or the activations"
            )
        # One row-wise function, so the silu runs inside the row tiles as well as the GEMMs.
        return invariant.row_wise(self._swiglu_mlp, x, row_keys)

    def _swiglu_mlp(self, x: Tensor) -> Tensor:
        gate, up = F.linear(x, self.gate_proj.weight), F.linear(x, self.up_proj.weight)
        return F.linear(swiglu(gate, up, x.dtype), self.down_proj.weight)


def swiglu(gate: Tensor, up: Tensor, dtype: torch.dtype) -> Tensor:
    """``silu(gate) * up`` formed in the compute dtype and rounded once to ``dtype`` (DeepSeek's
    ``Expert``): ``gate, up: [m, I]`` of one dtype (views with unit column stride are fine) →
    ``[m, I]`` in ``dtype``. The active fused pass where it takes the call (``glm_dsa.fused``:
    on CUDA one Triton pass, torch's silu formula), else torch."""
    fast = fused.swiglu(gate, up, dtype)
    if fast is not None:
        return fast
    cd = _compute_dtype(dtype)
    return (F.silu(gate.to(cd)) * up.to(cd)).to(dtype)


def _swiglu(gate_up: Tensor, dtype: torch.dtype) -> Tensor:
    """``gate_up: [m, 2I]`` (gate columns, then up) → ``silu(gate) * up: [m, I]`` (``swiglu``)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return swiglu(gate, up, dtype)


def combine_experts(expert_out: Tensor, position: Tensor, weights: Tensor, shared: Tensor | None,
                    row_mask: Tensor | None, out: Tensor | None = None) -> Tensor:
    """Each row's routed outputs, weighted and summed, plus its shared expert.

    ``expert_out: [P, H]`` the pairs' expert outputs; ``position: [n, top_k]`` int, row ``t``'s
    pairs' rows of ``expert_out``; ``weights: [n, top_k]`` in the compute dtype, their routing
    weights; ``shared: [n, H]`` or None; ``row_mask: [n]`` bool or None. In the compute dtype,
    ``acc = 0``, then ``acc += expert_out[position[t, j]] * weights[t, j]`` for ``j = 0 ..
    top_k-1`` (each product rounded, then added: DeepSeek's loop when ``position`` ascends with
    the expert), then ``acc += shared[t]``; rows with ``row_mask`` False are 0 and their pairs'
    rows are never used (they may hold anything). Returns ``[n, H]`` in ``expert_out.dtype``,
    written to ``out`` when given. The active fused pass where it takes the call
    (``glm_dsa.fused``: on CUDA one Triton pass, bitwise this), else torch.
    """
    n, hidden = position.shape[0], expert_out.shape[1]
    if out is None:
        out = expert_out.new_empty(n, hidden)
    fast = fused.combine_experts(expert_out, position, weights, shared, row_mask, out)
    if fast is not None:
        return fast
    acc = torch.zeros(n, hidden, dtype=weights.dtype, device=expert_out.device)
    for slot in range(position.shape[1]):
        acc += expert_out[position[:, slot]].to(acc.dtype) * weights[:, slot, None]
    if shared is not None:
        acc += shared.to(acc.dtype)
    if row_mask is not None:
        acc.masked_fill_(~row_mask[:, None], 0.0)
    return out.copy_(acc)


def _check_experts(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor) -> None:
    """``x: [m, H]``, ``gate_up_proj: [E, 2I, H]`` and ``down_proj: [E, H, I]``, one dtype."""
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[1] % 2:
        raise ValueError(
            f"gate_up_proj must be [E, 2I, H], got shape {tuple(gate_up_proj.shape)}"
        )
    num_experts, two_i, hidden = gate_up_proj.shape
    if down_proj.shape != (num_experts, hidden, two_i // 2):
        raise ValueError(
            f"down_proj must be [E, H, I] = {[num_experts, hidden, two_i // 2]} to match "
            f"gate_up_proj {tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}"
        )
    if x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"x must be [m, {hidden}], got shape {tuple(x.shape)}")
    if not x.dtype == gate_up_proj.dtype == down_proj.dtype:
        raise ValueError(
            f"x, gate_up_proj and down_proj must share one dtype, got {x.dtype}, "
            f"{gate_up_proj.dtype} and {down_proj.dtype}; cast the weights or the activations"
        )


def experts_grouped_mm(
    x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, offsets: Tensor, rows: Tensor | None = None
) -> Tensor:
    """Every routed expert's SwiGLU on its own rows, as two grouped GEMMs (``F.grouped_mm``).

    The pairs' inputs are ``x`` itself (``rows`` None) or its rows ``x[rows]`` (``rows: [P]``
    int64, gathered here so that the gathered copy is freed after the first GEMM). They are
    grouped by expert: expert ``e`` owns pairs ``offsets[e-1]:offsets[e]`` (from 0 for ``e =
    0``); ``offsets: [E]`` int32 on ``x``'s device, non-decreasing, ending at or before the
    pair count (it stays on the device: no host synchronisation); pairs past ``offsets[-1]`` are
    not computed and their output rows are unspecified. ``x: [m, H]``,
    ``gate_up_proj: [E, 2I, H]``, ``down_proj: [E, H, I]``, all in ``x.dtype``, which must be
    one of ``GROUPED_MM_DTYPES``.

    Pair ``r`` of expert ``e`` gets ``down_e · swiglu(gate_up_e · x_r)``: the GEMM outputs in
    ``x.dtype``, ``silu(gate) * up`` in the compute dtype rounded once to ``x.dtype``, exactly
    ``experts_loop``'s formula. Returns ``[P, H]`` in ``x.dtype``.

    On CUDA, torch's fused kernel takes bf16 on sm90/sm100 (H100/H200, B200); other dtypes and
    GPUs run torch's fallback, which copies ``offsets`` to the host and loops over the experts.
    """
    _check_experts(x, gate_up_proj, down_proj)
    if x.dtype not in GROUPED_MM_DTYPES:
        raise ValueError(
            f"F.grouped_mm takes {GROUPED_MM_DTYPES}, got {x.dtype}; use experts_loop"
        )
    if offsets.shape != (gate_up_proj.shape[0],) or offsets.dtype != torch.int32:
        raise ValueError(
            f"offsets must be int32 of shape [{gate_up_proj.shape[0]}] (one end row per "
            f"expert), got shape {tuple(offsets.shape)} dtype {offsets.dtype}"
        )
    if rows is not None and (rows.dim() != 1 or rows.dtype != torch.int64):
        raise ValueError(f"rows must be a 1-D int64 tensor, got shape {tuple(rows.shape)} "
                         f"dtype {rows.dtype}")
    # grouped_mm multiplies by mat_b [E, K, N]: the transposed views of the [E, N, K] weights.
    if rows is None:
        pairs = x
    else:  # on CUDA one Triton copy at bandwidth (glm_dsa.fused)
        fast = fused.gather_rows(x, rows)
        pairs = x.index_select(0, rows) if fast is None else fast  # [P, H]
        # A second name would keep the copy alive past the ``del pairs`` below, over the MoE
        # budget (62 MB over it on the H200, 2026-12-02 R3).
        del fast
    gate_up = F.grouped_mm(pairs, gate_up_proj.transpose(1, 2), offs=offsets)  # [P, 2I]
    del pairs
    h = _swiglu(gate_up, x.dtype)  # [P, I]
    del gate_up
    return F.grouped_mm(h, down_proj.transpose(1, 2), offs=offsets)


def experts_loop(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, counts: list[int]) -> Tensor:
    """``experts_grouped_mm``'s result for any float dtype (float64 included), one expert at a
    time: ``counts[e]`` rows of ``x: [m, H]`` (grouped by expert, ``sum(counts) == m``) per
    expert ``e``. Weights and result as in ``experts_grouped_mm``; returns ``[m, H]``."""
    _check_experts(x, gate_up_proj, down_proj)
    if len(counts) != gate_up_proj.shape[0] or sum(counts) != x.shape[0] or min(counts) < 0:
        raise ValueError(
            f"counts must give a row count ≥ 0 for each of the {gate_up_proj.shape[0]} experts "
            f"summing to the {x.shape[0]} rows of x, got {len(counts)} counts summing to "
            f"{sum(counts)}"
        )
    out = torch.empty_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)
            out[rows] = _swiglu(x[rows] @ gate_up_proj[e].T, x.dtype) @ down_proj[e].T
            start += count
    return out


def experts_row_tiled(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, counts: list[int],
                      row_keys: Tensor) -> Tensor:
    """``experts_loop`` with each expert's GEMMs row-tiled on its rows' ``row_keys`` (int
    ``[m]``, the tokens' positions; ``glm_dsa.invariant.row_tiled``): a row's result depends on
    that row, its expert and its key only, whatever else the expert got. Returns ``[m, H]``."""
    _check_experts(x, gate_up_proj, down_proj)
    out = torch.empty_like(x)
    start = 0
    for e, count in enumerate(counts):
        if count:
            rows = slice(start, start + count)

            def expert(t: Tensor, e: int = e) -> Tensor:
                return F.linear(_swiglu(F.linear(t, gate_up_proj[e]), x.dtype), down_proj[e])

            out[rows] = invariant.row_tiled(expert, x[rows], row_keys[rows])
            start += count
    return out


_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_STACKED = ("gate_up_proj", "down_proj")


class Experts(nn.Module):
    """The routed experts' SwiGLU weights, stacked in transformers 5.x's layout.

    ``gate_up_proj: [E, 2I, H]``: rows ``:I`` of ``gate_up_proj[e]`` are expert ``e``'s
    ``gate_proj.weight``, rows ``I:`` its ``up_proj.weight``; ``down_proj: [E, H, I]``.

    The state dict keeps the checkpoint names instead, ``{e}.gate_proj.weight``,
    ``{e}.up_proj.weight``, ``{e}.down_proj.weight`` for ``e = 0 .. E-1`` in that order, whose
    values are views of the stacked parameters (so ``state_dict(keep_vars=True)`` yields views,
    not ``Parameter`` objects). ``load_state_dict`` takes those names and copies each tensor
    into its rows, naming absent ones as missing; a state dict with none of them may hold the
    stacked names instead. Assigning (``assign=True``) per-expert tensors is refused: a slice
    of a parameter cannot be replaced by another tensor.
    """

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * intermediate_size, hidden_size)
        )
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # nn.Linear's initialisation of each expert's weights: U(±1/sqrt(fan_in)).
        nn.init.uniform_(self.gate_up_proj, -hidden_size ** -0.5, hidden_size ** -0.5)
        nn.init.uniform_(self.down_proj, -intermediate_size ** -0.5, intermediate_size ** -0.5)
        self.register_state_dict_post_hook(_save_per_expert)
        self.register_load_state_dict_pre_hook(_load_per_expert)

    @property
    def num_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def weights(self, e: int) -> tuple[Tensor, Tensor, Tensor]:
        """Expert ``e``'s ``(gate_proj [I, H], up_proj [I, H], down_proj [H, I])`` weights, as
        views of the stacked parameters."""
        return _expert_views(self.gate_up_proj, self.down_proj, e)

    def forward(self, x: Tensor, rows: Tensor, offsets: Tensor,
                row_keys: Tensor | None = None) -> Tensor:
        """The pairs' expert outputs: ``x: [n, H]`` the token rows, ``rows: [P]`` int64 each
        pair's token row, grouped by expert (expert ``e``'s pairs end at ``offsets[e]``, int32
        ``[E]`` on ``x``'s device; pairs past ``offsets[-1]`` are not computed and their outputs
        are unspecified) → ``[P, H]`` in ``x.dtype``.

        ``experts_grouped_mm`` (no host synchronisation) for ``GROUPED_MM_DTYPES`` where
        ``F.grouped_mm`` takes the shapes (rows of ``H`` and ``I`` elements a multiple of 16
        bytes); otherwise ``experts_loop``, or ``experts_row_tiled`` on the tokens' ``row_keys``
        in batch-invariant mode, which read the counts to the host."""
        if invariant.active() and row_keys is None:
            raise ValueError("batch-invariant mode needs the rows' positions (row_keys) for the experts")
        row_bytes = (x.shape[-1] * x.element_size(), self.down_proj.shape[-1] * x.element_size())
        if (x.dtype in GROUPED_MM_DTYPES and all(b % 16 == 0 for b in row_bytes)
                and (not invariant.active() or fused_grouped_mm(x.device, x.dtype))):
            return experts_grouped_mm(x, self.gate_up_proj, self.down_proj, offsets, rows)
        counts = offsets.diff(prepend=offsets.new_zeros(1)).tolist()
        routed = rows[: sum(counts)]
        if row_keys is not None and invariant.active():
            out = experts_row_tiled(x[routed], self.gate_up_proj, self.down_proj, counts,
                                    row_keys[routed])
        else:
            out = experts_loop(x[routed], self.gate_up_proj, self.down_proj, counts)
        # The pairs past the routed ones (masked rows') read zero rows, never uninitialised memory.
        return torch.cat([out, out.new_zeros(rows.numel() - routed.numel(), out.shape[1])])


def fused_grouped_mm(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``F.grouped_mm`` runs torch's fused CUDA kernel (bf16 on sm90/sm100) for ``dtype``
    rows on ``device``. Its row results depend on the row and its expert only, whatever the other
    groups hold (``scripts/probe_cuda_invariance.py``, H200), so batch-invariant mode keeps it;
    elsewhere the mode loops over the experts on the host (``experts_row_tiled``)."""
    return (device.type == "cuda" and dtype == torch.bfloat16
            and fused_grouped_mm_on(torch.cuda.get_device_capability(device), dtype))


def fused_grouped_mm_on(capability: tuple[int, int], dtype: torch.dtype) -> bool:
    """``fused_grouped_mm``'s rule on a CUDA device of ``capability`` (``(major, minor)``):
    bf16 rows on sm90 / sm100."""
    return dtype == torch.bfloat16 and capability[0] in (9, 10)


def _expert_views(gate_up: Tensor, down: Tensor, e: int) -> tuple[Tensor, Tensor, Tensor]:
    """Expert ``e``'s ``(gate_proj, up_proj, down_proj)`` as views of the stacked tensors."""
    i = down.shape[2]
    return gate_up[e, :i], gate_up[e, i:], down[e]


def _checkpoint_names(gate_up: Tensor, down: Tensor, prefix: str) -> list[tuple[str, Tensor]]:
    """``(checkpoint name, view of the stacked tensor)`` in checkpoint order."""
    return [
        (f"{prefix}{e}.{proj}.weight", view)
        for e in range(gate_up.shape[0])
        for proj, view in zip(_PROJECTIONS, _expert_views(gate_up, down, e))
    ]


def _save_per_expert(experts: Experts, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook: the stacked entries become per-expert views, in place. They were
    the last two entries written (the module has no children), so the order is kept."""
    gate_up, down = (state_dict.pop(prefix + name) for name in _STACKED)
    state_dict.update(_checkpoint_names(gate_up, down, prefix))


def _load_per_expert(
    experts: Experts,
    state_dict: dict,
    prefix: str,
    local_metadata: dict,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load-state-dict pre-hook: copy the per-expert tensors into the stacked parameters and
    take their names out of ``state_dict``, so that torch neither reports them as unexpected
    nor the stacked names as missing."""
    with torch.no_grad():
        named = _checkpoint_names(experts.gate_up_proj, experts.down_proj, prefix)
    given = [name for name, _ in named if name in state_dict]
    stacked = [prefix + name for name in _STACKED if prefix + name in state_dict]
    if not given and stacked:
        return  # transformers' stacked names load as the parameters they are
    if given and stacked:
        error_msgs.append(f"{prefix}: holds both per-expert and stacked expert tensors; give one")
        return
    if given and local_metadata.get("assign_to_params_buffers", False):
        error_msgs.append(
            f"{prefix}: per-expert tensors fill slices of the stacked parameters and cannot be "
            f"assigned; load them without assign=True"
        )
        return
    with torch.no_grad():
        for name, view in named:
            if name not in state_dict:
                missing_keys.append(name)
                continue
            t = state_dict.pop(name)
            if t.shape != view.shape:
                error_msgs.append(
                    f"size mismatch for {name}: copying a param with shape {tuple(t.shape)} "
                    f"from checkpoint, the shape in current model is {tuple(view.shape)}."
                )
                continue
            view.copy_(t)
    # Already in place: the stacked entries are the parameters themselves (a no-op copy).
    state_dict[prefix + "gate_up_proj"] = experts.gate_up_proj
    state_dict[prefix + "down_proj"] = experts.down_proj


class MoEGate(nn.Module):
    """The router's weights: ``weight: [E, hidden]`` and ``e_score_correction_bias: [E]``.

    The bias is a float32 parameter (zeros until loaded; no gradient) and stays float32 when
    the model is cast to bf16/fp16: bf16 keeps 8 significant bits, coarser than the gaps
    between selection scores that the bias exists to decide, so rounding it would change which
    experts are chosen (HF's ``_keep_in_fp32_modules_strict`` does the same). Casting to float64
    widens it.
    """

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.e_score_correction_bias = nn.Parameter(
            torch.zeros(config.n_routed_experts, dtype=torch.float32), requires_grad=False
        )
        # Same initialisation as nn.Linear, so a freshly built model has sensible logits.
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def _apply(self, fn, recurse=True):
        # Every dtype cast (.to, .bfloat16, .half, ...) goes through _apply: undo a narrowing one.
        bias = self.e_score_correction_bias.detach()
        super()._apply(fn, recurse)
        moved = self.e_score_correction_bias
        if moved.dtype not in (torch.float32, torch.float64):
            self.e_score_correction_bias = nn.Parameter(
                bias.to(device=moved.device, dtype=torch.float32), requires_grad=False
            )
        return self

    def forward(self, x: Tensor, row_mask: Tensor | None = None,
                row_keys: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``route`` with this layer's weights and the config's routing settings."""
        c = self.config
        return route(
            x, self.weight, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, row_mask, row_keys,
        )


class MoE(nn.Module):
    """Routed experts plus the shared expert: ``out = sum_j w_j * expert_{id_j}(x) + shared(x)``.

    The rows run in blocks of ``glm_dsa.budget.moe_rows`` rows, so that the temporaries stay
    within a byte budget at any token count. Per block: the shared expert; the router; the
    (row, slot) pairs sorted by expert, with each expert's end offset found on the device; the
    routed experts' two grouped GEMMs over the pairs' gathered rows (``Experts``:
    ``experts_grouped_mm``; float64 loops over the experts, ``experts_loop``, with the same
    formula), in ``x.dtype``; then each row's weighted outputs summed in the compute dtype in
    ascending expert order (DeepSeek's loop, so the result is deterministic and
    backend-independent), the shared expert added with weight 1, and the sum cast to
    ``x.dtype`` (``combine_experts``). On CUDA with bf16 / fp16 / fp32 experts nothing reads
    the device from the host (no ``.item()``, ``.tolist()`` or data-dependent shape), so a
    CUDA graph can capture it; SwiGLU and the combine are one Triton pass each there.
    """

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.gate = MoEGate(config)
        self.experts = Experts(
            config.n_routed_experts, config.hidden_size, config.moe_intermediate_size
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.n_shared_experts * config.moe_intermediate_size)
            if config.n_shared_experts > 0
            else None
        )

    def block_rows(self, n: int, dtype: torch.dtype, device: torch.device | str,
                   budget_bytes: int | None) -> int:
        """Rows per block for ``n`` rows of ``dtype`` activations on ``device``
        (``glm_dsa.budget.moe_rows`` with this layer's shapes); all ``n`` for no budget. In
        batch-invariant mode whole tiles of ``invariant.row_tile(device)`` rows (at least one):
        every product there runs on such tiles, so a smaller block would only pad them."""
        c = self.config
        rows = moe_rows(n, c.num_experts_per_tok, c.hidden_size, c.moe_intermediate_size,
                        c.n_shared_experts * c.moe_intermediate_size, c.n_routed_experts,
                        dtype, fused.moe_single_pass(torch.device(device), dtype), budget_bytes)
        return invariant.whole_tiles(rows, n, torch.device(device))

    def forward(self, x: Tensor, row_mask: Tensor | None = None, row_keys: Tensor | None = None,
                budget_bytes: int | None = None) -> tuple[Tensor, Tensor]:
        """``x: [n, hidden]``, ``row_mask: [n]`` bool or None, ``row_keys: [n]`` int positions
        (needed in batch-invariant mode, ``glm_dsa.invariant``), ``budget_bytes``: the
        temporaries' bound (``glm_dsa.budget.moe_rows``; None: one block of all rows).

        Returns ``(out [n, hidden] in x.dtype, expert_counts int64 [E])``, the counts being the
        rows routed to each expert. Masked rows (``row_mask`` False; context parallel pads ranks
        with them) are not routed, are absent from the counts, and output exactly 0.
        """
        _check_rows(x, self.config.hidden_size, row_mask)
        expert_dtype = self.experts.gate_up_proj.dtype
        if x.dtype != expert_dtype:
            raise ValueError(
                f"x is {x.dtype} but the experts are {expert_dtype}; cast one to the other"
            )
        if row_keys is not None and row_keys.shape != (x.shape[0],):
            raise ValueError(f"row_keys must be [{x.shape[0]}] (one position per row of x), got "
                             f"shape {tuple(row_keys.shape)}")
        n = x.shape[0]
        block = self.block_rows(n, x.dtype, x.device, budget_bytes)
        out = torch.empty_like(x)
        counts = torch.zeros(self.config.n_routed_experts, dtype=torch.int64, device=x.device)
        for start in range(0, n, block):
            rows = slice(start, min(n, start + block))
            counts += self._block(
                x[rows], None if row_mask is None else row_mask[rows],
                None if row_keys is None else row_keys[rows], out[rows],
            )
        return out, counts

    def _block(self, x: Tensor, row_mask: Tensor | None, row_keys: Tensor | None,
               out: Tensor) -> Tensor:
        """One block's MoE written to ``out [n, hidden]``; returns its expert counts ``[E]``."""
        n = x.shape[0]
        top_k, num_experts = self.config.num_experts_per_tok, self.config.n_routed_experts
        shared = None if self.shared_experts is None else self.shared_experts(x, row_keys)
        topk_ids, topk_weights = self.gate(x, row_mask, row_keys)  # [n, top_k] each

        # Pair p = row * top_k + slot. Masked pairs (id -1) get key E and sort past every expert,
        # so `order` lists the routed pairs grouped by ascending expert, then the masked ones.
        keys = torch.where(topk_ids >= 0, topk_ids, num_experts).reshape(-1)  # [P]
        sorted_keys, order = torch.sort(keys, stable=True)  # [P] each
        # Expert e's pairs end where the keys first exceed e: found on the device, where
        # bincount would synchronise to size its output.
        experts = torch.arange(num_experts, device=x.device)
        offsets = torch.searchsorted(sorted_keys, experts, right=True, out_int32=True)  # [E]
        del keys, sorted_keys
        expert_out = self.experts(x, order // top_k, offsets, row_keys)  # [P, hidden], sorted

        # Row t's pairs in ascending sorted position are its experts in ascending order
        # (DeepSeek's loop order), with the routing weights gathered alongside.
        pair_index = torch.arange(order.numel(), device=x.device)
        position = torch.empty_like(order).scatter_(0, order, pair_index)  # [P] inverse of order
        position, slot = position.view(n, top_k).sort(dim=1)  # [n, top_k] each
        combine_experts(expert_out, position, topk_weights.gather(1, slot), shared, row_mask, out)
        return offsets.diff(prepend=offsets.new_zeros(1)).to(torch.int64)
