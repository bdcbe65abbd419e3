"""Probe (not part of the package): a persistent logits kernel with TMA descriptor loads, against
glm_dsa.kernels.fp8_mqa_logits (and DeepGEMM) at issue 30's shapes; prints ms, TFLOP/s, calc_diff."""
import json, os, sys, time
import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.getcwd())


@triton.jit
def _tma_logits(q_desc, k_desc, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, S, n_keys, out_stride,
                H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                NUM_PROGS: tl.constexpr, STAGES: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M * H
    n_blocks = tl.cdiv(S, BLOCK_M)
    for i in range(tl.program_id(0), n_blocks, NUM_PROGS):
        pid_m = n_blocks - 1 - i
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < S
        ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
        ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
        nonempty = ke > ks
        lo = tl.min(tl.where(nonempty, ks, n_keys), axis=0)
        hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
        q = q_desc.load([pid_m * BLOCK_Q, 0])
        qi = pid_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
        w = tl.load(w_ptr + qi, mask=qi < S * H, other=0.0)
        row_off = rows.to(tl.int64) * out_stride
        for t in tl.range(lo // BLOCK_N, tl.cdiv(hi, BLOCK_N), num_stages=STAGES):
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            k = k_desc.load([t * BLOCK_N, 0])
            k_scale = tl.load(k_scale_ptr + cols, mask=cols < n_keys, other=0.0)
            s = tl.dot(k, tl.trans(q))
            s = tl.maximum(s, 0.0) * w[None, :]
            logits = tl.sum(tl.reshape(s, (BLOCK_N, BLOCK_M, H)), axis=2) * k_scale[:, None]
            inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
            logits = tl.where(inside, logits, float("-inf"))
            tl.store(out_ptr + row_off[None, :] + cols[:, None], logits,
                     mask=row_ok[None, :] & (cols[:, None] < n_keys))


def tma_logits(q, k, k_scale, w, ks, ke, BLOCK_M, BLOCK_N, warps, stages, progs_per_sm):
    S, H, D = q.shape
    N = k.shape[0]
    out = torch.empty((S, N), dtype=torch.float32, device=q.device)  # -inf outside is written only on computed tiles
    qd = TensorDescriptor.from_tensor(q.view(S * H, D), [BLOCK_M * H, D])
    kd = TensorDescriptor.from_tensor(k, [BLOCK_N, D])
    nprog = progs_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    nprog = min(nprog, triton.cdiv(S, BLOCK_M))
    _tma_logits[(nprog,)](qd, kd, k_scale, w, ks, ke, out, S, N, out.stride(0), H=H, D=D,
                          BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_PROGS=nprog, STAGES=stages,
                          num_warps=warps)
    return out


@triton.jit
def _pp_logits(q_desc, k_desc, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr, S, n_keys, out_stride,
               H: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               NUM_PROGS: tl.constexpr, STAGES: tl.constexpr):
    """As _tma_logits, with the next tile's MMA issued before this tile's epilogue (the raw
    scores carried across iterations), so that the tensor cores run under the epilogue."""
    BLOCK_Q: tl.constexpr = BLOCK_M * H
    n_blocks = tl.cdiv(S, BLOCK_M)
    for i in range(tl.program_id(0), n_blocks, NUM_PROGS):
        pid_m = n_blocks - 1 - i
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < S
        ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
        ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
        nonempty = ke > ks
        lo = tl.min(tl.where(nonempty, ks, n_keys), axis=0)
        hi = tl.max(tl.where(nonempty, ke, 0), axis=0)
        q = q_desc.load([pid_m * BLOCK_Q, 0])
        qt = tl.trans(q)
        qi = pid_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
        w = tl.load(w_ptr + qi, mask=qi < S * H, other=0.0)
        row_off = rows.to(tl.int64) * out_stride
        t0 = lo // BLOCK_N
        t1 = tl.cdiv(hi, BLOCK_N)
        s = tl.dot(k_desc.load([t0 * BLOCK_N, 0]), qt)
        for t in tl.range(t0, t1, num_stages=STAGES):
            s_next = tl.dot(k_desc.load([(t + 1) * BLOCK_N, 0]), qt)
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            k_scale = tl.load(k_scale_ptr + cols, mask=cols < n_keys, other=0.0)
            r = tl.maximum(s, 0.0) * w[None, :]
            logits = tl.sum(tl.reshape(r, (BLOCK_N, BLOCK_M, H)), axis=2) * k_scale[:, None]
            inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
            logits = tl.where(inside, logits, float("-inf"))
            tl.store(out_ptr + row_off[None, :] + cols[:, None], logits,
                     mask=row_ok[None, :] & (cols[:, None] < n_keys))
            s = s_next


def pp_logits(q, k, k_scale, w, ks, ke, BLOCK_M, BLOCK_N, warps, stages, progs_per_sm):
    S, H, D = q.shape
    N = k.shape[0]
    out = torch.empty((S, N), dtype=torch.float32, device=q.device)
    qd = TensorDescriptor.from_tensor(q.view(S * H, D), [BLOCK_M * H, D])
    kd = TensorDescriptor.from_tensor(k, [BLOCK_N, D])
    nprog = progs_per_sm * torch.cuda.get_device_properties(0).multi_processor_count
    nprog = min(nprog, triton.cdiv(S, BLOCK_M))
    _pp_logits[(nprog,)](qd, kd, k_scale, w, ks, ke, out, S, N, out.stride(0), H=H, D=D,
                         BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, NUM_PROGS=nprog, STAGES=stages,
                         num_warps=warps)
    return out


def main():
    from glm_dsa import oracle
    from glm_dsa.kernels import fp8_mqa_logits
    import triton.testing
    try:
        import deep_gemm
    except Exception:
        deep_gemm = None
    shapes = [(4096, 131072, 32), (32768, 131072, 32)]
    cfgs = [(8, 64, 4, 4, 2), (8, 64, 4, 3, 2), (4, 128, 8, 3, 1), (8, 128, 8, 3, 1)]
    res = []
    for S, N, H in shapes:
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(S, H, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        k = torch.randn(N, 128, device="cuda", generator=g).to(torch.float8_e4m3fn)
        k_scale = torch.rand(N, device="cuda", generator=g) + 0.25
        w = torch.randn(S, H, device="cuda", generator=g) * H**-0.5
        ks = torch.zeros(S, dtype=torch.int32, device="cuda")
        ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device="cuda")
        flops = 2 * H * 128 * int((ke - ks).long().sum())
        base = fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=False)
        ms = triton.testing.do_bench(lambda: fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=False), warmup=20, rep=100)
        row = {"shape": [S, N, H], "triton_ms": ms, "triton_tflops": flops / ms / 1e9}
        if deep_gemm is not None:
            dms = triton.testing.do_bench(lambda: deep_gemm.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=False), warmup=20, rep=100)
            row.update(deepgemm_ms=dms, deepgemm_tflops=flops / dms / 1e9)
        for c in cfgs:
            try:
                t0 = time.time()
                out = tma_logits(q, k, k_scale, w, ks, ke, *c)
                torch.cuda.synchronize()
                inside = torch.isfinite(out[-64:]) & (torch.arange(N, device="cuda")[None] < ke[-64:, None])
                diff = oracle.calc_diff(out[-64:][inside], base[-64:][inside])
                tms = triton.testing.do_bench(lambda: tma_logits(q, k, k_scale, w, ks, ke, *c), warmup=20, rep=100)
                row[f"tma{c}"] = {"ms": tms, "tflops": flops / tms / 1e9, "calc_diff_vs_triton": diff, "first_s": time.time() - t0}
            except Exception as e:
                row[f"tma{c}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            print(json.dumps({k2: v for k2, v in row.items()}), flush=True)
        res.append(row)
        del q, k, base
        torch.cuda.empty_cache()
    out = os.environ.get("RES", ".")
    with open(os.path.join(out, "tma_probe.json"), "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
