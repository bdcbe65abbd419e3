"""Golden vectors: oracle inputs and outputs on disk, and the comparison of a kernel's outputs.

``write_golden(dir, seed)`` (``glm-dsa golden``) writes one safetensors file per contract of
``glm_dsa.oracle`` and a ``manifest.json``. Every tensor is named
``<contract>.<case>.<name>``: the upstream argument names for inputs (``q``, ``kv_cache``,
``indices`` …), the output names for expected outputs (``logits``, ``out``, ``lse`` …) and
``<output>_mask`` for the valid region of a logits output. Cases cover GLM-5.3 and
DeepSeek-V3.2 head counts (32 / 64 index heads, 64 / 128 MLA heads), a cached prefix, rows
shorter than top-k, lengths that are not a multiple of 64, invalid indices and rows with none
valid. The manifest names, per expected output, the metric and tolerance it is checked with.

``compare(dir, candidate)`` (``glm-dsa compare``) checks a kernel's outputs, stored under the
same names, with the upstream metric of each tensor (``glm_dsa.testing.metrics``, shared with
``check_kernel``), after masking what the contract leaves unspecified:

* ``bitwise``: byte formats and quantized values, element by element.
* ``calc_diff``: DeepGEMM's metric inside the valid region (``< 5e-6`` against this
  dequantized-input reference, ``< 3e-5`` for bf16 logits); the candidate must be finite
  there and, for cleaned logits, exactly ``-inf`` outside; uncleaned entries outside are ignored.
* ``allclose``: FlashMLA's ``check_is_allclose`` (abs / rel per element, ±inf/NaN positions,
  cos_diff) with FlashMLA's tolerances.
* ``topk_set``: per row, the selected columns as a set, pads counted; a candidate may swap
  columns of equal score (kernels break ties arbitrarily), nothing else.
* ``index_set``: per row, the same multiset of indices (order free).

Files are deterministic: CPU generators seeded from ``seed`` and the case name, sorted
manifest keys, one fixed metadata entry per file; regenerating with the same seed, torch
version and CPU gives identical bytes.
"""

from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.config import get_config
from glm_dsa.outputs import replace_dir
from glm_dsa.testing.cases import block_table, ragged_rows, relative_indices
from glm_dsa.testing.metrics import (
    CALC_DIFF_MAX,
    CALC_DIFF_MAX_BF16,
    DECODE_LSE_TOL,
    DECODE_OUT_TOL,
    HADAMARD_TOL,
    SPARSE_OUT_TOL,
    SPARSE_STAT_TOL,
    check_tensor,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "Case",
    "build_cases",
    "write_golden",
    "load_golden",
    "TensorCheck",
    "CompareReport",
    "compare",
    "check_outputs",
    "format_report",
]

FORMAT = "glm-dsa-golden/1"
MANIFEST = "manifest.json"

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1

_GLM = get_config("glm-5.3")
_DSV32 = get_config("deepseek-v3.2")
_INDEX_DIM = _GLM.index_head_dim  # 128 in both models
_PAGE = _GLM.page_size  # 64


@dataclass
class Case:
    """One call of an oracle function with its expected outputs.

    Attributes:
        contract: the oracle function (and upstream kernel) name.
        case: short name of the shapes and conventions, unique within the contract.
        description: what the case exercises.
        call: the call, written with the stored tensor names.
        args: the non-tensor arguments (JSON scalars).
        inputs: tensor arguments by upstream name.
        outputs: expected outputs by name.
        checks: per output, the metric spec; tensor references are local names.
        aux: extra tensors the checks reference (valid-region masks).
    """

    contract: str
    case: str
    description: str
    call: str
    args: dict
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    checks: dict[str, dict]
    aux: dict[str, Tensor] = field(default_factory=dict)


def _generator(seed: int, contract: str, case: str) -> torch.Generator:
    """A CPU generator per case, so cases can be added without changing the others' data."""
    mixed = (seed * 0x9E3779B97F4A7C15 + zlib.crc32(f"{contract}.{case}".encode())) % 2**63
    return torch.Generator().manual_seed(mixed)


def _randn(g: torch.Generator, *shape: int, dtype: torch.dtype = torch.float32) -> Tensor:
    return torch.randn(*shape, generator=g).to(dtype)


def _i32(values) -> Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ----------------------------------------------------------------------------- cases
def _hadamard_cases(seed: int) -> list[Case]:
    cases = []
    for name, shape, scale, what in (
        ("glm", (4, _GLM.index_n_heads, _INDEX_DIM), _INDEX_DIM**-0.5,
         "GLM-5.3 indexer q: 4 tokens × 32 heads × 128, orthonormal scale 128**-0.5"),
        ("dsv32", (2, _DSV32.index_n_heads, _INDEX_DIM), _INDEX_DIM**-0.5,
         "DeepSeek-V3.2 indexer q: 2 tokens × 64 heads × 128, orthonormal scale"),
        ("pad", (6, 80), 1.0,
         "dim 80 (not a power of two): zero-padded to 128, transformed, truncated; scale 1"),
    ):
        g = _generator(seed, "hadamard_transform", name)
        x = _randn(g, *shape, dtype=torch.bfloat16)
        cases.append(Case(
            "hadamard_transform", name, what + "; expected is the float32 result",
            "hadamard_transform(x, scale)", {"scale": scale}, {"x": x},
            {"out": oracle.hadamard_transform(x.float(), scale)},
            {"out": {"metric": "allclose", **HADAMARD_TOL,
                     "why": "one bf16 rounding of the float32 transform (plus one ulp)"}},
        ))
    return cases


def _act_quant_cases(seed: int) -> list[Case]:
    cases = []
    g = _generator(seed, "act_quant", "glm_q_ue8m0")
    x = (_randn(g, 6, _GLM.index_n_heads, _INDEX_DIM) * 3).to(torch.bfloat16)
    cases.append(("glm_q_ue8m0", x, "ue8m0",
                  "GLM-5.3 indexer q (6 tokens × 32 heads), one power-of-two scale per head"))
    g = _generator(seed, "act_quant", "dsv32_k_fp32_scale")
    x = _randn(g, 70, _INDEX_DIM)
    x[3] = 0.0  # amax floor 1e-4
    x[5] *= 1e-6  # below the floor too
    cases.append(("dsv32_k_fp32_scale", x.to(torch.bfloat16), None,
                  "70 index keys, raw float32 scales amax/448; an all-zero and a tiny key hit "
                  "the 1e-4 amax floor"))
    out = []
    for name, x, fmt, what in cases:
        x_fp8, scale = oracle.act_quant(x, 128, fmt)
        why = "quantized values and scales are exact functions of the input"
        out.append(Case(
            "act_quant", name, what, "act_quant(x, block_size, scale_fmt)",
            {"block_size": 128, "scale_fmt": fmt}, {"x": x},
            {"x_fp8": x_fp8, "scale": scale},
            {"x_fp8": {"metric": "bitwise", "why": why}, "scale": {"metric": "bitwise", "why": why}},
        ))
    return out


def _kv_cache_cast_cases(seed: int) -> list[Case]:
    g = _generator(seed, "kv_cache_cast_to_fp8", "glm")
    k = _randn(g, 3, _PAGE, 1, _INDEX_DIM)
    k[1, 7] = 0.0
    k = k.to(torch.bfloat16)
    return [Case(
        "kv_cache_cast_to_fp8", "glm",
        "3 blocks × 64 index keys into DeepGEMM's [num_blocks, 64, 1, 132] cache; one zero key",
        "kv_cache_cast_to_fp8(k)", {}, {"k": k}, {"kv_cache": oracle.kv_cache_cast_to_fp8(k)},
        {"kv_cache": {"metric": "bitwise",
                      "why": "byte format; DeepGEMM's helper as run on CUDA: "
                             "sf = amax * fl32(1/448), payload x * fl32(1/sf) rounded to e4m3"}},
    )]


def _logits_check(clean: bool) -> dict:
    return {
        "metric": "calc_diff", "max": CALC_DIFF_MAX, "max_bf16": CALC_DIFF_MAX_BF16,
        "mask": "logits_mask",
        "outside_mask": "-inf" if clean else "unspecified",
        "why": "DeepGEMM: calc_diff < 5e-6 against the reference on dequantized inputs, "
               "-inf mask exact when cleaned; uncleaned entries outside the mask are ignored",
    }


def _mqa_logits_cases(seed: int) -> list[Case]:
    cases = []
    for name, heads, requests, clean, compressed, what in (
        ("glm", _GLM.index_n_heads, [(70, 21), (0, 13)], True, False,
         "32 heads; request 0 has a 70-token prefix, request 1 none; rows of 1…91 keys"),
        ("dsv32", _DSV32.index_n_heads, [(100, 11)], True, False,
         "64 heads; one request, 100-token prefix, 11 rows"),
        ("glm_uncleaned", _GLM.index_n_heads, [(20, 9), (0, 5)], False, False,
         "clean_logits=False: entries outside [ks, ke) are unspecified and not compared"),
        ("glm_compressed", _GLM.index_n_heads, [(50, 12), (0, 7)], False, True,
         "compressed logits: max_seqlen_k = max(ke - ks), out[i, j] is key ks[i] + j"),
    ):
        g = _generator(seed, "fp8_mqa_logits", name)
        ks, ke, s_kv = ragged_rows(requests)
        s = ks.shape[0]
        q = _randn(g, s, heads, _INDEX_DIM).to(torch.float8_e4m3fn)
        kv_fp8, kv_scale = oracle.act_quant(_randn(g, s_kv, _INDEX_DIM, dtype=torch.bfloat16), 128)
        kv_scale = kv_scale[:, 0]
        weights = _randn(g, s, heads)
        max_seqlen_k = int((ke - ks).max()) if compressed else 0
        call = lambda clean_logits: oracle.fp8_mqa_logits(  # noqa: E731
            q, (kv_fp8, kv_scale), weights, ks, ke, clean_logits, max_seqlen_k
        )
        logits = call(clean)
        # The valid region is where the cleaned (or compressed) output is finite.
        mask = torch.isfinite(logits if compressed else call(True))
        cases.append(Case(
            "fp8_mqa_logits", name, what,
            "fp8_mqa_logits(q, (kv_fp8, kv_scale), weights, cu_seqlen_ks, cu_seqlen_ke, "
            "clean_logits, max_seqlen_k)",
            {"clean_logits": clean, "max_seqlen_k": max_seqlen_k},
            {"q": q, "kv_fp8": kv_fp8, "kv_scale": kv_scale, "weights": weights,
             "cu_seqlen_ks": ks, "cu_seqlen_ke": ke},
            {"logits": logits}, {"logits": _logits_check(clean)}, {"logits_mask": mask},
        ))
    return cases


def _paged_logits_cases(seed: int) -> list[Case]:
    cases = []
    for name, heads, next_n, lens, max_len, clean, what in (
        ("glm_1d", _GLM.index_n_heads, 1, [1, 70, 130], 192, True,
         "32 heads, next_n=1, context lengths 1, 70, 130 over shuffled 64-token blocks"),
        ("glm_mtp_1d", _GLM.index_n_heads, 2, [64, 100], 128, True,
         "32 heads, next_n=2 (MTP): row (b, j) sees positions ≤ ctx_b - 2 + j"),
        ("dsv32_2d", _DSV32.index_n_heads, 2, [[65, 66], [100, 129]], 192, False,
         "64 heads, 2-D context_lens [B, next_n] (row sees positions < ctx[b, j]), uncleaned "
         "as the newest DeepGEMM requires"),
    ):
        g = _generator(seed, "fp8_paged_mqa_logits", name)
        batch = len(lens)
        longest = [max(n) if isinstance(n, list) else n for n in lens]
        blocks = [-(-n // _PAGE) for n in longest]
        num_blocks = sum(blocks) + 3  # spare blocks hold keys no row may see
        kv_cache = oracle.kv_cache_cast_to_fp8(
            _randn(g, num_blocks, _PAGE, 1, _INDEX_DIM, dtype=torch.bfloat16)
        )
        table = block_table(g, blocks, num_blocks)
        q = _randn(g, batch, next_n, heads, _INDEX_DIM).to(torch.float8_e4m3fn)
        weights = _randn(g, batch * next_n, heads)
        context_lens = _i32(lens)
        call = lambda clean_logits: oracle.fp8_paged_mqa_logits(  # noqa: E731
            q, kv_cache, weights, context_lens, table, max_len, clean_logits
        )
        logits = call(clean)
        cases.append(Case(
            "fp8_paged_mqa_logits", name, what,
            "fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, "
            "max_context_len, clean_logits)",
            {"max_context_len": max_len, "clean_logits": clean},
            {"q": q, "kv_cache": kv_cache, "weights": weights, "context_lens": context_lens,
             "block_table": table},
            {"logits": logits}, {"logits": _logits_check(clean)},
            {"logits_mask": torch.isfinite(call(True))},
        ))
    return cases


def _topk_inputs(g: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Eight [300]-column rows covering long rows, ties, short and empty rows, garbage outside."""
    n = 300
    logits = _randn(g, 8, n)
    # Eight levels: the 64th best value is tied with many unselected columns.
    logits[1] = torch.randint(0, 8, (n,), generator=g).float() / 2
    logits[7] = 0.25  # every column tied
    ranges = [(0, 300), (0, 300), (37, 237), (0, 40), (100, 164), (10, 75), (5, 5), (0, 300)]
    starts, ends = _i32([s for s, _ in ranges]), _i32([e for _, e in ranges])
    col = torch.arange(n)
    outside = (col[None, :] < starts[:, None]) | (col[None, :] >= ends[:, None])
    # Uncleaned logits: huge values and NaN outside the range must never be selected or read.
    garbage = torch.where(col % 2 == 0, torch.tensor(1e30), torch.tensor(float("nan")))
    logits = torch.where(outside, garbage.expand(8, n), logits)
    return logits, starts, ends


def _topk_cases(seed: int) -> list[Case]:
    cases = []
    topk = 64
    for name, base, pad, what in (
        ("sglang", "relative", -1,
         "SGLang fast_topk_v2 / vLLM top_k_per_row convention: relative to row_start, -1 pad"),
        ("tilelang", "absolute", 0, "TileLang tl_topk convention: column indices, 0 pad"),
    ):
        g = _generator(seed, "topk_per_row", name)
        logits, starts, ends = _topk_inputs(g)
        indices = oracle.topk_per_row(logits, starts, ends, topk, base, pad)
        cases.append(Case(
            "topk_per_row", name,
            what + "; rows: long, eight-level ties, offset range with NaN / 1e30 outside, "
            "40 keys, exactly 64, 65, empty, all tied",
            "topk_per_row(logits, row_starts, row_ends, topk, base, pad)",
            {"topk": topk, "base": base, "pad": pad},
            {"logits": logits, "row_starts": starts, "row_ends": ends},
            {"indices": indices},
            {"indices": {"metric": "topk_set", "scores": "logits", "row_starts": "row_starts",
                         "row_ends": "row_ends", "base": base, "pad": pad,
                         "why": "kernels order freely and break ties arbitrarily: compare per "
                                "row as sets, columns of equal score interchangeable"}},
        ))
    return cases


def _index_set_check(why: str) -> dict:
    return {"metric": "index_set", "why": why}


def _transform_cases(seed: int) -> list[Case]:
    g = _generator(seed, "topk_transform_ragged", "sglang")
    lens = [70, 70, 3, 120, 1, 33]
    indices = relative_indices(g, lens, 16)
    offsets = _i32([0, 0, 0, 70, 190, 190])
    cases = [Case(
        "topk_transform_ragged", "sglang",
        "request-relative top-k → rows of the concatenated prefill KV (three requests)",
        "topk_transform_ragged(indices, offsets)", {},
        {"indices": indices, "offsets": offsets},
        {"indices_out": oracle.topk_transform_ragged(indices, offsets)},
        {"indices_out": _index_set_check("elementwise transform, -1 kept; order free")},
    )]
    for name, page_size, what in (
        ("vllm", _PAGE, "vLLM / FlashMLA: page_table[r, i // 64] * 64 + i % 64"),
        ("sglang_page1", 1, "SGLang page_table_1: a token-level table (page_size=1)"),
    ):
        g = _generator(seed, "topk_transform_paged", name)
        lens = [150, 70, 10, 130]
        pages_per_row = -(-max(lens) // page_size)
        pool = torch.randperm(len(lens) * pages_per_row + 5, generator=g)
        page_table = pool[: len(lens) * pages_per_row].view(len(lens), pages_per_row)
        page_table = page_table.to(torch.int32)
        indices = relative_indices(g, lens, 16)
        cases.append(Case(
            "topk_transform_paged", name, what + "; -1 kept",
            "topk_transform_paged(indices, page_table, page_size)", {"page_size": page_size},
            {"indices": indices, "page_table": page_table},
            {"indices_out": oracle.topk_transform_paged(indices, page_table, page_size)},
            {"indices_out": _index_set_check("elementwise transform, -1 kept; order free")},
        ))
    return cases


def _latent(g: torch.Generator, num_blocks: int) -> Tensor:
    """bf16 [num_blocks, 64, 1, 576] latent rows of varied magnitude, one all-zero token."""
    kv = _randn(g, num_blocks, _PAGE, 1, oracle.MLA_DIM)
    kv *= torch.exp(_randn(g, num_blocks, _PAGE, 1, 1))  # per-token magnitudes over ~e^±3
    kv[0, 5] = 0.0
    return kv.to(torch.bfloat16)


def _mla_cache_cases(seed: int) -> list[Case]:
    g = _generator(seed, "quantize_k_cache", "glm")
    kv = _latent(g, 2)
    cases = [Case(
        "quantize_k_cache", "glm",
        "2 blocks × 64 latent rows into FlashMLA's 656-byte V32_FP8Sparse layout, ue8m0 tile "
        "scales (newest FlashMLA); one all-zero token hits the 1e-4 scale floor",
        "quantize_k_cache(kv, scale_fmt)", {"scale_fmt": "ue8m0"}, {"kv": kv},
        {"k_cache": oracle.quantize_k_cache(kv, "ue8m0")},
        {"k_cache": {"metric": "bitwise", "why": "byte format"}},
    )]
    for name, fmt, what in (
        ("glm", "ue8m0", "ue8m0 scales: every dequantized value is exact in bf16"),
        ("raw_scales", None, "raw amax/448 scales (Sep 2025): e4m3 × scale rounded to bf16"),
    ):
        g = _generator(seed, "dequantize_k_cache", name)
        k_cache = oracle.quantize_k_cache(_latent(g, 1), fmt)
        cases.append(Case(
            "dequantize_k_cache", name, what, "dequantize_k_cache(k_cache)", {},
            {"k_cache": k_cache}, {"kv": oracle.dequantize_k_cache(k_cache)},
            {"kv": {"metric": "bitwise", "why": "one rounding of an exact product"}},
        ))
    return cases


def _sparse_indices(g: torch.Generator, s_q: int, s_kv: int, topk: int) -> Tensor:
    """int32 [s_q, 1, topk] distinct valid rows; row 0 carries every kind of invalid index,
    row 1 (if any) has none valid (a lonely row), row 2 (if any) is half invalid."""
    rows = torch.stack([torch.randperm(s_kv, generator=g)[:topk] for _ in range(s_q)])
    invalid = [INT32_MIN, -123456, -1, s_kv, s_kv + 55, INT32_MAX]
    rows[0, 3 : 3 + len(invalid)] = torch.tensor(invalid)
    if s_q > 1:
        rows[1] = -1
    if s_q > 2:
        rows[2, ::2] = s_kv
    return rows.to(torch.int32).unsqueeze(1)


def _sparse_fwd_checks() -> dict:
    why = "FlashMLA test_flash_mla_sparse_prefill / kernelkit check_is_allclose"
    return {
        "out": {"metric": "allclose", **SPARSE_OUT_TOL, "why": why},
        "max_logits": {"metric": "allclose", **SPARSE_STAT_TOL, "why": why},
        "lse": {"metric": "allclose", **SPARSE_STAT_TOL, "why": why},
    }


def _sparse_fwd_cases(seed: int) -> list[Case]:
    cases = []
    for name, cfg, s_q, s_kv, sink, lengths, conv, what in (
        ("glm", _GLM, 3, 150, False, None, ("e", "+inf"),
         "64 heads, s_kv=150, topk=128; row 0: INT_MIN, -123456, -1, s_kv, s_kv+55, INT_MAX; "
         "row 1 lonely (lse +inf, max_logits -inf, out 0); row 2 half invalid"),
        ("glm_sink_topk_length", _GLM, 2, 150, True, [70, 0], ("e", "+inf"),
         "64 heads, attn_sink and topk_length (70, 0: the second row is lonely)"),
        ("dsv32", _DSV32, 1, 130, False, None, ("e", "+inf"),
         "128 heads, DeepSeek-V3.2 softmax scale (YaRN mscale²), s_kv=130, invalid indices"),
        ("glm_sep2025", _GLM, 2, 130, False, None, ("2", "-inf"),
         "the September-2025 kernel: base-2 max_logits and lse, lonely lse -inf"),
    ):
        g = _generator(seed, "flash_mla_sparse_fwd", name)
        heads, topk = cfg.num_attention_heads, 128
        q = _randn(g, s_q, heads, oracle.MLA_DIM, dtype=torch.bfloat16)
        kv = _randn(g, s_kv, 1, oracle.MLA_DIM, dtype=torch.bfloat16)
        indices = _sparse_indices(g, s_q, s_kv, topk)
        inputs = {"q": q, "kv": kv, "indices": indices}
        attn_sink = _randn(g, heads) if sink else None
        topk_length = _i32(lengths) if lengths is not None else None
        if attn_sink is not None:
            inputs["attn_sink"] = attn_sink
        if topk_length is not None:
            inputs["topk_length"] = topk_length
        out, max_logits, lse = oracle.flash_mla_sparse_fwd(
            q, kv, indices, cfg.softmax_scale, 512, attn_sink, topk_length, *conv
        )
        cases.append(Case(
            "flash_mla_sparse_fwd", name, what,
            "flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, "
            "lse_base, lonely_lse)",
            {"sm_scale": cfg.softmax_scale, "d_v": 512, "lse_base": conv[0], "lonely_lse": conv[1]},
            inputs, {"out": out, "max_logits": max_logits, "lse": lse}, _sparse_fwd_checks(),
        ))
    return cases


def _sparse_decode_cases(seed: int) -> list[Case]:
    cases = []
    why = "FlashMLA test_flash_mla_sparse_decoding / kernelkit check_is_allclose"
    for name, cfg, b, s_q, sink, lengths, what in (
        ("glm", _GLM, 2, 1, False, None,
         "64 heads, 3 blocks of 64 slots, topk=64 physical slots with -1 padding; entry (1, 0) "
         "has none valid (out 0, lse +inf)"),
        ("dsv32_sink_topk_length", _DSV32, 2, 1, True, [64, 20],
         "128 heads, attn_sink, topk_length (64, 20): valid slots past the length are not read"),
    ):
        g = _generator(seed, "flash_mla_sparse_decode", name)
        heads, topk, num_blocks = cfg.num_attention_heads, 64, 3
        k_cache = oracle.quantize_k_cache(_latent(g, num_blocks))
        q = _randn(g, b, s_q, heads, oracle.MLA_DIM, dtype=torch.bfloat16)
        slots = torch.stack([
            torch.randperm(num_blocks * _PAGE, generator=g)[:topk] for _ in range(b * s_q)
        ]).view(b, s_q, topk)
        if lengths is None:
            slots[0, 0, 50:] = -1
            slots[1, 0] = -1
        indices = slots.to(torch.int32)
        inputs = {"q": q, "k_cache": k_cache, "indices": indices}
        attn_sink = _randn(g, heads) if sink else None
        topk_length = _i32(lengths) if lengths is not None else None
        if topk_length is not None:
            inputs["topk_length"] = topk_length
        if attn_sink is not None:
            inputs["attn_sink"] = attn_sink
        out, lse = oracle.flash_mla_sparse_decode(
            q, k_cache, indices, cfg.softmax_scale, 512, topk_length, attn_sink
        )
        cases.append(Case(
            "flash_mla_sparse_decode", name, what,
            "flash_mla_sparse_decode(q, k_cache, indices, sm_scale, d_v, topk_length, attn_sink)",
            {"sm_scale": cfg.softmax_scale, "d_v": 512}, inputs, {"out": out, "lse": lse},
            {"out": {"metric": "allclose", **DECODE_OUT_TOL, "why": why},
             "lse": {"metric": "allclose", **DECODE_LSE_TOL, "why": why}},
        ))
    return cases


_BUILDERS: tuple[Callable[[int], list[Case]], ...] = (
    _hadamard_cases,
    _act_quant_cases,
    _kv_cache_cast_cases,
    _mqa_logits_cases,
    _paged_logits_cases,
    _topk_cases,
    _transform_cases,
    _mla_cache_cases,
    _sparse_fwd_cases,
    _sparse_decode_cases,
)


def build_cases(seed: int = 0) -> list[Case]:
    """Every golden case, computed by ``glm_dsa.oracle`` from inputs drawn with ``seed``."""
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed={seed!r} must be a non-negative int")
    return [case for build in _BUILDERS for case in build(seed)]


# ----------------------------------------------------------------------------- files
def _full(case: Case, name: str) -> str:
    return f"{case.contract}.{case.case}.{name}"


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _describe(t: Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _resolve(case: Case, spec: dict) -> dict:
    """The spec with its tensor references made full names."""
    out = dict(spec)
    for key in ("mask", "scores", "row_starts", "row_ends"):
        if key in out:
            out[key] = _full(case, out[key])
    return out


def write_golden(out_dir: str | os.PathLike, seed: int = 0) -> dict:
    """Write ``<contract>.safetensors`` per contract and ``manifest.json`` as the directory
    ``out_dir``, written beside it and swapped in whole (``glm_dsa.outputs.replace_dir``): an
    interrupted write leaves an existing golden directory as it was.

    Returns the manifest (also written).
    """
    return replace_dir(os.fspath(out_dir), lambda tmp: _write_golden_into(tmp, seed))


def _write_golden_into(out_dir: str, seed: int) -> dict:
    cases = build_cases(seed)
    by_contract: dict[str, list[Case]] = {}
    for case in cases:
        by_contract.setdefault(case.contract, []).append(case)

    files, entries = {}, []
    for contract, group in by_contract.items():
        tensors = {}
        for case in group:
            for kind in (case.inputs, case.outputs, case.aux):
                for name, t in kind.items():
                    tensors[_full(case, name)] = t.contiguous()
            entries.append({
                "contract": case.contract,
                "case": case.case,
                "file": f"{contract}.safetensors",
                "description": case.description,
                "call": case.call,
                "args": case.args,
                "inputs": {_full(case, n): _describe(t) for n, t in case.inputs.items()},
                "outputs": {
                    _full(case, n): {**_describe(t), **_resolve(case, case.checks[n])}
                    for n, t in case.outputs.items()
                },
                "aux": {_full(case, n): _describe(t) for n, t in case.aux.items()},
            })
        path = os.path.join(out_dir, f"{contract}.safetensors")
        # A single metadata entry: safetensors does not order several deterministically.
        save_file(tensors, path, metadata={"glm_dsa_golden": f"{FORMAT} {contract} seed={seed}"})
        files[f"{contract}.safetensors"] = {
            "sha256": _sha256(path), "bytes": os.path.getsize(path), "contract": contract
        }
    manifest = {
        "format": FORMAT,
        "seed": seed,
        "torch": torch.__version__,
        "files": files,
        "cases": entries,
    }
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return manifest


def load_golden(golden_dir: str | os.PathLike) -> tuple[dict, dict[str, Tensor]]:
    """Read ``manifest.json`` and every golden tensor, checking each file's sha256."""
    golden_dir = os.fspath(golden_dir)
    path = os.path.join(golden_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found; write golden vectors with: glm-dsa golden --out {golden_dir}")
    with open(path) as f:
        manifest = json.load(f)
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}")
    tensors: dict[str, Tensor] = {}
    for name, info in sorted(manifest["files"].items()):
        file_path = os.path.join(golden_dir, name)
        if not os.path.isfile(file_path) or _sha256(file_path) != info["sha256"]:
            raise ValueError(
                f"{file_path} is missing or differs from the manifest's sha256; regenerate the "
                f"golden directory with: glm-dsa golden --out {golden_dir} --seed {manifest['seed']}"
            )
        tensors.update(load_file(file_path))
    return manifest, tensors


# ----------------------------------------------------------------------------- compare
@dataclass(frozen=True)
class TensorCheck:
    """The verdict on one candidate tensor.

    Attributes:
        name: the golden output name (``<contract>.<case>.<output>``).
        metric: ``bitwise``, ``calc_diff``, ``allclose``, ``topk_set`` or ``index_set``.
        passed: the verdict.
        value: the metric's value: differing elements (bitwise), calc_diff, cos_diff
            (allclose), differing rows (topk_set, index_set); NaN when the check stopped
            before computing it.
        detail: one line saying what was compared and, on failure, where it first fails.
    """

    name: str
    metric: str
    passed: bool
    value: float
    detail: str


@dataclass(frozen=True)
class CompareReport:
    """All checks of one candidate, and the golden outputs it did not provide."""

    checks: tuple[TensorCheck, ...]
    not_in_candidate: tuple[str, ...]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


def _check(name: str, spec: dict, cand: Tensor, golden: Mapping[str, Tensor]) -> TensorCheck:
    verdict = check_tensor(spec, cand, golden[name], golden.__getitem__)
    return TensorCheck(name, spec["metric"], bool(verdict.passed), float(verdict.value),
                       verdict.detail)


def compare(golden_dir: str | os.PathLike, candidate: Mapping[str, Tensor]) -> CompareReport:
    """Check every candidate tensor against the golden output of the same name.

    ``candidate`` holds a kernel's outputs named like the golden outputs
    (``fp8_mqa_logits.glm.logits``); any subset of them. A name that is not a golden output is
    a ValueError (a typo would otherwise pass silently).
    """
    manifest, golden = load_golden(golden_dir)
    return check_outputs(manifest, golden, candidate)


def check_outputs(
    manifest: dict, golden: Mapping[str, Tensor], candidate: Mapping[str, Tensor]
) -> CompareReport:
    """``compare`` on an already loaded golden set (``load_golden``)."""
    specs = {name: spec for case in manifest["cases"] for name, spec in case["outputs"].items()}
    unknown = sorted(set(candidate) - set(specs))
    if unknown:
        raise ValueError(
            f"candidate tensors {unknown[:5]} are not golden outputs; name them "
            f"<contract>.<case>.<output> as in the golden {MANIFEST}, e.g. {min(specs)}"
        )
    if not candidate:
        raise ValueError("the candidate holds no tensors")
    checks = tuple(
        _check(name, specs[name], candidate[name], golden) for name in sorted(candidate)
    )
    missing = tuple(sorted(set(specs) - set(candidate)))
    return CompareReport(checks, missing)


def format_report(report: CompareReport) -> str:
    """One line per checked tensor (PASS / FAIL, name, metric detail) and a summary line."""
    width = max(len(c.name) for c in report.checks)
    lines = [
        f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.metric}: {c.detail}"
        for c in report.checks
    ]
    failed = sum(not c.passed for c in report.checks)
    lines.append(
        f"{len(report.checks)} checked: {len(report.checks) - failed} passed, {failed} failed; "
        f"{len(report.not_in_candidate)} golden outputs not in the candidate"
    )
    return "\n".join(lines)
