"""Benchmark the sparse MLA kernels on one GPU (issues 19 and 29's attention rows).

For each shape (queries, heads): top-2048 over ``--s-kv`` keys (131,072), d_qk 576, d_v 512,
bf16, in one run on the same inputs: the Gluon sm_90 kernel (``kernels.sparse_mla_gluon``, what
the triton backend dispatches to on sm_90), the Triton kernel (``kernels.sparse_mla``'s own,
what runs elsewhere), FlashMLA (``flash_mla_sparse_sm90.sparse_prefill_fwd``) when it imports,
both kernels over the FP8 pool's 656-byte rows (``gluon_fp8``, ``triton_fp8``; FlashMLA has no
FP8 prefill), the FP8-query form (``q8kv8``: ``kernels.sparse_mla_q8kv8_prefill_fwd``, the public
entry, so the Gluon Q8KV8 kernel on sm_90 where it is installed; the same q and kv quantized per
tensor, ``glm_dsa.fp8.per_tensor_quant``; checked against its own oracle contract and its
``calc_diff`` against the bf16 oracle recorded), and at 32,768 queries and 64 heads the reference
``glm_dsa.mla.sparse_mla_fwd``. Per form: time, TFLOP/s (FLOPs = 2 * s_q * topk * h_q * (576 +
512)) and the effective gather rate, TB/s = bytes the CTAs gather (s_q * h_q / 64 * topk * 1,152
for bf16 rows, * 656 for FP8: each 64-head CTA reads every selected row once) / time; time
ratios to FlashMLA; a correctness check against the oracle on a few hundred rows. The Triton
forms' autotune timings are recorded as ``*_variants`` (config -> ms; each row re-tunes).
Inputs as FlashMLA's tests: q and kv ``randn / 10``; each query attends 2,048 distinct rows below
its causal limit (queries are the last s_q tokens of the s_kv), a share ``--local`` of them
within ``LOCAL_WINDOW`` rows of that limit (issue #42's table: 0 and 0.5). Every part is guarded: one
failure is recorded and the rest still run.

    python scripts/bench_sparse_mla.py --out bench/sparse_mla.json
    python scripts/bench_sparse_mla.py --queries 16384 --s-kv 1048576 --forms gluon flashmla
    python scripts/bench_sparse_mla.py --forms flashmla gluon q8kv8 --local 0.5
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from glm_dsa import mla, oracle
from glm_dsa.fp8 import per_tensor_quant
from glm_dsa.testing.metrics import Q8KV8_OUT_TOL, Q8KV8_STAT_TOL, SPARSE_OUT_TOL, SPARSE_STAT_TOL

from benchlib import median_seconds

TOPK, D_QK, D_V = 2048, 576, 512
FORMS = ("gluon", "gluon_fp8", "triton", "triton_fp8", "q8kv8", "flashmla", "reference")
LOCAL_WINDOW = 4096  # rows before a query's causal limit that count as local
SM_SCALE = 1 / 16  # GLM-5.3: qk_head_dim ** -0.5
CHECK_ROWS = 256
REF_BUDGET_BYTES = 8 << 30  # the reference's row-chunk temporaries (it gathers [rows, 2048, 576])


def _flops(s_q: int, h: int) -> float:
    return 2.0 * s_q * TOPK * h * (D_QK + D_V)


def _gather_tbps(s_q: int, h: int, row_bytes: int, seconds: float) -> float:
    return s_q * (h // 64) * TOPK * row_bytes / seconds / 1e12


def _row_bytes(form: str) -> int:
    """Bytes a CTA gathers per selected row: FP8 656-byte rows, e4m3 576-byte rows, bf16 1152."""
    if form == "q8kv8":
        return D_QK
    return oracle.MLA_ROW_BYTES if form.endswith("fp8") else 2 * D_QK


def _indices(s_q: int, s_kv: int, gen: torch.Generator, local: float = 0.0) -> torch.Tensor:
    """int32 [s_q, 1, TOPK]: query i (token s_kv - s_q + i) takes TOPK distinct rows below it,
    ``round(local * TOPK)`` of them among the LOCAL_WINDOW rows just below, the rest anywhere
    below those (anywhere below the limit when ``local`` is 0)."""
    limit = torch.arange(s_kv - s_q + 1, s_kv + 1, device="cuda")           # rows [0, limit)
    n_local = round(local * TOPK)
    if n_local:
        near = torch.rand(s_q, LOCAL_WINDOW, device="cuda", generator=gen)
        near = limit[:, None] - 1 - near.topk(n_local, dim=-1).indices        # [s_q, n_local]
        far = _draw(s_q, s_kv, limit - LOCAL_WINDOW, TOPK - n_local, gen)
        return torch.cat([near.to(torch.int32), far], dim=-1).view(s_q, 1, TOPK)
    return _draw(s_q, s_kv, limit, TOPK, gen).view(s_q, 1, TOPK)


def _draw(s_q: int, s_kv: int, limit: torch.Tensor, k: int, gen: torch.Generator) -> torch.Tensor:
    """int32 [s_q, k]: row i takes k distinct rows of [0, limit[i])."""
    if k == 0:
        return torch.empty(s_q, 0, dtype=torch.int32, device="cuda")
    # Distinct draws without a per-row randperm: the top-TOPK of random keys over [0, s_kv),
    # with rows at or past the limit pushed to the bottom (limit > TOPK for every query here).
    cols = torch.arange(s_kv, device="cuda")
    out = torch.empty(s_q, k, dtype=torch.int32, device="cuda")
    step = max(1, (1 << 28) // s_kv)  # rows of random keys per draw (1 GB of float32)
    for r0 in range(0, s_q, step):
        r1 = min(s_q, r0 + step)
        keys = torch.rand(r1 - r0, s_kv, device="cuda", generator=gen)
        keys.masked_fill_(cols[None, :] >= limit[r0:r1, None], -1.0)
        out[r0:r1] = keys.topk(k, dim=-1).indices.to(torch.int32)
    return out


def _check(got, q, kv, idx, rows, q8kv8=None):
    """The oracle's verdicts on ``rows``; for the FP8-query form (``q8kv8``: ``(q_fp8, kv_fp8,
    q_scale, kv_scale)``) its own contract's, and ``out``'s calc_diff against bf16 attention."""
    if q8kv8 is None:
        want = oracle.flash_mla_sparse_fwd(q[rows], kv, idx[rows], SM_SCALE, D_V)
        out_tol, stat_tol = SPARSE_OUT_TOL, SPARSE_STAT_TOL
    else:
        q_fp8, kv_fp8, q_scale, kv_scale = q8kv8
        q_rows = q_fp8.view(torch.uint8)[rows].view(torch.float8_e4m3fn)  # no e4m3 gather kernel needed
        want = oracle.sparse_mla_q8kv8_prefill_fwd(q_rows, kv_fp8, idx[rows], SM_SCALE, q_scale,
                                                   kv_scale, D_V)
        out_tol, stat_tol = Q8KV8_OUT_TOL, Q8KV8_STAT_TOL
    result = {}
    for name, a, r, tol in zip(("out", "max_logits", "lse"), got, want,
                               (out_tol, stat_tol, stat_tol)):
        res = oracle.check_allclose(a[rows].float(), r.float(), **tol)
        result[name] = {"passed": res.passed, "max_abs_err": res.max_abs_err,
                        "cos_diff": res.cos_diff}
    if q8kv8 is not None:
        bf16 = oracle.flash_mla_sparse_fwd(q[rows], kv, idx[rows], SM_SCALE, D_V)[0]
        result["calc_diff_vs_bf16"] = oracle.calc_diff(got[0][rows].double(), bf16.double())
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
    parser.add_argument("--queries", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--s-kv", type=int, default=131_072, help="keys in the context")
    parser.add_argument("--forms", nargs="+", choices=FORMS, default=list(FORMS))
    parser.add_argument("--reps", type=int, default=5, help="timed runs per form (median)")
    parser.add_argument("--local", type=float, default=0.0, metavar="FRACTION",
                        help=f"share of each query's indices drawn within {LOCAL_WINDOW:,} rows of its "
                             "causal limit (default 0: all anywhere below it)")
    parser.add_argument("--gluon-variants", nargs="*", default=[], metavar="JSON",
                        help="also time the Gluon bf16 kernel with these CONFIG overrides, "
                             'e.g. \'{"schedule": "seesaw"}\' (recorded as gluon_variants: '
                             "config -> ms, with gluon_variants_check, where FlashMLA ran "
                             "gluon_variants_vs_flashmla, and with gluon in --forms "
                             "gluon_variants_bitwise: whether out, max_logits and lse equal "
                             "CONFIG's bit for bit, as a gather_hint's must)")
    parser.add_argument("--gluon-fp8-variants", nargs="*", default=[], metavar="JSON",
                        help="the same for the Gluon FP8-row kernel (with gluon_fp8 in --forms), "
                             'e.g. \'{"stages": 3}\' (recorded as gluon_fp8_variants)')
    args = parser.parse_args()
    forms, s_kv = set(args.forms), args.s_kv
    if not 0.0 <= args.local <= 1.0:
        parser.error(f"--local {args.local} must lie in [0, 1]")
    if s_kv - max(args.queries) < LOCAL_WINDOW + TOPK:
        parser.error(f"--s-kv {s_kv} needs {LOCAL_WINDOW + TOPK} rows below the first query")

    import triton

    from glm_dsa.kernels import sparse_mla, sparse_mla_q8kv8
    from glm_dsa.kernels.sparse_mla import _sparse_mla_fwd_kernel as tuner
    try:
        import flash_mla_sparse_sm90
    except ImportError:
        flash_mla_sparse_sm90 = None
    gluon_ok = (torch.cuda.get_device_capability() == (9, 0)
                and triton.__version__ in sparse_mla.GLUON_TESTED_TRITON)
    if gluon_ok:
        from glm_dsa.kernels.sparse_mla_gluon import CONFIG as GLUON_CONFIG
        from glm_dsa.kernels.sparse_mla_gluon import flash_mla_sparse_fwd_gluon

    gen = torch.Generator(device="cuda").manual_seed(0)
    kv = (torch.randn(s_kv, 1, D_QK, device="cuda", generator=gen) / 10).to(torch.bfloat16)
    if forms & {"gluon_fp8", "triton_fp8"}:
        fp8_rows = oracle.quantize_k_cache(kv.view(-1, 64, 1, D_QK)).view(-1, oracle.MLA_ROW_BYTES)
        kv_fp8_deq = oracle.dequantize_k_cache(fp8_rows.view(-1, 64, 1, oracle.MLA_ROW_BYTES))
    if "q8kv8" in forms:
        kv_q8, kv_q8_scale = per_tensor_quant(kv)
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "triton": triton.__version__, "date": time.strftime("%Y-%m-%d"), "s_kv": s_kv,
              "topk": TOPK, "local": args.local, "local_window": LOCAL_WINDOW,
              "gluon_config": GLUON_CONFIG if gluon_ok else None,
              # The peer build exposes no version; shared/peer/README.md names FlashMLA 9241ae3.
              "flashmla_commit": getattr(flash_mla_sparse_sm90, "__version__", None),
              "rows": []}
    for s_q in args.queries:
        idx = _indices(s_q, s_kv, gen, args.local)
        for h in args.heads:
            q = (torch.randn(s_q, h, D_QK, device="cuda", generator=gen) / 10).to(torch.bfloat16)
            row = {"s_q": s_q, "h_q": h, "gflop": _flops(s_q, h) / 1e9}
            rows = torch.linspace(0, s_q - 1, CHECK_ROWS, device="cuda").long()
            time_it = lambda fn: median_seconds(fn, reps=args.reps)  # noqa: E731
            runs = {}
            if "gluon" in forms and gluon_ok:
                runs["gluon"] = lambda: flash_mla_sparse_fwd_gluon(
                    q, kv, kv.stride(0), s_kv, idx, SM_SCALE, None, None)
            if "flashmla" in forms and flash_mla_sparse_sm90 is not None:
                runs["flashmla"] = lambda: flash_mla_sparse_sm90.sparse_prefill_fwd(
                    q, kv, idx, SM_SCALE, D_V, None, None)
            if "gluon_fp8" in forms and gluon_ok:
                runs["gluon_fp8"] = lambda: flash_mla_sparse_fwd_gluon(
                    q, fp8_rows, fp8_rows.stride(0), s_kv, idx, SM_SCALE, None, None, fp8=True)
            if "q8kv8" in forms:
                q_q8, q_q8_scale = per_tensor_quant(q)
                q8kv8_args = (q_q8, kv_q8, q_q8_scale, kv_q8_scale)
                row["q8kv8_kernel"] = sparse_mla_q8kv8._gluon_unsuitable(q_q8, kv_q8, D_V) or "gluon"
                runs["q8kv8"] = lambda: sparse_mla_q8kv8.sparse_mla_q8kv8_prefill_fwd(
                    q_q8, kv_q8, idx, SM_SCALE, q_q8_scale, kv_q8_scale, D_V)
            if "triton" in forms:
                runs["triton"] = lambda: sparse_mla._launch_triton(
                    q, kv, kv.stride(0), s_kv, idx, SM_SCALE, D_V, None, None, False)
            if "triton_fp8" in forms:
                runs["triton_fp8"] = lambda: sparse_mla._launch_triton(
                    q, fp8_rows, fp8_rows.stride(0), s_kv, idx, SM_SCALE, D_V, None, None, True)
            # CONFIG's results, for the variants' bitwise comparison (a failure shows in gluon_s).
            held: dict = {}
            if "gluon" in runs and args.gluon_variants:
                _guard(held, "base", runs["gluon"])
            base = held.get("base") if isinstance(held.get("base"), tuple) else None
            for text in args.gluon_variants if gluon_ok else ():
                variant = lambda: flash_mla_sparse_fwd_gluon(  # noqa: E731
                    q, kv, kv.stride(0), s_kv, idx, SM_SCALE, None, None, json.loads(text))
                _guard(row.setdefault("gluon_variants", {}), text,
                       lambda: time_it(variant) * 1e3)
                _guard(row.setdefault("gluon_variants_check", {}), text,
                       lambda: _check(variant(), q, kv, idx, rows))
                if base is not None:
                    _guard(row.setdefault("gluon_variants_bitwise", {}), text,
                           lambda: all(torch.equal(a, b) for a, b in zip(variant(), base)))
            del base, held
            for text in args.gluon_fp8_variants if "gluon_fp8" in runs else ():
                _guard(row.setdefault("gluon_fp8_variants", {}), text, lambda: time_it(
                    lambda: flash_mla_sparse_fwd_gluon(
                        q, fp8_rows, fp8_rows.stride(0), s_kv, idx, SM_SCALE, None, None,
                        json.loads(text), fp8=True)) * 1e3)
            for form, fn in runs.items():
                t0 = time.time()
                if form.startswith("triton"):
                    _retune(tuner)
                _guard(row, f"{form}_s", lambda: time_it(fn))
                row[f"{form}_first_call_s"] = time.time() - t0
                if form.startswith("triton"):
                    row[f"{form}_variants"] = _variants(tuner)
                rows_kv = kv_fp8_deq.view(-1, 1, D_QK) if form.endswith("fp8") else kv
                _guard(row, f"{form}_check", lambda: _check(
                    fn(), q, rows_kv, idx, rows, q8kv8_args if form == "q8kv8" else None))
            if "reference" in forms and s_q == 32768 and h == 64:
                _guard(row, "reference_s", lambda: median_seconds(
                    lambda: mla.sparse_mla_fwd(q, kv, idx, SM_SCALE, D_V,
                                               budget_bytes=REF_BUDGET_BYTES), reps=1))
            for form in FORMS:
                sec = row.get(f"{form}_s")
                if isinstance(sec, float):
                    row[f"{form}_tflops"] = _flops(s_q, h) / sec / 1e12
                    row[f"{form}_gather_tbps"] = _gather_tbps(s_q, h, _row_bytes(form), sec)
            # Time ratios: gluon_vs_flashmla >= 0.9 and gluon_fp8_over_bf16 <= 1.1 are the
            # targets (rates: FlashMLA's time over ours).
            for num, den, name in (("flashmla_s", "gluon_s", "gluon_vs_flashmla"),
                                   ("flashmla_s", "triton_s", "triton_vs_flashmla"),
                                   ("flashmla_s", "q8kv8_s", "q8kv8_vs_flashmla"),
                                   ("gluon_s", "q8kv8_s", "q8kv8_vs_gluon"),
                                   ("triton_s", "gluon_s", "triton_over_gluon"),
                                   ("gluon_fp8_s", "gluon_s", "gluon_fp8_over_bf16"),
                                   ("triton_fp8_s", "triton_s", "triton_fp8_over_bf16"),
                                   ("reference_s", "gluon_s", "reference_over_gluon")):
                if isinstance(row.get(num), float) and isinstance(row.get(den), float):
                    row[name] = row[num] / row[den]
            for text, ms in row.get("gluon_variants", {}).items():
                if isinstance(ms, float) and isinstance(row.get("flashmla_s"), float):
                    row.setdefault("gluon_variants_vs_flashmla", {})[text] = (
                        row["flashmla_s"] * 1e3 / ms)
            report["rows"].append(row)
            print(_line(row), flush=True)
            for form in ("gluon_variants", "gluon_fp8_variants", "triton_variants",
                         "triton_fp8_variants"):
                for cfg, ms in row.get(form, {}).items():
                    shown = f"{ms:8.3f} ms" if isinstance(ms, float) else f"error {ms}"
                    if form == "gluon_variants":
                        ratio = row.get("gluon_variants_vs_flashmla", {}).get(cfg)
                        check = row["gluon_variants_check"].get(cfg, {})
                        passed = all(isinstance(c, dict) and c.get("passed")
                                     for c in check.values()) and "error" not in check
                        shown += (f"  {ratio:.3f}x FlashMLA" if ratio else "") + (
                            "  check passed" if passed else "  CHECK FAILED")
                        same = row.get("gluon_variants_bitwise", {}).get(cfg)
                        if isinstance(same, bool):
                            shown += "  bitwise = CONFIG's" if same else "  NOT bitwise CONFIG's"
                    print(f"    {form[:-9]:10s} {shown}  {cfg}", flush=True)
            for key, val in row.items():
                if isinstance(val, dict) and "error" in val:
                    print(f"    {key}: {val['error']}", flush=True)
            del q
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


def _line(row: dict) -> str:
    def fmt(key, unit, width=7):
        v = row.get(key)
        return f"{v:{width}.2f}{unit}" if isinstance(v, float) else f"{'n/a':>{width}}{unit}"

    def ok(form):
        res = row.get(f"{form}_check")
        if not isinstance(res, dict):
            return "--"
        return "ok" if all(v.get("passed") for v in res.values() if isinstance(v, dict)) else "FAIL"

    parts = [f"s_q {row['s_q']:6d} h {row['h_q']:3d}"]
    for form in ("gluon", "gluon_fp8", "q8kv8", "flashmla", "triton", "triton_fp8"):
        rate, gather = fmt(f"{form}_tflops", " TF/s"), fmt(f"{form}_gather_tbps", " TB/s", 5)
        parts.append(f"{form} {rate} {gather} [{ok(form)}]")
    parts.append(f"gluon/flashmla {fmt('gluon_vs_flashmla', '', 5)}")
    parts.append(f"triton/flashmla {fmt('triton_vs_flashmla', '', 5)}")
    parts.append(f"q8kv8/flashmla {fmt('q8kv8_vs_flashmla', '', 5)}")
    parts.append(f"gluon fp8/bf16 time {fmt('gluon_fp8_over_bf16', '', 5)}")
    diff = (row.get("q8kv8_check") or {}).get("calc_diff_vs_bf16")
    if isinstance(diff, float):
        parts.append(f"q8kv8 calc_diff vs bf16 {diff:.1e} ({row.get('q8kv8_kernel')})")
    return " | ".join(parts)


if __name__ == "__main__":
    main()
