"""Probe (issue 31): where two prefills of the same prompts part ways above ``index_topk``.

For the ``small`` config on CUDA (triton backend, index_topk 64), each length set runs four
engines: eager, eager again, CUDA graphs, and the graph engine's padded steps run eagerly.
Prints which pairs are bitwise equal (and their ``calc_diff``), then, for the two eager runs,
the first ``indexer_topk`` / ``attend`` call whose inputs or outputs differ (checksums of the
bytes). With ``--pin`` every logits and candidate launch takes one config (the tiles fix the
head sum's order). Full log as JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import torch

import glm_dsa
from glm_dsa import backend as backend_mod
from glm_dsa.prefill import PrefillEngine

from benchlib import calc_diff


def digest(t: torch.Tensor) -> int:
    b = t.detach().contiguous().view(torch.uint8).flatten().to(torch.int64)
    w = torch.arange(b.numel(), device=b.device) % 65521 + 1
    return int((b * w).sum())


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--pin", action="store_true")
    p.add_argument("--config", default="small")
    p.add_argument("--lengths", default="1536,512;1500,700")
    p.add_argument("--kv-dtype", default="fp8")
    p.add_argument("--no-digest", action="store_true", help="record nothing (no host syncs)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="the Triton sparse MLA kernel without its L2 bulk prefetch")
    args = p.parse_args()
    if args.pin:
        from glm_dsa.kernels import mqa_logits
        one = mqa_logits._mqa_candidates_tuned.configs[:1]
        mqa_logits._mqa_candidates_tuned.configs = one
        mqa_logits._mqa_logits_tuned.configs = [mqa_logits.logits_config_of(one[0])]

    if args.no_prefetch:
        from glm_dsa.kernels import sparse_mla

        class NoPrefetch:
            def __init__(self, kernel):
                self.kernel = kernel

            def __getitem__(self, grid):
                launch = self.kernel[grid]
                return lambda *a, **kw: launch(*a, **{**kw, "PREFETCH": False})

        sparse_mla._sparse_mla_fwd_kernel = NoPrefetch(sparse_mla._sparse_mla_fwd_kernel)
    calls: list = []
    tb = backend_mod.TritonBackend
    topk0, attend0 = tb.indexer_topk, tb.attend

    def topk(self, *a):
        out = topk0(self, *a)
        if not capturing():
            calls.append(("topk", [digest(x) for x in a if isinstance(x, torch.Tensor)], digest(out)))
        return out

    def attend(self, attn, proj, cache, layer_idx, batch, idx, budget):
        out = attend0(self, attn, proj, cache, layer_idx, batch, idx, budget)
        if not capturing():
            calls.append(("attend", [digest(proj.q_latent), digest(idx)], digest(out)))
        return out

    if not args.no_digest:
        tb.indexer_topk, tb.attend = topk, attend
    cfg = glm_dsa.get_config(args.config)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # CPU (interpreter): eager runs only
    model = glm_dsa.init_weights(glm_dsa.build_model(cfg, torch.bfloat16), seed=0).to(dev).eval()
    log: dict = {"args": vars(args)}
    for lengths in [tuple(int(n) for n in ls.split(",")) for ls in args.lengths.split(";")]:
        ids = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]

        def run(graphs, padded=False):
            calls.clear()
            eng = PrefillEngine.for_prompts(model, list(lengths), chunked_prefill_size=1024, compute_logits=False,
                                            prefix_caching=False, cuda_graphs=graphs, backend="triton",
                                            kv_dtype=args.kv_dtype)
            if padded:
                eng.graphs.run = eng.graphs.run_eager
            rids = [eng.add_request(x) for x in ids]
            eng.run()
            return torch.cat([eng.output_hidden(r) for r in rids]).float(), list(calls), eng

        with torch.no_grad():
            eager, c1, _ = run(False)
            again, c2, _ = run(False)
            graph, _, eng = run(True) if dev == "cuda" else (eager, None, None)
            padded, _, _ = run(True, padded=True) if dev == "cuda" else (eager, None, None)
        rec = {
            "graphs_all": eng is not None and all(s.cuda_graph for s in eng.timeline),
            "steps": [] if eng is None else [sum(e - s for _, s, e in st.chunks) for st in eng.timeline],
        }
        for name, (a, b) in {"eager=again": (eager, again), "graph=padded_eager": (graph, padded),
                             "eager=graph": (eager, graph), "eager=padded_eager": (eager, padded)}.items():
            rec[name] = [bool(torch.equal(a, b)), calc_diff(a, b)]
        first = None
        for i, (x, y) in enumerate(zip(c1, c2)):
            if x != y:
                first = {"call": i, "kind": x[0], "inputs_equal": [u == v for u, v in zip(x[1], y[1])],
                         "output_equal": x[2] == y[2]}
                break
        rec["eager_calls"] = len(c1)
        rec["first_eager_difference"] = first
        log[str(lengths)] = rec
        flags = f"pin={args.pin} kv={args.kv_dtype} digest={not args.no_digest} prefetch={not args.no_prefetch}"
        print(f"{flags} {lengths}: " + json.dumps(rec), flush=True)
    with open(args.out, "w") as f:
        json.dump(log, f, indent=1)


if __name__ == "__main__":
    main()
