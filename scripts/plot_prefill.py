"""Plot step time against prefix length for chunked prefills, beside the per-step floor.

Series come from ``scripts/bench.py`` outputs: a ``bench.json`` (its prefill entry of
``--tokens`` tokens) or a bench log (``  step {json}`` lines closed by ``prefill {json}``, or
the older ``step N ((0, start, end),) S s ...`` lines). The floor of
a step is its FLOPs (the ledger's, ``bench.component_flops`` of ``end`` minus that of
``start``: every component is causal in the prefix) at the bf16 and fp8 ceilings of the JSON
given with ``--ceilings``.

Usage: python scripts/plot_prefill.py --out docs/prefill-1m.png --tokens 1048576 \
    --ceilings RUN.json --series "triton (2026-12-01)=RUN.json" --series "reference=OLD.log"
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench import GLM, component_flops  # noqa: E402

_STEP = re.compile(r"step (\d+) \(\(\d+, (\d+), (\d+)\),\) ([\d.]+) s")


def read_steps(path: str, tokens: int) -> list[tuple[int, int, float]]:
    """``(start, end, seconds)`` of each step of the ``tokens``-token prefill in ``path``."""
    if path.endswith(".json"):
        with open(path) as f:
            entry = next(p for p in json.load(f)["prefill"] if p["tokens"] == tokens)
        return [(s["start"], s["end"], s["seconds"]) for s in entry["steps"]]
    with open(path) as f:
        text = f.read()
    if "  step {" not in text:  # an older log: "step N ((0, start, end),) S s ..."
        return [(int(m[2]), int(m[3]), float(m[4])) for m in _STEP.finditer(text)]
    steps: list[tuple[int, int, float]] = []
    for line in text.splitlines():  # "  step {json}" lines, then "prefill {json}" per prompt
        if line.startswith("  step {"):
            s = json.loads(line[len("  step "):])
            steps.append((s["start"], s["end"], s["seconds"]))
        elif line.startswith("prefill {"):
            if json.loads(line[len("prefill "):])["tokens"] == tokens:
                return steps
            steps = []
    raise ValueError(f"{path} holds no prefill of {tokens} tokens")


def read_ceilings(path: str) -> dict:
    """The measured ceilings of a ``bench.json``, or of a bench log's ``ceilings {json}`` line."""
    with open(path) as f:
        if path.endswith(".json"):
            return json.load(f)["ceilings"]
        line = next(line for line in f if line.startswith("ceilings {"))
    return json.loads(line[len("ceilings "):])


def step_floor(start: int, end: int, ceilings: dict) -> float:
    """Seconds of the step's bf16 and fp8 FLOPs at the measured ceilings."""
    hi, lo = component_flops(GLM, end), component_flops(GLM, start)
    bf16 = sum(hi[k][0] - lo[k][0] for k in hi)
    fp8 = sum(hi[k][1] - lo[k][1] for k in hi)
    return bf16 / ceilings["bf16_flops_per_s"] + fp8 / ceilings["fp8_flops_per_s"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", type=int, default=1048576)
    ap.add_argument("--ceilings", required=True, help="bench.json or bench log whose ceilings set the floor")
    ap.add_argument("--series", action="append", required=True, help="LABEL=PATH (.json or .log)")
    ap.add_argument("--title", default="one GLM-5.3 layer (full indexer, MoE, FP8 KV), H200\n"
                                       "chunked prefill of 1,048,576 tokens, chunk 32,768")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ceilings = read_ceilings(args.ceilings)
    fig, ax = plt.subplots(figsize=(7.5, 5.5))
    steps = []
    for spec in args.series:
        label, path = spec.split("=", 1)
        steps = read_steps(path, args.tokens)
        total = sum(s for _, _, s in steps)
        ax.plot([a / 1e3 for a, _, _ in steps], [s for _, _, s in steps], marker="o", ms=3,
                label=f"{label}: {len(steps)} steps, {total:.1f} s")
    floor = [(a, step_floor(a, b, ceilings)) for a, b, _ in read_steps(args.series[0].split("=", 1)[1], args.tokens)]
    ax.plot([a / 1e3 for a, _ in floor], [f for _, f in floor], "k--",
            label=f"floor (FLOPs at measured ceilings): {sum(f for _, f in floor):.1f} s")
    ax.set_yscale("log")
    ax.set_xlabel("prefix at the start of the step (thousand tokens)")
    ax.set_ylabel("step time (s, log scale)")
    ax.set_title(args.title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    # Below the axes, so the legend never covers a curve.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), fontsize=8, ncol=1)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
