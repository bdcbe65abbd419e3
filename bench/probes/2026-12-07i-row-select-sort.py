"""Issue 43 (ninth session): the row select (``launch_select``, the peers composition's select
over DeepGEMM's logits and the redone rows') with its ascending sort as ``_sort_rows_kernel``
(one warp a row; ``bench/probes/2026-12-07i-row-select-sort.patch``) against HEAD's, which
sorts a candidate row inside the select's 8-warp program (``_emit(SORT=True)``, which the patch
removes with the near-copy of the sort it held). On the CPU the patched tree passes the whole
suite (2,073 passed, 352 skipped; under the interpreter candidate buffers fill in column order,
so only a GPU run can show the sort missing: the top-k file's CUDA tests check the order).

Run S8a measured the candidate select's sort moved the same way: 0.915 -> 0.807 ms at 4,096 x
131,072. Here: float32 logits ``[S, N]`` (normal, seeded), causal windows ``[0, N - S + 1 + r)``;
CUDA-event medians of 20 after 3, the two outputs compared bitwise.

    git show HEAD:glm_dsa/kernels/topk.py > /tmp/topk_head.py
    git apply bench/probes/2026-12-07i-row-select-sort.patch
    python bench/probes/2026-12-07i-row-select-sort.py /tmp/topk_head.py
"""
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from benchlib import median_seconds  # noqa: E402

from glm_dsa.kernels import topk as new  # noqa: E402

TOPK = 2048


def main():
    spec = importlib.util.spec_from_file_location("topk_old", sys.argv[1])
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    print("| rows x columns | HEAD ms | this tree ms | ratio | same bits |")
    print("|---|---|---|---|---|")
    for S, N in ((4096, 131072), (1477, 1015808)):
        g = torch.Generator(device="cuda").manual_seed(S)
        logits = torch.randn(S, N, generator=g, device="cuda")
        ends = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device="cuda")
        starts = torch.zeros(S, dtype=torch.int32, device="cuda")
        a = old.launch_select(logits, starts, ends, TOPK)[0]
        b = new.launch_select(logits, starts, ends, TOPK)[0]
        same = torch.equal(a, b) and bool((b[:, 1:] > b[:, :-1]).all())
        t_old = median_seconds(lambda: old.launch_select(logits, starts, ends, TOPK), warmup=3,
                               reps=20) * 1e3
        t_new = median_seconds(lambda: new.launch_select(logits, starts, ends, TOPK), warmup=3,
                               reps=20) * 1e3
        print(f"| {S:,} x {N:,} | {t_old:.3f} | {t_new:.3f} | {t_new / t_old:.3f} | {same} |",
              flush=True)
        del logits


if __name__ == "__main__":
    main()
