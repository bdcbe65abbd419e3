"""One DSA layer's chunked prefill under several backends, in one process, on one set of weights.

Builds one layer's random weights once (``--config``, ``--layers``; glm-5.3's layer 6 by
default: full indexer, MoE), then for each backend of ``--backends`` runs a warm-up prefill of
the same length (Triton's autotuning, DeepGEMM's JIT) and a timed one, recording the layer's
top-k of every step. Against the first backend (the baseline) it reports

* ``calc_diff`` of the hidden states (DeepGEMM's metric, float64 sums) and the top-k overlap
  (the mean over query rows of ``|A ∩ B| / |A|``, sets; rows of ≤ ``index_topk`` keys count 1);
* ``forced calc_diff``: the backend's attention run over the baseline's own top-k (a backend
  object that replays the baseline's selections, injected through ``PrefillEngine(backend=)``),
  beside the same for the reference backend (``--forced-reference``): that second figure is the
  reference-vs-baseline bound the first should fall within.

A backend that cannot run here (``peers`` without DeepGEMM / FlashMLA, or off CUDA) is listed
with the one-line reason. Prints a table and writes every figure to ``--out`` (JSON).

GPU: python scripts/bench_backends.py --out $OUT/bench_backends.json
CPU (small, Triton's interpreter):
    TRITON_INTERPRET=1 python scripts/bench_backends.py --config tiny --layers 0:2 --tokens 320 \\
        --chunk 128 --device cpu --dtype float32 --out /tmp/bench_backends.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import Tensor

from glm_dsa.backend import REFERENCE, Backend, get_backend
from glm_dsa.config import get_config, keep_layers
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import build_model, init_weights

from benchlib import calc_diff, sync

GB = 1e9


class Recording(Backend):
    """A backend that records every top-k its ``base`` returns (on the device); it can do what
    ``base`` can."""

    def __init__(self, base: Backend) -> None:
        self.base, self.name, self.topk = base, base.name, []
        self.graph_capturable, self.batch_invariant = base.graph_capturable, base.batch_invariant
        self.activation_dtypes, self.kv_dtypes = base.activation_dtypes, base.kv_dtypes
        self.passes = base.passes

    def indexer_topk(self, *args) -> Tensor:
        out = self.base.indexer_topk(*args)
        self.topk.append(out)
        return out

    def attend(self, *args) -> Tensor:
        return self.base.attend(*args)


class Replaying(Recording):
    """``base``'s attention over given top-k selections, returned in call order."""

    def __init__(self, base, selections: list[Tensor]) -> None:
        super().__init__(base)
        self.name = f"{base.name} over the baseline's top-k"
        self._next = iter(selections)

    def indexer_topk(self, q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes) -> Tensor:
        picked = next(self._next)
        if picked.shape != (q_fp8.shape[0], topk):
            raise RuntimeError(f"replayed top-k {tuple(picked.shape)} does not fit this call")
        return picked


def topk_overlap(a: list[Tensor], b: list[Tensor], rows: int = 1024) -> float:
    """Mean over rows of ``|A ∩ B| / |A|`` (``-1`` padding ignored; an empty row counts 1)."""
    total, count = 0.0, 0
    for sa, sb in zip(a, b):
        width = int(max(sa.max(), sb.max())) + 2
        for r0 in range(0, sa.shape[0], rows):
            ra, rb = sa[r0 : r0 + rows].long(), sb[r0 : r0 + rows].long()
            mask = torch.zeros(ra.shape[0], width, dtype=torch.bool, device=ra.device)
            mask.scatter_(1, torch.where(ra >= 0, ra, width - 1), True)
            mask[:, width - 1] = False
            shared = (mask.gather(1, torch.where(rb >= 0, rb, width - 1)) & (rb >= 0)).sum(1)
            size = (ra >= 0).sum(1)
            total += float(torch.where(size > 0, shared / size.clamp(min=1), 1.0).sum())
            count += ra.shape[0]
    return total / max(count, 1)


def prefill(model, ids: Tensor, backend, args, timing: bool) -> dict:
    """One prefill of ``ids``; its hidden states, steps, seconds and peak memory."""
    device = next(model.parameters()).device
    engine = PrefillEngine.for_prompts(model, [ids.numel()], kv_dtype=args.kv_dtype,
                                       chunked_prefill_size=args.chunk, prefix_caching=False,
                                       compute_logits=False, timing=timing, backend=backend)
    rid = engine.add_request(ids)
    sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    engine.run()
    sync(device)
    seconds = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    return {"hidden": engine.output_hidden(rid), "seconds": seconds, "peak_bytes": peak,
            "steps": [{"tokens": sum(e - s for _, s, e in r.chunks), "seconds": r.seconds,
                       "indexer_s": r.indexer, "attention_s": r.attention, "moe_s": r.moe,
                       "projections_s": r.projections} for r in engine.timeline]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="glm-5.3")
    ap.add_argument("--layers", default="6:7")
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--chunk", type=int, default=32768)
    ap.add_argument("--kv-dtype", default="fp8")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backends", default="triton,peers",
                    help="comma-separated; the first is the baseline the others are compared with")
    ap.add_argument("--forced-reference", action=argparse.BooleanOptionalAction, default=True,
                    help="also run the reference attention over the baseline's top-k (the bound)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="JSON log")
    args = ap.parse_args()

    device = torch.device(args.device)
    config = keep_layers(get_config(args.config), args.layers)
    t0 = time.perf_counter()
    model = init_weights(build_model(config, getattr(torch, args.dtype), device), args.seed).eval()
    sync(device)
    log: dict = {"config": config.name, "tokens": args.tokens, "chunk": args.chunk,
                 "kv_dtype": args.kv_dtype, "dtype": args.dtype, "device": str(device),
                 "torch": torch.__version__, "weights_s": time.perf_counter() - t0, "runs": []}
    if device.type == "cuda":
        log["gpu"] = torch.cuda.get_device_name(device)
    ids = torch.randint(0, config.vocab_size, (args.tokens,),
                        generator=torch.Generator().manual_seed(args.seed))
    names = args.backends.split(",")
    baseline = None
    for name in names:
        try:
            backend = get_backend(name, device)
            backend.require(getattr(torch, args.dtype), args.kv_dtype)
        except ValueError as e:
            log["runs"].append({"backend": name, "unavailable": str(e)})
            print(f"{name}: unavailable: {e}", flush=True)
            continue
        prefill(model, ids, backend, args, timing=False)  # autotuning / JIT out of the timings
        recording = Recording(backend)
        run = prefill(model, ids, recording, args, timing=True)
        run.update(backend=name, topk=recording.topk)
        if baseline is None:
            baseline = run
        else:
            run["calc_diff"] = calc_diff(run["hidden"], baseline["hidden"])
            run["topk_overlap"] = topk_overlap(baseline["topk"], run["topk"])
            forced = prefill(model, ids, Replaying(backend, baseline["topk"]), args, timing=False)
            run["forced_calc_diff"] = calc_diff(forced["hidden"], baseline["hidden"])
            del forced, run["hidden"], run["topk"]
        log["runs"].append(run)
        print(f"{name}: {run['seconds']:.3f} s", flush=True)
    if baseline is not None and args.forced_reference:
        forced = prefill(model, ids, Replaying(REFERENCE, baseline["topk"]), args, timing=True)
        log["reference_forced"] = {"seconds": forced["seconds"], "peak_bytes": forced["peak_bytes"],
                                   "forced_calc_diff": calc_diff(forced["hidden"], baseline["hidden"])}
    for run in log["runs"]:  # the tensors stay out of the log
        run.pop("hidden", None)
        run.pop("topk", None)

    with open(args.out, "w") as f:
        json.dump(log, f, indent=2)
    print(f"\n{config.name}, {args.tokens} tokens, chunk {args.chunk}, KV {args.kv_dtype}, "
          f"{args.dtype} on {device}; baseline {names[0]}")
    print("| backend | seconds per step | total s | peak GB | calc_diff | top-k overlap | forced calc_diff |")
    print("|---|---|---|---|---|---|---|")
    for run in log["runs"]:
        if "unavailable" in run:
            print(f"| {run['backend']} | unavailable: {run['unavailable']} | | | | | |")
            continue
        steps = ", ".join(f"{s['seconds']:.3f}" for s in run["steps"])
        diff = lambda k: f"{run[k]:.2e}" if k in run else "—"  # noqa: E731
        overlap = f"{100 * run['topk_overlap']:.2f} %" if "topk_overlap" in run else "—"
        print(f"| {run['backend']} | {steps} | {run['seconds']:.3f} | {run['peak_bytes'] / GB:.1f} | "
              f"{diff('calc_diff')} | {overlap} | {diff('forced_calc_diff')} |")
    if "reference_forced" in log:
        r = log["reference_forced"]
        print(f"| reference over the baseline's top-k (the bound) | | {r['seconds']:.3f} | "
              f"{r['peak_bytes'] / GB:.1f} | | | {r['forced_calc_diff']:.2e} |")


if __name__ == "__main__":
    main()
