"""Diagnostic (not part of the package): the candidate kernel at 8,192 x 1,048,576, H 32, one
config, against the logits kernel on the same rows: thresholds +inf (no entry kept: the cost of
the scoring alone), sampled thresholds (~5K kept a row), -inf for a 64-row slice (everything)."""
import json, os, sys, time
import torch, triton
sys.path.insert(0, os.getcwd())
from glm_dsa.kernels import mqa_logits as ml
from glm_dsa.kernels.mqa_logits import launch_mqa_candidates, launch_mqa_logits

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
one = ml.CANDIDATE_CONFIGS[0]
cfg = [triton.Config({"BLOCK_Q": one["BLOCK_Q"], "BLOCK_N": one["BLOCK_N"]}, num_warps=one["num_warps"], num_stages=one["num_stages"])]
ml._mqa_candidates_tuned.configs = cfg
ml._mqa_logits_tuned.configs = cfg
cand = 12288
res = {}
def cands(thr):
    c = torch.zeros((S, 4), dtype=torch.int32, device="cuda")
    launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, c, cand)
    return c
rows = slice(S - 1477, S)
res["logits_1477_rows_ms"] = ev_ms(lambda: launch_mqa_logits(q[rows], k, k_scale, w[rows], ks[rows], ke[rows], False, 0))
pairs_1477 = int((ke[rows] - ks[rows]).long().sum())
res["logits_1477_rows_tflops"] = 2 * H * 128 * pairs_1477 / res["logits_1477_rows_ms"] / 1e9
print(json.dumps(res), time.time() - t0, flush=True)
inf = torch.full((S,), float("inf"), device="cuda")
res["cand_none_kept_ms"] = ev_ms(lambda: cands(inf))
res["cand_none_kept_tflops"] = flops / res["cand_none_kept_ms"] / 1e9
print(json.dumps(res), time.time() - t0, flush=True)
stride = 128
sample = launch_mqa_logits(q, k[::stride].contiguous(), k_scale[::stride].contiguous(), w, ks, (ke + stride - 1) // stride, True, 0)
thr = sample.kthvalue(sample.shape[1] - 40, dim=1).values.contiguous()
del sample
c = cands(thr)
res["found_mean"], res["found_max"], res["found_min"] = float(c[:, 0].float().mean()), int(c[:, 0].max()), int(c[:, 0].min())
res["cand_sampled_ms"] = ev_ms(lambda: cands(thr))
res["cand_sampled_tflops"] = flops / res["cand_sampled_ms"] / 1e9
print(json.dumps(res), time.time() - t0, flush=True)
ninf = thr.clone(); ninf[-64:] = float("-inf")
res["cand_last64_all_kept_ms"] = ev_ms(lambda: cands(ninf), reps=1)
print(json.dumps(res), time.time() - t0, flush=True)
with open(os.path.join(os.environ.get("RES", "."), "diag.json"), "w") as f:
    json.dump(res, f, indent=2)
