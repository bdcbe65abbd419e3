"""Issue 43 (seventh session): the candidate kernel's int32 slot indices and both kernels' key
loads clamped to the last key instead of masked, against the tree before (9135a69), raw kernels
in one process on the same inputs.

Offline sm_90 SASS (Triton 3.6, ``/tmp/sass/loop_ops.py``'s count of the key-tile loop, one
thread, one tile): the candidate loop 477 -> 456 instructions with int32 slots (an entry's two
store addresses were a sign extension, a 64-bit multiply-add, a 64-bit shift and two 64-bit
adds; now two wide multiply-adds) -> 435 with the clamped loads (the masked loads' per-load
compares and selects gone); the logits loop 407 -> 388 at 256 x 64 and 473 -> 440 at 128 x 128.

Per shape: the candidate kernel at the shipped tiles (256 x 64, 4 warps, 4 stages; CUDA-event
medians of 10, counters zeroed in each timed call, timed old, new, new, old since run S7e),
old and new, with the counters and each
row's kept (key, column) set checked equal; at the first shape also the logits kernel at both
tuner tiles (clean logits), old and new, outputs checked bitwise equal.

    git apply bench/probes/2026-12-07-candidate-trials/run-s7e-int32-slots.patch  # and/or
    git apply bench/probes/2026-12-07-candidate-trials/run-s7e-clamped-loads.patch
    git show 9135a69:glm_dsa/kernels/mqa_logits.py > .oldtree/mqa_logits_9135a69.py
    python bench/probes/2026-12-07g-int32-slots-clamped-loads.py .oldtree/mqa_logits_9135a69.py \
        [SxN ...]   (default 4096x131072 16384x131072 4096x1048576)

Run S7e (H100, 2026-12-07, bench/logs/2026-12-07-h100-s7e-probe.log; 4,096 x 131,072 only,
both patches applied, old timed once before new), ms old / new: candidates 4.590 / 4.785 (1.04x
slower), logits 256 x 64 3.927 / 4.407 (1.12x slower), logits 128 x 128 4.718 / 4.633 (0.98x);
the same bits in every row. Fewer instructions, slower at the shipped tiles: both were reverted
(the clamped loads alone cost the logits kernel 12 %; the int32 slots were not timed alone).
"""
import importlib.util
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
sys.path.insert(0, os.path.dirname(__file__))
from bench_indexer import _inputs  # noqa: E402
from benchlib import median_seconds  # noqa: E402

from glm_dsa.kernels import mqa_logits as new  # noqa: E402

_ptx = importlib.import_module("2026-12-07f-ptx-epilogue")
thresholds, kept_sets = _ptx.thresholds, _ptx.kept_sets
CAND_TILES = (256, 64, 4, 4)
LOGITS_TILES = [(256, 64, 4, 4), (128, 128, 4, 3)]


def _module(path):
    spec = importlib.util.spec_from_file_location("mqa_logits_old", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_ms(fn, reps=10):
    return median_seconds(fn, warmup=2, reps=reps) * 1e3


def abba_ms(old_fn, new_fn):
    """Each form's mean of two medians, timed old, new, new, old: a drift of the card's clock
    over the four weighs on both alike (run S7e timed old then new, once)."""
    first_old, first_new = time_ms(old_fn), time_ms(new_fn)
    second_new, second_old = time_ms(new_fn), time_ms(old_fn)
    return {"old": (first_old + second_old) / 2, "new": (first_new + second_new) / 2}


def candidates(ml, q, w, k, k_scale, starts, ends, thr):
    return _ptx.candidates(q, w, k, k_scale, starts, ends, thr, CAND_TILES, True, module=ml)


def logits(ml, q, w, k, k_scale, ks, ke, tiles):
    bq, bn, warps, stages = tiles
    S, H, D = q.shape
    N = k.shape[0]
    out = torch.empty((S, N), dtype=torch.float32, device=q.device)
    grid = ml._grid(lambda bm: triton.cdiv(S, bm), lambda b: triton.cdiv(N, b), q.device)
    ml._mqa_logits_kernel[grid](
        q, k, k_scale, w, ks, ke, out, S, N, N, out.stride(0), 0, H=H, D=D, HP=ml._pow2(H),
        DP=ml._pow2(max(D, 32)), CLEAN=True, COMPRESSED=False, BLOCK_Q=bq, BLOCK_N=bn,
        num_warps=warps, num_stages=stages)
    return out


def main():
    old = _module(sys.argv[1])
    shapes = [tuple(int(x) for x in a.split("x")) for a in sys.argv[2:]] or [
        (4096, 131072), (16384, 131072), (4096, 1048576)]
    print("| rows x keys | kernel | tiles | 9135a69 ms | this tree ms | new / old | same |")
    print("|---|---|---|---|---|---|---|")
    for i, (S, N) in enumerate(shapes):
        q, k, k_scale, w, ks, ke = _inputs(S, N)
        starts, ends, lens, thr = thresholds(q, w, k, k_scale, ks, ke)
        ms = abba_ms(lambda: candidates(old, q, w, k, k_scale, starts, ends, thr),
                     lambda: candidates(new, q, w, k, k_scale, starts, ends, thr))
        sets = {}
        for name, ml in (("old", old), ("new", new)):
            keys, cols, counters = candidates(ml, q, w, k, k_scale, starts, ends, thr)
            sets[name] = (counters.clone(), kept_sets(keys, cols, counters))
            del keys, cols
        same = torch.equal(sets["old"][0], sets["new"][0]) and torch.equal(sets["old"][1],
                                                                           sets["new"][1])
        print(f"| {S} x {N} | candidates | 256 x 64, 4 warps | {ms['old']:.3f} | "
              f"{ms['new']:.3f} | {ms['new'] / ms['old']:.3f} | {same} |", flush=True)
        del sets
        if i == 0:
            for tiles in LOGITS_TILES:
                ms = abba_ms(lambda: logits(old, q, w, k, k_scale, ks, ke, tiles),
                             lambda: logits(new, q, w, k, k_scale, ks, ke, tiles))
                outs = {name: logits(ml, q, w, k, k_scale, ks, ke, tiles)
                        for name, ml in (("old", old), ("new", new))}
                same = torch.equal(outs["old"], outs["new"])
                print(f"| {S} x {N} | logits | {tiles[0]} x {tiles[1]}, {tiles[2]} warps | "
                      f"{ms['old']:.3f} | {ms['new']:.3f} | {ms['new'] / ms['old']:.3f} | "
                      f"{same} |", flush=True)
                del outs
        del q, k
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
