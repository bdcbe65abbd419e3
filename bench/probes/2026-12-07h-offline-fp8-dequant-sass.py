"""Issue 42 (eighth session; the eleventh's patch): offline sm_90 SASS (Triton 3.6, no GPU) of
the FP8-row Gluon kernel's gather loop, per ``fp8_form`` and ``fp8_dequant`` (the latter needs
``bench/probes/2026-12-08-fp8-dequant.patch``; without it only "float" exists): the loop's
instructions per thread and 64-key tile, its conversions (F2FP), the float32 path's HADD2.F32 /
FMUL, the integer path's PRMT / LOP3 / shifts / HMUL2, partition barriers, local-memory
accesses, and ptxas's spill bytes. Static counts, not times. The gather loop is the smallest
backward branch holding the tile's 32 dequantizing ``STS.128``.

    PATH=/tmp/t36/lib/python3.11/site-packages/triton/backends/nvidia/bin:$PATH \\
        PYTHONPATH=. /tmp/t36/bin/python bench/probes/2026-12-07h-offline-fp8-dequant-sass.py

(``/tmp/t36``: ``python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
torch==2.11.0 einops safetensors numpy tqdm``.) Per thread and tile, HEAD 454441b, then with
the patch (eleventh session):

| tree | form, dequant | loop | F2FP | HADD2.F32 | FMUL | PRMT | LOP3 | shifts | HMUL2 | BAR.SYNC | LDL/STL | spill B |
|---|---|---|---|---|---|---|---|---|---|---|---|---|
| HEAD | in_place, float | 1,081 | 256 | 256 | 256 | 0 | 3 | 12 | 0 | 19 | 0 | 0 |
| HEAD | ring, float | 1,156 | 256 | 256 | 256 | 0 | 4 | 19 | 0 | 11 | 0 | 0 |
| patch | in_place, float | 1,043 | 256 | 256 | 256 | 0 | 3 | 12 | 0 | 8 | 0 | 0 |
| patch | in_place, pow2 | 799 | 4 | 0 | 8 | 128 | 131 | 140 | 128 | 8 | 0 | 0 |
| patch | in_place, auto | 1,693 (both paths) | 260 | 256 | 264 | 128 | 147 | 149 | 128 | 14 | 3 | 16 |
| patch | ring, float | 1,156 | 256 | 256 | 256 | 0 | 4 | 19 | 0 | 11 | 0 | 0 |
| patch | ring, pow2 | 924 | 8 | 0 | 16 | 128 | 132 | 146 | 128 | 11 | 0 | 0 |
| patch | ring, auto | 1,805 (both paths) | 264 | 256 | 272 | 128 | 138 | 148 | 128 | 19 | 3 | 16 |

HEAD's in-place loop has 19 partition barriers against the bf16 gather's 2: 7 between its 8
chunk copies into the raw stage and 3 between its 4 stores into ``w_l``, i.e. between accesses
to slices of one allocation, which Triton's barrier analysis does not tell apart; 2 are the
kernel's own (``_dequantize_in_place``). The patch copies a tile in one op and stores two chunks
an op (``bench/probes/2026-12-08-fp8-dequant.py``'s docstring).
"""
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "2026-12-04-offline-sparse-mla-sass"))
from parse import loops, opcode  # noqa: E402

from glm_dsa.kernels import sparse_mla_gluon as g  # noqa: E402


def sass_and_spills(form: str, dequant: str) -> tuple[list, int]:
    g.CONFIG["fp8_dequant"] = dequant
    c = g.compile_sm90(has_sink=False, has_len=False, fp8=True, schedule="split", fp8_form=form)
    with tempfile.TemporaryDirectory() as d:
        ptx, cubin = Path(d) / "k.ptx", Path(d) / "k.cubin"
        ptx.write_text(c.asm["ptx"])
        err = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o", str(cubin)],
                             capture_output=True, text=True, check=True).stderr
        text = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    return ins, sum(int(n) for n in re.findall(r"(\d+) bytes spill stores", err))


def main():
    modes = ("float", "pow2", "auto") if "fp8_dequant" in g.CONFIG else ("float",)
    print("| form, dequant | loop | F2FP | HADD2.F32 | FMUL | PRMT | LOP3 | shifts | HMUL2 | "
          "BAR.SYNC | LDL/STL | spill B |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for form in ("in_place", "ring"):
        for dequant in modes:
            ins, spill = sass_and_spills(form, dequant)
            body = min((b for b in ([(x, s) for x, s in ins if tg <= x <= a]
                                    for tg, a, _ in loops(ins))
                        if sum("STS.128" in s for _, s in b) >= 32), key=len)
            c = collections.Counter(opcode(s) for _, s in body)

            def n(*names):
                return sum(k for op, k in c.items() if any(op == p or op.startswith(p + ".")
                                                           for p in names))

            print(f"| {form}, {dequant} | {len(body)} | {n('F2FP')} | {c['HADD2.F32']} | "
                  f"{n('FMUL')} | {n('PRMT')} | {n('LOP3')} | {c['IMAD.SHL.U32'] + n('SHF')} | "
                  f"{n('HMUL2')} | {n('BAR.SYNC')} | {n('LDL') + n('STL')} | {spill} |")


if __name__ == "__main__":
    main()
