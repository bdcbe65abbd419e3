"""Hugging Face transformers interop: run HF's ``glm_moe_dsa`` on glm-dsa's weights.

The checkpoint names are shared (``glm_dsa.weights`` reads and writes them), but transformers
5.x keeps each MoE layer's experts fused in two 3-D parameters: ``mlp.experts.gate_up_proj
[E, 2I, H]`` (gate rows, then up rows) and ``mlp.experts.down_proj [E, H, I]``. glm-dsa's
``moe.Experts`` holds exactly those parameters (its state dict translates them to the
per-expert checkpoint names), so ``hf_model`` hands the model's parameters over as they are;
``hf_state_dict`` also fuses a checkpoint-named state dict. transformers is not a dependency
of glm-dsa: only ``hf_model`` imports it.

HF differs from glm-dsa on purpose in ways a comparison must account for (see
``docs/performance.md``): its indexer is unquantized bf16/fp32 without the Hadamard rotation,
its attention is dense over the expanded K/V with the top-k as a mask, and its latent norms
(``q_a_layernorm``, ``kv_a_layernorm``) use eps 1e-6 whatever ``rms_norm_eps`` says, so the two
compute the same function only for a config with ``rms_norm_eps = 1e-6``.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from glm_dsa.config import DSAConfig, to_hf_config
from glm_dsa.layer import DSAForCausalLM

__all__ = ["hf_state_dict", "hf_model"]

_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_state_dict(state: dict[str, Tensor], config: DSAConfig) -> dict[str, Tensor]:
    """glm-dsa state dict → the state dict of transformers' ``GlmMoeDsaModel``.

    Args:
        state: ``DSAForCausalLM.state_dict()``-style tensors (``model.`` prefix, ``lm_head``),
            each MoE layer's experts under the per-expert checkpoint names or already stacked
            (``DSAForCausalLM.named_parameters()``: ``mlp.experts.gate_up_proj`` / ``down_proj``).
        config: the model's config (expert count per MoE layer).

    Returns:
        Names without the ``model.`` prefix (``GlmMoeDsaModel`` is the decoder stack); each MoE
        layer's per-expert tensors fused into ``mlp.experts.gate_up_proj`` /
        ``mlp.experts.down_proj``; ``lm_head`` dropped. Fused tensors are new; the others,
        stacked ones included, are the given tensors.

    Raises:
        ValueError: an MoE layer whose experts are not all present.
    """
    out: dict[str, Tensor] = {}
    experts: dict[str, dict[str, dict[int, Tensor]]] = {}
    for name, t in state.items():
        if name.startswith("lm_head."):
            continue
        if not name.startswith("model."):
            raise ValueError(f"unexpected tensor {name!r}: names start with 'model.' or 'lm_head.'")
        m = _EXPERT.match(name)
        if m is None:
            out[name[len("model."):]] = t
            continue
        prefix, e, proj = m.group(1)[len("model."):], int(m.group(2)), m.group(3)
        experts.setdefault(prefix, {}).setdefault(proj, {})[e] = t
    n = config.n_routed_experts
    for prefix, projs in experts.items():
        for proj in ("gate_proj", "up_proj", "down_proj"):
            have = sorted(projs.get(proj, {}))
            if have != list(range(n)):
                raise ValueError(f"{prefix}: {proj} present for {len(have)} of {n} experts")
        stack = {proj: torch.stack([projs[proj][e] for e in range(n)]) for proj in projs}
        out[f"{prefix}.gate_up_proj"] = torch.cat([stack["gate_proj"], stack["up_proj"]], dim=1)
        out[f"{prefix}.down_proj"] = stack["down_proj"]
    return out


def hf_model(
    model: DSAForCausalLM, attn_implementation: str = "sdpa", experts_implementation: str = "grouped_mm"
) -> nn.Module:
    """transformers' ``GlmMoeDsaModel`` holding ``model``'s config and weights.

    ``model`` is a ``DSAForCausalLM``. The HF modules are built on the meta device and then
    take ``model``'s parameters, the stacked experts included (shared, not copied; dtypes and
    device kept, so the router bias stays float32 as HF keeps it). Requires
    transformers ≥ 5.17 (``pip install -e ".[hf]"``); raises ImportError otherwise.

    ``attn_implementation``: ``"sdpa"`` (HF's default) or ``"eager"``; ``experts_implementation``:
    ``"grouped_mm"`` (HF's default; float32/bf16 only) or ``"eager"`` (a loop, any dtype).
    """
    try:
        from transformers import GlmMoeDsaConfig, GlmMoeDsaModel
    except ImportError as e:
        raise ImportError(f"hf_model needs transformers >= 5.17 with glm_moe_dsa ({e}); install "
                          f"it with: pip install -e '.[hf]'") from e

    config = model.config
    hf_config = GlmMoeDsaConfig(**to_hf_config(config))
    hf_config._attn_implementation = attn_implementation
    hf_config._experts_implementation = experts_implementation
    param = next(model.parameters())
    with torch.device("meta"):
        hf = GlmMoeDsaModel(hf_config)
    # named_parameters, not state_dict: its names for the experts are transformers' own.
    state = hf_state_dict(dict(model.named_parameters()), config)
    hf.load_state_dict(state, strict=True, assign=True)
    # Buffers that are not in the state dict (RoPE tables) are rebuilt on the real device.
    with torch.device(param.device):
        hf.rotary_emb = type(hf.rotary_emb)(hf_config)
    return hf.eval()
