"""Smoke: each Gluon logits schedule of issue 43's lg4 run on small shapes against the oracle
(no hang, right answer), before the timed runs. One line a (schedule, shape)."""
import json, sys, time, torch
sys.path.insert(0, ".")
from glm_dsa import oracle
from glm_dsa.kernels.mqa_logits_gluon import launch_mqa_logits_gluon
for cfg in json.loads(sys.argv[1]):
    for S, H, N in [(37, 32, 300), (64, 64, 5000), (9, 16, 70001)]:
        g = torch.Generator(device="cuda").manual_seed(S)
        q = torch.randn(S, H, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        k = torch.randn(N, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        ks_ = torch.rand(N, device="cuda", generator=g) + 0.25
        w = torch.randn(S, H, device="cuda", generator=g) * H ** -0.5
        ks = torch.randint(0, N // 2, (S,), device="cuda", generator=g).int()
        ke = torch.minimum(ks + torch.randint(0, N, (S,), device="cuda", generator=g).int(),
                           torch.tensor(N, device="cuda")).int()
        t = time.time()
        out = launch_mqa_logits_gluon(q, k, ks_, w, ks, ke, True, 0, cfg)
        torch.cuda.synchronize()
        ref = oracle.fp8_mqa_logits(q, (k, ks_), w, ks, ke)
        m = torch.isneginf(ref)
        print(cfg, S, H, N, "masks", bool(torch.equal(torch.isneginf(out), m)), "diff",
              oracle.calc_diff(out.masked_fill(m, 0), ref.masked_fill(m, 0)),
              f"{time.time() - t:.1f}s", flush=True)
