"""Model configuration: one frozen dataclass, named presets, and Hugging Face config I/O.

Every field name follows the Hugging Face ``config.json`` of GLM-5.x (``glm_moe_dsa``) and
DeepSeek-V3.2 (``deepseek_v32``), so a user can map ours to theirs without a table. Fields
that exist only here (``page_size``, ``dense_attn_kv_len_threshold``, ``index_k_norm_eps``,
``scale_fmt``) are runtime conventions of the kernels we mirror; ``to_hf_config`` writes them
as extra keys that Hugging Face ignores, so the round trip is lossless.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import warnings
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = [
    "DSAConfig",
    "YarnScaling",
    "Rule",
    "SCHEMA",
    "ROPE_SCHEMA",
    "PRESETS",
    "get_config",
    "indexer_types_from_rule",
    "parse_layers",
    "keep_layers",
    "from_hf_config",
    "to_hf_config",
]

FULL = "full"
SHARED = "shared"


# ------------------------------------------------------------------ the typed schema
_PYTHON_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int, "bool": bool, "str": str, "object": Mapping, "list": (list, tuple)}


@dataclass(frozen=True)
class Rule:
    """What one configuration key may hold: a JSON kind and a range or a set of values.

    ``kind``: ``"int"`` (an integer, not a boolean), ``"number"`` (a finite integer or float,
    not a boolean), ``"bool"``, ``"str"``, ``"object"`` or ``"list"``. ``low`` is inclusive,
    ``above`` / ``below`` exclusive; ``nullable`` admits ``null`` / ``None``.
    """

    kind: str
    low: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple[Any, ...] = ()
    nullable: bool = False

    def allowed(self) -> str:
        """What the rule admits, in words (``an integer ≥ 1``)."""
        if self.choices:
            text = "one of " + ", ".join(json.dumps(c) for c in self.choices)
        else:
            text = {"int": "an integer", "number": "a finite number", "bool": "a boolean (true or false)",
                    "str": "a string", "object": "a JSON object", "list": "a list"}[self.kind]
            bounds = [f"≥ {self.low:g}" if self.low is not None else "",
                      f"> {self.above:g}" if self.above is not None else "",
                      f"< {self.below:g}" if self.below is not None else ""]
            if any(bounds):
                text += " " + " and ".join(b for b in bounds if b)
        return text + (" or null" if self.nullable else "")

    def admits(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        if isinstance(value, bool) and self.kind != "bool":
            return False
        if self.kind == "number":
            if not isinstance(value, (int, float)) or not math.isfinite(value):
                return False
        elif not isinstance(value, _PYTHON_TYPES[self.kind]):
            return False
        if self.choices and value not in self.choices:
            return False
        return ((self.low is None or value >= self.low) and (self.above is None or value > self.above)
                and (self.below is None or value < self.below))


_POSITIVE = Rule("int", low=1)
_COUNT = Rule("int", low=0)
_EPS = Rule("number", above=0, below=1)
_FLAG = Rule("bool")

# Every top-level config.json key glm-dsa reads, with DSAConfig's field of the same name.
SCHEMA: dict[str, Rule] = {
    "model_type": Rule("str", choices=("glm_moe_dsa", "deepseek_v32")),
    **{key: _POSITIVE for key in (
        "num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
        "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim", "index_topk",
        "index_topk_freq", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
        "moe_intermediate_size", "intermediate_size", "max_position_embeddings", "vocab_size", "page_size")},
    **{key: _COUNT for key in ("index_skip_topk_offset", "n_shared_experts", "first_k_dense_replace",
                               "dense_attn_kv_len_threshold")},
    "indexer_types": Rule("list", nullable=True),
    "routed_scaling_factor": Rule("number", above=0),
    "norm_topk_prob": _FLAG,
    "rms_norm_eps": _EPS,
    "index_k_norm_eps": _EPS,
    "rope_theta": Rule("number", above=1),
    "rope_scaling": Rule("object", nullable=True),
    "rope_parameters": Rule("object", nullable=True),
    "rope_interleave": _FLAG,
    "indexer_rope_interleave": _FLAG,
    "tie_word_embeddings": _FLAG,
    "scale_fmt": Rule("str", choices=("ue8m0",), nullable=True),
}

# The keys of ``rope_scaling`` / ``rope_parameters`` (YaRN's, as Hugging Face names them).
ROPE_SCHEMA: dict[str, Rule] = {
    "rope_type": Rule("str", choices=("default", "yarn"), nullable=True),
    "type": Rule("str", choices=("default", "yarn"), nullable=True),
    "rope_theta": Rule("number", above=1),
    "factor": Rule("number", low=1),
    "original_max_position_embeddings": _POSITIVE,
    "beta_fast": Rule("number", above=0),
    "beta_slow": Rule("number", above=0),
    "mscale": Rule("number", low=0),
    "mscale_all_dim": Rule("number", low=0),
}

# Keys of GLM-5.x / DeepSeek-V3.2 config.json files that glm-dsa does not read: never reported
# as near-misses of the keys it does read.
_IGNORED_HF_KEYS = frozenset({
    "_name_or_path", "architectures", "attention_bias", "attention_dropout", "auto_map", "aux_loss_alpha",
    "bos_token_id", "dtype", "eos_token_id", "ep_size", "head_dim", "hidden_act", "initializer_range",
    "layer_types", "mlp_bias", "mlp_layer_types", "moe_layer_freq", "num_key_value_heads",
    "num_nextn_predict_layers", "output_router_logits", "pad_token_id", "pretraining_tp", "qk_head_dim",
    "quantization_config", "router_aux_loss_coef", "scoring_func", "seq_aux", "topk_method", "torch_dtype",
    "transformers_version", "use_cache", "partial_rotary_factor", "attention_factor",
})


def schema_problems(values: Mapping[str, Any], schema: Mapping[str, Rule], prefix: str = "",
                    show=json.dumps) -> list[str]:
    """One line per key of ``values`` that ``schema`` has a rule for and that breaks it:
    ``key=<value> must be <what is allowed>`` (values shown with ``show``)."""
    lines = []
    for key, rule in schema.items():
        if key in values and not rule.admits(values[key]):
            try:
                shown = show(values[key])
            except (TypeError, ValueError):
                shown = repr(values[key])
            lines.append(f"{prefix}{key}={shown} must be {rule.allowed()}")
    return lines


def near_misses(keys: Iterable[str], defaults: Mapping[str, Any], prefix: str = "") -> list[str]:
    """``did you mean`` lines for the ``keys`` that are not keys of ``defaults`` but close to one
    (difflib), naming the default the intended key then takes."""
    keys = list(keys)
    lines = []
    for key in keys:
        if key in defaults or key in _IGNORED_HF_KEYS:
            continue
        near = difflib.get_close_matches(key, list(defaults), n=1, cutoff=0.8)
        if near and near[0] not in keys:
            lines.append(f"unknown key {prefix}{key} (did you mean {prefix}{near[0]}? it is unset, so it "
                         f"takes its default {json.dumps(defaults[near[0]])})")
    return lines


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3.2's ``rope_scaling``); GLM-5.x has none."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

    def __post_init__(self) -> None:
        problems = schema_problems(vars(self), ROPE_SCHEMA, "rope_scaling.", show=repr)
        if not problems and not self.beta_fast > self.beta_slow:
            problems.append(f"rope_scaling.beta_fast={self.beta_fast!r} must be > rope_scaling.beta_slow="
                            f"{self.beta_slow!r} (YaRN ramps from the fast to the slow rotation count)")
        if problems:
            raise ValueError("\n".join(problems))

    def mscale_value(self, mscale: float) -> float:
        """YaRN's attention-magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 if factor ≤ 1)."""
        if self.factor <= 1.0:
            return 1.0
        return 0.1 * mscale * math.log(self.factor) + 1.0


def indexer_types_from_rule(num_layers: int, freq: int, offset: int) -> tuple[str, ...]:
    """Layer i is full iff ``max(i - offset + 1, 0) % freq == 0`` (HF / vLLM rule)."""
    if freq < 1:
        raise ValueError(f"index_topk_freq={freq} must be ≥ 1")
    return tuple(FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers))


@dataclass(frozen=True)
class DSAConfig:
    """One GLM-5.3 / DeepSeek-V3.2 DSA model's shape and conventions.

    Dimensions are in elements, lengths in tokens. ``indexer_types`` may be left empty, in which
    case it is derived from ``index_topk_freq`` / ``index_skip_topk_offset``; the explicit list
    wins when given.
    """

    name: str = "custom"
    model_type: str = "glm_moe_dsa"
    num_hidden_layers: int = 78
    hidden_size: int = 6144
    num_attention_heads: int = 64
    q_lora_rank: int = 2048
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 192
    qk_rope_head_dim: int = 64
    v_head_dim: int = 256
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 2048
    index_topk_freq: int = 4
    index_skip_topk_offset: int = 3
    indexer_types: tuple[str, ...] = ()
    n_routed_experts: int = 256
    num_experts_per_tok: int = 8
    n_group: int = 1
    topk_group: int = 1
    n_shared_experts: int = 1
    moe_intermediate_size: int = 2048
    intermediate_size: int = 12288
    first_k_dense_replace: int = 3
    routed_scaling_factor: float = 2.5
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-5
    rope_theta: float = 8_000_000.0
    rope_scaling: YarnScaling | None = None
    rope_interleave: bool = True
    indexer_rope_interleave: bool = True
    max_position_embeddings: int = 1_048_576
    vocab_size: int = 154_880
    tie_word_embeddings: bool = False
    page_size: int = 64
    dense_attn_kv_len_threshold: int = 2048
    index_k_norm_eps: float = 1e-6
    scale_fmt: str | None = "ue8m0"

    def __post_init__(self) -> None:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        rules = {k: r for k, r in SCHEMA.items() if k in fields and k != "rope_scaling"}  # a YarnScaling here
        problems = schema_problems(fields, rules, show=repr)
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, YarnScaling):
            problems.append(f"rope_scaling={self.rope_scaling!r} must be a YarnScaling or None")
        if problems:
            raise ValueError("\n".join(problems))
        if not self.indexer_types:
            object.__setattr__(
                self,
                "indexer_types",
                indexer_types_from_rule(
                    self.num_hidden_layers, self.index_topk_freq, self.index_skip_topk_offset
                ),
            )
        else:
            object.__setattr__(self, "indexer_types", tuple(self.indexer_types))
        self._validate()

    # ---------------------------------------------------------------- validation
    # The cross-field rules (each field's type and range are SCHEMA's, checked first): one flat
    # list, one message per rule, every broken rule reported at once, one line each.
    def _validate(self) -> None:
        problems: list[str] = []

        def need(ok: bool, msg: str) -> None:
            if not ok:
                problems.append(msg)

        need(
            self.index_topk % 64 == 0,
            f"index_topk={self.index_topk} must be a multiple of 64 (one KV page); "
            f"use {max(64, self.index_topk // 64 * 64)}",
        )
        need(
            len(self.indexer_types) == self.num_hidden_layers,
            f"indexer_types has {len(self.indexer_types)} entries; it needs one per layer "
            f"(num_hidden_layers={self.num_hidden_layers})",
        )
        bad = sorted({t for t in self.indexer_types if t not in (FULL, SHARED)})
        need(not bad, f"indexer_types may hold only 'full' or 'shared', got {bad}")
        need(
            self.indexer_types[0] == FULL,
            "indexer_types[0] must be 'full': a shared layer reuses an earlier full layer's top-k",
        )
        need(
            self.page_size & (self.page_size - 1) == 0,
            f"page_size={self.page_size} must be a power of two",
        )
        need(
            self.index_head_dim & (self.index_head_dim - 1) == 0,
            f"index_head_dim={self.index_head_dim} must be a power of two (Hadamard size); "
            "the index key's FP8 block is one key of any such width",
        )
        need(
            self.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)",
        )
        need(
            self.qk_rope_head_dim <= self.index_head_dim,
            f"qk_rope_head_dim={self.qk_rope_head_dim} must be ≤ index_head_dim={self.index_head_dim}",
        )
        need(
            self.n_routed_experts % self.n_group == 0,
            f"n_routed_experts={self.n_routed_experts} must be divisible by n_group={self.n_group}",
        )
        need(
            self.topk_group <= self.n_group,
            f"topk_group={self.topk_group} must be ≤ n_group={self.n_group}",
        )
        need(
            self.num_experts_per_tok <= self.topk_group * (self.n_routed_experts // self.n_group),
            f"num_experts_per_tok={self.num_experts_per_tok} exceeds the experts in the kept "
            f"groups (topk_group × n_routed_experts / n_group = "
            f"{self.topk_group * (self.n_routed_experts // self.n_group)})",
        )
        need(
            self.n_group == 1 or self.n_routed_experts // self.n_group >= 2,
            "group-limited routing sums each group's top-2 scores: each group needs ≥ 2 experts",
        )
        need(
            0 <= self.first_k_dense_replace <= self.num_hidden_layers,
            f"first_k_dense_replace={self.first_k_dense_replace} must lie in "
            f"[0, num_hidden_layers={self.num_hidden_layers}]",
        )
        if problems:
            raise ValueError("\n".join(problems))

    # ---------------------------------------------------------------- derived
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_latent_dim(self) -> int:
        """Width of one cached MLA latent row ``[c | k_pe]`` (576 for GLM-5.3)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """MLA attention scale: ``qk_head_dim**-0.5`` times YaRN's mscale² when scaled."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_scaling is not None:
            m = self.rope_scaling.mscale_value(self.rope_scaling.mscale_all_dim)
            scale *= m * m
        return scale

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == FULL)

    @property
    def shared_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.indexer_types) if t == SHARED)

    def is_full(self, layer: int) -> bool:
        return self.indexer_types[layer] == FULL

    def is_moe(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    def topk_source(self, layer: int) -> int:
        """The full layer whose top-k layer ``layer`` uses (itself if it is full)."""
        for i in range(layer, -1, -1):
            if self.indexer_types[i] == FULL:
                return i
        raise AssertionError("layer 0 is always full")  # guaranteed by validation

    def replace(self, **changes: Any) -> "DSAConfig":
        """A copy with ``changes``; ``indexer_types`` is re-derived unless given or unchanged."""
        rule_fields = {"num_hidden_layers", "index_topk_freq", "index_skip_topk_offset"}
        if "indexer_types" not in changes and rule_fields & changes.keys():
            changes["indexer_types"] = ()
        return dataclasses.replace(self, **changes)


_GLM53 = DSAConfig(name="glm-5.3")

_DSV32 = DSAConfig(
    name="deepseek-v3.2",
    model_type="deepseek_v32",
    num_hidden_layers=61,
    hidden_size=7168,
    num_attention_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=2048,
    index_topk_freq=1,
    index_skip_topk_offset=2,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    moe_intermediate_size=2048,
    intermediate_size=18432,
    first_k_dense_replace=3,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    rope_scaling=YarnScaling(),
    rope_interleave=True,
    indexer_rope_interleave=False,
    max_position_embeddings=163_840,
    vocab_size=129_280,
)

# Realistic ratios at small width: both full and shared layers, dense then MoE layers, and an
# index_topk far below the test lengths so that sparsity bites.
_SMALL = DSAConfig(
    name="small",
    num_hidden_layers=8,
    hidden_size=256,
    num_attention_heads=4,
    q_lora_rank=128,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=64,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    moe_intermediate_size=32,
    intermediate_size=512,
    first_k_dense_replace=2,
    rope_theta=10_000.0,
    max_position_embeddings=65_536,
    vocab_size=512,
)

_TINY = DSAConfig(
    name="tiny",
    num_hidden_layers=4,
    hidden_size=128,
    num_attention_heads=4,
    q_lora_rank=64,
    kv_lora_rank=128,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    index_n_heads=4,
    index_head_dim=128,
    index_topk=64,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_shared_experts=1,
    moe_intermediate_size=64,
    intermediate_size=256,
    first_k_dense_replace=1,
    rope_theta=10_000.0,
    max_position_embeddings=16_384,
    vocab_size=512,
)

PRESETS: dict[str, DSAConfig] = {c.name: c for c in (_GLM53, _DSV32, _SMALL, _TINY)}


def get_config(name_or_path: str) -> DSAConfig:
    """A preset by name, or a Hugging Face ``config.json`` (file or directory holding one)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    if os.path.isdir(name_or_path) or os.path.isfile(name_or_path):
        return from_hf_config(name_or_path)
    raise ValueError(
        f"unknown config {name_or_path!r}: use a preset ({', '.join(PRESETS)}) or a path to a "
        "Hugging Face config.json"
    )


# ------------------------------------------------------------------ a slice of the layer stack
def parse_layers(spec: str | int | range, num_hidden_layers: int) -> range:
    """``--layers`` as a range of layer indices: ``"N"`` (the first N layers) or ``"a:b"``
    (layers a … b-1, Python's slice), checked against ``num_hidden_layers``."""
    if isinstance(spec, range):
        kept = spec
    elif isinstance(spec, int):
        kept = range(spec)
    else:
        text = spec.strip()
        try:
            if ":" in text:
                a, b = text.split(":")
                kept = range(int(a), int(b))
            else:
                kept = range(int(text))
        except ValueError:
            raise ValueError(
                f"layers {spec!r} is neither a count N nor a range a:b of layer indices (e.g. 6:7)"
            ) from None
    if kept.step != 1 or not 0 <= kept.start < kept.stop <= num_hidden_layers:
        raise ValueError(
            f"layers {spec!r} must keep one or more consecutive layers of 0 … "
            f"{num_hidden_layers - 1} (count N ≤ {num_hidden_layers}, or a:b with 0 ≤ a < b ≤ "
            f"{num_hidden_layers})"
        )
    return kept


def keep_layers(config: DSAConfig, spec: str | int | range) -> DSAConfig:
    """``config`` cut down to the layers ``spec`` names (see ``parse_layers``), renumbered 0 … n-1.

    Each kept layer keeps its kind: full or shared indexer (``indexer_types``) and dense or MoE
    (``first_k_dense_replace`` counts the kept dense layers, which come first as in the original).
    The first kept layer must be full, since a shared layer reuses the top-k of the full layer
    before it. The name records the slice (``glm-5.3[6:7]``); ``weights.load_checkpoint(...,
    layers=spec)`` maps checkpoint layer ``start + i`` to layer ``i``.
    """
    kept = parse_layers(spec, config.num_hidden_layers)
    if not config.is_full(kept.start):
        source = config.topk_source(kept.start)
        raise ValueError(
            f"layers {kept.start}:{kept.stop} start at shared layer {kept.start}, which reuses the "
            f"top-k of full layer {source}; keep that layer too (e.g. {source}:{kept.stop})"
        )
    if kept == range(config.num_hidden_layers):
        return config
    return config.replace(
        name=f"{config.name}[{kept.start}:{kept.stop}]",
        num_hidden_layers=len(kept),
        indexer_types=tuple(config.indexer_types[i] for i in kept),
        first_k_dense_replace=sum(1 for i in kept if not config.is_moe(i)),
    )


# ------------------------------------------------------------------ Hugging Face config I/O
_DIRECT_FIELDS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
    "index_topk", "index_topk_freq", "index_skip_topk_offset", "n_routed_experts",
    "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts", "moe_intermediate_size",
    "intermediate_size", "first_k_dense_replace", "routed_scaling_factor", "norm_topk_prob",
    "rms_norm_eps", "rope_interleave", "indexer_rope_interleave", "max_position_embeddings",
    "vocab_size", "tie_word_embeddings",
)
_EXTRA_FIELDS = ("page_size", "dense_attn_kv_len_threshold", "index_k_norm_eps", "scale_fmt")
# keys a config.json must define: each sets a tensor shape or the layer schedule
_SHAPE_FIELDS = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "index_n_heads", "index_head_dim",
    "index_topk", "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group",
    "n_shared_experts", "moe_intermediate_size", "intermediate_size", "first_k_dense_replace",
    "vocab_size",
)
_KNOWN_KEYS = frozenset(_DIRECT_FIELDS + _EXTRA_FIELDS + ("model_type", "rope_theta", "rope_scaling",
                                                             "rope_parameters", "indexer_types"))


def _yarn_from_dict(d: Mapping[str, Any]) -> YarnScaling | None:
    """YaRN from a schema-checked ``rope_scaling`` / ``rope_parameters`` object (None: no scaling)."""
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in (None, "default"):
        return None
    ref = YarnScaling()
    return YarnScaling(
        factor=float(d.get("factor", ref.factor)),
        original_max_position_embeddings=int(
            d.get("original_max_position_embeddings", ref.original_max_position_embeddings)
        ),
        beta_fast=float(d.get("beta_fast", ref.beta_fast)),
        beta_slow=float(d.get("beta_slow", ref.beta_slow)),
        mscale=float(d.get("mscale", ref.mscale)),
        mscale_all_dim=float(d.get("mscale_all_dim", ref.mscale_all_dim)),
    )


def _read_config_json(path: str) -> dict[str, Any]:
    """The JSON object of a ``config.json`` file (or of a directory's), every failure naming it."""
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"config {os.path.dirname(path)} is a directory without a config.json")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except PermissionError:
        raise ValueError(f"config {path} is not readable; check its permissions") from None
    except UnicodeDecodeError:
        raise ValueError(f"config {path} is not UTF-8 text; a config.json is one JSON object") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"config {path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(d, dict):
        raise ValueError(f"config {path} holds a JSON {type(d).__name__.replace('dict', 'object')}, "
                         "not an object; a config.json is one JSON object {...} of named keys")
    return d


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> DSAConfig:
    """Build a config from a Hugging Face ``config.json`` (path, directory or parsed dict).

    Reads HF's own names: ``rope_parameters`` (transformers ≥ 5) or ``rope_theta`` +
    ``rope_scaling``; an explicit ``indexer_types`` list wins over the freq/offset rule; HF's
    defaults for GLM (freq 1, offset 2) apply when neither is given. A ``deepseek_v32`` config
    (DeepSeek-V3.2's published ``config.json``) defaults to a half-split indexer RoPE.

    Every key read is checked against ``SCHEMA`` / ``ROPE_SCHEMA`` (type, range, allowed values)
    and then the cross-field rules, before anything is built: the ``ValueError`` has one line per
    broken rule, each naming the file, the key, its value and what is allowed. A key that is not
    read but is a near-miss of one that is (``routed_scaling_factr``) is warned about (``did you
    mean``), since its default then applies.
    """
    if isinstance(path_or_dict, Mapping):
        d = dict(path_or_dict)
        where = name = str(d.get("_name_or_path", "hf"))
    else:
        where = os.fspath(path_or_dict)
        d = _read_config_json(where)
        name = str(d.get("_name_or_path", where))

    def refuse(lines: list[str]) -> ValueError:
        return ValueError("\n".join(f"config {where}: {line}" for line in lines))

    missing = [f for f in _SHAPE_FIELDS if f not in d]
    if missing:
        hints = []
        for f in missing:
            near = difflib.get_close_matches(f, [k for k in d if k not in _KNOWN_KEYS], n=1, cutoff=0.8)
            hints.append(f"{f} (did you mean: {near[0]!r}?)" if near else f)
        raise refuse([f"lacks key(s) that set tensor shapes or the layer schedule: {', '.join(hints)}"])
    problems = schema_problems(d, SCHEMA)
    rope_key = "rope_parameters" if isinstance(d.get("rope_parameters"), Mapping) else "rope_scaling"
    rope = d.get(rope_key) if isinstance(d.get(rope_key), Mapping) else None
    hf_defaults = {**{k: getattr(_GLM53, k) for k in _DIRECT_FIELDS + _EXTRA_FIELDS},
                   "index_topk_freq": 1, "index_skip_topk_offset": 2, "rope_theta": 10_000.0}
    warnings_ = near_misses(d, hf_defaults)
    if rope is not None:
        problems += schema_problems(rope, ROPE_SCHEMA, f"{rope_key}.")
        yarn_defaults = {"rope_type": "default", "type": "default", "rope_theta": 10_000.0,
                         **dataclasses.asdict(YarnScaling())}
        warnings_ += near_misses(rope, yarn_defaults, f"{rope_key}.")
    for line in warnings_:
        warnings.warn(f"config {where}: {line}", stacklevel=2)
    if problems:
        raise refuse(problems)

    kw: dict[str, Any] = {"name": name, "model_type": d.get("model_type", "glm_moe_dsa")}
    defaults: dict[str, Any] = {"index_topk_freq": 1, "index_skip_topk_offset": 2}
    if kw["model_type"] == "deepseek_v32":
        # DeepSeek-V3.2's config.json has no RoPE-layout keys; its indexer rotates half-split pairs
        # (DeepSeek's inference code, fixed 2025-11-17) while MLA's are interleaved
        defaults["indexer_rope_interleave"] = False
    for f in _DIRECT_FIELDS:
        if f in d:
            kw[f] = d[f]
        elif f in defaults:
            kw[f] = defaults[f]
    for f in _EXTRA_FIELDS:
        if f in d:
            kw[f] = d[f]
    top_theta = d.get("rope_theta", 10_000.0)
    kw["rope_theta"] = float(rope.get("rope_theta", top_theta) if rope is not None and rope_key == "rope_parameters"
                             else top_theta)
    if d.get("indexer_types"):
        kw["indexer_types"] = tuple(d["indexer_types"])
    try:
        kw["rope_scaling"] = _yarn_from_dict(rope) if rope is not None else None
        return DSAConfig(**kw)
    except ValueError as e:
        raise refuse(str(e).replace("rope_scaling.", f"{rope_key}.").splitlines()) from None


def to_hf_config(config: DSAConfig) -> dict[str, Any]:
    """The Hugging Face ``config.json`` dict for ``config`` (HF field names, explicit layer list)."""
    arch = "GlmMoeDsaForCausalLM" if config.model_type == "glm_moe_dsa" else "DeepseekV32ForCausalLM"
    d: dict[str, Any] = {
        "_name_or_path": config.name,
        "architectures": [arch],
        "model_type": config.model_type,
    }
    for f in _DIRECT_FIELDS:
        d[f] = getattr(config, f)
    d["num_key_value_heads"] = config.num_attention_heads
    d["indexer_types"] = list(config.indexer_types)
    rope: dict[str, Any] = {"rope_theta": config.rope_theta, "rope_type": "default"}
    if config.rope_scaling is not None:
        rope.update(rope_type="yarn", **dataclasses.asdict(config.rope_scaling))
    d["rope_parameters"] = rope
    d["rope_theta"] = config.rope_theta
    for f in _EXTRA_FIELDS:
        d[f] = getattr(config, f)
    return d

