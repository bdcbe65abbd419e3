"""Cost ledger of a chunked DSA prefill, computed from a config alone.

Every figure is a pure function of a :class:`~glm_dsa.config.DSAConfig` and a few run
parameters (prompt length, chunk size, cached prefix, CP degree, GPU spec), so the same code
accounts for ``glm-5.3``, ``deepseek-v3.2``, ``small`` and ``tiny``.

Units and conventions:

- FLOPs count **2 per multiply-add** and only the matrix products (norms, RoPE, softmax and
  top-k are not counted), as the design article does.
- Bytes are bytes; ``GB = 1e9`` bytes (the article's decimal unit). Rates are per second.
- ``tokens`` is the whole prompt length L (positions ``0 .. L-1``), ``prefix`` the P tokens
  already in the cache; the prefill computes the ``N = L - P`` new tokens.
- A query at absolute position ``i`` is scored by the indexer against ``i + 1`` keys (itself
  and everything before it, cached prefix included) and attends to ``min(index_topk, i + 1)``.

The exact integer helpers (``cache_bytes_written``, ``chunk_plan``, ``indexer_pairs``,
``cp_rank_positions``, ``cp_indexer_pairs_per_rank``, ``cp_comm_bytes_per_chunk``,
``logits_budget_bytes_static``) are what the rest of the project checks real runs against.
``build_ledger`` assembles everything into one JSON-ready dict (keys documented in
``docs/ledger.md``); ``glm_dsa.ledger_text.format_ledger`` renders that dict as text tables.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

from glm_dsa.batch import CP_BOUNDARY_GATHER, CP_SPLITS, INDEX_K_ALLGATHER, LATENT_ALLGATHER
import torch

from glm_dsa.budget import (LOGITS_TOTAL_MEM_CAP, NO_CHUNK_LOGITS, attention_row_bytes, attention_rows,
                            max_logit_rows, moe_row_bytes, moe_rows)
from glm_dsa.config import FULL, DSAConfig
from glm_dsa.indexer import TILE_BYTES
from glm_dsa.invariant import BATCH_TILE
from glm_dsa.kv_format import MLA_KV_FORMATS, MLA_TILE, index_k_page_bytes, mla_kv_unsupported
from glm_dsa.validate import need

__all__ = [
    "SCHEMA",
    "PLAN_LIST_MAX_CHUNKS",
    "GpuSpec",
    "OpFlops",
    "IndexerPairs",
    "CommRow",
    "TtftComponent",
    "main_kv_row_bytes",
    "index_k_row_bytes",
    "main_kv_page_bytes",
    "cache_bytes_written",
    "chunk_plan",
    "chunk_runs",
    "prefill_peak_bytes",
    "step_peak_bytes",
    "ALLOCATOR_SLACK_BYTES",
    "ALLOCATOR_SLACK_PERCENT",
    "LAYER_KINDS",
    "layer_kind_counts",
    "layer_weight_elements",
    "layer_weight_bytes",
    "outer_weight_elements",
    "layer_cache_row_bytes",
    "largest_tensor_elements",
    "indexer_pairs",
    "index_k_reread_bytes",
    "op_flops",
    "layer_flops_per_token",
    "sparse_mla_keys",
    "indexer_flops_per_pair",
    "param_counts",
    "logits_budget_bytes_static",
    "logits_row_slices",
    "cp_rank_positions",
    "cp_indexer_pairs_per_rank",
    "cp_mean_prefix_article",
    "cp_comm_bytes_per_chunk",
    "ttft_floor",
    "build_ledger",
]

# Names, formats and thresholds come from the modules that own them (the split names from
# glm_dsa.batch, the KV formats and the index-K page from glm_dsa.kv_format, the logits
# thresholds from glm_dsa.indexer). Some rules are re-derived here on purpose, from the config
# alone, as a cross-check the tests hold against the implementation: the main-KV and index-K row
# bytes (kv_format.mla_kv_row_bytes), the row slicing (budget.max_logit_rows), the static logits
# budget (budget.logits_budget_bytes without the live free memory) and the CP split
# (cp.split_rows).
SCHEMA = "glm-dsa.ledger/1"

GB = 10**9
FP32_BYTES = 4
BF16_BYTES = 2
FP8_BYTES = 1


def _need_int(name: str, value: Any, minimum: int) -> None:
    need(
        isinstance(value, int) and not isinstance(value, bool) and value >= minimum,
        f"{name}={value!r} must be an integer ≥ {minimum}",
    )


def _check_kv_dtype(kv_dtype: str) -> None:
    need(kv_dtype in MLA_KV_FORMATS, f"kv_dtype={kv_dtype!r} must be one of {MLA_KV_FORMATS}")


# ============================================================================ byte formats
def main_kv_row_bytes(config: DSAConfig, kv_dtype: str = "fp8") -> int:
    """Bytes of one token's MLA latent row in one layer's KV cache.

    ``"fp8"`` (FlashMLA ``V32_FP8Sparse``): ``kv_lora_rank`` e4m3 bytes, one float32 scale per
    128-element tile, ``qk_rope_head_dim`` bf16 values (656 for GLM-5.3); a ``kv_lora_rank`` that
    is not whole tiles is refused (``kv_format.mla_kv_unsupported``, the cache's rule). ``"bf16"``:
    ``2 * (kv_lora_rank + qk_rope_head_dim)`` (1152).
    """
    _check_kv_dtype(kv_dtype)
    why = mla_kv_unsupported(config.kv_lora_rank, kv_dtype)
    need(why is None, str(why))
    if kv_dtype == "fp8":
        return (
            config.kv_lora_rank * FP8_BYTES
            + FP32_BYTES * (config.kv_lora_rank // MLA_TILE)
            + BF16_BYTES * config.qk_rope_head_dim
        )
    return BF16_BYTES * config.kv_latent_dim


def index_k_row_bytes(config: DSAConfig) -> int:
    """Bytes of one token's index key in one full layer: FP8 values plus one float32 scale (132)."""
    return config.index_head_dim * FP8_BYTES + FP32_BYTES


def main_kv_page_bytes(config: DSAConfig, kv_dtype: str = "fp8") -> int:
    """Bytes of one ``page_size``-token page of one layer's MLA KV cache (41,984 for GLM-5.3 fp8)."""
    return config.page_size * main_kv_row_bytes(config, kv_dtype)


def cache_bytes_written(
    config: DSAConfig, extend_tokens: int, kv_dtype: str = "fp8"
) -> dict[str, int]:
    """Cache bytes a prefill of ``extend_tokens`` new tokens writes, over the whole model.

    Returns ``{"main_kv": …, "index_k": …, "total": …}`` in bytes: the MLA latent row in every
    layer, the index key only in full layers (shared layers have no index-K cache).
    """
    _need_int("extend_tokens", extend_tokens, 0)
    main = extend_tokens * config.num_hidden_layers * main_kv_row_bytes(config, kv_dtype)
    index = extend_tokens * len(config.full_layers) * index_k_row_bytes(config)
    return {"main_kv": main, "index_k": index, "total": main + index}


# ============================================================================ chunk plan
def chunk_runs(
    total_tokens: int, chunk: int, prefix: int = 0, page_size: int = 64
) -> list[tuple[int, int, int]]:
    """:func:`chunk_plan` as runs ``[(start, size, count), …]`` of ``count`` consecutive chunks of
    exactly ``size`` tokens from ``start``; at most three runs, built in constant time.

    After the first chunk every start is page-aligned, so every chunk but the last takes
    ``floor(chunk / page_size) * page_size`` tokens: the plan is a first chunk, a uniform run and
    a last chunk. The ledger's sums over chunks are closed forms over these runs, so its time
    does not grow with ``total_tokens``.
    """
    _need_int("total_tokens", total_tokens, 1)
    _need_int("prefix", prefix, 0)
    _need_int("page_size", page_size, 1)
    _need_int("chunk", chunk, 1)
    need(prefix < total_tokens, f"prefix={prefix} must be < total_tokens={total_tokens}: the "
          "prefill computes at least one new token")
    need(chunk >= page_size, f"chunk={chunk} tokens is smaller than one page (page_size="
          f"{page_size}); a chunk must hold at least one page")
    step = chunk // page_size * page_size
    # the remaining tokens round up to ≤ chunk tokens of whole pages  ⟺  they are ≤ step
    if total_tokens - prefix <= step:
        return [(prefix, total_tokens - prefix, 1)]
    first_end = min(total_tokens, (prefix + chunk) // page_size * page_size)
    runs = [(prefix, first_end - prefix, 1)]
    if first_end == total_tokens:  # an unaligned prefix whose pages reach past the end
        return runs
    uniform = max(0, -(-(total_tokens - step - first_end) // step))
    if uniform:
        runs.append((first_end, step, uniform))
    last = first_end + uniform * step
    runs.append((last, total_tokens - last, 1))
    return runs


def chunk_plan(
    total_tokens: int, chunk: int, prefix: int = 0, page_size: int = 64
) -> list[tuple[int, int]]:
    """Chunk boundaries ``[(start, end), …]`` covering ``[prefix, total_tokens)`` (docs/conventions.md §11).

    A step whose remaining ``total_tokens - start`` tokens round up to at most ``chunk`` tokens
    of whole pages takes them all; otherwise the chunk ends on a page boundary in absolute
    position, ``end = floor((start + chunk) / page_size) * page_size`` (SGLang ``PrefillAdder``).
    Interior boundaries are therefore multiples of ``page_size``; only the first start (an
    unaligned prefix) and the last end may not be.
    """
    return [(s + j * b, s + (j + 1) * b)
            for s, b, n in chunk_runs(total_tokens, chunk, prefix, page_size) for j in range(n)]


def _check_plan(plan: Sequence[tuple[int, int]]) -> None:
    need(len(plan) > 0, "the chunk plan is empty; build it with chunk_plan()")
    for (s0, e0), (s1, _) in zip(plan, plan[1:]):
        need(e0 == s1, f"chunk plan is not contiguous: ({s0}, {e0}) is followed by a chunk "
              f"starting at {s1}")
    for s, e in plan:
        need(0 <= s < e, f"chunk ({s}, {e}) must satisfy 0 ≤ start < end")


# Above this many chunks the ledger's JSON gives the chunk plan as runs only (docs/ledger.md).
PLAN_LIST_MAX_CHUNKS = 100_000


# ============================================================================ indexer pairs
def _sum_positions_plus_one(a: int, b: int) -> int:
    """``Σ_{i=a}^{b-1} (i + 1)``: keys scored by the queries at positions ``a .. b-1``."""
    return (b * (b + 1) - a * (a + 1)) // 2


@dataclass(frozen=True)
class IndexerPairs:
    """(query, key) pairs one full layer's indexer scores over a chunked prefill.

    Exact integers: ``total = intra_chunk + cross_chunk + prefix_cache``, where ``intra_chunk =
    Σ_j b_j (b_j + 1) / 2`` (keys of the query's own chunk, causal, itself included),
    ``cross_chunk = Σ_{i<j} b_i b_j`` (new tokens of earlier chunks) and ``prefix_cache = P · N``
    (the cached prefix, scored by every new query). ``*_approx`` are the article's
    approximations: ``N² / (2m)``, ``N² / 2`` and ``N² / 2 + P · N`` for ``m`` chunks.
    """

    total: int
    intra_chunk: int
    cross_chunk: int
    prefix_cache: int
    intra_chunk_approx: float
    cross_chunk_approx: float
    total_approx: float


def indexer_pairs(plan: Sequence[tuple[int, int]]) -> IndexerPairs:
    """Exact pair counts of one full layer over ``plan`` (from :func:`chunk_plan`).

    The cached prefix is ``plan[0][0]``: a query at absolute position ``i`` scores ``i + 1`` keys.
    """
    return _indexer_pairs(_runs_of(plan))


def _runs_of(plan: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """A checked plan as runs ``(start, size, count)`` of equal consecutive chunks."""
    _check_plan(plan)
    runs: list[tuple[int, int, int]] = []
    for s, e in plan:
        if runs and runs[-1][1] == e - s:
            runs[-1] = (runs[-1][0], e - s, runs[-1][2] + 1)
        else:
            runs.append((s, e - s, 1))
    return runs


def _run_starts(start: int, size: int, count: int) -> int:
    """``Σ_j (start + j · size)`` over the ``count`` chunks of one run."""
    return count * start + size * count * (count - 1) // 2


def _indexer_pairs(runs: Sequence[tuple[int, int, int]]) -> IndexerPairs:
    prefix = runs[0][0]
    end = runs[-1][0] + runs[-1][1] * runs[-1][2]
    new = end - prefix
    intra = sum(n * b * (b + 1) // 2 for _, b, n in runs)
    cross = sum(b * (_run_starts(s, b, n) - n * prefix) for s, b, n in runs)
    m = sum(n for _, _, n in runs)
    return IndexerPairs(
        total=_sum_positions_plus_one(prefix, end),
        intra_chunk=intra,
        cross_chunk=cross,
        prefix_cache=prefix * new,
        intra_chunk_approx=new * new / (2 * m),
        cross_chunk_approx=new * new / 2,
        total_approx=new * new / 2 + prefix * new,
    )


def index_k_reread_bytes(config: DSAConfig, plan: Sequence[tuple[int, int]]) -> int:
    """Index-K bytes of the already-committed prefix read again by each chunk, all full layers.

    Chunk ``j`` starting at ``s_j`` reads the ``s_j`` index keys before it (cached prefix
    included) once per full layer: ``full_layers · index_k_row_bytes · Σ_j s_j``. The article
    approximates ``Σ_j s_j`` by ``N² / (2B)`` for ``P = 0``.
    """
    return _index_k_reread_bytes(config, _runs_of(plan))


def _index_k_reread_bytes(config: DSAConfig, runs: Sequence[tuple[int, int, int]]) -> int:
    return len(config.full_layers) * index_k_row_bytes(config) * sum(_run_starts(*r) for r in runs)


def indexer_flops_per_pair(config: DSAConfig) -> int:
    """FLOPs of one (query, key) score: ``index_n_heads`` dot products of ``index_head_dim`` (8192)."""
    return 2 * config.index_n_heads * config.index_head_dim


# ============================================================================ FLOPs per op
@dataclass(frozen=True)
class OpFlops:
    """One matrix product of a layer.

    ``flops_per_token`` is per token per layer it runs in; ``applies_to`` is ``"all"``,
    ``"full"`` (full indexer layers), ``"moe"`` or ``"dense"``; ``in_article`` says whether the
    article's per-op table lists it (the router gate is not listed there).
    """

    op: str
    shape: str
    flops_per_token: int
    applies_to: str
    in_article: bool = True


def op_flops(config: DSAConfig) -> list[OpFlops]:
    """Per-token FLOPs of every matrix product, in the order of the article's table.

    ``sparse_mla`` assumes ``index_topk`` keys per query (QK over ``kv_lora_rank +
    qk_rope_head_dim`` and PV over ``kv_lora_rank``); :func:`sparse_mla_keys` gives the exact
    key count near the start of a sequence.
    """
    c = config
    h, heads, topk = c.hidden_size, c.num_attention_heads, c.index_topk
    experts = c.num_experts_per_tok
    return [
        OpFlops("a_proj", f"{h}->{c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim}",
                2 * h * (c.q_lora_rank + c.kv_lora_rank + c.qk_rope_head_dim), "all"),
        OpFlops("q_up", f"{c.q_lora_rank}->{heads * c.qk_head_dim}",
                2 * c.q_lora_rank * heads * c.qk_head_dim, "all"),
        OpFlops("q_absorb", f"{heads}x{c.qk_nope_head_dim}x{c.kv_lora_rank}",
                2 * heads * c.qk_nope_head_dim * c.kv_lora_rank, "all"),
        OpFlops("index_k", f"{h}->{c.index_head_dim}", 2 * h * c.index_head_dim, "full"),
        OpFlops("index_q", f"{c.q_lora_rank}->{c.index_n_heads * c.index_head_dim}",
                2 * c.q_lora_rank * c.index_n_heads * c.index_head_dim, "full"),
        OpFlops("index_gate", f"{h}->{c.index_n_heads}", 2 * h * c.index_n_heads, "full"),
        OpFlops("sparse_mla", f"{heads}x({c.kv_latent_dim}+{c.kv_lora_rank})x{topk}",
                2 * heads * (c.kv_latent_dim + c.kv_lora_rank) * topk, "all"),
        OpFlops("out_absorb", f"{heads}x{c.kv_lora_rank}x{c.v_head_dim}",
                2 * heads * c.kv_lora_rank * c.v_head_dim, "all"),
        OpFlops("o_proj", f"{heads * c.v_head_dim}->{h}", 2 * heads * c.v_head_dim * h, "all"),
        OpFlops("moe_experts", f"{experts}x3x{h}x{c.moe_intermediate_size}",
                2 * experts * 3 * h * c.moe_intermediate_size, "moe"),
        OpFlops("shared_experts", f"{c.n_shared_experts}x3x{h}x{c.moe_intermediate_size}",
                2 * c.n_shared_experts * 3 * h * c.moe_intermediate_size, "moe"),
        OpFlops("dense_mlp", f"3x{h}x{c.intermediate_size}", 2 * 3 * h * c.intermediate_size, "dense"),
        OpFlops("router_gate", f"{h}->{c.n_routed_experts}", 2 * h * c.n_routed_experts, "moe",
                in_article=False),
    ]


def _op_layers(config: DSAConfig, applies_to: str) -> int:
    counts = {
        "all": config.num_hidden_layers,
        "full": len(config.full_layers),
        "moe": config.num_hidden_layers - config.first_k_dense_replace,
        "dense": config.first_k_dense_replace,
    }
    return counts[applies_to]


def _op_runs_in(op: OpFlops, full: bool, moe: bool) -> bool:
    return {"all": True, "full": full, "moe": moe, "dense": not moe}[op.applies_to]


def layer_flops_per_token(config: DSAConfig, full: bool, moe: bool, with_router: bool = False) -> int:
    """Per-token FLOPs of one layer of the given kind (the article's ops; router optional).

    A full MoE layer of GLM-5.3 is 1,313,472,512 FLOPs/token (the article's "1313M").
    """
    return sum(
        op.flops_per_token
        for op in op_flops(config)
        if _op_runs_in(op, full, moe) and (op.in_article or with_router)
    )


def sparse_mla_keys(config: DSAConfig, start: int, end: int) -> int:
    """Exact ``Σ_{i=start}^{end-1} min(index_topk, i + 1)``: keys attended by positions ``start..end-1``."""
    _need_int("start", start, 0)
    need(end >= start, f"end={end} must be ≥ start={start}")
    k = config.index_topk

    def upto(x: int) -> int:  # Σ_{i<x} min(k, i + 1)
        return x * (x + 1) // 2 if x <= k else k * (k + 1) // 2 + (x - k) * k

    return upto(end) - upto(start)


def _model_flops_exact(config: DSAConfig, prefix: int, tokens: int) -> int:
    """All matrix-product FLOPs of the new tokens: router included, exact sparse-MLA keys."""
    new = tokens - prefix
    total = 0
    for op in op_flops(config):
        layers = _op_layers(config, op.applies_to)
        if op.op == "sparse_mla":
            per_key = op.flops_per_token // config.index_topk
            total += layers * per_key * sparse_mla_keys(config, prefix, tokens)
        else:
            total += layers * op.flops_per_token * new
    return total


# ============================================================================ parameters
def param_counts(config: DSAConfig) -> dict[str, int]:
    """Parameter counts (elements) by component, the model total, and those active per token.

    ``activated`` counts every weight a token touches: all but the ``n_routed_experts -
    num_experts_per_tok`` unchosen experts of each MoE layer.
    """
    c = config
    h, heads = c.hidden_size, c.num_attention_heads
    moe_layers = c.num_hidden_layers - c.first_k_dense_replace
    expert = 3 * h * c.moe_intermediate_size
    attention = (
        h * c.q_lora_rank + c.q_lora_rank
        + c.q_lora_rank * heads * c.qk_head_dim
        + h * c.kv_latent_dim + c.kv_lora_rank
        + c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        + heads * c.v_head_dim * h
    )
    indexer = (
        c.q_lora_rank * c.index_n_heads * c.index_head_dim
        + h * c.index_head_dim
        + 2 * c.index_head_dim
        + h * c.index_n_heads
    )
    counts = {
        "embedding": c.vocab_size * h,
        "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * h,
        "norms": c.num_hidden_layers * 2 * h + h,
        "attention_per_layer": attention,
        "indexer_per_full_layer": indexer,
        "dense_mlp_per_layer": 3 * h * c.intermediate_size,
        "experts_per_moe_layer": c.n_routed_experts * expert,
        "shared_experts_per_moe_layer": c.n_shared_experts * expert,
        "router_per_moe_layer": c.n_routed_experts * h + c.n_routed_experts,
    }
    counts["indexer_total"] = c.indexer_types.count(FULL) * indexer  # no per-layer tuple: any depth is cheap
    counts["total"] = (
        counts["embedding"] + counts["lm_head"] + counts["norms"]
        + c.num_hidden_layers * attention
        + counts["indexer_total"]
        + c.first_k_dense_replace * counts["dense_mlp_per_layer"]
        + moe_layers * (counts["experts_per_moe_layer"] + counts["shared_experts_per_moe_layer"]
                        + counts["router_per_moe_layer"])
    )
    counts["activated"] = counts["total"] - moe_layers * (c.n_routed_experts - c.num_experts_per_tok) * expert
    return counts


# ============================================================================ logits budget
def logits_budget_bytes_static(
    total_bytes: int, mem_fraction_static: float, free_fraction: float = 0.2
) -> int:
    """docs/conventions.md §12 static logits budget in bytes (SGLang ``mqa_logits_static_budget_bytes``).

    ``min(int(free_fraction * int(total * (1 - mem_fraction_static))), int(0.3 * total))``; the
    runtime budget is further capped by ``free_fraction`` of the live free memory, which a
    ledger cannot know. 141e9 bytes at 0.8 give 5,639,999,999 bytes.
    """
    _need_int("total_bytes", total_bytes, 1)
    need(0.0 <= mem_fraction_static <= 1.0,
          f"mem_fraction_static={mem_fraction_static} must lie in [0, 1]")
    need(0.0 < free_fraction <= 1.0, f"free_fraction={free_fraction} must lie in (0, 1]")
    static_free = int(total_bytes * max(0.0, 1.0 - mem_fraction_static))
    return min(int(static_free * free_fraction), int(total_bytes * LOGITS_TOTAL_MEM_CAP))


def logits_row_slices(num_q: int, num_k: int, budget_bytes: int) -> tuple[int, int]:
    """``(rows per slice, slices)`` of one ``[num_q, num_k]`` float32 logits matrix (§12).

    Unsliced when ``num_q * num_k < 8e6`` or the matrix fits the budget; otherwise
    ``rows = max(1, budget // (4 * num_k))`` and ``slices = ceil(num_q / rows)``.
    """
    _need_int("num_q", num_q, 1)
    _need_int("num_k", num_k, 1)
    _need_int("budget_bytes", budget_bytes, 0)
    if num_q * num_k < NO_CHUNK_LOGITS or FP32_BYTES * num_q * num_k <= budget_bytes:
        return num_q, 1
    rows = max(1, budget_bytes // (FP32_BYTES * num_k))
    return rows, -(-num_q // rows)


def _logits_peak_bytes(runs: Sequence[tuple[int, int, int]]) -> int:
    """Largest unsliced ``[b, end]`` float32 logits of any chunk (the last of each run is its largest)."""
    return max(FP32_BYTES * b * (s + n * b) for s, b, n in runs)


def _run_logits_slices(start: int, size: int, count: int, budget_bytes: int) -> int:
    """``Σ_j slices`` of :func:`logits_row_slices` over a run's chunks ``[start + j b, start + (j+1) b)``.

    Chunk ``j`` has ``num_k = e_j = start + (j + 1) b`` keys. Chunks are unsliced up to the last
    ``e`` with ``b e < 8e6`` or ``4 b e ≤ budget``; past it ``rows = max(1, budget // (4 e))`` is
    constant over blocks of ``e`` (at most ``2 √(budget / 4)`` of them), summed block by block.
    """
    quarter = budget_bytes // FP32_BYTES
    # last e that leaves a chunk unsliced (both conditions are monotone in e)
    e_free = max((NO_CHUNK_LOGITS - 1) // size, quarter // size)
    first_e = start + size
    j = max(0, min(count, (e_free - first_e) // size + 1)) if e_free >= first_e else 0
    total = j
    while j < count:
        e = first_e + j * size
        q = quarter // e
        if q == 0:  # one row per slice from here on
            return total + (count - j) * size
        e_last = quarter // q  # largest e with the same quotient
        block = min(count, (e_last - first_e) // size + 1) - j
        total += block * -(-size // q)
        j += block
    return total


# ============================================================================ context parallel
def _rank_ranges(n: int, cp: int, split: str) -> list[list[range]]:
    """Chunk-relative token indices of each rank as arithmetic ranges, in rank order."""
    _need_int("n", n, 0)
    _need_int("cp", cp, 1)
    need(split in CP_SPLITS, f"split={split!r} must be one of {CP_SPLITS}")
    if split == "interleave":
        return [[range(r, n, cp)] for r in range(cp)]
    blocks = cp if split == "contiguous" else 2 * cp
    # n // blocks tokens per block, the remainder one extra to each of the first blocks
    bounds = [0]
    for b in range(blocks):
        bounds.append(bounds[-1] + n // blocks + (1 if b < n % blocks else 0))
    block = [range(bounds[b], bounds[b + 1]) for b in range(blocks)]
    if split == "contiguous":
        return [[block[r]] for r in range(cp)]
    return [[block[r], block[2 * cp - 1 - r]] for r in range(cp)]


def cp_rank_positions(n: int, cp: int, split: str) -> list[list[int]]:
    """Chunk-relative token indices each of ``cp`` ranks holds, ascending.

    ``"contiguous"``: ``cp`` consecutive blocks (the first ``n % cp`` one token longer);
    ``"interleave"``: token ``i`` on rank ``i % cp`` (SGLang round-robin); ``"zigzag"``:
    ``2 cp`` consecutive blocks (the first ``n % (2 cp)`` one token longer), rank ``r`` holding
    blocks ``r`` and ``2 cp - 1 - r``.
    """
    return [[i for rg in ranges for i in rg] for ranges in _rank_ranges(n, cp, split)]


def _range_sum(rg: range) -> int:
    return len(rg) * (2 * rg.start + (len(rg) - 1) * rg.step) // 2 if len(rg) else 0


def cp_indexer_pairs_per_rank(n: int, cp: int, split: str, prefix: int = 0) -> list[int]:
    """Exact indexer (query, key) pairs per rank for one chunk of ``n`` tokens after ``prefix``.

    Rank ``r`` sums ``prefix + i + 1`` over its chunk-relative tokens ``i``: every query scores
    the cached prefix and the chunk up to itself. One full layer; multiply by the full layers.
    """
    _need_int("prefix", prefix, 0)
    return [
        sum(len(rg) * (prefix + 1) + _range_sum(rg) for rg in ranges)
        for ranges in _rank_ranges(n, cp, split)
    ]


def cp_mean_prefix_article(n: int, cp: int, split: str, rank: int, prefix: int = 0) -> float | None:
    """The article's average prefix length of ``rank``'s queries (``None`` for zigzag: not given).

    Contiguous ``r L / p + L / (2p)``; interleave ``L / 2 - (p - 1) / 2`` (the same for every
    rank). ``prefix`` is added to both (the article has no cached prefix).
    """
    need(split in CP_SPLITS, f"split={split!r} must be one of {CP_SPLITS}")
    if split == "contiguous":
        return prefix + rank * n / cp + n / (2 * cp)
    if split == "interleave":
        return prefix + n / 2 - (cp - 1) / 2
    return None


@dataclass(frozen=True)
class CommRow:
    """One communication of a prefill chunk: ``count`` collectives of ``bytes_each`` bytes.

    ``bytes_each`` is the size of the whole gathered / reduced tensor (the article's
    convention); ``local_bytes_each`` is one rank's share for the CP gathers (padded to
    ``ceil(n / cp)`` rows), ``None`` elsewhere. ``optional`` rows (DP attention) are not in the
    chunk total.
    """

    op: str
    description: str
    count: int
    bytes_each: int
    local_bytes_each: int | None = None
    optional: bool = False

    @property
    def total(self) -> int:
        return self.count * self.bytes_each


def cp_comm_bytes_per_chunk(
    config: DSAConfig,
    chunk_tokens: int,
    cp: int,
    index_k_bytes_per_token: int | None = None,
    latent_bytes_per_token: int | None = None,
) -> list[CommRow]:
    """Communication of one chunk of ``chunk_tokens`` tokens (docs/conventions.md §13; article's table).

    Rows: index-K all-gather (each full layer), latent all-gather (each layer; the article's
    table omits it), o_proj reduce-scatter (each layer, bf16), MoE dispatch (FP8, 1 byte per
    element) and combine (bf16) over ``num_experts_per_tok`` copies (each MoE layer), the CP
    boundary gather of the hidden states (once), and the optional DP-attention gather +
    scatter (twice per layer, bf16). CP rows have ``count = 0`` when ``cp == 1``.

    ``index_k_bytes_per_token`` defaults to the article's 132 (FP8 + scale); our implementation
    gathers the key before quantization, ``index_head_dim`` × element size (256 in bf16).
    ``latent_bytes_per_token`` defaults to bf16 ``[c | k_pe]`` (1152).
    """
    _need_int("chunk_tokens", chunk_tokens, 1)
    _need_int("cp", cp, 1)
    c = config
    idx_bytes = index_k_row_bytes(c) if index_k_bytes_per_token is None else index_k_bytes_per_token
    lat_bytes = BF16_BYTES * c.kv_latent_dim if latent_bytes_per_token is None else latent_bytes_per_token
    _need_int("index_k_bytes_per_token", idx_bytes, 1)
    _need_int("latent_bytes_per_token", lat_bytes, 1)
    n, h = chunk_tokens, c.hidden_size
    local = -(-n // cp)
    cp_on = 1 if cp > 1 else 0
    layers = c.num_hidden_layers
    moe_layers = layers - c.first_k_dense_replace
    hidden_bf16 = n * h * BF16_BYTES
    return [
        CommRow(INDEX_K_ALLGATHER, "chunk's index K, each full layer (CP)",
                cp_on * len(c.full_layers), n * idx_bytes, local * idx_bytes),
        CommRow(LATENT_ALLGATHER, "chunk's [c | k_pe], each layer (CP)",
                cp_on * layers, n * lat_bytes, local * lat_bytes),
        CommRow("o_proj_reduce_scatter", "o_proj output, bf16, each layer", layers, hidden_bf16),
        CommRow("moe_dispatch", "top-k copies of hidden, fp8, each MoE layer", moe_layers,
                n * c.num_experts_per_tok * h * FP8_BYTES),
        CommRow("moe_combine", "top-k expert outputs, bf16, each MoE layer", moe_layers,
                n * c.num_experts_per_tok * h * BF16_BYTES),
        CommRow(CP_BOUNDARY_GATHER, "hidden after the last layer, bf16 (CP)", cp_on, hidden_bf16,
                local * h * BF16_BYTES),
        CommRow("dp_attention_gather_scatter", "hidden gather + scatter, bf16, each layer",
                2 * layers, hidden_bf16, optional=True),
    ]


# ============================================================================ TTFT floor
@dataclass(frozen=True)
class GpuSpec:
    """Throughputs for the TTFT floor, per GPU. Defaults: the article's 8 × H200.

    ``indexer_flops_per_s`` and ``backbone_flops_per_s`` are *effective* rates (the article's
    300 TFLOP/s for the bandwidth-bound indexer and 1.5 PFLOP/s for the GEMMs), not peaks.
    ``mem_bytes`` is the total memory the logits budget is computed from (141e9; torch reports
    150,109,880,320 bytes on a real H200).
    """

    name: str = "H200"
    gpus: int = 8
    mem_bytes: int = 141 * GB
    hbm_bytes_per_s: float = 4.8e12
    indexer_flops_per_s: float = 300e12
    backbone_flops_per_s: float = 1.5e15
    nvlink_bytes_per_s: float = 900e9

    def __post_init__(self) -> None:
        _need_int("gpus", self.gpus, 1)
        _need_int("mem_bytes", self.mem_bytes, 1)
        for f in ("hbm_bytes_per_s", "indexer_flops_per_s", "backbone_flops_per_s", "nvlink_bytes_per_s"):
            v = getattr(self, f)
            need(isinstance(v, (int, float)) and v > 0, f"GpuSpec.{f}={v!r} must be > 0")


@dataclass(frozen=True)
class TtftComponent:
    """One term of the TTFT floor: ``amount`` (in ``unit``) at ``rate`` per second."""

    name: str
    amount: int
    unit: str
    rate: float
    rate_basis: str
    seconds: float


def ttft_floor(
    config: DSAConfig,
    tokens: int,
    chunk: int,
    prefix: int = 0,
    gpu: GpuSpec = GpuSpec(),
    kv_dtype: str = "fp8",
) -> dict[str, Any]:
    """The article's TTFT floor, term by term, with the article's choice of per-GPU or aggregate rate.

    Terms: indexer scoring FLOPs over all GPUs' indexer rate; index-K reread at one GPU's HBM
    (each TP rank reads the whole replicated cache); backbone FLOPs (exact top-k key counts,
    router included) over all GPUs; sparse-attention KV rows read over all GPUs' HBM (the
    article's aggregate, at the true row size); MoE dispatch + combine of every chunk over the
    aggregate NVLink; cache writes at one GPU's HBM. ``serial_s`` adds them all;
    ``critical_path_s`` overlaps the reread with indexer compute and hides the KV write, as the
    article's table notes. No CP, no queueing, no PD transfer.
    """
    runs = chunk_runs(tokens, chunk, prefix, config.page_size)
    new = tokens - prefix
    full = len(config.full_layers)
    g = gpu.gpus
    idx_flops = full * _indexer_pairs(runs).total * indexer_flops_per_pair(config)
    reread = _index_k_reread_bytes(config, runs)
    backbone = _model_flops_exact(config, prefix, tokens)
    keys = sparse_mla_keys(config, prefix, tokens)
    kv_read = config.num_hidden_layers * keys * main_kv_row_bytes(config, kv_dtype)
    moe = sum(
        n * row.total
        for _, b, n in runs
        for row in cp_comm_bytes_per_chunk(config, b, 1)
        if row.op in ("moe_dispatch", "moe_combine")
    )
    written = cache_bytes_written(config, new, kv_dtype)["total"]
    terms = [
        ("indexer_compute", idx_flops, "FLOP", g * gpu.indexer_flops_per_s, f"{g} GPUs x indexer rate"),
        ("index_k_reread", reread, "B", gpu.hbm_bytes_per_s, "1 GPU HBM"),
        ("backbone_compute", backbone, "FLOP", g * gpu.backbone_flops_per_s, f"{g} GPUs x backbone rate"),
        ("sparse_kv_read", kv_read, "B", g * gpu.hbm_bytes_per_s, f"{g} GPUs HBM"),
        ("moe_comm", moe, "B", g * gpu.nvlink_bytes_per_s, f"{g} GPUs NVLink"),
        ("kv_write", written, "B", gpu.hbm_bytes_per_s, "1 GPU HBM"),
    ]
    comps = [TtftComponent(n, a, u, r, b, a / r) for n, a, u, r, b in terms]
    sec = {c.name: c.seconds for c in comps}
    serial = sum(sec.values())
    critical = (
        max(sec["indexer_compute"], sec["index_k_reread"])
        + sec["backbone_compute"] + sec["sparse_kv_read"] + sec["moe_comm"]
    )
    return {"components": comps, "serial_s": serial, "critical_path_s": critical}


def _build_whole_model_time(run: _Run) -> dict[str, Any]:
    """The whole model's prefill on one GPU in layer-major order, from a measured layer
    (``glm_dsa.measured``); ``applies`` is False (and the seconds None) for a config whose layers
    were not measured."""
    from glm_dsa.measured import H200_GLM53_1M, whole_model_seconds

    m, c = H200_GLM53_1M, run.config
    full = len(c.full_layers)
    out: dict[str, Any] = {"measured": dataclasses.asdict(m), "applies": c.name == m.config, "full_layers": full,
                           "shared_layers": c.num_hidden_layers - full,
                           "full_layer_s": None, "shared_layer_s": None, "seconds": None}
    if out["applies"]:
        reference = _indexer_pairs(chunk_runs(m.tokens, m.chunk, 0, c.page_size)).total
        out.update(whole_model_seconds(full, c.num_hidden_layers - full, _indexer_pairs(run.runs).total, run.new,
                                       reference, m))
    return out


# ============================================================================ the whole ledger
@dataclass(frozen=True)
class _Run:
    """The inputs of one ledger, validated, with the chunk plan (as runs) every section shares."""

    config: DSAConfig
    tokens: int
    chunk: int
    prefix: int
    cp: int
    kv_dtype: str
    mem_fraction_static: float
    gpu: GpuSpec
    runs: list[tuple[int, int, int]]

    @property
    def new(self) -> int:
        return self.tokens - self.prefix

    @property
    def chunks(self) -> int:
        return sum(n for _, _, n in self.runs)


def _build_flops(run: _Run) -> dict[str, Any]:
    c = run.config
    ops = []
    for op in op_flops(c):
        n_layers = _op_layers(c, op.applies_to)
        ops.append({
            "op": op.op, "shape": op.shape, "flops_per_token": op.flops_per_token,
            "applies_to": op.applies_to, "layers": n_layers,
            "total": op.flops_per_token * n_layers * run.new, "in_article": op.in_article,
        })
    return {
        "ops": ops,
        "layer_per_token": {
            f"{'full' if f else 'shared'}_{'moe' if e else 'dense'}": layer_flops_per_token(c, f, e)
            for f in (True, False) for e in (True, False)
        },
        "model_total_article": sum(o["total"] for o in ops if o["in_article"]),
        "sparse_mla_keys": sparse_mla_keys(c, run.prefix, run.tokens),
        "model_total": _model_flops_exact(c, run.prefix, run.tokens),
    }


def _build_indexer(run: _Run) -> dict[str, Any]:
    c, new, full = run.config, run.new, len(run.config.full_layers)
    pairs = _indexer_pairs(run.runs)
    per_pair = indexer_flops_per_pair(c)
    intensity = per_pair // (c.index_head_dim * FP8_BYTES)
    return {
        "full_layers": full,
        "flops_per_pair": per_pair,
        "pairs_per_layer": {
            "total": pairs.total, "intra_chunk": pairs.intra_chunk,
            "cross_chunk": pairs.cross_chunk, "prefix_cache": pairs.prefix_cache,
        },
        "pairs_per_layer_approx": {
            "total": pairs.total_approx, "intra_chunk": pairs.intra_chunk_approx,
            "cross_chunk": pairs.cross_chunk_approx, "prefix_cache": float(pairs.prefix_cache),
        },
        "flops": full * pairs.total * per_pair,
        "flops_approx": full * pairs.total_approx * per_pair,
        "intensity_flop_per_byte": intensity,
        "bandwidth_bound_flops_per_s": intensity * run.gpu.hbm_bytes_per_s,
        "index_k_reread_bytes": _index_k_reread_bytes(c, run.runs),
        "index_k_reread_bytes_approx":
            full * index_k_row_bytes(c) * (new * new / (2 * run.chunk) + run.chunks * run.prefix),
    }


def _build_kv(run: _Run) -> dict[str, Any]:
    c, kv_dtype = run.config, run.kv_dtype
    layers, full = c.num_hidden_layers, len(c.full_layers)
    row_main, row_idx = main_kv_row_bytes(c, kv_dtype), index_k_row_bytes(c)
    at_l = cache_bytes_written(c, run.tokens, kv_dtype)
    return {
        "kv_dtype": kv_dtype,
        "main_row_bytes": row_main,
        "index_row_bytes": row_idx,
        "main_bytes_per_token": layers * row_main,
        "index_bytes_per_token": full * row_idx,
        "bytes_per_token": layers * row_main + full * row_idx,
        "main_bytes": at_l["main_kv"],
        "index_bytes": at_l["index_k"],
        "total_bytes": at_l["total"],
        "main_page_bytes": main_kv_page_bytes(c, kv_dtype),
        "index_page_bytes": index_k_page_bytes(c.page_size, c.index_head_dim),
        "pages_per_chunk": -(-run.chunk // c.page_size),
        "written_per_chunk": cache_bytes_written(c, run.chunk, kv_dtype),
        "written_request": cache_bytes_written(c, run.new, kv_dtype),
    }


def _build_chunks(run: _Run) -> dict[str, Any]:
    section: dict[str, Any] = {"count": run.chunks, "runs": [list(r) for r in run.runs]}
    if run.chunks <= PLAN_LIST_MAX_CHUNKS:
        section["plan"] = [[s + j * b, s + (j + 1) * b] for s, b, n in run.runs for j in range(n)]
    return section


def _build_logits(run: _Run) -> dict[str, Any]:
    total_mem, tokens, runs = run.gpu.mem_bytes, run.tokens, run.runs
    budget = logits_budget_bytes_static(total_mem, run.mem_fraction_static)
    last_start, last_size, _ = runs[-1]
    rows_last, slices_last = logits_row_slices(last_size, tokens, budget)
    return {
        "total_mem_bytes": total_mem,
        "mem_fraction_static": run.mem_fraction_static,
        "budget_bytes": budget,
        "row_bytes_at_tokens": FP32_BYTES * tokens,
        "rows_at_tokens": budget // (FP32_BYTES * tokens),
        "peak_bytes_one_chunk": _logits_peak_bytes(runs),
        "rows_last_chunk": rows_last,
        "slices_last_chunk": slices_last,
        "slices_total": sum(_run_logits_slices(s, b, n, budget) for s, b, n in runs),
    }


def _build_activations(run: _Run) -> dict[str, Any]:
    c = run.config
    return {
        "hidden_bytes_per_chunk": run.chunk * c.hidden_size * BF16_BYTES,
        "moe_intermediate_bytes_per_chunk":
            run.chunk * c.num_experts_per_tok * c.moe_intermediate_size * BF16_BYTES,
    }


def _build_mha_one_shot(run: _Run) -> dict[str, Any]:
    c = run.config
    mha_width = c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim)
    return {
        "kv_elements_per_token": mha_width,
        "latent_elements_per_token": c.kv_latent_dim,
        "temp_kv_bytes_at_tokens": run.tokens * mha_width * BF16_BYTES,
        "temp_kv_bytes_per_chunk": run.chunk * mha_width * BF16_BYTES,
    }


def _build_chunk_sizes(run: _Run) -> list[dict[str, Any]]:
    c = run.config
    reread = _index_k_reread_bytes(c, run.runs)
    rows = []
    for b in (run.chunk // 4, run.chunk, 4 * run.chunk):
        if b < c.page_size:
            continue
        p = chunk_runs(run.tokens, b, run.prefix, c.page_size)
        b_reread = _index_k_reread_bytes(c, p)
        rows.append({
            "chunk": b,
            "chunks": sum(n for _, _, n in p),
            "index_k_reread_bytes": b_reread,
            "index_k_reread_relative": b_reread / reread if reread else None,
            "logits_peak_bytes": _logits_peak_bytes(p),
            "hidden_bytes_per_chunk": b * c.hidden_size * BF16_BYTES,
        })
    return rows


def _build_context_parallel(run: _Run) -> dict[str, Any]:
    cp, new, prefix = run.cp, run.new, run.prefix
    section: dict[str, Any] = {"cp": cp, "sequence": {}, "request": {}}
    for split in CP_SPLITS:
        per_rank = cp_indexer_pairs_per_rank(new, cp, split, prefix)
        counts = [sum(len(rg) for rg in ranges) for ranges in _rank_ranges(new, cp, split)]
        section["sequence"][split] = {
            "tokens_per_rank": counts,
            "pairs_per_rank": per_rank,
            "mean_prefix_per_rank": [q / t - 1 if t else None for q, t in zip(per_rank, counts)],
            "article_mean_prefix_per_rank":
                [cp_mean_prefix_article(new, cp, split, r, prefix) for r in range(cp)],
            "max_over_min": max(per_rank) / min(per_rank) if min(per_rank) else None,
        }
        # a chunk of b tokens after s: rank r scores t_r (s + 1) + Σ_i i over its t_r tokens
        req = [0] * cp
        for s, b, n in run.runs:
            tokens_r = [sum(len(rg) for rg in ranges) for ranges in _rank_ranges(b, cp, split)]
            for r, (t, q) in enumerate(zip(tokens_r, cp_indexer_pairs_per_rank(b, cp, split))):
                req[r] += t * _run_starts(s, b, n) + n * q
        section["request"][split] = {
            "pairs_per_rank": req,
            "max_over_min": max(req) / min(req) if min(req) else None,
        }
    return section


def _build_comm(run: _Run) -> dict[str, Any]:
    rows = cp_comm_bytes_per_chunk(run.config, run.chunk, run.cp)
    return {
        "chunk_tokens": run.chunk,
        "cp": run.cp,
        "rows": [dict(dataclasses.asdict(r), total=r.total) for r in rows],
        "total_bytes": sum(r.total for r in rows if not r.optional),
    }


def _build_ttft(run: _Run) -> dict[str, Any]:
    ttft = ttft_floor(run.config, run.tokens, run.chunk, run.prefix, run.gpu, run.kv_dtype)
    return {
        "components": [
            dict(dataclasses.asdict(x), share=x.seconds / ttft["serial_s"]) for x in ttft["components"]
        ],
        "serial_s": ttft["serial_s"],
        "critical_path_s": ttft["critical_path_s"],
    }


def build_ledger(
    config: DSAConfig,
    tokens: int,
    chunk: int,
    prefix: int = 0,
    cp: int = 8,
    kv_dtype: str = "fp8",
    mem_fraction_static: float = 0.8,
    gpu: GpuSpec = GpuSpec(),
) -> dict[str, Any]:
    """Every account of the article for one prefill, as a JSON-ready dict (keys: docs/ledger.md).

    ``cp`` is the context-parallel degree (ranks) of the CP and communication sections.
    """
    _check_kv_dtype(kv_dtype)
    _need_int("cp", cp, 1)
    c = config
    run = _Run(c, tokens, chunk, prefix, cp, kv_dtype, mem_fraction_static, gpu,
               chunk_runs(tokens, chunk, prefix, c.page_size))
    layers, moe_layers = c.num_hidden_layers, c.num_hidden_layers - c.first_k_dense_replace
    return {
        "schema": SCHEMA,
        "inputs": {
            "config": c.name, "tokens": tokens, "prefix": prefix, "new_tokens": run.new, "chunk": chunk,
            "cp": cp, "kv_dtype": kv_dtype, "mem_fraction_static": mem_fraction_static,
            "gpu": dataclasses.asdict(gpu),
        },
        "model": {
            "layers": layers, "full_layers": len(c.full_layers),
            "shared_layers": layers - len(c.full_layers),
            "dense_layers": c.first_k_dense_replace, "moe_layers": moe_layers,
            "page_size": c.page_size, "index_topk": c.index_topk,
            "max_position_embeddings": c.max_position_embeddings,
        },
        "params": param_counts(c),
        "flops": _build_flops(run),
        "indexer": _build_indexer(run),
        "kv": _build_kv(run),
        "chunks": _build_chunks(run),
        "logits": _build_logits(run),
        "activations": _build_activations(run),
        "mha_one_shot": _build_mha_one_shot(run),
        "chunk_sizes": _build_chunk_sizes(run),
        "context_parallel": _build_context_parallel(run),
        "comm": _build_comm(run),
        "ttft": _build_ttft(run),
        "whole_model_time": _build_whole_model_time(run),
    }


# ============================================================================ memory of a run
# Every size below is a pure function of the config: layers of one kind (full or shared
# indexer, dense or MoE FFN) have the same sizes, so a stack of any depth is sized by counting
# its layers of each kind, never by building them.
LAYER_KINDS: tuple[tuple[bool, bool], ...] = ((True, False), (True, True), (False, False), (False, True))
"""The ``(full, moe)`` layer kinds: a full layer has an indexer and an index-K cache, a MoE
layer routed and shared experts in place of the dense MLP."""


def layer_kind_counts(config: DSAConfig) -> dict[tuple[bool, bool], int]:
    """Layers of each kind ``(full, moe)`` of ``config`` (all four keys; zeros included)."""
    k = config.first_k_dense_replace
    types = config.indexer_types
    full_dense = types[:k].count(FULL)
    full_moe = types[k:].count(FULL)
    return {(True, False): full_dense, (True, True): full_moe,
            (False, False): k - full_dense, (False, True): config.num_hidden_layers - k - full_moe}


def layer_kind_firsts(config: DSAConfig) -> dict[tuple[bool, bool], int]:
    """The first stack layer of each kind ``(full, moe)`` that ``config`` has (a layer stands for
    its kind: every layer of one kind has the same sizes)."""
    firsts: dict[tuple[bool, bool], int] = {}
    for i in range(config.num_hidden_layers):
        firsts.setdefault((config.is_full(i), config.is_moe(i)), i)
        if len(firsts) == len(LAYER_KINDS):
            break
    return firsts


def layer_weight_elements(config: DSAConfig, full: bool, moe: bool) -> int:
    """Parameters (elements) of one layer of kind ``(full, moe)``: its two norms, MLA, the
    indexer of a full layer, and the dense MLP or (MoE) the routed and shared experts and the
    router; ``param_counts``'s components."""
    counts = param_counts(config)
    ffn = (counts["experts_per_moe_layer"] + counts["shared_experts_per_moe_layer"]
           + counts["router_per_moe_layer"]) if moe else counts["dense_mlp_per_layer"]
    return (2 * config.hidden_size + counts["attention_per_layer"]
            + (counts["indexer_per_full_layer"] if full else 0) + ffn)


def layer_weight_bytes(config: DSAConfig, full: bool, moe: bool, dtype_bytes: int) -> int:
    """Bytes of one layer's weights of kind ``(full, moe)`` at ``dtype_bytes`` per parameter
    (every parameter of a built model is in the activation dtype)."""
    return layer_weight_elements(config, full, moe) * dtype_bytes


def outer_weight_elements(config: DSAConfig) -> int:
    """Parameters outside the layers: the embedding, ``lm_head`` (unless tied) and the final norm."""
    counts = param_counts(config)
    return counts["embedding"] + counts["lm_head"] + config.hidden_size


def layer_cache_row_bytes(config: DSAConfig, full: bool, kv_dtype: str) -> int:
    """Bytes one token occupies in one layer's cache pools: its main-KV row (any ``KVCache``
    format: fp8 rows, or ``kv_latent_dim`` values of a plain dtype) and, in a full layer, its
    index-K row."""
    if kv_dtype in MLA_KV_FORMATS:
        main = main_kv_row_bytes(config, kv_dtype)
    else:
        main = _PLAIN_KV_BYTES.get(kv_dtype, BF16_BYTES) * config.kv_latent_dim
    return main + (index_k_row_bytes(config) if full else 0)


_PLAIN_KV_BYTES = {"fp32": 4, "float32": 4, "fp64": 8, "float64": 8, "bf16": 2, "fp16": 2}


def largest_tensor_elements(config: DSAConfig) -> int:
    """Elements of the model's largest checkpoint tensor (a routed expert's projection counts
    alone, the shared experts as one MLP): what ``init_weights`` draws in float32, and a
    checkpoint load reads, at a time. The same number as ``weights.largest_tensor_numel``,
    from the shapes alone."""
    c = config
    h, heads = c.hidden_size, c.num_attention_heads
    sizes = [c.vocab_size * h, h * c.q_lora_rank, c.q_lora_rank * heads * c.qk_head_dim,
             h * c.kv_latent_dim, c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim),
             heads * c.v_head_dim * h]
    if FULL in c.indexer_types:
        sizes += [c.q_lora_rank * c.index_n_heads * c.index_head_dim, h * c.index_head_dim,
                  h * c.index_n_heads]
    if c.first_k_dense_replace:
        sizes.append(h * c.intermediate_size)
    if c.num_hidden_layers > c.first_k_dense_replace:
        sizes += [h * c.moe_intermediate_size, h * c.n_shared_experts * c.moe_intermediate_size,
                  c.n_routed_experts * h]
    return max(sizes)


def step_peak_bytes(
    config: DSAConfig,
    rows: int,
    context: int,
    kv_dtype: str,
    dtype_bytes: int,
    logits_bytes: int,
    attention_bytes: int,
    moe_bytes: int,
) -> int:
    """An upper bound on the bytes one prefill step holds beyond the weights, caches and kept
    outputs: ``rows`` query tokens over at most ``context`` context rows (all requests of the
    step together), with the three step budgets (``glm_dsa.budget``; 0 counts a budget at its
    smallest row chunk, as on CUDA where the budgets follow the memory left free).

    The step's live tensors (residual, norms, projections, the top-k of the last full layer, the
    step's slots) plus the largest of a layer's phases, each its largest tensors at once:

    * indexer (full layers): the context's index keys read back (``D + 8`` bytes a row, twice
      for the unpacking), the queries and their rotation temporaries, one row chunk's logits
      (``budget.max_logit_rows`` rows in the compute dtype) and the larger of the scoring tile
      (``indexer._tile_shape``: float64 scores and their rounded copy, at most ``TILE_BYTES``, with
      its float64 operands) and the top-k temporaries (16 bytes per logit, at most ``TILE_BYTES``);
    * attention: the context's latent rows gathered in the activation and compute dtypes with
      the packed rows (the reference backend; the Triton kernels read the pool in place, so this
      bounds them too), one row chunk of ``budget.attention_row_bytes`` (``attention_rows`` rows),
      and, where the context is short enough for the MHA one-shot form, its expanded keys and
      values and one score chunk (``mla._DENSE_SCORE_BYTES``);
    * FFN: one MoE block of ``budget.moe_row_bytes`` (``moe_rows`` rows, unfused), or the dense
      MLP's gate, up and SwiGLU temporaries of every row.
    """
    c = config
    b = dtype_bytes
    cb = max(FP32_BYTES, b)  # the compute dtype: promote_types(activations, float32)
    act_dtype = _DTYPES_BY_BYTES[b]
    h, heads, H, D = c.hidden_size, c.num_attention_heads, c.index_n_heads, c.index_head_dim
    live = (rows * b * (4 * h + 2 * c.q_lora_rank + 2 * heads * c.qk_head_dim + 2 * c.kv_latent_dim)
            + rows * (2 * c.qk_rope_head_dim * cb + 2 * c.index_topk * 4 + 64) + context * 8)
    phases = []
    if FULL in c.indexer_types:
        r = max_logit_rows(rows, max(context, 1), logits_bytes)
        itemsize = 8 + cb  # one float64 score and its rounded copy (indexer._mqa_logits)
        tile = itemsize * min(r * H * context, max(TILE_BYTES // itemsize, H * 16)) \
            + r * H * D * 8 + context * D * 8
        topk = 16 * min(r * context, max(TILE_BYTES // 16, context))
        phases.append(2 * context * (D + 8) + rows * H * (D * (1 + 3 * cb) + 24) + rows * D * 3 * cb
                      + r * context * cb + max(tile, topk) + rows * c.index_topk * 4)
    per_row = attention_row_bytes(c.index_topk, c.kv_latent_dim, c.kv_lora_rank, heads, act_dtype,
                                  _DTYPES_BY_BYTES[cb])
    att_rows = attention_rows(rows, c.index_topk, c.kv_latent_dim, c.kv_lora_rank, heads, act_dtype,
                              _DTYPES_BY_BYTES[cb], max(attention_bytes, 1))
    padded = -(-rows // BATCH_TILE) * BATCH_TILE
    gathered = context * (c.kv_latent_dim * (b + cb) + layer_cache_row_bytes(c, False, kv_dtype))
    attention = gathered + per_row * min(padded, att_rows) + rows * h * b \
        + heads * (c.qk_nope_head_dim + c.v_head_dim) * c.kv_lora_rank * cb
    if context <= min(c.dense_attn_kv_len_threshold, c.index_topk):
        expanded = cb * (context * (c.kv_latent_dim + heads * (c.qk_nope_head_dim + c.v_head_dim)
                                    + heads * c.qk_head_dim) + rows * heads * (c.qk_head_dim + c.v_head_dim))
        scores = 2 * min(rows * heads * context * cb, max(_DENSE_SCORE_BYTES, heads * context * cb))
        attention = max(attention, gathered + expanded + scores + rows * h * b)
    phases.append(attention)
    if c.num_hidden_layers > c.first_k_dense_replace:
        moe_row = moe_row_bytes(c.num_experts_per_tok, h, c.moe_intermediate_size,
                                c.n_shared_experts * c.moe_intermediate_size, c.n_routed_experts, act_dtype,
                                fused=False)
        block = moe_rows(rows, c.num_experts_per_tok, h, c.moe_intermediate_size,
                         c.n_shared_experts * c.moe_intermediate_size, c.n_routed_experts, act_dtype,
                         False, max(moe_bytes, 1))
        phases.append(moe_row * block + rows * h * b)
    if c.first_k_dense_replace:
        phases.append(rows * (c.intermediate_size * (3 * b + 4 * cb) + h * b))
    return live + max(phases)


_DTYPES_BY_BYTES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}
# What the host allocator keeps resident beyond the step's (or the saved outputs') tensors: glibc
# serves blocks under its mmap threshold (which rises to 32 MiB as large blocks are freed) from
# per-thread arenas it does not return, so freed tiles and activations of one layer or step stay
# resident beside the next one's. Counted as the smaller of those tensors and
# ``ALLOCATOR_SLACK_BYTES``, plus ``ALLOCATOR_SLACK_PERCENT`` of them. Measured (peak RSS minus
# the RSS after the model and pools are built, against the step's named tensors): ``--config
# tiny --tokens 4096 --chunk 4096`` 472-515 MB against 429 MB; ``--tokens 2048 --chunk 1024
# --dtype bfloat16`` 223 MB against 130 MB, 80 MB of it left resident by the first step.
ALLOCATOR_SLACK_BYTES = 128 << 20
ALLOCATOR_SLACK_PERCENT = 10
# mla._DENSE_SCORE_BYTES: the MHA one-shot form's score chunk
_DENSE_SCORE_BYTES = 1 << 28


def prefill_peak_bytes(
    config: DSAConfig,
    lengths: Sequence[int],
    chunk: int,
    kv_dtype: str,
    dtype_bytes: int,
    budget_bytes: int,
    *,
    attention_bytes: int | None = None,
    moe_bytes: int | None = None,
    prefix: int = 0,
    save_outputs: bool = False,
    layer_outputs: bool = False,
    input_bytes: int = 0,
) -> int:
    """An upper bound on the bytes ``glm-dsa prefill`` allocates on one device, beyond what the
    process holds before it builds the model (the interpreter and libraries: on the host
    ``preflight.host_baseline_bytes`` adds them).

    ``lengths``: every request's tokens, the warm-up request of a shared ``prefix`` included;
    ``chunk``: tokens per step; ``budget_bytes``, ``attention_bytes``, ``moe_bytes``: the step
    budgets (``glm_dsa.budget``; the last two default to ``budget_bytes``; 0 counts a budget at
    its smallest chunk, for CUDA where they follow the memory left free); ``prefix``: the
    tokens each request finds in the prefix cache; ``save_outputs`` / ``layer_outputs``: the
    ``--save-outputs`` file is written (with each layer's outputs); ``input_bytes``: the prompts'
    input file, read whole.

    The weights (``layer_weight_bytes`` per kind, the embedding, head and final norm) are held
    throughout, with, while they are drawn, one float32 copy of the largest tensor
    (``largest_tensor_elements``). Then the cache pools (``pages_for(lengths)`` pages of every
    layer's rows, ``layer_cache_row_bytes``), every request's output rows kept in the activation
    dtype (and each layer's, with its top-k, under ``layer_outputs``), the prompts, and the larger
    of the largest step (``step_peak_bytes`` at ``min(chunk, Σ lengths)`` rows over the longest
    context a step can see) and the saved outputs (their float32 host copies and the bytes the
    safetensors writer makes of them), with what the allocator keeps resident beside that larger
    one (``ALLOCATOR_SLACK_BYTES``, ``ALLOCATOR_SLACK_PERCENT``).
    """
    c = config
    b = dtype_bytes
    kinds = layer_kind_counts(c)
    weights = b * (outer_weight_elements(c) + sum(n * layer_weight_elements(c, *kind) for kind, n in kinds.items()))
    drawing = FP32_BYTES * largest_tensor_elements(c)
    pages = sum(-(-n // c.page_size) for n in lengths)
    pool = pages * c.page_size * sum(n * layer_cache_row_bytes(c, kind[0], kv_dtype) for kind, n in kinds.items())
    tokens, longest = sum(lengths), max(lengths)
    full = kinds[(True, False)] + kinds[(True, True)]
    h = c.hidden_size
    per_token_kept = h * b + (c.num_hidden_layers * h * b + full * c.index_topk * 4 if layer_outputs else 0)
    kept = tokens * (per_token_kept + 8) + len(lengths) * c.vocab_size * 2 * FP32_BYTES + input_bytes
    rows = min(chunk, tokens)
    # one request part-way (its whole prompt at most) and the new ones, each with its cache hit
    context = min(tokens, rows + longest + min(len(lengths), rows) * prefix)
    step = step_peak_bytes(c, rows, context, kv_dtype, b, budget_bytes,
                           budget_bytes if attention_bytes is None else attention_bytes,
                           budget_bytes if moe_bytes is None else moe_bytes)
    saved = 0
    if save_outputs:
        per_token_saved = h * FP32_BYTES + 8 + (c.num_hidden_layers * h * FP32_BYTES + full * c.index_topk * 4
                                                if layer_outputs else 0)
        saved = 2 * tokens * per_token_saved + tokens * per_token_kept
    transient = max(step, saved)
    slack = min(transient, ALLOCATOR_SLACK_BYTES) + transient * ALLOCATOR_SLACK_PERCENT // 100
    return weights + max(drawing, pool + kept + transient + slack)
