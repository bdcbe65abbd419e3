"""The FP8-query mode's per-step requantization of an FP8 pool's context: the Triton kernels
(``glm_dsa.kernels.kv_requant``) against the torch form they replace,
``mla_kv_per_tensor_fp8(mla_kv_load(pool, slots))``, at GLM-5.3's 656-byte rows.

    python scripts/bench_kv_requant.py [--tokens 131072,1048576] [--out PATH]

For each ``--tokens`` count: a pool of that many quantized random rows read through a random
slot permutation; whether the two agree bitwise (bytes and scale), the median of 5 timed calls
of each (CUDA events) and the kernels' rate in bytes moved (656 read + 576 written a token).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from benchlib import median_seconds  # noqa: E402

from glm_dsa.kernels.kv_requant import mla_kv_per_tensor_fp8_paged  # noqa: E402
from glm_dsa.kv_format import mla_kv_load, mla_kv_per_tensor_fp8, mla_kv_quantize  # noqa: E402

PAGE_SIZE = 64
MOVED_BYTES = 656 + 576  # a token's pool row read, its e4m3 row written


def measure(tokens: int, device: str) -> dict:
    pages = -(-tokens // PAGE_SIZE)
    rows = mla_kv_quantize(torch.randn(pages * PAGE_SIZE, 512, device=device),
                           torch.randn(pages * PAGE_SIZE, 64, device=device))
    pool = rows.reshape(pages, PAGE_SIZE, -1)
    slots = torch.randperm(pages * PAGE_SIZE, device=device)[:tokens]
    (got, got_scale), (want, want_scale) = (mla_kv_per_tensor_fp8_paged(pool, slots),
                                            mla_kv_per_tensor_fp8(mla_kv_load(pool, slots)))
    bitwise = (torch.equal(got.view(torch.uint8), want.view(torch.uint8))
               and torch.equal(got_scale.view(torch.int32), want_scale.view(torch.int32)))
    kernel_s = median_seconds(lambda: mla_kv_per_tensor_fp8_paged(pool, slots), reps=5)
    torch_s = median_seconds(lambda: mla_kv_per_tensor_fp8(mla_kv_load(pool, slots)), reps=5)
    return dict(tokens=tokens, bitwise=bitwise, kernel_ms=kernel_s * 1e3, torch_ms=torch_s * 1e3,
                kernel_tb_s=tokens * MOVED_BYTES / kernel_s / 1e12, speedup=torch_s / kernel_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="131072,1048576", help="comma-separated context lengths")
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    results = [measure(int(t), args.device) for t in args.tokens.split(",")]
    for r in results:
        print(f"{r['tokens']:>9} tokens: bitwise {r['bitwise']}, kernels {r['kernel_ms']:.3f} ms "
              f"({r['kernel_tb_s']:.2f} TB/s), torch {r['torch_ms']:.3f} ms, {r['speedup']:.1f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
