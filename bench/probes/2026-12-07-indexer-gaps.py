"""Issue 43 (run R): where `indexer_topk`'s 4,096 x 131,072 call leaves the GPU idle, and one
launch of the candidate and logits kernels for Nsight Compute.

`gaps`: after two untimed calls, one call under torch.profiler; prints each device idle gap of
over 10 us inside the call with the device activities on either side and the host ops that ran
in it (the chrome trace goes to $OUT/indexer-gaps.json). `candidates` / `logits`: after a warm-up
call (the autotuner's choice is cached on disk), one launch of that kernel alone, for
`ncu -k regex:_mqa_(candidates|logits)_kernel --launch-skip 1 --launch-count 1`."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_indexer import TOPK, _inputs  # noqa: E402

from glm_dsa.kernels import indexer as fast  # noqa: E402
from glm_dsa.kernels.mqa_logits import launch_mqa_candidates, launch_mqa_logits  # noqa: E402
from glm_dsa.kernels.topk import CAND_FACTOR, COUNTERS, launch_thresholds  # noqa: E402

S, N = 4096, 131_072
BUDGET = 6 << 30
q, k, k_scale, w, ks, ke = _inputs(S, N)
what = sys.argv[1]
if what == "gaps":
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    for _ in range(2):
        fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)
        torch.cuda.synchronize()
    prof.export_chrome_trace(os.path.join(os.environ.get("OUT", "/tmp"), "indexer-gaps.json"))
    ev = prof.events()
    dev = sorted((e for e in ev if e.device_type == DeviceType.CUDA), key=lambda e: e.time_range.start)
    host = sorted((e for e in ev if e.device_type == DeviceType.CPU), key=lambda e: e.time_range.start)
    total = 0.0
    print(f"{len(dev)} device activities over {(dev[-1].time_range.end - dev[0].time_range.start) / 1e3:.3f} ms")
    end = dev[0].time_range.end
    for a, b in zip(dev, dev[1:]):
        end = max(end, a.time_range.end)
        gap = b.time_range.start - end
        if gap > 10:
            total += gap
            ops = [h.name for h in host if end <= h.time_range.start < b.time_range.start
                   and not h.name.startswith(("cuda", "aten::empty", "aten::view"))]
            print(f"gap {gap:7.1f} us  after {a.name[:40]!r} before {b.name[:40]!r}; host: "
                  + ", ".join(dict.fromkeys(ops))[:400])
    print(f"gaps over 10 us: {total / 1e3:.3f} ms")
    for e in dev:
        print(f"  {e.time_range.elapsed_us():9.1f} us  {e.name[:80]}")
else:
    fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)
    torch.cuda.synchronize()
    if what == "candidates":
        # The thresholds of a real call: the sample's, so the kept share is the call's (~4 %).
        lens = ke - ks
        stride = fast.sample_stride(N, TOPK)
        s_starts = ks.add(stride - 1).floor_divide(stride)
        s_ends = ke.add(stride - 1).floor_divide(stride)
        sample = launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w,
                                   s_starts, s_ends, False, 0)
        thr = launch_thresholds(sample, s_starts, s_ends, lens, TOPK, CAND_FACTOR * TOPK)
        for _ in range(2):
            counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device="cuda")
            launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, CAND_FACTOR * TOPK)
        print("kept mean", counters[:, 0].float().mean().item())
    else:
        for _ in range(2):
            launch_mqa_logits(q, k, k_scale, w, ks, ke, False, 0)
    torch.cuda.synchronize()
    print(what, "ran")
