"""One H200 run: the ceilings, then GLM-5.3 components, a full-size chunked prefill, and
Hugging Face transformers' ``glm_moe_dsa`` layer on the same weights.

    python scripts/bench.py --out DIR [--parts moe,indexer,mla,prefill,hf,peers]
        [--prefill-tokens 32768,131072] [--hf-tokens 2048,8192,16384,24576] [--profile]
        [--peer-queries 4096,32768]

``peers`` (not in the default parts; needs ``deep_gemm`` and ``flash_mla_sparse_sm90``
importable) puts DeepGEMM's ``fp8_mqa_logits`` and FlashMLA's sparse prefill beside the
oracle's reference and, when ``glm_dsa.kernels`` has them, the Triton kernels, on the same
inputs: a causal chunk of each ``--peer-queries`` rows at the end of 131,072 keys.

The ceilings are always measured first. Every figure is measured in this run; each is printed
beside the floor it is compared with (ledger FLOPs at the measured ceilings). Writes
DIR/bench.json and the same figures as Markdown tables in DIR/RESULTS.md after every
measurement (and DIR/profile_*.txt with ``--profile``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time

import torch
from torch import Tensor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

from glm_dsa import oracle, peers
from glm_dsa.config import PRESETS, DSAConfig
from glm_dsa.budget import Budgets, default_logits_bytes, max_logit_rows
from glm_dsa.indexer import indexer_topk, mqa_logits, topk_per_row
from glm_dsa.ledger import op_flops, sparse_mla_keys
from glm_dsa.mla import sparse_mla_fwd
from glm_dsa.prefill import PrefillEngine

from benchlib import calc_diff, median_seconds, sync

GLM = PRESETS["glm-5.3"]
GB = 1e9


def _peak(fn) -> tuple[float, int, int]:
    """(seconds, bytes allocated before, peak bytes during) of one call of ``fn``."""
    sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t, before, torch.cuda.max_memory_allocated()


def ceilings() -> dict:
    dev = "cuda"
    x = torch.empty(int(4e9), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = median_seconds(lambda: y.copy_(x), warmup=2, reps=5)
    copy_bw = 2 * x.numel() / t
    del x, y
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / median_seconds(lambda: a @ b, warmup=3, reps=10)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=dev)
    fp8 = 2 * n**3 / median_seconds(
        lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), warmup=3, reps=10
    )
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": bf16, "fp8_flops_per_s": fp8}


def random_moe(cfg: DSAConfig):
    """A bf16 ``MoE`` of ``cfg`` on the GPU, every parameter ``N(0, 1/fan_in)`` from seed 0."""
    from glm_dsa.moe import MoE

    with torch.device("meta"):
        moe = MoE(cfg).to(torch.bfloat16)
    moe = moe.to_empty(device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5).to(p.dtype))
    return moe


def bench_moe(ceil: dict, tokens: int = 32768) -> dict:
    cfg = GLM
    moe = random_moe(cfg)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    budget = Budgets.default("cuda").moe_bytes  # as a prefill step runs it
    with torch.no_grad():
        t = median_seconds(lambda: moe(x, budget_bytes=budget), warmup=1, reps=3)
        _, before, peak = _peak(lambda: moe(x, budget_bytes=budget))
    f = {op.op: op.flops_per_token for op in op_flops(cfg)}
    flops = tokens * (f["moe_experts"] + f["shared_experts"] + f["router_gate"])
    return {
        "tokens": tokens, "seconds": t, "tflops": flops / t / 1e12,
        "floor_seconds": flops / ceil["bf16_flops_per_s"], "extra_peak_gb": (peak - before) / GB,
        "moe_budget_bytes": budget,
    }


def bench_indexer(ceil: dict, queries: int, keys: int) -> dict:
    """One chunk of ``queries`` rows at the end of a ``keys``-long causal context."""
    cfg, dev = GLM, "cuda"
    gen = torch.Generator(device=dev).manual_seed(1)
    H, D = cfg.index_n_heads, cfg.index_head_dim
    q_fp8 = (torch.randn(queries, H, D, device=dev, generator=gen) * 20).to(torch.float8_e4m3fn)
    k_fp8 = (torch.randn(keys, D, device=dev, generator=gen) * 20).to(torch.float8_e4m3fn)
    k_scale = torch.rand(keys, device=dev, generator=gen) * 1e-2 + 1e-3
    w = torch.randn(queries, H, device=dev, generator=gen) * 1e-2
    prefix = keys - queries
    ks = torch.zeros(queries, dtype=torch.int32, device=dev)
    ke = (prefix + torch.arange(queries, device=dev) + 1).to(torch.int32)
    budget = default_logits_bytes(dev)
    inputs = sum(t.numel() * t.element_size() for t in (q_fp8, k_fp8, k_scale, w, ks, ke))
    seconds, before, peak = _peak(lambda: indexer_topk(q_fp8, w, k_fp8, k_scale, ks, ke, cfg.index_topk, budget))
    pairs = queries * prefix + queries * (queries + 1) // 2
    flops = pairs * 2 * H * D
    # The logits / top-k split, on the last row chunk (the widest): the same calls indexer_topk
    # makes, timed apart.
    rows = max_logit_rows(queries, keys, budget)
    r0, hi = queries - rows, keys
    starts = ks[r0:]
    ends = ke[r0:]
    logits_s = median_seconds(lambda: mqa_logits(q_fp8[r0:], k_fp8[:hi], k_scale[:hi], w[r0:], starts, ends,
                                         clean_logits=False), warmup=1, reps=2)
    logits = mqa_logits(q_fp8[r0:], k_fp8[:hi], k_scale[:hi], w[r0:], starts, ends, clean_logits=False)
    topk_s = median_seconds(lambda: topk_per_row(logits, starts, ends, cfg.index_topk), warmup=1, reps=2)
    del logits
    out_bytes = queries * cfg.index_topk * 4
    return {
        "queries": queries, "keys": keys, "budget_gb": budget / GB, "inputs_gb": inputs / GB,
        "peak_gb": peak / GB, "peak_over_inputs_gb": (peak - before) / GB,
        "limit_gb": 1.1 * (inputs + budget) / GB, "topk_out_gb": out_bytes / GB,
        "seconds": seconds, "tflops": flops / seconds / 1e12,
        "floor_seconds_fp8": flops / ceil["fp8_flops_per_s"],
        "last_chunk_rows": rows, "last_chunk_logits_seconds": logits_s, "last_chunk_topk_seconds": topk_s,
    }


def bench_mla(ceil: dict, queries: int = 32768, keys: int = 131072) -> dict:
    cfg, dev = GLM, "cuda"
    gen = torch.Generator(device=dev).manual_seed(2)
    H, d = cfg.num_attention_heads, cfg.kv_latent_dim
    q = torch.randn(queries, H, d, device=dev, dtype=torch.bfloat16, generator=gen)
    kv = torch.randn(keys, 1, d, device=dev, dtype=torch.bfloat16, generator=gen)
    prefix = keys - queries
    rows = prefix + torch.arange(queries, device=dev)
    idx = (torch.rand(queries, cfg.index_topk, device=dev, generator=gen) * (rows[:, None] + 1)).to(torch.int32)
    idx = idx[:, None, :]
    budget = 4 << 30
    fn = lambda: sparse_mla_fwd(q, kv, idx, cfg.softmax_scale, d_v=cfg.kv_lora_rank, budget_bytes=budget)  # noqa: E731
    seconds, before, peak = _peak(fn)
    # float32 out [s_q, h, 512] plus max_logits and lse: the results, not temporaries
    results = queries * H * (cfg.kv_lora_rank + 2) * 4
    flops = queries * H * cfg.index_topk * 2 * (d + cfg.kv_lora_rank)
    return {
        "queries": queries, "keys": keys, "topk": cfg.index_topk, "budget_gb": budget / GB,
        "seconds": seconds, "tflops": flops / seconds / 1e12, "floor_seconds": flops / ceil["bf16_flops_per_s"],
        "results_gb": results / GB, "temporaries_peak_gb": (peak - before - results) / GB,
    }


def _one_layer_model(**changes) -> torch.nn.Module:
    """One full-width GLM-5.3 layer (full indexer, MoE) in bf16 on the GPU, ``init_weights`` seed 0.

    Built on the meta device and filled on the GPU: initialising the 5.4e9 parameters on the
    host first costs about a minute per model.
    """
    from glm_dsa.layer import DSAForCausalLM
    from glm_dsa.weights import init_weights

    cfg = GLM.replace(name="glm-5.3-one-layer", num_hidden_layers=1, first_k_dense_replace=0, **changes)
    with torch.device("meta"):
        model = DSAForCausalLM(cfg).to(torch.bfloat16)
    return init_weights(model.to_empty(device="cuda"), 0).eval()


def bench_prefill(ceil: dict, tokens: int, entry: dict, save, chunk: int = 32768,
                  backend: str = "reference", attention_precision: str = "bf16") -> None:
    """Chunked prefill of one ``tokens``-long prompt; fills ``entry`` step by step and calls
    ``save()`` after each step, so a run stopped by a time limit keeps its finished steps.
    ``attention_precision``: the engine's (``PrefillEngine``); "fp8" runs the fast path, not
    the batch-invariant one (``entry["batch_invariant"]`` records which ran)."""
    model = _one_layer_model()
    cfg = model.config
    # First-call set-up out of the timings: the allocator, and on the triton backend Triton's
    # autotuning, which runs once per shape class (the logits kernel's classes change with the
    # prefix), so that backend warms up with a prefill of the same length.
    warm_tokens = tokens if backend == "triton" else 2 * chunk
    warm = PrefillEngine.for_prompts(model, [warm_tokens], kv_dtype="fp8", chunked_prefill_size=chunk,
                                     compute_logits=False, prefix_caching=False, backend=backend,
                                     attention_precision=attention_precision)
    warm.add_request(torch.arange(warm_tokens) % cfg.vocab_size)
    warm.run()
    del warm
    engine = PrefillEngine.for_prompts(model, [tokens], kv_dtype="fp8", chunked_prefill_size=chunk,
                                       prefix_caching=False, compute_logits=False, timing=True,
                                       backend=backend, attention_precision=attention_precision)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    engine.add_request(ids)
    flops = component_flops(cfg, tokens)
    floors = {k: flops[k][0] / ceil["bf16_flops_per_s"] + flops[k][1] / ceil["fp8_flops_per_s"] for k in flops}
    entry.update(tokens=tokens, chunk=chunk, backend=backend, attention_precision=attention_precision,
                 batch_invariant=engine.batch_invariant, steps=[], floor_seconds=sum(floors.values()),
                 component_floor_seconds=floors, component_flops=flops)
    sync()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()

    def on_step(s) -> None:
        entry["steps"].append(
            {"step": s.step, "start": s.chunks[0][1], "end": s.chunks[0][2], "seconds": s.seconds,
             "indexer": s.indexer, "attention": s.attention, "moe": s.moe, "projections": s.projections,
             "peak_gb": torch.cuda.max_memory_allocated() / GB})
        entry["wall_seconds"] = time.perf_counter() - t0
        print("  step", json.dumps(entry["steps"][-1]), flush=True)
        save()

    engine.run(on_step)
    steps = entry["steps"]
    totals = {k: sum(s[k] for s in steps) for k in flops}
    entry.update(peak_gb=torch.cuda.max_memory_allocated() / GB, totals=totals,
                 component_tflops={k: (flops[k][0] + flops[k][1]) / totals[k] / 1e12 for k in flops})
    del engine, model


def component_flops(cfg: DSAConfig, tokens: int) -> dict[str, tuple[int, int]]:
    """Ledger FLOPs of one full MoE layer over a ``tokens``-long prompt, per timed component:
    ``(bf16 FLOPs, fp8 FLOPs)``. The split follows ``DecoderLayer``'s timers: projections = the
    q/kv down and q up projections; indexer = its projections (bf16) and the ``(query, key)``
    logits (fp8, the causal pairs); attention = absorption, sparse MLA over the keys each
    position really has, ``o_proj``; moe = router, routed and shared experts."""
    f = {op.op: op.flops_per_token for op in op_flops(cfg)}
    pairs = tokens * (tokens + 1) // 2
    mla = f["sparse_mla"] // cfg.index_topk * sparse_mla_keys(cfg, 0, tokens)
    return {
        "projections": (tokens * (f["a_proj"] + f["q_up"]), 0),
        "indexer": (tokens * (f["index_k"] + f["index_q"] + f["index_gate"]),
                    pairs * 2 * cfg.index_n_heads * cfg.index_head_dim),
        "attention": (tokens * (f["q_absorb"] + f["out_absorb"] + f["o_proj"]) + mla, 0),
        "moe": (tokens * (f["router_gate"] + f["moe_experts"] + f["shared_experts"]), 0),
    }


def _overlap(a: Tensor, b: Tensor, n_keys: Tensor, topk: int, block: int = 1024) -> tuple[float, int]:
    """Mean ``|A_i ∩ B_i| / topk`` over the rows with more than ``topk`` keys, and their count.

    a, b: int ``[S, topk]`` token indices of one request (rows with more than ``topk`` keys hold
    no padding); n_keys: ``[S]`` keys each row may choose from.
    """
    rows = (n_keys > topk).nonzero().flatten()
    if rows.numel() == 0:
        return 1.0, 0
    width = int(n_keys.max())
    total = 0
    for i in range(0, rows.numel(), block):
        r = rows[i : i + block]
        chosen = torch.zeros(r.numel(), width, dtype=torch.bool, device=a.device)
        chosen.scatter_(1, a[r].long(), True)
        total += int(chosen.gather(1, b[r].long()).sum())
    return total / (rows.numel() * topk), rows.numel()


def _param_bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


@contextlib.contextmanager
def _index_topk(model: torch.nn.Module, hf: torch.nn.Module | None, topk: int):
    """Run ``model`` (and ``hf``) with ``index_topk = topk``: the weights do not depend on it."""
    configs = {m: m.config for m in model.modules() if isinstance(getattr(m, "config", None), DSAConfig)}
    hf_indexers = [m for m in hf.modules() if hasattr(m, "index_topk")] if hf is not None else []
    old_hf = [m.index_topk for m in hf_indexers]
    try:
        for m, c in configs.items():
            m.config = c.replace(index_topk=topk)
        for m in hf_indexers:
            m.index_topk = topk
        yield
    finally:
        for m, c in configs.items():
            m.config = c
        for m, k in zip(hf_indexers, old_hf):
            m.index_topk = k


def _run_ours(model, ids: Tensor, kv_dtype: str, timing: bool = False, chunk: int = 32768,
              backend: str = "reference", engine: PrefillEngine | None = None, cuda_graphs: bool | None = None):
    """One chunked prefill of ``ids``: (seconds, peak bytes, hidden [L, hidden] on the GPU, engine).
    ``engine``: reuse it (its cache and captured CUDA graphs), as a server does; else a new one."""
    if engine is None:
        engine = PrefillEngine.for_prompts(model, [ids.numel()], kv_dtype=kv_dtype, chunked_prefill_size=chunk,
                                           prefix_caching=False, compute_logits=False, timing=timing,
                                           backend=backend, cuda_graphs=cuda_graphs)
    rid = engine.add_request(ids)
    sync()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine.run()
    sync()
    return time.perf_counter() - t0, torch.cuda.max_memory_allocated(), engine.output_hidden(rid), engine


def _time_ours(model, ids: Tensor, backend: str, cuda_graphs: bool | None, reps: int = 2) -> dict:
    """Best of ``reps`` prefills on one engine after a warm-up run on it (which captures its CUDA
    graphs): seconds, peak bytes above what was allocated before the engine, hidden, engine."""
    base = torch.cuda.memory_allocated()
    warm = _run_ours(model, ids, "fp8", backend=backend, cuda_graphs=cuda_graphs)
    engine = warm[3]
    runs = [_run_ours(model, ids, "fp8", backend=backend, engine=engine) for _ in range(reps)]
    graphs = engine.graphs.report() if engine.graphs is not None else None
    return {"seconds": min(r[0] for r in runs), "peak": max(r[1] for r in runs) - base,
            "first_seconds": warm[0], "hidden": runs[0][2], "engine": engine,
            "from_graphs": all(s.cuda_graph for s in engine.timeline[-reps:]), "graphs": graphs}


# One measurement script read top to bottom: build both models, then per length time, compare
# and profile each; the steps share the models and the result dict (93 lines).
def bench_vs_hf(lengths: list[int], out_dir: str, profile: bool, backend: str = "reference",
                graphs: bool = True) -> list[dict]:
    """glm-dsa's chunked prefill against transformers' ``GlmMoeDsaModel`` (one full-width MoE layer
    with the indexer, bf16, sdpa) on the same weights, at each length in ``lengths``.

    Both run from token ids to the final-normed hidden states. ``rms_norm_eps`` is 1e-6 here so
    that HF's latent norms (fixed at 1e-6) compute the same function as ours. glm-dsa runs with
    its default CUDA graphs (``graphs``; the triton backend) and eagerly, each on an engine reused
    after a warm-up; the eager hidden states are compared with the graphs' bitwise.
    """
    from glm_dsa.hf import hf_model

    model = _one_layer_model(rms_norm_eps=1e-6)
    cfg = model.config
    hf = hf_model(model)
    # The two models share every weight tensor (glm-dsa's experts are stored in HF's fused
    # layout); each peak below is the memory a call adds, plus that model's own weights.
    ours_w, hf_w = _param_bytes(model), _param_bytes(hf)
    print(f"hf: weights ours {ours_w / GB:.1f} GB, HF {hf_w / GB:.1f} GB (shared)", flush=True)
    captured: dict[str, Tensor] = {}
    indexer = model.model.layers[0].self_attn.indexer
    hf.layers[0].self_attn.indexer.register_forward_hook(
        lambda m, a, out: captured.__setitem__("hf", out[0]))  # [B=1, S, topk] -> [S, topk]
    rows = []
    for n in lengths:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        row: dict = {"tokens": n}
        captured.clear()
        with torch.no_grad():
            # glm-dsa as configured (CUDA graphs by default on the triton backend), then eagerly;
            # each engine is reused after a warm-up run, as a server reuses its engine and graphs.
            # The top-k is read by a hook, on the eager run only (cuda_graphs=False): a replay calls no hook.
            hook = indexer.register_forward_hook(lambda m, a, out: captured.__setitem__("ours", out))
            eager = _time_ours(model, ids, backend, cuda_graphs=False)
            hook.remove()
            ours_topk = captured.get("ours")
            row["ours_eager_seconds"] = eager["seconds"]
            del eager
            torch.cuda.empty_cache()
            ours = _time_ours(model, ids, backend, cuda_graphs=None if graphs else False)
            row["ours_seconds"] = ours["seconds"]
            row["ours_peak_gb"] = (ours["peak"] + ours_w) / GB
            row["ours_cuda_graphs"] = ours["from_graphs"]
            row["ours_first_seconds"] = ours["first_seconds"]
            if ours["graphs"] is not None:
                row["graph_pool_gb"] = ours["graphs"]["pool_bytes"] / GB
                row["graph_capture_seconds"] = sum(g["capture_seconds"] for g in ours["graphs"]["graphs"])
            row["eager_over_graphs"] = row["ours_eager_seconds"] / row["ours_seconds"]
            ours_hidden = model.model.norm(ours["hidden"])
            row["graphs_equal_eager"] = torch.equal(ours["hidden"], _run_ours(
                model, ids, "fp8", backend=backend, cuda_graphs=False)[2])
            engine = _run_ours(model, ids, "fp8", timing=True, backend=backend, cuda_graphs=False)[3]
            s = engine.timeline[0]
            row["ours_components"] = {k: getattr(s, k) for k in ("projections", "indexer", "attention", "moe")}
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as prof

                with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
                    _run_ours(model, ids, "fp8", backend=backend, engine=ours["engine"])
                with open(os.path.join(out_dir, f"profile_{n}.txt"), "w") as f:
                    for shapes in (False, True):
                        f.write(p.key_averages(group_by_input_shape=shapes).table(
                            sort_by="cuda_time_total", row_limit=40, max_name_column_width=90,
                            max_shapes_column_width=120))
            del ours, engine
            torch.cuda.empty_cache()
            dev_ids = ids.cuda()[None]
            try:
                hf(input_ids=dev_ids)  # warm-up
                sync()
                times = []
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                for _ in range(2):
                    t0 = time.perf_counter()
                    hf_hidden = hf(input_ids=dev_ids).last_hidden_state[0]
                    sync()
                    times.append(time.perf_counter() - t0)
                row["hf_seconds"] = min(times)
                row["hf_peak_gb"] = (torch.cuda.max_memory_allocated() - base + hf_w) / GB
                row["speedup_vs_hf"] = row["hf_seconds"] / row["ours_seconds"]
                if n > cfg.index_topk:
                    positions = torch.arange(n, device="cuda")
                    row["topk_overlap"], row["overlap_rows"] = _overlap(
                        ours_topk, captured["hf"], positions + 1, cfg.index_topk)
                else:
                    row["calc_diff_fp8_kv"] = calc_diff(ours_hidden.float(), hf_hidden.float())
                del hf_hidden
            except torch.cuda.OutOfMemoryError as e:
                row["hf_error"] = str(e).split("\n")[0][:300]
            torch.cuda.empty_cache()
        print("hf", json.dumps(row), flush=True)
        rows.append(row)
    # Same function check: with index_topk >= length both attend over every earlier key; a bf16
    # KV cache leaves bf16 rounding as the only difference (HF also rounds in bf16 throughout).
    for n in (2048, 8192):
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        with torch.no_grad(), _index_topk(model, hf, max(n, cfg.index_topk)):
            ours = model.model.norm(_run_ours(model, ids, "bf16", backend=backend)[2]).float()
            theirs = hf(input_ids=ids.cuda()[None]).last_hidden_state[0].float()
        eq = {"tokens": n, "index_topk": max(n, cfg.index_topk), "calc_diff": calc_diff(ours, theirs),
              "max_abs_diff": float((ours - theirs).abs().max()), "max_abs": float(theirs.abs().max())}
        print("hf-equal", json.dumps(eq), flush=True)
        rows.append({"equality": eq})
        torch.cuda.empty_cache()
    del hf, model
    torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------ peers
def causal_pairs(queries: int, keys: int) -> int:
    """Unmasked (query, key) pairs of a causal chunk of ``queries`` rows ending at key ``keys``."""
    prefix = keys - queries
    return queries * prefix + queries * (queries + 1) // 2


def logits_flops(queries: int, keys: int, heads: int, dim: int) -> int:
    """FLOPs of the indexer logits over the unmasked pairs: ``2 · H · D · pairs``."""
    return 2 * heads * dim * causal_pairs(queries, keys)


def sparse_prefill_flops(s_q: int, topk: int, h_q: int, d_qk: int = 576, d_v: int = 512) -> int:
    """FlashMLA's count for sparse prefill: ``2 · s_q · topk · h_q · (d_qk + d_v)``."""
    return 2 * s_q * topk * h_q * (d_qk + d_v)


def peer_rows(op: str, shape: str, flops: int, timings: dict[str, float], peer: str) -> list[dict]:
    """One row per implementation: time, TFLOP/s and its time over the peer's (``peer``)."""
    return [{"op": op, "shape": shape, "impl": name, "seconds": s, "tflops": flops / s / 1e12,
             "vs_peer": s / timings[peer]} for name, s in timings.items()]


def _triton(name: str):
    """``glm_dsa.kernels.<name>`` when the Triton backend provides it, else None."""
    try:
        import glm_dsa.kernels as kernels
    except ImportError:
        return None
    return getattr(kernels, name, None)


def _time_impls(impls: dict, args: tuple) -> dict[str, float]:
    """Median seconds of each available implementation on ``args``; the slow reference runs once."""
    return {name: median_seconds(lambda fn=fn: fn(*args), *((0, 1) if name == "reference" else (2, 5)))
            for name, fn in impls.items() if fn is not None}


def bench_peers(queries: int, keys: int = 131072) -> list[dict]:
    """DeepGEMM / FlashMLA, the Triton kernels and the oracle on the same GLM-5.3 inputs."""
    cfg, dev = GLM, "cuda"
    gen = torch.Generator(device=dev).manual_seed(3)
    H, D = cfg.index_n_heads, cfg.index_head_dim
    q = torch.randn(queries, H, D, device=dev, generator=gen).to(torch.float8_e4m3fn)
    k_fp8, k_scale = oracle.act_quant(torch.randn(keys, D, device=dev, generator=gen).bfloat16(), D)
    w = torch.randn(queries, H, device=dev, generator=gen)
    ks = torch.zeros(queries, dtype=torch.int32, device=dev)
    ke = (keys - queries + torch.arange(queries, device=dev) + 1).to(torch.int32)
    impls = {"DeepGEMM": peers.fp8_mqa_logits, "Triton": _triton("fp8_mqa_logits"),
             "reference": oracle.fp8_mqa_logits}
    times = _time_impls(impls, (q, (k_fp8, k_scale[:, 0].contiguous()), w, ks, ke))
    rows = peer_rows("fp8_mqa_logits", f"{queries:,} q × {keys:,} keys, H={H}, D={D}, causal",
                     logits_flops(queries, keys, H, D), times, "DeepGEMM")
    del q, k_fp8, k_scale, w
    torch.cuda.empty_cache()

    h_q, d, d_v, topk = cfg.num_attention_heads, cfg.kv_latent_dim, cfg.kv_lora_rank, cfg.index_topk
    q = (torch.randn(queries, h_q, d, device=dev, generator=gen) * 0.1).bfloat16()
    kv = (torch.randn(keys, 1, d, device=dev, generator=gen) * 0.1).bfloat16()
    limit = (keys - queries + torch.arange(queries, device=dev) + 1)[:, None]
    idx = (torch.rand(queries, topk, device=dev, generator=gen) * limit).to(torch.int32)[:, None, :]
    impls = {"FlashMLA": peers.flash_mla_sparse_fwd, "Triton": _triton("flash_mla_sparse_fwd"),
             "reference": oracle.flash_mla_sparse_fwd}
    times = _time_impls(impls, (q, kv, idx, cfg.softmax_scale, d_v))
    rows += peer_rows("sparse prefill", f"{queries:,} q, top-{topk} of {keys:,} keys, h_q={h_q}",
                      sparse_prefill_flops(queries, topk, h_q, d, d_v), times, "FlashMLA")
    torch.cuda.empty_cache()
    return rows


def render_peers(rows: list[dict]) -> list[str]:
    """Markdown table of ``bench_peers`` rows."""
    out = ["| op | shape | implementation | time | TFLOP/s | time / peer's |", "|---|---|---|---|---|---|"]
    out += [f"| {r['op']} | {r['shape']} | {r['impl']} | {_ms(r['seconds'])} | {r['tflops']:,.1f} "
            f"| {r['vs_peer']:,.2f}× |" for r in rows]
    return out + [""]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def render_markdown(res: dict) -> str:
    """The run's tables in Markdown (what ``bench/RESULTS.md`` quotes), from ``bench.json``."""
    out = [f"## {res['date']} — {res['gpu']}, torch {res['torch']}"
           + (f", transformers {res['transformers']}" if res.get("transformers") else ""), ""]
    if res.get("command"):
        out += [f"`{res['command']}`", ""]
    c = res["ceilings"]
    out += ["| ceiling | measured |", "|---|---|",
            f"| device-to-device copy (read + write) | {c['copy_bytes_per_s'] / 1e12:.2f} TB/s |",
            f"| bf16 matmul 8192³ | {c['bf16_flops_per_s'] / 1e12:.0f} TFLOP/s |",
            f"| fp8 `torch._scaled_mm` 8192³ | {c['fp8_flops_per_s'] / 1e12:.0f} TFLOP/s |", ""]
    rows = []
    if "moe" in res:
        m = res["moe"]
        rows.append(f"| MoE layer | {m['tokens']:,} tokens | {_ms(m['seconds'])} | {m['tflops']:.0f} TFLOP/s "
                    f"| {_ms(m['floor_seconds'])} | {m['seconds'] / m['floor_seconds']:.1f}× "
                    f"| +{m['extra_peak_gb']:.2f} GB peak |")
    for r in res.get("indexer", []):
        rows.append(f"| indexer logits + top-k | {r['queries']:,} q × {r['keys']:,} keys | {_ms(r['seconds'])} "
                    f"| {r['tflops']:.1f} TFLOP/s | {_ms(r['floor_seconds_fp8'])} "
                    f"| {r['seconds'] / r['floor_seconds_fp8']:.0f}× | peak {r['peak_gb']:.2f} GB ≤ "
                    f"{r['limit_gb']:.2f} GB; last chunk logits {_ms(r['last_chunk_logits_seconds'])}, "
                    f"top-k {_ms(r['last_chunk_topk_seconds'])} |")
    if "mla" in res:
        m = res["mla"]
        rows.append(f"| sparse MLA, top-{m['topk']} | {m['queries']:,} q over {m['keys']:,} keys "
                    f"| {_ms(m['seconds'])} | {m['tflops']:.1f} TFLOP/s | {_ms(m['floor_seconds'])} "
                    f"| {m['seconds'] / m['floor_seconds']:.0f}× | temporaries {m['temporaries_peak_gb']:.2f} GB "
                    f"≤ budget {m['budget_gb']:.2f} GB |")
    if rows:
        out += ["| component | shape | time | rate | floor | × floor | memory |", "|---|---|---|---|---|---|---|",
                *rows, ""]
    if res.get("peers"):
        out += render_peers(res["peers"])
    prefill = [p for p in res.get("prefill", []) if p.get("steps")]
    if prefill:
        out += ["| tokens | steps | wall | projections | indexer | attention | MoE | peak | floor | × floor |",
                "|---|---|---|---|---|---|---|---|---|---|"]
        for p in prefill:
            steps = p["steps"]
            done = steps[-1]["end"]
            sums = {k: sum(s[k] for s in steps) for k in ("projections", "indexer", "attention", "moe")}
            peak = p.get("peak_gb", max((s.get("peak_gb", 0.0) for s in steps), default=0.0))
            finished = done == p["tokens"]
            ratio = f"{p['wall_seconds'] / p['floor_seconds']:.0f}×" if finished else "—"
            out.append(f"| {p['tokens']:,} | {len(steps)}{'' if finished else f' (to {done:,})'} "
                       f"| {_ms(p['wall_seconds'])} | " + " | ".join(_ms(sums[k]) for k in sums)
                       + f" | {peak:.1f} GB | {_ms(p['floor_seconds'])} | {ratio} |")
        out.append("")
    hf = [r for r in res.get("hf", []) if "tokens" in r]
    if hf:
        out += ["| tokens | glm-dsa | glm-dsa eager | HF | HF time / glm-dsa time | glm-dsa peak | HF peak "
                "| agreement |", "|---|---|---|---|---|---|---|---|"]
        for r in hf:
            if "hf_seconds" in r:
                theirs = (_ms(r["hf_seconds"]), f"{r['speedup_vs_hf']:.2f}", f"{r['hf_peak_gb']:.1f} GB")
            else:
                theirs = (f"failed: {r.get('hf_error', '')[:90]}", "—", "—")
            agree = (f"top-k overlap {r['topk_overlap']:.1%} ({r['overlap_rows']:,} rows)" if "topk_overlap" in r
                     else f"calc_diff {r['calc_diff_fp8_kv']:.1e} (FP8 KV)" if "calc_diff_fp8_kv" in r else "—")
            mode = " (graphs)" if r.get("ours_cuda_graphs") else ""
            eager = _ms(r["ours_eager_seconds"]) if "ours_eager_seconds" in r else "—"
            out.append(f"| {r['tokens']:,} | {_ms(r['ours_seconds'])}{mode} | {eager} | {theirs[0]} | {theirs[1]} "
                       f"| {r['ours_peak_gb']:.1f} GB | {theirs[2]} | {agree} |")
        for r in res["hf"]:
            if "equality" in r:
                e = r["equality"]
                out.append(f"\nindex_topk {e['index_topk']:,} ≥ {e['tokens']:,} tokens, bf16 KV: calc_diff "
                           f"{e['calc_diff']:.1e}, largest difference {e['max_abs_diff']:.3g} (values up to "
                           f"{e['max_abs']:.3g}).")
        out.append("")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="moe,indexer,mla,prefill,hf")
    ap.add_argument("--prefill-tokens", default="32768,131072")
    ap.add_argument("--indexer-keys", default="131072,1048576")
    ap.add_argument("--hf-tokens", default="2048,8192,16384,24576")
    ap.add_argument("--profile", action="store_true", help="profile glm-dsa at each --hf-tokens length")
    ap.add_argument("--peer-queries", default="4096,32768", help="query rows of the peers part")
    ap.add_argument("--backend", choices=("reference", "triton"), default="reference",
                    help="the engine's indexer top-k and sparse attention (prefill and hf parts)")
    ap.add_argument("--attention-precision", choices=("bf16", "fp8"), default="bf16",
                    help="prefill part: the engine's attention precision (fp8: the FP8-query Q8KV8 "
                         "kernel, triton backend)")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                    help="hf part: glm-dsa's timed runs with the engine's default CUDA graphs (on the triton "
                         "backend); the eager time is measured beside them either way")
    args = ap.parse_args()
    if not os.path.isdir(args.out) or not os.access(args.out, os.W_OK | os.X_OK):
        ap.error(f"--out {args.out} is not a writable directory; create it first (mkdir -p {args.out})")
    parts = set(args.parts.split(","))
    res: dict = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
    }
    if "hf" in parts:
        import transformers

        res["transformers"] = transformers.__version__

    def save() -> None:
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(res, f, indent=2)
        with open(os.path.join(args.out, "RESULTS.md"), "w") as f:
            f.write(render_markdown(res))

    res["ceilings"] = ceilings()
    print("ceilings", json.dumps(res["ceilings"]), flush=True)
    save()
    if "moe" in parts:
        res["moe"] = bench_moe(res["ceilings"])
        print("moe", json.dumps(res["moe"]), flush=True)
        save()
    if "indexer" in parts:
        res["indexer"] = []
        for keys in map(int, args.indexer_keys.split(",")):
            r = bench_indexer(res["ceilings"], 32768, keys)
            res["indexer"].append(r)
            print("indexer", json.dumps(r), flush=True)
            save()
            torch.cuda.empty_cache()
    if "mla" in parts:
        res["mla"] = bench_mla(res["ceilings"])
        print("mla", json.dumps(res["mla"]), flush=True)
        save()
        torch.cuda.empty_cache()
    if "prefill" in parts:
        res["prefill"] = []
        for tokens in map(int, args.prefill_tokens.split(",")):
            entry: dict = {}
            res["prefill"].append(entry)
            bench_prefill(res["ceilings"], tokens, entry, save, backend=args.backend,
                          attention_precision=args.attention_precision)
            print("prefill", json.dumps({k: v for k, v in entry.items() if k != "steps"}), flush=True)
            save()
            torch.cuda.empty_cache()
    if "peers" in parts:
        res["peers"] = []
        for queries in map(int, args.peer_queries.split(",")):
            rows = bench_peers(queries)
            res["peers"] += rows
            for r in rows:
                print("peers", json.dumps(r), flush=True)
            save()
    if "hf" in parts:
        res["hf"] = bench_vs_hf([int(n) for n in args.hf_tokens.split(",")], args.out, args.profile,
                                args.backend, args.cuda_graphs)
        save()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
