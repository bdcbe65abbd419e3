"""Generated inputs for every kernel contract of ``glm_dsa.oracle``: named edge cases and
seeded random cases, with the metric each output is checked with.

A case builder draws its sizes through a ``Pick`` (``int(lo, hi)``, ``choice(options)``) and its
tensor values from a seeded CPU ``torch.Generator``; ``make_case`` backs the pick with a seeded
``random.Random``, ``glm_dsa.testing.strategies`` with hypothesis (so sizes shrink). Inputs are
always built on the CPU; the checker moves them to the kernel's device.

Size tables (``SHAPES``): ``"small"`` for CPU runs (head counts 8-32, top-k 16-128, a few hundred
keys); ``"glm-5.3"`` for GPU runs with GLM-5.3 / DeepSeek-V3.2 head counts (32 / 64 index heads,
64 / 128 MLA heads), index_topk 2048, their softmax scales, and contexts of a few thousand keys;
``"golden"`` (the golden vectors') those head counts and scales over the small contexts;
``"tp"`` the tensor-parallel shards' head counts (index 8-64, MLA 8-128) and top-k 256-2048 over
the GLM-5.3 contexts, ``"h8"`` … ``"h128"`` one shard's head count each.
"""

from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.config import get_config
from glm_dsa.kv_format import MX_BLOCK, mxfp4_quantize, mxfp8_quantize
from glm_dsa.testing.metrics import (
    CALC_DIFF_MAX,
    CALC_DIFF_MAX_BF16,
    DECODE_LSE_TOL,
    DECODE_OUT_TOL,
    HADAMARD_TOL,
    Q8KV8_OUT_TOL,
    Q8KV8_STAT_TOL,
    SPARSE_OUT_TOL,
    SPARSE_STAT_TOL,
    TOPK_REL_TOL,
)

__all__ = ["SHAPES", "CONTRACTS", "CONVENTIONS", "NEWEST", "Case", "clauses", "conventions",
           "convention_of", "expected_outputs", "invalid_indices", "index_queries", "index_weights",
           "Pick", "edge_case_names", "make_case", "build_case", "topk_scores", "TP_TOPK",
           "positions_of_slots", "check_seed", "mx_quantize", "MX_FORMATS", "FLOAT64_TRUTH"]

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
PAGE = 64  # tokens per KV page (both caches)
INDEX_DIM = 128  # index head dim of GLM-5.3 and DeepSeek-V3.2

_GLM, _DSV32 = get_config("glm-5.3"), get_config("deepseek-v3.2")

SHAPES: dict[str, dict[str, Any]] = {
    "small": {
        "index_heads": (8, 16, 32), "mla_heads": (16, 32), "topk": (16, 64),
        "mla_topk": (64, 128), "max_prefix": 150, "max_extend": 16, "max_context": 200,
        "max_cols": 300, "max_kv": 300, "max_rows": 8, "max_s_q": 4,
        "sm_scale": (0.5,),  # FlashMLA's sparse tests
    },
    "glm-5.3": {
        "index_heads": (_GLM.index_n_heads, _DSV32.index_n_heads),
        "mla_heads": (_GLM.num_attention_heads, _DSV32.num_attention_heads),
        "topk": (_GLM.index_topk,), "mla_topk": (_GLM.index_topk,), "max_prefix": 3000,
        "max_extend": 32, "max_context": 4096, "max_cols": 6144, "max_kv": 4096, "max_rows": 8,
        "max_s_q": 8, "sm_scale": (_GLM.softmax_scale, _DSV32.softmax_scale),
    },
}
# The golden vectors' sizes: GLM-5.3 / DeepSeek-V3.2 head counts and softmax scales over the
# small table's contexts and top-k (a few MB on disk, seconds on a CPU), with the sparse
# attention's top-k a multiple of 128, as FlashMLA's SM90 kernels require (phase1.cuh:
# topk % (2 * B_TOPK) == 0), so the real kernel can run every golden case.
SHAPES["golden"] = {**SHAPES["small"], **{k: SHAPES["glm-5.3"][k] for k in
                                          ("index_heads", "mla_heads", "sm_scale")},
                    "mla_topk": (128, 256)}

# Tensor-parallel shards: DeepSeek-V3.2 at TP8 holds 16 MLA heads per rank, GLM-5.3 8;
# flashinfer-bench's DSA definitions are h16 (attention) and h64 (indexer) with top-k 256 and
# 2048. Index heads stop at 64: DeepGEMM 54e2261 (csrc/apis/attention.hpp) takes 8/16/32/64 on
# SM100 and 32/64 on SM90. FlashMLA 9241ae3 instantiates its sparse kernels for h_q 64 and 128
# (csrc/api/sparse_fwd.h); a shard of 8 or 16 heads is padded to 64 by its caller, so the
# contract is the same at any head count. "tp" draws every count; "h<N>" pins one shard.
TP_TOPK = (256, 512, 1024, 2048)
SHAPES["tp"] = {**SHAPES["glm-5.3"], "index_heads": (8, 16, 32, 64),
                "mla_heads": (8, 16, 32, 64, 128), "topk": TP_TOPK, "mla_topk": TP_TOPK}
for _h in (8, 16, 32, 64, 128):
    SHAPES[f"h{_h}"] = {**SHAPES["tp"], "index_heads": (min(_h, 64),), "mla_heads": (_h,)}

# The MX indexer contracts (fp8_fp4_*mqa_logits) draw their key format and block size from
# each table: DeepGEMM 559d79f takes MXFP8 and MXFP4 with block_kv 32 / 64 / 128 on SM100
# (csrc/apis/attention.hpp). "sm90" is what its SM90 path runs, FP8 only, 32 or 64 heads,
# 64-token blocks; "mxfp8" / "mxfp4" pin one format (a kernel that implements one).
MX_FORMATS = ("mxfp8", "mxfp4")
for _table in SHAPES.values():
    _table.setdefault("index_formats", MX_FORMATS)
    _table.setdefault("block_kv", (32, PAGE, PAGE, 128))
SHAPES["sm90"] = {**SHAPES["glm-5.3"], "index_formats": ("fp8",), "block_kv": (PAGE,)}
# The bf16-cache decode's heads: the table's MLA heads, but flashinfer-bench's h16 in the golden
# set (its DSA definitions' shard; 1152-byte rows at 64 / 128 heads would take 13 MB there).
for _table in SHAPES.values():
    _table.setdefault("bf16_decode_heads", _table["mla_heads"])
SHAPES["golden"]["bf16_decode_heads"] = (16,)
for _fmt in MX_FORMATS:
    SHAPES[_fmt] = {**SHAPES["small"], "index_formats": (_fmt,)}

# FlashMLA's sparse prefill tests draw q and kv as randn / 10 (docs/conventions.md §7).
MLA_INPUT_STD = 0.1


class Pick(Protocol):
    """Where a builder's sizes come from (random.Random or hypothesis)."""

    def int(self, lo: int, hi: int) -> int: ...

    def choice(self, options: tuple) -> Any: ...


class _RandomPick:
    def __init__(self, seed: int):
        self._rng = random.Random(seed)

    def int(self, lo: int, hi: int) -> int:
        return self._rng.randint(lo, hi)

    def choice(self, options: tuple) -> Any:
        return options[self._rng.randrange(len(options))]


@dataclass
class Case:
    """One call of a kernel and of its oracle, and how to compare them.

    Attributes:
        contract: the oracle function (and upstream kernel) name.
        name: the edge case's name, or ``random #i`` for a random case.
        args: required arguments, passed positionally.
        kwargs: optional arguments the case sets (and the pinned ``kernel_options``), passed by
            keyword to the kernel and the oracle.
        checks: per output name, in output order, the metric spec (``glm_dsa.testing.metrics``).
        dtypes: per output, the dtypes the contract allows.
        aux: tensors the checks reference (valid-region masks, scores, row ranges).
        repro: the ``make_case`` call that rebuilds this case.
        clause: the contract clause an edge case holds ("" for a random case).
        pinned: the ``kwargs`` that are pinned conventions (``kernel_options``), not the case's.
    """

    contract: str
    name: str
    args: tuple
    kwargs: dict
    checks: dict[str, dict]
    dtypes: dict[str, tuple[torch.dtype, ...]]
    aux: dict[str, Tensor] = field(default_factory=dict)
    repro: str = ""
    clause: str = ""
    pinned: tuple[str, ...] = ()


# --------------------------------------------------------------------------- helpers
def _i32(values) -> Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _randn(g: torch.Generator, *shape: int, std: float = 1.0, dtype=torch.float32) -> Tensor:
    return (torch.randn(*shape, generator=g) * std).to(dtype)


def ragged_rows(requests: list[tuple[int, int]]) -> tuple[Tensor, Tensor, int]:
    """(ks, ke, S_kv) of the extend rows of (prefix, extend) requests over their concatenated KV:
    extend row i of a request sees its prefix and itself (``ke = ks + prefix + i + 1``)."""
    ks, ke, offset = [], [], 0
    for prefix, extend in requests:
        for i in range(extend):
            ks.append(offset)
            ke.append(offset + prefix + i + 1)
        offset += prefix + extend
    return _i32(ks), _i32(ke), offset


def block_table(g: torch.Generator, blocks_per_request: list[int], num_blocks: int) -> Tensor:
    """int32 [B, max(blocks)]: distinct shuffled physical blocks, unused entries 0."""
    pool = torch.randperm(num_blocks, generator=g)
    table = torch.zeros((len(blocks_per_request), max(blocks_per_request)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_request):
        table[b, :n] = pool[used : used + n].to(torch.int32)
        used += n
    return table


def relative_indices(g: torch.Generator, lens: list[int], topk: int) -> Tensor:
    """int32 [R, topk]: distinct request-relative indices, -1 after min(topk, len) entries."""
    rows = []
    for n in lens:
        k = min(topk, n)
        rows.append(torch.randperm(n, generator=g)[:k].tolist() + [-1] * (topk - k))
    return _i32(rows)


def _ceil_page(n: int) -> int:
    return -(-n // PAGE) * PAGE


# --------------------------------------------------------------------------- numerics
def _hadamard(g, pick, shp, edge):
    heads = pick.choice(shp["index_heads"])
    rows, dim, scale = pick.int(1, 4), pick.choice((64, 128)), pick.choice((1.0, "orthonormal"))
    if edge == "non_power_of_two_dim":
        dim, scale = 80, 1.0
    x = _randn(g, rows, heads, dim, dtype=torch.bfloat16)
    if edge == "zeros":
        x.zero_()
    if edge == "large_magnitude":
        x = (x.float() * 1e4).to(torch.bfloat16)
    scale = dim**-0.5 if scale == "orthonormal" else scale
    return (x,), {"scale": scale}, {}


def _act_quant(g, pick, shp, edge):
    rows, blocks = pick.int(1, 2 * shp["max_rows"]), pick.int(1, 4)
    fmt = pick.choice((None, "ue8m0"))
    x = _randn(g, rows, blocks * 128) * torch.exp(_randn(g, rows, 1) * 2)
    if edge == "ue8m0_scales":
        fmt = "ue8m0"
    if edge == "fp32_scales":
        fmt = None
    if edge == "all_zero_block":
        x[0, :128] = 0.0  # hits the 1e-4 amax floor
    if edge == "tiny_block":
        x[-1, -128:] *= 1e-6
    kwargs = {} if fmt is None else {"scale_fmt": fmt}
    return (x.to(torch.bfloat16),), kwargs, {}


def _kv_cache_cast(g, pick, shp, edge):
    num_blocks = 1 if edge == "single_block" else pick.int(1, 4)
    k = _randn(g, num_blocks, PAGE, 1, INDEX_DIM)
    if edge == "zero_key":
        k[0, 7] = 0.0
    return (k.to(torch.bfloat16),), {}, {}


def _kv_cache_cast_fp4(g, pick, shp, edge):
    num_blocks, head_dim = pick.int(1, 3), pick.choice((64, 128, 128))
    if edge is not None:
        num_blocks, head_dim = 1, 64 if edge == "head_dim_64" else INDEX_DIM
    k = _randn(g, num_blocks, PAGE, 1, head_dim) * torch.exp(_randn(g, num_blocks, PAGE, 1, 1))
    if edge == "midpoint_ties":
        # Every e2m1 midpoint (and its negative) times the block's power-of-two scale: amax 6
        # pins the scale at 1, so each value lies exactly between two codes.
        ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
        k[0, :, 0, :32] = torch.cat([ties, -ties, ties, -ties])[torch.randperm(32, generator=g)]
    if edge == "zero_key":
        k[0, 7] = 0.0
    if edge == "power_of_two_amax":
        k[0, :, 0, :32] = k[0, :, 0, :32].clamp(-5.9, 5.9)
        k[0, :, 0, 0] = 6.0 * 2.0 ** torch.randint(-6, 6, (PAGE,), generator=g).float()
    return (k.to(torch.bfloat16),), {}, {}


# --------------------------------------------------------------------------- indexer logits
def index_queries(g: torch.Generator, lead: tuple[int, ...], heads: int,
                  aligned: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(q_fp8 [*lead, heads, 128] e4m3, q_scale [*lead, heads] float32) as the model's indexer
    makes them: ``act_quant`` of activations whose magnitude varies per (token, head), so
    every payload reaches the full e4m3 range (|q| up to 448). ``aligned`` (a ±1 [128] sign
    pattern) gives every query that sign pattern (the float16-overflow case)."""
    x = _randn(g, *lead, heads, INDEX_DIM) * torch.exp(_randn(g, *lead, heads, 1))
    if aligned is not None:
        x = (x.abs() + 0.5) * aligned
    q_fp8, q_scale = oracle.act_quant(x.to(torch.bfloat16), INDEX_DIM)
    return q_fp8, q_scale[..., 0]


def index_weights(g: torch.Generator, q_scale: Tensor) -> Tensor:
    """float32 [rows, heads] head gates at the model's scale: ``w · H^-1/2 · q_scale · D^-1/2``
    (the indexer folds each query's FP8 scale into its gate, docs/conventions.md §3)."""
    rows = q_scale.reshape(-1, q_scale.shape[-1])
    heads = rows.shape[-1]
    return _randn(g, *rows.shape) * heads**-0.5 * rows * INDEX_DIM**-0.5


def _index_keys(g: torch.Generator, n: int, aligned: Tensor | None = None) -> Tensor:
    """bf16 [n, 128] index keys, per-token magnitudes over ~e^±3 (optionally one sign pattern)."""
    k = _randn(g, n, INDEX_DIM) * torch.exp(_randn(g, n, 1))
    if aligned is not None:
        k = (k.abs() + 0.5) * aligned
    return k.to(torch.bfloat16)


def _signs(g: torch.Generator) -> Tensor:
    return torch.where(torch.rand(INDEX_DIM, generator=g) < 0.5, -1.0, 1.0)


def _mqa_logits(g, pick, shp, edge):
    heads = pick.choice(shp["index_heads"])
    requests = [(pick.int(0, shp["max_prefix"]), pick.int(1, shp["max_extend"]))
                for _ in range(pick.int(1, 3))]
    clean, compressed = True, False
    if edge == "no_prefix":
        requests = [(0, shp["max_extend"])]
    if edge in ("uncleaned", "compressed"):
        clean, compressed = False, edge == "compressed"
    ks, ke, s_kv = ragged_rows(requests)
    if edge == "empty_window":
        ke[0] = ks[0]
    aligned = _signs(g) if edge == "float16_overflow" else None
    q, q_scale = index_queries(g, (len(ks),), heads, aligned)
    k_fmt = "ue8m0" if edge == "ue8m0_k_scales" else pick.choice((None, "ue8m0"))
    k_fp8, k_scale = oracle.act_quant(_index_keys(g, s_kv, aligned), INDEX_DIM, k_fmt)
    weights = index_weights(g, q_scale)
    kwargs = {}
    if not clean:
        kwargs["clean_logits"] = False
    if compressed:
        kwargs["max_seqlen_k"] = max(1, int((ke - ks).max()))
    args = (q, (k_fp8, k_scale[:, 0]), weights, ks, ke)
    cleaned = oracle.fp8_mqa_logits(*args) if not compressed else oracle.fp8_mqa_logits(*args, **kwargs)
    return args, kwargs, {"mask": torch.isfinite(cleaned)}


def _paged_inputs(g: torch.Generator, longest: list[int], next_n: int, heads: int,
                  aligned: Tensor | None = None, distinct: int | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(kv_cache, block_table, q, weights) of a paged call: shuffled pages with two spare ones
    (keys no row may see), queries and gates at the model's ranges; ``distinct`` draws every
    key from that many distinct ones."""
    blocks = [-(-n // PAGE) for n in longest]
    num_blocks = sum(blocks) + 2
    keys = _index_keys(g, num_blocks * PAGE, aligned)
    if distinct is not None:
        keys = keys[torch.randint(0, distinct, (keys.shape[0],), generator=g)]
    keys = keys.view(num_blocks, PAGE, 1, INDEX_DIM)
    kv_cache = oracle.kv_cache_cast_to_fp8(keys)
    table = block_table(g, blocks, num_blocks)
    q, q_scale = index_queries(g, (len(longest), next_n), heads, aligned)
    return kv_cache, table, q, index_weights(g, q_scale)


def _paged_logits(g, pick, shp, edge):
    heads = pick.choice(shp["index_heads"])
    next_n = pick.choice((1, 2))
    lens = [pick.int(next_n, shp["max_context"]) for _ in range(pick.int(1, 3))]
    clean = True
    if edge == "context_63_64_65":
        next_n, lens = 1, [63, 64, 65]
    if edge == "context_1":
        next_n, lens = 1, [1, 2]
    if edge == "mtp_across_page":
        next_n, lens = 2, [64, 65, 129]
    if edge == "context_lens_2d":
        # Row (b, j) sees positions < lens[b][j]; the last column is each request's longest,
        # as MTP makes it and DeepGEMM needs it (its scheduler reads KV blocks up to
        # ctx[b, next_n - 1]: 54e2261 scheduler/sm90_paged_mqa_logits.cuh:189).
        next_n, lens = 2, [[63, 65], [64, 129]]
    if edge == "uncleaned":
        clean = False
    longest = [max(n) if isinstance(n, list) else n for n in lens]
    aligned = _signs(g) if edge == "float16_overflow" else None
    kv_cache, table, q, weights = _paged_inputs(g, longest, next_n, heads, aligned)
    max_len = _ceil_page(max(longest)) + (PAGE if edge == "wide_output" else 0)
    args = (q, kv_cache, weights, _i32(lens), table, max_len)
    kwargs = {} if clean else {"clean_logits": False}
    return args, kwargs, {"mask": torch.isfinite(oracle.fp8_paged_mqa_logits(*args))}


def topk_scores(contract: str, args: tuple) -> dict[str, Tensor]:
    """The aux tensors ``topk_margin`` reads for a fused top-k call: float64 scores of every
    key (``scores``, the logits oracle with float64 gates) and each row's range
    (``row_starts``, ``row_ends``; a paged row's positions start at 0)."""
    if contract == "fp8_mqa_topk":
        q, kv, weights, ks, ke, _ = args
        return {"scores": oracle.fp8_mqa_logits(q, kv, weights.double(), ks, ke),
                "row_starts": ks, "row_ends": ke}
    q, kv_cache, weights, ctx, table, _ = args
    ends = oracle.visible_lens(ctx, q.shape[1])
    width = _ceil_page(max(int(ctx.max()), 1))
    scores = oracle.fp8_paged_mqa_logits(q, kv_cache, weights.double(), ctx, table, width)
    return {"scores": scores, "row_starts": torch.zeros_like(ends), "row_ends": ends}


def _mqa_topk(g, pick, shp, edge):
    heads, topk = pick.choice(shp["index_heads"]), pick.choice(shp["topk"])
    requests = [(pick.int(0, shp["max_prefix"]), pick.int(1, shp["max_extend"]))
                for _ in range(pick.int(1, 3))]
    if edge == "window_shorter_than_k":
        requests = [(topk - 4, 3)]  # rows see k - 3, k - 2, k - 1 keys
    if edge == "window_k_and_k_plus_1":
        requests = [(topk - 1, 2)]
    if edge == "second_request":
        requests = [(topk + 20, 2), (2 * topk + 5, 3)]  # rows of the second start past key 0
    if edge in ("tied_keys", "empty_window"):
        requests = [(2 * topk + 37, 2)]
    ks, ke, s_kv = ragged_rows(requests)
    if edge == "empty_window":
        ke[0] = ks[0]
    keys = _index_keys(g, s_kv)
    if edge == "tied_keys":  # every key one of eight: many keys share the k-th score exactly
        keys = keys[torch.randint(0, 8, (s_kv,), generator=g)]
    k_fmt = pick.choice((None, "ue8m0"))
    k_fp8, k_scale = oracle.act_quant(keys, INDEX_DIM, k_fmt)
    q, q_scale = index_queries(g, (len(ks),), heads)
    args = (q, (k_fp8, k_scale[:, 0]), index_weights(g, q_scale), ks, ke, topk)
    return args, {}, topk_scores("fp8_mqa_topk", args)


def _paged_topk(g, pick, shp, edge):
    heads, topk = pick.choice(shp["index_heads"]), pick.choice(shp["topk"])
    next_n = pick.choice(shp.get("next_n", (1, 2)))
    lens = [pick.int(next_n, shp["max_context"]) for _ in range(pick.int(1, 3))]
    if edge == "context_shorter_than_k":
        next_n, lens = 1, [topk - 1, 1]
    if edge == "context_k_and_k_plus_1":
        next_n, lens = 1, [topk, topk + 1]
    if edge == "mtp_rows":
        next_n, lens = 2, [topk + 40, 2 * topk + 3]
    if edge == "tied_keys":
        next_n, lens = 1, [2 * topk + 37]
    # tied_keys: every key is one of eight, so many positions share the k-th score exactly.
    distinct = 8 if edge == "tied_keys" else None
    kv_cache, table, q, weights = _paged_inputs(g, lens, next_n, heads, distinct=distinct)
    args = (q, kv_cache, weights, _i32(lens), table, topk)
    return args, {}, topk_scores("fp8_paged_mqa_topk", args)


def _logits_checks(call: dict) -> dict:
    cleaned = call.get("clean_logits", True)
    return {"logits": {"metric": "calc_diff", "max": CALC_DIFF_MAX, "max_bf16": CALC_DIFF_MAX_BF16,
                       "mask": "mask", "outside_mask": "-inf" if cleaned else "unspecified"}}


# --------------------------------------------------------------------------- MX indexer logits
def mx_quantize(x: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """``(payload, sf)`` of ``x [..., D]`` as DeepGEMM's MX kernels take them, one int32 word of
    ue8m0 bytes per row: MXFP8 e4m3 ``[..., D]`` (``per_token_cast_to_fp8``) or MXFP4 int8
    packed e2m1 ``[..., D / 2]`` (``per_token_cast_to_fp4``), both ``gran_k=32``,
    ``use_packed_ue8m0=True``; ``sf`` int32 ``[...]``."""
    lead, d = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, d)
    if fmt == "mxfp8":
        payload, exps = mxfp8_quantize(flat)
    else:
        codes, exps = mxfp4_quantize(flat)
        payload = codes.view(torch.int8)
    return payload.reshape(*lead, -1), exps.view(torch.int32).reshape(lead)


# The key format each MX edge case prefers (the table's first format where it lacks it), so the
# default tables' edge cases hold every clause in both formats between them.
_MX_EDGE_FORMAT = {"empty_window": "mxfp4", "uncleaned": "mxfp8", "compressed": "mxfp4",
                   "smallest_head_dim": "mxfp8", "exponent_spread": "mxfp4", "zero_blocks": "mxfp8",
                   "large_scores": "mxfp4", "context_63_64_65": "mxfp8", "smallest_block_kv": "mxfp4",
                   "largest_block_kv": "mxfp8", "context_lens_2d": "mxfp4"}
# Per-block magnitudes of the exponent_spread case: the four blocks of a row 2^33 apart at most.
_SPREAD = (2.0**-20, 1.0, 2.0**13, 2.0**-7)


def _mx_format_and_dim(pick: Pick, shp: dict, edge: str | None, paged: bool = False) -> tuple[str, int]:
    formats: tuple[str, ...] = shp["index_formats"]
    preferred = _MX_EDGE_FORMAT.get(edge or "", "")
    fmt: str = pick.choice(formats) if edge is None else (preferred if preferred in formats else formats[0])
    # FP8: DeepGEMM's 32 / 64 / 128, paged 128 (the only one its SM90 paged kernel is tested at,
    # 54e2261 tests/test_attention.py).
    dims = oracle.MX_HEAD_DIMS.get(fmt, (INDEX_DIM,) if paged else (32, 64, INDEX_DIM))
    d = pick.choice(dims) if edge is None else INDEX_DIM
    return fmt, min(dims) if edge == "smallest_head_dim" else d


def _mx_values(g: torch.Generator, lead: tuple[int, ...], d: int, edge: str | None,
               aligned: Tensor | None) -> Tensor:
    """bf16 ``[*lead, d]`` queries or keys, per-row magnitudes over ~e^±3; the MX edge cases'
    block patterns (blocks 2^33 apart, all-zero blocks, one sign pattern for large scores)."""
    x = _randn(g, *lead, d) * torch.exp(_randn(g, *lead, 1))
    if edge == "exponent_spread":
        x = x * torch.tensor(_SPREAD).repeat_interleave(MX_BLOCK)[: d]
    if edge == "zero_blocks":
        x.reshape(-1, d)[::2, MX_BLOCK : 2 * MX_BLOCK] = 0.0
    if aligned is not None:
        x = (x.abs() + 0.5) * aligned[:d] * 30.0
    return x.to(torch.bfloat16)


def _mx_queries(g: torch.Generator, fmt: str, lead: tuple[int, ...], heads: int, d: int,
                edge: str | None, aligned: Tensor | None) -> tuple[tuple, Tensor]:
    """``(q, weights)``: MX queries with their scale words and plain gates ``w · H^-1/2 ·
    D^-1/2``; FP8 queries as the model makes them (``act_quant``, the scale in the gates)."""
    x = _mx_values(g, (*lead, heads), d, edge, aligned)
    if fmt == "fp8":
        q_fp8, q_scale = oracle.act_quant(x, d)
        scales = q_scale[..., 0].reshape(-1, heads)
        return (q_fp8, None), _randn(g, *scales.shape) * heads**-0.5 * scales * d**-0.5
    return mx_quantize(x, fmt), _randn(g, x[..., 0, 0].numel(), heads) * heads**-0.5 * d**-0.5


def _mx_logits(g, pick, shp, edge):
    heads = pick.choice(shp["index_heads"])
    fmt, d = _mx_format_and_dim(pick, shp, edge)
    requests = [(pick.int(0, shp["max_prefix"]), pick.int(1, shp["max_extend"]))
                for _ in range(pick.int(1, 3))]
    ks, ke, s_kv = ragged_rows(requests)
    if edge == "empty_window":
        ke[0] = ks[0]
    aligned = _signs(g) if edge == "large_scores" else None
    q, weights = _mx_queries(g, fmt, (len(ks),), heads, d, edge, aligned)
    keys = _mx_values(g, (s_kv,), d, edge, aligned)
    if fmt == "fp8":
        k_fp8, k_scale = oracle.act_quant(keys, d)
        kv = (k_fp8, k_scale[:, 0])
    else:
        kv = mx_quantize(keys, fmt)
    kwargs: dict[str, Any] = {}
    if edge in ("uncleaned", "compressed"):
        kwargs["clean_logits"] = False
    if edge == "compressed":
        kwargs["max_seqlen_k"] = max(1, int((ke - ks).max()))
    args = (q, kv, weights, ks, ke)
    if edge == "compressed":  # column j of row i is key ks[i] + j
        mask = torch.arange(kwargs["max_seqlen_k"])[None, :] < (ke - ks)[:, None]
    else:
        col = torch.arange(s_kv)[None, :]
        mask = (col >= ks[:, None]) & (col < ke[:, None])
    return args, kwargs, {"mask": mask}


def _mx_paged_logits(g, pick, shp, edge):
    heads = pick.choice(shp["index_heads"])
    fmt, d = _mx_format_and_dim(pick, shp, edge, paged=True)
    block_kv = pick.choice(shp["block_kv"])
    next_n = pick.choice((1, 2))
    lens: list = [pick.int(next_n, shp["max_context"]) for _ in range(pick.int(1, 3))]
    two_d = pick.choice((False, True))
    if edge is not None:
        next_n, lens, two_d = 1, [2 * block_kv + 5, block_kv - 7], False
    if edge == "smallest_block_kv":
        block_kv = min(shp["block_kv"])
    if edge == "largest_block_kv":
        block_kv = max(shp["block_kv"])
    if edge == "context_63_64_65":
        lens = [block_kv - 1, block_kv, block_kv + 1]
    if edge == "context_lens_2d":
        next_n, two_d = 2, True
    if two_d:  # row (b, j) sees < lens[b][j], the last column the longest (DeepGEMM's scheduler)
        lens = [[max(1, n - j) for j in reversed(range(next_n))] for n in lens]
    longest = [max(n) if isinstance(n, list) else n for n in lens]
    blocks = [-(-n // block_kv) for n in longest]
    num_blocks = sum(blocks) + 2  # two spare blocks no row may see
    keys = _mx_values(g, (num_blocks * block_kv,), d, edge, None).view(num_blocks, block_kv, 1, d)
    writer = {"fp8": oracle.kv_cache_cast_to_fp8, "mxfp8": oracle.kv_cache_cast_to_mxfp8,
              "mxfp4": oracle.kv_cache_cast_to_fp4}[fmt]
    table = block_table(g, blocks, num_blocks)
    q, weights = _mx_queries(g, fmt, (len(longest), next_n), heads, d, edge, None)
    max_len = -(-max(longest) // block_kv) * block_kv
    args = (q, writer(keys), weights, _i32(lens), table, max_len)
    kwargs = {"clean_logits": False} if edge == "uncleaned" else {}
    ends = oracle.visible_lens(args[3], next_n)
    return args, kwargs, {"mask": torch.arange(max_len)[None, :] < ends[:, None]}


def _kv_cache_cast_mxfp8(g, pick, shp, edge):
    num_blocks, head_dim = pick.int(1, 3), pick.choice((32, 64, INDEX_DIM, INDEX_DIM))
    if edge is not None:
        num_blocks, head_dim = 1, {"head_dim_32": 32, "head_dim_64": 64}.get(edge, INDEX_DIM)
    k = _randn(g, num_blocks, PAGE, 1, head_dim) * torch.exp(_randn(g, num_blocks, PAGE, 1, 1))
    if edge == "zero_key":
        k[0, 7] = 0.0
    if edge == "power_of_two_amax":
        # amax = 448 * 2^k: the raw scale amax × fl32(1/448) may land a hair above 2^k, whose
        # ceiling then doubles the scale; the helper's bytes say which.
        k[0, :, 0, :32] = k[0, :, 0, :32].clamp(-440, 440)
        k[0, :, 0, 0] = 448.0 * 2.0 ** torch.randint(-12, 4, (PAGE,), generator=g).float()
    if edge == "exponent_spread":
        k = k * torch.tensor(_SPREAD).repeat_interleave(MX_BLOCK)[:head_dim]
    return (k.to(torch.bfloat16),), {}, {}


# --------------------------------------------------------------------------- top-k
def _topk(g, pick, shp, edge):
    topk = pick.choice(shp["topk"])
    rows, n = pick.int(1, shp["max_rows"]), pick.int(1, shp["max_cols"])
    logits = _randn(g, rows, n)
    if pick.choice((False, True)):
        logits = torch.randint(0, 8, (rows, n), generator=g).float() / 2  # ties everywhere
    starts = torch.randint(0, n, (rows,), generator=g)
    ends = starts + (torch.rand(rows, generator=g) * (n + 1 - starts)).long()
    if edge is not None:
        n = 2 * topk + 37
        lens = {"ties_at_kth": [n] * 2, "all_tied": [n], "empty_row": [0, 5],
                "row_shorter_than_k": [topk - 1], "row_exactly_k": [topk],
                "row_k_plus_1": [topk + 1], "offset_rows": [topk + 9, n - 20]}[edge]
        rows = len(lens)
        starts = torch.tensor([0 if edge != "offset_rows" else 20 * (r + 1) for r in range(rows)])
        starts = starts.clamp(max=n - max(lens))
        ends = starts + torch.tensor(lens)
        logits = _randn(g, rows, n)
        if edge == "ties_at_kth":
            # Eight levels: the k-th best value is tied with many unselected columns.
            logits = torch.randint(0, 8, (rows, n), generator=g).float() / 2
        if edge == "all_tied":
            logits.fill_(0.25)
    col = torch.arange(n)
    outside = (col[None, :] < starts[:, None]) | (col[None, :] >= ends[:, None])
    # Uncleaned logits: huge values and NaN outside the range must never be selected or read.
    garbage = torch.where(col % 2 == 0, torch.tensor(1e30), torch.tensor(float("nan")))
    logits = torch.where(outside, garbage.expand(rows, n), logits)
    starts, ends = starts.to(torch.int32), ends.to(torch.int32)
    aux = {"scores": logits, "row_starts": starts, "row_ends": ends}
    return (logits, starts, ends, topk), {}, aux


def _transform_ragged(g, pick, shp, edge):
    topk = pick.choice(shp["topk"])
    lens = [pick.int(0, shp["max_cols"]) for _ in range(pick.int(1, shp["max_rows"]))]
    if edge == "all_minus_one_row":
        lens = [0, topk + 3]
    if edge == "short_rows":
        lens = [1, topk - 1, topk]
    offsets = torch.cumsum(torch.tensor([0] + lens[:-1]), 0).to(torch.int32)
    if edge == "zero_offsets":
        offsets.zero_()
    indices = relative_indices(g, lens, topk)
    if edge == "repeated_index":
        lens = [topk + 3, 40]
        offsets = _i32([0, topk + 3])
        indices = relative_indices(g, lens, topk)
        indices[0, :5] = 2  # a repeated index is transformed like any other, repeats kept
        indices[1, 1:40:2] = indices[1, 0:39:2]
    return (indices, offsets), {}, {}


def _transform_paged(g, pick, shp, edge):
    topk = pick.choice(shp["topk"])
    page_size = pick.choice((PAGE, PAGE, 1))
    lens = [pick.int(0, shp["max_context"]) for _ in range(pick.int(1, shp["max_rows"]))]
    if edge == "page_size_1":
        page_size = 1
    if edge in ("page_boundary_63_64_65", "all_minus_one_row", "repeated_index"):
        page_size, lens = PAGE, [130, 0]
    pages = max(1, -(-max(lens) // page_size))
    page_table = torch.randperm(len(lens) * pages + 5, generator=g)[: len(lens) * pages]
    page_table = page_table.view(len(lens), pages).to(torch.int32)
    indices = relative_indices(g, lens, topk)
    if edge == "page_boundary_63_64_65":
        indices[0, :3] = _i32([63, 64, 65])
    if edge == "repeated_index":
        indices[0, :5] = 64
    kwargs = {} if page_size == PAGE else {"page_size": page_size}
    return (indices, page_table), kwargs, {}


# --------------------------------------------------------------------------- FP8 MLA cache
def _latent(g: torch.Generator, num_blocks: int, std: float = 1.0) -> Tensor:
    """float32 [num_blocks, 64, 1, 576] latent rows, per-token magnitudes over ~e^±3."""
    kv = _randn(g, num_blocks, PAGE, 1, oracle.MLA_DIM, std=std)
    return kv * torch.exp(_randn(g, num_blocks, PAGE, 1, 1))


def _quantize_cache(g, pick, shp, edge):
    kv = _latent(g, 1 if edge else pick.int(1, 3))
    fmt = pick.choice(("ue8m0", None))
    if edge == "ue8m0_scales":
        fmt = "ue8m0"
    if edge == "fp32_scales":
        fmt = None
    if edge == "zero_token":
        kv[0, 5] = 0.0
    if edge == "wide_magnitudes":
        kv[0, :, :, :128] *= 1e3
        kv[0, :, :, 128:256] *= 1e-3
    return (kv.to(torch.bfloat16),), ({} if fmt == "ue8m0" else {"scale_fmt": fmt}), {}


def _dequantize_cache(g, pick, shp, edge):
    kv = _latent(g, 1 if edge else pick.int(1, 3))
    fmt = pick.choice(("ue8m0", None))
    if edge == "ue8m0_cache":
        fmt = "ue8m0"
    if edge == "fp32_scale_cache":
        fmt = None
    if edge == "zero_token":
        kv[0, 5] = 0.0
    return (oracle.quantize_k_cache(kv.to(torch.bfloat16), fmt),), {}, {}


# --------------------------------------------------------------------------- sparse MLA
def invalid_indices(s_kv: int) -> tuple[int, ...]:
    """The invalid sparse-attention indices over ``s_kv`` rows that every kernel must skip:
    negative (INT32_MIN, -123456, -1) and at or past the end (s_kv, s_kv + 55, INT32_MAX),
    FlashMLA's test set."""
    return (INT32_MIN, -123456, -1, s_kv, s_kv + 55, INT32_MAX)


def _prefill_indices(g: torch.Generator, s_q: int, s_kv: int, topk: int) -> Tensor:
    """int32 [s_q, 1, topk]: distinct valid rows, -1 padding past s_kv, up to a quarter of the
    entries replaced by invalid values (negative or ≥ s_kv) at random places."""
    invalid = torch.tensor(invalid_indices(s_kv))
    rows = []
    for _ in range(s_q):
        valid = torch.randperm(s_kv, generator=g)[:topk]
        row = torch.cat([valid, torch.full((topk - valid.numel(),), -1)])
        hit = torch.rand(topk, generator=g) < float(torch.rand(1, generator=g)) / 4
        row = torch.where(hit, invalid[torch.randint(0, 6, (topk,), generator=g)], row)
        rows.append(row[torch.randperm(topk, generator=g)])
    return torch.stack(rows).to(torch.int32).unsqueeze(1)


def _repeat_pairs(row: Tensor) -> None:
    """Each odd entry of ``row`` repeats the even one before it (in place; any length)."""
    odd = row[1::2]
    odd.copy_(row[::2][: odd.numel()])


def _put(t: Tensor, start: int, values: list[int]) -> None:
    """``values`` written over ``t``'s entries from flat position ``start`` on, in row order
    (across rows when a row is shorter), as many as ``t`` holds."""
    flat = t.view(-1)[start:start + len(values)]
    flat.copy_(_i32(values[: flat.numel()]))


def _sparse_fwd(g, pick, shp, edge):
    heads, topk = pick.choice(shp["mla_heads"]), pick.choice(shp["mla_topk"])
    s_q, s_kv = pick.int(1, shp["max_s_q"]), pick.int(1, shp["max_kv"])
    sink, lengths = pick.choice((False, True)), pick.choice((False, True))
    sm_scale = pick.choice(shp["sm_scale"])
    if edge is not None:
        # three rows at least, and enough of them for the invalid values at flat 3..8 at any top-k
        s_q, s_kv = max(3, -(-9 // topk)), topk + 50
        sink, lengths = edge == "attn_sink", edge == "topk_length"
    if edge == "topk_past_kv":
        s_kv = topk // 2 + 3  # FlashMLA's "irregular shapes with OOB top-k"
    q = _randn(g, s_q, heads, oracle.MLA_DIM, std=MLA_INPUT_STD, dtype=torch.bfloat16)
    kv = _randn(g, s_kv, 1, oracle.MLA_DIM, std=MLA_INPUT_STD, dtype=torch.bfloat16)
    indices = _prefill_indices(g, s_q, s_kv, topk)
    if edge == "invalid_indices":
        _put(indices, 3, list(invalid_indices(s_kv)))
    if edge == "lonely_row":
        indices[1] = -1
        indices[2, 0, ::2] = s_kv
    if edge == "repeated_index":
        indices[0, 0, :8] = 5  # a valid row listed eight times is attended eight times
        _repeat_pairs(indices[1, 0])
    kwargs = {}
    if sink:
        kwargs["attn_sink"] = _randn(g, heads)
    if lengths:
        kwargs["topk_length"] = torch.randint(0, topk + 1, (s_q,), generator=g).to(torch.int32)
        if edge == "topk_length":
            kwargs["topk_length"][:2] = _i32([0, topk // 2 + 1])
    return (q, kv, indices, sm_scale), kwargs, {}


def per_tensor_fp8(x: Tensor) -> tuple[Tensor, Tensor]:
    """(e4m3 payload, float32 [1] scale) of ``x`` with one scale for the tensor, amax / 448:
    how the Q8KV8 cases quantize q and kv (SGLang's test casts with scale 1, the unit_scales
    case)."""
    scale = (x.float().abs().amax().clamp_min(1e-4) / 448.0).reshape(1)
    return (x.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn), scale


def _q8kv8(g, pick, shp, edge):
    heads, sm_scale = pick.choice(shp["mla_heads"]), pick.choice(shp["sm_scale"])
    topk = pick.choice(tuple(k for k in shp["mla_topk"] if k % 128 == 0) or (128,))
    s_q, s_kv = pick.int(1, shp["max_s_q"]), pick.int(1, max(shp["max_kv"], topk))
    extras, d_qk = pick.choice((False, True)), pick.choice((oracle.MLA_DIM, oracle.MLA_DIM, 512))
    if edge is not None:
        s_q, s_kv, extras, d_qk = 3, topk + 50, edge == "attn_sink_and_topk_length", oracle.MLA_DIM
    if edge == "no_rope_512":
        d_qk = 512
    q = _randn(g, s_q, heads, d_qk, std=MLA_INPUT_STD)
    kv = _randn(g, s_kv, 1, d_qk, std=MLA_INPUT_STD)
    (q_fp8, q_scale), (kv_fp8, kv_scale) = per_tensor_fp8(q), per_tensor_fp8(kv)
    if edge == "unit_scales":  # SGLang's test: a plain cast, both scales 1
        q_fp8, kv_fp8 = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
        q_scale, kv_scale = torch.ones(1), torch.ones(1)
    indices = _prefill_indices(g, s_q, s_kv, topk)
    if edge == "invalid_indices":
        indices[0, 0, 3:9] = _i32(list(invalid_indices(s_kv)))
    if edge == "lonely_row":
        indices[1] = -1
    kwargs = {}
    if extras:
        kwargs["attn_sink"] = _randn(g, heads)
        kwargs["topk_length"] = torch.randint(0, topk + 1, (s_q,), generator=g).to(torch.int32)
        if edge == "attn_sink_and_topk_length":
            kwargs["topk_length"][:2] = _i32([0, topk // 2 + 1])
    return (q_fp8, kv_fp8, indices, sm_scale, q_scale, kv_scale), kwargs, {}


def _sparse_decode(g, pick, shp, edge, bf16_cache: bool = False):
    heads = pick.choice(shp["bf16_decode_heads"] if bf16_cache else shp["mla_heads"])
    topk = pick.choice(shp["mla_topk"])
    block_size = pick.choice((PAGE, PAGE, 1)) if bf16_cache else PAGE
    b, s_q = pick.int(1, 3), pick.int(1, 2)
    num_blocks = pick.int(1, max(2, topk // block_size + 1))
    sink, lengths = pick.choice((False, True)), pick.choice((False, True))
    sm_scale = pick.choice(shp["sm_scale"])
    if edge is not None:
        block_size = 1 if edge == "page_size_1" else PAGE
        # bf16: a context of a quarter of the top-k (rows end in -1), as decode rows of short
        # requests do (two pages at least); the golden set's bf16 caches then fit its size.
        b, s_q, num_blocks = 2, 1, topk // block_size + 1
        if bf16_cache:
            num_blocks = max(2 * PAGE // block_size, topk // 4 // block_size + 1)
        sink, lengths = edge == "attn_sink", edge == "topk_length"
    if edge == "unread_nan":
        num_blocks += 1  # a spare page of NaN, never named by a read slot
    if bf16_cache:
        k_cache = _randn(g, num_blocks, block_size, 1, oracle.MLA_DIM, std=MLA_INPUT_STD)
        k_cache = (k_cache * torch.exp(_randn(g, num_blocks, block_size, 1, 1))).to(torch.bfloat16)
    else:
        latent = _latent(g, num_blocks, std=MLA_INPUT_STD).to(torch.bfloat16)
        k_cache = oracle.quantize_k_cache(latent, "ue8m0")  # the decode kernel's bf16(fp8)·bf16(scale)
    slots = num_blocks * block_size
    readable = slots - (block_size if edge == "unread_nan" else 0)
    idx = torch.stack([torch.randperm(readable, generator=g)[:topk] for _ in range(b * s_q)])
    idx = torch.cat([idx, torch.full((b * s_q, topk - idx.shape[1]), -1)], dim=1)
    pad = torch.rand(b * s_q, topk, generator=g) < float(torch.rand(1, generator=g)) / 4
    indices = torch.where(pad, -1, idx).view(b, s_q, topk)
    if edge == "lonely_entry":
        indices[1] = -1
    if edge == "slots_across_pages":
        _put(indices, 0, [PAGE - 1, PAGE, 2 * PAGE - 1, 0])
    if edge == "repeated_slot":
        indices[0, 0, :6] = 7  # a valid slot listed six times is attended six times
        _repeat_pairs(indices[1, 0])
    if edge == "unread_nan":
        k_cache[-1] = float("nan")
    q = _randn(g, b, s_q, heads, oracle.MLA_DIM, std=MLA_INPUT_STD, dtype=torch.bfloat16)
    kwargs = {}
    if lengths:
        kwargs["topk_length"] = torch.randint(0, topk + 1, (b,), generator=g).to(torch.int32)
        if edge == "topk_length":
            kwargs["topk_length"][:] = _i32([0, topk // 2 + 1])
    if edge == "unread_nan":
        # Both entries read their first half; the slots only entry 1's second half names hold
        # NaN (a kernel that loads them and weights them 0 gets 0 × NaN = NaN).
        half = topk // 2
        kwargs["topk_length"] = _i32([half, half])
        read = indices[:, 0, :half]
        tail = indices[1, 0, half:]
        unread = tail[(tail >= 0) & ~torch.isin(tail, read)]
        k_cache.view(-1, oracle.MLA_DIM)[unread.long()] = float("nan")
    if sink:
        kwargs["attn_sink"] = _randn(g, heads)
    return (q, k_cache, indices.to(torch.int32), sm_scale), kwargs, {}


def _sparse_decode_bf16(g, pick, shp, edge):
    return _sparse_decode(g, pick, shp, edge, bf16_cache=True)


# --------------------------------------------------------------------------- the table
@dataclass(frozen=True)
class Contract:
    """How to build, call and check one contract.

    build(g, pick, shapes, edge) → (args, kwargs, aux). edges: each named edge case and the
    contract clause it holds. checks(call) → the metric spec per output, given the call's
    optional arguments.
    """

    build: Callable
    edges: dict[str, str]
    checks: Callable[[dict], dict]
    dtypes: dict[str, tuple[torch.dtype, ...]]


_F32, _BF16 = torch.float32, torch.bfloat16
_BYTES = (torch.uint8, torch.int8, torch.float8_e4m3fn)


def _same(metric: str, *names: str, **spec) -> Callable[[dict], dict]:
    return lambda call: {n: {"metric": metric, **spec} for n in names}


def _topk_checks(call: dict) -> dict:
    return {"indices": {"metric": "topk_set", "scores": "scores", "row_starts": "row_starts",
                        "row_ends": "row_ends", "base": call.get("base", "relative"),
                        "pad": call.get("pad", -1)}}


def _margin_checks(call: dict) -> dict:
    return {"indices": {"metric": "topk_margin", "scores": "scores", "row_starts": "row_starts",
                        "row_ends": "row_ends", "rel_tol": TOPK_REL_TOL}}


CONTRACTS: dict[str, Contract] = {
    "hadamard_transform": Contract(
        _hadamard, {
            "non_power_of_two_dim": "a dim that is not a power of two is zero-padded to the next "
                                    "power, transformed and truncated",
            "zeros": "zero input gives zero output (no NaN from a scale)",
            "large_magnitude": "values of 1e4 keep their relative accuracy",
        },
        _same("allclose", "out", **HADAMARD_TOL), {"out": (_BF16, _F32)}),
    "act_quant": Contract(
        _act_quant, {
            "ue8m0_scales": "scale_fmt='ue8m0': power-of-two scales 2^ceil(log2(amax/448))",
            "fp32_scales": "scale_fmt=None: float32 scales amax/448",
            "all_zero_block": "an all-zero block takes the 1e-4 amax floor",
            "tiny_block": "a block far below the floor is scaled by the floor",
        },
        _same("bitwise", "x_fp8", "scale"),
        {"x_fp8": (torch.float8_e4m3fn,), "scale": (_F32,)}),
    "kv_cache_cast_to_fp8": Contract(
        _kv_cache_cast, {
            "zero_key": "an all-zero key takes the 1e-4 amax floor",
            "single_block": "one 64-token block: payload at t*128, scale at 64*128 + 4t",
        },
        _same("bitwise", "kv_cache", region_dims=3, regions=[["payload", 0, PAGE * INDEX_DIM],
              ["scales", PAGE * INDEX_DIM, PAGE * (INDEX_DIM + 4)]]),
        {"kv_cache": (torch.uint8,)}),
    "kv_cache_cast_to_fp4": Contract(
        _kv_cache_cast_fp4, {
            "midpoint_ties": "a value on an e2m1 midpoint takes the smaller magnitude (0.75 -> 0.5, "
                             "5 -> 4), as DeepGEMM's helper does; not the even code",
            "zero_key": "an all-zero key takes the 1e-4 amax floor: exponent byte 2^ceil(log2(1e-4/6))",
            "power_of_two_amax": "amax = 6 * 2^k: the scale is 2^k exactly (ceil of an exact power)",
            "head_dim_64": "64 dims: two exponent bytes per token, the other two 127 (1.0)",
        },
        _same("bitwise", "kv_cache"), {"kv_cache": (torch.uint8,)}),
    "kv_cache_cast_to_mxfp8": Contract(
        _kv_cache_cast_mxfp8, {
            "zero_key": "an all-zero key takes the 1e-4 amax floor: exponent byte of "
                        "2^ceil(log2(1e-4 × fl32(1/448)))",
            "power_of_two_amax": "amax = 448 * 2^k: the raw scale amax × fl32(1/448) rounds to 2^k "
                                 "exactly, whose ceiling is 2^k",
            "head_dim_32": "32 dims: one exponent byte per token, the other three 127 (1.0)",
            "head_dim_64": "64 dims: two exponent bytes per token, the other two 127 (1.0)",
            "exponent_spread": "blocks of one key 2^33 apart: one exponent byte per 32 elements, "
                               "block j in byte j of the token's word",
        },
        _same("bitwise", "kv_cache"), {"kv_cache": (torch.uint8,)}),
    "fp8_mqa_logits": Contract(
        _mqa_logits, {
            "empty_window": "a row with ke == ks sees no key: every entry -inf",
            "no_prefix": "a request without prefix: row i sees keys ks..ks+i",
            "uncleaned": "clean_logits=False: entries outside [ks, ke) are unspecified",
            "compressed": "max_seqlen_k > 0: out[i, j] is key ks[i] + j, -inf past ke",
            "ue8m0_k_scales": "keys quantized with power-of-two scales",
            "full_range": "q and k are act_quant payloads over the full e4m3 range (|x| up to "
                          "448) and the gates carry q's scale, as the model makes them",
            "float16_overflow": "q and k of one sign pattern: q·k reaches ~1e7, past float16's "
                                "65504; the kernel accumulates in float32",
        },
        _logits_checks, {"logits": (_F32, _BF16)}),
    "fp8_paged_mqa_logits": Contract(
        _paged_logits, {
            "context_63_64_65": "contexts one short of, at and one past a 64-token page",
            "context_1": "a context of one token",
            "mtp_across_page": "next_n=2: row (b, j) sees positions <= ctx_b - 2 + j, across a page",
            "context_lens_2d": "2-D context_lens [B, next_n]: row (b, j) sees positions < ctx[b, j] "
                               "(the last column each request's longest)",
            "uncleaned": "clean_logits=False: entries past the context are unspecified",
            "wide_output": "max_context_len a page past the longest context: those columns -inf",
            "full_range": "q and k are act_quant payloads over the full e4m3 range (|x| up to "
                          "448) and the gates carry q's scale, as the model makes them",
            "float16_overflow": "q and k of one sign pattern: q·k reaches ~1e7, past float16's "
                                "65504; the kernel accumulates in float32",
        },
        _logits_checks, {"logits": (_F32, _BF16)}),
    "fp8_mqa_topk": Contract(
        _mqa_topk, {
            "window_shorter_than_k": "rows that see fewer than k keys: each key once (relative "
                                     "to ks), then -1",
            "window_k_and_k_plus_1": "exactly k keys (all of them), and k + 1 (one left out)",
            "second_request": "rows of a second request: positions relative to its ks, not "
                              "key numbers",
            "empty_window": "a row with ke == ks: all -1",
            "tied_keys": "eight distinct keys: keys of equal score are interchangeable",
        },
        _margin_checks, {"indices": (torch.int32,)}),
    "fp8_paged_mqa_topk": Contract(
        _paged_topk, {
            "context_shorter_than_k": "rows that see fewer than k positions: each position "
                                      "once, then -1",
            "context_k_and_k_plus_1": "exactly k positions (all of them), and k + 1 (one left out)",
            "mtp_rows": "next_n=2: row (b, j) ranks positions <= ctx_b - 2 + j",
            "tied_keys": "eight distinct keys: positions of equal score are interchangeable",
        },
        _margin_checks, {"indices": (torch.int32,)}),
    "fp8_fp4_mqa_logits": Contract(
        _mx_logits, {
            "empty_window": "a row with ke == ks sees no key: every entry -inf",
            "uncleaned": "clean_logits=False: entries outside [ks, ke) are unspecified",
            "compressed": "max_seqlen_k > 0: out[i, j] is key ks[i] + j, -inf past ke",
            "smallest_head_dim": "the format's smallest head dim (MXFP8 32, MXFP4 64): the bytes of "
                                 "a scale word past D/32 are 127 padding, not read",
            "exponent_spread": "the blocks of every query and key 2^-20, 1, 2^13, 2^-7 apart: "
                               "each ue8m0 byte scales its own 32 elements",
            "zero_blocks": "all-zero blocks (their exponent from the 1e-4 floor) add nothing",
            "large_scores": "q and k of one sign pattern: q·k far past float16's 65504; the "
                            "kernel accumulates in float32",
        },
        _logits_checks, {"logits": (_F32, _BF16)}),
    "fp8_fp4_paged_mqa_logits": Contract(
        _mx_paged_logits, {
            "context_63_64_65": "contexts one short of, at and one past a block",
            "smallest_block_kv": "the table's smallest block_kv (32 on SM100): a block's scale "
                                 "words start block_kv × payload bytes into it",
            "largest_block_kv": "the table's largest block_kv (128 on SM100)",
            "context_lens_2d": "2-D context_lens [B, next_n] (DeepGEMM's only form): row (b, j) "
                               "sees positions < ctx[b, j], the last column each request's longest",
            "uncleaned": "clean_logits=False: entries past the context are unspecified",
            "exponent_spread": "the blocks of every query and key 2^-20, 1, 2^13, 2^-7 apart: "
                               "each ue8m0 byte scales its own 32 elements",
            "smallest_head_dim": "the format's smallest head dim (MXFP8 32, MXFP4 64): a token is "
                                 "D (or D/2) payload bytes and one 4-byte word",
        },
        _logits_checks, {"logits": (_F32, _BF16)}),
    "topk_per_row": Contract(
        _topk, {
            "ties_at_kth": "the k-th value tied with unselected columns: any of them may be taken",
            "all_tied": "every column tied",
            "empty_row": "an empty row (start == end): all pads",
            "row_shorter_than_k": "k-1 columns: every column once, then pads",
            "row_exactly_k": "exactly k columns: every column once",
            "row_k_plus_1": "k+1 columns: the smallest one dropped",
            "offset_rows": "rows starting past column 0: indices relative to row_start",
        },
        _topk_checks, {"indices": (torch.int32,)}),
    "topk_transform_ragged": Contract(
        _transform_ragged, {
            "all_minus_one_row": "a row of -1 stays -1",
            "short_rows": "rows shorter than k: -1 entries stay -1",
            "zero_offsets": "offsets 0: indices unchanged",
            "repeated_index": "a repeated index is transformed each time it is listed",
        },
        _same("index_set", "indices_out"), {"indices_out": (torch.int32,)}),
    "topk_transform_paged": Contract(
        _transform_paged, {
            "page_boundary_63_64_65": "positions 63, 64, 65 map across a page boundary",
            "page_size_1": "page_size=1: the page table is a slot table",
            "all_minus_one_row": "a row of -1 stays -1",
            "repeated_index": "a repeated position is mapped each time it is listed",
        },
        _same("index_set", "indices_out"), {"indices_out": (torch.int32,)}),
    "quantize_k_cache": Contract(
        _quantize_cache, {
            "ue8m0_scales": "ue8m0 tile scales 2^ceil(log2(max(amax/448, 1e-4)))",
            "fp32_scales": "scale_fmt=None: float32 tile scales amax/448",
            "zero_token": "an all-zero token takes the 1e-4 scale floor",
            "wide_magnitudes": "tiles 1e6 apart in magnitude in one row",
        },
        _same("bitwise", "k_cache", region_dims=1, regions=[
              ["payload", 0, oracle.MLA_NOPE_DIM],
              ["scales", oracle.MLA_NOPE_DIM, oracle.MLA_NOPE_DIM + 16],
              ["rope", oracle.MLA_NOPE_DIM + 16, oracle.MLA_ROW_BYTES]]), {"k_cache": _BYTES}),
    "dequantize_k_cache": Contract(
        _dequantize_cache, {
            "ue8m0_cache": "ue8m0 scales: every dequantized value exact in bf16",
            "fp32_scale_cache": "float32 scales: e4m3 x scale rounded once to bf16",
            "zero_token": "an all-zero token dequantizes to zeros",
        },
        _same("bitwise", "kv"), {"kv": (_BF16,)}),
    "flash_mla_sparse_fwd": Contract(
        _sparse_fwd, {
            "invalid_indices": "INT32_MIN, -123456, -1, s_kv, s_kv + 55, INT32_MAX are skipped",
            "lonely_row": "a row with no valid index: out 0, max_logits -inf, lse +inf; and a "
                          "half-invalid row",
            "attn_sink": "attn_sink, a value-less key per head: out normalised by "
                         "logaddexp(lse, sink), lse without it",
            "topk_length": "entries at or past topk_length[i] are skipped (0 gives a lonely row)",
            "topk_past_kv": "top-k wider than s_kv: the excess is -1 padding",
            "repeated_index": "a valid index listed twice is attended twice",
        },
        lambda call: {"out": {"metric": "allclose", **SPARSE_OUT_TOL},
                      "max_logits": {"metric": "allclose", **SPARSE_STAT_TOL},
                      "lse": {"metric": "allclose", **SPARSE_STAT_TOL}},
        {"out": (_BF16, _F32), "max_logits": (_F32,), "lse": (_F32,)}),
    "sparse_mla_q8kv8_prefill_fwd": Contract(
        _q8kv8, {
            "unit_scales": "q and kv cast to e4m3 with scales 1 (SGLang's test and serving cast)",
            "invalid_indices": "INT32_MIN, -123456, -1, s_kv, s_kv + 55, INT32_MAX are skipped",
            "lonely_row": "a row with no valid index: out 0, max_logits -inf, lse +inf",
            "attn_sink_and_topk_length": "attn_sink and topk_length together (the kernel's full "
                                         "path): out normalised by logaddexp(lse, sink), entries "
                                         "at or past topk_length skipped",
            "no_rope_512": "d_qk = 512: q and kv without RoPE dims",
        },
        lambda call: {"out": {"metric": "allclose", **Q8KV8_OUT_TOL},
                      "max_logits": {"metric": "allclose", **Q8KV8_STAT_TOL},
                      "lse": {"metric": "allclose", **Q8KV8_STAT_TOL}},
        {"out": (_BF16, _F32), "max_logits": (_F32,), "lse": (_F32,)}),
    "flash_mla_sparse_decode": Contract(
        _sparse_decode, {
            "lonely_entry": "a query with no valid slot: out 0, lse +inf",
            "attn_sink": "attn_sink, a value-less key per head: out normalised by "
                         "logaddexp(lse, sink), lse without it",
            "topk_length": "slots at or past topk_length[b] are not read",
            "slots_across_pages": "slots 63, 64, 127, 0: the page is slot // 64",
            "repeated_slot": "a valid slot listed twice is attended twice",
        },
        lambda call: {"out": {"metric": "allclose", **DECODE_OUT_TOL},
                      "lse": {"metric": "allclose", **DECODE_LSE_TOL}},
        {"out": (_BF16, _F32), "lse": (_F32,)}),
    "flash_mla_sparse_decode_bf16": Contract(
        _sparse_decode_bf16, {
            "lonely_entry": "a query with no valid slot: out 0, lse +inf",
            "attn_sink": "attn_sink, a value-less key per head: out normalised by "
                         "logaddexp(lse, sink), lse without it",
            "topk_length": "slots at or past topk_length[b] are not read",
            "slots_across_pages": "slots 63, 64, 127, 0: the page is slot // 64",
            "repeated_slot": "a valid slot listed twice is attended twice",
            "page_size_1": "block_size 1: a slot is a block",
            "unread_nan": "slots named only at or past topk_length, and a page no slot names, hold "
                          "NaN: nothing reads them",
        },
        lambda call: {"out": {"metric": "allclose", **DECODE_OUT_TOL},
                      "lse": {"metric": "allclose", **DECODE_LSE_TOL}},
        {"out": (_BF16, _F32), "lse": (_F32,)}),
}


# Conventions a kernel may implement instead of the newest upstream one, pinned through
# ``kernel_options`` (``check_kernel(..., convention=NAME)``, ``glm-dsa check --convention``);
# golden vectors hold each contract's edge cases once per convention.
NEWEST = "newest"
CONVENTIONS: dict[str, dict[str, dict]] = {
    "flash_mla_sparse_fwd": {"sep2025": {"lse_base": "2", "lonely_lse": "-inf"}},
    "topk_per_row": {"tilelang": {"base": "absolute", "pad": 0}},
    # DeepGEMM's own default (clean_logits=False), which its newest kernel cannot change for
    # 2-D context_lens: entries past a row's context are left as they are.
    "fp8_paged_mqa_logits": {"deepgemm": {"clean_logits": False}},
    "fp8_fp4_paged_mqa_logits": {"deepgemm": {"clean_logits": False}},
    # SGLang's FP4 index-K writer floors the scale, not amax (its default rounding).
    "kv_cache_cast_to_fp4": {"sglang": {"scale_floor": "scale"}},
    # flashinfer-bench's DSA definitions: base-2 lse, -inf for a query with no valid slot.
    "flash_mla_sparse_decode_bf16": {"flashinfer": {"lse_base": "2", "lonely_lse": "-inf"}},
}


# Arguments an older convention's kernel does not have (attn_sink and topk_length came after
# FlashMLA c28eca9): its random cases are drawn without them, its edge cases that need them
# do not exist.
CONVENTION_LACKS: dict[str, tuple[str, ...]] = {"sep2025": ("attn_sink", "topk_length"),
                                                 "flashinfer": ("attn_sink", "topk_length")}


def conventions(contract: str) -> dict[str, dict]:
    """Every convention of ``contract`` and the options it pins, the newest (none) first."""
    _contract(contract)
    return {NEWEST: {}, **CONVENTIONS.get(contract, {})}


def convention_of(contract: str, options: dict) -> str | None:
    """The convention whose pinned options are exactly ``options`` (None if none is)."""
    for name, pinned in conventions(contract).items():
        if pinned == options:
            return name
    return None


def _contract(name: str) -> Contract:
    if name not in CONTRACTS:
        raise ValueError(f"unknown contract {name!r}; one of: {', '.join(CONTRACTS)}")
    return CONTRACTS[name]


def _shapes(name: str | dict) -> dict:
    if isinstance(name, dict):  # a table of its own (a flashinfer-bench definition's axes)
        return name
    if name not in SHAPES:
        raise ValueError(f"unknown shapes {name!r}; one of: {', '.join(SHAPES)}")
    return SHAPES[name]


def edge_case_names(contract: str) -> tuple[str, ...]:
    """The named edge cases of ``contract``, always run by ``check_kernel``."""
    return tuple(_contract(contract).edges)


def clauses(contract: str) -> dict[str, str]:
    """Each named edge case of ``contract`` and the contract clause it holds."""
    return dict(_contract(contract).edges)


def check_seed(seed: object, what: str = "seed") -> int:
    """``seed`` if it is an int in ``[0, 2**63)`` (what the case generators are seeded with);
    else ValueError naming ``what``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
        raise ValueError(f"{what}={seed!r} must be an int from 0 to 2**63 - 1")
    return seed


def _mix(seed: int, *parts) -> int:
    text = ".".join(str(p) for p in parts)
    return (seed * 0x9E3779B97F4A7C15 + zlib.crc32(text.encode())) % 2**63


def build_case(contract: str, pick: Pick, data_seed: int, shapes: str | dict = "small",
               edge: str | None = None, name: str | None = None,
               kernel_options: dict | None = None) -> Case:
    """A case of ``contract`` with sizes from ``pick`` and tensor values from ``data_seed``.

    ``kernel_options`` are passed to the kernel and the oracle in every case and override the
    case's own optional arguments (pin ``scale_fmt``, ``clean_logits``, ``lse_base`` … to the
    convention a kernel implements).
    """
    spec, shp = _contract(contract), _shapes(shapes)
    if edge is not None and edge not in spec.edges:
        raise ValueError(f"{contract} has no edge case {edge!r}; its edge cases: {', '.join(spec.edges)}")
    opts = dict(kernel_options or {})
    g = torch.Generator().manual_seed(data_seed)
    args, kwargs, aux = spec.build(g, pick, shp, edge)
    lacks = CONVENTION_LACKS.get(convention_of(contract, opts) or "", ())
    for key in lacks:
        if key in kwargs and edge is not None:
            raise ValueError(f"{contract}'s edge case {edge!r} needs {key}, which the "
                             f"{convention_of(contract, opts)} convention's kernels do not take")
        kwargs.pop(key, None)
    kwargs = {**kwargs, **opts}
    return Case(contract, name or (edge or "random"), tuple(args), kwargs, spec.checks(kwargs),
                spec.dtypes, aux, clause=spec.edges.get(edge, "") if edge else "", pinned=tuple(opts))


def positions_of_slots(slots: Tensor, block_table: Tensor, block_size: int, next_n: int = 1) -> Tensor:
    """int64 ``[R, k]`` positions in each row's request of physical slots
    ``block * block_size + offset`` (row r belongs to request ``r // next_n``; a block listed
    twice, as block 0 in a table's unused tail, is its first entry); ``-1`` stays; a slot
    outside the request's blocks becomes ``2**31 - 1`` (a position no row has)."""
    out = torch.full(slots.shape, -1, dtype=torch.int64)
    for r in range(slots.shape[0]):
        where: dict[int, int] = {}
        for i, b in enumerate(block_table[r // next_n].tolist()):
            where.setdefault(int(b), i)  # the first: a table's unused tail repeats block 0
        for j, v in enumerate(slots[r].tolist()):
            if v >= 0:
                logical = where.get(v // block_size)
                out[r, j] = 2**31 - 1 if logical is None else logical * block_size + v % block_size
    return out


# Attention contracts whose expected outputs are computed in float64 (q and kv, or their
# scales, upcast exactly) and rounded once to the float32 the oracle gives for the case's
# inputs: the truth within half a float32 ulp, its own rounding error out of the bound, and the
# golden files no larger than float32 outputs make them.
FLOAT64_TRUTH = ("flash_mla_sparse_fwd", "sparse_mla_q8kv8_prefill_fwd", "flash_mla_sparse_decode",
                 "flash_mla_sparse_decode_bf16")


def _float64_inputs(contract: str, args: tuple) -> tuple:
    def up(t):
        return t.double() if isinstance(t, Tensor) and t.dtype in (torch.bfloat16, torch.float32) else t
    if contract == "sparse_mla_q8kv8_prefill_fwd":  # e4m3 q and kv stay; float64 scales lift it
        return args[:4] + tuple(up(t) for t in args[4:])
    if contract == "flash_mla_sparse_decode":  # the 656-byte cache stays bytes
        return (up(args[0]),) + args[1:]
    return tuple(up(t) for t in args)


def expected_outputs(case: Case) -> tuple[Tensor, ...]:
    """The oracle's outputs on ``case`` (CPU), in the order of ``case.checks``; attention
    contracts' (``FLOAT64_TRUTH``) computed in float64, rounded once to float32."""
    fn = getattr(oracle, case.contract)
    args = case.args
    if case.contract == "hadamard_transform":
        args = (args[0].float(),) + args[1:]  # the float32 truth a bf16 output is rounded from
    if case.contract in FLOAT64_TRUTH:
        out = fn(*_float64_inputs(case.contract, args), **case.kwargs)
        return tuple(t.float() for t in out)
    out = fn(*args, **case.kwargs)
    return out if isinstance(out, tuple) else (out,)


def make_case(contract: str, which: str | int, *, seed: int = 0, shapes: str | dict = "small",
              **kernel_options) -> Case:
    """Edge case ``which`` (a name) or random case number ``which`` (an int) of ``check_kernel``'s
    run with ``seed`` and ``shapes``; the same inputs as that run."""
    if isinstance(which, str):
        # An edge case's sizes depend on its name only (the same at every seed), its values on
        # the seed; different edges draw different head counts and scales.
        pick = _RandomPick(_mix(0, contract, which, "sizes"))
        data_seed, edge, name = _mix(seed, contract, which), which, which
    else:
        case_seed = _mix(seed, contract, "random", which)
        pick, data_seed, edge, name = _RandomPick(case_seed), case_seed, None, f"random #{which}"
    case = build_case(contract, pick, data_seed, shapes, edge, name, kernel_options)
    options = "".join(f", {k}={v!r}" for k, v in kernel_options.items())
    case.repro = (f"glm_dsa.testing.make_case({contract!r}, {which!r}, seed={seed}, "
                  f"shapes={shapes!r}{options})")
    return case
