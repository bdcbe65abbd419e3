"""Offline sm_90 compiles of the Triton logits and candidate kernels: registers, spills, and the
SASS instructions of the key-tile loop (one thread, one key tile), for two trees of
``glm_dsa/kernels/mqa_logits.py``. No GPU: Triton 3.6 (the H200's) compiles for
``GPUTarget("cuda", 90, 32)``, its bundled ptxas assembles, cuobjdump disassembles.

Usage (a Triton 3.6 venv, its nvidia bin on PATH, TRITON_INTERPRET unset; the tree before
with its own ``order_keys``):
    git show 7713308:glm_dsa/kernels/topk.py > /tmp/old_topk.py
    git show 7713308:glm_dsa/kernels/mqa_logits.py \
        | sed 's/from glm_dsa.kernels.topk import/from old_topk import/' > /tmp/old_mqa_logits.py
    PYTHONPATH=.:/tmp python bench/probes/2026-12-04-offline-logits-loop.py \
        before=/tmp/old_mqa_logits.py after=glm_dsa/kernels/mqa_logits.py

The loop is the longest backward branch of the kernel; its count is static (every instruction
of the body once), which for these bodies (no branch but the atomics' per-lane guards) is what
a thread issues per key tile. A figure to compare epilogues with, not a time.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BASE_SIG = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "w_ptr": "*fp32",
            "ks_ptr": "*i32", "ke_ptr": "*i32"}
LOGITS_SIG = {**BASE_SIG, "out_ptr": "*fp32", "S": "i32", "n_keys": "i32", "n_out": "i32",
              "out_stride": "i32", "size_class": "i32"}
CAND_SIG = {**BASE_SIG, "thr_ptr": "*fp32", "cand_key_ptr": "*i32", "cand_idx_ptr": "*i32",
            "counters_ptr": "*i32", "S": "i32", "n_keys": "i32", "size_class": "i32", "cand": "i32"}


def _module(name: str, path: str):
    spec = importlib.util.spec_from_file_location(f"mqa_logits_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def _loop(sass: str) -> Counter:
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.match(r"\s+/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    spans = []
    for a, ln in zip(addr, lines):
        m = re.search(r"BRA (?:`\(\.L_x_\d+\) )?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < a:
            spans.append((int(m.group(1), 16), a))
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0]
           for a, ln in zip(addr, lines) if lo <= a <= hi]
    return Counter(op.split(".")[0] for op in ops)


def _compile(kernel, sig: dict, consts: dict, num_warps: int, num_stages: int, tmp: Path):
    full = {**sig, **{n: "constexpr" for n in consts}}
    order = list(full)
    if order != list(kernel.arg_names):
        raise RuntimeError(f"signature {order} is not the kernel's {list(kernel.arg_names)}")
    aligned = [n for n in sig if n.endswith("_ptr")] + [n for n in ("out_stride", "cand") if n in sig]
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
    return regs, spill, _loop(sass)


def main(argv: list[str]) -> None:
    trees = dict(a.split("=", 1) for a in argv)
    print("| tree | kernel | H | BLOCK_Q × BLOCK_N, warps, stages, lag | registers | spill B "
          "| loop instr. | FMNMX+FFMA | SHFL | BAR |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as d:
        for name, path in trees.items():
            ml = _module(name, path)
            for H in (32, 64):
                hp = 1 << (H - 1).bit_length()
                jobs = [(ml._mqa_logits_kernel, LOGITS_SIG, c, {"CLEAN": False, "COMPRESSED": False})
                        for c in ml.CONFIGS]
                epilogue = ({"PTX_EPILOGUE": ml._PTX_EPILOGUE}
                            if "PTX_EPILOGUE" in ml._mqa_candidates_kernel.arg_names else {})
                jobs += [(ml._mqa_candidates_kernel, CAND_SIG, c,
                          {"STORE_LAG": c["STORE_LAG"]} if "STORE_LAG" in c else epilogue)
                         for c in ml.CANDIDATE_CONFIGS]
                for kernel, sig, c, extra in jobs:
                    consts = {"H": H, "D": 128, "HP": hp, "DP": 128, **extra,
                              "BLOCK_Q": c["BLOCK_Q"], "BLOCK_N": c["BLOCK_N"]}
                    if "STORE_LAG" in extra:  # the kernel's last constexpr
                        consts["STORE_LAG"] = consts.pop("STORE_LAG")
                    regs, spill, ops = _compile(kernel, sig, consts, c["num_warps"],
                                                c["num_stages"], Path(d))
                    print(f"| {name} | {kernel.__name__.strip('_')} | {H} | {c['BLOCK_Q']} × "
                          f"{c['BLOCK_N']}, {c['num_warps']}, {c['num_stages']}, "
                          f"{c.get('STORE_LAG', '-')} | {regs} | {spill} | {sum(ops.values())} | "
                          f"{ops['FMNMX'] + ops['FFMA']} | {ops['SHFL']} | {ops['BAR']} |", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
