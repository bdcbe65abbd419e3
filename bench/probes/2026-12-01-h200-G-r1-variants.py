# The timing driver of helper G's rounds R1 and R1b (run from a scratch/ folder of the tree, as
# bench/logs/2026-12-01-h200-G-r*.log show). Its variant modules were the Gluon module at these
# commits: _v1_scratch = d756123 (both warpgroups score each tile), _v2r1 = faf940f (R1's v2),
# _v2k32 = a3c3eef with BLOCK_K 32, 4 stages and P reinterpreted over the RoPE block.
"""R1 scratch (not committed): Gluon v2 (main module) and v1 (scratch) correctness + timing beside FlashMLA."""
import importlib.util, sys, time, json, os, traceback
import torch
from glm_dsa import oracle
from glm_dsa.testing.metrics import SPARSE_OUT_TOL, SPARSE_STAT_TOL
import glm_dsa.kernels.sparse_mla_gluon as v2
sys.path.insert(0, "scratch"); import _v1_scratch as v1; import _v2r1 as v2r1; import _v2k32 as v2k32
spec = importlib.util.spec_from_file_location("bench", "scripts/bench_sparse_mla.py")
bench = importlib.util.module_from_spec(spec); spec.loader.exec_module(bench)
try:
    import flash_mla_sparse_sm90 as fm
except ImportError:
    fm = None
RES = os.environ.get("RES", "/tmp")
out = {}
def fp8_rows(kv):
    s_kv = kv.shape[0]
    pad = torch.zeros((-s_kv) % 64, 1, 576, dtype=kv.dtype, device=kv.device)
    pages = oracle.quantize_k_cache(torch.cat([kv, pad]).view(-1, 64, 1, 576))
    return pages.view(-1, 656)[:s_kv], oracle.dequantize_k_cache(pages).view(-1, 1, 576)[:s_kv]

def smoke(name, mod):
    fp8 = name.endswith("fp8")
    torch.manual_seed(0)
    ok_all = True
    for h, s_q, s_kv, topk, sink, ln in [(64, 64, 8192, 2048, False, False), (128, 33, 3000, 512, True, True), (64, 5, 100, 100, False, True), (64, 3, 50, 64, True, False)]:
        q = (torch.randn(s_q, h, 576, device="cuda") / 10).bfloat16()
        kv = (torch.randn(s_kv, 1, 576, device="cuda") / 10).bfloat16()
        idx = torch.randint(0, s_kv, (s_q, 1, topk), device="cuda", dtype=torch.int32)
        idx[0, 0, 3:9] = torch.tensor([-2**31, -123456, -1, s_kv, s_kv + 55, 2**31 - 1], device="cuda")
        idx[1] = -1
        snk = torch.randn(h, device="cuda") if sink else None
        lens = torch.randint(0, topk + 1, (s_q,), device="cuda", dtype=torch.int32) if ln else None
        t0 = time.time()
        if fp8:
            rows, kv = fp8_rows(kv)
            got = mod.flash_mla_sparse_fwd_gluon(q, rows, 656, s_kv, idx, 1 / 16, snk, lens, fp8=True)
        else:
            got = mod.flash_mla_sparse_fwd_gluon(q, kv, 576, s_kv, idx, 1 / 16, snk, lens)
        torch.cuda.synchronize(); t1 = time.time()
        want = oracle.flash_mla_sparse_fwd(q.double(), kv.double(), idx, 1 / 16, 512, snk.double() if sink else None, lens)
        msg = []
        for nm, a, w, tol in zip(("out", "max", "lse"), got, want, (SPARSE_OUT_TOL, SPARSE_STAT_TOL, SPARSE_STAT_TOL)):
            r = oracle.check_allclose(a.float().cpu(), w.float().cpu(), **tol)
            fin = torch.isfinite(w)
            err = (a.double()[fin] - w[fin]).abs().max().item() if fin.any() else 0
            msg.append(f"{nm} {'ok' if r.passed else 'FAIL'} {err:.2g}")
            ok_all &= r.passed
        print(f"  {name} h{h} s_q{s_q} s_kv{s_kv} topk{topk} sink{int(sink)} len{int(ln)}: {' | '.join(msg)}  ({t1-t0:.1f}s)", flush=True)
    return ok_all
mode = sys.argv[1]
if mode == "smoke":
    name = sys.argv[2]
    print(f"  {name}: all ok = {smoke(name, {'v1': v1, 'v2': v2, 'v2fp8': v2}[name])}", flush=True)
    sys.exit(0)
S_KV = 131072
gen = torch.Generator(device="cuda").manual_seed(0)
if mode == "ncu":
    kv = (torch.randn(S_KV, 1, 576, device="cuda", generator=gen) / 10).to(torch.bfloat16)
    idx = bench._indices(4096, S_KV, gen)
    q = (torch.randn(4096, 64, 576, device="cuda", generator=gen) / 10).to(torch.bfloat16)
    for _ in range(2):
        v2.flash_mla_sparse_fwd_gluon(q, kv, 576, S_KV, idx, bench.SM_SCALE, None, None)
    if fm is not None:
        fm.sparse_prefill_fwd(q, kv, idx, bench.SM_SCALE, 512, None, None)
    torch.cuda.synchronize()
    sys.exit(0)
kv = (torch.randn(S_KV, 1, 576, device="cuda", generator=gen) / 10).to(torch.bfloat16)
for s_q in (16384,):
    idx = bench._indices(s_q, S_KV, gen)
    for h in (64, 128):
        q = (torch.randn(s_q, h, 576, device="cuda", generator=gen) / 10).to(torch.bfloat16)
        rows = torch.linspace(0, s_q - 1, 128, device="cuda").long()
        fl = bench._flops(s_q, h)
        line = [f"s_q {s_q} h {h}"]
        fns = {}
        if fm is not None:
            fns["flashmla"] = lambda: fm.sparse_prefill_fwd(q, kv, idx, bench.SM_SCALE, 512, None, None)
        for v in sys.argv[2:]:
            if v == "v2fp8":
                rows8, _ = fp8_rows(kv)
                fns[v] = lambda rows8=rows8: v2.flash_mla_sparse_fwd_gluon(q, rows8, 656, S_KV, idx, bench.SM_SCALE, None, None, fp8=True)
            elif v == "v2k32":
                fns[v] = lambda: v2k32.flash_mla_sparse_fwd_gluon(q, kv, 576, S_KV, idx, bench.SM_SCALE, None, None)
            elif v == "v2r1":
                fns[v] = lambda: v2r1.flash_mla_sparse_fwd_gluon(q, kv, 576, S_KV, idx, bench.SM_SCALE, None, None, {"prefetch": 0})
            elif v == "v1":
                fns[v] = lambda: v1.flash_mla_sparse_fwd_gluon(q, kv, 576, S_KV, idx, bench.SM_SCALE, None, None)
            else:  # v2 or v2pfN
                pf = int(v[4:]) if v.startswith("v2pf") else v2.CONFIG["prefetch"]
                fns[v] = lambda pf=pf: v2.flash_mla_sparse_fwd_gluon(q, kv, 576, S_KV, idx, bench.SM_SCALE, None, None, {"prefetch": pf})
        for nm, fn in fns.items():
            try:
                t = bench._time(fn, 3)
                chk = bench._check(fn(), q, fp8_rows(kv)[1] if nm.endswith("fp8") else kv, idx, rows)
                ok = all(v["passed"] for v in chk.values())
                out[f"{nm}_{s_q}_{h}"] = {"s": t, "tflops": fl / t / 1e12, "check": chk}
                line.append(f"{nm} {t*1e3:.2f} ms {fl/t/1e12:.0f} TF/s {bench._gather_tbps(s_q, h, 1152, t):.2f} TB/s [{'ok' if ok else 'FAIL'}]")
            except Exception as e:
                traceback.print_exc(); line.append(f"{nm} ERROR {type(e).__name__}")
        print(" | ".join(line), flush=True)
json.dump(out, open(f"{RES}/r1_time_{'_'.join(sys.argv[2:])}.json", "w"), indent=1, default=str)
