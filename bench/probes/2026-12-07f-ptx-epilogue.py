"""Issue 43 (sixth session): the logits and candidate kernels' epilogues as inline PTX.

Offline sm_90 SASS (Triton 3.6) showed why the candidate kernel's filter costs 0.7 ms at
4,096 x 131,072 even when it keeps nothing (run W2): Triton gives every load, store and atomic
on a tensor of pointers a coalescing layout of its own and converts the values into it through
shared memory, with a barrier of the whole program. The candidate loop (256 x 64 tiles, 4
warps) converts twice a tile (the kept mask before the atomics, the slots and keys before the
stores: 4 STS, 9 LDS, 4 BAR.SYNC a tile, against the logits loop's 2 STS, 5 LDS, 2 BAR), and
the barrier after the atomics makes every warp wait for the slowest warp's atomic round trip.
``PTX_EPILOGUE`` issues the atomic and the stores as inline PTX on the tile's MMA layout:
no conversion, no barrier but the pipeline's (loop 499 -> 472 instructions, lag 1 513 -> 476).

In one process, per shape: the candidate kernel raw at the shipped tiles (256 x 64, 4 warps, 4
stages; CUDA-event medians of 10, counters zeroed inside each timed call) with ``PTX_EPILOGUE``
off and on, and the whole ``indexer_topk`` with the module's epilogue off and on. Checks: the
counters equal and each row's kept (key, column) set equal, ``indexer_topk``'s output equal.
Argument: shapes SxN (default 4096x131072 16384x131072 4096x1048576).

Runs Z and Z3 ran this probe's first form, which also timed storing a tile's entries at once
(``STORE_LAG`` 0, beside the next tile's step) and the logits kernel with PTX stores at 128 x 128
and 256 x 64 (bench/logs/2026-12-07-h100-z3-ptx-epilogue.log has those rows): both were dropped
after run Z3 (lag 0 slower in every row, the PTX logits stores 1.04x slower at 128 x 128), so
their rows and arguments are gone here.
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_indexer import TOPK, _inputs  # noqa: E402
from benchlib import median_seconds  # noqa: E402

from glm_dsa.kernels import indexer as fast  # noqa: E402
from glm_dsa.kernels import mqa_logits as ml  # noqa: E402
from glm_dsa.kernels import topk as tk  # noqa: E402

BUDGET = 6 << 30
CAND_TILES = [(256, 64, 4, 4)]  # (BLOCK_Q, BLOCK_N, warps, stages)


def time_ms(fn, reps=10):
    """CUDA-event median of ``reps`` calls after two untimed ones, ms."""
    return median_seconds(fn, warmup=2, reps=reps) * 1e3


def thresholds(q, w, k, k_scale, ks, ke):
    """The shipped call's thresholds (its windows, sample and threshold launches)."""
    cand = tk.CAND_FACTOR * TOPK
    stride = fast.sample_stride(k.shape[0], TOPK)
    counters = torch.empty((q.shape[0], tk.COUNTERS), dtype=torch.int32, device=q.device)
    starts, ends, lens, s_starts, s_ends = fast.launch_windows(ks, ke, counters, TOPK, cand,
                                                               stride)
    sample = ml.launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w,
                                  s_starts, s_ends, clean_logits=False, max_seqlen_k=0)
    return starts, ends, lens, tk.launch_thresholds(sample, s_starts, s_ends, lens, TOPK, cand)


def candidates(q, w, k, k_scale, starts, ends, thr, tiles, ptx, module=ml):
    """One launch of ``module``'s candidate kernel (this tree's unless another is given)."""
    bq, bn, warps, stages = tiles
    S, H, D = q.shape
    cand = tk.CAND_FACTOR * TOPK
    counters = torch.zeros((S, tk.COUNTERS), dtype=torch.int32, device=q.device)
    keys = torch.empty((S, cand), dtype=torch.int32, device=q.device)
    cols = torch.empty((S, cand), dtype=torch.int32, device=q.device)
    grid = module._grid(lambda bm: triton.cdiv(S, bm), lambda b: triton.cdiv(k.shape[0], b),
                        q.device)
    module._mqa_candidates_kernel[grid](
        q, k, k_scale, w, starts, ends, thr, keys, cols, counters, S, k.shape[0], 0, cand,
        H=H, D=D, HP=module._pow2(H), DP=module._pow2(max(D, 32)), PTX_EPILOGUE=ptx, BLOCK_Q=bq,
        BLOCK_N=bn, num_warps=warps, num_stages=stages)
    return keys, cols, counters


def kept_sets(keys, cols, counters):
    """Each row's kept (key, column) pairs as sorted int64s (the slots' order is the atomics')."""
    n = counters[:, 0].clamp(max=keys.shape[1])
    live = torch.arange(keys.shape[1], device=keys.device)[None, :] < n[:, None]
    pair = (keys.long() << 32) | (cols.long() & 0xFFFFFFFF)
    pair = torch.where(live, pair, torch.iinfo(torch.int64).max)
    return pair.sort(dim=1).values


def main():
    shapes = [tuple(int(x) for x in a.split("x")) for a in sys.argv[1:]] or [
        (4096, 131072), (16384, 131072), (4096, 1048576)]
    print("| rows x keys | kernel | tiles | Triton's epilogue ms | PTX epilogue ms | PTX / Triton | same |")
    print("|---|---|---|---|---|---|---|")
    for S, N in shapes:
        q, k, k_scale, w, ks, ke = _inputs(S, N)
        starts, ends, lens, thr = thresholds(q, w, k, k_scale, ks, ke)
        for tiles in CAND_TILES:
            ms, sets = {}, {}
            for ptx in (False, True):
                ms[ptx] = time_ms(lambda: candidates(q, w, k, k_scale, starts, ends, thr, tiles,
                                                     ptx))
                keys, cols, counters = candidates(q, w, k, k_scale, starts, ends, thr, tiles, ptx)
                sets[ptx] = (counters.clone(), kept_sets(keys, cols, counters))
            same = (torch.equal(sets[False][0], sets[True][0])
                    and torch.equal(sets[False][1], sets[True][1]))
            print(f"| {S} x {N} | candidates | {tiles[0]} x {tiles[1]}, "
                  f"{tiles[2]} warps | {ms[False]:.3f} | {ms[True]:.3f} | "
                  f"{ms[True] / ms[False]:.3f} | {same} |", flush=True)
            del sets
        ms, outs = {}, {}
        for ptx in (False, True):
            ml._PTX_EPILOGUE = ptx
            outs[ptx] = fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)
            ms[ptx] = time_ms(lambda: fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET))
        ml._PTX_EPILOGUE = True
        print(f"| {S} x {N} | indexer_topk | tuned | {ms[False]:.3f} | {ms[True]:.3f} | "
              f"{ms[True] / ms[False]:.3f} | {torch.equal(outs[False], outs[True])} |", flush=True)
        del q, k, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
