"""CUDA graphs on the H200: the host syncs of a prefill step, replay against eager, step times.

``python scripts/probe_graphs.py --part syncs|equal|time --out DIR`` (one part per process so that a
time limit on one keeps the others). ``syncs``: every synchronising CUDA call of one eager step of
``small`` (triton backend), by source line, then the same for a step run from graphs (only the
metadata copies and the one read of the check verdicts may sync). ``equal``: engines with and without graphs on the same prompts (one
request on a bucket, a padded one, three requests over several chunked steps with prefix-cache
hits), each request's hidden rows compared bitwise, and eager against eager. ``time``: one
GLM-5.3 layer (bench.py's) at ``--tokens``, eager and graphs, each engine reused for a warm-up
and ``--reps`` timed runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(__file__))

import glm_dsa  # noqa: E402
from glm_dsa.prefill import PrefillEngine  # noqa: E402

from benchlib import calc_diff  # noqa: E402

GB = 1e9


def _one_config() -> None:
    """One logits config instead of the autotune space: compile time is what a probe runs out of."""
    from glm_dsa.kernels import mqa_logits

    mqa_logits._mqa_logits_tuned.configs = mqa_logits._mqa_logits_tuned.configs[1:2]


def _small():
    cfg = glm_dsa.get_config("small")
    return glm_dsa.init_weights(glm_dsa.build_model(cfg, torch.bfloat16), seed=0).cuda().eval()


def _prompts(cfg, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]


def _run(model, prompts, graphs, chunk, prefix=None, engine=None, patch_eager=False):
    if engine is None:
        lengths = [p.numel() for p in prompts] + ([prefix.numel()] if prefix is not None else [])
        engine = PrefillEngine.for_prompts(model, lengths, chunked_prefill_size=chunk, compute_logits=False,
                                           prefix_caching=prefix is not None, cuda_graphs=graphs)
        if patch_eager:  # the padded step, eagerly: what the graphs replay
            engine.graphs.run = engine.graphs.run_eager
        if prefix is not None:
            engine.warm_up(prefix)
    rids = [engine.add_request(p) for p in prompts]
    engine.run()
    torch.cuda.synchronize()
    return [engine.output_hidden(r) for r in rids], engine


def part_syncs(out: str) -> dict:
    model = _small()
    cfg = model.config
    found: dict[str, dict[str, int]] = {}

    def record(label, fn):
        sites: dict[str, int] = {}

        def show(message, category, filename, lineno, file=None, line=None):
            frames = [f for f in traceback.extract_stack()[:-1] if "glm_dsa" in f.filename]
            where = (f"{os.path.relpath(frames[-1].filename)}:{frames[-1].lineno} {frames[-1].name}"
                     if frames else f"{filename}:{lineno}")
            sites[where] = sites.get(where, 0) + 1

        old = warnings.showwarning
        warnings.showwarning = show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                fn()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = old
        found[label] = sites
        print(f"syncs, {label}: {sum(sites.values())} at {len(sites)} sites", flush=True)
        for k, v in sorted(sites.items(), key=lambda kv: -kv[1]):
            print(f"  {v:4d}  {k}", flush=True)

    for graphs in (False, True):
        engine = PrefillEngine.for_prompts(model, [2048, 2048], chunked_prefill_size=2048, compute_logits=False,
                                           cuda_graphs=graphs)
        engine.add_request(_prompts(cfg, [2048])[0])
        engine.run()  # compiles, autotunes and (graphs) captures
        torch.cuda.synchronize()
        engine.add_request(_prompts(cfg, [2048], seed=1)[0])
        record(f"one step of 2048 tokens, small, triton, {'graphs' if graphs else 'eager'}",
               lambda: (engine.step(), torch.cuda.synchronize()))
        if graphs:
            print("graphs report", json.dumps(engine.graphs.report()), flush=True)
    return found


def part_equal(out: str) -> list[dict]:
    model = _small()
    cfg = model.config
    rows = []
    cases = [("one request, 2048 tokens (bucket 2048), chunk 2048", [2048], 2048, None),
             ("one request, 1000 tokens (padded to 1024), chunk 2048", [1000], 2048, None),
             ("three requests 700/450/1100, chunk 512, prefix 300 cached", [700, 450, 1100], 512, 300)]
    for name, lengths, chunk, prefix in cases:
        prompts = _prompts(cfg, lengths)
        pre = None
        if prefix is not None:
            pre = _prompts(cfg, [prefix], seed=7)[0]
            prompts = [torch.cat([pre, p[prefix:]]) for p in prompts]
        t0 = time.perf_counter()
        eager, _ = _run(model, prompts, False, chunk, pre)
        eager2, _ = _run(model, prompts, False, chunk, pre)
        graph, engine = _run(model, prompts, True, chunk, pre)
        again = None
        if pre is None:
            again, _ = _run(model, prompts, None, chunk, engine=engine)  # replays only
        padded_eager = _run(model, prompts, True, chunk, pre, patch_eager=True)[0]
        row = {"case": name,
               "graphs_equal_eager": all(torch.equal(a, b) for a, b in zip(eager, graph)),
               "replay_equal_first": None if again is None else all(torch.equal(a, b) for a, b in zip(graph, again)),
               "graphs_equal_padded_eager": all(torch.equal(a, b) for a, b in zip(padded_eager, graph)),
               "padded_eager_equal_eager": all(torch.equal(a, b) for a, b in zip(padded_eager, eager)),
               "eager_equal_eager": all(torch.equal(a, b) for a, b in zip(eager, eager2)),
               "max_abs_diff": max(float((a.float() - b.float()).abs().max()) for a, b in zip(eager, graph)),
               "max_abs": max(float(a.float().abs().max()) for a in eager),
               "graph_steps": sum(s.cuda_graph for s in engine.timeline),
               "steps": len(engine.timeline), "report": engine.graphs.report(),
               "seconds": time.perf_counter() - t0}
        print("equal", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def part_time(out: str, tokens: list[int], reps: int) -> list[dict]:
    from bench import _one_layer_model

    model = _one_layer_model()
    cfg = model.config
    rows = []
    for n in tokens:
        ids = torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
        row: dict = {"tokens": n}
        outs = {}
        with torch.no_grad():
            for graphs in (False, True):
                engine = PrefillEngine.for_prompts(model, [n], kv_dtype="fp8", chunked_prefill_size=32768,
                                                   prefix_caching=False, compute_logits=False, cuda_graphs=graphs)
                t0 = time.perf_counter()
                first, _ = _run(model, [ids], None, 0, engine=engine)
                row[f"{'graphs' if graphs else 'eager'}_first_s"] = time.perf_counter() - t0
                times = []
                for _ in range(reps):
                    t0 = time.perf_counter()
                    hidden, _ = _run(model, [ids], None, 0, engine=engine)
                    times.append(time.perf_counter() - t0)
                row[f"{'graphs' if graphs else 'eager'}_s"] = times
                outs[graphs] = hidden[0]
                if not graphs:
                    outs["eager_first"] = first[0]
                if graphs:
                    row["report"] = engine.graphs.report()
                del engine
                torch.cuda.empty_cache()
        row["equal"] = torch.equal(outs[False], outs[True])
        row["eager_equal_eager"] = torch.equal(outs[False], outs["eager_first"])
        row["calc_diff_graphs_eager"] = calc_diff(outs[False], outs[True])
        row["calc_diff_eager_eager"] = calc_diff(outs[False], outs["eager_first"])
        row["max_abs_diff"] = float((outs[False].float() - outs[True].float()).abs().max())
        row["eager_over_graphs"] = min(row["eager_s"]) / min(row["graphs_s"])
        print("time", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=("syncs", "equal", "time"), required=True)
    ap.add_argument("--out", default=".")
    ap.add_argument("--tokens", default="2048,8192")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one-config", action="store_true", help="one logits config (no autotuning)")
    args = ap.parse_args()
    if args.one_config:
        _one_config()
    if args.part == "syncs":
        res = part_syncs(args.out)
    elif args.part == "equal":
        res = part_equal(args.out)
    else:
        res = part_time(args.out, [int(t) for t in args.tokens.split(",")], args.reps)
    with open(os.path.join(args.out, f"probe_graphs_{args.part}.json"), "w") as f:
        json.dump(res, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
