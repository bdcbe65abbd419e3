"""Issue 43 (fifth session, runs Y, Y3, Y4): the candidate select's block and radix digit on the
GPU (`_select_candidates_kernel` at blocks 4,096 / 2,048 / 1,024 / 512 — run Y had the first
two, Y3 three — and `DIGIT` 8 / 6 / 5 bits; offline sm_90 compiles put 5-bit rounds at 1.27x
the issue of 8-bit ones over a 4,096-key block but 14 shared-memory atomics a thread against
64, bench/probes/2026-12-07e-offline-select.py), on run O's buffers
(`2026-12-07-select-probe.py`: 4,096 rows, 12,288 slots, 2,965-8,821 candidates a row in random
order, keys of random float32 scores, columns distinct in [0, 131,072)); CUDA-event medians of
20 after 3 warm-ups; each output compared with `launch_select_candidates`' as the tree of the
run shipped it. Argument: rows.
"""
import statistics
import sys

import torch
import triton

from glm_dsa.kernels import topk as tk

R = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
N, TOPK, CAND = 131_072, 2048, tk.CAND_FACTOR * 2048
dev = "cuda" if torch.cuda.is_available() else "cpu"
g = torch.Generator().manual_seed(0)
found = torch.randint(2965, 8822, (R,), generator=g, dtype=torch.int32)
keys = torch.zeros(R, CAND, dtype=torch.int32)
cols = torch.zeros(R, CAND, dtype=torch.int32)
cols_sorted = torch.zeros(R, CAND, dtype=torch.int32)
keys_sorted = torch.zeros(R, CAND, dtype=torch.int32)
for r in range(R):
    n = int(found[r])
    c = torch.randperm(N, generator=g)[:n].to(torch.int32)
    x = torch.randn(n, generator=g)
    bits = x.view(torch.int32)
    k = torch.where(bits < 0, ~bits, bits | -2147483648)  # order_keys
    keys[r, :n], cols[r, :n] = k, c
    order = torch.argsort(c)
    keys_sorted[r, :n], cols_sorted[r, :n] = k[order], c[order]
counters = torch.zeros(R, tk.COUNTERS, dtype=torch.int32)
counters[:, 0] = found
lens = torch.full((R,), N, dtype=torch.int32)
keys, cols, keys_sorted, cols_sorted, counters, lens = (
    t.to(dev) for t in (keys, cols, keys_sorted, cols_sorted, counters, lens))

want, redo, _ = tk.launch_select_candidates(keys, cols, counters.clone(), lens, TOPK)
assert int(redo.sum()) == 0




def launch(k, c, block, digit):
    out = torch.empty(R, TOPK, dtype=torch.int32, device=dev)
    rd = torch.empty(R, dtype=torch.int32, device=dev)
    tk._select_candidates_kernel[(R,)](
        k, c, counters, lens, out, rd, TOPK, CAND, BLOCK=block,
        TOPK=triton.next_power_of_2(TOPK), DIGIT=digit, num_warps=tk.NUM_WARPS)
    return out


def time_ms(fn):
    if dev == "cpu":
        fn()
        return float("nan")
    for _ in range(3):
        fn()
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


print(f"rows {R}, slots {CAND}, candidates mean {found.float().mean():.0f}, device {dev}")
print("| order | BLOCK | digit bits | ms | same as shipped |")
print("|---|---|---|---|---|")
for order, (k, c) in (("random", (keys, cols)), ("ascending", (keys_sorted, cols_sorted))):
    for block in (tk.BLOCK, 2048, 1024, 512):
        for digit in (8, 6, 5):
            got = launch(k, c, block, digit)
            same = bool(torch.equal(got, want))
            ms = time_ms(lambda: launch(k, c, block, digit))
            print(f"| {order} | {block} | {digit} | {ms:.3f} | {same} |", flush=True)
