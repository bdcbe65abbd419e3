"""Issue 43 (run V): the host time of each step of `indexer_topk` before its candidate kernel at
4,096 x 131,072 (the short chunk), by `time.perf_counter` around each call with no
synchronization inside the timed part: median of 50 after 20 warm-up calls, the GPU kept busy
by a `torch.cuda._sleep` queued first so that no call waits on it (50: a step of 15 kernels
queues 750 launches, inside CUDA's launch queue). The host reads (`.tolist()`, `.item()`,
the input checks' read) are timed after a synchronize, the GPU idle."""
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_indexer import TOPK, _inputs  # noqa: E402

from glm_dsa.kernels import indexer as fast  # noqa: E402
from glm_dsa.kernels.mqa_logits import launch_mqa_candidates, launch_mqa_logits  # noqa: E402
from glm_dsa.kernels.topk import CAND_FACTOR, COUNTERS, launch_select_candidates, launch_thresholds  # noqa: E402
from glm_dsa.validate import check_indexer_topk_inputs  # noqa: E402

S, N = 4096, 131_072
q, k, k_scale, w, ks, ke = _inputs(S, N)
lens = (ke - ks).to(torch.int32)
stride = fast.sample_stride(N, TOPK)
cand = CAND_FACTOR * TOPK
s_starts = ks.add(stride - 1).floor_divide(stride)
s_ends = ke.add(stride - 1).floor_divide(stride)
sk, ss = k[::stride].contiguous(), k_scale[::stride].contiguous()
sample = launch_mqa_logits(q, sk, ss, w, s_starts, s_ends, False, 0)
thr = launch_thresholds(sample, s_starts, s_ends, lens, TOPK, cand)
counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device="cuda")
keys, cols = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, cand)


def prep():
    starts = ks.to(torch.int32)
    ln = ke.to(torch.int32) - starts
    ends = torch.where(ln > TOPK, starts + ln, starts)
    a, b = k[::stride].contiguous(), k_scale[::stride].contiguous()
    s0 = starts.add(stride - 1).floor_divide(stride)
    s1 = torch.where(ln > cand, ends.add(stride - 1).floor_divide(stride), s0)
    return a, b, s0, s1


def span():
    a, b = ks.long(), ke.long()
    n = b - a
    ne = n > 0
    return torch.stack([n.max(), torch.where(ne, a, N).min(), torch.where(ne, b, 0).max()])


steps = {
    "one small torch op (ks.add)": lambda: ks.add(1),
    "the span's ops, without the read": span,
    "the launch's windows and sample keys (15 torch ops)": prep,
    "sample logits launch (autotuned Triton)": lambda: launch_mqa_logits(q, sk, ss, w, s_starts, s_ends, False, 0),
    "threshold launch (Triton)": lambda: launch_thresholds(sample, s_starts, s_ends, lens, TOPK, cand),
    "counters zeros": lambda: torch.zeros((S, COUNTERS), dtype=torch.int32, device="cuda"),
    "candidate launch (autotuned Triton)": lambda: launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, cand),
    "select launch (Triton)": lambda: launch_select_candidates(keys, cols, counters, lens, TOPK),
}
print("| step | host us (median of 50) |\n|---|---|")
for name, fn in steps.items():
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(1_000_000_000)  # ~0.6 s of GPU time queued ahead: nothing below waits on it
    ts = []
    for _ in range(50):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    print(f"| {name} | {statistics.median(ts) * 1e6:.1f} |", flush=True)
    torch.cuda.synchronize()
reads = {"the input checks, with their read": lambda: check_indexer_topk_inputs(q, w, k, k_scale, ks, ke, TOPK),
         "a host read of three numbers (.tolist)": lambda: span().tolist(),
         "a host read of one flag (.item)": lambda: bool((ks < 0).any())}
for name, fn in reads.items():
    ts = []
    for _ in range(200):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    print(f"| {name}, GPU idle | {statistics.median(ts) * 1e6:.1f} |")
for _ in range(3):
    fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, 6 << 30)
ts = []
for _ in range(20):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, 6 << 30)
    torch.cuda.synchronize()
    ts.append(time.perf_counter() - t0)
print(f"| whole indexer_topk (wall, ms) | {statistics.median(ts) * 1e3:.3f} |")
