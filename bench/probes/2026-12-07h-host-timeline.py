"""Issue 43 (eighth session): where the host's time goes inside one ``indexer_topk`` call at a
short chunk, and whether the GPU waits for it.

Run S8a (H100) measured 4,096 x 131,072 at 6.55 ms a call against 5.28 ms of kernels (run Z6:
5.79 against 5.45): a millisecond outside the kernels, on the host. Here each step of the call
(the input checks, the row windows, the sampled keys' copies, the sample logits, the
thresholds, the candidate kernel, the select) is wrapped: when its launch returns on the host
(``host``, µs from the call's entry) and when the GPU reaches the same point of the stream (an
event recorded there, ``gpu``). Where ``gpu - host`` is a few µs the GPU had drained its queue
and waited for the host; the candidate kernel's ``gpu`` is when the long kernel starts.
Medians of 20 calls, after 3 untimed. Second table: the host µs of each autotuned launch,
split into the autotuner's own work (``Autotuner.run`` less the ``JITFunction.run`` it calls)
and the JIT launch.

    python bench/probes/2026-12-07h-host-timeline.py [SxN]
"""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_indexer import TOPK, _inputs  # noqa: E402

from glm_dsa import budget  # noqa: E402
from glm_dsa.kernels import indexer as ix  # noqa: E402
from glm_dsa.kernels import mqa_logits as ml  # noqa: E402

STEPS = ["check_indexer_topk_inputs", "check_kernel_shapes", "check_cuda_tensor",
         "launch_windows", "_Sample", "launch_mqa_logits", "launch_thresholds",
         "launch_mqa_candidates", "launch_select_candidates"]
marks: list = []


def wrap(name):
    fn = getattr(ix, name)

    def timed(*a, **kw):
        r = fn(*a, **kw)
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((name, time.perf_counter(), e))
        return r

    setattr(ix, name, timed)


launches: dict = {}


def wrap_tuner(name):
    tuner = getattr(ml, name)
    outer, inner = tuner.run, tuner.fn.run
    spent = launches.setdefault(name, {"tuner": [], "jit": []})

    def run_inner(*a, **kw):
        t = time.perf_counter()
        r = inner(*a, **kw)
        spent["jit"].append((time.perf_counter() - t) * 1e6)
        return r

    def run_outer(*a, **kw):
        t = time.perf_counter()
        n = len(spent["jit"])
        r = outer(*a, **kw)
        spent["tuner"].append((time.perf_counter() - t) * 1e6 - sum(spent["jit"][n:]))
        return r

    tuner.fn.run, tuner.run = run_inner, run_outer


def main():
    S, N = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "4096x131072").split("x"))
    q, k, k_scale, w, ks, ke = _inputs(S, N)
    budget_bytes = budget.logits_budget_bytes("cuda")
    for name in STEPS:
        wrap(name)
    for name in ("_mqa_logits_tuned", "_mqa_candidates_tuned"):
        wrap_tuner(name)
    rows = {}
    walls = []
    for rep in range(23):
        marks.clear()
        torch.cuda.synchronize()
        e0 = torch.cuda.Event(enable_timing=True)
        e0.record()
        t0 = time.perf_counter()
        ix.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, budget_bytes)
        e1 = torch.cuda.Event(enable_timing=True)
        e1.record()
        marks.append(("return", time.perf_counter(), e1))
        torch.cuda.synchronize()
        if rep < 3:
            continue
        walls.append(e0.elapsed_time(e1) * 1e3)
        for i, (name, t, e) in enumerate(marks):
            rows.setdefault((i, name), []).append(((t - t0) * 1e6, e0.elapsed_time(e) * 1e3))
    print(f"{S} x {N}, budget {budget_bytes}: call {statistics.median(walls):.0f} µs on the GPU clock")
    print("| # | step returned | host µs | gpu µs | gpu - host |")
    print("|---|---|---|---|---|")
    for (i, name), v in sorted(rows.items()):
        h = statistics.median(x[0] for x in v)
        g = statistics.median(x[1] for x in v)
        print(f"| {i} | {name} | {h:.0f} | {g:.0f} | {g - h:.0f} |")
    print("| autotuned kernel | autotuner µs | JIT launch µs | launches |")
    print("|---|---|---|---|")
    for name, spent in launches.items():
        print(f"| {name} | {statistics.median(spent['tuner'][3:]):.1f} | "
              f"{statistics.median(spent['jit'][3:]):.1f} | {len(spent['jit'])} |")


if __name__ == "__main__":
    main()

