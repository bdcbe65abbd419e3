"""Profile the last step of a one-layer GLM-5.3 chunked prefill on the GPU (torch.profiler).

For each ``--tokens`` length: a warm-up prefill of the same length (autotuning, allocator), then
a prefill whose last step (the longest prefix) runs under the profiler. Writes the kernel table
sorted by CUDA time to ``OUT/profile_<tokens>.txt`` and prints its first rows.

Usage: python scripts/profile_prefill.py --out DIR --tokens 2048,1048576 [--backend triton]
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import _one_layer_model  # noqa: E402  (same model as the benchmark)

from glm_dsa.prefill import PrefillEngine  # noqa: E402


def profile_last_step(model, tokens: int, backend: str, chunk: int, out_dir: str, rows: int) -> None:
    cfg = model.config
    ids = torch.randint(0, cfg.vocab_size, (tokens,), generator=torch.Generator().manual_seed(tokens))
    for warm in (True, False):
        engine = PrefillEngine.for_prompts(model, [tokens], kv_dtype="fp8", chunked_prefill_size=chunk,
                                           prefix_caching=False, compute_logits=False, backend=backend)
        engine.add_request(ids)
        steps = math.ceil(tokens / chunk)
        for _ in range(steps - 1):
            engine.step()
        if warm:
            engine.step()
            continue
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.step()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=70)
        with open(os.path.join(out_dir, f"profile_{tokens}.txt"), "w") as f:
            f.write(f"last step of a {tokens}-token prefill, chunk {chunk}, backend {backend}: "
                    f"{engine.timeline[-1].seconds:.4f} s\n{table}")
        print(f"== {tokens} tokens: last step {engine.timeline[-1].seconds:.4f} s")
        print("\n".join(table.splitlines()[: rows + 3]), flush=True)
        del engine
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="2048,16384,1048576")
    ap.add_argument("--backend", default="triton", choices=("reference", "triton"))
    ap.add_argument("--chunk", type=int, default=32768)
    ap.add_argument("--rows", type=int, default=18, help="table rows printed (all 40 are written)")
    args = ap.parse_args()
    model = _one_layer_model()
    for tokens in map(int, args.tokens.split(",")):
        profile_last_step(model, tokens, args.backend, args.chunk, args.out, args.rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
