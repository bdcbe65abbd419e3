"""Regenerate weights_stub/: tiny and small checkpoints in HF form, and an FP8 variant of small.

    python scripts/make_weights_stub.py [--out weights_stub]

Deterministic: the same command writes byte-identical files (fixed seeds, CPU generator).
"""

from __future__ import annotations

import argparse
import os

import torch

from glm_dsa.config import PRESETS
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.weights import init_weights, save_checkpoint

STUBS = (("tiny", "tiny", False, 0), ("small", "small", False, 1), ("small-fp8", "small", True, 1))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "weights_stub"))
    args = parser.parse_args(argv)
    for dirname, preset, fp8, seed in STUBS:
        model = init_weights(DSAForCausalLM(PRESETS[preset]).to(torch.bfloat16), seed)
        path = os.path.join(args.out, dirname)
        save_checkpoint(model, path, fp8=fp8)
        size = os.path.getsize(os.path.join(path, "model.safetensors"))
        print(f"{path}: {size / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
