"""Issue 42 (run M): one launch of each sparse MLA kernel for Nsight Compute's stall reasons
(`ncu -k regex:NAME --launch-skip 1 --launch-count 1 --metrics regex:...stalled...`): our Gluon
kernel at h_q 64 (the split schedule) and 128 (the seesaw), its FP8-row forms (ring, in place), and FlashMLA
9241ae3's sparse prefill at both head counts, on the same inputs: 4,096 queries, top-2048 of
131,072 keys, uniform indices. Each form runs twice (the first compiles). Argument: the forms."""
import sys

import torch

from glm_dsa import oracle
from glm_dsa.kernels.sparse_mla_gluon import flash_mla_sparse_fwd_gluon

S, T, N = 4096, 2048, 131072
g = torch.Generator(device="cuda").manual_seed(0)
idx = torch.randint(0, N, (S, 1, T), device="cuda", dtype=torch.int32, generator=g)
kv = (torch.randn(N, 1, 576, device="cuda", generator=g) / 10).bfloat16()
rows = oracle.quantize_k_cache(kv.view(-1, 64, 1, 576)).view(-1, oracle.MLA_ROW_BYTES)
q = {h: (torch.randn(S, h, 576, device="cuda", generator=g) / 10).bfloat16() for h in (64, 128)}


def flashmla(h):
    import flash_mla_sparse_sm90

    return flash_mla_sparse_sm90.sparse_prefill_fwd(q[h], kv, idx, 1 / 16, 512, None, None)


forms = {
    "gluon_h64": lambda: flash_mla_sparse_fwd_gluon(q[64], kv, 576, N, idx, 1 / 16, None, None),
    "gluon_h128": lambda: flash_mla_sparse_fwd_gluon(q[128], kv, 576, N, idx, 1 / 16, None, None),
    "gluon_fp8_ring_h64": lambda: flash_mla_sparse_fwd_gluon(
        q[64], rows, oracle.MLA_ROW_BYTES, N, idx, 1 / 16, None, None, {"fp8_form": "ring"},
        fp8=True),
    "gluon_fp8_in_place_h64": lambda: flash_mla_sparse_fwd_gluon(
        q[64], rows, oracle.MLA_ROW_BYTES, N, idx, 1 / 16, None, None, {"fp8_form": "in_place"},
        fp8=True),
    "flashmla_h64": lambda: flashmla(64),
    "flashmla_h128": lambda: flashmla(128),
}
for name in sys.argv[1:] or forms:
    for _ in range(2):
        forms[name]()
    torch.cuda.synchronize()
    print(name, "ran", flush=True)
