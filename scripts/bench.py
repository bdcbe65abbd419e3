"""One H200 run: the ceilings, then GLM-5.3 components and a full-size chunked prefill.

    python scripts/bench.py --out DIR [--parts ceilings,moe,indexer,mla,prefill] [--prefill-tokens 131072]

Every figure is measured in this run; each is printed beside the floor it is compared with
(ledger FLOPs at the measured ceilings). Writes DIR/bench.json and DIR/bench.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

from glm_dsa.config import PRESETS
from glm_dsa.indexer import indexer_topk, logits_budget_bytes
from glm_dsa.ledger import layer_flops_per_token, op_flops, sparse_mla_keys
from glm_dsa.mla import sparse_mla_fwd

GLM = PRESETS["glm-5.3"]
GB = 1e9


def _sync() -> None:
    torch.cuda.synchronize()


def _timed(fn, warmup: int = 1, reps: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after ``warmup`` (CUDA events)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        _sync()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def _peak(fn) -> tuple[float, int, int]:
    """(seconds, bytes allocated before, peak bytes during) of one call of ``fn``."""
    _sync()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    t = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t, before, torch.cuda.max_memory_allocated()


def ceilings() -> dict:
    dev = "cuda"
    x = torch.empty(int(4e9), dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    t = _timed(lambda: y.copy_(x), warmup=2, reps=5)
    copy_bw = 2 * x.numel() / t
    del x, y
    n = 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / _timed(lambda: a @ b, warmup=3, reps=10)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t().contiguous().t()
    one = torch.ones((), device=dev)
    fp8 = 2 * n**3 / _timed(
        lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), warmup=3, reps=10
    )
    return {"copy_bytes_per_s": copy_bw, "bf16_flops_per_s": bf16, "fp8_flops_per_s": fp8}


def bench_moe(ceil: dict, tokens: int = 32768) -> dict:
    from glm_dsa.moe import MoE

    cfg = GLM
    moe = MoE(cfg).to(device="cuda", dtype=torch.bfloat16)
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_((torch.randn(p.shape, generator=gen, device="cuda") * p.shape[-1] ** -0.5).to(p.dtype))
    x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
    with torch.no_grad():
        t = _timed(lambda: moe(x), warmup=1, reps=3)
        _, before, peak = _peak(lambda: moe(x))
    f = {op.op: op.flops_per_token for op in op_flops(cfg)}
    flops = tokens * (f["moe_experts"] + f["shared_experts"] + f["router_gate"])
    return {
        "tokens": tokens, "seconds": t, "tflops": flops / t / 1e12,
        "floor_seconds": flops / ceil["bf16_flops_per_s"], "extra_peak_gb": (peak - before) / GB,
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
    budget = logits_budget_bytes(torch.device(dev), 0.8)
    inputs = sum(t.numel() * t.element_size() for t in (q_fp8, k_fp8, k_scale, w, ks, ke))
    seconds, before, peak = _peak(lambda: indexer_topk(q_fp8, w, k_fp8, k_scale, ks, ke, cfg.index_topk, budget))
    pairs = queries * prefix + queries * (queries + 1) // 2
    flops = pairs * 2 * H * D
    out_bytes = queries * cfg.index_topk * 4
    return {
        "queries": queries, "keys": keys, "budget_gb": budget / GB, "inputs_gb": inputs / GB,
        "peak_gb": peak / GB, "peak_over_inputs_gb": (peak - before) / GB,
        "limit_gb": 1.1 * (inputs + budget) / GB, "topk_out_gb": out_bytes / GB,
        "seconds": seconds, "tflops": flops / seconds / 1e12,
        "floor_seconds_fp8": flops / ceil["fp8_flops_per_s"],
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


def bench_prefill(ceil: dict, tokens: int, chunk: int = 32768) -> dict:
    from glm_dsa.layer import DSAForCausalLM
    from glm_dsa.prefill import PrefillEngine
    from glm_dsa.weights import init_weights

    cfg = GLM.replace(name="glm-5.3-one-layer", num_hidden_layers=1, first_k_dense_replace=0)
    model = init_weights(DSAForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16), 0).eval()
    budget = logits_budget_bytes(torch.device("cuda"), 0.8)
    pages = -(-tokens // cfg.page_size)
    engine = PrefillEngine(model, pages, "fp8", chunk, budget, compute_logits=False, timing=True)
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(0))
    engine.add_request(ids)
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    engine.run(lambda s: print(f"  step {s.step} {s.chunks} {s.seconds:.2f} s (indexer {s.indexer:.2f}, "
                               f"attention {s.attention:.2f}, moe {s.moe:.2f})", flush=True))
    wall = time.perf_counter() - t0
    steps = [
        {"step": s.step, "start": s.chunks[0][1], "end": s.chunks[0][2], "seconds": s.seconds,
         "indexer": s.indexer, "attention": s.attention, "moe": s.moe, "projections": s.projections}
        for s in engine.timeline
    ]
    # Floor: the ledger's per-token FLOPs (sparse MLA over the keys each position really has)
    # at the bf16 rate, plus the indexer's causal pairs at the fp8 rate.
    f = {op.op: op.flops_per_token for op in op_flops(cfg)}
    dense_ops = layer_flops_per_token(cfg, full=True, moe=True, with_router=True) - f["sparse_mla"]
    mla = f["sparse_mla"] // cfg.index_topk * sparse_mla_keys(cfg, 0, tokens)
    idx_flops = (tokens * (tokens + 1) // 2) * 2 * cfg.index_n_heads * cfg.index_head_dim
    floor = (tokens * dense_ops + mla) / ceil["bf16_flops_per_s"] + idx_flops / ceil["fp8_flops_per_s"]
    return {
        "tokens": tokens, "chunk": chunk, "wall_seconds": wall, "peak_gb": torch.cuda.max_memory_allocated() / GB,
        "floor_seconds": floor, "steps": steps,
        "totals": {k: sum(s[k] for s in steps) for k in ("indexer", "attention", "moe", "projections")},
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--parts", default="ceilings,moe,indexer,mla,prefill")
    ap.add_argument("--prefill-tokens", default="131072")
    ap.add_argument("--indexer-keys", default="131072,1048576")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    res: dict = {
        "date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
    }

    def save() -> None:
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(res, f, indent=2)

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
            r = bench_prefill(res["ceilings"], tokens)
            res["prefill"].append(r)
            print("prefill", json.dumps({k: v for k, v in r.items() if k != "steps"}), flush=True)
            for s in r["steps"]:
                print("  step", json.dumps(s), flush=True)
            save()
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
