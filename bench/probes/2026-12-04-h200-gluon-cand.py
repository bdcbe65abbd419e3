"""Probe (issue 43, 2026-12-04 run H): the candidate filter on the Gluon logits kernel.

``indexer_topk`` with its candidate kernel swapped for ``launch_mqa_candidates_gluon`` (its
``CONFIG`` and ``FOUR_CONSUMERS``) against the Triton candidate kernel, at 4,096 × 131,072 and
32,768 × 1,048,576 causal rows (H 32, D 128, top-2048, the indexer part's inputs), beside
DeepGEMM's logits alone over the budget's slices. The Gluon kernel's warp-specialized consumers
might hide the per-entry atomics' round trip behind the other consumer's MMAs. Prints a table;
the sets are compared with the Triton path's (rows that differ: near-ties of two accumulation
orders). Run: ``PYTHONPATH=$PWD:/tmp/peer/pkg python bench/probes/2026-12-04-h200-gluon-cand.py``.
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
from bench_indexer import _deepgemm_logits_in_slices, _inputs  # noqa: E402
from benchlib import median_seconds  # noqa: E402

from glm_dsa import budget as budgets  # noqa: E402
from glm_dsa.kernels import indexer as fast  # noqa: E402
from glm_dsa.kernels import mqa_logits_gluon as mg  # noqa: E402

TOPK, H, D = 2048, 32, 128
SHAPES = [(4096, 131_072), (32_768, 1_048_576)]
triton_cand = fast.launch_mqa_candidates


def gluon_cand(config):
    def launch(q, k, k_scale, w, ks, ke, thr, counters, cand):
        return mg.launch_mqa_candidates_gluon(q, k, k_scale, w, ks, ke, thr, counters, cand, config)
    return launch


try:
    import deep_gemm
except Exception as e:  # noqa: BLE001
    deep_gemm, dg_error = None, repr(e)
rows_out = []
for S, N in SHAPES:
    q, k, k_scale, w, ks, ke = _inputs(S, N)
    budget = budgets.default_logits_bytes("cuda")
    flops = 2 * H * D * int((ke - ks).long().sum())
    res = {}
    ref = None
    for name, launch in [("triton", triton_cand), ("gluon", gluon_cand(None)),
                         ("gluon4", gluon_cand(mg.FOUR_CONSUMERS))]:
        fast.launch_mqa_candidates = launch
        try:
            out = fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, budget)
            ms = 1e3 * median_seconds(lambda: fast.indexer_topk(q, w, k, k_scale, ks, ke, TOPK, budget),
                                      warmup=1, reps=3)
        except Exception as e:  # noqa: BLE001
            res[name] = f"failed: {e!r}"[:120]
            continue
        finally:
            fast.launch_mqa_candidates = triton_cand
        if ref is None:
            ref, differ = out, 0
        else:
            differ = int((out.sort(1).values != ref.sort(1).values).any(1).sum())
        res[name] = f"{ms:.2f} ms ({flops / ms / 1e9:.0f}), rows differing {differ}"
        torch.cuda.empty_cache()
    if deep_gemm is not None:
        rows = budgets.max_logit_rows(S, N, budget)
        ms = 1e3 * median_seconds(lambda: _deepgemm_logits_in_slices(deep_gemm, q, k, k_scale, w, ks, ke, rows),
                                  warmup=1, reps=3)
        res["deepgemm_logits"] = f"{ms:.2f} ms ({flops / ms / 1e9:.0f})"
    else:
        res["deepgemm_logits"] = dg_error[:80]
    rows_out.append((S, N, res))
    print(S, N, res, flush=True)
    del q, k, k_scale, w, ks, ke, ref
    torch.cuda.empty_cache()

print("\n| rows × keys | indexer_topk, Triton candidates | Gluon CONFIG | Gluon FOUR_CONSUMERS | DeepGEMM logits |")
print("|---|---|---|---|---|")
for S, N, r in rows_out:
    print(f"| {S:,} × {N:,} | {r.get('triton')} | {r.get('gluon')} | {r.get('gluon4')} | {r.get('deepgemm_logits')} |")
