"""The GLM-5.3 MoE layer alone on one GPU: time, rate and transient memory at each token count.

    python scripts/bench_moe.py --out DIR [--tokens 2048,32768] [--budget-bytes N]
        [--before PATH] [--profile-tokens 32768]

One set of random bf16 GLM-5.3 MoE weights (256 experts top 8 + one shared expert). For each
``--tokens`` length: the median of 3 timed calls after a warm-up (CUDA events), and one more call's
peak allocation above what was allocated before it (the weights and the input): the MoE's
transient memory, its output included. Floors, from ceilings measured first in the same run: the
ledger's FLOPs at the bf16 matmul rate, and the weights' bytes read once at the copy rate (the
floor at short lengths, where every expert's weights are read for a few rows each).

``--before PATH``: a ``moe.py`` of an earlier tree (e.g. ``git show main:glm_dsa/moe.py``), whose
``MoE`` is run on the very same parameters and timed beside the current one; its outputs are
compared with the current ones (``calc_diff``, expert counts equal). Also checked on the GPU: the
fused SwiGLU and combine against their torch forms (largest difference, bitwise flags), no host
synchronisation in the current MoE (``torch.cuda.set_sync_debug_mode("error")``), and a CUDA
graph capture of it replaying bitwise the eager result. Writes DIR/bench_moe.json (and
DIR/profile_moe_<tokens>.txt, the kernel table of one call).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout
from bench import _peak, ceilings, random_moe  # noqa: E402
from benchlib import calc_diff, median_seconds  # noqa: E402

from glm_dsa.budget import Budgets  # noqa: E402
from glm_dsa.config import PRESETS  # noqa: E402
from glm_dsa.ledger import op_flops  # noqa: E402
from glm_dsa.moe import MoE, combine_experts, swiglu  # noqa: E402

GLM = PRESETS["glm-5.3"]
GB = 1e9


def _load_before(path: str, cfg, moe: MoE) -> torch.nn.Module:
    """The ``MoE`` of the file at ``path``, holding ``moe``'s own parameters (no copy)."""
    spec = importlib.util.spec_from_file_location("moe_before", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with torch.device("meta"):
        before = module.MoE(cfg)
    for name, param in moe.named_parameters():
        owner_name, _, leaf = name.rpartition(".")
        setattr(before.get_submodule(owner_name), leaf, param)
    return before


def _kernel_checks() -> dict:
    """The Triton SwiGLU and combine against their torch forms on GLM-5.3-sized rows."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    gate_up = torch.randn(4096, 4096, device="cuda", generator=gen).bfloat16() * 4
    gate, up = gate_up.chunk(2, dim=-1)
    fused = swiglu(gate, up, torch.bfloat16)
    ref = (torch.nn.functional.silu(gate.float()) * up.float()).bfloat16()
    expert_out = torch.randn(8192, 6144, device="cuda", generator=gen).bfloat16()
    position = torch.randperm(8192, device="cuda", generator=gen).view(1024, 8).sort(dim=1).values
    weights = torch.rand(1024, 8, device="cuda", generator=gen)
    shared = torch.randn(1024, 6144, device="cuda", generator=gen).bfloat16()
    mask = torch.rand(1024, device="cuda", generator=gen) < 0.9
    got = combine_experts(expert_out, position, weights, shared, mask)
    acc = torch.zeros(1024, 6144, device="cuda")
    for j in range(8):
        acc += expert_out[position[:, j]].float() * weights[:, j, None]
    want = ((acc + shared.float()) * mask[:, None]).bfloat16()
    return {"swiglu_bitwise": bool(torch.equal(fused, ref)),
            "swiglu_max_abs_diff": float((fused.float() - ref.float()).abs().max()),
            "swiglu_differing_fraction": float((fused != ref).float().mean()),
            "combine_bitwise": bool(torch.equal(got, want))}


def _graph_check(moe: MoE, x: torch.Tensor, budget: int) -> dict:
    """No host synchronisation in a call, and a CUDA graph of it replaying the eager result."""
    out: dict = {}
    torch.cuda.set_sync_debug_mode("error")
    try:
        eager = moe(x, budget_bytes=budget)
        out["sync_free"] = True
    except RuntimeError as e:
        out["sync_free"], out["sync_error"] = False, str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
    eager = moe(x, budget_bytes=budget)
    try:
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            moe(x, budget_bytes=budget)  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = moe(x, budget_bytes=budget)
        graph.replay()
        torch.cuda.synchronize()
        out["graph_replay_bitwise"] = bool(torch.equal(captured[0], eager[0])
                                           and torch.equal(captured[1], eager[1]))
        out["graph_replay_seconds"] = median_seconds(graph.replay, warmup=1, reps=5)
    except RuntimeError as e:
        out["graph_error"] = str(e).splitlines()[0]
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default="2048,32768")
    ap.add_argument("--budget-bytes", type=int, default=None,
                    help="the MoE budget (default: glm_dsa.budget.Budgets.default on the GPU)")
    ap.add_argument("--before", default=None, help="an earlier tree's moe.py, timed beside")
    ap.add_argument("--profile-tokens", default="32768", help="lengths to profile ('' for none)")
    args = ap.parse_args()
    if not os.path.isdir(args.out):
        ap.error(f"--out {args.out} is not a directory; create it first")
    budget = args.budget_bytes or Budgets.default("cuda").moe_bytes
    res: dict = {"date": datetime.date.today().isoformat(), "gpu": torch.cuda.get_device_name(),
                 "torch": torch.__version__, "command": "python " + " ".join(sys.argv),
                 "moe_budget_bytes": budget, "rows": []}

    def save() -> None:
        with open(os.path.join(args.out, "bench_moe.json"), "w") as f:
            json.dump(res, f, indent=2)

    res["ceilings"] = ceil = ceilings()
    print("ceilings", json.dumps(ceil), flush=True)
    cfg = GLM
    moe = random_moe(cfg)
    weight_bytes = sum(p.numel() * p.element_size() for p in moe.parameters())
    # The copy rate counts the bytes read and written: reading the weights once moves their bytes.
    read_floor = weight_bytes / ceil["copy_bytes_per_s"]
    before = _load_before(args.before, cfg, moe) if args.before else None
    f = {op.op: op.flops_per_token for op in op_flops(cfg)}
    try:
        res["kernels"] = _kernel_checks()
    except Exception as e:  # report and go on to the timings
        res["kernels"] = {"error": f"{type(e).__name__}: {e}"}
    print("kernels", json.dumps(res["kernels"]), flush=True)
    save()
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for tokens in map(int, args.tokens.split(",")):
            x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            flops = tokens * (f["moe_experts"] + f["shared_experts"] + f["router_gate"])
            row = {"tokens": tokens, "block_rows": moe.block_rows(tokens, x.dtype, x.device, budget),
                   "weight_gb": weight_bytes / GB, "weight_read_floor_s": read_floor,
                   "flop_floor_s": flops / ceil["bf16_flops_per_s"]}
            for name, module, kwargs in (("now", moe, {"budget_bytes": budget}), ("before", before, {})):
                if module is None:
                    continue
                t = median_seconds(lambda: module(x, **kwargs), warmup=1, reps=3)
                torch.cuda.empty_cache()
                _, held, peak = _peak(lambda: module(x, **kwargs))
                row[name] = {"seconds": t, "tflops": flops / t / 1e12,
                             "transient_gb": (peak - held) / GB,
                             "x_weight_floor": t / max(read_floor, row["flop_floor_s"])}
            if before is not None:
                a, ca = moe(x, budget_bytes=budget)
                b, cb = before(x)
                row["calc_diff_vs_before"] = calc_diff(a, b)
                row["counts_equal_before"] = bool(torch.equal(ca, cb))
                del a, b
            print("moe", json.dumps(row), flush=True)
            res["rows"].append(row)
            save()
            del x
            torch.cuda.empty_cache()
        x = torch.randn(2048, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
        try:
            res["graph"] = _graph_check(moe, x, budget)
        except Exception as e:  # report and go on to the profile
            res["graph"] = {"error": f"{type(e).__name__}: {e}"}
        print("graph", json.dumps(res["graph"]), flush=True)
        save()
        for tokens in [int(t) for t in args.profile_tokens.split(",") if t]:
            from torch.profiler import ProfilerActivity, profile

            x = torch.randn(tokens, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=gen)
            moe(x, budget_bytes=budget)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                moe(x, budget_bytes=budget)
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=70)
            with open(os.path.join(args.out, f"profile_moe_{tokens}.txt"), "w") as fh:
                fh.write(table)
            print("\n".join(table.splitlines()[:22]), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
