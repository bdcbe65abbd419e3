"""Benchmark the Triton indexer kernels on one GPU (issues 18 and 30), in one run of a few minutes.

Parts (each independent: one that fails records its error and the others still run):
  ceiling   fp8 ``torch._scaled_mm`` TFLOP/s at 8192³ (the tensor-core ceiling of this GPU).
  indexer   ``indexer_topk`` (candidate filter in the logits epilogue, exact select) for a
            32,768-token chunk at prefix 983,040 (1,015,808 keys) under the SGLang logits
            budget, against the chunk's logits alone (the logits kernel over the budget's row
            slices, and DeepGEMM's on the same slices) and against the previous implementation
            (those logits, then the radix select per slice); the launch's steps (sample and
            thresholds, candidates, select) by CUDA events, the candidate counts and redone
            rows, peak memory above the inputs, and recall against the oracle on a few rows.
  logits    ``fp8_mqa_logits`` at issue 30's four shapes (``LOGITS_SHAPES``: S × N, H, D = 128,
            the queries the last S tokens of an N-token request, causal with prefix);
            TFLOP/s over unmasked pairs (2·H·D per pair), DeepGEMM on the same inputs when
            ``import deep_gemm`` works, the ratio, calc_diff against the oracle on a row subset.
  paged     ``fp8_paged_mqa_logits`` at 4,096 and 32,768 × 131,072 through a shuffled block table.

The first call of each kernel autotunes (``glm_dsa.kernels.mqa_logits.CONFIGS``,
``CANDIDATE_CONFIGS``); its time is reported as ``first_call_s`` and the winning config is
printed.

Usage: python scripts/bench_indexer.py --out bench_indexer.json [--deep-gemm PATH]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

H, D, CONTEXT, TOPK = 32, 128, 131_072, 2048
INDEXER_CHUNK, INDEXER_PREFIX = 32_768, 983_040
# Issue 30's four logits shapes: (query rows, keys, heads), causal, the rows the last keys.
LOGITS_SHAPES = [(4096, 131_072, 32), (32_768, 131_072, 32), (8192, 1_048_576, 32), (4096, 131_072, 64)]
CHECK_ROWS = 256  # rows checked against the float64 oracle (slow at 131,072 keys)
RECALL_ROWS = 8


def _inputs(S: int, N: int, seed: int = 0, heads: int = H):
    H = heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(S, H, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(N, D, device="cuda", generator=g).to(torch.float8_e4m3fn)
    k_scale = torch.rand(N, device="cuda", generator=g) + 0.25
    weights = torch.randn(S, H, device="cuda", generator=g) * H**-0.5
    ks = torch.zeros(S, dtype=torch.int32, device="cuda")
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device="cuda")
    return q, k, k_scale, weights, ks, ke


def _time_ms(fn) -> float:
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=50, rep=300))


def _first_call_s(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def _check_rows(out, q, k, k_scale, weights, ks, ke):
    """calc_diff and mask equality of ``out`` against the oracle on CHECK_ROWS rows."""
    from glm_dsa import oracle

    S = q.shape[0]
    rows = torch.unique(torch.cat([torch.randperm(S, device="cuda")[: CHECK_ROWS - 2],
                                   torch.tensor([0, S - 1], device="cuda")]))  # fmt: skip
    ref = oracle.fp8_mqa_logits(q[rows], (k, k_scale), weights[rows], ks[rows], ke[rows])
    got = out[rows]
    mask = torch.isneginf(ref)
    masks_equal = bool(torch.equal(torch.isneginf(got), mask))
    diff = oracle.calc_diff(got.masked_fill(mask | torch.isinf(got), 0), ref.masked_fill(mask, 0))
    return {"calc_diff": diff, "masks_equal": masks_equal, "rows_checked": int(rows.numel())}


def _best_config(kernel) -> str:
    best = getattr(kernel, "best_config", None)
    return str(best) if best is not None else "n/a"


def part_ceiling() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = _time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return {"scaled_mm_tflops": 2 * n**3 / ms / 1e9, "ms": ms}


def part_logits(S: int, N: int, heads: int, deep_gemm) -> dict:
    from glm_dsa.kernels import fp8_mqa_logits, mqa_logits

    q, k, k_scale, w, ks, ke = _inputs(S, N, heads=heads)
    pairs = int((ke - ks).long().sum())
    flops = 2 * heads * D * pairs
    run = lambda: fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=True)  # noqa: E731
    res = {"S": S, "N": N, "H": heads, "unmasked_pairs": pairs, "first_call_s": _first_call_s(run)}
    res["config"] = _best_config(mqa_logits._mqa_logits_tuned)
    ms = _time_ms(run)
    res.update(triton_ms=ms, triton_tflops=flops / ms / 1e9)
    out = run()
    res.update(_check_rows(out, q, k, k_scale, w, ks, ke))
    if deep_gemm is not None:
        try:
            dg = lambda: deep_gemm.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=True)  # noqa: E731
            ref = dg()
            dms = _time_ms(dg)
            res.update(deepgemm_ms=dms, deepgemm_tflops=flops / dms / 1e9, ratio=dms / ms)
            mask = torch.isneginf(ref)
            from glm_dsa import oracle

            res["deepgemm_masks_equal"] = bool(torch.equal(torch.isneginf(out), mask))
            rows = slice(S - CHECK_ROWS, S)
            res["calc_diff_vs_deepgemm"] = oracle.calc_diff(
                out[rows].masked_fill(mask[rows], 0), ref[rows].masked_fill(mask[rows], 0)
            )
        except Exception as e:  # DeepGEMM's own failure must not hide ours
            res["deepgemm_error"] = f"{type(e).__name__}: {e}"
    del out
    return res


def part_paged(S: int) -> dict:
    from glm_dsa.kernels import fp8_paged_mqa_logits, mqa_logits

    page = 64
    q, k, k_scale, w, ks, ke = _inputs(S, CONTEXT)
    n_pages = CONTEXT // page
    # Page bytes: 64 × 128 e4m3 then 64 float32 scales; logical page i lives at perm[i].
    payload = k.view(torch.uint8).view(n_pages, page * D)
    scales = k_scale.view(torch.uint8).view(n_pages, page * 4)
    perm = torch.randperm(n_pages, device="cuda")
    pool = torch.empty(n_pages, page * (D + 4), dtype=torch.uint8, device="cuda")
    pool[perm] = torch.cat([payload, scales], dim=1)
    kv_cache = pool.view(n_pages, page, 1, D + 4)
    table = perm.to(torch.int32)[None, :]
    ctx = torch.tensor([CONTEXT], dtype=torch.int32, device="cuda")
    qp = q.view(1, S, H, D)
    run = lambda: fp8_paged_mqa_logits(qp, kv_cache, w, ctx, table, CONTEXT)  # noqa: E731
    pairs = int((ke - ks).long().sum())
    res = {"S": S, "N": CONTEXT, "unmasked_pairs": pairs, "first_call_s": _first_call_s(run)}
    res["config"] = _best_config(mqa_logits._paged_mqa_logits_tuned)
    ms = _time_ms(run)
    res.update(triton_ms=ms, triton_tflops=2 * H * D * pairs / ms / 1e9)
    out = run()
    res.update(_check_rows(out, q, k, k_scale, w, ks, ke))
    return res


def _median_s(fn, reps: int = 3) -> float:
    """Median wall seconds of ``reps`` synchronized calls after one warm-up."""
    fn()
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def _progress(res: dict, *keys: str) -> None:
    """Print measurements as they are made, so a run stopped by its time limit shows them."""
    print("  indexer", json.dumps({k: res[k] for k in keys if k in res}, default=str), flush=True)


def _slices(S: int, rows: int):
    return [(r0, min(S, r0 + rows)) for r0 in range(0, S, rows)]


def part_indexer(deep_gemm) -> dict:
    """One GLM-5.3 chunk at prefix 983,040: the candidate-filter ``indexer_topk`` against the
    chunk's logits alone (the logits kernel over the budget's row slices, what any indexer that
    materializes logits computes; DeepGEMM on the same slices) and against the previous
    implementation (those logits, then the radix select per slice)."""
    from glm_dsa import budget as budgets, oracle
    from glm_dsa.kernels import indexer as fast
    from glm_dsa.kernels import mqa_logits
    from glm_dsa.kernels.mqa_logits import launch_mqa_logits

    S, N = INDEXER_CHUNK, INDEXER_PREFIX + INDEXER_CHUNK
    q, k, k_scale, w, ks, ke = _inputs(S, N)
    budget = budgets.logits_budget_bytes("cuda")
    rows = budgets.max_logit_rows(S, N, budget)
    pairs = int((ke - ks).long().sum())
    flops = 2 * H * D * pairs
    res = {"S": S, "N": N, "budget_bytes": budget, "logits_rows_per_slice": rows,
           "n_slices": -(-S // rows), "candidate_rows_per_launch": fast.candidate_rows(S, N, D, TOPK, budget),
           "unmasked_pairs": pairs}  # fmt: skip
    run = lambda: fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, budget)  # noqa: E731
    res["first_call_s"] = _first_call_s(run)
    res["candidate_config"] = _best_config(mqa_logits._mqa_candidates_tuned)
    timings = getattr(mqa_logits._mqa_candidates_tuned, "configs_timings", None) or {}
    res["candidate_config_ms"] = {str(c): t for c, t in timings.items()}
    _progress(res, "first_call_s", "candidate_config", "candidate_config_ms")
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = run()
    torch.cuda.synchronize()
    res["peak_above_inputs_bytes"] = torch.cuda.max_memory_allocated() - base
    res["indexer_s"] = _median_s(run)
    res["indexer_tflops"] = flops / res["indexer_s"] / 1e12
    _progress(res, "indexer_s", "indexer_tflops", "peak_above_inputs_bytes")

    def logits_alone():
        for r0, r1 in _slices(S, rows):
            launch_mqa_logits(q[r0:r1], k, k_scale, w[r0:r1], ks[r0:r1], ke[r0:r1], False, 0)

    res["logits_alone_s"] = _median_s(logits_alone)
    res["logits_alone_tflops"] = flops / res["logits_alone_s"] / 1e12
    res["indexer_over_logits_alone"] = res["indexer_s"] / res["logits_alone_s"]
    _progress(res, "logits_alone_s", "logits_alone_tflops", "indexer_over_logits_alone")
    if deep_gemm is not None:
        try:
            def dg_alone():
                for r0, r1 in _slices(S, rows):
                    deep_gemm.fp8_mqa_logits(q[r0:r1], (k, k_scale), w[r0:r1], ks[r0:r1], ke[r0:r1],
                                             clean_logits=False)  # fmt: skip

            res["deepgemm_logits_alone_s"] = _median_s(dg_alone)
            res["deepgemm_logits_alone_tflops"] = flops / res["deepgemm_logits_alone_s"] / 1e12
            res["indexer_over_deepgemm_logits_alone"] = res["indexer_s"] / res["deepgemm_logits_alone_s"]
            _progress(res, "deepgemm_logits_alone_s", "indexer_over_deepgemm_logits_alone")
        except Exception as e:  # DeepGEMM's own failure must not hide ours
            res["deepgemm_error"] = f"{type(e).__name__}: {e}"

    def previous():
        fast.select_in_chunks(q, w, k, k_scale, ks, ke, TOPK, budget, fast._full_logits(q, w, k, k_scale))

    res["previous_s"] = _median_s(previous, reps=1)
    _progress(res, "previous_s")
    # The steps of one launch (the whole chunk): sample + thresholds, candidates, select.
    steps = _launch_steps(fast, q, w, k, k_scale, ks, ke)
    res.update(steps)
    _progress(res, *steps)

    # Recall against the oracle's canonical top-k on a few rows.
    pick = torch.linspace(0, S - 1, RECALL_ROWS, device="cuda").long()
    ref_logits = oracle.fp8_mqa_logits(q[pick], (k, k_scale), w[pick], ks[pick], ke[pick])
    ref = oracle.topk_per_row(ref_logits, ks[pick], ke[pick], TOPK)
    recalls = []
    for i, m in enumerate(pick.tolist()):
        f, r = set(out[m].tolist()) - {-1}, set(ref[i].tolist()) - {-1}
        recalls.append(len(f & r) / len(r))
    res.update(recall_mean=sum(recalls) / len(recalls), recall_worst=min(recalls))
    return res


def _launch_steps(fast, q, w, k, k_scale, ks, ke) -> dict:
    """CUDA-event times of one launch's steps over the whole chunk, candidate counts, redo rows."""
    from glm_dsa.kernels.mqa_logits import launch_mqa_candidates, launch_mqa_logits
    from glm_dsa.kernels.topk import CAND_FACTOR, launch_select_candidates, launch_thresholds

    S = q.shape[0]
    lens = (ke - ks).to(torch.int32)
    longest = int(lens.max())
    cand = min(CAND_FACTOR * TOPK, longest)
    stride = -(-longest // fast.SAMPLE)
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    ev[0].record()
    s_starts = ks.add(stride - 1).floor_divide(stride)
    s_ends = ke.add(stride - 1).floor_divide(stride)
    sample = launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w,
                               s_starts, s_ends, False, 0)  # fmt: skip
    thr = launch_thresholds(sample, s_starts, s_ends, lens, TOPK, cand)
    ev[1].record()
    counters = torch.zeros((S, 4), dtype=torch.int32, device="cuda")
    keys, cols = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, cand)
    ev[2].record()
    found = counters[:, 0].clone()
    _, redo, _ = launch_select_candidates(keys, cols, counters, lens, TOPK)
    ev[3].record()
    torch.cuda.synchronize()
    f = found.float()
    return {"sample_threshold_ms": ev[0].elapsed_time(ev[1]), "candidates_ms": ev[1].elapsed_time(ev[2]),
            "select_ms": ev[2].elapsed_time(ev[3]), "candidates_mean": float(f.mean()),
            "candidates_min": int(found.min()), "candidates_max": int(found.max()), "cand_slots": cand,
            "redo_rows": int(redo.sum())}  # fmt: skip


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--deep-gemm", default=None, help="directory to put on sys.path for deep_gemm")
    p.add_argument("--parts", default="ceiling,indexer,logits,paged")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.deep_gemm:
        sys.path.insert(0, args.deep_gemm)
    try:
        import deep_gemm
    except Exception as e:  # not installed, or built for another torch
        deep_gemm, dg_error = None, f"{type(e).__name__}: {e}"
    else:
        dg_error = None
    import triton

    props = torch.cuda.get_device_properties(0)
    report = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "deep_gemm": None if deep_gemm is None else getattr(deep_gemm, "__version__", "imported"),
        "deep_gemm_error": dg_error,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "parts": {},
    }
    parts = args.parts.split(",")
    jobs = []
    if "ceiling" in parts:
        jobs.append(("ceiling", part_ceiling))
    if "logits" in parts:
        jobs += [(f"logits_{S}x{N}_h{h}", lambda S=S, N=N, h=h: part_logits(S, N, h, deep_gemm))
                 for S, N, h in LOGITS_SHAPES]
    if "paged" in parts:
        jobs += [(f"paged_{S}", lambda S=S: part_paged(S)) for S in (4096, 32768)]
    if "indexer" in parts:
        jobs.append(("indexer", lambda: part_indexer(deep_gemm)))
    for name, job in jobs:
        t0 = time.perf_counter()
        try:
            report["parts"][name] = job()
        except Exception as e:
            report["parts"][name] = {"error": f"{type(e).__name__}: {e}",
                                     "traceback": traceback.format_exc()}  # fmt: skip
        report["parts"][name]["wall_s"] = time.perf_counter() - t0
        torch.cuda.empty_cache()
        print(f"{name:12s} {json.dumps(report['parts'][name], default=str)[:1500]}", flush=True)
        # Written after every part, so that a run stopped by its time limit keeps what it finished.
        Path(args.out).write_text(json.dumps(report, indent=2, default=str))

    print("\n| part | ms | TFLOP/s | DeepGEMM TFLOP/s | ratio | calc_diff | masks |")
    print("|---|---|---|---|---|---|---|")
    for name, r in report["parts"].items():
        if "triton_ms" in r:
            print(f"| {name} | {r['triton_ms']:.2f} | {r['triton_tflops']:.0f} | "
                  f"{r.get('deepgemm_tflops', float('nan')):.0f} | {r.get('ratio', float('nan')):.3f} | "
                  f"{r['calc_diff']:.2e} | {r['masks_equal']} |")  # fmt: skip
    if "indexer" in report["parts"] and "indexer_s" in report["parts"]["indexer"]:
        r = report["parts"]["indexer"]
        print(f"\nindexer 32K @ 983,040: {r['indexer_s']:.3f} s ({r['indexer_tflops']:.0f} TFLOP/s), "
              f"logits alone {r['logits_alone_s']:.3f} s in {r['n_slices']} slices "
              f"(ratio {r['indexer_over_logits_alone']:.2f}; DeepGEMM logits alone "
              f"{r.get('deepgemm_logits_alone_s', float('nan')):.3f} s), previous {r['previous_s']:.3f} s; "
              f"steps: sample {r['sample_threshold_ms']:.1f} ms, candidates {r['candidates_ms']:.1f} ms, "
              f"select {r['select_ms']:.1f} ms; candidates {r['candidates_min']}–{r['candidates_max']} "
              f"(mean {r['candidates_mean']:.0f}, slots {r['cand_slots']}), redo {r['redo_rows']}; "
              f"peak +{r['peak_above_inputs_bytes'] / 2**30:.2f} GiB; "
              f"recall mean {r['recall_mean']:.4f} worst {r['recall_worst']:.4f}")  # fmt: skip
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
