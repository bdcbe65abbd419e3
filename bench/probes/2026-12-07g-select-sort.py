"""Issue 43 (seventh session): the candidate select's ascending sort as its own kernel of few
warps, against the select of 9135a69 that sorts inside its 8-warp program.

Inside the select's program the sort (``tl.sort``, a bitonic network over the row's 2,048
columns) crossed warps through shared memory with a barrier each step: 0.34 of the select's
1.12 ms at 4,096 rows (run O). ``_sort_rows_kernel`` sorts a row in one program of
``SORT_WARPS`` warps after the select has written it unsorted.

At 4,096 x 131,072 (the frontier's inputs and thresholds, the candidate buffers of one
candidate-kernel launch): the old ``launch_select_candidates`` and the new one at 1, 2, 4 and 8
sort warps (CUDA-event medians of 20), outputs checked equal.

    git show 9135a69:glm_dsa/kernels/topk.py > .oldtree/topk_9135a69.py
    python bench/probes/2026-12-07g-select-sort.py .oldtree/topk_9135a69.py [SxN]

Offline (Triton 3.6 sm_90, ptxas -v, the whole sort kernel at TOPK 2,048): 1 warp 204 registers,
13,800 instructions a thread (2,880 SHFL, no STS or BAR); 2 warps 127 registers, 8,832 (17 BAR);
4 warps 72 registers and 4 bytes spilled, 5,376 (32 BAR); 8 warps 48 registers, 3,152 (44 BAR):
13.8K, 17.7K, 21.5K, 25.2K warp instructions a row. Not yet run on a GPU (the seventh session's
device time went to runs S7a, S7b and S7e).
"""
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
sys.path.insert(0, os.path.dirname(__file__))
from bench_indexer import TOPK, _inputs  # noqa: E402
from benchlib import median_seconds  # noqa: E402

from glm_dsa.kernels import mqa_logits as ml  # noqa: E402
from glm_dsa.kernels import topk as new  # noqa: E402

thresholds = importlib.import_module("2026-12-07f-ptx-epilogue").thresholds


def main():
    spec = importlib.util.spec_from_file_location("topk_old", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    S, N = (int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "4096x131072").split("x"))
    q, k, k_scale, w, ks, ke = _inputs(S, N)
    starts, ends, lens, thr = thresholds(q, w, k, k_scale, ks, ke)
    cand = new.CAND_FACTOR * TOPK
    counters = torch.zeros((S, new.COUNTERS), dtype=torch.int32, device=q.device)
    keys, cols = ml.launch_mqa_candidates(q, k, k_scale, w, starts, ends, thr, counters, cand)
    found = counters[:, 0].float()
    print(f"{S} x {N}: candidates a row mean {found.mean():.0f}, min {found.min():.0f}, "
          f"max {found.max():.0f} of {cand} slots")

    def select(mod):
        c = counters.clone()
        return mod.launch_select_candidates(keys, cols, c, lens, TOPK)[0]

    ref = select(old)
    print("| select | sort | ms | same as 9135a69 |")
    print("|---|---|---|---|")
    ms = median_seconds(lambda: select(old), warmup=3, reps=20) * 1e3
    print(f"| 9135a69 | in the select's 8 warps | {ms:.3f} | True |", flush=True)
    for warps in (1, 2, 4, 8):
        new.SORT_WARPS = warps
        same = torch.equal(select(new), ref)
        ms = median_seconds(lambda: select(new), warmup=3, reps=20) * 1e3
        print(f"| this tree | `_sort_rows_kernel`, {warps} warps | {ms:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
