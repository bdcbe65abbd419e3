"""Checkpoint I/O in Hugging Face form: ``config.json`` + ``model.safetensors`` with HF names.

Names are the model's own state-dict keys, which are HF's (``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` …). FP8 checkpoints store e4m3 weights
with a float32 ``weight_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]``; the weight is
``W_fp8 * scale`` per 128×128 block and is dequantized at load. Never quantized (docs/conventions.md
§10): the router ``mlp.gate.*``, ``indexer.weights_proj``, norms, biases, the embedding and the
LM head.

Loading is strict: every missing, unexpected, mis-shaped or mis-typed tensor is collected and
reported in one ``CheckpointError`` listing each key. Shared layers carry no indexer tensors;
the MTP layer (index ``num_hidden_layers``) is ignored.
"""

from __future__ import annotations

import json
import math
import os
import re

import torch
from safetensors.torch import load_file, save_file

from glm_dsa.config import DSAConfig, from_hf_config, keep_layers, parse_layers, to_hf_config
from glm_dsa.fp8 import FP8_E4M3_MAX
from glm_dsa.layer import DSAForCausalLM

__all__ = [
    "CheckpointError",
    "is_quantizable",
    "block_quantize_weight",
    "block_dequantize_weight",
    "state_dict_for_save",
    "load_state_dict",
    "save_checkpoint",
    "build_model",
    "load_checkpoint",
    "init_weights",
]

WEIGHT_BLOCK = 128
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_NEVER_QUANTIZED = re.compile(
    r"(^lm_head\.|^model\.embed_tokens\.|norm\.|\.mlp\.gate\.|indexer\.weights_proj\.|\.bias$|_bias$)"
)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model; ``problems`` maps each key to what is wrong."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = dict(sorted(problems.items()))
        lines = "\n".join(f"  {k}: {v}" for k, v in self.problems.items())
        super().__init__(f"{len(self.problems)} checkpoint problem(s):\n{lines}")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is stored in FP8 in a block-quantized checkpoint (2-D linear weights only)."""
    return tensor.dim() == 2 and name.endswith(".weight") and not _NEVER_QUANTIZED.search(name)


def block_quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` → (e4m3 ``[out, in]``, float32 ``weight_scale_inv [ceil(out/128), ceil(in/128)]``).

    Scale per 128×128 block is ``amax / 448`` (``amax`` floored at 1e-4 so zero blocks stay finite).
    """
    out_f, in_f = w.shape
    bo, bi = math.ceil(out_f / WEIGHT_BLOCK), math.ceil(in_f / WEIGHT_BLOCK)
    padded = torch.zeros(bo * WEIGHT_BLOCK, bi * WEIGHT_BLOCK, dtype=torch.float32)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(bo, WEIGHT_BLOCK, bi, WEIGHT_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale = amax / FP8_E4M3_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(bo * WEIGHT_BLOCK, bi * WEIGHT_BLOCK)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def block_dequantize_weight(w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W = W_fp8 * scale_inv`` per 128×128 block, returned in ``dtype``.

    The product is taken in float32 (upstream's ``weight_dequant``), or in float64 for a float64
    target, where it is exact.
    """
    out_f, in_f = w_fp8.shape
    cdt = torch.promote_types(dtype, torch.float32)
    expand = scale_inv.repeat_interleave(WEIGHT_BLOCK, 0)[:out_f].repeat_interleave(WEIGHT_BLOCK, 1)[:, :in_f]
    return (w_fp8.to(cdt) * expand.to(cdt)).to(dtype)


def state_dict_for_save(model: DSAForCausalLM, fp8: bool = False) -> dict[str, torch.Tensor]:
    """The tensors to write: the model's state dict, block-quantized where ``fp8`` and allowed."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        t = t.detach().cpu().contiguous()
        if fp8 and is_quantizable(name, t):
            q, s = block_quantize_weight(t)
            out[name] = q
            out[name[: -len("weight")] + "weight_scale_inv"] = s
        else:
            out[name] = t
    return out


def _ignored(name: str, config: DSAConfig) -> bool:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    return m is not None and int(m.group(1)) >= config.num_hidden_layers


def load_state_dict(model: DSAForCausalLM, tensors: dict[str, torch.Tensor], strict: bool = True) -> None:
    """Copy ``tensors`` (HF names, bf16/fp16/fp32 or FP8 + ``weight_scale_inv``) into ``model``.

    Each tensor is converted to the dtype of the parameter it fills. With ``strict`` every
    problem raises one ``CheckpointError``; otherwise only shape/dtype problems do and
    missing/unexpected keys are skipped.
    """
    config = model.config
    expected = model.state_dict()
    problems: dict[str, str] = {}
    scales = {k for k in tensors if k.endswith(".weight_scale_inv")}
    used_scales: set[str] = set()
    loaded: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in scales or _ignored(name, config):
            continue
        if name not in expected:
            if strict:
                problems[name] = "unexpected tensor (not in this model)"
            continue
        target = expected[name]
        if tuple(t.shape) != tuple(target.shape):
            problems[name] = f"shape {tuple(t.shape)}, expected {tuple(target.shape)}"
            continue
        if t.is_floating_point() and not bool(torch.isfinite(t.float()).all()):
            problems[name] = "holds NaN or inf"
            continue
        if t.dtype == torch.float8_e4m3fn:
            scale_name = name[: -len("weight")] + "weight_scale_inv"
            if not is_quantizable(name, target):
                problems[name] = "stored in FP8, but this tensor is never quantized"
                continue
            if scale_name not in tensors:
                problems[name] = f"FP8 weight without its scale {scale_name}"
                continue
            s = tensors[scale_name]
            want = (math.ceil(t.shape[0] / WEIGHT_BLOCK), math.ceil(t.shape[1] / WEIGHT_BLOCK))
            if s.dtype != torch.float32 or tuple(s.shape) != want:
                problems[scale_name] = f"{s.dtype} {tuple(s.shape)}, expected torch.float32 {want}"
                continue
            used_scales.add(scale_name)
            loaded[name] = block_dequantize_weight(t, s, target.dtype)
        elif t.dtype in _FLOAT_DTYPES:
            if name.endswith("e_score_correction_bias") and t.dtype != torch.float32:
                problems[name] = f"dtype {t.dtype}, expected torch.float32 (router bias)"
                continue
            loaded[name] = t.to(target.dtype)
        else:
            problems[name] = f"dtype {t.dtype} is not a floating point or FP8 weight"
    if strict:
        for name in expected:
            if name not in tensors and name not in problems:
                problems[name] = "missing"
        for name in scales - used_scales:
            if name not in problems and not _ignored(name, config):
                problems[name] = "scale without an FP8 weight"
    if problems:
        raise CheckpointError(problems)
    # Every name, shape and dtype is checked above; torch's loader copies each tensor into its
    # parameter, the routed experts' per-expert names into their stacked parameters included.
    model.load_state_dict(loaded, strict=False)


def save_checkpoint(model: DSAForCausalLM, directory: str | os.PathLike, fp8: bool = False) -> None:
    """Write ``config.json`` and ``model.safetensors`` (deterministic bytes for equal weights)."""
    os.makedirs(directory, exist_ok=True)
    cfg = to_hf_config(model.config)
    if fp8:
        cfg["quantization_config"] = {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "weight_block_size": [WEIGHT_BLOCK, WEIGHT_BLOCK],
            "activation_scheme": "dynamic",
            "modules_to_not_convert": ["lm_head", "model.embed_tokens", "mlp.gate", "indexer.weights_proj"],
        }
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(state_dict_for_save(model, fp8), os.path.join(directory, "model.safetensors"))


def build_model(
    config: DSAConfig, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
) -> DSAForCausalLM:
    """An uninitialised model whose parameters are allocated on ``device`` from the start (one
    full-size GLM-5.3 layer is 10 G parameters: no host copy), then cast to ``dtype``."""
    with torch.device(device):
        model = DSAForCausalLM(config)
    return model.to(dtype)


def _renumber_layers(tensors: dict[str, torch.Tensor], kept: range) -> dict[str, torch.Tensor]:
    """Checkpoint layer ``kept.start + i`` renamed to layer ``i``; the other layers dropped."""
    out = {}
    for name, t in tensors.items():
        m = re.match(r"model\.layers\.(\d+)\.", name)
        if m is None:
            out[name] = t
        elif int(m.group(1)) in kept:
            out[f"model.layers.{int(m.group(1)) - kept.start}.{name[m.end():]}"] = t
    return out


def load_checkpoint(
    directory: str | os.PathLike,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    strict: bool = True,
    layers: str | int | range | None = None,
) -> DSAForCausalLM:
    """Build the model from ``directory``'s ``config.json`` and load ``model.safetensors`` into it.

    ``layers`` keeps a slice of the stack (``config.keep_layers``): checkpoint layer
    ``start + i`` fills the model's layer ``i``.
    """
    config = from_hf_config(directory)
    tensors = load_file(os.path.join(directory, "model.safetensors"))
    if layers is not None:
        kept = parse_layers(layers, config.num_hidden_layers)
        config = keep_layers(config, kept)
        tensors = _renumber_layers(tensors, kept)
    model = build_model(config, dtype, device)
    load_state_dict(model, tensors, strict=strict)
    return model


def init_weights(model: DSAForCausalLM, seed: int = 0) -> DSAForCausalLM:
    """Fill ``model`` with deterministic random weights (a generator on the model's device).

    Linear weights ~ N(0, 1/fan_in) so activations stay O(1) through the stack; norm weights
    1 ± 0.1 and LayerNorm biases ± 0.1 so that a dropped norm weight or bias changes the output;
    the router correction bias ~ N(0, 0.1²) so that it changes selections. Tensors are
    visited in state-dict order, each drawn at its checkpoint shape (a routed expert's
    ``[I, H]`` or ``[H, I]`` projection, filled through its view of the stacked parameters),
    so equal seeds give equal weights on the same device type.
    """
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.state_dict(keep_vars=True).items():
            noise = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32)
            if name.endswith("e_score_correction_bias"):
                value = 0.1 * noise
            elif "norm" in name and name.endswith(".bias"):
                value = 0.1 * noise
            elif "norm" in name:
                value = 1.0 + 0.1 * noise
            elif name.endswith("embed_tokens.weight"):
                value = noise
            else:
                value = noise * p.shape[-1] ** -0.5
            p.copy_(value.to(p.dtype))
    return model
