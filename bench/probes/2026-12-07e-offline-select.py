"""Issue 43 (fifth session): offline sm_90 compiles (Triton 3.6, the H200's; no GPU) of the
kernels the host-plan change added or touched: the windows kernel, the candidate kernel with its
window split (the shipped tiles), and the candidate select at 8- to 4-bit radix digits (its
4,096-key block as before) —
registers, spills, and the select's SASS: all instructions, warp votes (the histogram's
ballots), popcounts and shared-memory atomics, each round's block loop (the loops' bodies, as
``2026-12-04-offline-logits-loop.py`` counts them). Static counts, not times.

    PATH=/tmp/t36/lib/python3.11/site-packages/triton/backends/nvidia/bin:$PATH \\
        PYTHONPATH=. /tmp/t36/bin/python bench/probes/2026-12-07e-offline-select.py
"""
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from glm_dsa.kernels import indexer, mqa_logits, topk


def compile_(kernel, sig, consts, num_warps, num_stages, tmp):
    full = {**sig, **{n: "constexpr" for n in consts}}
    order = list(full)
    assert order == list(kernel.arg_names), (order, kernel.arg_names)
    aligned = [n for n in sig if n.endswith("_ptr")]
    src = ASTSource(kernel, full, {(order.index(n),): v for n, v in consts.items()},
                    attrs={(order.index(n),): [["tt.divisibility", 16]] for n in aligned})
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": num_warps, "num_stages": num_stages})
    ptx, cubin = tmp / "k.ptx", tmp / "k.cubin"
    ptx.write_text(out.asm["ptx"])
    err = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                         capture_output=True, text=True, check=True).stderr
    sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True,
                          check=True).stdout
    regs = int(re.findall(r"Used (\d+) registers", err)[0])
    spill = int(re.findall(r"(\d+) bytes spill stores", err)[0])
    return regs, spill, sass


def ops(sass):
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/", ln)]
    names = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0].split(".")[0]
             for ln in lines]
    return lines, Counter(names)


def loops(lines):
    """Instruction counts of the backward branches' bodies (the loops), longest first."""
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4,})\*/", ln).group(1), 16) for ln in lines]
    spans = []
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            spans.append(sum(1 for b in addr if int(m.group(1), 16) <= b <= a))
    return sorted(spans, reverse=True)


SELECT_SIG = {"cand_key_ptr": "*i32", "cand_idx_ptr": "*i32", "counters_ptr": "*i32",
              "lens_ptr": "*i32", "out_ptr": "*i32", "redo_ptr": "*i32", "topk": "i32",
              "cand": "i32"}
WINDOWS_SIG = {"ks_ptr": "*i32", "ke_ptr": "*i32", "win_ptr": "*i32", "counters_ptr": "*i32",
               "R": "i32", "topk": "i32", "cand": "i32", "stride": "i32"}
CAND_SIG = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "w_ptr": "*fp32",
            "ks_ptr": "*i32", "ke_ptr": "*i32", "thr_ptr": "*fp32", "cand_key_ptr": "*i32",
            "cand_idx_ptr": "*i32", "counters_ptr": "*i32", "S": "i32", "n_keys": "i32",
            "size_class": "i32", "cand": "i32"}

with tempfile.TemporaryDirectory() as d:
    tmp = Path(d)
    print("| kernel | registers | spill B | instructions | VOTE | POPC | ATOMS | loop bodies |")
    print("|---|---|---|---|---|---|---|---|")
    jobs = [("windows", indexer._windows_kernel, WINDOWS_SIG, {"BLOCK": 1024}, 4, 1)]
    for c in mqa_logits.CANDIDATE_CONFIGS:
        consts = {"H": 32, "D": 128, "HP": 32, "DP": 128, "BLOCK_Q": c["BLOCK_Q"],
                  "BLOCK_N": c["BLOCK_N"], "STORE_LAG": c["STORE_LAG"]}
        jobs.append((f"candidates {c['BLOCK_Q']}x{c['BLOCK_N']} lag {c['STORE_LAG']}",
                     mqa_logits._mqa_candidates_kernel, CAND_SIG, consts, c["num_warps"],
                     c["num_stages"]))
    for digit in (8, 7, 6, 5, 4):
        jobs.append((f"select, {digit}-bit digits", topk._select_candidates_kernel, SELECT_SIG,
                     {"BLOCK": topk.BLOCK, "TOPK": 2048, "DIGIT": digit}, topk.NUM_WARPS, 1))
    for name, kernel, sig, consts, warps, stages in jobs:
        regs, spill, sass = compile_(kernel, sig, consts, warps, stages, tmp)
        lines, c = ops(sass)
        print(f"| {name} | {regs} | {spill} | {len(lines)} | {c['VOTE']} | {c['POPC']} | "
              f"{c['ATOMS']} | {loops(lines)} |", flush=True)
