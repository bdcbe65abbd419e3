"""Context-parallel prefill benchmark: one chunked prefill split over 2..8 ranks (torchrun).

    torchrun --nproc-per-node 2 scripts/bench_cp.py --out DIR [--tokens 131072] [--chunk 32768]
        [--config glm-5.3] [--layers 1] [--split interleave] [--device cuda] [--no-check]

Every rank builds the same model (seeded random weights) and runs the same request with
``glm_dsa.cp`` (NCCL on CUDA, rank r on cuda:LOCAL_RANK; gloo on CPU). Measured per step and
per rank: seconds (step, indexer, attention, MoE, projections), indexer (query, key) pairs and
bytes gathered; per rank: peak memory (CUDA allocator peak, or the process's peak RSS on CPU).
Each step's pairs and bytes are set beside the ledger's figures (``cp_indexer_pairs_per_rank``,
``cp_comm_bytes_per_chunk`` at our element sizes). Unless ``--no-check``, every rank then runs
the same prefill alone (no communication, so no rank waits on another) and the relative error
of the CP output against it is reported. Rank 0 writes DIR/bench_cp.json and prints a summary.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time

import torch

from glm_dsa.batch import CP_BOUNDARY_GATHER, CP_SPLITS, INDEX_K_ALLGATHER, LATENT_ALLGATHER
from glm_dsa.cache import KV_DTYPES
from glm_dsa.config import get_config
from glm_dsa.cp import CPGroup, init_from_env, launched_by_torchrun
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.ledger import cp_comm_bytes_per_chunk, cp_indexer_pairs_per_rank
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights

from benchlib import sync


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=".", help="directory for bench_cp.json (rank 0)")
    ap.add_argument("--config", default="glm-5.3", help="preset or config.json (default glm-5.3)")
    ap.add_argument("--layers", type=int, default=1,
                    help="layers of the config to run (default 1: one full MoE layer)")
    ap.add_argument("--tokens", type=int, default=131072, help="prompt length (default 131072)")
    ap.add_argument("--chunk", type=int, default=32768, help="chunked_prefill_size (default 32768)")
    ap.add_argument("--split", choices=CP_SPLITS, default="interleave")
    ap.add_argument("--device", default="cuda", help="cuda (rank r on cuda:LOCAL_RANK) or cpu")
    ap.add_argument("--dtype", choices=["bfloat16", "float32", "float64"],
                    help="weights/activations (default bfloat16 on CUDA, float32 on CPU)")
    ap.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp8")
    ap.add_argument("--budget-bytes", type=int,
                    help="indexer logits and attention budgets (default: glm_dsa.budget.Budgets.default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-check", action="store_true", help="skip the single-rank comparison")
    args = ap.parse_args(argv)
    if args.layers < 1 or args.tokens < 1:
        ap.error("--layers and --tokens must be ≥ 1")
    return args


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _engine(model, args, device, cp_group):
    return PrefillEngine.for_prompts(model, [args.tokens], kv_dtype=args.kv_dtype,
                                     chunked_prefill_size=args.chunk, budget_bytes=args.budget_bytes,
                                     compute_logits=False, timing=True, cp_group=cp_group,
                                     backend="reference")


def _comm_snapshot(group: CPGroup) -> dict:
    return {op: vars(c).copy() for op, c in group.comm.items()}


def _against_ledger(cfg, steps: list, ranks: list, cp_size: int, split: str, elem: int) -> list:
    """Each step's per-rank pairs and bytes set beside the ledger's at our element size."""
    out_steps = []
    for i, s in enumerate(steps):
        rows = {r.op: r for r in cp_comm_bytes_per_chunk(
            cfg, s["tokens"], cp_size,
            index_k_bytes_per_token=cfg.index_head_dim * elem,
            latent_bytes_per_token=cfg.kv_latent_dim * elem)}
        ledger_comm = {
            op: {"collectives": rows[op].count, "bytes": rows[op].total,
                 "local_bytes": rows[op].count * rows[op].local_bytes_each}
            for op in (INDEX_K_ALLGATHER, LATENT_ALLGATHER)
        }
        # The ledger counts the boundary gather in bf16; ours moves the activation dtype.
        b = rows[CP_BOUNDARY_GATHER]
        ledger_comm[CP_BOUNDARY_GATHER] = {
            "collectives": b.count, "bytes": b.total * elem // 2,
            "local_bytes": b.count * b.local_bytes_each * elem // 2}
        pairs = [len(cfg.full_layers) * p
                 for p in cp_indexer_pairs_per_rank(s["tokens"], cp_size, split, s["prefix"])]
        per_rank = [r["steps"][i] for r in ranks]
        out_steps.append({
            "step": s["step"], "prefix": s["prefix"], "tokens": s["tokens"],
            "seconds_max": max(p["seconds"] for p in per_rank),
            "indexer_max": max(p["indexer"] for p in per_rank),
            "per_rank": per_rank,
            "ledger": {"indexer_pairs_per_rank": pairs, "comm": ledger_comm},
            "matches_ledger": all(p["comm"] == ledger_comm and p["indexer_pairs"] == pairs[r]
                                  for r, p in enumerate(per_rank)),
        })
    return out_steps


def bench(args: argparse.Namespace, device: torch.device) -> dict | None:
    """Run the benchmark on this rank of an initialized group; rank 0 gets the result dict."""
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    cfg = get_config(args.config)
    cfg = cfg.replace(name=f"{cfg.name}-{args.layers}-layer", num_hidden_layers=args.layers,
                      first_k_dense_replace=0)
    model = DSAForCausalLM(cfg).to(device=device, dtype=getattr(torch, dtype_name))
    model = init_weights(model, args.seed).eval()
    ids = torch.randint(0, cfg.vocab_size, (args.tokens,),
                        generator=torch.Generator().manual_seed(args.seed))
    group = CPGroup(args.split)
    engine = _engine(model, args, device, group)
    rid = engine.add_request(ids)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    steps = []
    while True:
        pairs, comm = group.indexer_pairs, _comm_snapshot(group)
        record = engine.step()
        if record is None:
            break
        (_, start, end), = record.chunks
        after = _comm_snapshot(group)
        steps.append({
            "step": record.step, "prefix": start, "tokens": end - start,
            "seconds": record.seconds, "indexer": record.indexer, "attention": record.attention,
            "moe": record.moe, "projections": record.projections,
            "indexer_pairs": group.indexer_pairs - pairs,
            "comm": {op: {k: after[op][k] - comm[op][k] for k in after[op]} for op in after},
        })
    peak = _peak_bytes(device)
    hidden = engine.output_hidden(rid)
    del engine
    if device.type == "cuda":
        torch.cuda.empty_cache()

    check = None
    if not args.no_check:
        alone = _engine(model, args, device, None)
        ref_rid = alone.add_request(ids)
        sync(device)
        t0 = time.perf_counter()
        alone.run()
        sync(device)
        ref = alone.output_hidden(ref_rid)
        diff = (hidden.double() - ref.double())
        check = {
            "single_rank_seconds": time.perf_counter() - t0,
            "rel_err": float(diff.norm() / ref.double().norm()),
            "max_abs_err": float(diff.abs().max()),
            "bitwise_equal": bool(torch.equal(hidden, ref)),
        }
        del alone

    mine = {"rank": group.rank, "peak_bytes": peak, "steps": steps, "check": check}
    ranks: list = [None] * group.size
    torch.distributed.all_gather_object(ranks, mine)
    if group.rank != 0:
        return None
    out_steps = _against_ledger(cfg, steps, ranks, group.size, args.split,
                                torch.finfo(getattr(torch, dtype_name)).bits // 8)
    return {
        "config": cfg.name, "tokens": args.tokens, "chunk": args.chunk, "cp": group.size,
        "split": args.split, "device": device.type, "dtype": dtype_name, "kv_dtype": args.kv_dtype,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "seconds_total_max": sum(s["seconds_max"] for s in out_steps),
        "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
        "check_per_rank": [r["check"] for r in ranks],
        "matches_ledger": all(s["matches_ledger"] for s in out_steps),
        "steps": out_steps,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not launched_by_torchrun():
        raise SystemExit("run under torchrun: torchrun --nproc-per-node N scripts/bench_cp.py ...")
    device = init_from_env(args.device)
    result = bench(args, device)
    torch.distributed.destroy_process_group()
    if result is None:
        return 0
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_cp.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(f"cp={result['cp']} {result['split']} {result['config']} {result['tokens']} tokens, "
          f"chunk {result['chunk']}, {result['dtype']} / kv {result['kv_dtype']} on {result['device']}")
    for s in result["steps"]:
        print(f"  step {s['step']}: tokens {s['prefix']}-{s['prefix'] + s['tokens'] - 1}  "
              f"{s['seconds_max']:.3f} s (indexer {s['indexer_max']:.3f} s)  "
              f"pairs/rank {[p['indexer_pairs'] for p in s['per_rank']]}  ledger ok {s['matches_ledger']}")
    print(f"  peak GB per rank: {[round(b / 1e9, 2) for b in result['peak_bytes_per_rank']]}")
    if result["check_per_rank"][0] is not None:
        print(f"  vs one rank: rel err {[c['rel_err'] for c in result['check_per_rank']]}")
    return 0 if result["matches_ledger"] else 1


if __name__ == "__main__":
    sys.exit(main())
