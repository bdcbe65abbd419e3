"""Checkpoints in Hugging Face's layout: ``config.json`` and safetensors files with HF names.

A checkpoint directory holds one ``model.safetensors`` or shards ``model-000NN-of-000MM.safetensors``
named by ``model.safetensors.index.json``'s ``weight_map``. Names are the model's own state-dict
keys, which are HF's (``model.layers.{i}.self_attn.q_a_proj.weight``,
``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` …). FP8 checkpoints store e4m3 weights
with a float32 ``weight_scale_inv`` of shape ``[ceil(out/128), ceil(in/128)]``; the weight is
``W_fp8 * scale`` per 128×128 block and is dequantized at load. Never quantized (docs/conventions.md
§10): the router ``mlp.gate.*``, ``indexer.weights_proj``, norms, biases, the embedding and the
LM head.

Loading is checked before it reads: ``open_checkpoint`` matches every name, shape and dtype of
the tensors the model needs against the safetensors headers (no tensor read, no parameter
allocated) and collects every problem in one ``CheckpointError``. ``Checkpoint.load`` then reads
the FP8 block scales (finite and positive, or refused), allocates the model on its device and
reads one tensor at a time, straight to that device, each from a freshly opened file: host
memory stays bounded by the largest tensor, and only files holding a kept tensor are opened.
The multi-token-prediction layers (``model.layers.{num_hidden_layers + j}.*`` for ``j <
num_nextn_predict_layers``) and the layers ``--layers`` leaves out are skipped and counted in
``Checkpoint.note``; a layer beyond those is an unexpected tensor. Shared layers carry no
indexer tensors.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from glm_dsa.config import DSAConfig, from_hf_config, keep_layers, parse_layers, to_hf_config
from glm_dsa.fp8 import FP8_E4M3_MAX
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.preflight import safetensors_header

__all__ = [
    "CheckpointError",
    "Checkpoint",
    "resolve_dtype",
    "is_quantizable",
    "block_quantize_weight",
    "block_dequantize_weight",
    "state_dict_for_save",
    "load_state_dict",
    "write_config",
    "write_safetensors",
    "save_checkpoint",
    "checkpoint_files",
    "open_checkpoint",
    "largest_tensor_numel",
    "build_model",
    "load_checkpoint",
    "init_weights",
    "init_layer_weights",
    "init_outer_weights",
    "build_outer_model",
    "weight_stream_seed",
]

_log = logging.getLogger(__name__)

WEIGHT_BLOCK = 128
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
_DTYPE_NAMES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
    "float64": torch.float64, "fp64": torch.float64,
}
# safetensors' dtype names of the tensors a checkpoint may hold for this model
_HEADER_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                  "F32": torch.float32, "F64": torch.float64}
_NEVER_QUANTIZED = re.compile(
    r"(^lm_head\.|^model\.embed_tokens\.|norm\.|\.mlp\.gate\.|indexer\.weights_proj\.|\.bias$|_bias$)"
)
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_SCALE = "weight_scale_inv"
_SHOWN = 10  # problems spelled out in a CheckpointError's message; .problems holds them all


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: ``problems`` maps each tensor (or file) name
    to what is wrong with it; the message is one line naming them."""

    def __init__(self, problems: Mapping[str, str], directory: str | os.PathLike | None = None) -> None:
        self.problems = dict(sorted(problems.items()))
        where = f"checkpoint {os.fspath(directory)}" if directory is not None else "checkpoint"
        items = [f"{k}: {v}" for k, v in self.problems.items()]
        if len(items) == 1:
            message = f"{where}: {items[0]}"
        else:
            more = len(items) - _SHOWN
            message = (f"{where}: {len(items)} problems: " + "; ".join(items[:_SHOWN])
                       + (f"; and {more} more (CheckpointError.problems lists them all)" if more > 0 else ""))
        super().__init__(message)


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A model dtype from a ``torch.dtype`` or its name (``float32``/``fp32``, ``bfloat16``/``bf16``,
    ``float16``/``fp16``, ``float64``/``fp64``); anything else is refused in one line."""
    if isinstance(dtype, torch.dtype) and dtype in _FLOAT_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPE_NAMES:
        return _DTYPE_NAMES[dtype.lower()]
    raise ValueError(f"dtype {dtype!r} is not a model dtype; use torch.float32, torch.bfloat16, torch.float16, "
                     f"torch.float64 or one of the names {', '.join(_DTYPE_NAMES)}")


def is_quantizable(name: str, tensor: torch.Tensor) -> bool:
    """Whether ``name`` is stored in FP8 in a block-quantized checkpoint (2-D linear weights only)."""
    return tensor.dim() == 2 and name.endswith(".weight") and not _NEVER_QUANTIZED.search(name)


def block_quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w [out, in]`` → (e4m3 ``[out, in]``, float32 ``weight_scale_inv [ceil(out/128), ceil(in/128)]``).

    Scale per 128×128 block is ``amax / 448`` (``amax`` floored at 1e-4 so zero blocks stay finite).
    Computed on ``w``'s device; the same bits on any (each step is exactly rounded).
    """
    out_f, in_f = w.shape
    bo, bi = math.ceil(out_f / WEIGHT_BLOCK), math.ceil(in_f / WEIGHT_BLOCK)
    padded = torch.zeros(bo * WEIGHT_BLOCK, bi * WEIGHT_BLOCK, dtype=torch.float32, device=w.device)
    padded[:out_f, :in_f] = w.float()
    blocks = padded.view(bo, WEIGHT_BLOCK, bi, WEIGHT_BLOCK)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    # A tensor divisor: CUDA divides by a Python scalar as a product with its reciprocal, which
    # rounds differently; tensor by tensor both devices give the exactly rounded quotient.
    scale = amax / torch.full_like(amax, FP8_E4M3_MAX)
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    q = q.view(bo * WEIGHT_BLOCK, bi * WEIGHT_BLOCK)[:out_f, :in_f].to(torch.float8_e4m3fn)
    return q.contiguous(), scale


def block_dequantize_weight(w_fp8: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``W = W_fp8 * scale_inv`` per 128×128 block, returned in ``dtype``.

    The product is taken in float32 (upstream's ``weight_dequant``), or in float64 for a float64
    target, where it is exact; beyond the result it takes one copy of the weight in that precision.
    """
    out_f, in_f = w_fp8.shape
    cdt = torch.promote_types(dtype, torch.float32)
    if out_f % WEIGHT_BLOCK == 0 and in_f % WEIGHT_BLOCK == 0:  # whole blocks: broadcast, no expanded scale
        bo, bi = out_f // WEIGHT_BLOCK, in_f // WEIGHT_BLOCK
        w = w_fp8.to(cdt).view(bo, WEIGHT_BLOCK, bi, WEIGHT_BLOCK)
        w.mul_(scale_inv.to(cdt)[:, None, :, None])
        return w.view(out_f, in_f).to(dtype)
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
            out[_scale_name(name)] = s
        else:
            out[name] = t
    return out


def _scale_name(weight_name: str) -> str:
    return weight_name[: -len("weight")] + _SCALE


# ------------------------------------------------------------------ checks against the model
TensorInfo = tuple  # (torch.dtype, or the header's dtype name when it is not one of ours; shape)


def _check_entries(
    infos: Mapping[str, TensorInfo],
    expected: Mapping[str, torch.Tensor],
    label: Mapping[str, str],
    strict: bool,
    allow_missing: bool,
) -> tuple[dict[str, str], dict[str, str]]:
    """Every name, shape and dtype of ``infos`` (model names → ``(dtype, shape)``) against the
    model's ``expected`` tensors (meta tensors will do). Returns ``(problems keyed by the
    checkpoint names in label, {FP8 weight: its scale})``. Unexpected tensors are problems
    under ``strict``; missing ones unless ``allow_missing``."""
    problems: dict[str, str] = {}
    fp8: dict[str, str] = {}
    scales = {k for k in infos if k.endswith("." + _SCALE)}
    for name, (dtype, shape) in infos.items():
        if name in scales:
            continue
        key = label[name]
        if name not in expected:
            if strict:
                problems[key] = "unexpected tensor (not in this model)"
            continue
        target = expected[name]
        if tuple(shape) != tuple(target.shape):
            problems[key] = f"shape {tuple(shape)}, expected {tuple(target.shape)}"
        elif dtype == torch.float8_e4m3fn and not is_quantizable(name, target):
            problems[key] = (f"dtype {dtype}, expected bf16, fp16, fp32 or fp64: FP8 checkpoints quantize 2-D "
                             "linear weights only, never the norms, biases, router gate, indexer.weights_proj, "
                             "embedding or LM head")
        elif dtype == torch.float8_e4m3fn:
            scale = _scale_name(name)
            want = (math.ceil(shape[0] / WEIGHT_BLOCK), math.ceil(shape[1] / WEIGHT_BLOCK))
            if scale not in infos:
                problems[key] = f"FP8 weight without its scale {label.get(scale, _scale_name(key))}"
            elif infos[scale][0] != torch.float32 or tuple(infos[scale][1]) != want:
                problems[label[scale]] = f"{infos[scale][0]} {tuple(infos[scale][1])}, expected torch.float32 {want}"
            else:
                fp8[name] = scale
        elif dtype in _FLOAT_DTYPES:
            if name.endswith("e_score_correction_bias") and dtype != torch.float32:
                problems[key] = f"dtype {dtype}, expected torch.float32 (router bias)"
        else:
            problems[key] = f"dtype {dtype} is not a floating point or FP8 weight"
    if not allow_missing:
        for name in expected:
            if name not in infos:
                problems.setdefault(label.get(name, name), "missing")
    if strict:
        for name in scales - set(fp8.values()):
            weight = name[: -len(_SCALE)] + "weight"
            if weight not in expected or infos.get(weight, (None,))[0] != torch.float8_e4m3fn:
                problems.setdefault(label[name], "scale without an FP8 weight")
    return problems, fp8


def _check_scale(scale: torch.Tensor) -> str | None:
    """What is wrong with an FP8 block-scale tensor's values (every block finite and > 0), or None."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return None
    first = tuple(int(i) for i in bad.nonzero()[0])
    return (f"{int(bad.sum())} of {scale.numel()} block scales are not finite and positive "
            f"(block {first}: {scale[first].item()}); the FP8 weight it scales would load wrong")


def _all_finite(t: torch.Tensor, chunk: int = 1 << 20) -> bool:
    """No NaN or inf in ``t``, checked ``chunk`` elements at a time (``isfinite`` of a whole
    embedding would take twice its size again in temporaries)."""
    return bool(torch.stack([torch.isfinite(part).all() for part in t.reshape(-1).split(chunk)]).all())


def _fill(
    model: torch.nn.Module,
    order: Mapping[str, str],
    read: Callable[[str], torch.Tensor],
    fp8: Mapping[str, str],
    scales: Mapping[str, torch.Tensor],
) -> None:
    """Copy each tensor ``read(model name)`` (dequantized with its checked scale when FP8) into
    the model's parameter of that name, one at a time, in ``order`` (model name → checkpoint
    name, for errors). A tensor holding NaN or inf is refused before it is copied."""
    targets = model.state_dict(keep_vars=True)  # views: a routed expert's rows of its stack
    with torch.no_grad():
        for name, key in order.items():
            target = targets[name]
            t = read(name)
            if name in fp8:
                t = block_dequantize_weight(t.to(target.device), scales[fp8[name]].to(target.device), target.dtype)
            else:
                t = t.to(device=target.device, dtype=target.dtype)
            if not _all_finite(t):
                raise CheckpointError({key: "holds NaN or inf"})
            target.copy_(t)
            del t


def load_state_dict(model: DSAForCausalLM, tensors: Mapping[str, torch.Tensor], strict: bool = True) -> None:
    """Copy ``tensors`` (HF names, bf16/fp16/fp32 or FP8 + ``weight_scale_inv``) into ``model``.

    Each tensor is converted to the dtype of the parameter it fills. With ``strict`` every
    problem raises one ``CheckpointError``; otherwise only shape/dtype/scale problems do and
    missing/unexpected keys are skipped (a missing parameter keeps its value).
    """
    infos = {k: (t.dtype, tuple(t.shape)) for k, t in tensors.items()}
    problems, fp8 = _check_entries(infos, model.state_dict(), {k: k for k in tensors}, strict, not strict)
    for scale in fp8.values():
        if (why := _check_scale(tensors[scale])) is not None:
            problems[scale] = why
    if problems:
        raise CheckpointError(problems)
    expected = model.state_dict()
    order = {k: k for k in tensors if k in expected}
    _fill(model, order, tensors.__getitem__, fp8, tensors)


# ------------------------------------------------------------------ writing
def write_config(config: DSAConfig, directory: str | os.PathLike, fp8: bool = False) -> None:
    """Write ``directory/config.json`` for ``config`` (with HF's FP8 ``quantization_config`` if ``fp8``)."""
    os.makedirs(directory, exist_ok=True)
    cfg = to_hf_config(config)
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


def write_safetensors(
    tensors: Mapping[str, torch.Tensor], directory: str | os.PathLike, max_shard_bytes: int | None = None
) -> list[str]:
    """Write ``tensors`` as ``model.safetensors``, or, with ``max_shard_bytes``, as HF's shards
    ``model-{i:05d}-of-{n:05d}.safetensors`` (filled in order, a new one when the next tensor
    would pass the limit; a larger tensor gets a shard of its own) plus
    ``model.safetensors.index.json`` (``metadata.total_size``, ``weight_map``). Deterministic
    bytes for equal tensors; returns the files written."""
    os.makedirs(directory, exist_ok=True)
    if max_shard_bytes is None:
        save_file(dict(tensors), os.path.join(directory, SINGLE_FILE))
        return [SINGLE_FILE]
    if max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be ≥ 1")
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for file, shard in zip(files, shards):
        save_file(shard, os.path.join(directory, file))
    index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
             "weight_map": {name: file for file, shard in zip(files, shards) for name in shard}}
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump(index, f, indent=2, sort_keys=True)
        f.write("\n")
    return files


def save_checkpoint(
    model: DSAForCausalLM, directory: str | os.PathLike, fp8: bool = False, max_shard_bytes: int | None = None
) -> None:
    """Write ``config.json`` and the weights (``write_safetensors``; FP8 block-quantized where
    ``fp8``); deterministic bytes for equal weights."""
    write_config(model.config, directory, fp8)
    write_safetensors(state_dict_for_save(model, fp8), directory, max_shard_bytes)


# ------------------------------------------------------------------ reading
def _open(path: str, device: str = "cpu"):
    """``safe_open`` of one file; a file it cannot read is one ``CheckpointError`` line."""
    directory, file = os.path.split(path)
    try:
        return safe_open(path, framework="pt", device=device)
    except SafetensorError as e:
        raise CheckpointError({file: f"is not a safetensors file, or is truncated or corrupt ({e}); "
                                     "download it again"}, directory) from None
    except OSError as e:
        raise CheckpointError({file: f"cannot be read ({e.strerror or e})"}, directory) from None


def _header(path: str) -> dict[str, TensorInfo]:
    """``{name: (dtype, shape)}`` of one safetensors file, from its header alone."""
    with _open(path) as f:
        out = {}
        for name in f.keys():
            s = f.get_slice(name)
            out[name] = (_HEADER_DTYPES.get(s.get_dtype(), s.get_dtype()), tuple(s.get_shape()))
        return out


def checkpoint_files(directory: str | os.PathLike) -> dict[str, str]:
    """``{tensor name: file path}`` of a checkpoint directory: ``model.safetensors.index.json``'s
    ``weight_map`` (every file it names must exist; nothing is opened), else the names in
    ``model.safetensors``'s header."""
    d = os.fspath(directory)
    index = os.path.join(d, INDEX_FILE)
    if os.path.isfile(index):
        twice: list[str] = []

        def unique_keys(pairs: list[tuple[str, object]]) -> dict:
            seen: dict = {}
            for key, value in pairs:
                if key in seen:
                    twice.append(key)
                seen[key] = value
            return seen

        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f, object_pairs_hook=unique_keys).get("weight_map")
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise CheckpointError({INDEX_FILE: f"is not a JSON object with a weight_map ({e})"}, d) from None
        if not isinstance(weight_map, dict) or not weight_map or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
            raise CheckpointError({INDEX_FILE: "its weight_map is not a non-empty {tensor name: file name} object"}, d)
        if twice:
            raise CheckpointError({name: f"named twice in {INDEX_FILE}'s JSON; keep one entry"
                                   for name in twice}, d)
        # Lexically inside the directory (a hub cache's shards are symlinks to blobs elsewhere,
        # so the check is on the names, not on where links lead).
        outside = {file for file in weight_map.values()
                   if os.path.isabs(file) or os.path.normpath(file).split(os.sep)[0] == os.pardir}
        if outside:
            raise CheckpointError({file: f"named by {INDEX_FILE} but outside the checkpoint directory; "
                                         "a weight_map names files inside it" for file in outside}, d)
        absent: dict[str, int] = {}
        for file in weight_map.values():
            if not os.path.isfile(os.path.join(d, file)):
                absent[file] = absent.get(file, 0) + 1
        if absent:
            raise CheckpointError({file: f"named by {INDEX_FILE} for {n} tensor(s) but not in the directory; "
                                         "download it again" for file, n in absent.items()}, d)
        return {name: os.path.join(d, file) for name, file in weight_map.items()}
    single = os.path.join(d, SINGLE_FILE)
    if os.path.isfile(single):
        return {name: single for name in _header(single)}
    raise ValueError(f"checkpoint {d} has no {SINGLE_FILE} and no {INDEX_FILE}: not a Hugging Face checkpoint "
                     "directory")


def _nextn_layers(directory: str) -> int:
    """``num_nextn_predict_layers`` of the checkpoint's config.json (0 when absent)."""
    with open(os.path.join(directory, "config.json"), encoding="utf-8") as f:
        n = json.load(f).get("num_nextn_predict_layers", 0)
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{directory}/config.json: num_nextn_predict_layers={n!r} must be an integer ≥ 0")
    return n


def _meta_model(config: DSAConfig) -> DSAForCausalLM:
    with torch.device("meta"):
        return DSAForCausalLM(config)


@dataclass(frozen=True)
class LayerTensors:
    """One decoder layer's checkpoint tensors in host memory (``Checkpoint.read_layer``):
    ``names`` maps each of the layer's tensor names to its checkpoint name (for errors),
    ``tensors`` holds them as stored (FP8 ones not yet dequantized), ``scales`` the FP8 weights'
    checked block scales, by weight name."""

    layer: int
    names: Mapping[str, str]
    tensors: Mapping[str, torch.Tensor]
    scales: Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory checked against the model it fills, from its headers alone.

    ``config`` is the model's (cut to ``layers``, the checkpoint layers kept: checkpoint layer
    ``layers.start + i`` fills layer ``i``); ``tensors`` maps each model tensor name to the
    ``(checkpoint name, file)`` it is read from, ``scales`` each FP8 weight's model name to its
    scale's; ``files`` are the files that hold them (the only ones ``load`` opens); ``note`` is
    one line saying what is read and what is skipped, and why.
    """

    directory: str
    config: DSAConfig
    layers: range
    tensors: Mapping[str, tuple[str, str]]
    scales: Mapping[str, tuple[str, str]]
    files: tuple[str, ...]
    note: str

    def weight_bytes(self, dtype: torch.dtype | str) -> int:
        """Bytes of the model's parameters in ``dtype`` (the router bias stays float32)."""
        dtype = resolve_dtype(dtype)
        return sum(p.numel() * p.element_size() for p in _meta_model(self.config).to(dtype).parameters())

    def load(self, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu") -> DSAForCausalLM:
        """The model in ``dtype`` on ``device``, filled from the checkpoint.

        The FP8 block scales are read and checked first (every block finite and positive), then
        the parameters are allocated on ``device`` and each tensor is read by itself, straight to
        ``device``, from a file opened for it alone: host memory stays within about one tensor.
        """
        dtype, device = resolve_dtype(dtype), torch.device(device)
        scales = self._scales(self.scales)
        model = build_model(self.config, dtype, device)
        self._fill(model, self.tensors, scales, device)
        return model

    def load_outer(self, dtype: torch.dtype | str = torch.float32,
                   device: torch.device | str = "cpu") -> DSAForCausalLM:
        """The model with its embedding, final norm and head filled on ``device`` and its layers
        left on the meta device (``build_outer_model``), for ``load_layer`` to fill one at a time."""
        dtype, device = resolve_dtype(dtype), torch.device(device)
        outer = {n: v for n, v in self.tensors.items() if _LAYER.match(n) is None}
        model = build_outer_model(self.config, dtype, device)
        self._fill(model, outer, self._scales({n: v for n, v in self.scales.items() if n in outer}), device)
        return model

    def load_layer(self, layer: torch.nn.Module, read: LayerTensors | None = None) -> None:
        """Fill decoder ``layer`` (stack layer ``layer.layer_idx``, its parameters allocated)
        from the checkpoint: its FP8 scales read and checked first, then each tensor by itself,
        straight to the layer's device; or, given ``read`` (``read_layer`` of this layer), from
        those host tensors."""
        if read is not None:
            if read.layer != layer.layer_idx:
                raise ValueError(f"read_layer gave layer {read.layer}'s tensors for layer {layer.layer_idx}")
            _fill(layer, read.names, read.tensors.__getitem__, {n: n for n in read.scales}, read.scales)
            return
        prefix = f"model.layers.{layer.layer_idx}."
        device = next(layer.parameters()).device
        mine = {n[len(prefix):]: v for n, v in self.tensors.items() if n.startswith(prefix)}
        scales = self._scales({n[len(prefix):]: v for n, v in self.scales.items() if n.startswith(prefix)})
        self._fill(layer, mine, scales, device)

    def stored_layer_bytes(self, layer_idx: int) -> int:
        """Bytes stack layer ``layer_idx``'s tensors and FP8 scales take as the checkpoint stores
        them, from the files' headers."""
        return sum(n for *_, n in self._spans(layer_idx))

    def read_bytes(self, layer_idx: int) -> int:
        """Bytes of the host buffer ``read_layer`` reads stack layer ``layer_idx`` into: its
        stored tensors and scales, each at a ``_READ_ALIGN``-byte boundary."""
        return sum(_aligned(n) for *_, n in self._spans(layer_idx))

    def read_layer(self, layer_idx: int, pin: bool = False, into: torch.Tensor | None = None) -> LayerTensors:
        """Stack layer ``layer_idx``'s tensors as the checkpoint stores them, read into host
        memory with its FP8 scales checked: what ``load_layer(layer, read)`` copies in.

        The bytes are read with plain sequential file reads, file by file in offset order, into
        one buffer of ``read_bytes(layer_idx)`` bytes: ``into`` (a uint8 host tensor at least
        that long, reused: a run reads layer after layer into the same buffers) or a new one,
        pinned with ``pin`` (for copies to a GPU). Each tensor is a view of the buffer. The
        reads release the GIL (``readinto``), so a layer-major run reads the next layer so, in a
        thread of its own, while this one computes without slowing its launches
        (``layer_major.CheckpointLayerWeights``)."""
        spans = self._spans(layer_idx)
        size = sum(_aligned(n) for *_, n in spans)
        if into is None:
            into = torch.empty(size, dtype=torch.uint8, pin_memory=pin)
        elif into.dtype != torch.uint8 or into.dim() != 1 or into.numel() < size or into.is_cuda:
            raise ValueError(f"read_layer({layer_idx}): into must be a 1-D uint8 host tensor of at least "
                             f"{size} bytes (read_bytes), got {into.dtype} {tuple(into.shape)} on {into.device}")
        views: dict[str, torch.Tensor] = {}
        pos, current, f = 0, None, None
        try:
            for name, _, path, dtype, shape, offset, n in spans:
                if path != current:
                    if f is not None:
                        f.close()
                    current, f = path, open(path, "rb", buffering=0)
                part = into[pos:pos + n]
                _read_exactly(f, offset, part, path)
                views[name] = part.view(dtype).view(shape)
                pos += _aligned(n)
        finally:
            if f is not None:
                f.close()
        tensors = {n: views[n] for n in views if not n.startswith(_SCALE_PREFIX)}
        scales: dict[str, torch.Tensor] = {}
        problems: dict[str, str] = {}
        for name, key, *_ in spans:
            if name.startswith(_SCALE_PREFIX):
                weight = name[len(_SCALE_PREFIX):]
                scales[weight] = views[name]
                if (why := _check_scale(scales[weight])) is not None:
                    problems[key] = why
        if problems:
            raise CheckpointError(problems, self.directory)
        names = {n: key for n, key, *_ in spans if not n.startswith(_SCALE_PREFIX)}
        return LayerTensors(layer_idx, names, tensors, scales)

    def _spans(self, layer_idx: int) -> list[tuple[str, str, str, torch.dtype, tuple[int, ...], int, int]]:
        """``(name, checkpoint name, file, dtype, shape, byte offset in the file, bytes)`` of
        stack layer ``layer_idx``'s tensors (named as in the layer) and FP8 scales (named
        ``_SCALE_PREFIX`` + the weight's name), sorted by file and offset: from the headers."""
        prefix = f"model.layers.{layer_idx}."
        wanted = [(n[len(prefix):], key, path) for n, (key, path) in self.tensors.items() if n.startswith(prefix)]
        wanted += [(_SCALE_PREFIX + n[len(prefix):], key, path) for n, (key, path) in self.scales.items()
                   if n.startswith(prefix)]
        headers = {}
        for path in {path for *_, path in wanted}:
            header = safetensors_header("--weights", path)
            with open(path, "rb") as f:
                start = 8 + int.from_bytes(f.read(8), "little")
            headers[path] = (header, start)
        out = []
        for name, key, path in wanted:
            header, start = headers[path]
            info = header[key]
            lo, hi = (int(x) for x in info["data_offsets"])
            out.append((name, key, path, _HEADER_DTYPES[info["dtype"]], tuple(info["shape"]), start + lo, hi - lo))
        return sorted(out, key=lambda s: (s[2], s[5]))

    def _scales(self, wanted: Mapping[str, tuple[str, str]]) -> dict[str, torch.Tensor]:
        """The FP8 block scales of ``wanted`` (weight name → its scale's ``(checkpoint name,
        file)``), read and checked (every block finite and positive): one ``CheckpointError``."""
        scales: dict[str, torch.Tensor] = {}  # by the model name of the weight each scales
        problems: dict[str, str] = {}
        for weight, (key, path) in wanted.items():
            scales[weight] = _read(path, key, "cpu").clone()
            if (why := _check_scale(scales[weight])) is not None:
                problems[key] = why
        if problems:
            raise CheckpointError(problems, self.directory)
        return scales

    def _fill(self, module: torch.nn.Module, tensors: Mapping[str, tuple[str, str]],
              scales: Mapping[str, torch.Tensor], device: torch.device) -> None:
        """``tensors`` (``module``'s names → ``(checkpoint name, file)``) read one at a time to
        ``device`` into ``module``, dequantized with ``scales`` where FP8."""
        where = "cpu" if device.type == "cpu" else str(device)
        _fill(module, {n: key for n, (key, _) in tensors.items()},
              lambda n: _read(tensors[n][1], tensors[n][0], where), {n: n for n in scales}, scales)


# read_layer's buffer: each tensor starts at a multiple of this (a view as float64 needs 8; 64 is a
# cache line); its scales are named so, apart from the weights they scale.
_READ_ALIGN = 64
_SCALE_PREFIX = "scale:"


def _aligned(n: int) -> int:
    return -(-n // _READ_ALIGN) * _READ_ALIGN


def _read_exactly(f, offset: int, out: torch.Tensor, path: str) -> None:
    """``out.numel()`` bytes of open file ``f`` from ``offset`` into uint8 ``out``."""
    view = out.numpy().data.cast("B")
    f.seek(offset)
    got = 0
    while got < len(view):
        n = f.readinto(view[got:])
        if not n:
            raise CheckpointError({os.path.basename(path): f"ends before byte {offset + len(view)}: truncated; "
                                                           "download it again"}, os.path.dirname(path))
        got += n


def _read(path: str, name: str, device: str) -> torch.Tensor:
    """Tensor ``name`` of file ``path`` on ``device``, the file opened for it alone (its mapping
    is dropped once the tensor is: host memory does not grow with the tensors read)."""
    with _open(path, device) as f:
        return f.get_tensor(name)


def open_checkpoint(
    directory: str | os.PathLike, layers: str | int | range | None = None, strict: bool = True
) -> Checkpoint:
    """Check a checkpoint directory against the model built from its ``config.json``, cut to
    ``layers`` (``config.keep_layers``), reading headers only: only the files holding a kept
    tensor are opened (every file, for a single ``model.safetensors``).

    Every missing, mis-shaped or mis-typed tensor, scale problem, file named by the weight map
    but absent, truncated file, or (with ``strict``) unexpected tensor is one entry of one
    ``CheckpointError``. Tensors of layers outside ``layers`` and of the MTP layers
    (``num_nextn_predict_layers`` after the last) are skipped; a layer index beyond those is
    unexpected (skipped and counted without ``strict``).
    """
    d = os.fspath(directory)
    full = from_hf_config(d)
    nextn = _nextn_layers(d)
    n_layers = full.num_hidden_layers
    kept = parse_layers(layers, n_layers) if layers is not None else range(n_layers)
    config = keep_layers(full, kept)
    files = checkpoint_files(d)
    wanted: dict[str, str] = {}  # model name -> checkpoint name
    problems: dict[str, str] = {}
    skipped = {"layers": 0, "mtp": 0, "beyond": 0}
    for name in files:
        m = _LAYER.match(name)
        if m is None:
            wanted[name] = name
            continue
        i = int(m.group(1))
        if i in kept:
            wanted[f"model.layers.{i - kept.start}.{name[m.end():]}"] = name
        elif i < n_layers:
            skipped["layers"] += 1
        elif i < n_layers + nextn:
            skipped["mtp"] += 1
        elif strict:
            problems[name] = (f"layer {i} is beyond the model's {n_layers} layers and its "
                              f"{nextn} MTP layer(s) (num_nextn_predict_layers)")
        else:
            skipped["beyond"] += 1
    needed = sorted({files[k] for k in wanted.values()})
    headers = {path: _header(path) for path in needed}
    infos: dict[str, TensorInfo] = {}
    for model_name, key in wanted.items():
        header = headers[files[key]]
        if key not in header:
            problems[key] = f"{INDEX_FILE} puts it in {os.path.basename(files[key])}, whose header lacks it"
        else:
            infos[model_name] = header[key]
    label = dict(wanted)
    expected = _meta_model(config).state_dict()
    for name in expected:  # a missing tensor is named as the checkpoint would name it
        m = _LAYER.match(name)
        label.setdefault(name, name if m is None else
                         f"model.layers.{int(m.group(1)) + kept.start}.{name[m.end():]}")
    found, fp8 = _check_entries(infos, expected, label, strict, allow_missing=False)
    for key, why in found.items():  # a misplaced tensor is named as such, not as missing
        problems.setdefault(key, why)
    if problems:
        raise CheckpointError(problems, d)
    tensors = {n: (wanted[n], files[wanted[n]]) for n in expected}
    scales = {n: (wanted[s], files[wanted[s]]) for n, s in fp8.items()}
    scope = "all layers" if kept == range(n_layers) else f"layers {kept.start}:{kept.stop}"
    parts = [f"read {len(tensors) + len(scales)} tensors ({scope}, embedding, final norm, head) "
             f"from {len(needed)} of {len(set(files.values()))} file(s)"]
    if skipped["layers"]:
        parts.append(f"skipped {skipped['layers']} tensors of the other layers")
    if skipped["mtp"]:
        parts.append(f"skipped {skipped['mtp']} tensors of the MTP layer(s) "
                     f"{', '.join(str(n_layers + j) for j in range(nextn))} (num_nextn_predict_layers={nextn}; "
                     "multi-token prediction is not part of the prefill)")
    if skipped["beyond"]:
        parts.append(f"skipped {skipped['beyond']} unexpected tensors of layers beyond {n_layers + nextn - 1} "
                     "(strict=False)")
    return Checkpoint(d, config, kept, tensors, scales, tuple(needed), f"checkpoint {d}: " + "; ".join(parts))


def largest_tensor_numel(config: DSAConfig) -> int:
    """Elements of the model's largest checkpoint tensor (a routed expert's projection counts
    alone): what ``init_weights`` draws, and a checkpoint load reads, at a time."""
    return max(t.numel() for t in _meta_model(config).state_dict().values())


def build_model(
    config: DSAConfig, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> DSAForCausalLM:
    """An uninitialised model (``init_weights`` or a checkpoint fills it) whose parameters are
    allocated once, in ``dtype``, on ``device``: built on the meta device, cast there, then
    materialised, so a full-size GLM-5.3 layer (10 G parameters) takes 20 GB in bf16 and no
    float32 copy ever exists."""
    dtype = resolve_dtype(dtype)
    return _meta_model(config).to(dtype).to_empty(device=torch.device(device))


def build_outer_model(
    config: DSAConfig, dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu"
) -> DSAForCausalLM:
    """A model whose embedding, final norm and head are allocated in ``dtype`` on ``device`` and
    whose decoder layers stay on the meta device: a layer-major run (``glm_dsa.layer_major``)
    allocates, fills and frees one layer at a time."""
    model = _meta_model(config).to(resolve_dtype(dtype))
    for module in (model.model.embed_tokens, model.model.norm, model.lm_head):
        module.to_empty(device=torch.device(device))
    return model


def load_checkpoint(
    directory: str | os.PathLike,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    strict: bool = True,
    layers: str | int | range | None = None,
) -> DSAForCausalLM:
    """The model of ``directory``'s ``config.json`` filled from its safetensors files
    (``open_checkpoint`` then ``Checkpoint.load``; the skip note is logged at INFO).

    ``layers`` keeps a slice of the stack (``config.keep_layers``): checkpoint layer
    ``start + i`` fills the model's layer ``i``. ``dtype`` is a ``torch.dtype`` or its name.
    """
    dtype = resolve_dtype(dtype)
    checkpoint = open_checkpoint(directory, layers, strict)
    _log.info(checkpoint.note)
    return checkpoint.load(dtype, device)


# Random-weight streams besides the layers' (``weight_stream``): each its own generator, so a
# tensor's draw depends on the seed and the tensor alone, not on which layers a run keeps.
_STREAM_LAYER, _STREAM_EMBED, _STREAM_NORM, _STREAM_HEAD = 0, 1, 2, 3
_OUTSIDE_LAYERS = {"model.embed_tokens.": _STREAM_EMBED, "model.norm.": _STREAM_NORM, "lm_head.": _STREAM_HEAD}


def weight_stream_seed(seed: int, kind: int, index: int = 0) -> int:
    """The 64-bit generator seed of one random-weight stream: ``kind`` 0 is model layer ``index``
    (the full config's numbering), 1 the embedding, 2 the final norm, 3 the LM head. Mixed by
    numpy's ``SeedSequence`` so that neighbouring seeds and layers give unrelated streams."""
    import numpy as np

    if seed < 0:
        raise ValueError(f"seed {seed} must be ≥ 0")
    return int(np.random.SeedSequence([seed, kind, index]).generate_state(1, np.uint64)[0])


def _draw(tensors: list[tuple[str, torch.Tensor]], gen: torch.Generator) -> None:
    """Fill each ``(name, tensor)`` in order from ``gen`` (the distributions of ``init_weights``)."""
    for name, p in tensors:
        noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32)
        if name.endswith("e_score_correction_bias") or ("norm" in name and name.endswith(".bias")):
            noise.mul_(0.1)
        elif "norm" in name:
            noise.mul_(0.1).add_(1.0)
        elif not name.endswith("embed_tokens.weight"):
            noise.mul_(p.shape[-1] ** -0.5)
        p.copy_(noise)  # rounds to p's dtype as .to would
        del noise


def init_layer_weights(layer: torch.nn.Module, seed: int, model_layer: int) -> None:
    """Fill one decoder ``layer`` (its parameters allocated, on any device) with the random
    weights of layer ``model_layer`` of the full config under ``seed``: the weights
    ``init_weights`` gives that layer whatever slice of the stack is kept. Drawn on the layer's
    device, one float32 tensor at a time."""
    device = next(layer.parameters()).device
    gen = torch.Generator(device=device).manual_seed(weight_stream_seed(seed, _STREAM_LAYER, model_layer))
    with torch.no_grad():
        _draw(list(layer.state_dict(keep_vars=True).items()), gen)


def init_weights(model: DSAForCausalLM, seed: int = 0, first_layer: int = 0) -> DSAForCausalLM:
    """Fill ``model`` with deterministic random weights (generators on the model's device).

    Linear weights ~ N(0, 1/fan_in) so activations stay O(1) through the stack; norm weights
    1 ± 0.1 and LayerNorm biases ± 0.1 so that a dropped norm weight or bias changes the output;
    the router correction bias ~ N(0, 0.1²) so that it changes selections. Each model layer
    draws from a generator of its own, seeded by ``(seed, first_layer + i)`` for the stack's
    layer ``i`` (``first_layer`` = ``a`` of a ``--layers a:b`` slice), and the embedding, final
    norm and LM head each from one seeded by ``seed`` alone (``weight_stream_seed``): a slice
    holds exactly the whole model's layers ``a..b-1`` and the same embedding and head. Within a
    stream tensors are visited in state-dict order, each drawn at its checkpoint shape (a routed
    expert's ``[I, H]`` or ``[H, I]`` projection, filled through its view of the stacked
    parameters), so equal seeds give equal weights on the same device type. Each is drawn in
    float32 and scaled in place: the only memory beyond the parameters is one float32 copy of
    the largest tensor (the embedding), so a run's peak is its prefill's.
    """
    if first_layer < 0:
        raise ValueError(f"first_layer {first_layer} must be ≥ 0")
    init_outer_weights(model, seed)
    for i, layer in enumerate(model.model.layers):
        init_layer_weights(layer, seed, first_layer + i)
    return model


def init_outer_weights(model: DSAForCausalLM, seed: int = 0) -> DSAForCausalLM:
    """Fill the embedding, final norm and head of ``model`` with ``init_weights``'s random
    weights (each from its own stream of ``seed``), leaving its layers as they are (on the meta
    device for a layer-major run)."""
    device = model.lm_head.weight.device
    outside: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for name, p in model.state_dict(keep_vars=True).items():
        if _LAYER.match(name) is None:
            kind = next(k for prefix, k in _OUTSIDE_LAYERS.items() if name.startswith(prefix))
            outside.setdefault(kind, []).append((name, p))
    with torch.no_grad():
        for kind, tensors in outside.items():
            _draw(tensors, torch.Generator(device=device).manual_seed(weight_stream_seed(seed, kind)))
    return model
