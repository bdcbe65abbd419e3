"""The decoder layer and the layer stack, with shared-layer top-k reuse.

A layer is ``h = x + attn(input_layernorm(x))``, ``out = h + ffn(post_attention_layernorm(h))``.
Full layers run the indexer and hand their top-k on; shared layers own no indexer and attend
over the top-k of the nearest earlier full layer (``config.indexer_types``). Module names follow
the Hugging Face checkpoints (``model.layers.{i}.self_attn.indexer.wq_b`` …), so a state dict
maps one to one onto a ``glm_moe_dsa`` checkpoint.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from glm_dsa.batch import ForwardBatch
from glm_dsa.cache import KVCache
from glm_dsa.config import DSAConfig
from glm_dsa.indexer import Indexer
from glm_dsa.mla import MLA
from glm_dsa.moe import MLP, MoE
from glm_dsa.norm import RMSNorm

if TYPE_CHECKING:
    from glm_dsa.cp import CPChunk

__all__ = ["DecoderLayer", "DSAModel", "DSAForCausalLM", "LayerTimes"]


@dataclass
class LayerTimes:
    """Wall seconds spent per component, summed over layers (filled only when timing is on)."""

    projections: float = 0.0
    indexer: float = 0.0
    attention: float = 0.0
    moe: float = 0.0


class _Timer:
    """Accumulates wall time per component; synchronizes CUDA so the split is real."""

    def __init__(self, times: LayerTimes | None, device: torch.device) -> None:
        self.times, self.device = times, device
        self._t = 0.0

    def start(self) -> None:
        if self.times is not None:
            self._t = self._now()

    def stop(self, component: str) -> None:
        if self.times is not None:
            now = self._now()
            setattr(self.times, component, getattr(self.times, component) + now - self._t)
            self._t = now

    def _now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()


class DecoderLayer(nn.Module):
    """One GLM-5.3 DSA layer: MLA (+ indexer on full layers) and a dense MLP or MoE FFN."""

    def __init__(self, config: DSAConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_full = config.is_full(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLA(config)
        if self.is_full:
            # Registered under self_attn so the state-dict name is HF's `self_attn.indexer.*`.
            self.self_attn.indexer = Indexer(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(config) if config.is_moe(layer_idx) else MLP(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        topk: torch.Tensor | None,
        budget_bytes: int,
        row_mask: torch.Tensor | None = None,
        times: LayerTimes | None = None,
        cp: CPChunk | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the layer on the batch's query tokens.

        Args:
            x: ``[n, hidden]`` residual stream of the query tokens.
            batch: ragged metadata; this layer's KV (and index K) are written at ``out_slots``.
            cache: the pools; the context is read back through ``batch.kv_slots``.
            topk: int32 ``[n, index_topk]`` request-relative top-k of the previous full layer
                (required on shared layers, ignored on full ones).
            budget_bytes: memory budget for indexer logits rows and the sparse-attention gather.
            row_mask: bool ``[n]``; False rows are padding and stay out of MoE routing.
            cp: context parallel (None: one rank). ``x`` and ``batch`` are then this rank's
                rows; the chunk's latent rows and index keys are gathered from every rank and
                written at the whole chunk's slots (``glm_dsa.cp``).
        Returns:
            ``(out [n, hidden], topk)``: the topk this layer used, for the next shared layer.
        """
        timer = _Timer(times, x.device)
        timer.start()
        h_in = self.input_layernorm(x)
        proj = self.self_attn.project(h_in, batch.positions)
        kv_latent, out_slots = proj.kv_latent, batch.out_slots
        if cp is not None:  # every rank stores the whole chunk's rows
            kv_latent, out_slots = cp.gather(kv_latent, "latent_allgather"), cp.out_slots
        cache.write_mla(self.layer_idx, out_slots, kv_latent)
        timer.stop("projections")
        if self.is_full:
            topk = self.self_attn.indexer(
                h_in, proj.q_latent, batch, cache.index_k[self.layer_idx], budget_bytes, cp
            )
            cache.record_index_k_write(out_slots.numel())
            timer.stop("indexer")
        elif topk is None:
            raise ValueError(f"shared layer {self.layer_idx} needs the top-k of an earlier full layer")
        kv_context = cache.read_mla(self.layer_idx, batch.kv_slots, x.dtype)
        attn = self.self_attn.attend(proj, kv_context, batch, topk, budget_bytes)
        timer.stop("attention")
        h = x + attn
        ffn_in = self.post_attention_layernorm(h)
        if isinstance(self.mlp, MoE):
            ffn, _ = self.mlp(ffn_in, row_mask)
        else:
            ffn = self.mlp(ffn_in)
            if row_mask is not None:
                ffn = ffn * row_mask.unsqueeze(-1).to(ffn.dtype)
        timer.stop("moe")
        return h + ffn, topk


class DSAModel(nn.Module):
    """``model.*`` of the checkpoint: token embedding, the layer stack and the final norm."""

    def __init__(self, config: DSAConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        inputs: torch.Tensor,
        batch: ForwardBatch,
        cache: KVCache,
        budget_bytes: int,
        row_mask: torch.Tensor | None = None,
        times: LayerTimes | None = None,
        cp: CPChunk | None = None,
    ) -> torch.Tensor:
        """``inputs``: int64 token ids ``[n]`` or hidden states ``[n, hidden]``; returns the last
        layer's output ``[n, hidden]`` before the final norm. ``cp``: see ``DecoderLayer``;
        ``glm_dsa.cp.CPGroup.forward`` runs a context-parallel step through here."""
        if inputs.dtype == torch.int64:
            x = self.embed_tokens(inputs)
        elif inputs.is_floating_point() and inputs.dim() == 2:
            x = inputs
        else:
            raise ValueError(
                f"inputs must be int64 token ids [n] or hidden states [n, hidden], got {inputs.dtype} "
                f"{tuple(inputs.shape)}"
            )
        topk = None
        for layer in self.layers:
            x, topk = layer(x, batch, cache, topk, budget_bytes, row_mask, times, cp)
        return x


class DSAForCausalLM(nn.Module):
    """The stack plus ``lm_head``; logits are computed for each request's last position only."""

    def __init__(self, config: DSAConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DSAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def logits(self, hidden_last: torch.Tensor) -> torch.Tensor:
        """``hidden_last [r, hidden]`` (before the final norm) → float32 logits ``[r, vocab]``."""
        h = self.model.norm(hidden_last)
        return torch.nn.functional.linear(h.float(), self.lm_head.weight.float())
