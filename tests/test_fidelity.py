"""Selection fidelity (`glm_dsa.fidelity`, `glm-dsa fidelity`) against independent computations.

The mass and output figures are checked against float64 loops and the test-only dense MLA of
``dense_reference``; the recalls against an indexer scored here from the state dict; the hooks
against the prefill's own top-k (recomputed from the captured inputs, they agree exactly).
"""

import json
import math

import pytest
import torch

from glm_dsa import ForwardBatch, KVCache
from glm_dsa.cli import main
from glm_dsa.config import get_config, keep_layers
from glm_dsa.fidelity import (
    RANDOM_WEIGHTS_NOTE,
    attention_mass,
    position_buckets,
    sample_positions,
    selection_fidelity,
    topk_recall,
)
from glm_dsa.indexer import topk_per_row
from glm_dsa.oracle import calc_diff
from glm_dsa.weights import build_model, init_weights

from dense_reference import F64, mla_dense, mla_probs, rms_norm, rope_complex

F = torch.float64


def _random_case(rows, heads, length, d=24, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, heads, d, generator=gen, dtype=F) * 2
    kv = torch.randn(length, d, generator=gen, dtype=F)
    return q, kv, gen


def _loop_mass(q, kv, lengths, topk, scale, index_topk, d_v):
    """Per row and head: kept and best mass, overlap, sparse and dense outputs, by plain loops."""
    r, heads, _ = q.shape
    kept, best = torch.zeros(r, heads, dtype=F), torch.zeros(r, heads, dtype=F)
    overlap, out_s, out_d = [], torch.zeros(r, heads, d_v, dtype=F), torch.zeros(r, heads, d_v, dtype=F)
    for i in range(r):
        n = int(lengths[i])
        chosen = {int(j) for j in topk[i] if 0 <= int(j) < n}
        probs = []
        for h in range(heads):
            logits = [float(q[i, h] @ kv[j]) * scale for j in range(n)]
            top = max(logits)
            e = [math.exp(x - top) for x in logits]
            probs.append([x / sum(e) for x in e])
        mean = [sum(p[j] for p in probs) / heads for j in range(n)]
        best_keys = set(sorted(range(n), key=lambda j: (-mean[j], j))[:index_topk])
        overlap.append(len(chosen & best_keys) / len(best_keys))
        for h in range(heads):
            kept[i, h] = sum(probs[h][j] for j in chosen)
            best[i, h] = sum(probs[h][j] for j in best_keys)
            for j in range(n):
                out_d[i, h] += probs[h][j] * kv[j, :d_v]
                if j in chosen:
                    out_s[i, h] += probs[h][j] / kept[i, h] * kv[j, :d_v]
    return kept, best, torch.tensor(overlap, dtype=F), out_s, out_d


def test_mass_shares_match_a_float64_loop_with_padding_repeats_and_short_rows():
    q, kv, gen = _random_case(rows=6, heads=3, length=40)
    lengths = torch.tensor([1, 3, 8, 9, 25, 40])
    k = 8
    topk = torch.full((6, k), -1, dtype=torch.int32)
    topk[0, 0] = 0                                      # one key, -1 padded
    topk[1, :3] = torch.tensor([0, 1, 2])               # a short row: every key, then -1
    topk[2, :8] = torch.arange(8)                       # exactly index_topk keys
    topk[3, :5] = torch.tensor([8, 8, 2, 50, -1])       # a repeat, a key past the causal limit
    topk[4] = torch.randperm(25, generator=gen)[:k].to(torch.int32)
    topk[5] = torch.randperm(40, generator=gen)[:k].to(torch.int32)
    got = attention_mass(q, kv, lengths, topk, 0.3, k, d_v=16)
    want = _loop_mass(q, kv, lengths, topk, 0.3, k, 16)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    # Rows with at most index_topk keys that keep them all keep every bit of the mass.
    assert torch.allclose(got.kept[1:3], torch.ones(2, 3, dtype=F), atol=1e-14, rtol=0)
    assert torch.allclose(got.best[:3], torch.ones(3, 3, dtype=F), atol=1e-14, rtol=0)
    # The selection and its complement share the whole mass.
    rest = torch.full((6, 40), -1, dtype=torch.int32)
    for i in range(6):
        others = sorted(set(range(int(lengths[i]))) - {int(j) for j in topk[i]})
        rest[i, : len(others)] = torch.tensor(others, dtype=torch.int32)
    complement = attention_mass(q, kv, lengths, rest, 0.3, k, d_v=16)
    assert torch.allclose(got.kept + complement.kept, torch.ones(6, 3, dtype=F), atol=1e-14, rtol=0)


def test_row_chunks_change_the_figures_only_by_rounding():
    # A chunk's score GEMM spans its own longest row, so its blocking (last bits) follows the chunk.
    q, kv, gen = _random_case(rows=9, heads=2, length=70, seed=4)
    lengths = torch.randint(1, 71, (9,), generator=gen)
    topk = torch.randint(-1, 70, (9, 16), generator=gen, dtype=torch.int32)
    whole = attention_mass(q, kv, lengths, topk, 0.2, 16, d_v=24)
    chunked = attention_mass(q, kv, lengths, topk, 0.2, 16, d_v=24, budget_bytes=1)
    for a, b in zip(whole, chunked):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def test_an_indexer_scoring_the_true_attention_logits_keeps_the_best_mass():
    q, kv, _ = _random_case(rows=12, heads=1, length=200, seed=1)
    lengths = torch.arange(150, 200, 4)[:12]
    logits = torch.einsum("rd,ld->rl", q[:, 0], kv) * 0.25                     # the true logits
    zeros = torch.zeros(12, dtype=torch.int32)
    planted = topk_per_row(logits, zeros, lengths.to(torch.int32), 32)
    got = attention_mass(q, kv, lengths, planted, 0.25, 32, d_v=24)
    torch.testing.assert_close(got.kept, got.best, rtol=0, atol=1e-13)
    assert torch.equal(got.overlap, torch.ones(12, dtype=F))
    # With several heads the best shared keys are those of highest head-mean mass; an indexer
    # scoring exactly that keeps the best mass too, and any other selection keeps less.
    q4, kv4, gen = _random_case(rows=12, heads=4, length=200, seed=2)
    probs = (torch.einsum("rhd,ld->rhl", q4, kv4) * 0.25).masked_fill(
        torch.arange(200)[None, None, :] >= lengths[:, None, None], -math.inf).softmax(-1)
    planted4 = topk_per_row(probs.mean(1).log(), zeros, lengths.to(torch.int32), 32)
    got4 = attention_mass(q4, kv4, lengths, planted4, 0.25, 32, d_v=24)
    torch.testing.assert_close(got4.kept, got4.best, rtol=0, atol=1e-13)
    other = torch.stack([torch.randperm(int(n), generator=gen)[:32] for n in lengths]).to(torch.int32)
    assert bool((attention_mass(q4, kv4, lengths, other, 0.25, 32, d_v=24).kept.mean(1)
                 < got4.best.mean(1)).all())


def test_a_shuffled_indexer_keeps_about_index_topk_over_n():
    # A uniformly random k-subset of n keys holds k/n of any distribution in expectation.
    q, kv, gen = _random_case(rows=64, heads=4, length=512, seed=3)
    lengths = torch.full((64,), 512)
    shuffled = torch.stack([torch.randperm(512, generator=gen)[:32] for _ in range(64)]).to(torch.int32)
    got = attention_mass(q, kv, lengths, shuffled, 0.3, 32, d_v=24)
    assert abs(float(got.kept.mean()) - 32 / 512) < 0.01
    assert float(got.best.mean()) > 2 * float(got.kept.mean())


def test_recall_counts_each_valid_key_once():
    topk = torch.tensor([[0, 1, 2, -1], [3, 3, 1, 0], [5, 0, -1, -1], [0, -1, -1, -1]])
    ref = torch.tensor([[2, 1, 0, -1], [0, 1, 2, 4], [0, 1, -1, -1], [-1, -1, -1, -1]])
    got = topk_recall(topk, ref, torch.tensor([3, 5, 6, 1]))
    assert got.tolist() == [1.0, 0.5, 0.5, 1.0]


def test_rows_are_spread_one_per_stretch_and_buckets_double_from_index_topk():
    pos = sample_positions(1000, 10, seed=5)
    assert [int(p) // 100 for p in pos] == list(range(10))
    assert torch.equal(pos, sample_positions(1000, 10, seed=5))
    assert not torch.equal(pos, sample_positions(1000, 10, seed=6))
    assert torch.equal(sample_positions(7, 10), torch.arange(7))
    assert position_buckets(1000, 64) == [(0, 64), (64, 128), (128, 256), (256, 512), (512, 1000)]
    assert position_buckets(50, 64) == [(0, 50)]


def _layer_norm(x, w, b, eps):
    x = x.to(F64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * w.to(F64) + b.to(F64)


def _indexer_scores(sd, prefix, cfg, x, positions):
    """float64 ``[L, L]`` weighted-ReLU scores of the unquantized indexer (no rotation: it is
    orthonormal, so it leaves exact scores as they are)."""
    g = lambda k: sd[prefix + k].to(F64)  # noqa: E731
    L, H, D, rope = x.shape[0], cfg.index_n_heads, cfg.index_head_dim, cfg.qk_rope_head_dim
    q_lat = rms_norm(x @ g("q_a_proj.weight").T, g("q_a_layernorm.weight"), cfg.rms_norm_eps)
    q = (q_lat @ g("indexer.wq_b.weight").T).view(L, H, D)
    k = _layer_norm(x @ g("indexer.wk.weight").T, g("indexer.k_norm.weight"), g("indexer.k_norm.bias"),
                    cfg.index_k_norm_eps)
    inter = cfg.indexer_rope_interleave
    q = torch.cat([rope_complex(q[..., :rope], positions, cfg.rope_theta, inter), q[..., rope:]], dim=-1)
    k = torch.cat([rope_complex(k[:, :rope], positions, cfg.rope_theta, inter), k[:, rope:]], dim=-1)
    w = x @ g("indexer.weights_proj.weight").T * H**-0.5 * D**-0.5
    return (torch.einsum("mhd,nd->mhn", q, k).relu() * w[..., None]).sum(1)


def test_layer_figures_match_an_independent_float64_dense_attention_and_indexer():
    cfg = keep_layers(get_config("tiny"), 1)
    model = init_weights(build_model(cfg, F), seed=3).eval()
    n, k = 300, cfg.index_topk
    tokens = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(7))
    # One step (chunk ≥ n), so the layer's own one-shot indexer below picks what the prefill picked.
    report = selection_fidelity(model, tokens, rows=24, seed=1, chunked_prefill_size=320, kv_dtype="fp64",
                                budget_bytes=1 << 26)
    layer0 = report["layers"][0]
    assert (layer0["layer"], layer0["kind"], layer0["topk_from"]) == (0, "full", 0)
    rows = report["positions"]
    assert len(rows) == 24

    layer = model.model.layers[0]
    batch = ForwardBatch.contiguous([n])
    with torch.no_grad():
        x = layer.input_layernorm(model.model.embed_tokens(tokens))
        proj = layer.self_attn.project(x, batch.positions)
        topk = layer.self_attn.indexer(x, proj.q_latent, batch, KVCache(cfg, 5, "fp64").index_k[0],
                                       budget_bytes=1 << 26)
    sd = model.state_dict()
    prefix = "model.layers.0.self_attn."
    h = rms_norm(sd["model.embed_tokens.weight"][tokens], sd["model.layers.0.input_layernorm.weight"],
                 cfg.rms_norm_eps)
    positions = torch.arange(n)
    probs, _ = mla_probs(sd, prefix, cfg, h, positions)                         # [H, n, n]
    chosen = [{int(j) for j in topk[m] if 0 <= int(j) <= m} for m in range(n)]
    sparse = mla_dense(sd, prefix, cfg, h, positions, allowed=chosen)
    dense = mla_dense(sd, prefix, cfg, h, positions)
    scores = _indexer_scores(sd, prefix, cfg, h, positions)
    got = layer0["rows"]
    for i, m in enumerate(rows):
        keys = sorted(chosen[m])
        mean = probs[:, m, : m + 1].mean(0).tolist()
        best = sorted(range(m + 1), key=lambda j: (-mean[j], j))[:k]
        assert got["mass_kept"][i] == pytest.approx(float(probs[:, m, keys].sum(-1).mean()), abs=1e-12)
        assert got["mass_kept_worst_head"][i] == pytest.approx(float(probs[:, m, keys].sum(-1).min()), abs=1e-12)
        assert got["mass_best"][i] == pytest.approx(float(probs[:, m, best].sum(-1).mean()), abs=1e-12)
        assert got["overlap"][i] == len(set(keys) & set(best)) / len(best)
        assert got["calc_diff"][i] == pytest.approx(calc_diff(sparse[m], dense[m]), abs=1e-12)
        row = scores[m, : m + 1].tolist()
        ref = set(sorted(range(m + 1), key=lambda j: (-row[j], j))[:k])
        assert got["recall_fp32"][i] == len(set(keys) & ref) / len(ref)
        assert got["recall_fp32_unrotated"][i] == got["recall_fp32"][i]
    assert any(m >= k for m in rows) and min(got["mass_kept"]) < 0.9   # sparsity bites on later rows


def test_a_shared_layer_attending_like_its_full_layer_keeps_what_that_layer_keeps():
    # Layer 0 (full) leaves the residual stream as it is (zero o_proj and MLP down_proj), and
    # layer 1 (shared) has layer 0's attention weights: same scores, and it reuses layer 0's
    # top-k, so its figures are layer 0's.
    cfg = get_config("tiny").replace(name="tiny-pair", num_hidden_layers=2, indexer_types=("full", "shared"),
                                     first_k_dense_replace=2)
    model = init_weights(build_model(cfg, F), seed=4).eval()
    sd = model.state_dict()
    with torch.no_grad():
        sd["model.layers.0.self_attn.o_proj.weight"].zero_()
        sd["model.layers.0.mlp.down_proj.weight"].zero_()
        for name, t in sd.items():
            if name.startswith(("model.layers.1.self_attn.", "model.layers.1.input_layernorm.")) and \
                    not name.endswith("o_proj.weight"):
                t.copy_(sd[name.replace("layers.1.", "layers.0.")])
    tokens = torch.randint(0, cfg.vocab_size, (400,), generator=torch.Generator().manual_seed(8))
    report = selection_fidelity(model, tokens, rows=20, chunked_prefill_size=128, kv_dtype="fp64")
    full, shared = report["layers"]
    assert (shared["kind"], shared["topk_from"]) == ("shared", 0)
    for name in ("mass_kept", "mass_kept_worst_head", "mass_best", "overlap"):
        assert shared["rows"][name] == pytest.approx(full["rows"][name], abs=1e-13), name
    assert max(full["rows"]["mass_best"][i] - full["rows"]["mass_kept"][i] for i in range(20)) > 0.01
    assert max(shared["rows"]["calc_diff"]) > 1e-3   # its own o_proj: a real sparse-vs-dense error


def test_fidelity_command_prints_each_layer_and_says_random_weights_are_a_self_test(capsys):
    assert main(["fidelity", "--config", "tiny", "--tokens", "300", "--chunk", "128", "--rows", "12"]) == 0
    out = capsys.readouterr().out
    assert RANDOM_WEIGHTS_NOTE in out
    assert "== layer 0 (full: its own FP8 indexer)" in out
    assert "== layer 3 (shared: reuses layer 2's top-k)" in out
    assert "\nall " in out and "\n256-299 " in out


def test_fidelity_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "mass.png"
    assert main(["fidelity", "--config", "tiny", "--tokens", "200", "--chunk", "64", "--rows", "8", "--json",
                 "--plot", str(png)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["random_weights"] and report["tokens"] == 200 and len(report["positions"]) == 8
    assert [lay["kind"] for lay in report["layers"]] == ["full", "full", "full", "shared"]
    assert report["layers"][0]["summary"][-1]["positions"] == "all"
    # The hooks saw what the prefill ran: the FP8 top-k recomputed from them is the prefill's.
    for lay in report["layers"][:3]:
        assert lay["rows"]["recall_fp8_recomputed"] == [1.0] * 8
    for lay in report["layers"]:
        assert all(b >= k - 1e-6 for k, b in zip(lay["rows"]["mass_kept"], lay["rows"]["mass_best"]))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_fidelity_from_hidden_states_equals_the_run_from_the_ids_they_embed(tmp_path, capsys):
    from safetensors.torch import save_file

    cfg = get_config("tiny")
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(3))
    model = init_weights(build_model(cfg, torch.float32), seed=0)
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids).float()
    save_file({"request.0.input_ids": ids}, tmp_path / "ids.safetensors")
    save_file({"request.0.hidden": hidden.contiguous()}, tmp_path / "hidden.safetensors")
    common = ["fidelity", "--config", "tiny", "--chunk", "64", "--rows", "8", "--json"]
    reports = []
    for flag, name in (("--input-ids", "ids"), ("--input-hidden", "hidden")):
        assert main([*common, flag, str(tmp_path / f"{name}.safetensors")]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert [lay["rows"] for lay in reports[0]["layers"]] == [lay["rows"] for lay in reports[1]["layers"]]


@pytest.mark.cuda
def test_fidelity_runs_on_cuda_in_bf16_with_the_triton_backend():
    cfg = get_config("small")
    model = init_weights(build_model(cfg, torch.bfloat16, "cuda"), seed=0).eval()
    tokens = torch.randint(0, cfg.vocab_size, (1500,), generator=torch.Generator().manual_seed(9))
    report = selection_fidelity(model, tokens, rows=32, chunked_prefill_size=512, backend="triton")
    assert (report["backend"], report["dtype"]) == ("triton", "bfloat16")
    assert report["device"].startswith("cuda")
    for lay in report["layers"]:
        rows = lay["rows"]
        assert all(b >= k - 1e-5 for k, b in zip(rows["mass_kept"], rows["mass_best"]))
        assert all(math.isfinite(c) for c in rows["calc_diff"])
        if lay["kind"] == "full":   # the Triton top-k differs from the reference only at near-ties
            assert sum(rows["recall_fp8_recomputed"]) / 32 > 0.99


def test_fidelity_with_a_checkpoint_has_no_random_weights_note(capsys):
    assert main(["fidelity", "--config", "weights_stub/tiny", "--weights", "weights_stub/tiny", "--tokens", "100",
                 "--chunk", "64", "--rows", "4"]) == 0
    out = capsys.readouterr().out
    assert "weights weights_stub/tiny" in out and RANDOM_WEIGHTS_NOTE not in out


@pytest.mark.parametrize("argv, needle", [
    (["--tokens", "100", "--rows", "0"], "--rows 0 must be ≥ 1"),
    (["--tokens", "100", "--request", "1"], "--request 1 must lie in [0, 1)"),
    (["--rows", "4"], "--tokens N"),
])
def test_fidelity_rejects_bad_input_in_one_line(argv, needle, capsys):
    assert main(["fidelity", "--config", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
