"""Scratch: the candidate kernel, persistent over row blocks, with TMA loads of queries and keys
(H a power of two, D = 128). Compared with glm_dsa's pointer-load candidate kernel."""
import triton
import triton.language as tl
from glm_dsa.kernels.mqa_logits import _row_block_window, _tile_logits
from glm_dsa.kernels.topk import order_keys


@triton.jit
def _cand_tma(q_desc, k_desc, k_scale_ptr, w_ptr, ks_ptr, ke_ptr, thr_ptr, cand_key_ptr, cand_idx_ptr,
              counters_ptr, S, n_keys, cand, H: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              STAGES: tl.constexpr):
    BLOCK_Q: tl.constexpr = BLOCK_M * H
    n_blocks = tl.cdiv(S, BLOCK_M)
    for i in range(tl.program_id(0), n_blocks, tl.num_programs(0)):
        pid_m = n_blocks - 1 - i
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < S
        ks = tl.load(ks_ptr + rows, mask=row_ok, other=0)
        ke = tl.load(ke_ptr + rows, mask=row_ok, other=0)
        thr = tl.load(thr_ptr + rows, mask=row_ok, other=0.0)
        lo, hi = _row_block_window(ks, ke, n_keys)
        q = q_desc.load([pid_m * BLOCK_Q, 0])
        qi = pid_m * BLOCK_Q + tl.arange(0, BLOCK_Q)
        w = tl.load(w_ptr + qi, mask=qi < S * H, other=0.0)
        cand_off = rows.to(tl.int64) * cand
        count_ptrs = counters_ptr + tl.broadcast_to(rows[None, :] * 4, (BLOCK_N, BLOCK_M))
        for t in tl.range(lo // BLOCK_N, tl.cdiv(hi, BLOCK_N), num_stages=STAGES):
            cols = t * BLOCK_N + tl.arange(0, BLOCK_N)
            k = k_desc.load([t * BLOCK_N, 0])
            k_scale = tl.load(k_scale_ptr + cols, mask=cols < n_keys, other=0.0)
            logits = _tile_logits(k, k_scale, q, w, BLOCK_N, BLOCK_M, H)
            inside = (cols[:, None] >= ks[None, :]) & (cols[:, None] < ke[None, :])
            take = inside & ~(logits < thr[None, :])
            slot = tl.atomic_add(count_ptrs, 1, mask=take, sem="relaxed")
            ok = take & (slot < cand)
            at = cand_off[None, :] + slot
            tl.store(cand_key_ptr + at, order_keys(logits).to(tl.int32, bitcast=True), mask=ok)
            tl.store(cand_idx_ptr + at, cols[:, None] - ks[None, :], mask=ok)
