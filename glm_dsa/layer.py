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

import torch
from torch import nn

from glm_dsa import fused, invariant
from glm_dsa.backend import REFERENCE, Backend
from glm_dsa.batch import LATENT_ALLGATHER, ForwardBatch, RowGather
from glm_dsa.budget import Budgets
from glm_dsa.cache import KVCache
from glm_dsa.config import DSAConfig
from glm_dsa.mla import MLA
from glm_dsa.moe import MLP, MoE
from glm_dsa.norm import RMSNorm

__all__ = ["DecoderLayer", "DSAModel", "DSAForCausalLM", "LayerTimes", "StepContext", "StepObserver"]


@dataclass
class LayerTimes:
    """Wall seconds spent per component, summed over layers (filled only when timing is on)."""

    projections: float = 0.0
    indexer: float = 0.0
    attention: float = 0.0
    moe: float = 0.0


class StepObserver:
    """What a step's layers hand to whoever watches the step (``PrefillEngine(observer=)``,
    ``glm_dsa.fidelity``, the engine's ``layer_outputs``). Each method does nothing here; an
    observer overrides those it needs. The tensors are the step's own (detach or copy what is
    kept); a step run from CUDA graphs calls no observer, so an engine with one runs eagerly."""

    def attention_input(self, layer: DecoderLayer, h_in: torch.Tensor) -> None:
        """``layer``'s attention input ``input_layernorm(x)`` ``[n, hidden]``."""

    def topk(self, layer: DecoderLayer, topk_indices: torch.Tensor) -> None:
        """A full ``layer``'s indexer top-k, int32 ``[n, index_topk]`` request-relative."""

    def layer_output(self, layer: DecoderLayer, out: torch.Tensor,
                     topk_indices: torch.Tensor | None) -> None:
        """``layer``'s output ``[n, hidden]`` and the top-k it attended over."""


@dataclass(frozen=True)
class StepContext:
    """What every layer of one prefill step shares besides its input.

    Attributes:
        batch: ragged metadata; each layer's KV (and index K) are written at ``out_slots`` and
            the context is read back through ``kv_slots``.
        cache: the pools.
        budgets: the indexer-logits and attention row-chunk byte budgets (``glm_dsa.budget``).
        backend: the indexer top-k and attention implementations, and the fused passes every
            layer half runs under (``glm_dsa.backend``).
        row_mask: bool ``[n]``; False rows are padding and stay out of MoE routing.
        times: per-component wall seconds are added here when given.
        observer: told each layer's attention input, top-k and output when given.
        cp_chunk: context parallel (None: one rank). The step's ``x`` and ``batch`` are then
            this rank's rows; the chunk's latent rows and index keys are gathered from every
            rank and written at the whole chunk's slots.
    """

    batch: ForwardBatch
    cache: KVCache
    budgets: Budgets
    backend: Backend = REFERENCE
    row_mask: torch.Tensor | None = None
    times: LayerTimes | None = None
    cp_chunk: RowGather | None = None
    observer: StepObserver | None = None


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
    """One GLM-5.3 DSA layer: MLA (with its indexer on full layers) and a dense MLP or MoE FFN."""

    def __init__(self, config: DSAConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.is_full = config.is_full(layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLA(config, has_indexer=self.is_full)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp: nn.Module = (
            MoE(config) if config.is_moe(layer_idx) else MLP(config.hidden_size, config.intermediate_size)
        )

    def forward(
        self, x: torch.Tensor, step: StepContext, topk_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``h = x + attn(input_layernorm(x))``, ``out = h + ffn(post_attention_layernorm(h))``,
        writing this step's KV (and index K) on the way.

        Args:
            x: ``[n, hidden]`` residual stream of the query tokens.
            step: the step's batch, cache, budgets, backend, padding mask, timer and CP chunk.
            topk_indices: int32 ``[n, index_topk]`` request-relative top-k of the previous full
                layer (required on shared layers, ignored on full ones).
        Returns:
            ``(out [n, hidden], topk_indices)``: the top-k this layer used, for the next shared
            layer.
        """
        h, topk_indices = self.attention_block(x, step, topk_indices)
        out = self.ffn_block(h, step)
        if step.observer is not None:
            step.observer.layer_output(self, out, topk_indices)
        return out, topk_indices

    def attention_block(
        self, x: torch.Tensor, step: StepContext, topk_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first half of ``forward``: ``(h = x + attn(input_layernorm(x)) [n, hidden],
        topk_indices)``, this step's KV (and index K) written. ``glm_dsa.graphs`` captures the
        halves as separate pieces where the FFN cannot be captured."""
        with fused.using(step.backend.passes):
            return self._attention_block(x, step, topk_indices)

    def _attention_block(
        self, x: torch.Tensor, step: StepContext, topk_indices: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        attn, batch, cache, cp_chunk = self.self_attn, step.batch, step.cache, step.cp_chunk
        timer = _Timer(step.times, x.device)
        timer.start()
        h_in = self.input_layernorm(x)
        if step.observer is not None:
            step.observer.attention_input(self, h_in)
        proj = attn.project(h_in, batch.positions)
        cache.write_mla(self.layer_idx, *_whole_chunk(proj.kv_latent, batch, cp_chunk))
        timer.stop("projections")
        if attn.indexer is not None:  # writes this step's index K, then scores the context
            topk_indices = attn.indexer(h_in, proj.q_latent, batch, cache.index_k[self.layer_idx],
                                        step.budgets.logits_bytes, cp_chunk, step.backend.indexer_topk)
            timer.stop("indexer")
            if step.observer is not None:
                step.observer.topk(self, topk_indices)
        elif topk_indices is None:
            raise ValueError(f"shared layer {self.layer_idx} needs the top-k of an earlier full layer")
        h = x + step.backend.attend(attn, proj, cache, self.layer_idx, batch, topk_indices,
                                    step.budgets.attention_bytes)
        timer.stop("attention")
        return h, topk_indices

    def ffn_block(self, h: torch.Tensor, step: StepContext) -> torch.Tensor:
        """The second half of ``forward``: ``h + ffn(post_attention_layernorm(h))`` ``[n, hidden]``."""
        timer = _Timer(step.times, h.device)
        timer.start()
        with fused.using(step.backend.passes):
            out = h + self._ffn(self.post_attention_layernorm(h), step.row_mask,
                                step.batch.positions, step.budgets.moe_bytes)
        timer.stop("moe")
        return out

    def _ffn(self, x: torch.Tensor, row_mask: torch.Tensor | None, positions: torch.Tensor,
             moe_bytes: int) -> torch.Tensor:
        """The MoE (its temporaries within ``moe_bytes``) or dense MLP; padding rows
        (``row_mask`` False) give exactly 0."""
        if isinstance(self.mlp, MoE):
            return self.mlp(x, row_mask, positions, moe_bytes)[0]
        out = self.mlp(x, positions)
        return out if row_mask is None else out * row_mask.unsqueeze(-1).to(out.dtype)


def _whole_chunk(kv_latent: torch.Tensor, batch: ForwardBatch, cp_chunk: RowGather | None):
    """``(slots, rows)`` to store: this step's rows, gathered from every rank under CP."""
    if cp_chunk is None:
        return batch.out_slots, kv_latent
    return cp_chunk.out_slots, cp_chunk.gather(kv_latent, LATENT_ALLGATHER)


class DSAModel(nn.Module):
    """``model.*`` of the checkpoint: token embedding, the layer stack and the final norm."""

    def __init__(self, config: DSAConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, inputs: torch.Tensor, step: StepContext) -> torch.Tensor:
        """``inputs``: int64 token ids ``[n]`` or hidden states ``[n, hidden]``; returns the last
        layer's output ``[n, hidden]`` before the final norm. ``step``: see ``StepContext``
        (the context-parallel driver passes this rank's share of the step)."""
        x = self.input_rows(inputs)
        topk_indices = None
        for layer in self.layers:
            x, topk_indices = layer(x, step, topk_indices)
        return x

    def input_rows(self, inputs: torch.Tensor) -> torch.Tensor:
        """The first layer's input ``[n, hidden]``: ``inputs`` embedded when token ids (int64
        ``[n]``), as given when hidden states ``[n, hidden]``."""
        if inputs.dtype == torch.int64:
            return self.embed_tokens(inputs)
        if inputs.is_floating_point() and inputs.dim() == 2:
            return inputs
        raise ValueError(
            f"inputs must be int64 token ids [n] or hidden states [n, hidden], got {inputs.dtype} "
            f"{tuple(inputs.shape)}"
        )


# Rows per lm_head call on CUDA in batch-invariant mode (``glm_dsa.invariant.row_wise``).
_HEAD_TILE = 16


class DSAForCausalLM(nn.Module):
    """The stack plus ``lm_head``; logits are computed for each request's last position only."""

    def __init__(self, config: DSAConfig) -> None:
        super().__init__()
        self.config = config
        self.model = DSAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def logits(self, hidden_last: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """``hidden_last [r, hidden]`` (before the final norm) → float32 logits ``[r, vocab]``;
        ``positions [r]``: the rows' positions, needed in batch-invariant mode."""
        h = self.model.norm(hidden_last)
        # One row per request finishing in the step: CUDA tiles of a few rows, not of a chunk's.
        return invariant.linear(h.float(), self.lm_head.weight.float(), positions, cuda_tile=_HEAD_TILE)
