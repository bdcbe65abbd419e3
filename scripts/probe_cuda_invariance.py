"""Which products of a GLM-5.3 layer round a row by the call it rides in, on this GPU?

For the triton backend's operations at GLM-5.3 shapes (bf16 projections, the float32 router and
lm_head, the float64 gates, the absorbed per-head ``bmm``, the routed experts' ``grouped_mm``,
the norms' row means), prints, per operation:

* ``rows``: the row counts n (of those tried) for which ``op(x[:n])`` differs bitwise from the
  first n rows of ``op(x[:N])`` — what a chunk size or a co-scheduled request changes today;
* ``tile T``: with every call made on exactly T rows (``fixed_rows``), whether a row's result
  still moves with its place in the call or with the other rows in it (shifted windows, zero
  padding); empty means a T-row tiling makes the op batch-invariant;
* the time of one ``N``-row call against ``N / T`` tiled calls (what the tiling costs).

    python scripts/probe_cuda_invariance.py --out DIR   # writes probe_cuda_invariance.json
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from benchlib import median_seconds

COUNTS = [1, 2, 3, 7, 16, 63, 64, 65, 100, 128, 129, 256, 500, 512, 1000, 1024, 2048, 4096, 8192]
TILES = [512, 1024, 2048]
SHIFTS = [1, 7, 64, 100, 333]


def _linear(k, n, dtype, device, g):
    w = (torch.randn(n, k, generator=g, device=device) / k**0.5).to(dtype)
    return lambda t: F.linear(t, w), (k,)


def _router(k, n, device, g):
    w = torch.randn(n, k, generator=g, device=device) / k**0.5
    return lambda t: torch.mm(t, w.T, out_dtype=torch.float32) if t.dtype != torch.float32 \
        else t @ w.T, (k,)


def _bmm(h, k, n, device, g):
    w = (torch.randn(h, k, n, generator=g, device=device) / k**0.5).to(torch.bfloat16)
    # rows first as the model holds them: [r, H, k] -> [H, r, k] @ [H, k, n] -> [r, H, n]
    return lambda t: torch.bmm(t.transpose(0, 1), w).transpose(0, 1), (h, k)


def _mean(d):
    return lambda t: t.float().square().mean(-1, keepdim=True), (d,)


def ops(device, g):
    bf = torch.bfloat16
    return {
        "q_a 6144->2048": (_linear(6144, 2048, bf, device, g), bf),
        "q_b 2048->16384": (_linear(2048, 16384, bf, device, g), bf),
        "kv_a 6144->576": (_linear(6144, 576, bf, device, g), bf),
        "o_proj 16384->6144": (_linear(16384, 6144, bf, device, g), bf),
        "wq_b 2048->4096": (_linear(2048, 4096, bf, device, g), bf),
        "wk 6144->128": (_linear(6144, 128, bf, device, g), bf),
        "shared gate 6144->2048": (_linear(6144, 2048, bf, device, g), bf),
        "shared down 2048->6144": (_linear(2048, 6144, bf, device, g), bf),
        "gates f64 6144->32": (_linear(6144, 32, torch.float64, device, g), torch.float64),
        "router f32 6144->256": (_router(6144, 256, device, g), torch.float32),
        "lm_head f32 6144->8192": (_linear(6144, 8192, torch.float32, device, g), torch.float32),
        "W_UK bmm 64x192->512": (_bmm(64, 192, 512, device, g), bf),
        "W_UV bmm 64x512->256": (_bmm(64, 512, 256, device, g), bf),
        "rms mean 6144": (_mean(6144), bf),
        "rms mean 2048": (_mean(2048), bf),
        "rms mean 512": (_mean(512), bf),
        "k_norm mean 128": (_mean(128), bf),
    }


def fixed_rows(fn, x, tile):
    """``fn`` on calls of exactly ``tile`` rows (the last zero-padded)."""
    n = x.shape[0]
    tiles = -(-n // tile)
    padded = x.new_zeros((tiles * tile, *x.shape[1:]))
    padded[:n] = x
    return torch.cat([fn(padded[t * tile:(t + 1) * tile]) for t in range(tiles)])[:n]


def probe_op(fn, shape, dtype, n_max, device, g):
    x = (torch.randn(n_max, *shape, generator=g, device=device)).to(dtype)
    full = fn(x)
    rows = [n for n in COUNTS if n < n_max and not torch.equal(fn(x[:n].clone()), full[:n])]
    tiles = {}
    for tile in TILES:
        base = fn(x[:tile].clone())
        moved = []
        for s in SHIFTS:
            if s < tile and not torch.equal(fn(x[s:s + tile].clone())[: tile - s], base[s:]):
                moved.append(f"shift {s}")
        for m in (1, 64, 100, tile - 1):
            if not torch.equal(fixed_rows(fn, x[:m], tile), base[:m]):
                moved.append(f"pad {m}")
        noise = x[:tile].clone()
        noise[tile // 2:] = torch.randn_like(noise[tile // 2:].float()).to(dtype)
        if not torch.equal(fn(noise)[: tile // 2], base[: tile // 2]):
            moved.append("neighbours")
        tiles[tile] = moved
    times = {"one call ms": 1e3 * median_seconds(lambda: fn(x))}
    for tile in TILES:
        times[f"tile {tile} ms"] = 1e3 * median_seconds(lambda tile=tile: fixed_rows(fn, x, tile))
    return {"rows": rows, "tiles": tiles, "times": times}


def probe_grouped(device, g, experts=256, hidden=6144, inter=2048, top=8):
    """A fixed set of pairs of a few experts, alone and inside a large step: equal rows?"""
    w = (torch.randn(experts, 2 * inter, hidden, generator=g, device=device) / hidden**0.5).to(torch.bfloat16)

    def run(counts, x):
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        return F.grouped_mm(x, w.transpose(1, 2), offs=offs)

    out = {}
    for small_rows in (8, 64, 200):
        mine = torch.randn(small_rows * 4, hidden, generator=g, device=device).to(torch.bfloat16)
        counts = [0] * experts
        counts[3:7] = [small_rows] * 4
        alone = run(counts, mine)
        for total in (4096 * top, 64 * top, 1024 * top):
            others = total // experts
            big_counts = [others] * experts
            big_counts[3:7] = [others + small_rows] * 4
            parts, at = [], 0
            for e in range(experts):
                c = big_counts[e]
                if 3 <= e < 7:
                    extra = torch.randn(others, hidden, generator=g, device=device).to(torch.bfloat16)
                    parts.append(torch.cat([extra, mine[(e - 3) * small_rows:(e - 2) * small_rows]]))
                else:
                    parts.append(torch.randn(c, hidden, generator=g, device=device).to(torch.bfloat16))
                at += c
            big = run(big_counts, torch.cat(parts))
            ends = torch.tensor(big_counts).cumsum(0)
            got = torch.cat([big[ends[e] - small_rows:ends[e]] for e in range(3, 7)])
            out[f"{small_rows} rows/expert inside {total} pairs"] = bool(torch.equal(got, alone))
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=16384, help="largest call (default 16384)")
    ap.add_argument("--out", default=".", help="folder for probe_cuda_invariance.json")
    args = ap.parse_args(argv)
    device = torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(0)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, "
          f"bf16 reduced-precision reduction {torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}")
    found = {}
    for name, ((fn, shape), dtype) in ops(device, g).items():
        n_max = args.rows if "f64" not in name and "f32" not in name else 4096
        res = probe_op(fn, shape, dtype, n_max, device, g)
        found[name] = res
        t = res["times"]
        print(f"{name:<24} rows differ: {res['rows'] or 'none'}")
        print(f"{'':<24} " + "; ".join(f"tile {k}: {v or 'invariant'}" for k, v in res["tiles"].items()))
        print(f"{'':<24} {n_max} rows: " + ", ".join(f"{k} {v:.3f}" for k, v in t.items()))
    found["grouped_mm"] = probe_grouped(device, g)
    for k, v in found["grouped_mm"].items():
        print(f"grouped_mm {k}: {'equal' if v else 'DIFFERS'}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "probe_cuda_invariance.json"), "w") as f:
        json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
