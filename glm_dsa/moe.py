"""noaux_tc mixture of experts: sigmoid router with a selection-only bias, routed experts run
grouped by expert, a shared expert, and the dense MLP of the first layers (CONVENTIONS §8).

Weight names follow the Hugging Face checkpoints under ``model.layers.{i}.mlp.``:
``gate.weight``, ``gate.e_score_correction_bias``, ``experts.{e}.{gate,up,down}_proj.weight``,
``shared_experts.{gate,up,down}_proj.weight``; a dense layer's ``MLP`` owns
``{gate,up,down}_proj.weight`` directly.

"Compute dtype" is ``torch.promote_types(x.dtype, torch.float32)``: float32 for bf16/fp32
activations (the DeepSeek/HF convention ``x.float() @ gate.weight.float().T``), float64 for
float64 activations so that float64 tests reach ~1e-12.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from glm_dsa.config import DSAConfig

__all__ = ["route", "MLP", "MoEGate", "MoE"]

# Keeps an all-zero score row from dividing by zero; the value HF and vLLM use.
_NORM_EPS = 1e-20


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
    on ties (a stable sort), so the choice never depends on the backend's top-k tie-breaking."""
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]


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
) -> tuple[Tensor, Tensor]:
    """noaux_tc routing of each row of ``x`` to ``top_k`` experts.

    ``x: [n, hidden]`` float; ``gate_weight: [E, hidden]`` (any float dtype, upcast to the
    compute dtype); ``e_score_correction_bias: [E]`` float32 or float64 (a bf16 bias has
    already lost the precision that decides expert choice, so it is refused);
    ``row_mask: [n]`` bool or None.

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
    _check_rows(x, None, row_mask)
    n, hidden = x.shape
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

    cd = _compute_dtype(x.dtype)
    scores = torch.sigmoid(x.to(cd) @ gate_weight.to(cd).T)  # [n, E]
    selection = scores + e_score_correction_bias.to(cd)  # [n, E]
    if n_group > 1:
        grouped = selection.view(n, n_group, group_size)
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [n, G]
        kept = torch.zeros(n, n_group, dtype=torch.bool, device=x.device)
        kept.scatter_(1, _stable_top(group_scores, topk_group), True)
        selection = grouped.masked_fill(~kept[:, :, None], float("-inf")).view(n, num_experts)
    topk_ids = _stable_top(selection, top_k)  # [n, top_k]
    topk_weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + _NORM_EPS)
    topk_weights = topk_weights * routed_scaling_factor
    if row_mask is not None:
        topk_ids = topk_ids.masked_fill(~row_mask[:, None], -1)
        topk_weights = topk_weights.masked_fill(~row_mask[:, None], 0.0)
    return topk_ids, topk_weights


class MLP(nn.Module):
    """SwiGLU feed-forward ``down(silu(gate x) * up x)``, bias-free: an expert, the shared
    expert, or the dense MLP of layers below ``first_k_dense_replace``.

    ``silu`` and the product run in the compute dtype and are cast back to ``x.dtype`` before
    ``down_proj`` (DeepSeek's ``Expert``): ``[..., hidden] -> [..., hidden]`` in ``x.dtype``.
    """

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        weight = self.gate_proj.weight
        if x.shape[-1] != weight.shape[1] or x.dtype != weight.dtype:
            raise ValueError(
                f"MLP expects [..., {weight.shape[1]}] {weight.dtype} input, got shape "
                f"{tuple(x.shape)} dtype {x.dtype}; cast the module or the activations"
            )
        cd = _compute_dtype(x.dtype)
        h = F.silu(self.gate_proj(x).to(cd)) * self.up_proj(x).to(cd)
        return self.down_proj(h.to(x.dtype))


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

    def forward(self, x: Tensor, row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``route`` with this layer's weights and the config's routing settings."""
        c = self.config
        return route(
            x, self.weight, self.e_score_correction_bias, c.num_experts_per_tok, c.n_group,
            c.topk_group, c.norm_topk_prob, c.routed_scaling_factor, row_mask,
        )


class MoE(nn.Module):
    """Routed experts plus the shared expert: ``out = sum_j w_j * expert_{id_j}(x) + shared(x)``.

    Routed experts run grouped: the (row, slot) pairs are sorted by expert and each active
    expert runs its three GEMMs once on its rows, in ``x.dtype``. Each row's weighted outputs
    are summed in the compute dtype in ascending expert order (DeepSeek's loop, so the result
    is deterministic and backend-independent), the shared expert is added with weight 1, and
    the sum is cast to ``x.dtype``. Memory beyond the weights: ``[n * top_k, hidden]`` expert
    outputs in ``x.dtype`` plus ``[n, hidden]`` temporaries.
    """

    def __init__(self, config: DSAConfig):
        super().__init__()
        self.config = config
        self.gate = MoEGate(config)
        self.experts = nn.ModuleList(
            MLP(config.hidden_size, config.moe_intermediate_size)
            for _ in range(config.n_routed_experts)
        )
        self.shared_experts = (
            MLP(config.hidden_size, config.n_shared_experts * config.moe_intermediate_size)
            if config.n_shared_experts > 0
            else None
        )

    def forward(self, x: Tensor, row_mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``x: [n, hidden]``, ``row_mask: [n]`` bool or None.

        Returns ``(out [n, hidden] in x.dtype, expert_counts int64 [E])``, the counts being the
        rows routed to each expert. Masked rows (``row_mask`` False; context parallel pads ranks
        with them) are not routed, are absent from the counts, and output exactly 0.
        Reads the counts to the host once; no per-token or per-expert synchronisation.
        """
        _check_rows(x, self.config.hidden_size, row_mask)
        expert_dtype = self.experts[0].gate_proj.weight.dtype
        if x.dtype != expert_dtype:
            raise ValueError(
                f"x is {x.dtype} but the experts are {expert_dtype}; cast one to the other"
            )
        n, hidden = x.shape
        top_k, num_experts = self.config.num_experts_per_tok, self.config.n_routed_experts
        topk_ids, topk_weights = self.gate(x, row_mask)  # [n, top_k] each

        # Pair p = row * top_k + slot. Masked pairs (id -1) get key E and sort past every expert,
        # so `order` lists the routed pairs grouped by ascending expert, then the masked ones.
        keys = torch.where(topk_ids >= 0, topk_ids, num_experts).reshape(-1)  # [P]
        sorted_keys, order = torch.sort(keys, stable=True)  # [P] each
        # Counts from the sorted keys rather than bincount, which syncs on CUDA to size its output.
        experts = torch.arange(num_experts + 1, device=x.device)
        expert_counts = torch.searchsorted(sorted_keys, experts).diff()  # [E]
        counts = expert_counts.tolist()  # the one host sync
        rows = order // top_k  # [P] row of each pair, in sorted order

        expert_out = x.new_empty(n * top_k, hidden)  # [P, hidden], sorted order
        # Masked pairs read the tail below; zeros keep uninitialised memory (NaN) out of `out`.
        expert_out[sum(counts) :].zero_()
        start = 0
        for e, count in enumerate(counts):
            if count:
                chosen = rows[start : start + count]
                expert_out[start : start + count] = self.experts[e](x[chosen])
                start += count

        # Each row's outputs are summed in ascending expert order (DeepSeek's loop order): a
        # row's positions in the sorted order ascend with its experts.
        pair_index = torch.arange(order.numel(), device=x.device)
        position = torch.empty_like(order).scatter_(0, order, pair_index)  # [P] inverse of order
        position = position.view(n, top_k).sort(dim=1).values  # [n, top_k]
        weights = topk_weights.reshape(-1)[order]  # [P], sorted order
        out = torch.zeros(n, hidden, dtype=_compute_dtype(x.dtype), device=x.device)
        for slot in range(top_k):
            p = position[:, slot]
            out += expert_out[p].to(out.dtype) * weights[p, None]

        if self.shared_experts is not None:
            out += self.shared_experts(x).to(out.dtype)
        if row_mask is not None:
            out.masked_fill_(~row_mask[:, None], 0.0)
        return out.to(x.dtype), expert_counts
