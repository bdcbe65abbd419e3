"""The cost ledger as text: ``format_ledger`` renders a ``glm_dsa.ledger.build_ledger`` dict as
aligned tables, with the design article's printed figures in their own column beside ours.

Pure presentation: every number comes from the dict (``docs/ledger.md`` documents its keys);
nothing here computes a cost.
"""

from __future__ import annotations

from typing import Any, Sequence

from glm_dsa.report import number, si, table

__all__ = ["ARTICLE_CONFIG", "format_ledger"]

# Figures printed in the design article (the project's seed), for GLM-5.3 only; the text report
# shows them in their own column beside ours. Per-op FLOPs: its table "一层 prefill 的算术"
# (M FLOP per token; P FLOP for the whole model at 10**6 tokens). Quoted, never computed with.
ARTICLE_CONFIG = "glm-5.3"
ARTICLE_OP_FLOPS = {  # op: (MFLOP per token, PFLOP over 78/21/75/3 layers at 10**6 tokens)
    "a_proj": (32.2, 2.5), "q_up": (67.1, 5.2), "q_absorb": (12.6, 1.0), "index_k": (1.6, 0.03),
    "index_q": (16.8, 0.35), "index_gate": (0.4, 0.008), "sparse_mla": (285, 22.2),
    "out_absorb": (16.8, 1.3), "o_proj": (201.3, 15.7), "moe_experts": (604, 45.3),
    "shared_experts": (75.5, 5.7), "dense_mlp": (453, 1.4),
}
ARTICLE_KV = {  # KV bytes: "每 token 每层 656 字节", index K "132 字节", "≈56.6 GB" at 1,048,576
    "main_row_bytes": "656 B", "index_row_bytes": "132 B", "bytes_per_token": "53,940 B",
    "main_bytes": "53.7 GB at 1M", "index_bytes": "2.9 GB at 1M", "total_bytes": "56.6 GB at 1M",
    "main_page_bytes": "41,984 B", "index_page_bytes": "8,448 B", "pages_per_chunk": "512",
}
ARTICLE_TTFT = "55-65 s (with its index-K reread slip)"
ARTICLE_TTFT_GPU_SECONDS = (440, 520)  # its 55-65 s on 8 H200s, in GPU-seconds


def _article(ledger: dict[str, Any]) -> bool:
    return ledger["inputs"]["config"] == ARTICLE_CONFIG


def _q(label: str, value: Any, unit: str | None = None, note: str = "", article: str = "") -> list[Any]:
    """A ``quantity | value | ≈ (SI) | design article`` row; ``unit`` asks for the SI rendering."""
    return [label, value, si(value, unit) if unit is not None else note, article]


_Q_HEADERS = ["quantity", "value", "≈ (SI units)", "design article"]


def _render_header(ledger: dict[str, Any]) -> list[str]:
    inp, mod = ledger["inputs"], ledger["model"]
    header = [
        f"glm-dsa ledger: config {inp['config']}, L = {number(inp['tokens'])} tokens "
        f"(prefix P = {number(inp['prefix'])}, new N = {number(inp['new_tokens'])})",
        f"chunk B = {number(inp['chunk'])}, CP {inp['cp']}, KV {inp['kv_dtype']}; TTFT floor "
        f"(last table, critical_path_s): {si(ledger['ttft']['critical_path_s'], 's')}",
        f"model: {mod['layers']} layers = {mod['full_layers']} full + {mod['shared_layers']} shared "
        f"indexer layers; {mod['dense_layers']} dense + {mod['moe_layers']} MoE",
        f"page {mod['page_size']} tokens; index_topk {mod['index_topk']}",
        "units: FLOP counts 2 per multiply-add; B = bytes; SI decimal prefixes (GB = 1e9 B,",
        "TFLOP = 1e12 FLOP); s = seconds. 'design article': figures printed in the design",
        "article (GLM-5.3 only; per-op totals there are at 10^6 tokens), quoted, not computed.",
    ]
    if inp["tokens"] > mod["max_position_embeddings"]:
        header.append(f"note: L exceeds max_position_embeddings = {number(mod['max_position_embeddings'])}")
    return ["\n".join(header)]


def _render_flops(ledger: dict[str, Any]) -> list[str]:
    fl, new = ledger["flops"], ledger["inputs"]["new_tokens"]
    art = ARTICLE_OP_FLOPS if _article(ledger) else {}

    def cited(op: str, i: int, unit: str) -> str:
        if op == "router_gate" and _article(ledger):
            return "not in its table"
        return f"{art[op][i]:g} {unit}" if op in art else "-"

    return [
        table(
            "FLOPs per op per token (sparse MLA at index_topk keys)",
            ["op", "shape", "layers", "FLOP/token", "≈ (SI units)", "design article"],
            [[o["op"], o["shape"], o["layers"], o["flops_per_token"], si(o["flops_per_token"], "FLOP"),
              cited(o["op"], 0, "MFLOP")] for o in fl["ops"]],
        ),
        table(
            f"FLOPs per op over N = {number(new)} new tokens, all layers",
            ["op", "total FLOP", "≈ (SI units)", "design article (10^6 tokens)"],
            [[o["op"], o["total"], si(o["total"], "FLOP"), cited(o["op"], 1, "PFLOP")]
             for o in fl["ops"]],
        ),
        table(
            "FLOPs per layer per token (the article's ops, router excluded)",
            ["layer kind", "FLOP/token", "≈ (SI units)", "design article"],
            [_q(k, v, "FLOP", article="1.31 GFLOP" if k == "full_moe" and _article(ledger) else "")
             for k, v in fl["layer_per_token"].items()],
        ),
        table("model FLOPs", _Q_HEADERS, [
            _q("model_total_article (article's ops)", fl["model_total_article"], "FLOP",
               article="~100 PFLOP" if _article(ledger) else ""),
            _q("sparse_mla_keys (sum of min(topk, i+1))", fl["sparse_mla_keys"], note="keys"),
            _q("model_total (all ops, router, exact keys)", fl["model_total"], "FLOP"),
        ]),
    ]


def _render_params(ledger: dict[str, Any]) -> list[str]:
    art = {"indexer_per_full_layer": "9.4 M", "indexer_total": "197 M", "experts_per_moe_layer": "9.66 G",
           "total": "744 G"} if _article(ledger) else {}
    return [table("parameters (elements)", ["component", "params", "≈ (SI units)", "design article"],
                  [_q(k, v, "", article=art.get(k, "")) for k, v in ledger["params"].items()])]


def _render_indexer(ledger: dict[str, Any]) -> list[str]:
    ix = ledger["indexer"]
    full = ix["full_layers"]
    pl, pa = ix["pairs_per_layer"], ix["pairs_per_layer_approx"]
    return [
        table(
            f"indexer (query, key) pairs: per full layer, x {full} full layers, article's approximation",
            ["term", "pairs/layer", f"x {full} layers", "approx/layer"],
            [[t, pl[t], full * pl[t], pa[t]] for t in ("intra_chunk", "cross_chunk", "prefix_cache", "total")],
        ),
        table("indexer cost", _Q_HEADERS, [
            _q("flops_per_pair", ix["flops_per_pair"]),
            _q("flops (exact)", ix["flops"], "FLOP"),
            _q("flops_approx (L^2/2 pairs)", ix["flops_approx"], "FLOP"),
            _q("intensity_flop_per_byte", ix["intensity_flop_per_byte"], note="FLOP/B (FP8 K)"),
            _q("bandwidth_bound_flops_per_s", ix["bandwidth_bound_flops_per_s"], "FLOP/s"),
            _q("index_k_reread_bytes (exact)", ix["index_k_reread_bytes"], "B"),
            _q("index_k_reread_bytes_approx (N^2/(2B))", ix["index_k_reread_bytes_approx"], "B"),
        ]),
    ]


def _render_kv(ledger: dict[str, Any]) -> list[str]:
    kv = ledger["kv"]
    wc, wr = kv["written_per_chunk"], kv["written_request"]
    art = ARTICLE_KV if _article(ledger) and kv["kv_dtype"] == "fp8" else {}
    return [table(f"KV cache ({kv['kv_dtype']} main KV)", ["quantity", "bytes", "≈ (SI units)", "design article"], [
        _q("main_row_bytes (per token per layer)", kv["main_row_bytes"], "B", article=art.get("main_row_bytes", "")),
        _q("index_row_bytes (per token per full layer)", kv["index_row_bytes"], "B",
           article=art.get("index_row_bytes", "")),
        _q("main_bytes_per_token (all layers)", kv["main_bytes_per_token"], "B"),
        _q("index_bytes_per_token (full layers)", kv["index_bytes_per_token"], "B"),
        _q("bytes_per_token", kv["bytes_per_token"], "B", article=art.get("bytes_per_token", "")),
        _q("main_bytes at L", kv["main_bytes"], "B", article=art.get("main_bytes", "")),
        _q("index_bytes at L", kv["index_bytes"], "B", article=art.get("index_bytes", "")),
        _q("total_bytes at L", kv["total_bytes"], "B", article=art.get("total_bytes", "")),
        _q("main_page_bytes", kv["main_page_bytes"], "B", article=art.get("main_page_bytes", "")),
        _q("index_page_bytes", kv["index_page_bytes"], "B", article=art.get("index_page_bytes", "")),
        _q("pages_per_chunk", kv["pages_per_chunk"], note="pages", article=art.get("pages_per_chunk", "")),
        *[_q(f"written_per_chunk {k}", v, "B") for k, v in wc.items()],
        *[_q(f"written_request {k} (N tokens)", v, "B") for k, v in wr.items()],
    ])]


def _plan_chunk(runs: Sequence[Sequence[int]], j: int) -> tuple[int, int]:
    """Chunk ``j`` (from 0) of a plan given as runs ``(start, size, count)``."""
    for start, size, count in runs:
        if j < count:
            return start + j * size, start + (j + 1) * size
        j -= count
    raise IndexError(j)


def _render_chunks(ledger: dict[str, Any]) -> list[str]:
    count = ledger["chunks"]["count"]
    shown = list(range(count)) if count <= 4 else [0, 1, None, count - 1]
    plan = {j: _plan_chunk(ledger["chunks"]["runs"], j) for j in shown if j is not None}
    return [table(
        f"chunk plan ({ledger['chunks']['count']} chunks)",
        ["chunk", "start", "end", "tokens"],
        [["...", "...", "...", "..."] if j is None
         else [str(j + 1), plan[j][0], plan[j][1], plan[j][1] - plan[j][0]] for j in shown],
    )]


def _render_memory(ledger: dict[str, Any]) -> list[str]:
    """The logits, activations and MHA one-shot sections share one table."""
    lg, act, mha = ledger["logits"], ledger["activations"], ledger["mha_one_shot"]
    return [table("indexer logits, activations, MHA one-shot", _Q_HEADERS, [
        _q("total_mem_bytes (per GPU)", lg["total_mem_bytes"], "B"),
        _q("mem_fraction_static", lg["mem_fraction_static"]),
        _q("budget_bytes (static, conventions §12)", lg["budget_bytes"], "B"),
        _q("row_bytes_at_tokens (4 L)", lg["row_bytes_at_tokens"], "B"),
        _q("rows_at_tokens (budget // 4L)", lg["rows_at_tokens"], note="rows"),
        _q("peak_bytes_one_chunk (unsliced)", lg["peak_bytes_one_chunk"], "B"),
        _q("rows_last_chunk", lg["rows_last_chunk"], note="rows/slice"),
        _q("slices_last_chunk", lg["slices_last_chunk"], note="slices"),
        _q("slices_total", lg["slices_total"], note="slices"),
        _q("hidden_bytes_per_chunk (bf16)", act["hidden_bytes_per_chunk"], "B"),
        _q("moe_intermediate_bytes_per_chunk (bf16)", act["moe_intermediate_bytes_per_chunk"], "B"),
        _q("mha kv_elements_per_token", mha["kv_elements_per_token"]),
        _q("mha latent_elements_per_token", mha["latent_elements_per_token"]),
        _q("mha temp_kv_bytes_at_tokens (bf16)", mha["temp_kv_bytes_at_tokens"], "B"),
        _q("mha temp_kv_bytes_per_chunk (bf16)", mha["temp_kv_bytes_per_chunk"], "B"),
    ])]


def _render_chunk_sizes(ledger: dict[str, Any]) -> list[str]:
    return [table(
        "chunk size comparison (reread relative to chunk B)",
        ["chunk", "chunks", "index-K reread B", "relative", "logits peak B", "≈ (SI)", "hidden act B"],
        [[x["chunk"], x["chunks"], x["index_k_reread_bytes"], x["index_k_reread_relative"],
          x["logits_peak_bytes"], si(x["logits_peak_bytes"], "B"), x["hidden_bytes_per_chunk"]]
         for x in ledger["chunk_sizes"]],
    )]


def _render_context_parallel(ledger: dict[str, Any]) -> list[str]:
    cps = ledger["context_parallel"]
    seq = cps["sequence"]
    contig, inter, zig = seq["contiguous"], seq["interleave"], seq["zigzag"]
    return [
        table(
            f"context parallel CP{cps['cp']}: N new tokens split once; mean prefix per rank (exact / article)",
            ["rank", "contig exact", "contig article", "interleave exact", "interleave article",
             "zigzag exact"],
            [[str(r), contig["mean_prefix_per_rank"][r], contig["article_mean_prefix_per_rank"][r],
              inter["mean_prefix_per_rank"][r], inter["article_mean_prefix_per_rank"][r],
              zig["mean_prefix_per_rank"][r]] for r in range(cps["cp"])],
        ),
        table(
            "context parallel: indexer pairs per rank (one full layer) and imbalance",
            ["split", "scope", "min pairs", "max pairs", "max/min"],
            [[split, scope, min(d["pairs_per_rank"]), max(d["pairs_per_rank"]), d["max_over_min"]]
             for scope in ("sequence", "request") for split, d in cps[scope].items()],
        ),
    ]


def _render_comm(ledger: dict[str, Any]) -> list[str]:
    cm = ledger["comm"]
    return [table(
        f"communication per chunk of {number(cm['chunk_tokens'])} tokens, CP{cm['cp']}",
        ["op", "count", "bytes each", "local each", "total B", "total"],
        [[r["op"] + (" (optional)" if r["optional"] else ""), r["count"], r["bytes_each"],
          r["local_bytes_each"], r["total"], si(r["total"], "B")] for r in cm["rows"]]
        + [["total (without optional)", "", "", "", cm["total_bytes"], si(cm["total_bytes"], "B")]],
    )]


def _render_ttft(ledger: dict[str, Any]) -> list[str]:
    tt, gpu = ledger["ttft"], ledger["inputs"]["gpu"]
    note = f"; design article: {ARTICLE_TTFT}" if _article(ledger) else ""
    return [table(
        f"TTFT floor on {gpu['gpus']} x {gpu['name']}: each term's amount at its rate",
        ["term", "amount", "rate (basis)", "seconds", "share"],
        [[x["name"], f"{x['amount']:,} {x['unit']}", f"{si(x['rate'], x['unit'] + '/s')} ({x['rate_basis'].removesuffix(' rate')})",
          x["seconds"], f"{100 * x['share']:.1f}%"] for x in tt["components"]]
        + [["serial_s", "", "", tt["serial_s"], ""],
           ["critical_path_s", "", "", tt["critical_path_s"], ""]],
    ) + ("\nserial_s: the terms one after another; critical_path_s: max(indexer_compute, "
         "index_k_reread)\n+ backbone_compute + sparse_kv_read + moe_comm (kv_write overlaps).\n"
         f"TTFT floor = critical_path_s = {si(tt['critical_path_s'], 's')}{note}")]


def _render_whole_model_time(ledger: dict[str, Any]) -> list[str]:
    w = ledger["whole_model_time"]
    if not w["applies"]:
        return []
    m = w["measured"]
    rows = [[f"full layer ({w['full_layers']})", f"{w['full_layer_s']:.2f}", f"{w['full_layers'] * w['full_layer_s']:.1f}"],
            [f"shared layer ({w['shared_layers']})", f"{w['shared_layer_s']:.2f}",
             f"{w['shared_layers'] * w['shared_layer_s']:.1f}"],
            ["whole model, one GPU", "", f"{w['seconds']:.1f}"]]
    lines = [table(f"whole model on one {m['gpu']} in layer-major order, from a measured layer",
                   ["layers", "seconds each", "seconds"], rows)]
    low, high = ARTICLE_TTFT_GPU_SECONDS
    article = (f"design article at {number(m['tokens'])} tokens: {ARTICLE_TTFT} on 8 x H200,\n"
               f"= {low}-{high} GPU-seconds; this estimate is {w['seconds'] / high:.2f}-{w['seconds'] / low:.2f}x of it"
               if _article(ledger) and ledger["inputs"]["tokens"] == m["tokens"] and not ledger["inputs"]["prefix"]
               else f"(the design article prices {number(m['tokens'])} tokens only)")
    lines[0] += ("\n" + f"measured: one full layer at {number(m['tokens'])} tokens (chunk {number(m['chunk'])}) "
                 f"{m['full_layer_s']} s, indexer {m['indexer_s']} s,\n{m['setup']}; {m['date']},\n"
                 f"source: {m['source']}.\n"
                 "Scaled to this prompt: the indexer by its query-key pairs, the rest by the tokens run.\n" + article)
    return lines


# The text report, section by section, in the order the tables are printed.
_RENDERERS = (
    _render_header, _render_flops, _render_params, _render_indexer, _render_kv, _render_chunks,
    _render_memory, _render_chunk_sizes, _render_context_parallel, _render_comm, _render_ttft,
    _render_whole_model_time,
)


def format_ledger(ledger: dict[str, Any]) -> str:
    """Render a :func:`build_ledger` dict as aligned text tables (every JSON number appears)."""
    return "\n\n".join(block for render in _RENDERERS for block in render(ledger)) + "\n"
