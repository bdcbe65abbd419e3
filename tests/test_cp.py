"""Context-parallel prefill (glm_dsa.cp) over gloo: cp = 2, 3, 4 give one rank's answer.

Each cp degree is one spawn of real processes (``glm_dsa.cp.launch``); every rank runs all the
scenarios below and saves its outputs, caches and per-step counters, which the tests compare
with a one-rank run in this process and with the ledger.

Why the float32 bounds are not 1e-5 everywhere: under CP each rank runs its GEMMs on about
n / cp rows (and every MoE expert on another subset of rows) where one rank runs them on n. CPU
BLAS rounds a row differently for different row counts (MKL takes another path for 1–3, 5–7,
9–11 rows), so a token's float32 values can differ in the last bit from the one-rank run
(measured: fp32 KV caches differ by ~1e-7 relative). Rounding such a value to bf16 (or FP8)
can then move it by one bf16 step (2^-8 relative; 2^-3 for e4m3), and a near-tied top-k choice
can follow. Measured over 6 random scenarios × cp 2, 3, 4 × the three splits: outputs within
5.8e-7 (fp32 KV), 2.7e-5 (bf16 KV) and 7.9e-5 (FP8 KV) — the same effect and the same bounds as
chunk invariance (tests/test_prefill.py): 1e-5 / 1e-4 / 5e-4. The strict equivalence is
therefore checked in float64 with an fp64 cache, where a last-bit difference is ~1e-16 and
flips nothing: ≤ 1e-10 (measured ≤ 2e-15), and the FP8 index-K pages are byte-identical.

The logits are the exception: ``DSAForCausalLM.logits`` is a float32 GEMM in every model dtype,
and a rank runs on ``cores // cp`` threads while the one-rank run here runs on 2
(tests/conftest.py). MKL rounds a one-row float32 GEMM by its thread count (``tiny``'s
``[1, 128] × [128, 512]``: 1, 2, 8 and 16 threads agree, 3 and 5 differ by 2e-6, 2026-12-01,
this host), so on a 16-core host (5 threads per rank at cp = 3) the float64 runs' logits
differed by 1.3e-8 relative (reproduced here, to the last digit, with ``os.cpu_count`` made to
say 16 in the ranks). They are
checked against the float32 dot-product error bound instead (``_assert_float32_logits_agree``).
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import example, given
from hypothesis import strategies as st

from glm_dsa.batch import COMM_OPS, CP_SPLITS
from glm_dsa.cli import main as cli_main
from glm_dsa.config import PRESETS
from glm_dsa.cp import CPGroup, launch, split_rows
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.ledger import cp_comm_bytes_per_chunk, cp_indexer_pairs_per_rank, cp_rank_positions
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights

# Two layers cover a full (indexer) and a shared layer, a dense MLP and a MoE with padded rows
# masked out; absorbed sparse attention everywhere (the MHA path is checked separately below).
CFG = PRESETS["tiny"].replace(
    num_hidden_layers=2, indexer_types=("full", "shared"), dense_attn_kv_len_threshold=0
)
CFG_MHA = CFG.replace(dense_attn_kv_len_threshold=2048)  # contexts ≤ 64 take the MHA path
TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5, "bf16": 1e-4}
# Whole-pool relative error of the main KV cache. One bf16 flip moves an element by 2^-8 of
# itself, ~2e-5 of a small test pool's norm, and a flip in layer 0 moves more values in layer 1:
# measured 2.6e-6 here, 1.0e-4 in other scenarios; any misplaced row would be O(1).
CACHE_TOLERANCE = {"fp64": 1e-10, "fp32": 1e-5, "bf16": 1e-3}
BENCH_CP = Path(__file__).resolve().parents[1] / "scripts" / "bench_cp.py"

# name -> (config, [(length, seed, shares_first_tokens_of_previous)], chunk). Requests of a
# scenario are queued together unless they share a prefix, which needs the previous one done.
SCENARIOS = {
    # several requests in one step; lengths not divisible by cp; a 3-token request
    "requests": (CFG, [(70, 1, 0), (3, 2, 0), (130, 3, 0)], 128),
    # a chunk of 2 tokens: shorter than cp = 3 or 4, some ranks hold only padding
    "short": (CFG, [(2, 4, 0)], 64),
    # step 1: 192 tokens, prefix 0 (divisible by 2, 3, 4); step 2: 8 tokens after 192; then a
    # prefix-cache hit of 192 tokens and a 37-token chunk after it
    "prefix": (CFG, [(200, 5, 0), (229, 6, 192)], 192),
    # the MHA one-shot path under CP (longest context 50 ≤ min(2048, index_topk))
    "mha": (CFG_MHA, [(50, 7, 0)], 64),
}


# (scenario, dtype, kv_dtype, split) runs of every cp degree
RUNS = (
    [(s, "float64", "fp64", "interleave") for s in SCENARIOS]
    + [(s, "float32", "bf16", "interleave") for s in ("requests", "short", "prefix")]
    + [("requests", "float32", "fp32", "interleave")]
    + [(s, "float64", "fp64", split) for s in ("requests", "prefix") for split in ("contiguous", "zigzag")]
)


def _prompts(scenario: str) -> list[torch.Tensor]:
    _, spec, _ = SCENARIOS[scenario]
    prompts: list[torch.Tensor] = []
    for length, seed, shared in spec:
        gen = torch.Generator().manual_seed(seed)
        fresh = torch.randint(0, CFG.vocab_size, (length - shared,), generator=gen)
        prompts.append(torch.cat([prompts[-1][:shared], fresh]) if shared else fresh)
    return prompts


@functools.lru_cache(maxsize=None)
def _model(config, dtype: str) -> DSAForCausalLM:
    return init_weights(DSAForCausalLM(config), seed=3).to(getattr(torch, dtype)).eval()


def _run(scenario: str, dtype: str, kv_dtype: str, group: CPGroup | None) -> dict:
    """Run a scenario; returns outputs, caches, bytes written and per-step CP counters."""
    config, spec, chunk = SCENARIOS[scenario]
    eng = PrefillEngine(_model(config, dtype), num_pages=16, kv_dtype=kv_dtype,
                        chunked_prefill_size=chunk, budget_bytes=1 << 22, cp_group=group)
    rids, steps = [], []

    def run_recording_each_step() -> None:
        while True:
            pairs = group.indexer_pairs if group else 0
            comm = {op: vars(c).copy() for op, c in group.comm.items()} if group else {}
            record = eng.step()
            if record is None:
                return
            steps.append({
                "chunks": record.chunks,
                "pairs": (group.indexer_pairs - pairs) if group else None,
                "comm": {op: {k: vars(group.comm[op])[k] - v for k, v in comm[op].items()} for op in comm},
            })

    for prompt, (_, _, shared) in zip(_prompts(scenario), spec):
        if shared:
            run_recording_each_step()  # the previous request is done (and cached) before the hit
        rids.append(eng.add_request(prompt))
    run_recording_each_step()
    return {
        "hidden": [eng.output_hidden(r) for r in rids],
        "logits": [eng.finished[r].logits for r in rids],
        "mla": {k: v.clone() for k, v in eng.cache.mla.items()},
        "index_k": {k: v.clone() for k, v in eng.cache.index_k.items()},
        "bytes_written": dict(eng.bytes_written),
        "steps": steps,
    }


def _bench_module():
    spec = importlib.util.spec_from_file_location("bench_cp", BENCH_CP)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH_ARGS = ["--config", "tiny", "--layers", "2", "--tokens", "150", "--chunk", "64",
              "--device", "cpu", "--kv-dtype", "fp32", "--split", "zigzag"]


def _rank_worker(out_dir: str) -> None:
    rank, size = dist.get_rank(), dist.get_world_size()
    results = {}
    for scenario, dtype, kv_dtype, split in RUNS:
        results[(scenario, dtype, kv_dtype, split)] = _run(scenario, dtype, kv_dtype, CPGroup(split))
    if size == 2:
        bench = _bench_module()
        results["bench"] = bench.bench(bench.parse_args(BENCH_ARGS), torch.device("cpu"))
    torch.save(results, f"{out_dir}/rank{rank}.pt")


@functools.lru_cache(maxsize=None)
def _cp_results(cp: int) -> list[dict]:
    """Every rank's results of one spawn of ``cp`` ranks, in rank order."""
    with tempfile.TemporaryDirectory() as d:
        launch(_rank_worker, cp, "cpu", (d,))
        return [torch.load(f"{d}/rank{r}.pt", weights_only=False) for r in range(cp)]


@functools.lru_cache(maxsize=None)
def _one_rank(scenario: str, dtype: str, kv_dtype: str) -> dict:
    return _run(scenario, dtype, kv_dtype, None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def _assert_float32_logits_agree(lg: torch.Tensor, lg_ref: torch.Tensor, h: torch.Tensor,
                                 h_ref: torch.Tensor, model: DSAForCausalLM) -> None:
    """``lg`` and ``lg_ref`` (float32 ``[vocab]``) are the logits of last hidden rows ``h`` and
    ``h_ref`` (``[hidden]``, before the final norm): each a float32 GEMM, of ``a = norm(h)``
    rounded to float32, in an order of summation that depends on the thread count.

    Any order of a K-term float32 dot product lies within ``γ_K Σ|aᵢ wᵢ|`` of the exact one
    (``γ_K = K u / (1 - K u)``, ``u = 2⁻²⁴``; an FMA rounds less, not more), and rounding ``a`` to
    float32 moves it by ``u |a|`` more, so with γ_{K+1} for both:
    ``|lg - lg_ref| ≤ γ_{K+1} (|a| + |a_ref|) |W|ᵀ + |a - a_ref| |W|ᵀ``, element by element
    (``W`` the float32 ``lm_head`` weight). A misplaced or stale row is off by O(1), far beyond.
    """
    with torch.no_grad():
        w = model.lm_head.weight.float().double().abs()             # [vocab, K]
        a, a_ref = (model.model.norm(x[None]).double()[0] for x in (h, h_ref))
    k = w.shape[1]
    gamma = (k + 1) * 2.0**-24 / (1 - (k + 1) * 2.0**-24)
    bound = gamma * (w @ (a.abs() + a_ref.abs())) + w @ (a - a_ref).abs()
    excess = (lg.double() - lg_ref.double()).abs() - bound
    assert bool((excess <= 0).all()), f"logits off the float32 GEMM bound by up to {float(excess.max()):.3g}"


def _cache_values(pool: torch.Tensor, kv_dtype: str) -> torch.Tensor:
    return pool.view(torch.bfloat16) if kv_dtype == "bf16" else pool


# ----------------------------------------------------------------------------- the split
def _expected_rows(n: int, cp: int, split: str) -> list[list[int]]:
    """Independent definition: token -> rank, by the rule of each split."""
    if split == "interleave":
        owner = [i % cp for i in range(n)]
    else:
        blocks = cp if split == "contiguous" else 2 * cp
        block_of = []
        for b in range(blocks):
            block_of += [b] * (n // blocks + (1 if b < n % blocks else 0))
        owner = [b if split == "contiguous" else min(b, 2 * cp - 1 - b) for b in block_of]
    return [[i for i in range(n) if owner[i] == r] for r in range(cp)]


@given(n=st.integers(1, 300), cp=st.integers(1, 9), split=st.sampled_from(CP_SPLITS))
@example(n=2, cp=4, split="interleave")  # fewer tokens than ranks
def test_split_deals_every_token_to_one_rank_by_the_rule_of_the_split(n, cp, split):
    rows = split_rows(n, cp, split)
    assert [r.tolist() for r in rows] == _expected_rows(n, cp, split)
    assert [r.tolist() for r in rows] == cp_rank_positions(n, cp, split)
    assert max(r.numel() for r in rows) == math.ceil(n / cp)  # the padded length


def test_split_and_group_reject_bad_input_with_a_reason():
    with pytest.raises(ValueError, match="positive number of tokens"):
        split_rows(0, 2)
    with pytest.raises(ValueError, match="positive number of ranks"):
        split_rows(5, 0)
    with pytest.raises(ValueError, match="choose one of"):
        split_rows(5, 2, "round-robin")
    with pytest.raises(ValueError, match="not initialized"):
        CPGroup()


# ----------------------------------------------------------------------------- equivalence
@pytest.mark.parametrize("cp", [2, 3, 4])
def test_cp_ranks_give_one_ranks_outputs_and_caches(cp):
    ranks = _cp_results(cp)
    for key in RUNS:
        scenario, dtype, kv_dtype, split = key
        got, ref = ranks[0][key], _one_rank(scenario, dtype, kv_dtype)
        tol = TOLERANCE[kv_dtype]
        for h, h_ref, lg, lg_ref in zip(got["hidden"], ref["hidden"], got["logits"], ref["logits"]):
            assert h.shape == h_ref.shape
            assert rel_err(h, h_ref) <= tol, key
            if kv_dtype == "fp64":  # float64 hidden states, float32 logits: see the module docstring
                _assert_float32_logits_agree(lg, lg_ref, h[-1], h_ref[-1], _model(SCENARIOS[scenario][0], dtype))
            else:
                assert rel_err(lg, lg_ref) <= tol, key
        assert got["bytes_written"] == ref["bytes_written"], key
        for layer, pool in ref["mla"].items():
            values = _cache_values(got["mla"][layer], kv_dtype)
            assert rel_err(values, _cache_values(pool, kv_dtype)) <= CACHE_TOLERANCE[kv_dtype], (key, layer)
        if kv_dtype == "fp64":  # no rounding flips: the FP8 index-K pages are the same bytes
            for layer, pages in ref["index_k"].items():
                assert torch.equal(got["index_k"][layer], pages), (key, layer)


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_rank_holds_the_whole_caches_and_outputs(cp):
    ranks = _cp_results(cp)
    for key in RUNS:
        first = ranks[0][key]
        for other in ranks[1:]:
            mine = other[key]
            assert all(torch.equal(a, b) for a, b in zip(mine["hidden"], first["hidden"]))
            for pools in ("mla", "index_k"):
                assert all(torch.equal(mine[pools][k], first[pools][k]) for k in first[pools])


# ----------------------------------------------------------------------------- counters
def _single_request_steps(cp: int, split: str):
    """(rank_records, n, prefix) of every one-request step of the runs with ``split``."""
    ranks = _cp_results(cp)
    for key in RUNS:
        if key[3] != split:
            continue
        for i, step in enumerate(ranks[0][key]["steps"]):
            if len(step["chunks"]) == 1:
                (_, start, end), = step["chunks"]
                yield [r[key]["steps"][i] for r in ranks], end - start, start


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("split", CP_SPLITS)
def test_indexer_pairs_per_rank_match_the_ledger(cp, split):
    full_layers = len(CFG.full_layers)
    seen = 0
    for records, n, prefix in _single_request_steps(cp, split):
        pairs = [rec["pairs"] for rec in records]
        assert pairs == [full_layers * p for p in cp_indexer_pairs_per_rank(n, cp, split, prefix)]
        # independent: query i of the chunk scores the prefix and the chunk up to itself
        owned = _expected_rows(n, cp, split)
        assert pairs == [full_layers * sum(prefix + i + 1 for i in rows) for rows in owned]
        seen += 1
    assert seen >= 3


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_contiguous_split_loads_the_last_rank_about_2p_minus_1_times_the_first(cp):
    # prefix step 1: 192 tokens, no prefix, blocks of b = 192 / cp. Rank r sums i + 1 over its
    # block: b (r b) + b (b + 1) / 2, so last / first = ((2p - 1) b + 1) / (b + 1) → 2p − 1.
    for records, n, prefix in _single_request_steps(cp, "contiguous"):
        if n == 192 and prefix == 0:
            b = n // cp
            assert records[-1]["pairs"] * (b + 1) == records[0]["pairs"] * ((2 * cp - 1) * b + 1)
            assert records[-1]["pairs"] / records[0]["pairs"] == pytest.approx(2 * cp - 1, rel=0.04)
            return
    pytest.fail("no 192-token step without prefix was run")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_bytes_gathered_per_chunk_match_the_ledger(cp):
    ranks = _cp_results(cp)
    for key in RUNS:
        elem = torch.finfo(getattr(torch, key[1])).bits // 8
        for i, step in enumerate(ranks[0][key]["steps"]):
            n = sum(end - start for _, start, end in step["chunks"])
            # the index key is gathered unquantized (index_head_dim values), the latent
            # [c | k_pe] as computed, both in the activation dtype
            rows = {r.op: r for r in cp_comm_bytes_per_chunk(
                CFG, n, cp, index_k_bytes_per_token=CFG.index_head_dim * elem,
                latent_bytes_per_token=CFG.kv_latent_dim * elem)}
            for rank in ranks:
                comm = rank[key]["steps"][i]["comm"]
                for op in ("index_k_allgather", "latent_allgather"):
                    assert comm[op] == {"collectives": rows[op].count, "bytes": rows[op].total,
                                        "local_bytes": rows[op].count * rows[op].local_bytes_each}
                # the ledger prices the boundary gather in bf16; ours moves the activation dtype
                b = rows["cp_boundary_gather"]
                assert comm["cp_boundary_gather"] == {
                    "collectives": 1, "bytes": b.bytes_each * elem // 2,
                    "local_bytes": b.local_bytes_each * elem // 2}
                # independent: per layer, n rows gathered, ceil(n / cp) rows sent by each rank
                layers = {"index_k_allgather": 1, "latent_allgather": 2, "cp_boundary_gather": 1}
                width = {"index_k_allgather": 128, "latent_allgather": 144, "cp_boundary_gather": 128}
                for op in COMM_OPS:
                    assert comm[op]["bytes"] == layers[op] * n * width[op] * elem
                    assert comm[op]["local_bytes"] == layers[op] * -(-n // cp) * width[op] * elem


# ----------------------------------------------------------------------------- cli, bench
def test_prefill_cli_with_two_ranks_saves_one_ranks_outputs(tmp_path, capfd):
    common = ["prefill", "--config", "tiny", "--tokens", "150", "--requests", "2", "--chunk", "64",
              "--prefix", "70", "--kv-dtype", "fp32", "--no-progress", "--json"]
    assert cli_main(common + ["--cp", "2", "--save-outputs", str(tmp_path / "cp2.safetensors")]) == 0
    report = json.loads(capfd.readouterr().out)
    assert cli_main(common + ["--cp", "1", "--save-outputs", str(tmp_path / "cp1.safetensors")]) == 0
    single = json.loads(capfd.readouterr().out)
    from safetensors.torch import load_file

    cp2, cp1 = load_file(tmp_path / "cp2.safetensors"), load_file(tmp_path / "cp1.safetensors")
    assert cp2.keys() == cp1.keys()
    for name in cp1:
        assert rel_err(cp2[name], cp1[name]) <= TOLERANCE["fp32"], name
    assert report["cache"] == single["cache"]
    cp = report["context_parallel"]
    assert (cp["cp"], cp["split"]) == (2, "interleave") and "context_parallel" not in single
    # Two requests of 150 tokens with a 64-token prefix hit each (the warm-up is not counted):
    # the 86 new tokens of each are scored against position + 1 keys in every full layer;
    # tiny has 3 full layers.
    expected_total = 3 * 2 * sum(p + 1 for p in range(64, 150))
    assert sum(r["indexer_pairs"] for r in cp["ranks"]) == expected_total


def test_bench_cp_parses_its_defaults_and_matches_one_rank_and_the_ledger():
    bench = _bench_module()
    args = bench.parse_args(["--out", "x"])
    assert (args.tokens, args.chunk, args.config, args.layers, args.split, args.device) == (
        131072, 32768, "glm-5.3", 1, "interleave", "cuda")
    result = _cp_results(2)[0]["bench"]
    assert result["cp"] == 2 and result["split"] == "zigzag"
    assert [s["tokens"] for s in result["steps"]] == [64, 64, 22]
    assert result["matches_ledger"]
    assert all(c["rel_err"] <= TOLERANCE["fp32"] for c in result["check_per_rank"])
