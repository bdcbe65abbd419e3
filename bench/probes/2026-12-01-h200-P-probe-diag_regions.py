"""Diagnostic (not part of the package): the candidate kernel with per-thread regions (no
atomics; p30scratch/regions/glm_dsa) at 8,192 x 1,048,576, H 32, per config: thresholds +inf
(nothing kept), sampled (~5K a row); then that tree's indexer_topk on the same rows. Compare with
diag.py (the atomic kernel) on the same inputs."""
import json, os, sys, time
sys.path.insert(0, os.path.join(os.getcwd(), "p30scratch", "regions"))
import torch, triton
from glm_dsa.kernels import mqa_logits as ml
assert hasattr(ml, "CANDIDATE_REGIONS"), ml.__file__
from glm_dsa.kernels.mqa_logits import candidate_slots, launch_mqa_candidates, launch_mqa_logits

def ev_ms(fn, reps=3):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps):
        fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps

t0 = time.time()
S, N, H = 8192, 1048576, 32
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(S, H, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
k = torch.randn(N, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
k_scale = torch.rand(N, device="cuda", generator=g) + 0.25
w = torch.randn(S, H, device="cuda", generator=g) * H**-0.5
ks = torch.zeros(S, dtype=torch.int32, device="cuda")
ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device="cuda")
flops = 2 * H * 128 * int((ke - ks).long().sum())
stride = 128
sample = launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w, ks, (ke + stride - 1) // stride, True, 0)
thr = sample.kthvalue(sample.shape[1] - 40, dim=1).values.contiguous()
del sample
inf = torch.full((S,), float("inf"), device="cuda")
slots = candidate_slots(12288)
res = {"slots": slots}
for c in [(256, 64, 8, 4), (256, 64, 8, 3), (256, 64, 4, 4), (128, 64, 4, 4)]:
    ml._mqa_candidates_tuned.configs = [triton.Config({"BLOCK_Q": c[0], "BLOCK_N": c[1]}, num_warps=c[2], num_stages=c[3])]
    try:
        r = {"none_kept_ms": ev_ms(lambda: launch_mqa_candidates(q, k, k_scale, w, ks, ke, inf, slots))}
        _, _, counts = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, slots)
        r["sampled_ms"] = ev_ms(lambda: launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, slots))
        r["sampled_tflops"] = flops / r["sampled_ms"] / 1e9
        r["found_mean"], r["fullest_region"] = float(counts.sum(1).float().mean()), int(counts.max())
    except Exception as e:
        r = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    res[str(c)] = r
    print(json.dumps(res), round(time.time() - t0, 1), flush=True)
with open(os.path.join(os.environ.get("RES", "."), "diag_regions.json"), "w") as f:
    json.dump(res, f, indent=2)
