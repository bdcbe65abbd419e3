"""Benchmark the Triton sparse MLA kernels on one GPU (issue 19's attention rows).

For each shape (queries, heads): top-2048 over 131,072 keys, d_qk 576, d_v 512, bf16:
the Triton kernel's time and TFLOP/s (FLOPs = 2 * s_q * topk * h_q * (576 + 512)), FlashMLA's
(``flash_mla_sparse_sm90.sparse_prefill_fwd``) when it imports, their ratio, the FP8 paged form
(656-byte rows) and its ratio to bf16, and a correctness check against the oracle on a few
hundred rows. At 32,768 queries and 64 heads also the reference ``glm_dsa.mla.sparse_mla_fwd``.
Each form's autotune timings (one per kernel variant in ``_GPU_CONFIGS``) are recorded as
``*_variants``: config -> milliseconds at that shape (each row re-tunes).
Inputs as FlashMLA's tests: q and kv ``randn / 10``; each query attends 2,048 distinct rows below
its causal limit (queries are the last s_q tokens of the 131,072). Every part is guarded: one
failure is recorded and the rest still run. Autotune runs on first use (a few configs).

    python scripts/bench_sparse_mla.py --out bench/sparse_mla.json
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from glm_dsa import mla, oracle
from glm_dsa.testing.metrics import SPARSE_OUT_TOL, SPARSE_STAT_TOL

S_KV, TOPK, D_QK, D_V = 131_072, 2048, 576, 512
SM_SCALE = 1 / 16  # GLM-5.3: qk_head_dim ** -0.5
CHECK_ROWS = 256
REF_BUDGET_BYTES = 8 << 30  # the reference's row-chunk temporaries (it gathers [rows, 2048, 576])


def _flops(s_q: int, h: int) -> float:
    return 2.0 * s_q * TOPK * h * (D_QK + D_V)


def _time(fn, reps: int = 5) -> float:
    """Median seconds of ``fn()`` over ``reps`` CUDA-event-timed runs, after one warm-up."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def _indices(s_q: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [s_q, 1, TOPK]: query i (token S_KV - s_q + i) takes TOPK distinct rows below it."""
    limit = torch.arange(S_KV - s_q + 1, S_KV + 1, device="cuda")           # rows [0, limit)
    # Distinct draws without a per-row randperm: the top-TOPK of random keys over [0, S_KV),
    # with rows at or past the limit pushed to the bottom (limit > TOPK for every query here).
    cols = torch.arange(S_KV, device="cuda")
    out = torch.empty(s_q, TOPK, dtype=torch.int32, device="cuda")
    for r0 in range(0, s_q, 1024):
        r1 = min(s_q, r0 + 1024)
        keys = torch.rand(r1 - r0, S_KV, device="cuda", generator=gen)
        keys.masked_fill_(cols[None, :] >= limit[r0:r1, None], -1.0)
        out[r0:r1] = keys.topk(TOPK, dim=-1).indices.to(torch.int32)
    return out.view(s_q, 1, TOPK)


def _check(got, q, kv, idx, rows):
    want = oracle.flash_mla_sparse_fwd(q[rows], kv, idx[rows], SM_SCALE, D_V)
    result = {}
    for name, a, r, tol in zip(("out", "max_logits", "lse"), got, want,
                               (SPARSE_OUT_TOL, SPARSE_STAT_TOL, SPARSE_STAT_TOL)):
        res = oracle.check_allclose(a[rows].float(), r.float(), **tol)
        result[name] = {"passed": res.passed, "max_abs_err": res.max_abs_err,
                        "cos_diff": res.cos_diff}
    return result


def _retune(tuner) -> None:
    """Make the next call autotune again, at this shape (the tuning key has no s_q)."""
    tuner.cache.clear()
    tuner.configs_timings = {}


def _variants(tuner) -> dict:
    """The autotuner's last timings: ``"BLOCK_H: 64, ..." -> ms`` per variant it compiled."""
    timings = getattr(tuner, "configs_timings", None) or {}
    return {str(cfg): (t[0] if isinstance(t, (list, tuple)) else t) for cfg, t in timings.items()}


def _guard(record: dict, key: str, fn):
    try:
        record[key] = fn()
    except Exception as exc:  # one failing part must not stop the others
        record[key] = {"error": f"{type(exc).__name__}: {exc}",
                       "trace": traceback.format_exc(limit=3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="sparse_mla_bench.json")
    parser.add_argument("--queries", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    args = parser.parse_args()

    from glm_dsa.kernels import flash_mla_sparse_fwd, sparse_mla_fwd_fp8
    from glm_dsa.kernels.sparse_mla import _sparse_mla_fwd_kernel as tuner
    try:
        import flash_mla_sparse_sm90
    except ImportError:
        flash_mla_sparse_sm90 = None

    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = (torch.randn(S_KV, 1, D_QK, device="cuda", generator=gen) / 10).to(torch.bfloat16)
    fp8_rows = oracle.quantize_k_cache(kv.view(-1, 64, 1, D_QK)).view(-1, oracle.MLA_ROW_BYTES)
    kv_fp8_deq = oracle.dequantize_k_cache(fp8_rows.view(-1, 64, 1, oracle.MLA_ROW_BYTES))
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d"), "s_kv": S_KV, "topk": TOPK, "rows": []}
    for s_q in args.queries:
        idx = _indices(s_q, gen)
        for h in args.heads:
            q = (torch.randn(s_q, h, D_QK, device="cuda", generator=gen) / 10).to(torch.bfloat16)
            row = {"s_q": s_q, "h_q": h, "gflop": _flops(s_q, h) / 1e9}
            rows = torch.linspace(0, s_q - 1, CHECK_ROWS, device="cuda").long()
            t0 = time.time()
            _retune(tuner)
            _guard(row, "triton_s", lambda: _time(
                lambda: flash_mla_sparse_fwd(q, kv, idx, SM_SCALE, D_V)))
            row["first_call_incl_autotune_s"] = time.time() - t0
            row["triton_variants"] = _variants(tuner)
            _guard(row, "triton_check", lambda: _check(
                flash_mla_sparse_fwd(q, kv, idx, SM_SCALE, D_V), q, kv, idx, rows))
            _retune(tuner)
            _guard(row, "fp8_s", lambda: _time(
                lambda: sparse_mla_fwd_fp8(q, fp8_rows, idx, SM_SCALE, D_V)))
            row["fp8_variants"] = _variants(tuner)
            _guard(row, "fp8_check", lambda: _check(
                sparse_mla_fwd_fp8(q, fp8_rows, idx, SM_SCALE, D_V),
                q, kv_fp8_deq.view(-1, 1, D_QK), idx, rows))
            if flash_mla_sparse_sm90 is not None:
                _guard(row, "flashmla_s", lambda: _time(
                    lambda: flash_mla_sparse_sm90.sparse_prefill_fwd(
                        q, kv, idx, SM_SCALE, D_V, None, None)))
            if s_q == 32768 and h == 64:
                _guard(row, "reference_s", lambda: _time(
                    lambda: mla.sparse_mla_fwd(q, kv, idx, SM_SCALE, D_V,
                                               budget_bytes=REF_BUDGET_BYTES), reps=1))
            for key in ("triton_s", "fp8_s", "flashmla_s", "reference_s"):
                if isinstance(row.get(key), float):
                    row[key.replace("_s", "_tflops")] = _flops(s_q, h) / row[key] / 1e12
            # Time ratios: triton_vs_flashmla >= 0.9 and fp8_over_bf16 <= 1.2 are the targets.
            for num, den, name in (("flashmla_s", "triton_s", "triton_vs_flashmla"),
                                   ("fp8_s", "triton_s", "fp8_over_bf16"),
                                   ("reference_s", "triton_s", "reference_over_triton")):
                if isinstance(row.get(num), float) and isinstance(row.get(den), float):
                    row[name] = row[num] / row[den]
            report["rows"].append(row)
            print(_line(row), flush=True)
            for form in ("triton_variants", "fp8_variants"):
                for cfg, ms in row[form].items():
                    print(f"    {form[:-9]:6s} {ms:8.3f} ms  {cfg}", flush=True)
            del q
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


def _line(row: dict) -> str:
    def fmt(key, unit):
        v = row.get(key)
        return f"{v:8.2f}{unit}" if isinstance(v, float) else f"{'n/a':>8}{unit}"

    ok = lambda key: ("ok" if isinstance(row.get(key), dict) and  # noqa: E731
                      all(v.get("passed") for v in row[key].values() if isinstance(v, dict))
                      else "FAIL")
    return (f"s_q {row['s_q']:6d} h {row['h_q']:3d} | triton {fmt('triton_tflops', ' TF/s')} "
            f"[{ok('triton_check')}] | flashmla {fmt('flashmla_tflops', ' TF/s')} "
            f"ratio {fmt('triton_vs_flashmla', '')} | fp8 {fmt('fp8_tflops', ' TF/s')} "
            f"[{ok('fp8_check')}] fp8/bf16 {fmt('fp8_over_bf16', '')} | "
            f"ref/triton {fmt('reference_over_triton', '')}")


if __name__ == "__main__":
    main()
