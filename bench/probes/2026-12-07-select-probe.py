"""Issue 43 (run O): where the candidate select's ~1.0 ms at 4,096 x 131,072 goes (run N, H100).

`_select_candidates_kernel` on buffers shaped as the frontier's (4,096 rows, 12,288 slots,
2,965-8,821 candidates a row, ~5,050 on average; keys of random float32 scores, columns distinct
in [0, 131,072)), timed by CUDA events (median of 20 after 3 warm-ups):
  * `order`: candidates in random order (as the atomics leave them: the emit then sorts its
    2,048 columns) or in ascending column order (the emit's check finds them in order, no sort);
    the difference is the sort's cost;
  * `BLOCK` x `num_warps`: the block the radix rounds and the emit stride over.
Each variant's output is checked equal to the shipped launch's (`launch_select_candidates`).
Prints one table; argument: rows (default 4,096). On the CPU (TRITON_INTERPRET=1) pass a few
rows to check that it runs.
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


def launch(k, c, block, warps):
    out = torch.empty(R, TOPK, dtype=torch.int32, device=dev)
    rd = torch.empty(R, dtype=torch.int32, device=dev)
    tk._select_candidates_kernel[(R,)](
        k, c, counters, lens, out, rd, TOPK, CAND, BLOCK=block,
        TOPK=triton.next_power_of_2(TOPK), num_warps=warps)
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
print("| order | BLOCK | warps | ms | same as shipped |")
print("|---|---|---|---|---|")
for order, (k, c) in (("random", (keys, cols)), ("ascending", (keys_sorted, cols_sorted))):
    for block, warps in ((tk.BLOCK, tk.NUM_WARPS), (4096, 4), (2048, 8), (2048, 4), (1024, 4)):
        got = launch(k, c, block, warps)
        same = bool(torch.equal(got, want))
        ms = time_ms(lambda: launch(k, c, block, warps))
        print(f"| {order} | {block} | {warps} | {ms:.3f} | {same} |")
