"""The cost ledger against the design article's figures and against explicit loops.

Article figures are quoted with the table or sentence they come from and re-derived here from
the GLM-5.3 dimensions (docs/conventions.md §1), never read back from the ledger. Where the article's
printed figure differs from its own formula, the test pins the formula and says why (the full
list is in docs/ledger.md).
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm_dsa.batch import CP_SPLITS
from glm_dsa.config import PRESETS, get_config
from glm_dsa.ledger import (
    GpuSpec,
    build_ledger,
    cache_bytes_written,
    chunk_plan,
    cp_comm_bytes_per_chunk,
    cp_indexer_pairs_per_rank,
    cp_mean_prefix_article,
    cp_rank_positions,
    index_k_reread_bytes,
    index_k_row_bytes,
    indexer_pairs,
    layer_flops_per_token,
    logits_budget_bytes_static,
    logits_row_slices,
    main_kv_page_bytes,
    main_kv_row_bytes,
    op_flops,
    param_counts,
    sparse_mla_keys,
    ttft_floor,
)

GLM = get_config("glm-5.3")
L_1M = 1_048_576  # the article's "1M" (max_position_embeddings)
B_32K = 32_768
# GLM-5.3 dimensions written out once (docs/conventions.md §1), so expectations do not read the config.
HID, HEADS, QLORA, KVLORA, NOPE, ROPE, V = 6144, 64, 2048, 512, 192, 64, 256
IDX_H, IDX_D, TOPK, E, TOPK_E, MOE_I, DENSE_I = 32, 128, 2048, 256, 8, 2048, 12288
LAYERS, FULL, MOE_LAYERS, DENSE_LAYERS = 78, 21, 75, 3
FP8_ROW = KVLORA + 4 * (KVLORA // 128) + 2 * ROPE  # article: 512 + 16 + 128 = 656
IDX_ROW = IDX_D + 4  # article: 128 B FP8 + 4 B scale = 132


@pytest.fixture(scope="module")
def ledger_1m():
    return build_ledger(GLM, tokens=L_1M, chunk=B_32K)


def rounds_to(x: float, article: float, unit: float, digits: int) -> bool:
    """The article prints ``article`` for ``x`` rounded to ``digits`` decimals of ``unit``."""
    return round(x / unit, digits) == article


# ------------------------------------------------------------------ layers and KV bytes
def test_glm53_has_21_full_and_57_shared_indexer_layers(ledger_1m):
    # Article, 先把模型常量摆出来: "到第 77 层一共 21 个 full、57 个 shared".
    full = [i for i in range(78) if max(i - 3 + 1, 0) % 4 == 0]
    assert len(full) == 21
    assert ledger_1m["model"]["full_layers"] == len(full)
    assert ledger_1m["model"]["shared_layers"] == 78 - len(full)
    assert ledger_1m["model"]["moe_layers"] == MOE_LAYERS


def test_kv_row_bytes_match_the_article_656_and_132():
    # Article, KV 写入: "每 token 每层 656 字节(512 + 128 + 16)"; index K "132 字节".
    assert FP8_ROW == 656 and IDX_ROW == 132
    assert main_kv_row_bytes(GLM, "fp8") == FP8_ROW
    assert main_kv_row_bytes(GLM, "bf16") == 2 * (KVLORA + ROPE) == 1152
    assert index_k_row_bytes(GLM) == IDX_ROW


def test_kv_per_token_and_at_1m_match_the_article_56_6_gb(ledger_1m):
    # Article: "1,048,576×(78×656+21×132)≈1,048,576×53,940≈56.6 GB,其中主 KV 53.7GB,索引 K 2.9GB".
    kv = ledger_1m["kv"]
    assert kv["bytes_per_token"] == LAYERS * 656 + FULL * 132 == 53_940
    assert kv["total_bytes"] == L_1M * 53_940
    assert rounds_to(kv["total_bytes"], 56.6, 1e9, 1)
    assert kv["main_bytes"] == L_1M * LAYERS * 656 and rounds_to(kv["main_bytes"], 53.7, 1e9, 1)
    assert kv["index_bytes"] == L_1M * FULL * 132 and rounds_to(kv["index_bytes"], 2.9, 1e9, 1)


def test_page_sizes_pages_per_chunk_and_bytes_written_per_chunk(ledger_1m):
    # Article, 页布局与写放大: "64×656=41,984 字节", "64×132=8,448 字节", "一个 32768 的 chunk
    # 对应 512 页", "78 层 × 512 页 × 41KB ≈ 1.68GB/chunk", "21 × 512 × 8.25KB ≈ 91MB/chunk".
    assert main_kv_page_bytes(GLM) == 64 * 656 == 41_984
    kv = ledger_1m["kv"]
    assert kv["index_page_bytes"] == 64 * 132 == 8_448
    assert kv["pages_per_chunk"] == B_32K // 64 == 512
    assert kv["written_per_chunk"]["main_kv"] == 78 * 512 * 41_984
    assert rounds_to(kv["written_per_chunk"]["main_kv"], 1.68, 1e9, 2)
    assert kv["written_per_chunk"]["index_k"] == 21 * 512 * 8_448
    assert rounds_to(kv["written_per_chunk"]["index_k"], 91, 1e6, 0)


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_cache_bytes_written_matches_byte_assembled_rows(name, kv_dtype):
    """Assemble one token's cache rows with struct and count their bytes."""
    c = PRESETS[name]
    if kv_dtype == "fp8":
        tiles = c.kv_lora_rank // 128
        row = (struct.pack(f"<{c.kv_lora_rank}b", *([0] * c.kv_lora_rank))
               + struct.pack(f"<{tiles}f", *([1.0] * tiles))
               + struct.pack(f"<{c.qk_rope_head_dim}e", *([0.0] * c.qk_rope_head_dim)))
    else:  # bf16 has the size of float16
        row = struct.pack(f"<{c.kv_latent_dim}e", *([0.0] * c.kv_latent_dim))
    idx_row = struct.pack(f"<{c.index_head_dim}b", *([0] * c.index_head_dim)) + struct.pack("<f", 1.0)
    n_full = sum(t == "full" for t in c.indexer_types)
    for tokens in (0, 1, 777):
        got = cache_bytes_written(c, tokens, kv_dtype)
        assert got["main_kv"] == tokens * c.num_hidden_layers * len(row)
        assert got["index_k"] == tokens * n_full * len(idx_row)
        assert got["total"] == got["main_kv"] + got["index_k"]


# ------------------------------------------------------------------ FLOPs per op
# Article, 一层 prefill 的算术 (每 token FLOPs, 全模型合计 at "1M token"):
ARTICLE_OPS = {
    # op: (FLOP/token derived from dims, article FLOP/token in M, article total in PFLOP, layers)
    "a_proj": (2 * HID * (QLORA + KVLORA + ROPE), 32.2, 2.5, LAYERS),
    "q_up": (2 * QLORA * HEADS * (NOPE + ROPE), 67.1, 5.2, LAYERS),
    "q_absorb": (2 * HEADS * NOPE * KVLORA, 12.6, 1.0, LAYERS),
    "index_k": (2 * HID * IDX_D, 1.6, 0.03, FULL),
    "index_q": (2 * QLORA * IDX_H * IDX_D, 16.8, 0.35, FULL),
    "index_gate": (2 * HID * IDX_H, 0.4, 0.008, FULL),
    "sparse_mla": (2 * HEADS * (KVLORA + ROPE) * TOPK + 2 * HEADS * KVLORA * TOPK, 285, 22.2, LAYERS),
    "out_absorb": (2 * HEADS * KVLORA * V, 16.8, 1.3, LAYERS),
    "o_proj": (2 * HEADS * V * HID, 201.3, 15.7, LAYERS),
    "moe_experts": (2 * TOPK_E * 3 * HID * MOE_I, 604, 45.3, MOE_LAYERS),
    "shared_experts": (2 * 3 * HID * MOE_I, 75.5, 5.7, MOE_LAYERS),
    "dense_mlp": (2 * 3 * HID * DENSE_I, 453, 1.4, DENSE_LAYERS),
}


def _digits(x: float) -> int:
    return len(repr(x).split(".")[1]) if "." in repr(x) else 0


def test_per_op_flops_per_token_match_the_article_table():
    ops = {o.op: o for o in op_flops(GLM)}
    for name, (expected, article_m, _, _) in ARTICLE_OPS.items():
        assert ops[name].flops_per_token == expected, name
        assert rounds_to(expected, article_m, 1e6, _digits(article_m)), name
    # the router gate (6144 -> 256) is not in the article's table
    assert ops["router_gate"].flops_per_token == 2 * HID * E and not ops["router_gate"].in_article


def test_article_model_totals_are_per_one_million_decimal_tokens():
    """The table's "全模型合计(1M token)" column matches N = 10**6 tokens, not 2**20."""
    led = build_ledger(GLM, tokens=10**6, chunk=B_32K)
    totals = {o["op"]: o for o in led["flops"]["ops"]}
    for name, (per_token, _, article_p, layers) in ARTICLE_OPS.items():
        assert totals[name]["layers"] == layers
        assert totals[name]["total"] == per_token * layers * 10**6
        assert rounds_to(totals[name]["total"], article_p, 1e15, _digits(article_p)), name
    # "全模型 ≈ 100 PFLOP"
    assert round(led["flops"]["model_total_article"] / 1e17) == 1



def test_at_2_pow_20_tokens_the_model_totals_are_5_percent_above_the_article_column(ledger_1m):
    totals = {o["op"]: o["total"] for o in ledger_1m["flops"]["ops"]}
    assert totals["a_proj"] == ARTICLE_OPS["a_proj"][0] * LAYERS * L_1M
    assert round(totals["a_proj"] / 1e15, 1) == 2.6  # the article's column says 2.5 (at 10**6)
    assert round(ledger_1m["flops"]["model_total_article"] / 1e15, 1) == 105.6


def test_full_moe_layer_is_1313m_flops_per_token():
    # Article: "一层 prefill 的算术:1313M FLOPs" and "单层合计(full MoE 层) ≈ 1.31G".
    expected = sum(v[0] for k, v in ARTICLE_OPS.items() if k != "dense_mlp")
    assert expected == 1_313_472_512
    assert layer_flops_per_token(GLM, full=True, moe=True) == expected
    assert layer_flops_per_token(GLM, full=True, moe=True, with_router=True) == expected + 2 * HID * E
    indexer_ops = 2 * HID * IDX_D + 2 * QLORA * IDX_H * IDX_D + 2 * HID * IDX_H
    assert layer_flops_per_token(GLM, full=False, moe=True) == expected - indexer_ops


def test_q_and_output_absorption_sum_to_29_4_tflop_per_layer_at_one_million_tokens():
    # Article: "Q 吸收 2×n×64×192×512 = 2n×6.29M", "输出吸收 2n×8.39M", "对 1M token,两项合计约
    # 29.4 TFLOP". 2n×6.29M is the table's 12.6M per token; 29.4 TFLOP is ONE layer at 10**6.
    assert round(64 * 192 * 512 / 1e6, 2) == 6.29 and round(64 * 512 * 256 / 1e6, 2) == 8.39
    ops = {o.op: o.flops_per_token for o in op_flops(GLM)}
    one_layer = (ops["q_absorb"] + ops["out_absorb"]) * 10**6
    assert round(one_layer / 1e12, 1) == 29.4


@given(start=st.integers(0, 5000), length=st.integers(0, 5000), name=st.sampled_from(sorted(PRESETS)))
def test_sparse_mla_keys_equal_explicit_sum_of_min_topk_and_position(start, length, name):
    c = PRESETS[name]
    expected = sum(min(c.index_topk, i + 1) for i in range(start, start + length))
    assert sparse_mla_keys(c, start, start + length) == expected


# ------------------------------------------------------------------ parameters
def test_parameter_counts_match_the_article():
    # Article: "索引器的参数只有 197M(21 层 × 9.4M)", "每层 9.66B 参数的专家权重", "744B 参数".
    p = param_counts(GLM)
    indexer = QLORA * IDX_H * IDX_D + HID * IDX_D + 2 * IDX_D + HID * IDX_H
    assert p["indexer_per_full_layer"] == indexer and round(indexer / 1e6, 1) == 9.4
    assert p["indexer_total"] == 21 * indexer and round(21 * indexer / 1e6) == 197
    assert p["experts_per_moe_layer"] == 256 * 3 * HID * MOE_I
    assert round(256 * 3 * HID * MOE_I / 1e9, 2) == 9.66
    # 744B in the article; the config (no MTP layer) gives 743.4B
    assert abs(p["total"] / 744e9 - 1) < 0.002
    unused = MOE_LAYERS * (256 - 8) * 3 * HID * MOE_I
    assert p["activated"] == p["total"] - unused


# ------------------------------------------------------------------ indexer
def test_indexer_flops_at_1m_are_94_pflop(ledger_1m):
    # Article: "F_idx = 21 × L²/2 × 8192 ≈ 9.4×10^16 FLOPs, 即约 94 PFLOP".
    ix = ledger_1m["indexer"]
    assert ix["flops_per_pair"] == 2 * IDX_H * IDX_D == 8192
    exact = 21 * (L_1M * (L_1M + 1) // 2) * 8192
    assert ix["flops"] == exact
    assert math.isclose(ix["flops_approx"], 21 * L_1M**2 / 2 * 8192)
    assert round(exact / 1e16, 1) == 9.5 and int(exact / 1e15) == 94  # "≈ 9.4e16": truncated


def test_indexer_intensity_is_64_flop_per_byte_and_307_tflops_at_4_8_tbps(ledger_1m):
    # Article: "32×128×2 / 128 = 64 FLOP/Byte", "4.8TB/s 只能喂出约 307 TFLOPS".
    ix = ledger_1m["indexer"]
    assert ix["intensity_flop_per_byte"] == 32 * 128 * 2 // 128 == 64
    assert round(ix["bandwidth_bound_flops_per_s"] / 1e12) == 307


def test_chunked_indexer_terms_match_the_article_at_1m(ledger_1m):
    # Article, 分块对 DSA 的副作用: "块内项约 21×L²/(2×32)≈3.6×10^11", "跨块项约 21×L²/2≈1.15×10^13",
    # "跨块项占了 97%".
    pl = ledger_1m["indexer"]["pairs_per_layer"]
    pa = ledger_1m["indexer"]["pairs_per_layer_approx"]
    assert pl["intra_chunk"] == 32 * (B_32K * (B_32K + 1) // 2)
    assert pl["cross_chunk"] == (L_1M**2 - 32 * B_32K**2) // 2
    assert pl["prefix_cache"] == 0
    assert round(21 * pl["intra_chunk"] / 1e11, 1) == 3.6
    assert round(21 * pa["cross_chunk"] / 1e13, 2) == 1.15  # article's approximation L²/2
    assert round(21 * pl["cross_chunk"] / 1e13, 2) == 1.12  # exact: L²/2 · (1 - 1/m)
    assert round(100 * pl["cross_chunk"] / (pl["cross_chunk"] + pl["intra_chunk"])) == 97


def test_index_k_reread_follows_the_formula_not_the_printed_4_7e13(ledger_1m):
    # Article: "21×L²/(2b)×132 ≈ 4.7×10^13 字节" and TTFT table "≈ 46TB". The formula with
    # b = 32768 gives 4.65e10 B (46.5 GB); 4.7e13 is the formula with m = 32 in place of b.
    ix = ledger_1m["indexer"]
    exact = 21 * 132 * sum(j * B_32K for j in range(32))
    assert ix["index_k_reread_bytes"] == exact
    formula = 21 * L_1M**2 / (2 * B_32K) * 132
    assert math.isclose(ix["index_k_reread_bytes_approx"], formula)
    assert round(formula / 1e10, 2) == 4.65
    assert round(21 * L_1M**2 / (2 * 32) * 132 / 1e13, 1) == 4.8  # the article's slip (prints 4.7)
    assert exact < 4.7e13 / 1000


def test_indexer_logits_of_a_32k_chunk_at_1m_are_137_gb(ledger_1m):
    # Article: "32768×1,048,576×4 字节 ≈ 137GB".
    assert ledger_1m["logits"]["peak_bytes_one_chunk"] == B_32K * L_1M * 4
    assert int(B_32K * L_1M * 4 / 1e9) == 137


def test_logits_budget_is_5_6_gb_and_1344_rows_at_1m(ledger_1m):
    # Article, logits 的显存预算: "30% 是 42.3GB", "空闲是 28.2GB, 其中 20% 是 5.6GB", "一行 4MB",
    # "最多一次算约 1300 行", "切成约 25 段". docs/conventions.md §12: "≈5.6 GB, ≈1340 rows".
    total = 141 * 10**9
    assert round(0.3 * total / 1e9, 1) == 42.3 and round(0.2 * total / 1e9, 1) == 28.2
    budget = logits_budget_bytes_static(total, 0.8)
    assert abs(budget - 0.2 * 0.2 * total) <= 2
    lg = ledger_1m["logits"]
    assert lg["budget_bytes"] == budget and round(budget / 1e9, 1) == 5.6
    assert lg["row_bytes_at_tokens"] == 4 * L_1M == 4 * 2**20  # "一行 4MB" (MiB)
    rows = int(0.04 * total) // (4 * L_1M)  # 5.64e9 / 4,194,304 = 1344.7
    assert lg["rows_at_tokens"] == rows == 1344
    assert lg["slices_last_chunk"] == -(-B_32K // rows) == 25


def test_mha_one_shot_temporary_kv_is_60_gb_at_2_pow_20_and_57_gb_at_10_pow_6(ledger_1m):
    # Article: "1,048,576×64×448×2 字节 ≈ 57GB"; "32768×28,672×2≈1.9GB"; "约 50 倍".
    mha = ledger_1m["mha_one_shot"]
    assert mha["kv_elements_per_token"] == 64 * (192 + 256) == 28_672
    assert round(28_672 / 576) == 50
    assert mha["temp_kv_bytes_at_tokens"] == L_1M * 64 * 448 * 2
    assert round(L_1M * 64 * 448 * 2 / 1e9, 1) == 60.1  # what the product gives
    assert round(10**6 * 64 * 448 * 2 / 1e9) == 57  # what the article prints
    assert mha["temp_kv_bytes_per_chunk"] == B_32K * 28_672 * 2 and round(B_32K * 28_672 * 2 / 1e9, 1) == 1.9


def test_chunk_size_comparison_matches_the_article_table(ledger_1m):
    # Article, chunk 大小对照表: 8192: 4×, 8192 × 1M × 4 ≈ 34GB, 8192 × 6144 × 2 ≈ 100MB, 128 次;
    # 32768: 1×, 137GB, 402MB, 32; 131072: 0.25×, 549GB, 1.6GB, 8.
    rows = {r["chunk"]: r for r in ledger_1m["chunk_sizes"]}
    article = {8192: (4, 34, 100e6, 128), 32768: (1, 137, 402e6, 32), 131072: (0.25, 549, 1.6e9, 8)}
    base = 21 * 132 * sum(j * B_32K for j in range(32))
    for b, (rel, logits_gb, act, count) in article.items():
        m = L_1M // b
        assert rows[b]["chunks"] == m == count
        reread = 21 * 132 * sum(j * b for j in range(m))
        assert rows[b]["index_k_reread_bytes"] == reread
        assert rows[b]["index_k_reread_relative"] == pytest.approx(reread / base, rel=1e-12)
        # exact ratios 127/31 and 7/31; the article's 4× / 0.25× is the L²/(2b) approximation
        assert abs(reread / base - rel) / rel < 0.11
        assert rows[b]["logits_peak_bytes"] == b * L_1M * 4 and int(b * L_1M * 4 / 1e9) == logits_gb
        assert rows[b]["hidden_bytes_per_chunk"] == b * 6144 * 2
        assert abs(b * 6144 * 2 / act - 1) < 0.01


# ------------------------------------------------------------------ communication
def test_communication_per_chunk_matches_the_article_table(ledger_1m):
    # Article, 一条 prefill 的通信账本 (n=32768, h=6144, CP8):
    # 索引 K AllGather 21 × n×132 B ≈ 4.3MB ≈ 90MB; o_proj ReduceScatter 78 × n×h×2 ≈ 402MB ≈ 31GB;
    # dispatch 75 × 8n×h×1 ≈ 1.6GB ≈ 120GB; combine 75 × 8n×h×2 ≈ 3.2GB ≈ 240GB;
    # CP 边界 1 × n×h×2 ≈ 0.4GB; DP Attention 78 × 2 × n×h×2 ≈ 63GB; "每 rank 本地 4096 行 × 132
    # 字节 ≈ 540KB".
    n, h = B_32K, HID
    rows = {r["op"]: r for r in ledger_1m["comm"]["rows"]}
    article = {
        "index_k_allgather": (21, n * 132, 4.3e6, 90e6),
        "o_proj_reduce_scatter": (78, n * h * 2, 402e6, 31e9),
        "moe_dispatch": (75, 8 * n * h, 1.6e9, 120e9),
        "moe_combine": (75, 8 * n * h * 2, 3.2e9, 240e9),
        "cp_boundary_gather": (1, n * h * 2, 402e6, 0.4e9),
        "dp_attention_gather_scatter": (156, n * h * 2, 402e6, 63e9),
    }
    for op, (count, each, each_article, total_article) in article.items():
        assert rows[op]["count"] == count and rows[op]["bytes_each"] == each, op
        assert abs(each / each_article - 1) < 0.03, op
        assert abs(count * each / total_article - 1) < 0.03, op
    assert rows["index_k_allgather"]["local_bytes_each"] == 4096 * 132 == 540_672
    # the latent all-gather is missing from the article's table: bf16 [c | k_pe] per layer
    assert rows["latent_allgather"]["count"] == 78 and rows["latent_allgather"]["bytes_each"] == n * 576 * 2
    assert rows["dp_attention_gather_scatter"]["optional"]


@given(n=st.integers(1, 100_000), cp=st.integers(1, 16))
def test_cp_rows_vanish_without_cp_and_other_rows_do_not_depend_on_cp(n, cp):
    with_cp = {r.op: r for r in cp_comm_bytes_per_chunk(GLM, n, cp)}
    no_cp = {r.op: r for r in cp_comm_bytes_per_chunk(GLM, n, 1)}
    for op in ("index_k_allgather", "latent_allgather", "cp_boundary_gather"):
        assert no_cp[op].total == 0
        assert with_cp[op].local_bytes_each == -(-n // cp) * (with_cp[op].bytes_each // n)
    for op in ("o_proj_reduce_scatter", "moe_dispatch", "moe_combine", "dp_attention_gather_scatter"):
        assert with_cp[op] == no_cp[op]


def test_index_k_gather_element_size_is_a_parameter():
    # our implementation gathers bf16 keys before quantization: 2 × 128 B per token
    rows = {r.op: r for r in cp_comm_bytes_per_chunk(GLM, B_32K, 8, index_k_bytes_per_token=2 * IDX_D)}
    assert rows["index_k_allgather"].bytes_each == B_32K * 256


# ------------------------------------------------------------------ chunk plan
def test_one_million_tokens_in_32k_chunks_is_32_equal_chunks():
    # Article, 调度时间线: step 1 "0 – 32767", step 2 "32768 – 65535", step 32 "1015808 – 1048575".
    plan = chunk_plan(L_1M, B_32K)
    assert plan == [(j * B_32K, (j + 1) * B_32K) for j in range(32)]
    assert plan[-1] == (1_015_808, 1_048_576)


def test_unaligned_prefix_first_chunk_ends_on_a_page_boundary():
    # end = floor((prefix + limit) / 64) * 64 (docs/conventions.md §11)
    assert chunk_plan(1000, 128, prefix=100) == [(100, 192), (192, 320), (320, 448), (448, 576),
                                                 (576, 704), (704, 832), (832, 960), (960, 1000)]


@given(
    total=st.integers(1, 20_000),
    prefix_frac=st.floats(0, 0.999),
    chunk=st.integers(64, 3000),
    page=st.sampled_from([1, 16, 64]),
)
def test_chunk_plan_covers_the_new_tokens_with_maximal_page_aligned_chunks(total, prefix_frac, chunk, page):
    prefix = int(prefix_frac * total)
    plan = chunk_plan(total, chunk, prefix, page)
    assert plan[0][0] == prefix and plan[-1][1] == total
    for (s, e), nxt in zip(plan, plan[1:]):
        assert nxt[0] == e
        assert e % page == 0  # interior boundaries on pages
        assert e + page > s + chunk  # no later page boundary fits the budget
        assert -(-(total - s) // page) * page > chunk  # the rest did not fit in one step
    assert all(0 < e - s <= chunk for s, e in plan)


def test_chunk_smaller_than_a_page_is_rejected():
    with pytest.raises(ValueError, match="smaller than one page"):
        chunk_plan(1000, 32)
    with pytest.raises(ValueError, match="prefix"):
        chunk_plan(100, 64, prefix=100)


# ------------------------------------------------------------------ indexer pairs
def _explicit_pairs(plan):
    """Classify every scored (query, key) pair by an explicit double loop."""
    prefix = plan[0][0]
    chunk_of = {}
    for j, (s, e) in enumerate(plan):
        for i in range(s, e):
            chunk_of[i] = j
    intra = cross = pre = 0
    for q in range(prefix, plan[-1][1]):
        for k in range(q + 1):
            if k < prefix:
                pre += 1
            elif chunk_of[k] == chunk_of[q]:
                intra += 1
            else:
                cross += 1
    return intra, cross, pre


@given(
    total=st.integers(1, 400),
    prefix=st.integers(0, 150),
    chunk=st.integers(1, 250),
    page=st.sampled_from([1, 8, 64]),
)
def test_indexer_pair_terms_equal_an_explicit_loop(total, prefix, chunk, page):
    prefix = min(prefix, total - 1)
    chunk = max(chunk, page)
    plan = chunk_plan(total, chunk, prefix, page)
    p = indexer_pairs(plan)
    intra, cross, pre = _explicit_pairs(plan)
    assert (p.intra_chunk, p.cross_chunk, p.prefix_cache) == (intra, cross, pre)
    assert p.total == intra + cross + pre == sum(i + 1 for i in range(prefix, total))


@given(total=st.integers(1, 3000), prefix=st.integers(0, 1000), chunk=st.integers(64, 700))
def test_index_k_reread_counts_each_chunks_committed_prefix_once_per_full_layer(total, prefix, chunk):
    prefix = min(prefix, total - 1)
    c = PRESETS["small"]
    plan = chunk_plan(total, chunk, prefix, c.page_size)
    n_full = sum(t == "full" for t in c.indexer_types)
    expected = 0
    for s, _ in plan:
        expected += n_full * s * (c.index_head_dim + 4)
    assert index_k_reread_bytes(c, plan) == expected


# ------------------------------------------------------------------ context parallel
def _independent_positions(n, cp, split):
    idx = np.arange(n)
    if split == "interleave":
        return [[i for i in range(n) if i % cp == r] for r in range(cp)]
    if split == "contiguous":
        return [b.tolist() for b in np.array_split(idx, cp)]
    blocks = np.array_split(idx, 2 * cp)
    return [blocks[r].tolist() + blocks[2 * cp - 1 - r].tolist() for r in range(cp)]


@given(
    n=st.integers(0, 500),
    cp=st.integers(1, 9),
    split=st.sampled_from(CP_SPLITS),
    prefix=st.integers(0, 10_000),
)
def test_cp_positions_and_pairs_match_an_independent_split(n, cp, split, prefix):
    expected = _independent_positions(n, cp, split)
    assert cp_rank_positions(n, cp, split) == expected
    pairs = cp_indexer_pairs_per_rank(n, cp, split, prefix)
    assert pairs == [sum(prefix + i + 1 for i in rank) for rank in expected]
    assert sum(pairs) == sum(prefix + i + 1 for i in range(n))


@given(n=st.integers(1, 5000), cp=st.integers(1, 16), prefix=st.integers(0, 10**6))
def test_interleave_ranks_differ_by_at_most_one_stride_per_token_plus_one_token(n, cp, prefix):
    # Ranks r < r' with equal counts differ by (r' - r) per token ≤ (cp - 1)·ceil(n/cp); a rank
    # with one more token adds at most that token's prefix + n keys.
    pairs = cp_indexer_pairs_per_rank(n, cp, "interleave", prefix)
    assert max(pairs) - min(pairs) <= (cp - 1) * -(-n // cp) + prefix + n


@given(blocks=st.integers(1, 200), cp=st.integers(1, 16), prefix=st.integers(0, 10**6))
def test_zigzag_is_exactly_balanced_when_2cp_divides_n(blocks, cp, prefix):
    pairs = cp_indexer_pairs_per_rank(blocks * 2 * cp, cp, "zigzag", prefix)
    assert len(set(pairs)) == 1


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_contiguous_last_over_first_mean_prefix_tends_to_2p_minus_1(cp):
    # Article: "第一段 rank 的平均前缀是 L/(2p),最后一段是 (2p−1)L/(2p),两者相差 2p−1 倍;p=8 时是 15 倍".
    n = L_1M
    first = range(0, n // cp)
    last = range(n - n // cp, n)
    ratio = (sum(last) / len(last)) / (sum(first) / len(first))
    assert abs(ratio - (2 * cp - 1)) < 1e-3
    pairs = cp_indexer_pairs_per_rank(n, cp, "contiguous")
    mean_prefix = [q / (n // cp) - 1 for q in pairs]
    assert math.isclose(mean_prefix[-1] / mean_prefix[0], ratio, rel_tol=1e-12)
    # the article's formula r L/p + L/(2p) is the exact mean plus 1/2
    for r in range(cp):
        assert cp_mean_prefix_article(n, cp, "contiguous", r) == mean_prefix[r] + 0.5


def test_interleave_article_mean_prefix_is_l_over_2_minus_p_minus_1_over_2(ledger_1m):
    # Article: "s̄_r^interleave = L/2 − (p−1)/2 ≈ L/2"; exact for rank r: (L − p)/2 + r.
    seq = ledger_1m["context_parallel"]["sequence"]["interleave"]
    for r in range(8):
        assert seq["mean_prefix_per_rank"][r] == (L_1M - 8) / 2 + r
        assert seq["article_mean_prefix_per_rank"][r] == L_1M / 2 - 7 / 2


# ------------------------------------------------------------------ logits budget
@given(
    total=st.integers(10**9, 200 * 10**9),
    mfs=st.floats(0.0, 1.0),
    free=st.floats(0.01, 1.0),
)
def test_logits_budget_is_the_smaller_of_the_two_caps(total, mfs, free):
    expected = min(free * (1 - mfs) * total, 0.3 * total)
    assert abs(logits_budget_bytes_static(total, mfs, free) - expected) <= 2 + 1e-9 * total


@given(num_q=st.integers(1, 100_000), num_k=st.integers(1, 2_000_000), budget=st.integers(0, 10**10))
def test_logit_row_slices_fit_the_budget_and_cover_the_rows(num_q, num_k, budget):
    rows, slices = logits_row_slices(num_q, num_k, budget)
    assert rows * slices >= num_q > rows * (slices - 1)
    if num_q * num_k < 8_000_000 or 4 * num_q * num_k <= budget:
        assert (rows, slices) == (num_q, 1)
    else:
        assert rows == max(1, budget // (4 * num_k))
        assert rows == 1 or 4 * rows * num_k <= budget < 4 * (rows + 1) * num_k


# ------------------------------------------------------------------ TTFT
def test_ttft_floor_terms_follow_the_article_rates(ledger_1m):
    # Article, TTFT 的算术: 索引器 94 PFLOP / (8 × 300 TFLOPS) ≈ 39s; 主干 100 PFLOP / (8 × 1.5 PFLOPS)
    # ≈ 8.3s; 稀疏注意力 78 × L×2048×576B ≈ 96TB / 38TB/s ≈ 2.5s; MoE 360GB/chunk × 32 ≈ 11.5TB /
    # 7.2TB/s ≈ 1.6s; KV 写入 57GB / 4.8TB/s ≈ 12ms.
    comp = {x["name"]: x for x in ledger_1m["ttft"]["components"]}
    idx = 21 * (L_1M * (L_1M + 1) // 2) * 8192
    assert comp["indexer_compute"]["amount"] == idx and round(idx / (8 * 300e12)) == 39
    assert round(comp["indexer_compute"]["seconds"]) == 39
    keys = 2048 * L_1M - 2047 * 2048 // 2  # positions < 2048 see fewer keys
    assert comp["sparse_kv_read"]["amount"] == 78 * keys * FP8_ROW
    assert round(78 * L_1M * 2048 * 576 / 1e12, 1) == 96.5  # the article counts 576 B per key
    assert round(78 * L_1M * 2048 * 576 / (8 * 4.8e12), 1) == 2.5
    moe = 32 * 75 * B_32K * 8 * HID * 3
    assert comp["moe_comm"]["amount"] == moe and round(moe / 7.2e12, 1) == 1.6
    assert comp["kv_write"]["amount"] == L_1M * 53_940 and round(L_1M * 53_940 / 4.8e12 * 1e3) == 12
    dense_ops = sum(f * n for name, (f, _, _, n) in ARTICLE_OPS.items() if name != "sparse_mla")
    backbone = (dense_ops + 2 * HID * E * MOE_LAYERS) * L_1M + 78 * 2 * HEADS * (576 + 512) * keys
    assert comp["backbone_compute"]["amount"] == backbone
    assert round(backbone / (8 * 1.5e15), 1) == 8.8  # the article's 8.3 s is 100 PFLOP (10**6 tokens)
    tt = ledger_1m["ttft"]
    assert math.isclose(tt["serial_s"], sum(x["seconds"] for x in comp.values()))
    assert tt["critical_path_s"] <= tt["serial_s"]


def test_gpu_spec_overrides_scale_the_floor():
    slow = ttft_floor(GLM, 65_536, B_32K, gpu=GpuSpec(gpus=4))
    fast = ttft_floor(GLM, 65_536, B_32K, gpu=GpuSpec(gpus=8))
    s = {x.name: x.seconds for x in slow["components"]}
    f = {x.name: x.seconds for x in fast["components"]}
    assert math.isclose(s["indexer_compute"], 2 * f["indexer_compute"])
    assert math.isclose(s["kv_write"], f["kv_write"])  # one GPU's HBM either way
    with pytest.raises(ValueError, match="hbm_bytes_per_s"):
        GpuSpec(hbm_bytes_per_s=0)


# ------------------------------------------------------------------ every config, stable keys
def _key_paths(d, prefix=""):
    if isinstance(d, dict):
        return {p for k, v in d.items() for p in _key_paths(v, f"{prefix}.{k}")} | {prefix}
    if isinstance(d, list) and d and isinstance(d[0], dict):
        return {p for v in d for p in _key_paths(v, f"{prefix}[]")}
    return {prefix}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_ledger_has_the_same_json_keys_for_every_config(name, ledger_1m):
    led = build_ledger(PRESETS[name], tokens=3000, chunk=512, prefix=130, cp=3)
    json.dumps(led)
    assert _key_paths(led) == _key_paths(ledger_1m)
    assert led["kv"]["bytes_per_token"] == (
        PRESETS[name].num_hidden_layers * main_kv_row_bytes(PRESETS[name])
        + sum(t == "full" for t in PRESETS[name].indexer_types) * (PRESETS[name].index_head_dim + 4)
    )


# ------------------------------------------------------------------ agreement with the numerics modules
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_row_and_page_bytes_agree_with_kv_format(name):
    from glm_dsa import kv_format

    c = PRESETS[name]
    for kv_dtype in ("fp8", "bf16"):
        assert main_kv_row_bytes(c, kv_dtype) == kv_format.mla_kv_row_bytes(
            c.kv_lora_rank, c.qk_rope_head_dim, kv_dtype)
    # The ledger's own row formula, paged, against the byte layout the cache stores.
    assert c.page_size * index_k_row_bytes(c) == kv_format.index_k_page_bytes(c.page_size, c.index_head_dim)


@given(num_q=st.integers(1, 50_000), num_k=st.integers(1, 2_000_000), budget=st.integers(0, 10**10))
def test_logit_rows_agree_with_the_indexers_row_limit(num_q, num_k, budget):
    from glm_dsa.budget import max_logit_rows

    assert logits_row_slices(num_q, num_k, budget)[0] == max_logit_rows(num_q, num_k, budget)


# ------------------------------------------------------------------ closed forms at any length
def _chunk_plan_stepwise(total, chunk, prefix, page):
    """SGLang's PrefillAdder rule applied one step at a time (the definition chunk_runs condenses)."""
    plan, start = [], prefix
    while start < total:
        if -(-(total - start) // page) * page <= chunk:
            end = total
        else:
            end = min(total, (start + chunk) // page * page)
        plan.append((start, end))
        start = end
    return plan


@given(
    total=st.integers(1, 20_000),
    prefix_frac=st.floats(0, 0.999),
    chunk=st.integers(1, 3000),
    page=st.sampled_from([1, 7, 16, 64]),
)
def test_chunk_runs_expand_to_the_stepwise_plan(total, prefix_frac, chunk, page):
    from glm_dsa.ledger import chunk_runs

    prefix = int(prefix_frac * total)
    if chunk < page:
        return
    runs = chunk_runs(total, chunk, prefix, page)
    expanded = [(s + j * b, s + (j + 1) * b) for s, b, n in runs for j in range(n)]
    assert expanded == _chunk_plan_stepwise(total, chunk, prefix, page) == chunk_plan(total, chunk, prefix, page)
    assert len(runs) <= 3


@given(
    start=st.integers(0, 50_000),
    size=st.integers(1, 5_000),
    count=st.integers(1, 200),
    budget=st.one_of(st.sampled_from([0, 10**5, 4 * 10**7]), st.integers(0, 10**8)),
)
def test_logits_slices_of_a_run_sum_the_per_chunk_slices(start, size, count, budget):
    from glm_dsa.ledger import _run_logits_slices

    expected = sum(logits_row_slices(size, start + (j + 1) * size, budget)[1] for j in range(count))
    assert _run_logits_slices(start, size, count, budget) == expected


def test_ledger_time_does_not_grow_with_tokens():
    import time

    t0 = time.perf_counter()
    ledger = build_ledger(get_config("glm-5.3"), tokens=10**12, chunk=32768)
    assert time.perf_counter() - t0 < 10
    n = 10**12
    assert ledger["chunks"]["count"] == -(-n // 32768)
    assert "plan" not in ledger["chunks"]  # 30.5M chunks are given as runs only
    assert ledger["indexer"]["pairs_per_layer"]["total"] == n * (n + 1) // 2


# ------------------------------------------------------------------ whole model from a measured layer
def test_whole_model_time_from_the_measured_layer():
    """GLM-5.3 at 1,048,576 tokens: 21 full layers at the measured 10.93 s and 57 shared layers at
    10.93 - 7.15 s (the measured layer without its indexer), beside the article's 440-520 GPU-s."""
    from glm_dsa.ledger_text import format_ledger
    from glm_dsa.measured import H200_GLM53_1M, whole_model_seconds

    led = build_ledger(PRESETS["glm-5.3"], tokens=1_048_576, chunk=32_768)
    w = led["whole_model_time"]
    assert w["applies"] and (w["full_layers"], w["shared_layers"]) == (21, 57)
    assert w["seconds"] == pytest.approx(21 * 10.93 + 57 * (10.93 - 7.15))
    assert w["measured"]["date"] == "2026-12-02" and "issue 41" in w["measured"]["source"]
    text = format_ledger(led)
    assert "445.0" in text and "440-520 GPU-seconds" in text and "0.86-1.01x" in text
    # the indexer scales with its pairs, the rest with the tokens: half the pairs, a quarter of the tokens
    half = whole_model_seconds(2, 3, indexer_pairs=50, new_tokens=H200_GLM53_1M.tokens // 4, measured_pairs=100)
    rest = (10.93 - 7.15) / 4
    assert half["seconds"] == pytest.approx(2 * (7.15 / 2 + rest) + 3 * rest)
    other = build_ledger(PRESETS["small"], tokens=3000, chunk=512)["whole_model_time"]
    assert not other["applies"] and other["seconds"] is None
    assert "whole model on one" not in format_ledger(build_ledger(PRESETS["small"], tokens=3000, chunk=512))
