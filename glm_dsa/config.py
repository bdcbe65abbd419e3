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
from dataclasses import dataclass
from typing import Any, Mapping

__all__ = [
    "DSAConfig",
    "YarnScaling",
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


@dataclass(frozen=True)
class YarnScaling:
    """YaRN RoPE scaling (DeepSeek-V3.2's ``rope_scaling``); GLM-5.x has none."""

    factor: float = 40.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 1.0

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
    # One flat list of checks, one per rule on the fields, each with its own message: splitting
    # it would only scatter the rules a reader looks for in one place (81 lines).
    def _validate(self) -> None:
        def need(ok: bool, msg: str) -> None:
            if not ok:
                raise ValueError(msg)

        positive = [
            "num_hidden_layers", "hidden_size", "num_attention_heads", "q_lora_rank",
            "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
            "index_n_heads", "index_head_dim", "index_topk", "n_routed_experts",
            "num_experts_per_tok", "n_group", "topk_group", "moe_intermediate_size",
            "intermediate_size", "max_position_embeddings", "vocab_size", "page_size",
        ]
        for f in positive:
            v = getattr(self, f)
            need(isinstance(v, int) and v > 0, f"{f}={v!r} must be a positive integer")
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
        need(self.n_shared_experts >= 0, f"n_shared_experts={self.n_shared_experts} must be ≥ 0")
        need(
            self.scale_fmt in (None, "ue8m0"),
            f"scale_fmt={self.scale_fmt!r} must be None (fp32 amax/448) or 'ue8m0'",
        )
        need(self.rms_norm_eps > 0, f"rms_norm_eps={self.rms_norm_eps} must be > 0")

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
_KNOWN_KEYS = frozenset(_DIRECT_FIELDS + _EXTRA_FIELDS)


def _yarn_from_dict(d: Mapping[str, Any]) -> YarnScaling | None:
    kind = d.get("rope_type", d.get("type", "default"))
    if kind in (None, "default"):
        return None
    if kind != "yarn":
        raise ValueError(f"rope scaling type {kind!r} is not supported; only 'yarn' or none")
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


def from_hf_config(path_or_dict: str | os.PathLike | Mapping[str, Any]) -> DSAConfig:
    """Build a config from a Hugging Face ``config.json`` (path, directory or parsed dict).

    Reads HF's own names: ``rope_parameters`` (transformers ≥ 5) or ``rope_theta`` +
    ``rope_scaling``; an explicit ``indexer_types`` list wins over the freq/offset rule; HF's
    defaults for GLM (freq 1, offset 2) apply when neither is given. A ``deepseek_v32`` config
    (DeepSeek-V3.2's published ``config.json``) defaults to a half-split indexer RoPE.
    """
    if isinstance(path_or_dict, Mapping):
        d = dict(path_or_dict)
        name = str(d.get("_name_or_path", "hf"))
    else:
        p = os.fspath(path_or_dict)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p, encoding="utf-8") as f:
            d = json.load(f)
        name = str(d.get("_name_or_path", p))
    kw: dict[str, Any] = {"name": name, "model_type": d.get("model_type", "glm_moe_dsa")}
    defaults: dict[str, Any] = {"index_topk_freq": 1, "index_skip_topk_offset": 2}
    if kw["model_type"] == "deepseek_v32":
        # DeepSeek-V3.2's config.json has no RoPE-layout keys; its indexer rotates half-split pairs
        # (DeepSeek's inference code, fixed 2025-11-17) while MLA's are interleaved
        defaults["indexer_rope_interleave"] = False
    missing = [f for f in _SHAPE_FIELDS if f not in d]
    if missing:
        hints = []
        for f in missing:
            near = difflib.get_close_matches(f, [k for k in d if k not in _KNOWN_KEYS], n=1, cutoff=0.8)
            hints.append(f"{f} (did you mean: {near[0]!r}?)" if near else f)
        raise ValueError(f"config {name} lacks key(s) that set tensor shapes or the layer schedule: "
                         f"{', '.join(hints)}")
    for f in _DIRECT_FIELDS:
        if f in d:
            kw[f] = d[f]
        elif f in defaults:
            kw[f] = defaults[f]
    for f in _EXTRA_FIELDS:
        if f in d:
            kw[f] = d[f]
    rope = d.get("rope_parameters")
    if isinstance(rope, Mapping):
        kw["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10_000.0)))
        kw["rope_scaling"] = _yarn_from_dict(rope)
    else:
        kw["rope_theta"] = float(d.get("rope_theta", 10_000.0))
        scaling = d.get("rope_scaling")
        kw["rope_scaling"] = _yarn_from_dict(scaling) if isinstance(scaling, Mapping) else None
    if d.get("indexer_types"):
        kw["indexer_types"] = tuple(d["indexer_types"])
    return DSAConfig(**kw)


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

