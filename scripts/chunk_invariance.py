"""How far a request's outputs move with the chunk size and the requests beside it.

The `small` preset in float32 (fp32 KV, reference backend, random weights): requests of
``--lengths`` tokens run together in steps of each ``--chunks`` size, against each request run
alone in one step. Per chunk size it prints the largest relative error of the hidden states
(max |Δ| / max |ref| per request, the worst request), the fraction of positions off by more
than 1e-4 of the scale, and the fraction of (position, full layer) rows whose top-k set
differs from the one-shot run's. ``--batch-invariant`` runs both sides with the switch on.

    python scripts/chunk_invariance.py --seeds 0 1 --json out.json
"""

from __future__ import annotations

import argparse
import json

import torch

from glm_dsa.config import PRESETS
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights


def _run(model, prompts, chunk, invariant):
    """Per request: hidden [L, hidden] and {layer: top-k rows [L, k]} (each as a set later)."""
    eng = PrefillEngine(model, num_pages=200, kv_dtype="fp32", chunked_prefill_size=chunk,
                        budget_bytes=1 << 26, batch_invariant=invariant)
    captured = []
    hooks = [layer.self_attn.indexer.register_forward_hook(
                 lambda mod, args, out, i=i: captured.append((i, out.clone())))
             for i, layer in enumerate(model.model.layers) if layer.self_attn.indexer is not None]
    rids = [eng.add_request(p) for p in prompts]
    topk = {r: {} for r in rids}
    try:
        while (record := eng.step()) is not None:
            for layer, rows in captured:
                q0 = 0
                for rid, start, end in record.chunks:
                    topk[rid].setdefault(layer, []).append(rows[q0 : q0 + end - start])
                    q0 += end - start
            captured.clear()
    finally:
        for h in hooks:
            h.remove()
    return [(eng.output_hidden(r), {k: torch.cat(v) for k, v in topk[r].items()}) for r in rids]


def _flips(a, b):
    """Rows whose top-k sets differ, and rows compared."""
    sa, _ = torch.sort(a, dim=-1)
    sb, _ = torch.sort(b, dim=-1)
    return int((sa != sb).any(dim=-1).sum()), a.shape[0]


def measure(seed, lengths, chunks, invariant):
    cfg = PRESETS["small"]
    model = init_weights(DSAForCausalLM(cfg), seed=seed).eval()
    gen = torch.Generator().manual_seed(1000 + seed)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=gen) for n in lengths]
    alone = [_run(model, [p], 1 << 14, invariant)[0] for p in prompts]
    rows = []
    for chunk in chunks:
        together = _run(model, prompts, chunk, invariant)
        worst, off, positions, flipped, compared = 0.0, 0, 0, 0, 0
        for (h, tk), (h1, tk1) in zip(together, alone):
            scale = h1.abs().max()
            err = (h - h1).abs().amax(dim=-1) / scale
            worst = max(worst, float(err.max()))
            off += int((err > 1e-4).sum())
            positions += h.shape[0]
            for layer in tk1:
                f, c = _flips(tk[layer], tk1[layer])
                flipped, compared = flipped + f, compared + c
        rows.append({"seed": seed, "chunk": chunk, "max_rel_err": worst,
                     "positions_off_1e-4": off / positions, "topk_rows_flipped": flipped / compared})
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[700, 450, 1100])
    ap.add_argument("--chunks", type=int, nargs="+", default=[128, 256, 512])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    rows = [r for s in args.seeds for r in measure(s, args.lengths, args.chunks, args.batch_invariant)]
    print(f"small, float32, fp32 KV, requests {args.lengths}, batch_invariant={args.batch_invariant}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'seed':>4} {'chunk':>6} {'max rel err':>12} {'positions > 1e-4':>17} {'top-k rows flipped':>19}")
    for r in rows:
        print(f"{r['seed']:>4} {r['chunk']:>6} {r['max_rel_err']:12.2e} {r['positions_off_1e-4']:17.2%} "
              f"{r['topk_rows_flipped']:19.3%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
