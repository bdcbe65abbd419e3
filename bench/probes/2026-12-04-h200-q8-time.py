"""Issue 42, run A: the Gluon Q8KV8 kernel (helper q8g) timed beside FlashMLA's bf16 sparse prefill
on the same inputs (16,384 queries x top-2048 over 131,072 keys; q, kv randn/10 quantized per
tensor; FlashMLA on their bf16 dequantization). Prints one line per form; FLOPs
2 * s_q * topk * h_q * (576 + 512)."""
import sys

import torch

from glm_dsa import peers
from glm_dsa.kernels import sparse_mla_q8kv8_gluon as m
from glm_dsa.testing.cases import per_tensor_fp8 as p8

S, T, N, SC = 16384, 2048, 131072, 1 / 16
torch.manual_seed(0)
kv, ks = p8(torch.randn(N, 1, 576, device="cuda") / 10)
idx = torch.randint(0, N, (S, 1, T), device="cuda", dtype=torch.int32)


def tm(fn, n=5):
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(True), torch.cuda.Event(True)
    a.record()
    for _ in range(n):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / n / 1e3


cfgs = [{}] + [eval(c) for c in sys.argv[1:]]
for h in (64, 128):
    q, qs = p8(torch.randn(S, h, 576, device="cuda") / 10)
    fl = 2 * S * T * h * 1088
    for cfg in cfgs:
        base = dict(m.CONFIG)
        m.CONFIG.update(cfg)
        try:
            t = tm(lambda: m.sparse_mla_q8kv8_fwd_gluon(q, kv, 576, N, idx, SC, qs, ks, None, None))
            print(f"q8kv8 gluon h_q={h} {cfg or 'CONFIG'}: {t*1e3:.2f} ms {fl/t/1e12:.0f} TFLOP/s", flush=True)
        except Exception as e:  # one failure is recorded, the rest still run
            print(f"q8kv8 gluon h_q={h} {cfg}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
        m.CONFIG.clear()
        m.CONFIG.update(base)
    if peers.available(peers.FLASH_MLA):
        qb, kb = (q.float() * qs).bfloat16(), (kv.float() * ks).bfloat16()
        t = tm(lambda: peers.flash_mla_sparse_fwd(qb, kb, idx, SC, 512))
        print(f"FlashMLA bf16 h_q={h}: {t*1e3:.2f} ms {fl/t/1e12:.0f} TFLOP/s", flush=True)
