"""The per-step conversions of an FP8 pool's context, Triton kernels against the torch forms
they stand for, at GLM-5.3's 656-byte rows: the FP8-query mode's requantization to one scale
(``glm_dsa.kernels.kv_requant``, ``mla_kv_per_tensor_fp8(mla_kv_load(pool, slots))``) and the bf16
mode's dequantization (``glm_dsa.kernels.kv_dequant``, ``mla_kv_dequantize(mla_kv_load(pool,
slots), dtype=torch.bfloat16)``).

    python scripts/bench_kv_requant.py [--tokens 131072,1048576] [--ops requant,dequant] [--out PATH]

For each ``--tokens`` count and op: a pool of that many quantized random rows read through a
random slot permutation; whether the two agree bitwise, the median of 5 timed calls of each
(CUDA events) and the kernel's rate in bytes moved (656 read, and 576 e4m3 or 1,152 bf16 bytes
written a token).
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

from glm_dsa.kernels.kv_dequant import mla_kv_dequantize_paged  # noqa: E402
from glm_dsa.kernels.kv_requant import mla_kv_per_tensor_fp8_paged  # noqa: E402
from glm_dsa.kv_format import (  # noqa: E402
    mla_kv_dequantize,
    mla_kv_load,
    mla_kv_per_tensor_fp8,
    mla_kv_quantize,
)

PAGE_SIZE = 64
# Each op: the kernel, the torch form, the bytes a token moves (its pool row read, its row written).
OPS = {
    "requant": (mla_kv_per_tensor_fp8_paged, lambda pool, slots: mla_kv_per_tensor_fp8(
        mla_kv_load(pool, slots)), 656 + 576),
    "dequant": (mla_kv_dequantize_paged, lambda pool, slots: mla_kv_dequantize(
        mla_kv_load(pool, slots), dtype=torch.bfloat16), 656 + 1152),
}


def _bits(out) -> list[torch.Tensor]:
    """The outputs' bytes: a tensor, or a (tensor, scale) pair."""
    outs = out if isinstance(out, tuple) else (out,)
    return [t.contiguous().view(torch.uint8) for t in outs]


def measure(op: str, tokens: int, device: str) -> dict:
    kernel, torch_form, moved = OPS[op]
    pages = -(-tokens // PAGE_SIZE)
    rows = mla_kv_quantize(torch.randn(pages * PAGE_SIZE, 512, device=device),
                           torch.randn(pages * PAGE_SIZE, 64, device=device))
    pool = rows.reshape(pages, PAGE_SIZE, -1)
    slots = torch.randperm(pages * PAGE_SIZE, device=device)[:tokens]
    got, want = _bits(kernel(pool, slots)), _bits(torch_form(pool, slots))
    bitwise = all(torch.equal(a, b) for a, b in zip(got, want))
    kernel_s = median_seconds(lambda: kernel(pool, slots), reps=5)
    torch_s = median_seconds(lambda: torch_form(pool, slots), reps=5)
    return dict(op=op, tokens=tokens, bitwise=bitwise, kernel_ms=kernel_s * 1e3,
                torch_ms=torch_s * 1e3, kernel_tb_s=tokens * moved / kernel_s / 1e12,
                speedup=torch_s / kernel_s)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="131072,1048576", help="comma-separated context lengths")
    ap.add_argument("--ops", default="requant,dequant", help=f"comma-separated, of {sorted(OPS)}")
    ap.add_argument("--out", help="write the figures here (JSON)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    ops = args.ops.split(",")
    if not set(ops) <= set(OPS):
        ap.error(f"--ops {args.ops!r}: each must be one of {sorted(OPS)}")
    results = [measure(op, int(t), args.device) for op in ops for t in args.tokens.split(",")]
    for r in results:
        print(f"{r['op']:>8} {r['tokens']:>9} tokens: bitwise {r['bitwise']}, kernels {r['kernel_ms']:.3f} ms "
              f"({r['kernel_tb_s']:.2f} TB/s), torch {r['torch_ms']:.3f} ms, {r['speedup']:.1f}x")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
