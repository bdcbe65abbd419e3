"""Per-loop SASS opcode counts of the sparse MLA kernels, compiled for sm_90 with no GPU.

Compares the softmax with ``sm_scale · log2 e`` folded into the exponent's FFMA (this tree)
against the form that scales every score first (the tree on PYTHONPATH). Usage, once per tree:

    PATH=<triton 3.6>/backends/nvidia/bin:$PATH env -u TRITON_INTERPRET \
        PYTHONPATH=<tree>:<triton 3.6 site-packages> python fold_counts.py <label>

Prints, for each kernel form, every loop of the compiled function with its instruction total
and its FMUL / FADD / FFMA / MUFU.EX2 counts (the loops are the softmax's per-tile bodies and
the gather warpgroups' per-tile loops: the FP8 forms' dequantization is the one with 256 FMUL).
"""
import collections
import inspect
import subprocess
import sys
import tempfile
from pathlib import Path

# The SASS parser of the 2026-12-04 probe, reused as it is.
sys.path.insert(0, str(Path(__file__).parents[1] / "2026-12-04-offline-sparse-mla-sass"))
from parse import load, loops, opcode  # noqa: E402

from glm_dsa.kernels import sparse_mla_gluon, sparse_mla_q8kv8_gluon  # noqa: E402

RING = ({"fp8_form": "ring"}
        if "fp8_form" in inspect.signature(sparse_mla_gluon.compile_sm90).parameters else {})

FORMS = {
    "split_h64": lambda: sparse_mla_gluon.compile_sm90(False, False, schedule="split", h_q=64),
    "seesaw_h128": lambda: sparse_mla_gluon.compile_sm90(False, False, schedule="seesaw", h_q=128),
    # The ring form by name where the tree has two (the in-place form is the default now).
    "fp8rows_h64": lambda: sparse_mla_gluon.compile_sm90(False, False, fp8=True, h_q=64, **RING),
    "fp8rows_in_place_h64": lambda: sparse_mla_gluon.compile_sm90(False, False, fp8=True, h_q=64,
                                                                  fp8_form="in_place"),
    "q8kv8": lambda: sparse_mla_q8kv8_gluon.compile_sm90(False, False),
}
OPS = ("FMUL", "FADD", "FFMA", "MUFU.EX2")


def main(label: str) -> None:
    tmp = Path(tempfile.mkdtemp())
    for name, build in FORMS.items():
        cubin = tmp / f"{name}.cubin"
        try:
            cubin.write_bytes(build().asm["cubin"])
        except TypeError:  # a form this tree does not have (fp8_form came after the fold)
            print(f"{label} {name} not in this tree")
            continue
        sass = tmp / f"{name}.sass"
        sass.write_text(subprocess.run(["cuobjdump", "-sass", str(cubin)], check=True,
                                       capture_output=True, text=True).stdout)
        for fn, ins in load(str(sass)).items():
            spans = [(lo, hi) for lo, hi, _ in loops(ins)]
            # Innermost loops only (an outer back edge spans the partitions' dispatch).
            inner = [(lo, hi) for lo, hi in spans
                     if not any((lo, hi) != o and lo <= o[0] and o[1] <= hi for o in spans)]
            for lo, hi in sorted(set(inner)):
                body = [opcode(t) for a, t in ins if lo <= a <= hi]
                if len(body) < 200:  # the copy and barrier loops, not a softmax body
                    continue
                c = collections.Counter(body)
                counts = " ".join(f"{op}={sum(n for k, n in c.items() if k == op or k.startswith(op + '.'))}"
                                  for op in OPS)
                print(f"{label} {name} loop {lo:#x}-{hi:#x} total={len(body)} {counts}")


if __name__ == "__main__":
    main(sys.argv[1])
