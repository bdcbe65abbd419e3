"""Runs M and R: summarize Nsight Compute's per-instruction warp-stall samples
(`ncu -i X.ncu-rep --page source --csv --print-source sass`, the csv the run scripts write):
total samples (proportional to the kernel's time times its resident warps), samples and
executed instructions by opcode, and the most-sampled instructions with the three before them
(a `BRA` after `SYNCS.PHASECHK.TRANS64.TRYWAIT` is an mbarrier wait; `WARPGROUP.DEPBAR` a wait
on the warpgroup's MMAs). Usage: python 2026-12-07-sass-stalls.py sass-*.csv [--top N]."""
import argparse
import collections
import csv


def summarize(path: str, top: int) -> None:
    rows = list(csv.reader(open(path)))
    kernel, hdr, data = rows[0][1], rows[1], rows[2:]
    i_s, i_e = hdr.index("Warp Stall Sampling (All Samples)"), hdr.index("Instructions Executed")
    samples = [int(r[i_s] or 0) for r in data]
    total = sum(samples)
    by_op, execs = collections.Counter(), collections.Counter()
    for r, s in zip(data, samples):
        words = r[1].split()
        op = (words[1] if words and words[0].startswith("@") else words[0] if words else "?").split(".")[0]
        by_op[op] += s
        execs[op] += int(r[i_e] or 0)
    print(f"== {path}: {kernel[:72]}, {total} samples, {sum(execs.values()) / 1e6:.1f} M warp instructions")
    print("   by opcode (share of samples / M executed): " + ", ".join(
        f"{op} {100 * s / total:.1f} % / {execs[op] / 1e6:.1f}" for op, s in by_op.most_common(10)))
    for i in sorted(range(len(data)), key=lambda i: -samples[i])[:top]:
        ctx = " | ".join(data[j][1].strip()[:48] for j in range(max(0, i - 3), i))
        print(f"   {100 * samples[i] / total:5.1f} %  {data[i][1].strip()[:60]:60s}  after: {ctx}")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("csv", nargs="+")
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    for p in a.csv:
        summarize(p, a.top)
