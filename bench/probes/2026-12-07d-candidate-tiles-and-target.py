"""Issue 43 (run W): two untried levers on the candidate kernel at 131,072 keys.

1. Tiles. The candidate kernel (raw, one config at a time; counters zeroed in each timed call)
   at the tuner's four configs and at tiles it does not have (128 x 64 with 4 warps: 64
   accumulator registers, room for 3 CTAs an SM; 256 x 64 with 8 warps), beside the logits
   kernel at its own pick (128 x 128, 4 warps) and at the same tiles. Thresholds are a real
   call's (the sample's), so the kept share is the call's (~4 %).
2. The sample's aim. Thresholds from samples of stride 128 / 64 / 32 (16 / 32 / 64 expected
   hits above the k-th key) aimed at 2.5 / 2.0 / 1.5 topk keys: the candidates a row keeps
   (mean, min), the rows that would be redone (fewer than topk), and the candidate kernel's
   and the select's times with those thresholds.
3. Keep density (run W2, `--density`): the shipped tiles at thresholds of +inf (nothing kept:
   the scoring and the epilogue's compares alone) and at aims of 0.25 to 5 topk keys; beside
   it `_reserve_kernel`, a trial filter with one atomic per (row, tile) that reserves the
   tile's kept entries of the row (their count a sum over the tile's keys, each entry's slot
   the reservation plus its rank, an exclusive scan), in place of one atomic per kept entry.
Every variant's top-k (select on its buffers) is compared with the shipped call's where no
row is redone. Prints two tables; argument: shapes as SxN (default 4096x131072 16384x131072); on the CPU
(TRITON_INTERPRET=1) a small shape checks that it runs.
"""
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_indexer import TOPK, _inputs  # noqa: E402

from glm_dsa.kernels import indexer as fast  # noqa: E402
from glm_dsa.kernels import mqa_logits as ml  # noqa: E402
from glm_dsa.kernels import topk as tk  # noqa: E402

BUDGET = 6 << 30
TILES = [  # (BLOCK_Q, BLOCK_N, warps, stages, lag)
    (256, 64, 4, 4, 0), (256, 64, 4, 4, 1), (256, 128, 8, 3, 0), (256, 128, 8, 3, 1),
    (128, 64, 4, 4, 0), (128, 64, 4, 4, 1), (128, 64, 4, 5, 0), (256, 64, 8, 4, 0),
    (256, 64, 8, 4, 1), (128, 128, 8, 4, 0),
]
AIMS = [(128, 2.5), (64, 2.5), (64, 2.0), (32, 2.0), (32, 1.5), (64, 1.5)]


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU (interpreter): a smoke run


@triton.jit
def _reserve_kernel(
    q_ptr, k_ptr, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, thr_ptr, cand_key_ptr, cand_idx_ptr,
    counters_ptr, S, n_keys, cand, H: tl.constexpr, D: tl.constexpr, HP: tl.constexpr,
    DP: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, COUNTERS: tl.constexpr,
):
    """``_mqa_candidates_kernel``'s buffers (the same entries, other slots) with one atomic
    per (row, tile): the row's kept count in the tile, its entries at the returned base plus
    their rank among the tile's kept entries of the row."""
    BLOCK_M: tl.constexpr = max(BLOCK_Q // HP, 1)
    rows, row_ok, ks, ke, s0, s1, c0, c1, q, w = ml._row_block(
        q_ptr, w_ptr, ks_ptr, ke_ptr, S, n_keys, H, D, HP, DP, BLOCK_M, BLOCK_N)
    thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0)
    cand_off = rows.to(tl.int64) * cand
    for t in tl.range(c0, c1):
        cols, col_ok, logits = ml._key_tile(k_ptr, k_scale_ptr, q, w, t, n_keys, D, DP, HP,
                                            BLOCK_M, BLOCK_N)
        inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
        take = inside & ~(logits < thr[None, :])
        key = tk.order_keys(logits).to(tl.int32, bitcast=True)
        kept = take.to(tl.int32)
        n = tl.sum(kept, axis=0)
        base = tl.atomic_add(counters_ptr + rows * COUNTERS, n, mask=row_ok & (n > 0),
                             sem="relaxed")
        slot = tl.where(take, base[None, :] + tl.cumsum(kept, axis=0) - kept, cand)
        ml._store_candidates(cand_key_ptr, cand_idx_ptr, cand_off, cand, slot, key,
                             cols[:, None] - ks[None, :])


def reserve(q, w, k, k_scale, ks, ke, thr, bq=256, bn=64, warps=4, stages=4):
    S, H, D = q.shape
    cand = tk.CAND_FACTOR * TOPK
    counters = torch.zeros((S, tk.COUNTERS), dtype=torch.int32, device=q.device)
    keys = torch.empty((S, cand), dtype=torch.int32, device=q.device)
    cols = torch.empty((S, cand), dtype=torch.int32, device=q.device)
    grid = ml._grid(lambda bm: triton.cdiv(S, bm), lambda b: triton.cdiv(k.shape[0], b), q.device)
    _reserve_kernel[grid](q, k, k_scale, w, ks, ke, thr, keys, cols, counters, S, k.shape[0],
                          cand, H=H, D=D, HP=ml._pow2(H), DP=ml._pow2(max(D, 32)), BLOCK_Q=bq,
                          BLOCK_N=bn, COUNTERS=tk.COUNTERS, num_warps=warps, num_stages=stages)
    return keys, cols, counters


def time_ms(fn, reps=10):
    if DEV == "cpu":
        fn()
        return float("nan")
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def thresholds(q, w, k, k_scale, ks, ke, stride, target):
    lens = ke - ks
    cand = tk.CAND_FACTOR * TOPK
    s_starts = ks.add(stride - 1).floor_divide(stride)
    s_ends = torch.where(lens > cand, ke.add(stride - 1).floor_divide(stride), s_starts)
    sample = ml.launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w,
                                  s_starts, s_ends, clean_logits=False, max_seqlen_k=0)
    thr = torch.empty(q.shape[0], dtype=torch.float32, device=q.device)
    block = min(max(triton.next_power_of_2(sample.shape[1]), 256), tk.BLOCK)
    tk._threshold_kernel[(q.shape[0],)](sample, sample.stride(0), sample.shape[1], s_starts,
                                        s_ends, lens, thr, int(target * TOPK), cand, BLOCK=block,
                                        num_warps=max(block // 512, 1))
    return thr


def candidates(q, w, k, k_scale, ks, ke, thr, tiles):
    bq, bn, warps, stages, lag = tiles
    S, H, D = q.shape
    cand = tk.CAND_FACTOR * TOPK
    counters = torch.zeros((S, tk.COUNTERS), dtype=torch.int32, device=q.device)
    keys = torch.empty((S, cand), dtype=torch.int32, device=q.device)
    cols = torch.empty((S, cand), dtype=torch.int32, device=q.device)
    grid = ml._grid(lambda bm: triton.cdiv(S, bm), lambda b: triton.cdiv(k.shape[0], b), q.device)
    ml._mqa_candidates_kernel[grid](
        q, k, k_scale, w, ks, ke, thr, keys, cols, counters, S, k.shape[0], 0, cand,
        H=H, D=D, HP=ml._pow2(H), DP=ml._pow2(max(D, 32)), BLOCK_Q=bq, BLOCK_N=bn,
        STORE_LAG=lag, num_warps=warps, num_stages=stages)
    return keys, cols, counters


def logits(q, w, k, k_scale, ks, ke, bq, bn, warps, stages):
    S, H, D = q.shape
    out = torch.empty((S, k.shape[0]), dtype=torch.float32, device=q.device)
    grid = ml._grid(lambda bm: triton.cdiv(S, bm), lambda b: triton.cdiv(k.shape[0], b), q.device)
    ml._mqa_logits_kernel[grid](
        q, k, k_scale, w, ks, ke, out, S, k.shape[0], k.shape[0], out.stride(0), 0,
        H=H, D=D, HP=ml._pow2(H), DP=ml._pow2(max(D, 32)), BLOCK_Q=bq, BLOCK_N=bn, CLEAN=False,
        COMPRESSED=False, num_warps=warps, num_stages=stages)
    return out


def density(q, w, k, k_scale, ks, ke):
    print("\n| threshold | kept mean | candidates ms | reserve trial ms | reserve top-k as shipped | logits 256 x 64 ms |")
    print("|---|---|---|---|---|---|")
    lens = ke - ks
    ship = (256, 64, 4, 4, 1)
    fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)  # tunes the sample's logits launch
    lg = time_ms(lambda: logits(q, w, k, k_scale, ks, ke, 256, 64, 4, 4))
    stride = fast.sample_stride(k.shape[0], TOPK)
    for aim in (None, 0.25, 1.0, 2.5, 5.0):
        if aim is None:
            thr = torch.full((q.shape[0],), float("inf"), device=q.device)
        else:
            thr = thresholds(q, w, k, k_scale, ks, ke, stride, aim)
        ms = time_ms(lambda: candidates(q, w, k, k_scale, ks, ke, thr, ship))
        _, _, counters = candidates(q, w, k, k_scale, ks, ke, thr, ship)
        r_ms = time_ms(lambda: reserve(q, w, k, k_scale, ks, ke, thr))
        keys, cols, r_counters = reserve(q, w, k, k_scale, ks, ke, thr)
        same = bool(torch.equal(r_counters, counters))
        if aim == tk.TARGET_FACTOR:
            want = fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)
            got, redo, _ = tk.launch_select_candidates(keys, cols, r_counters, lens, TOPK)
            same = same and int(redo.sum()) == 0 and bool(torch.equal(got, want))
        print(f"| {'+inf' if aim is None else f'aim {aim} topk'} | {counters[:, 0].float().mean():.0f} | {ms:.3f} | {r_ms:.3f} | {same} | {lg:.3f} |")


def main():
    args = [a for a in sys.argv[1:] if a != "--density"]
    shapes = [tuple(int(x) for x in a.split("x")) for a in args] or [(4096, 131072), (16384, 131072)]
    for S, N in shapes:
        if "--density" in sys.argv:
            print(f"\n{S} x {N}")
            q, k, k_scale, w, ks, ke = _inputs(S, N, device=DEV)
            density(q, w, k, k_scale, ks, ke)
            continue
        q, k, k_scale, w, ks, ke = _inputs(S, N, device=DEV)
        flops = 2 * q.shape[1] * 128 * int((ke - ks).long().sum())
        want = fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET)
        full = time_ms(lambda: fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, BUDGET))
        lens = ke - ks
        base_thr = thresholds(q, w, k, k_scale, ks, ke, fast.sample_stride(N, TOPK), tk.TARGET_FACTOR)
        print(f"\n{S} x {N}: indexer_topk {full:.3f} ms")
        print("| kernel | BLOCK_Q x BLOCK_N | warps | stages | lag | ms | TFLOP/s | top-k as shipped |")
        print("|---|---|---|---|---|---|---|---|")
        for bq, bn, warps, stages in ((128, 128, 4, 4), (256, 64, 4, 4), (128, 64, 4, 4), (256, 64, 8, 4)):
            try:
                ms = time_ms(lambda: logits(q, w, k, k_scale, ks, ke, bq, bn, warps, stages))
                print(f"| logits | {bq} x {bn} | {warps} | {stages} | - | {ms:.3f} | {flops / ms / 1e9:.0f} | - |")
            except Exception as e:  # noqa: BLE001 — a config that does not compile is a row
                print(f"| logits | {bq} x {bn} | {warps} | {stages} | - | failed: {type(e).__name__} {str(e)[:80]} | | |")
        for tiles in TILES:
            try:
                ms = time_ms(lambda: candidates(q, w, k, k_scale, ks, ke, base_thr, tiles))
                keys, cols, counters = candidates(q, w, k, k_scale, ks, ke, base_thr, tiles)
                got, redo, _ = tk.launch_select_candidates(keys, cols, counters, lens, TOPK)
                same = bool(torch.equal(got, want)) and int(redo.sum()) == 0
                bq, bn, warps, stages, lag = tiles
                print(f"| candidates | {bq} x {bn} | {warps} | {stages} | {lag} | {ms:.3f} | {flops / ms / 1e9:.0f} | {same} |")
            except Exception as e:  # noqa: BLE001
                print(f"| candidates | {tiles} | failed: {type(e).__name__} {str(e)[:80]} | | | | | |")
        print("\n| stride | aim (x topk) | kept mean | kept min | rows redone | sample+threshold ms | candidates ms | select ms | top-k as shipped |")
        print("|---|---|---|---|---|---|---|---|---|")
        ship = (256, 64, 4, 4, 1)
        for stride, aim in AIMS:
            st_ms = time_ms(lambda: thresholds(q, w, k, k_scale, ks, ke, stride, aim))
            thr = thresholds(q, w, k, k_scale, ks, ke, stride, aim)
            c_ms = time_ms(lambda: candidates(q, w, k, k_scale, ks, ke, thr, ship))
            keys, cols, counters = candidates(q, w, k, k_scale, ks, ke, thr, ship)
            found = counters[:, 0]
            redo_rows = int((found < TOPK).sum())
            s_ms = time_ms(lambda: tk.launch_select_candidates(keys, cols, counters, lens, TOPK))
            got, redo, _ = tk.launch_select_candidates(keys, cols, counters, lens, TOPK)
            ok = redo == 0
            same = bool(torch.equal(got[ok], want[ok]))
            print(f"| {stride} | {aim} | {found.float().mean():.0f} | {int(found.min())} | {redo_rows} | {st_ms:.3f} | {c_ms:.3f} | {s_ms:.3f} | {same} |")


if __name__ == "__main__":
    main()
