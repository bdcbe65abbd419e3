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
            ``import deep_gemm`` works, the ratio, calc_diff against the oracle on a row subset;
            on sm_90 the Gluon kernel (``glm_dsa.kernels.mqa_logits_gluon``) too, each of
            ``--gluon-configs`` timed and the fastest reported beside both, its masks against
            the Triton kernel's and its last rows against DeepGEMM's. ``--logits-shapes``
            replaces the four shapes.
  paged     ``fp8_paged_mqa_logits`` at 4,096 and 32,768 × 131,072 through a shuffled block table.
  frontier  (not in the default parts; issue 43) ``indexer_topk`` beside the peers composition
            (``glm_dsa.peers.indexer_topk``: DeepGEMM's logits in the budget's row chunks, our
            radix select over them) at 4,096, 16,384 and 32,768 rows × 131,072 and 1,048,576
            keys (``FRONTIER_SHAPES``, causal with prefix, the budget of the indexer part):
            ms and TFLOP/s of the whole ``indexer_topk`` and its steps, of DeepGEMM's logits
            alone and ours alone (the same row slices), of the composition; the rate of
            ``indexer_topk`` over DeepGEMM's logits alone, its speedup over the composition,
            and the two top-k sets on a few rows (equal, and each within ``topk_margin`` of
            the oracle's scores). Without DeepGEMM the composition is ``select_in_chunks`` over
            our logits. Runs on the CPU under ``TRITON_INTERPRET=1`` at tiny
            ``--frontier-shapes`` (with a ``--frontier-topk`` below their keys).

The first call of each kernel autotunes (``glm_dsa.kernels.mqa_logits.CONFIGS``,
``CANDIDATE_CONFIGS``); its time is reported as ``first_call_s`` and the winning config is
printed.

Usage: python scripts/bench_indexer.py --out bench_indexer.json [--deep-gemm PATH] [--parts ...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchlib import median_seconds, profile_call, sync  # noqa: E402

H, D, CONTEXT, TOPK = 32, 128, 131_072, 2048
INDEXER_CHUNK, INDEXER_PREFIX = 32_768, 983_040
# Issue 30's four logits shapes: (query rows, keys, heads), causal, the rows the last keys.
LOGITS_SHAPES = [(4096, 131_072, 32), (32_768, 131_072, 32), (8192, 1_048_576, 32), (4096, 131_072, 64)]
CHECK_ROWS = 256  # rows checked against the float64 oracle (slow at 131,072 keys)
RECALL_ROWS = 8
# Issue 43's frontier shapes (rows, keys), keys outer: each autotune bucket (a factor of 16 in
# rows × keys) is first met, and tuned, at its smallest shape.
FRONTIER_SHAPES = [(S, N) for N in (131_072, 1_048_576) for S in (4096, 16_384, 32_768)]
# Timed calls after the first (which compiles and autotunes); 32,768 × 1M costs ~0.5 s a call.
FRONTIER_REPS = 3
FRONTIER_CHECK_ROWS = 4  # rows whose two top-k sets are compared, first and last among them


def _inputs(S: int, N: int, seed: int = 0, heads: int = H, device: str = "cuda"):
    """The last ``S`` tokens of an ``N``-token causal request: q ``[S, heads, D]`` e4m3, k
    ``[N, D]`` e4m3, k_scale ``[N]``, weights ``[S, heads]``, int32 ks = 0 and ke ``[S]``."""
    H = heads
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(S, H, D, device=device, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(N, D, device=device, generator=g).to(torch.float8_e4m3fn)
    k_scale = torch.rand(N, device=device, generator=g) + 0.25
    weights = torch.randn(S, H, device=device, generator=g) * H**-0.5
    ks = torch.zeros(S, dtype=torch.int32, device=device)
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=device)
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


def _candidate_tuning() -> dict:
    """The candidate kernel's config and, where this process tuned it, each config's time
    (ms, Triton's autotuner): every ``CANDIDATE_CONFIGS`` entry."""
    from glm_dsa.kernels import mqa_logits

    timings = getattr(mqa_logits._mqa_candidates_tuned, "configs_timings", None) or {}
    return {"candidate_config": _best_config(mqa_logits._mqa_candidates_tuned),
            "candidate_config_ms": {str(c): t for c, t in timings.items()}}


def part_ceiling() -> dict:
    n = 8192
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    ms = _time_ms(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16))
    return {"scaled_mm_tflops": 2 * n**3 / ms / 1e9, "ms": ms}


def part_logits(S: int, N: int, heads: int, deep_gemm, gluon_configs: list[dict]) -> dict:
    """The Triton kernel, the Gluon sm_90 kernel (each of ``gluon_configs``, the fastest
    reported) and DeepGEMM on one shape; each checked against the oracle on a row subset, the
    Gluon kernel's masks against the Triton kernel's and its last rows against DeepGEMM's."""
    from glm_dsa import oracle
    from glm_dsa.kernels import mqa_logits

    q, k, k_scale, w, ks, ke = _inputs(S, N, heads=heads)
    pairs = int((ke - ks).long().sum())
    flops = 2 * heads * D * pairs
    run = lambda: mqa_logits.launch_mqa_logits(q, k, k_scale, w, ks, ke, True, 0)  # noqa: E731
    res = {"S": S, "N": N, "H": heads, "unmasked_pairs": pairs, "first_call_s": _first_call_s(run)}
    res["config"] = _best_config(mqa_logits._mqa_logits_tuned)
    ms = _time_ms(run)
    res.update(triton_ms=ms, triton_tflops=flops / ms / 1e9)
    out = run()
    res.update(_check_rows(out, q, k, k_scale, w, ks, ke))
    tail = slice(S - CHECK_ROWS, S)
    # One full output at a time (8,192 x 1,048,576 float32 is 32 GiB; two and a third in a
    # timing loop overflowed an 80 GB H100 on 2026-12-07, run O): masks and last rows are kept.
    out_mask, out_tail = torch.isneginf(out), out[tail].clone()
    del out
    gluon_tail = None
    try:
        from glm_dsa.kernels.mqa_logits_gluon import gluon_refusal
    except Exception as e:  # a Triton whose Gluon API differs: the other columns still run
        res["gluon_refusal"] = f"import: {type(e).__name__}: {e}"
    else:
        res["gluon_refusal"] = gluon_refusal(q, k)
    if res["gluon_refusal"] is None:
        from glm_dsa.kernels.mqa_logits_gluon import launch_mqa_logits_gluon

        timings = []
        for cfg in gluon_configs:
            grun = lambda cfg=cfg: launch_mqa_logits_gluon(q, k, k_scale, w, ks, ke, True, 0, cfg)  # noqa: E731
            try:
                timings.append({"config": cfg, "first_call_s": _first_call_s(grun), "ms": _time_ms(grun)})
            except Exception as e:  # one config's failure (a compile error) must not hide the others
                timings.append({"config": cfg, "error": f"{type(e).__name__}: {e}"})
            print(f"  gluon {cfg}: {timings[-1].get('ms', timings[-1].get('error'))}", flush=True)
        res["gluon_configs"] = timings
        timed = [t for t in timings if "ms" in t]
        if timed:
            best = min(timed, key=lambda t: t["ms"])
            gms = best["ms"]
            res.update(gluon_config=best["config"], gluon_ms=gms, gluon_tflops=flops / gms / 1e9,
                       gluon_vs_triton=ms / gms)
            gout = launch_mqa_logits_gluon(q, k, k_scale, w, ks, ke, True, 0, best["config"])
            check = _check_rows(gout, q, k, k_scale, w, ks, ke)
            res.update({f"gluon_{n}": v for n, v in check.items()})
            res["gluon_masks_equal_triton"] = bool(torch.equal(torch.isneginf(gout), out_mask))
            gluon_tail = gout[tail].clone()
            del gout
    if deep_gemm is not None:
        try:
            dg = lambda: deep_gemm.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=True)  # noqa: E731
            ref = dg()
            mask, ref_tail = torch.isneginf(ref), ref[tail].clone()
            del ref
            dms = _time_ms(dg)
            res.update(deepgemm_ms=dms, deepgemm_tflops=flops / dms / 1e9, ratio=dms / ms)
            res["deepgemm_masks_equal"] = bool(torch.equal(out_mask, mask))
            res["calc_diff_vs_deepgemm"] = oracle.calc_diff(
                out_tail.masked_fill(mask[tail], 0), ref_tail.masked_fill(mask[tail], 0)
            )
            if gluon_tail is not None:
                res["gluon_vs_deepgemm"] = dms / res["gluon_ms"]
                res["gluon_calc_diff_vs_deepgemm"] = oracle.calc_diff(
                    gluon_tail.masked_fill(mask[tail], 0), ref_tail.masked_fill(mask[tail], 0))
        except Exception as e:  # DeepGEMM's own failure must not hide ours
            res["deepgemm_error"] = f"{type(e).__name__}: {e}"
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


def _progress(res: dict, *keys: str, label: str = "indexer") -> None:
    """Print measurements as they are made, so a run stopped by its time limit shows them."""
    print(f"  {label}", json.dumps({k: res[k] for k in keys if k in res}, default=str), flush=True)


def _slices(S: int, rows: int):
    return [(r0, min(S, r0 + rows)) for r0 in range(0, S, rows)]


def _triton_logits_in_slices(q, k, k_scale, w, ks, ke, rows: int) -> None:
    """Our logits kernel over ``[S, N]`` in slices of ``rows`` rows (the budget's), each slice
    freed as the next is made: what an indexer that materializes its logits computes."""
    from glm_dsa.kernels.mqa_logits import launch_mqa_logits

    for r0, r1 in _slices(q.shape[0], rows):
        launch_mqa_logits(q[r0:r1], k, k_scale, w[r0:r1], ks[r0:r1], ke[r0:r1], False, 0)


def _deepgemm_logits_in_slices(deep_gemm, q, k, k_scale, w, ks, ke, rows: int) -> None:
    """``deep_gemm.fp8_mqa_logits`` over the same slices as ``_triton_logits_in_slices``."""
    for r0, r1 in _slices(q.shape[0], rows):
        deep_gemm.fp8_mqa_logits(q[r0:r1], (k, k_scale), w[r0:r1], ks[r0:r1], ke[r0:r1], clean_logits=False)


def part_indexer(deep_gemm) -> dict:
    """One GLM-5.3 chunk at prefix 983,040: the candidate-filter ``indexer_topk`` against the
    chunk's logits alone (the logits kernel over the budget's row slices, what any indexer that
    materializes logits computes; DeepGEMM on the same slices) and against the previous
    implementation (those logits, then the radix select per slice)."""
    from glm_dsa import budget as budgets, oracle
    from glm_dsa.kernels import indexer as fast

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
    res.update(_candidate_tuning())
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

    res["logits_alone_s"] = _median_s(lambda: _triton_logits_in_slices(q, k, k_scale, w, ks, ke, rows))
    res["logits_alone_tflops"] = flops / res["logits_alone_s"] / 1e12
    res["indexer_over_logits_alone"] = res["indexer_s"] / res["logits_alone_s"]
    _progress(res, "logits_alone_s", "logits_alone_tflops", "indexer_over_logits_alone")
    if deep_gemm is not None:
        try:
            res["deepgemm_logits_alone_s"] = _median_s(
                lambda: _deepgemm_logits_in_slices(deep_gemm, q, k, k_scale, w, ks, ke, rows))
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


class _HostEvent:
    """``torch.cuda.Event``'s ``record`` and ``elapsed_time`` (ms) on the host clock, for a CPU
    run (Triton's interpreter has done a launch's work when it returns)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "_HostEvent") -> float:
        return (end.t - self.t) * 1e3


def _launch_steps(fast, q, w, k, k_scale, ks, ke, topk: int = TOPK) -> dict:
    """Times (ms, CUDA events; the host clock on the CPU) of one launch's steps over the whole
    chunk, candidate counts, redo rows."""
    from glm_dsa.kernels.mqa_logits import launch_mqa_candidates, launch_mqa_logits
    from glm_dsa.kernels.topk import CAND_FACTOR, COUNTERS, launch_select_candidates, launch_thresholds

    S = q.shape[0]
    lens = (ke - ks).to(torch.int32)
    longest = int(lens.max())
    cand = min(CAND_FACTOR * topk, longest)
    stride = fast.sample_stride(longest, topk)
    ev: list = [torch.cuda.Event(enable_timing=True) if q.is_cuda else _HostEvent() for _ in range(4)]
    ev[0].record()
    s_starts = ks.add(stride - 1).floor_divide(stride)
    s_ends = ke.add(stride - 1).floor_divide(stride)
    sample = launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w,
                               s_starts, s_ends, False, 0)  # fmt: skip
    thr = launch_thresholds(sample, s_starts, s_ends, lens, topk, cand)
    ev[1].record()
    # The kernels' layout: COUNTERS int32 a row, candidates appended in column 0.
    counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device=q.device)
    keys, cols = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, cand)
    ev[2].record()
    found = counters[:, 0].clone()
    _, redo, _ = launch_select_candidates(keys, cols, counters, lens, topk)
    ev[3].record()
    sync(q.device)
    f = found.float()
    return {"sample_threshold_ms": ev[0].elapsed_time(ev[1]), "candidates_ms": ev[1].elapsed_time(ev[2]),
            "select_ms": ev[2].elapsed_time(ev[3]), "candidates_mean": float(f.mean()),
            "candidates_min": int(found.min()), "candidates_max": int(found.max()), "cand_slots": cand,
            "redo_rows": int(redo.sum())}  # fmt: skip


def part_frontier(S: int, N: int, topk: int, deep_gemm) -> dict:
    """Issue 43's frontier at ``S`` rows × ``N`` keys: the whole ``indexer_topk`` (and its
    steps) beside DeepGEMM's logits alone, ours alone (the budget's row slices) and the peers
    composition (``glm_dsa.peers.indexer_topk``; ``select_in_chunks`` over our logits when
    DeepGEMM is absent or fails). Times in ms, rates in TFLOP/s over the unmasked pairs
    (2·H·D each); ``rate_vs_deepgemm_logits`` and ``speedup_vs_composition`` above 1 favour
    ``indexer_topk``. Memory: at most one budget of logits (or of candidates) at a time."""
    from glm_dsa import budget as budgets, peers
    from glm_dsa.kernels import indexer as fast, mqa_logits

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = dev == "cuda"
    q, k, k_scale, w, ks, ke = _inputs(S, N, heads=H, device=dev)
    budget = budgets.default_logits_bytes(dev)
    rows = budgets.max_logit_rows(S, N, budget)
    pairs = int((ke - ks).long().sum())
    flops = 2 * H * D * pairs
    res: dict = {"S": S, "N": N, "H": H, "D": D, "topk": topk, "budget_bytes": budget,
                 "logits_rows_per_slice": rows, "n_slices": -(-S // rows),
                 "candidate_rows_per_launch": fast.candidate_rows(S, N, D, topk, budget),
                 "unmasked_pairs": pairs, "reps": FRONTIER_REPS if cuda else 1}  # fmt: skip
    label = f"frontier {S}x{N}"

    def measure(name: str, fn):
        """``fn()``'s output, from its first call (which compiles and autotunes). On CUDA the
        median of FRONTIER_REPS more is its time, and their peak memory above what was held
        before them (inputs, earlier outputs) is recorded; on the CPU that first call's time."""
        sync(dev)
        t0 = time.perf_counter()
        out = fn()
        sync(dev)
        first = time.perf_counter() - t0
        res[f"{name}_first_call_s"] = first
        if cuda:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            ms = 1e3 * median_seconds(fn, warmup=0, reps=FRONTIER_REPS)
            res[f"{name}_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        else:
            ms = 1e3 * first
        res[f"{name}_ms"], res[f"{name}_tflops"] = ms, flops / ms / 1e9
        _progress(res, f"{name}_first_call_s", f"{name}_ms", f"{name}_tflops", f"{name}_peak_bytes",
                  label=label)  # fmt: skip
        return out

    out = measure("indexer", lambda: fast.indexer_topk(q, w, k, k_scale, ks, ke, topk, budget))
    if cuda:
        # Where the call's time goes beyond its steps' kernels: idle device time inside it is
        # the host's (launch overhead, device reads), the "rest" below.
        res["indexer_profile"] = profile_call(lambda: fast.indexer_topk(q, w, k, k_scale, ks, ke, topk, budget))
        _progress(res["indexer_profile"], "wall_ms", "gpu_busy_ms", "gpu_idle_ms", "launches", "host_waits", "kernels",
                  label=f"{label} profile")
    res.update(_candidate_tuning())
    _progress(res, "candidate_config", "candidate_config_ms", label=label)
    # The steps run every row in one launch: where the call takes several, a row count its
    # kernels have not met, which the first run compiles and autotunes (13.6 s of "candidates" at
    # 32,768 x 1,048,576 on 2026-12-07, run O): the second run is timed.
    _launch_steps(fast, q, w, k, k_scale, ks, ke, topk)
    steps = _launch_steps(fast, q, w, k, k_scale, ks, ke, topk)
    # What the three steps leave of the whole call: the redone rows, the row-chunk loop's syncs;
    # a comparison only where the call is one launch (``indexer_profile`` has the kernels' own
    # times either way).
    one_launch = res["candidate_rows_per_launch"] >= S
    steps["rest_ms"] = (res["indexer_ms"] - sum(steps[f"{step}_ms"] for step in
                                                ("sample_threshold", "candidates", "select"))
                        if one_launch else float("nan"))
    res.update(steps)
    _progress(res, *steps, label=label)
    measure("triton_logits", lambda: _triton_logits_in_slices(q, k, k_scale, w, ks, ke, rows))
    # The pick for the slices' last bucket: at 4,096 x 131,072 run S8a timed this kernel at 5.26
    # ms against run Z6's 4.03 on the same tree, with no pick logged to tell a tuner's change.
    res["triton_logits_config"] = _best_config(mqa_logits._mqa_logits_tuned)
    _progress(res, "triton_logits_config", label=label)
    composed = None
    if deep_gemm is None:
        res["deepgemm_skipped"] = "import deep_gemm failed (the report's deep_gemm_error)"
    else:
        try:
            measure("deepgemm_logits",
                    lambda: _deepgemm_logits_in_slices(deep_gemm, q, k, k_scale, w, ks, ke, rows))
            composed = measure("composition",
                               lambda: peers.indexer_topk(q, w, k, k_scale, ks, ke, topk, budget))
            res["composition"] = "peers.indexer_topk: DeepGEMM's logits, our radix select"
        except Exception as e:  # DeepGEMM's own failure must not hide ours
            res["deepgemm_error"] = f"{type(e).__name__}: {e}"
    if composed is None:
        composed = measure("composition", lambda: fast.select_in_chunks(
            q, w, k, k_scale, ks, ke, topk, budget, fast._full_logits(q, w, k, k_scale)))
        res["composition"] = "select_in_chunks: our logits, our radix select"
    res["speedup_vs_composition"] = res["composition_ms"] / res["indexer_ms"]
    res["rate_vs_triton_logits"] = res["triton_logits_ms"] / res["indexer_ms"]
    if "deepgemm_logits_ms" in res:
        res["rate_vs_deepgemm_logits"] = res["deepgemm_logits_ms"] / res["indexer_ms"]
    res.update(_compare_topk(out, composed, q, w, k, k_scale, ks, ke, topk))
    _progress(res, "speedup_vs_composition", "rate_vs_deepgemm_logits", "topk_sets_equal_rows",
              label=label)
    return res


def _compare_topk(a, b, q, w, k, k_scale, ks, ke, topk: int) -> dict:
    """Two top-k outputs ``[S, topk]`` on FRONTIER_CHECK_ROWS rows: equal as sets, the members
    of ``a`` missing from ``b``, and each against the oracle's scores by ``topk_margin``
    (members within ``TOPK_REL_TOL`` of the row's largest |score| of the k-th best count as
    right: the two rank their own float32 logits, whose summation orders differ)."""
    from glm_dsa import oracle
    from glm_dsa.testing.metrics import TOPK_REL_TOL, check_tensor

    S = q.shape[0]
    pick = torch.linspace(0, S - 1, FRONTIER_CHECK_ROWS, device=q.device).long().unique()
    scores = oracle.fp8_mqa_logits(q[pick], (k, k_scale), w[pick], ks[pick], ke[pick]).cpu()
    starts, ends = ks[pick].cpu(), ke[pick].cpu()
    ref = oracle.topk_per_row(scores, starts, ends, topk)
    aux = {"scores": scores, "row_starts": starts, "row_ends": ends}
    spec = {"metric": "topk_margin", "rel_tol": TOPK_REL_TOL, "scores": "scores", "row_starts": "row_starts",
            "row_ends": "row_ends"}  # fmt: skip
    sa = [set(r) - {-1} for r in a[pick].tolist()]
    sb = [set(r) - {-1} for r in b[pick].tolist()]
    res: dict = {"check_rows": pick.tolist(), "topk_sets_equal_rows": sum(x == y for x, y in zip(sa, sb)),
                 "topk_members_differ": sum(len(x - y) for x, y in zip(sa, sb))}  # fmt: skip
    for name, got in (("indexer", a), ("composition", b)):
        v = check_tensor(spec, got[pick].cpu(), ref, aux.__getitem__)
        res[f"{name}_topk_margin"] = {"passed": v.passed, "worst": v.value, "detail": v.detail}
    return res


def _dims(text: str, names: str, example: str) -> list[tuple[int, ...]]:
    """Comma-separated ``AxBx…`` items, one field for each of ``names`` (``"rows x keys"``):
    positive integers with rows ≤ keys."""
    n = names.count(" x ") + 1
    shapes = []
    for item in text.split(","):
        fields = item.lower().split("x")
        if len(fields) != n or not all(f.strip().isdigit() for f in fields) or not (
                1 <= int(fields[0]) <= int(fields[1])):
            raise argparse.ArgumentTypeError(f"{item!r}: give {names}, 1 <= rows <= keys, e.g. {example}")
        shapes.append(tuple(int(f) for f in fields))
    return shapes


def _logits_shapes(text: str) -> list[tuple[int, ...]]:
    """``"4096x131072x32"`` → ``[(4096, 131072, 32)]`` (rows × keys × heads), comma-separated."""
    return _dims(text, "rows x keys x heads", "4096x131072x32")


def _shapes(text: str) -> list[tuple[int, ...]]:
    """``"64x1024,128x2048"`` → ``[(64, 1024), (128, 2048)]`` (rows × keys)."""
    return _dims(text, "rows x keys pairs", "64x1024,128x2048")


def _frontier_table(parts: dict) -> str:
    """Markdown table of the frontier parts: ms (TFLOP/s) of each, the ratios, the top-k check."""
    nan = float("nan")
    lines = ["\n| rows × keys | indexer_topk | sample / cand. / select / rest ms, redo | DeepGEMM logits "
             "| rate vs DeepGEMM logits | composition | speedup vs composition | our logits | sets equal "
             "| margin |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in parts.values():
        margin = r["indexer_topk_margin"]["passed"] and r["composition_topk_margin"]["passed"]
        lines.append(
            f"| {r['S']:,} × {r['N']:,} | {r['indexer_ms']:.2f} ms ({r['indexer_tflops']:.0f}) | "
            f"{r['sample_threshold_ms']:.1f} / {r['candidates_ms']:.1f} / {r['select_ms']:.1f} / "
            f"{r['rest_ms']:.1f}, {r['redo_rows']} | "
            f"{r.get('deepgemm_logits_ms', nan):.2f} ms ({r.get('deepgemm_logits_tflops', nan):.0f}) | "
            f"{r.get('rate_vs_deepgemm_logits', nan):.2f} | {r['composition_ms']:.2f} ms "
            f"({r['composition_tflops']:.0f}) | {r['speedup_vs_composition']:.2f} | "
            f"{r['triton_logits_ms']:.2f} ms ({r['triton_logits_tflops']:.0f}) | "
            f"{r['topk_sets_equal_rows']} of {len(r['check_rows'])} | {'pass' if margin else 'FAIL'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--deep-gemm", default=None, help="directory to put on sys.path for deep_gemm")
    p.add_argument("--parts", default="ceiling,indexer,logits,paged",
                   help="comma-separated: ceiling, indexer, logits, paged, frontier (module docstring)")
    p.add_argument("--gluon-configs", type=json.loads, default=[{}],
                   help="JSON list of entries overriding mqa_logits_gluon.CONFIG, each timed in the "
                        "logits part (the fastest reported); default: CONFIG alone")
    p.add_argument("--logits-shapes", type=_logits_shapes, default=None,
                   help="rows x keys x heads list for the logits part, e.g. 4096x131072x32 "
                        "(default: LOGITS_SHAPES)")
    p.add_argument("--frontier-shapes", type=_shapes, default=None,
                   help="rows x keys list for the frontier part, e.g. 64x1024,128x2048 "
                        "(default: FRONTIER_SHAPES)")
    p.add_argument("--frontier-topk", type=int, default=TOPK,
                   help=f"indices per row in the frontier part (default {TOPK})")
    args = p.parse_args(argv)
    parts = args.parts.split(",")
    shapes = args.frontier_shapes or FRONTIER_SHAPES
    if "frontier" in parts and not all(n > args.frontier_topk >= 1 for _, n in shapes):
        p.error(f"--frontier-topk {args.frontier_topk} must lie in [1, keys) of every frontier shape "
                "(at fewer keys every row keeps them all and nothing is selected)")
    if not torch.cuda.is_available():
        if parts != ["frontier"] or args.frontier_shapes is None or os.environ.get("TRITON_INTERPRET") != "1":
            print("needs a CUDA GPU; on the CPU only --parts frontier runs, with TRITON_INTERPRET=1 and tiny "
                  "--frontier-shapes (e.g. 8x128 --frontier-topk 8)", file=sys.stderr)
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

    props = torch.cuda.get_device_properties(0) if torch.cuda.is_available() else None
    report = {
        "device": props.name if props else "cpu (Triton's interpreter)",
        "sms": props.multi_processor_count if props else None,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "deep_gemm": None if deep_gemm is None else getattr(deep_gemm, "__version__", "imported"),
        "deep_gemm_error": dg_error,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(sys.argv),
        "parts": {},
    }
    jobs = []
    if "ceiling" in parts:
        jobs.append(("ceiling", part_ceiling))
    if "logits" in parts:
        jobs += [(f"logits_{S}x{N}_h{h}",
                  lambda S=S, N=N, h=h: part_logits(S, N, h, deep_gemm, args.gluon_configs))
                 for S, N, h in args.logits_shapes or LOGITS_SHAPES]
    if "paged" in parts:
        jobs += [(f"paged_{S}", lambda S=S: part_paged(S)) for S in (4096, 32768)]
    if "indexer" in parts:
        jobs.append(("indexer", lambda: part_indexer(deep_gemm)))
    if "frontier" in parts:
        jobs += [(f"frontier_{S}x{N}", lambda S=S, N=N: part_frontier(S, N, args.frontier_topk, deep_gemm))
                 for S, N in shapes]
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

    logits = {name: r for name, r in report["parts"].items() if "triton_ms" in r}
    if logits:
        print("\n| part | Triton ms (TFLOP/s) | Gluon ms (TFLOP/s) | DeepGEMM ms (TFLOP/s) | Triton vs DG "
              "| Gluon vs DG | Gluon vs Triton | calc_diff T / G / G-DG | masks T / G |")
        print("|---|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for name, r in logits.items():
        print(f"| {name} | {r['triton_ms']:.2f} ({r['triton_tflops']:.0f}) | "
              f"{r.get('gluon_ms', nan):.2f} ({r.get('gluon_tflops', nan):.0f}) | "
              f"{r.get('deepgemm_ms', nan):.2f} ({r.get('deepgemm_tflops', nan):.0f}) | "
              f"{r.get('ratio', nan):.3f} | {r.get('gluon_vs_deepgemm', nan):.3f} | "
              f"{r.get('gluon_vs_triton', nan):.3f} | {r['calc_diff']:.1e} / "
              f"{r.get('gluon_calc_diff', nan):.1e} / {r.get('gluon_calc_diff_vs_deepgemm', nan):.1e} | "
              f"{r['masks_equal']} / {r.get('gluon_masks_equal')} |")  # fmt: skip
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
    frontier = {n: r for n, r in report["parts"].items() if n.startswith("frontier_") and "indexer_ms" in r}
    if frontier:
        print(_frontier_table(frontier))
    Path(args.out).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
