"""The arithmetic behind scripts/bench.py's reported figures (the GPU timings themselves run on
the H200 only): the top-k overlap against HF and the per-component FLOP split; and
scripts/bench_indexer.py's frontier part end to end at tiny shapes in Triton's interpreter."""

import importlib.util
import json
import math
import pathlib
import sys

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_dsa.config import PRESETS
from glm_dsa.ledger import layer_flops_per_token, op_flops

_PATH = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
sys.path.insert(0, str(_PATH.parent))  # as when a script runs: its folder first (benchlib)
_SPEC = importlib.util.spec_from_file_location("glm_dsa_bench", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)
import benchlib  # noqa: E402


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 60), topk=st.integers(1, 12))
@settings(max_examples=30)
def test_overlap_is_the_mean_shared_fraction_over_rows_with_more_keys_than_topk(seed, n, topk):
    gen = torch.Generator().manual_seed(seed)
    n_keys = torch.arange(1, n + 1)  # row i may choose among keys 0 … i
    a = torch.full((n, topk), -1, dtype=torch.int64)
    b = torch.full((n, topk), -1, dtype=torch.int64)
    for i in range(n):
        if i + 1 > topk:
            a[i] = torch.randperm(i + 1, generator=gen)[:topk]
            b[i] = torch.randperm(i + 1, generator=gen)[:topk]
    shared, rows = 0, 0
    for i in range(n):
        if i + 1 > topk:
            shared += len(set(a[i].tolist()) & set(b[i].tolist()))
            rows += 1
    got, got_rows = bench._overlap(a, b, n_keys, topk, block=7)
    assert got_rows == rows
    assert got == (shared / (rows * topk) if rows else 1.0)


def test_component_flops_partition_the_ledgers_layer_flops():
    """Projections + indexer projections + attention + MoE = the ledger's per-token FLOPs of a
    full MoE layer with sparse MLA over the keys each position has; the indexer's fp8 part is
    its causal (query, key) pairs."""
    cfg = PRESETS["glm-5.3"]
    for tokens in (1000, 32768, 131072):
        flops = bench.component_flops(cfg, tokens)
        per_token = {op.op: op.flops_per_token for op in op_flops(cfg)}
        full = layer_flops_per_token(cfg, full=True, moe=True, with_router=True)
        keys = sum(min(cfg.index_topk, i + 1) for i in range(tokens))
        mla = per_token["sparse_mla"] // cfg.index_topk * keys
        assert sum(b for b, _ in flops.values()) == tokens * (full - per_token["sparse_mla"]) + mla
        pairs = tokens * (tokens + 1) // 2
        assert flops["indexer"][1] == pairs * 2 * cfg.index_n_heads * cfg.index_head_dim
        assert all(f8 == 0 for name, (_, f8) in flops.items() if name != "indexer")


def test_markdown_tables_quote_the_json_figures_and_mark_an_unfinished_prefill():
    res = {
        "date": "2026-11-29", "gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "transformers": "5.17.0",
        "command": "python scripts/bench.py --parts prefill,hf",
        "ceilings": {"copy_bytes_per_s": 4.2e12, "bf16_flops_per_s": 7.8e14, "fp8_flops_per_s": 1.4e15},
        "prefill": [
            {"tokens": 65536, "floor_seconds": 0.1, "wall_seconds": 2.0, "peak_gb": 30.0,
             "steps": [{"end": 32768, "projections": 0.1, "indexer": 0.5, "attention": 0.3, "moe": 0.05},
                       {"end": 65536, "projections": 0.1, "indexer": 0.7, "attention": 0.3, "moe": 0.05}]},
            {"tokens": 1048576, "floor_seconds": 3.0, "wall_seconds": 300.0,
             "steps": [{"end": 32768, "projections": 0.1, "indexer": 0.5, "attention": 0.4, "moe": 0.07,
                        "peak_gb": 41.5}]},
        ],
        "hf": [
            {"tokens": 8192, "ours_seconds": 0.2, "ours_peak_gb": 27.6, "hf_seconds": 0.08,
             "hf_peak_gb": 40.6, "speedup_vs_hf": 0.4, "topk_overlap": 0.984, "overlap_rows": 6144},
            {"tokens": 2048, "ours_seconds": 0.012, "ours_eager_seconds": 0.021, "ours_cuda_graphs": True,
             "ours_peak_gb": 24.6, "hf_seconds": 0.0155, "hf_peak_gb": 23.2, "speedup_vs_hf": 1.29,
             "calc_diff_fp8_kv": 7.2e-4},
            {"tokens": 24576, "ours_seconds": 0.63, "ours_peak_gb": 35.8, "hf_error": "CUDA out of memory."},
            {"equality": {"tokens": 2048, "index_topk": 2048, "calc_diff": 5.5e-4, "max_abs_diff": 1.2,
                          "max_abs": 5.9}},
        ],
    }
    md = bench.render_markdown(res)
    assert "torch 2.11.0+cu130, transformers 5.17.0" in md
    assert "| 65,536 | 2 | 2.00 s | 200.0 ms | 1.20 s | 600.0 ms | 100.0 ms | 30.0 GB | 100.0 ms | 20× |" in md
    assert "| 1,048,576 | 1 (to 32,768) | 300.00 s |" in md and "| 41.5 GB | 3.00 s | — |" in md
    assert "| 8,192 | 200.0 ms | — | 80.0 ms | 0.40 | 27.6 GB | 40.6 GB | top-k overlap 98.4% (6,144 rows) |" in md
    assert ("| 2,048 | 12.0 ms (graphs) | 21.0 ms | 15.5 ms | 1.29 | 24.6 GB | 23.2 GB | calc_diff 7.2e-04 (FP8 KV) |"
            in md)
    assert "| 24,576 | 630.0 ms | — | failed: CUDA out of memory. | — |" in md
    assert "calc_diff 5.5e-04" in md


# ------------------------------------------------------------------ the peers part
@given(queries=st.integers(1, 50), extra=st.integers(0, 80))
@settings(max_examples=20)
def test_causal_pairs_count_the_unmasked_entries_of_the_chunk(queries, extra):
    keys = queries + extra
    ke = [keys - queries + i + 1 for i in range(queries)]  # row i sees keys [0, ke[i])
    assert bench.causal_pairs(queries, keys) == sum(ke)
    assert bench.logits_flops(queries, keys, 32, 128) == 2 * 32 * 128 * sum(ke)


def test_sparse_prefill_flops_reproduce_flashmlas_quoted_rate():
    # peer README: 4,096 queries, h_q 64, top-2048 in 2.36 ms is 494 TFLOP/s.
    flops = bench.sparse_prefill_flops(4096, 2048, 64)
    assert flops == 2 * 4096 * 2048 * 64 * (576 + 512)
    assert round(flops / 2.36e-3 / 1e12) in (494, 495)


def test_peer_rows_report_rate_and_time_over_the_peer():
    rows = bench.peer_rows("op", "shape", 4e12, {"DeepGEMM": 2.0, "Triton": 3.0, "reference": 40.0}, "DeepGEMM")
    assert [(r["impl"], r["tflops"], r["vs_peer"]) for r in rows] == [
        ("DeepGEMM", 2.0, 1.0), ("Triton", 4 / 3, 1.5), ("reference", 0.1, 20.0)]
    table = bench.render_peers(rows)
    assert table[0].startswith("| op | shape | implementation |") and len(table) == 2 + 3 + 1
    assert "| Triton | 3.00 s | 1.3 | 1.50× |" in table[3]


def test_plot_floor_of_the_steps_adds_up_to_the_whole_prefill(tmp_path):
    """Every component's FLOPs are causal in the prefix, so the per-step floors of a chunked
    prefill add up to the floor of the whole prompt; and a bench log's step lines parse."""
    sys_path = str(_PATH.parent)
    import sys

    sys.path.insert(0, sys_path)
    try:
        spec = importlib.util.spec_from_file_location("glm_dsa_plot", _PATH.parent / "plot_prefill.py")
        plot = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(plot)
    finally:
        sys.path.remove(sys_path)
    ceilings = {"bf16_flops_per_s": 7e14, "fp8_flops_per_s": 1.3e15}
    tokens, chunk = 300_000, 32_768
    bounds = [(a, min(a + chunk, tokens)) for a in range(0, tokens, chunk)]
    whole = bench.component_flops(bench.GLM, tokens)
    expect = (sum(v[0] for v in whole.values()) / ceilings["bf16_flops_per_s"]
              + sum(v[1] for v in whole.values()) / ceilings["fp8_flops_per_s"])
    got = sum(plot.step_floor(a, b, ceilings) for a, b in bounds)
    assert abs(got - expect) <= 1e-9 * expect
    log = tmp_path / "prefill.log"
    log.write_text("ceilings {}\n  step 1 ((0, 0, 32768),) 2.22 s (indexer 0.58)\n"
                   "  step 2 ((0, 32768, 65536),) 2.31 s (indexer 1.26)\n")
    assert plot.read_steps(str(log), 65536) == [(0, 32768, 2.22), (32768, 65536, 2.31)]


def test_bench_refuses_a_missing_out_directory_before_any_work(tmp_path, monkeypatch, capsys):
    import pytest

    missing = tmp_path / "no" / "such"
    monkeypatch.setattr("sys.argv", ["bench.py", "--out", str(missing), "--parts", "moe"])
    monkeypatch.setattr(bench, "ceilings", lambda: pytest.fail("bench.py measured before checking --out"))
    with pytest.raises(SystemExit) as info:
        bench.main()
    assert info.value.code == 2
    assert f"--out {missing} is not a writable directory; create it first" in capsys.readouterr().err


def test_the_bench_metric_is_the_oracles_calc_diff_in_row_blocks():
    from glm_dsa.oracle import calc_diff

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(1000, 7, generator=gen)
    y = x + 1e-3 * torch.randn(1000, 7, generator=gen)
    assert abs(benchlib.calc_diff(x, y, rows=64) - calc_diff(x, y)) < 1e-12
    assert benchlib.calc_diff(torch.zeros(3, 2), torch.zeros(3, 2)) == 0.0


@given(spans=st.lists(st.tuples(st.integers(0, 200), st.integers(0, 50)), max_size=12))
@settings(max_examples=50)
def test_covered_is_the_length_of_the_spans_union(spans):
    """``covered`` (the profile's GPU busy time) against a count of the unit cells any span holds."""
    spans = [(float(s), float(s + n)) for s, n in spans]
    cells = {c for s, e in spans for c in range(int(s), int(e))}
    assert benchlib.covered(spans) == len(cells)
    assert benchlib.covered([(0.0, 4.0), (1.0, 2.0), (3.5, 6.0), (10.0, 11.0)]) == 7.0


# ------------------------------------------------------------------ bench_indexer's frontier part
def _load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"glm_dsa_{name}", _PATH.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_frontier_part_reports_each_shape_and_both_top_ks_hold_an_exact_top_k(tmp_path, monkeypatch):
    """``bench_indexer.py --parts frontier`` at two tiny shapes (Triton's interpreter on the
    CPU): each shape's fields, its causal pair count, and on the rows it checked, indexer_topk's
    and the composition's sets equal to each other and each a top-k of float64 scores computed
    here from the inputs the two were called with."""
    import pytest

    pytest.importorskip("triton")
    from glm_dsa.kernels import indexer as fast

    bench_indexer = _load_script("bench_indexer")
    calls: dict = {}

    def spy(fn, kind):
        def wrapped(q, w, k, k_scale, ks, ke, topk, *rest):
            out = fn(q, w, k, k_scale, ks, ke, topk, *rest)
            calls[kind, q.shape[0], k.shape[0]] = (out.cpu(), q, w, k, k_scale, ks, ke)
            return out
        return wrapped

    # The composition (peers.indexer_topk, or select_in_chunks without DeepGEMM) ends in
    # select_in_chunks; indexer_topk redoes rows through another function.
    monkeypatch.setattr(fast, "indexer_topk", spy(fast.indexer_topk, "indexer"))
    monkeypatch.setattr(fast, "select_in_chunks", spy(fast.select_in_chunks, "composition"))
    out = tmp_path / "frontier.json"
    shapes, topk = [(4, 96), (6, 80)], 8
    assert bench_indexer.main(["--out", str(out), "--parts", "frontier", "--frontier-topk", str(topk),
                               "--frontier-shapes", ",".join(f"{S}x{N}" for S, N in shapes)]) == 0
    report = json.loads(out.read_text())
    for S, N in shapes:
        r = report["parts"][f"frontier_{S}x{N}"]
        assert "error" not in r, r.get("traceback")
        assert r["unmasked_pairs"] == sum(N - S + 1 + i for i in range(S))  # row i sees keys [0, N − S + 1 + i)
        for name in ("indexer", "triton_logits", "composition"):
            assert r[f"{name}_ms"] > 0 and r[f"{name}_tflops"] > 0
        assert "deepgemm_logits_ms" in r or "deepgemm_skipped" in r or "deepgemm_error" in r
        for step in ("sample_threshold_ms", "candidates_ms", "select_ms", "rest_ms", "redo_rows"):
            assert step in r
        assert r["triton_logits_config"].startswith("BLOCK_Q: ")  # the tuner's pick, logged
        assert math.isnan(r["rest_ms"]) == (r["candidate_rows_per_launch"] < S)
        if r["redo_rows"] == 0:  # every row's candidates held its top-k, within the slots
            assert topk <= r["candidates_min"] <= r["candidates_max"] <= r["cand_slots"]
        assert r["indexer_topk_margin"]["passed"] and r["composition_topk_margin"]["passed"]
        rows = r["check_rows"]
        assert rows[0] == 0 and rows[-1] == S - 1 and r["topk_sets_equal_rows"] == len(rows)
        got, q, w, k, k_scale, ks, ke = calls["indexer", S, N]
        composed = calls["composition", S, N][0]
        # Exact scores: k_scale[n] · Σ_h w[m, h] · relu(q[m, h] · k[n]), in float64.
        dots = torch.einsum("shd,nd->shn", q.double().cpu(), k.double().cpu()).clamp_min(0)
        scores = (w.double().cpu()[:, :, None] * dots).sum(1) * k_scale.double().cpu()
        for m in rows:
            window = scores[m, int(ks[m]):int(ke[m])]
            kth = float(window.topk(topk).values[-1])
            picked = set(got[m].tolist())
            assert picked == set(composed[m].tolist()) and len(picked) == topk
            assert all(0 <= c < len(window) for c in picked)
            # Float32 logits may swap members of near-equal exact score, nothing further.
            assert float(window[sorted(picked)].min()) >= kth - 1e-6 * float(window.abs().max())
