"""Issue 43 (fifth session, run Y): `indexer_topk`'s host plan, the shipped one (no span read:
launches over every key, one windows kernel, the select writing into the call's tensors, one
read after the launches) against the previous one (each row chunk's span read first, ~26 torch
ops of windows, two reads after), in one process on the same kernels: the previous module is
kept verbatim as `2026-12-07e-span-plan-indexer.py` (792f3ee's
`glm_dsa/kernels/indexer.py`). Wall time of whole calls (synchronized before and after; median
of 20 after 3 warm-ups, the two plans alternating), outputs compared bitwise, at the frontier's
shapes (causal rows at the end of the keys, H 32, D 128, top-2048)."""
import importlib.util
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "..", "scripts"))
from bench_indexer import TOPK, _inputs  # noqa: E402

from glm_dsa import budget as budgets  # noqa: E402
from glm_dsa.kernels import indexer as shipped  # noqa: E402

spec = importlib.util.spec_from_file_location("span_plan", os.path.join(HERE, "2026-12-07e-span-plan-indexer.py"))
previous = importlib.util.module_from_spec(spec)
spec.loader.exec_module(previous)

print("| rows × keys | previous plan ms | shipped plan ms | saved ms | outputs equal |\n|---|---|---|---|---|")
for arg in sys.argv[1:]:
    S, N = (int(x) for x in arg.split("x"))
    q, k, k_scale, w, ks, ke = _inputs(S, N)
    budget = budgets.default_logits_bytes("cuda")
    fns = {"previous": lambda: previous.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, budget),
           "shipped": lambda: shipped.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, budget)}
    outs = {name: fn() for name, fn in fns.items()}
    for _ in range(3):
        for fn in fns.values():
            fn()
    ts = {name: [] for name in fns}
    for _ in range(20):
        for name, fn in fns.items():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            ts[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(v) * 1e3 for name, v in ts.items()}
    same = torch.equal(outs["previous"], outs["shipped"])
    print(f"| {S:,} × {N:,} | {med['previous']:.3f} | {med['shipped']:.3f} | "
          f"{med['previous'] - med['shipped']:.3f} | {same} |", flush=True)
    print("raw", arg, {name: [round(t * 1e3, 3) for t in v] for name, v in ts.items()}, flush=True)
