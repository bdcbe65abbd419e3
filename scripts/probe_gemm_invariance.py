"""Does a GEMM round a row the same whatever else is in the call? Measured on this host.

For the float32 product shapes of the `small` preset and of GLM-5.3, prints:

* ``linear``: row counts n in 1..ROWS for which ``F.linear(x[:n], W)`` differs from the first n
  rows of ``F.linear(x[:ROWS], W)`` (what a chunk or a co-scheduled request changes);
* ``place``: rows of a fixed T-row call whose result moves with the row's place in the call
  (what fixed-shape tiles alone would leave: MKL's AVX2 edge kernels);
* ``bmm``: batch counts in 1..40 for which an item of ``torch.bmm`` differs from the same
  item in a 40-item call;
* the same for ``glm_dsa.invariant`` (row_tiled on positions, batch_tiled), which must be empty;
* row-wise reductions (``mean``, ``sum`` over the last dim) against the row count;
* elementwise ops against the row count (ATen's SIMD loop and its scalar tail may round apart),
  plain and through ``glm_dsa.invariant.row_wise``.

Run it under each MKL path: ``MKL_ENABLE_INSTRUCTIONS=AVX2 python scripts/probe_gemm_invariance.py``
and without the variable (the host's best path). ``--json FILE`` writes the raw findings.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from glm_dsa import invariant

LINEAR_SHAPES = {  # (in, out): small's q_a / q_b / kv_a / o_proj / experts, GLM-5.3's
    "small": [(256, 128), (128, 192), (256, 144), (128, 256), (256, 64), (32, 256), (256, 16)],
    "glm-5.3": [(6144, 2048), (2048, 12288), (6144, 576), (16384, 6144), (6144, 32)],
}
BMM_SHAPES = [(4, 576, 64, True), (4, 64, 576, False), (4, 576, 96, True), (64, 576, 2048, True),
              (64, 2048, 576, False)]  # (m, k, n, transposed rhs): sparse MLA's q·kᵀ and p·v


def _differing_counts(f, x, counts):
    full = f(x)
    return [n for n in counts if not torch.equal(f(x[:n].clone()), full[:n])]


def probe_linear(k, n, rows, g):
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(rows, k, generator=g)
    keys = torch.randint(0, 1 << 20, (rows,), generator=g)
    counts = range(1, rows + 1)
    plain = _differing_counts(lambda t: F.linear(t, w), x, counts)
    with invariant.batch_invariant():
        full = invariant.linear(x, w, keys)
        tiled = [c for c in counts if not torch.equal(invariant.linear(x[:c], w, keys[:c]), full[:c])]
    return plain, tiled


def probe_place(k, n, tile, g, trials=2):
    w = torch.randn(n, k, generator=g) / k**0.5
    moved = set()
    for _ in range(trials):
        v = torch.randn(k, generator=g)
        results = []
        for p in range(tile):
            t = torch.randn(tile, k, generator=g)
            t[p] = v
            results.append(F.linear(t, w)[p])
        moved |= {p for p in range(tile) if not torch.equal(results[p], results[0])}
    return sorted(moved)


def probe_bmm(m, k, n, transposed, g, items=40):
    a = torch.randn(items, m, k, generator=g)
    b = torch.randn(items, n, k, generator=g).transpose(1, 2) if transposed else torch.randn(items, k, n, generator=g)
    counts = range(1, items + 1)
    plain = [c for c in counts if not torch.equal(torch.bmm(a[:c], b[:c])[0], torch.bmm(a, b)[0])]
    full = invariant.batch_tiled(torch.bmm, a, b)
    tiled = [c for c in counts if not torch.equal(invariant.batch_tiled(torch.bmm, a[:c], b[:c]), full[:c])]
    return plain, tiled


def probe_reductions(g, rows=300):
    out = {}
    for d in (128, 256, 2048, 6144):
        x = torch.randn(rows, d, generator=g)
        for name, f in (("mean", lambda t: t.square().mean(-1)), ("sum", lambda t: t.exp().sum(-1))):
            out[f"{name}[{d}]"] = _differing_counts(f, x, range(1, rows + 1))
    return out


ELEMENTWISE = {"exp": torch.exp, "log": torch.log, "rsqrt": torch.rsqrt, "cos": torch.cos,
               "sigmoid": torch.sigmoid, "silu": F.silu, "gelu": F.gelu}


def probe_elementwise(g, rows=300):
    """Row counts for which an op's rows differ from the same rows of a ``rows``-row call,
    for the router's 16 and 4 columns, an odd width and an MLP width; plain and row-wise
    (keyed on random positions)."""
    out = {}
    counts = range(1, rows + 1)
    keys = torch.randint(0, 1 << 16, (rows,), generator=g)
    for name, op in ELEMENTWISE.items():
        for d in (4, 16, 37, 512):
            x = torch.randn(rows, d, generator=g) * 3
            if name in ("log", "rsqrt"):
                x = x.abs() + 1e-3
            plain = _differing_counts(op, x, counts)
            whole = _row_wise(op, x, keys)
            tiled = [n for n in counts if not torch.equal(_row_wise(op, x[:n], keys[:n]), whole[:n])]
            out[f"{name}[{d}]"] = {"plain": plain, "row_wise": tiled}
    return out


def _row_wise(op, x, keys):
    with invariant.batch_invariant():
        return invariant.row_wise(op, x, keys)


def _short(xs, k=8):
    return "none" if not xs else f"{len(xs)}: {', '.join(map(str, xs[:k]))}{' …' if len(xs) > k else ''}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=600, help="largest row count tried (default 600)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (default 2, as CI)")
    ap.add_argument("--glm", action="store_true", help="also GLM-5.3's shapes (slow on 2 cores)")
    ap.add_argument("--json", help="write the findings here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    path = os.environ.get("MKL_ENABLE_INSTRUCTIONS", "host default")
    print(f"torch {torch.__version__}, {args.threads} threads, MKL_ENABLE_INSTRUCTIONS={path}, "
          f"ATen {torch.backends.cpu.get_cpu_capability()}")
    found: dict = {"mkl_path": path, "threads": args.threads, "linear": {}, "place": {}, "bmm": {}}
    print(f"{'product':<34} {'plain: row counts that differ':<44} invariant")
    for preset, shapes in LINEAR_SHAPES.items():
        if preset == "glm-5.3" and not args.glm:
            continue
        rows = args.rows if preset == "small" else min(args.rows, 80)
        for k, n in shapes:
            plain, tiled = probe_linear(k, n, rows, g)
            found["linear"][f"{k}x{n}"] = {"plain": plain, "row_tiled": tiled, "rows": rows}
            label = f"linear {k}->{n} (1..{rows} rows)"
            print(f"{label:<34} {_short(plain):<44} {_short(tiled)}")
    for tile in (32, 64, 96, 128):
        moved = {f"{k}x{n}": probe_place(k, n, tile, g) for k, n in LINEAR_SHAPES["small"]}
        found["place"][tile] = moved
        bad = {s: p for s, p in moved.items() if p}
        label = f"place in a {tile}-row call"
        print(f"{label:<34} {', '.join(f'{s} rows {p[:4]}' for s, p in bad.items()) or 'none'}")
    for m, k, n, tr in BMM_SHAPES:
        plain, tiled = probe_bmm(m, k, n, tr, g)
        found["bmm"][f"{m}x{k}x{n}{'T' if tr else ''}"] = {"plain": plain, "batch_tiled": tiled}
        label = f"bmm [{m},{k}]x[{k},{n}]{'ᵀ' if tr else ''} (1..40)"
        print(f"{label:<34} {_short(plain):<44} {_short(tiled)}")
    found["reductions"] = probe_reductions(g)
    for name, counts in found["reductions"].items():
        label = f"row-wise {name} (1..300 rows)"
        print(f"{label:<34} {_short(counts)}")
    found["elementwise"] = probe_elementwise(g)
    for name, res in found["elementwise"].items():
        label = f"elementwise {name} (1..300 rows)"
        print(f"{label:<34} {_short(res['plain']):<44} {_short(res['row_wise'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(found, f, indent=1)


if __name__ == "__main__":
    main()
