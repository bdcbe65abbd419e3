"""Issue 43 (sixth session, run Z2): where the candidate kernel's two epilogues differ.

Run Z's probe found the kept (key, column) sets of the PTX and Triton epilogues unequal while
``indexer_topk``'s output was equal, and two CUDA tests failed. Here each form's buffers are
compared with the truth from the logits kernel (every entry of a row's window not below its
threshold, its order key and column): per form and config, the rows whose count or set is not
the truth's, and for the first such row what is missing and what is extra (columns, keys, the
logit there, the threshold). Cases: test 1's (200 x 3,000, H 32 and 64, thresholds -inf, every
entry kept) and the probe's (4,096 x 131,072, the shipped thresholds).

Run Z2 ran it on run Z's tree (bench/logs/2026-12-07-h100-z2-diag.log): the truth then came from
the raw logits kernel at 128 x 128 tiles, which at H 64 is a row-major head order (2 rows a
block), so that case's "wrong sets" there are the truth's order, not the candidates'; here the
truth is ``launch_mqa_logits``' own pick (head-major at both head counts). It now runs on the
tree after the fix (the head sum's explicit fmas) and the probe's later form (no store lag).
"""
import os
import sys

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from bench_indexer import TOPK, _inputs  # noqa: E402

from glm_dsa.kernels import mqa_logits as ml  # noqa: E402
from glm_dsa.kernels import topk as tk  # noqa: E402

import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location(
    "ptx_probe", os.path.join(os.path.dirname(__file__), "2026-12-07f-ptx-epilogue.py"))
probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(probe)


def order_keys(x):
    bits = (x + 0.0).view(torch.int32)
    return torch.where(bits < 0, ~bits, bits ^ torch.iinfo(torch.int32).min)


def run_case(name, q, k, k_scale, w, ks, ke, thr, cand):
    S, N = q.shape[0], k.shape[0]
    full = ml.launch_mqa_logits(q, k, k_scale, w, ks, ke, True, 0)
    cols = torch.arange(N, device=q.device)[None, :]
    inside = (cols >= ks[:, None]) & (cols < ke[:, None])
    take = inside & ~(full < thr[:, None])
    want_n = take.sum(1).to(torch.int32)
    hp = ml._pow2(q.shape[1])
    for c in ml.one_head_order(ml._mqa_candidates_tuned.configs, {}, HP=hp):
        tiles = (c.kwargs["BLOCK_Q"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages)
        for ptx in (False, True):
            keys, kcols, counters = probe.candidates(q, w, k, k_scale, ks, ke, thr, tiles, ptx)
            n = counters[:, 0]
            bad_n = (n != want_n).nonzero().flatten().tolist()
            bad_set = []
            for m in range(0, S, max(1, S // 128)):
                if n[m] != want_n[m] or n[m] > cand:
                    continue
                got = set(zip(kcols[m, :n[m]].tolist(), keys[m, :n[m]].tolist()))
                j = take[m].nonzero().flatten()
                want = set(zip((j - ks[m]).tolist(), order_keys(full[m, j]).tolist()))
                if got != want:
                    bad_set.append((m, got, want))
                if len(bad_set) >= 3:
                    break
            print(f"{name} | {tiles} ptx={ptx} | rows with a wrong count: {len(bad_n)} "
                  f"{bad_n[:5]} (got {n[bad_n[:5]].tolist()}, want {want_n[bad_n[:5]].tolist()}) "
                  f"| rows (of 128 spread) with a wrong set: {[b[0] for b in bad_set]}", flush=True)
            for m, got, want in bad_set[:1]:
                miss, extra = sorted(want - got)[:4], sorted(got - want)[:4]
                print(f"   row {m}: window [{int(ks[m])}, {int(ke[m])}), thr {float(thr[m])!r}, "
                      f"{len(want - got)} missing {miss}, {len(got - want)} extra {extra}")
                for col, key in miss[:2] + extra[:2]:
                    j = int(ks[m]) + col
                    if 0 <= j < N:
                        print(f"     col {col}: logit {float(full[m, j])!r} key "
                              f"{int(order_keys(full[m, j:j + 1])[0])}")


def main():
    for H in (32, 64):
        S, N = 200, 3000
        q, k, k_scale, w, ks, _ = _inputs(S, N, heads=H)
        ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device="cuda")
        thr = torch.full((S,), float("-inf"), device="cuda")
        run_case(f"200x3000 H{H} keep-all", q, k, k_scale, w, ks, ke, thr, N)
    q, k, k_scale, w, ks, ke = _inputs(4096, 131072)
    starts, ends, lens, thr = probe.thresholds(q, w, k, k_scale, ks, ke)
    run_case("4096x131072 shipped thr", q, k, k_scale, w, starts, ends, thr,
             tk.CAND_FACTOR * TOPK)


if __name__ == "__main__":
    main()
