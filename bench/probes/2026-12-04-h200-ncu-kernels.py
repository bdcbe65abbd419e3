"""Issues 42, 43 (run C): one launch of each kernel whose target was missed, for Nsight Compute
(`ncu -k regex:... --launch-skip 1 --launch-count 1`): the Gluon sparse MLA (bf16 split, FP8
rows), the Gluon Q8KV8 kernel, 4,096 queries x top-2048 over 131,072 keys, h_q 64, and the
Gluon indexer logits at 4,096 x 131,072, H 32. Each runs twice (the first compiles)."""
import sys

import torch

from glm_dsa import oracle
from glm_dsa.kernels.mqa_logits_gluon import launch_mqa_logits_gluon
from glm_dsa.kernels.sparse_mla_gluon import flash_mla_sparse_fwd_gluon
from glm_dsa.kernels.sparse_mla_q8kv8_gluon import sparse_mla_q8kv8_fwd_gluon
from glm_dsa.testing.cases import per_tensor_fp8

S, T, N, H = 4096, 2048, 131072, 64
torch.manual_seed(0)
g = torch.Generator(device="cuda").manual_seed(0)
idx = torch.randint(0, N, (S, 1, T), device="cuda", dtype=torch.int32, generator=g)
q = (torch.randn(S, H, 576, device="cuda", generator=g) / 10).bfloat16()
kv = (torch.randn(N, 1, 576, device="cuda", generator=g) / 10).bfloat16()
rows = oracle.quantize_k_cache(kv.view(-1, 64, 1, 576)).view(-1, oracle.MLA_ROW_BYTES)
q8, qs = per_tensor_fp8(q.float())
kv8, ks = per_tensor_fp8(kv.float())
lq = torch.randn(S, 32, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
lk = torch.randn(N, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
lks = torch.rand(N, device="cuda", generator=g) + 0.25
lw = torch.randn(S, 32, device="cuda", generator=g) * 32**-0.5
lstart = torch.zeros(S, dtype=torch.int32, device="cuda")
lend = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device="cuda")
forms = {
    "bf16": lambda: flash_mla_sparse_fwd_gluon(q, kv, 576, N, idx, 1 / 16, None, None),
    "fp8rows": lambda: flash_mla_sparse_fwd_gluon(q, rows, oracle.MLA_ROW_BYTES, N, idx, 1 / 16,
                                                  None, None, fp8=True),
    "q8kv8": lambda: sparse_mla_q8kv8_fwd_gluon(q8, kv8, 576, N, idx, 1 / 16, qs, ks, None, None),
    "logits_gluon": lambda: launch_mqa_logits_gluon(lq, lk, lks, lw, lstart, lend, True, 0),
}
for name in sys.argv[1:] or forms:
    for _ in range(2):
        forms[name]()
    torch.cuda.synchronize()
    print(name, "ran", flush=True)
