"""The Triton indexer kernels against the oracle (DeepGEMM's metric: exact -inf masks, calc_diff).

On the CPU these run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), at
small shapes; the ``cuda`` tests run the compiled kernels at GLM-5.3 shapes.
"""

import pytest
import torch

pytest.importorskip("triton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from glm_dsa import budget, indexer, oracle, testing  # noqa: E402
from glm_dsa.kernels import fp8_mqa_logits, fp8_paged_mqa_logits, indexer_topk  # noqa: E402
from glm_dsa.kernels.mqa_logits import _row_block_window, _window_split  # noqa: E402
from glm_dsa.kernels.topk import COUNTERS, select_rows  # noqa: E402
from test_kernels_direct import order_keys as _order_keys  # noqa: E402
from test_kernels_topk import ascending  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
# DeepGEMM's tolerance against a reference on the dequantized inputs (docs/conventions.md §14).
CALC_DIFF_TOL = 5e-6
NEG_INF = float("-inf")


def _inputs(S, H, D, N, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(S, H, D, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(N, D, generator=g).to(torch.float8_e4m3fn)
    k_scale = torch.rand(N, generator=g) + 0.25
    weights = torch.randn(S, H, generator=g) * H**-0.5
    return q.to(DEV), k.to(DEV), k_scale.to(DEV), weights.to(DEV)


def _windows(kind, S, N, seed):
    """int32 ks, ke [S]: ``causal`` = two requests of a ragged batch, each with a prefix."""
    g = torch.Generator().manual_seed(seed)
    if kind == "causal":
        # Request a: keys [0, N // 2), its last S // 2 tokens are queries; request b likewise.
        na, sa = N // 2, S // 2
        nb, sb = N - na, S - sa
        ks = [0] * sa + [na] * sb
        ke = [na - sa + i + 1 for i in range(sa)] + [na + nb - sb + i + 1 for i in range(sb)]
    else:
        ks = torch.randint(0, N, (S,), generator=g)
        ke = torch.minimum(ks + torch.randint(0, N, (S,), generator=g), torch.tensor(N))
        ks, ke = ks.tolist(), ke.tolist()
    ks, ke = list(ks), list(ke)
    for m in range(0, S, 5):  # empty rows, at the start, inside and at the end of a window
        ks[m] = ke[m] = min(ke[m], N) if m % 2 else ks[m]
    return (torch.tensor(ks, dtype=torch.int32, device=DEV),
            torch.tensor(ke, dtype=torch.int32, device=DEV))  # fmt: skip


def _assert_logits_close(out, ref):
    assert out.shape == ref.shape and out.dtype == torch.float32
    mask = torch.isneginf(ref)
    assert torch.equal(torch.isneginf(out), mask), "the -inf masks differ"
    assert torch.isfinite(out[~mask]).all()
    diff = oracle.calc_diff(out.masked_fill(mask, 0.0), ref.masked_fill(mask, 0.0))
    assert diff <= CALC_DIFF_TOL, diff


# ------------------------------------------------------------------------- ragged logits
@pytest.mark.parametrize(
    "S, H, D, N, kind",
    [
        (37, 4, 128, 300, "causal"),
        (23, 32, 128, 170, "random"),
        (9, 24, 80, 97, "random"),  # heads and dims that are not powers of two
        (1, 64, 128, 40, "causal"),
        # Head-major columns (a block of ≥ 4 rows): one, two, eight row groups of four; padded
        # heads; the two-head and one-head edges.
        (13, 16, 128, 120, "causal"),
        (10, 12, 128, 77, "random"),
        (11, 2, 64, 90, "random"),
        (7, 1, 32, 60, "causal"),
    ],
)
def test_fp8_mqa_logits_matches_oracle(S, H, D, N, kind):
    q, k, k_scale, w = _inputs(S, H, D, N, seed=S + H)
    ks, ke = _windows(kind, S, N, seed=N)
    ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    _assert_logits_close(fp8_mqa_logits(q, (k, k_scale), w, ks, ke), ref)


def test_the_tuner_keeps_one_head_order_per_head_count():
    """``one_head_order`` on the GPU tables: at 32 padded heads the 64-wide blocks (2 rows,
    row-major) go, at 64 the 128-wide ones; 16 heads (every block ≥ 4 rows) and 128 (every
    block < 4 rows) keep them all, as does one head (row-major at any block)."""
    import triton

    from glm_dsa.kernels import mqa_logits

    def kept(table, hp):
        configs = [triton.Config({k: v for k, v in c.items() if not k.startswith("num_")})
                   for c in table]
        return sorted({c.kwargs["BLOCK_Q"] for c in mqa_logits.one_head_order(configs, {}, HP=hp)})

    assert kept(mqa_logits.CONFIGS, 32) == [128, 256]
    assert kept(mqa_logits.CONFIGS, 64) == [256]
    assert kept(mqa_logits.CONFIGS, 16) == [64, 128, 256]
    assert kept(mqa_logits.CONFIGS, 128) == [64, 128, 256]
    assert kept(mqa_logits.CONFIGS, 1) == [64, 128, 256]
    assert kept(mqa_logits.CANDIDATE_CONFIGS, 32) == [256]


@pytest.mark.cuda
@pytest.mark.parametrize("H", [32, 64])
def test_every_config_the_tuner_may_pick_gives_the_same_logit_bits(monkeypatch, H):
    """Each config ``one_head_order`` keeps, forced in turn: the logits kernel's bits equal
    across them (the head sum's order does not follow the tile), and the candidate kernel's
    keys, with every entry kept, are those logits' order keys."""
    from glm_dsa.kernels import mqa_logits
    from glm_dsa.kernels.mqa_logits import launch_mqa_candidates, launch_mqa_logits

    S, N = 200, 3000
    q, k, k_scale, w = _inputs(S, H, 128, N, seed=71)
    ks, ke = _causal_chunk(S, N)
    hp = 1 << (H - 1).bit_length()
    logits = []
    for c in mqa_logits.one_head_order(mqa_logits._mqa_logits_tuned.configs, {}, HP=hp):
        monkeypatch.setattr(mqa_logits._mqa_logits_tuned, "configs", [c])
        logits.append((str(c), launch_mqa_logits(q, k, k_scale, w, ks, ke, True, 0)))
    first = logits[0][1]
    for name, out in logits[1:]:
        assert torch.equal(out.view(torch.int32), first.view(torch.int32)), name
    thr = torch.full((S,), float("-inf"), device=DEV)
    for c in mqa_logits.one_head_order(mqa_logits._mqa_candidates_tuned.configs, {}, HP=hp):
        monkeypatch.setattr(mqa_logits._mqa_candidates_tuned, "configs", [c])
        counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device=DEV)
        keys, cols = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, N)
        for m in (0, S // 2, S - 1):
            n = int(counters[m, 0])
            assert n == int(ke[m] - ks[m]), (str(c), m)
            order = cols[m, :n].long().argsort()
            expected = _order_keys(first[m, int(ks[m]) + cols[m, :n].long()[order]])
            assert torch.equal(keys[m, :n][order], expected), (str(c), m)


@pytest.mark.cuda
@pytest.mark.parametrize("H", [32, 64])
def test_the_ptx_epilogue_keeps_what_tritons_atomics_and_stores_keep(monkeypatch, H):
    """The candidate kernel's epilogue as inline PTX (``mqa_logits._PTX_EPILOGUE``, the GPU's
    default) and as Triton's own atomics and stores, each config the tuner may pick forced in
    turn, on a ragged batch with thresholds that keep a part of each row and a buffer too small
    for some rows: the counts equal the logits kernel's (its entries not below the threshold)
    in both forms, and each fitting row's kept (order key, column) set is the logits kernel's
    entries (an overflowing row keeps whichever entries took the first slots)."""
    from glm_dsa.kernels import mqa_logits
    from glm_dsa.kernels.mqa_logits import launch_mqa_candidates

    S, N, cand = 300, 5000, 1024
    q, k, k_scale, w = _inputs(S, H, 128, N, seed=73)
    ks, ke = _windows("causal", S, N, seed=73)
    hp = 1 << (H - 1).bit_length()
    full = fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    # The row's ~1,200th best logit: most rows keep more than ``cand``, short rows fewer.
    thr = torch.where(ke - ks > 1200, full.sort(dim=1, descending=True).values[:, 1200],
                      float("-inf")).contiguous()
    cols = torch.arange(N, device=DEV)[None, :]
    take = (cols >= ks[:, None]) & (cols < ke[:, None]) & ~(full < thr[:, None])
    want_n = take.sum(dim=1).to(torch.int32)
    fits = want_n <= cand
    assert (~fits).any() and fits.any()
    never = torch.iinfo(torch.int64).max
    want = torch.where(take, (_order_keys(full).long() << 32) | (cols - ks[:, None]).long(), never)
    want = want.sort(dim=1).values[:, :cand]
    for ptx in (False, True):
        monkeypatch.setattr(mqa_logits, "_PTX_EPILOGUE", ptx)
        for c in mqa_logits.one_head_order(mqa_logits._mqa_candidates_tuned.configs, {}, HP=hp):
            monkeypatch.setattr(mqa_logits._mqa_candidates_tuned, "configs", [c])
            counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device=DEV)
            keys, kept = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, cand)
            live = torch.arange(cand, device=DEV)[None, :] < counters[:, :1].clamp(max=cand)
            pairs = torch.where(live, (keys.long() << 32) | kept.long(), never).sort(dim=1).values
            assert torch.equal(counters[:, 0], want_n), (ptx, str(c))
            assert torch.equal(pairs[fits], want[fits]), (ptx, str(c))


_PTX_AOT = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from glm_dsa.kernels import mqa_logits as ml

PTRS = {"q_ptr": "*fp8e4nv", "k_ptr": "*fp8e4nv", "k_scale_ptr": "*fp32", "w_ptr": "*fp32",
        "ks_ptr": "*i32", "ke_ptr": "*i32"}
SIGS = {
    "candidates": (ml._mqa_candidates_kernel, {**PTRS, "thr_ptr": "*fp32", "cand_key_ptr": "*i32",
                   "cand_idx_ptr": "*i32", "counters_ptr": "*i32", "S": "i32", "n_keys": "i32",
                   "size_class": "i32", "cand": "i32"}),
}
kind, consts = sys.argv[1], json.loads(sys.argv[2])
warps, stages = int(sys.argv[3]), int(sys.argv[4])
kernel, sig = SIGS[kind]
full = {**sig, **{n: "constexpr" for n in consts}, "PTX_EPILOGUE": "constexpr"}
order = [n for n in kernel.arg_names if n in full]
counts = {}
for ptx in (False, True):
    values = {**consts, "PTX_EPILOGUE": ptx}
    src = ASTSource(kernel, {n: full[n] for n in order},
                    {(order.index(n),): v for n, v in values.items()},
                    attrs={(order.index(n),): [["tt.divisibility", 16]] for n in sig
                           if n.endswith("_ptr")})
    text = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": warps, "num_stages": stages}).asm["ptx"]
    counts[str(ptx)] = {s: text.count(s) for s in ("ld.shared", "atom.relaxed.gpu.global.add.u32",
                                                   "atom.global", "st.global.b32")}
print(json.dumps(counts))
"""


@pytest.mark.skipif(DEV == "cuda", reason="the offline compile's check; the GPU runs the kernels")
def test_the_ptx_epilogue_compiles_without_tritons_layout_conversions():
    """sm_90 PTX of the candidate kernel at the shipped tiles, with Triton's epilogue and the PTX
    one (a fresh interpreter without TRITON_INTERPRET, no GPU). An ``ld.shared`` outside the
    MMA's descriptors is Triton converting values into another layout, each with a barrier of the
    program: the PTX epilogue leaves out the two a tile (Triton 3.9 leaves none at all, 3.6 the
    weights' before the loop), and its atomics are the epilogue's, four a thread a tile."""
    import json
    import os
    import subprocess
    import sys

    from glm_dsa.kernels import mqa_logits

    c = mqa_logits.CANDIDATE_CONFIGS[0]
    consts = {"H": 32, "D": 128, "HP": 32, "DP": 128, "BLOCK_Q": c["BLOCK_Q"],
              "BLOCK_N": c["BLOCK_N"]}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", _PTX_AOT, "candidates", json.dumps(consts), str(c["num_warps"]),
         str(c["num_stages"])], env=env, capture_output=True, text=True, timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    counts = json.loads(done.stdout.strip().splitlines()[-1])
    triton_form, ptx_form = counts["False"], counts["True"]
    assert ptx_form["ld.shared"] < triton_form["ld.shared"], counts
    assert ptx_form["st.global.b32"] > 0
    assert ptx_form["atom.relaxed.gpu.global.add.u32"] == 4 and ptx_form["atom.global"] == 0
    assert triton_form["atom.global"] == 4, counts  # Triton's own atomics


def test_fp8_mqa_logits_all_rows_empty_is_all_masked():
    q, k, k_scale, w = _inputs(6, 4, 128, 50, seed=1)
    ks = torch.full((6,), 20, dtype=torch.int32, device=DEV)
    out = fp8_mqa_logits(q, (k, k_scale), w, ks, ks.clone())
    assert torch.isneginf(out).all()


def test_unclean_logits_agree_inside_the_windows():
    S, N = 21, 130
    q, k, k_scale, w = _inputs(S, 4, 128, N, seed=3)
    ks, ke = _windows("random", S, N, seed=4)
    ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    out = fp8_mqa_logits(q, (k, k_scale), w, ks, ke, clean_logits=False)
    inside = ~torch.isneginf(ref)
    assert oracle.calc_diff(out[inside], ref[inside]) <= CALC_DIFF_TOL


def test_compressed_logits_match_oracle():
    S, N = 19, 150
    q, k, k_scale, w = _inputs(S, 4, 128, N, seed=5)
    ks, ke = _windows("random", S, N, seed=6)
    longest = int((ke - ks).max())
    ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke, False, longest + 3)
    _assert_logits_close(fp8_mqa_logits(q, (k, k_scale), w, ks, ke, False, longest + 3), ref)


def test_invalid_arguments_raise_before_launch():
    q, k, k_scale, w = _inputs(4, 4, 128, 10, seed=7)
    ks = torch.zeros(4, dtype=torch.int32, device=DEV)
    ke = torch.full((4,), 10, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="float32"):
        fp8_mqa_logits(q, (k, k_scale), w.double(), ks, ke)
    with pytest.raises(ValueError, match="clean_logits=False"):
        fp8_mqa_logits(q, (k, k_scale), w, ks, ke, True, 10)
    with pytest.raises(ValueError, match="max_seqlen_k"):
        fp8_mqa_logits(q, (k, k_scale), w, ks, ke, False, 9)
    with pytest.raises(ValueError, match="ks ≤ ke"):
        fp8_mqa_logits(q, (k, k_scale), w, ke, ks)
    q12, k12 = q[..., :120].contiguous(), k[:, :120].contiguous()
    with pytest.raises(ValueError, match="multiple of 16"):
        fp8_mqa_logits(q12, (k12, k_scale), w, ks, ke)


# ------------------------------------------------------------------------- paged logits
def _paged_inputs(context_lens, next_n, H, D, seed, page=64):
    """Index-K pages of ``len(context_lens)`` requests in a shuffled pool, plus queries."""
    B = len(context_lens)
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-c // page) for c in context_lens) + 1
    num_blocks = B * max_blocks + 3
    keys = torch.randn(num_blocks, page, 1, D, generator=g)
    kv_cache = oracle.kv_cache_cast_to_fp8(keys)
    block_table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks)
    q = torch.randn(B, next_n, H, D, generator=g).to(torch.float8_e4m3fn)
    weights = torch.randn(B * next_n, H, generator=g) * H**-0.5
    return (q.to(DEV), kv_cache.to(DEV), weights.to(DEV),
            block_table.to(torch.int32).to(DEV))  # fmt: skip


@pytest.mark.parametrize("two_d", [False, True])
@pytest.mark.parametrize("lens, next_n, H, D", [
    ([63, 64, 65], 2, 4, 128),
    ([100, 150], 20, 8, 64),  # head-major blocks of 8 rows, the last one partly past next_n
])
def test_fp8_paged_mqa_logits_matches_oracle_across_page_boundaries(two_d, lens, next_n, H, D):
    q, kv_cache, w, table = _paged_inputs(lens, next_n, H, D, seed=11)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    if two_d:  # [B, next_n]: row j sees step · (next_n − 1 − j) tokens fewer than the last
        step = min(7, min(lens) // next_n)
        back = step * torch.arange(next_n - 1, -1, -1, device=DEV, dtype=torch.int32)
        ctx = (ctx[:, None] - back).to(torch.int32)
    width = max(lens) + 5
    ref = oracle.fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, width)
    _assert_logits_close(fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, width), ref)


def test_fp8_paged_mqa_logits_refuses_a_page_outside_the_pool():
    """The kernel follows the block table without bounds checks, so the wrapper checks every
    entry a row can reach (an out-of-range page would read another allocation)."""
    lens, next_n, H, D = [63, 65], 1, 4, 128
    q, kv_cache, w, table = _paged_inputs(lens, next_n, H, D, seed=13)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    table[1, 1] = kv_cache.shape[0]  # request 1's second page: one past the pool
    with pytest.raises(ValueError, match="block_table holds a page outside"):
        fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, 70)
    table[1, 1] = 0
    table[1, 2] = -5  # beyond request 1's context (65 tokens: two pages): never read
    fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, 70)


def test_fp8_paged_mqa_logits_with_a_strided_pool_and_32_heads():
    lens, next_n = [130, 1], 3
    q, kv_cache, w, table = _paged_inputs(lens, next_n, 32, 128, seed=12)
    # Blocks that sit 8448 + 64 bytes apart: any block stride that is a multiple of 4 works.
    pool = torch.zeros(kv_cache.shape[0], 8448 + 64, dtype=torch.uint8, device=DEV)
    pool[:, :8448] = kv_cache.view(kv_cache.shape[0], -1)
    strided = pool[:, :8448].view(-1, 64, 1, 132)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = oracle.fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, 192)
    _assert_logits_close(fp8_paged_mqa_logits(q, strided, w, ctx, table, 192), ref)


# ------------------------------------------------------------------------- the harness
@pytest.mark.parametrize("contract, fn", [("fp8_mqa_logits", fp8_mqa_logits),
                                          ("fp8_paged_mqa_logits", fp8_paged_mqa_logits)])
def test_logits_kernels_pass_the_harness(contract, fn):
    cases = len(testing.edge_case_names(contract)) + 2  # every named edge, two random cases
    assert testing.check_kernel(contract, fn, cases=cases, device=DEV).cases_run == cases


@pytest.mark.cuda
@pytest.mark.parametrize("contract, fn", [("fp8_mqa_logits", fp8_mqa_logits),
                                          ("fp8_paged_mqa_logits", fp8_paged_mqa_logits)])
def test_logits_kernels_pass_the_harness_at_glm_shapes(contract, fn):
    testing.check_kernel(contract, fn, cases=20, device=DEV, shapes="glm-5.3")


# ------------------------------------------------------------------------- top-k
def _assert_same_topk_sets(fast, ref, logits, ks, ke, topk, tol=0.0, slack=None):
    """Equal sets per row, except swaps of entries near the row's k-th logit: within ``tol``
    relative to it, or, given ``slack`` (``[R, N]`` bounds on each logit's error), within the
    swapped entry's bound plus the row's largest (which bounds the shift of the k-th value)."""
    recalls = []
    for m in range(fast.shape[0]):
        f = set(fast[m][fast[m] >= 0].tolist())
        r = set(ref[m][ref[m] >= 0].tolist())
        assert len(f) == len(r) == min(topk, int(ke[m] - ks[m])), m
        assert all(0 <= i < int(ke[m] - ks[m]) for i in f), m
        if f != r:
            lo, hi = int(ks[m]), int(ke[m])
            row = logits[m, lo:hi]
            kth = row[sorted(r)].min()
            swapped = torch.tensor(sorted(f ^ r), device=row.device)
            allowed = tol * kth.abs().clamp_min(1e-30)
            if slack is not None:
                allowed = allowed + slack[m, lo:hi][swapped] + slack[m, lo:hi].max()
            assert ((row[swapped] - kth).abs() <= allowed).all(), m
        recalls.append(len(f & r) / len(r) if r else 1.0)
    return recalls


def _wgmma_error_bound(q, k, k_scale, w, window):
    """``[S, N]`` bound on each fp8-wgmma logit's error against the exact oracle.

    Hopper's fp8 wgmma adds its products with about 13 mantissa bits, not float32's 24
    (DeepGEMM's README and the DeepSeek-V3 report, "FP8 accumulation precision"): each of the
    D = 128 additions of one head's ``q·k`` may lose up to 2⁻¹³ of the running sum, so that dot
    product is off by at most ``D · 2⁻¹³ · max_i |Σ_{d<i} q_d k_d|``, and the logit
    ``k_scale · Σ_h w_h relu(q_h·k)`` by at most ``k_scale · Σ_h |w_h|`` times that (ReLU is
    1-Lipschitz). Zero outside ``window``. One query row at a time (``[H, N, D]`` partial sums).
    """
    D = q.shape[-1]
    kf = k.float()
    bound = torch.zeros(window.shape, dtype=torch.float32, device=window.device)
    for s in range(q.shape[0]):
        partial = torch.cumsum(q[s].float()[:, None, :] * kf[None], dim=-1)  # [H, N, D]
        peak = partial.abs().amax(dim=-1)  # [H, N]
        bound[s] = (w[s].abs() @ peak) * k_scale * (D * 2.0**-13)
    return bound.masked_fill(~window, 0.0)


@pytest.mark.parametrize("rows_per_chunk", [None, 7])
def test_indexer_topk_selects_the_reference_sets(monkeypatch, rows_per_chunk):
    S, H, D, N, topk = 29, 4, 128, 260, 24
    q, k, k_scale, w = _inputs(S, H, D, N, seed=21)
    ks, ke = _windows("causal", S, N, seed=22)
    ke[1] = ks[1] + 3  # a row with fewer keys than topk
    if rows_per_chunk is not None:
        # Real budgets chunk only above 8e6 logits; force the chunk loop at a small shape.
        monkeypatch.setattr(budget, "max_logit_rows", lambda *a: rows_per_chunk)
    ref = indexer.indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    fast = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    assert fast.shape == (S, topk) and fast.dtype == torch.int32
    lens = (ke - ks).long()
    short = lens <= topk
    ar = torch.arange(topk, device=DEV)
    assert torch.equal(fast[short], torch.where(ar < lens[short, None], ar, -1).to(torch.int32))
    logits = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    recalls = _assert_same_topk_sets(fast, ref, logits, ks, ke, topk, tol=1e-5)
    assert min(recalls) >= 0.9 and sum(recalls) / len(recalls) >= 0.99


@pytest.mark.parametrize("rows_per_chunk", [None, 5])
def test_indexer_topk_keeps_every_rows_last_keys_when_they_score_highest(monkeypatch, rows_per_chunk):
    """Scores rise strictly with the key's position (equal fp8 keys, scales 1, 1.01, 1.02 …), so
    a causal row's top-k is exactly its last ``topk`` keys, the row's own key included: a row
    chunk that reads one key short of its range loses it."""
    S, H, D, topk, prefix = 23, 4, 128, 8, 10
    N = prefix + S
    q = torch.full((S, H, D), 0.5).to(torch.float8_e4m3fn).to(DEV)
    k = torch.full((N, D), 0.25).to(torch.float8_e4m3fn).to(DEV)
    k_scale = (1 + 0.01 * torch.arange(N, dtype=torch.float32)).to(DEV)
    w = torch.ones(S, H, device=DEV)
    ks = torch.zeros(S, dtype=torch.int32, device=DEV)
    ke = torch.arange(prefix + 1, N + 1, dtype=torch.int32, device=DEV)
    if rows_per_chunk is not None:
        monkeypatch.setattr(budget, "max_logit_rows", lambda *a: rows_per_chunk)
    fast = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30).cpu()
    for m in range(S):
        n = prefix + m + 1
        assert sorted(fast[m].tolist()) == list(range(n - topk, n)), m


def test_indexer_topk_names_the_first_row_whose_logits_are_nan(monkeypatch):
    """NaN is reported once, after every row chunk is queued, with the row's absolute index."""
    S, H, D, N, topk = 29, 4, 128, 260, 24
    q, k, k_scale, w = _inputs(S, H, D, N, seed=21)
    ks, ke = _windows("causal", S, N, seed=22)
    w[17, 2] = float("nan")
    monkeypatch.setattr(budget, "max_logit_rows", lambda *a: 7)  # row 17 is in the third chunk
    with pytest.raises(ValueError, match="logits row 17 holds NaN"):
        indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)


def test_select_rows_fills_short_rows_and_offsets_long_ones():
    logits = torch.full((3, 8), NEG_INF, device=DEV)
    logits[0, 2:7] = torch.tensor([5.0, 1.0, 4.0, 3.0, 2.0], device=DEV)
    starts = torch.tensor([2, 0, 4], device=DEV)
    ends = torch.tensor([7, 2, 4], device=DEV)
    out = select_rows(logits, starts, ends, 3)
    assert sorted(out[0].tolist()) == [0, 2, 3]  # scores 5, 4, 3 at columns 2, 4, 5
    assert out[1].tolist() == [0, 1, -1] and out[2].tolist() == [-1, -1, -1]


# ------------------------------------------------------------------------- GLM-5.3 shapes
def _causal_chunk(S, context):
    """ks, ke of S queries that are the last S tokens of a ``context``-token request."""
    ks = torch.zeros(S, dtype=torch.int32, device=DEV)
    ke = torch.arange(context - S + 1, context + 1, dtype=torch.int32, device=DEV)
    return ks, ke


@pytest.mark.cuda
@pytest.mark.parametrize("S, N", [(2048, 32768), (4096, 16384)])
def test_fp8_mqa_logits_at_glm_shapes(S, N):
    q, k, k_scale, w = _inputs(S, 32, 128, N, seed=31)
    ks, ke = _causal_chunk(S, N)
    ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    _assert_logits_close(fp8_mqa_logits(q, (k, k_scale), w, ks, ke), ref)


@pytest.mark.cuda
def test_fp8_paged_mqa_logits_at_glm_shapes():
    lens, next_n = [20000, 9001], 512
    q, kv_cache, w, table = _paged_inputs(lens, next_n, 32, 128, seed=32)
    ctx = torch.tensor(lens, dtype=torch.int32, device=DEV)
    ref = oracle.fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, 20000)
    _assert_logits_close(fp8_paged_mqa_logits(q, kv_cache, w, ctx, table, 20000), ref)


@pytest.mark.cuda
def test_indexer_topk_at_glm_shapes_recall():
    S, N, topk = 2048, 32768, 2048
    q, k, k_scale, w = _inputs(S, 32, 128, N, seed=33)
    ks, ke = _causal_chunk(S, N)
    budget = 4 * 512 * N  # 512 rows of logits at a time
    ref = indexer.indexer_topk(q, w, k, k_scale, ks, ke, topk, budget)
    fast = indexer_topk(q, w, k, k_scale, ks, ke, topk, budget)
    rows = torch.arange(0, S, 97, device=DEV)
    logits = oracle.fp8_mqa_logits(q[rows], (k, k_scale), w[rows], ks[rows], ke[rows])
    # fp8 wgmma accumulates more coarsely than the exact oracle: entries whose logits differ
    # by less than the accumulation error bound may swap (1e-3 of the k-th value was exceeded).
    slack = _wgmma_error_bound(q[rows], k, k_scale, w[rows], torch.isfinite(logits))
    recalls = _assert_same_topk_sets(fast[rows], ref[rows], logits, ks[rows], ke[rows], topk,
                                     slack=slack)  # fmt: skip
    assert sum(recalls) / len(recalls) >= 0.99 and min(recalls) >= 0.95


# ------------------------------------------------------------------------- candidate filter
def _kernel_logits(q, w, k, k_scale, ks, ke):
    """``[S, N]`` float32: the candidate kernel's own logits inside the windows, ``-inf`` outside.

    At threshold ``-inf`` its epilogue keeps every entry of every window with its column, so
    its order keys, decoded, are the float32 logits ``indexer_topk``'s selection sees (the same
    kernel and, with the config pinned, the same tiles). Windows start at key 0 here, as in
    ``indexer_topk``'s launch over the span from the first row's start."""
    from glm_dsa.kernels.mqa_logits import launch_mqa_candidates

    S, N = q.shape[0], k.shape[0]
    width = max(1, int((ke - ks).max()))
    counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device=DEV)
    thr = torch.full((S,), NEG_INF, device=DEV)
    keys, cols = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, width)
    assert torch.equal(counters[:, 0], (ke - ks).to(torch.int32))
    bits = keys.view(torch.int32)
    # Invert glm_dsa.kernels.topk.order_keys: flip all bits of negatives, the sign of positives.
    positive = bits < 0  # top bit set: a non-negative score
    raw = torch.where(positive, bits ^ torch.iinfo(torch.int32).min, ~bits).view(torch.float32)
    logits = torch.full((S, N), NEG_INF, device=DEV)
    for m in range(S):
        n = int(ke[m] - ks[m])
        seen = cols[m, :n].long()
        assert torch.equal(seen.sort().values, torch.arange(n, device=DEV)), m  # each key once
        logits[m, int(ks[m]) + seen] = raw[m, :n]
    return logits


@triton.jit
def _window_shares(ks_ptr, ke_ptr, out_ptr, n_keys, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (0, p)'s ``_window_split`` tiles ``[c0, c1)`` into ``out[2p : 2p + 2]``."""
    r = tl.arange(0, BLOCK_M)
    lo, hi = _row_block_window(tl.load(ks_ptr + r), tl.load(ke_ptr + r), n_keys)
    c0, c1 = _window_split(lo, hi, BLOCK_N)
    tl.store(out_ptr + 2 * tl.program_id(1), c0)
    tl.store(out_ptr + 2 * tl.program_id(1) + 1, c1)


@pytest.mark.parametrize("lo, hi, splits", [(150, 390, 4), (0, 400, 4), (150, 390, 16),
                                             (40, 41, 3), (None, None, 4)])
def test_window_split_shares_the_row_blocks_own_tiles_evenly(lo, hi, splits):
    """The candidate kernel's split of a row block's key tiles across the grid's column splits,
    run as a kernel of ``splits`` programs: program p takes tiles ``[t0 + p·n, t0 + (p+1)·n)``
    of the window's ``[t0, t1)`` (``n = ⌈(t1 − t0) / splits⌉``, clipped), so together they take
    each of those tiles once and none outside; a block with no window takes none."""
    n_keys, block_n = 400, 32
    if lo is None:  # every row empty
        ks = torch.tensor([7, 0, 0, 399], dtype=torch.int32)
        ke = ks.clone()
    else:  # one row spans [lo, hi), the others inside it or empty
        ks = torch.tensor([lo, lo, hi, (lo + hi) // 2], dtype=torch.int32)
        ke = torch.tensor([hi, lo, hi, hi], dtype=torch.int32)
    out = torch.zeros(2 * splits, dtype=torch.int32, device=DEV)
    _window_shares[(1, splits)](ks.to(DEV), ke.to(DEV), out, n_keys, BLOCK_M=4, BLOCK_N=block_n)
    got = [tuple(p) for p in out.cpu().view(splits, 2).tolist()]
    if lo is None:
        assert all(c0 == c1 for c0, c1 in got), got
        return
    t0, t1 = lo // block_n, -(-hi // block_n)
    n = -(-(t1 - t0) // splits)
    expected = [(min(t0 + p * n, t1), min(t0 + (p + 1) * n, t1)) for p in range(splits)]
    assert got == expected


def _threshold_between_scores(row):
    """A threshold keeping about a third of ``row``'s scores, halfway across the widest gap
    between two of them there, so that the kernel's float32 rounding cannot move an entry
    across it (below every score for a row of one)."""
    v = row.sort().values
    if v.numel() < 3:
        return v[0] - 1 if v.numel() else row.new_tensor(0.0)
    lo, hi = v.numel() // 2, max(v.numel() * 5 // 6, v.numel() // 2 + 1)
    gaps = v[lo + 1 : hi + 1] - v[lo:hi]
    j = lo + int(gaps.argmax())
    return (v[j] + v[j + 1]) / 2


# Windows from key 0 (one request), and all in keys [150, 390) of 400 (a batch's later request:
# the column splits share that window's tiles, ``_window_split``).
CANDIDATE_WINDOWS = {"from_key_0": (200, [0, 0, 30, 0, 10, 0], [200, 150, 180, 0, 11, 199]),
                     "late_keys": (400, [150, 150, 170, 150, 200], [390, 300, 390, 151, 389])}


@pytest.mark.parametrize("windows", list(CANDIDATE_WINDOWS))
@pytest.mark.parametrize("splits", [False, True], ids=["one_split", "column_splits"])
def test_candidates_are_every_kept_entry_once_with_and_without_column_splits(monkeypatch, splits,
                                                                             windows):
    """The candidate kernel's buffers, with one program a row block and with the columns split
    across programs, its kept entries stored in the next tile's step (the last tile's after the
    loop): each row's count and columns are its window's entries at or above the threshold,
    recomputed from the oracle's logits (thresholds off the scores' float32 rounding)."""
    from glm_dsa.kernels import mqa_logits
    from glm_dsa.kernels.mqa_logits import launch_mqa_candidates

    pin_logits_configs(monkeypatch)
    # No splits: the grid's target is one program per row block; splits: 64 programs.
    monkeypatch.setattr(mqa_logits, "INTERPRET_PROGRAMS", 64 if splits else 1)
    if not splits:
        monkeypatch.setattr(mqa_logits, "PROGRAMS_PER_SM", 0)
    N, starts, ends = CANDIDATE_WINDOWS[windows]
    S, H, D = len(starts), 4, 128
    q, k, k_scale, w = _inputs(S, H, D, N, seed=61)
    ks = torch.tensor(starts, dtype=torch.int32, device=DEV)
    ke = torch.tensor(ends, dtype=torch.int32, device=DEV)
    ref = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    thr = torch.stack([_threshold_between_scores(r[torch.isfinite(r)]) for r in ref])
    counters = torch.zeros((S, COUNTERS), dtype=torch.int32, device=DEV)
    keys, cols = launch_mqa_candidates(q, k, k_scale, w, ks, ke, thr, counters, N)
    for m in range(S):
        s, e = int(ks[m]), int(ke[m])
        expected = [j - s for j in range(s, e) if float(ref[m, j]) >= float(thr[m])]
        n = int(counters[m, 0])
        assert n == len(expected), m
        assert sorted(cols[m, :n].tolist()) == expected, m


def test_sample_stride_expects_sample_hits_above_the_kth_key_up_to_the_sample_size():
    """``topk / SAMPLE_HITS`` keys apart (16 expected sample points above the k-th key)
    until the span would need more than ``SAMPLE`` of them: 2048 / 16 = 128 at 131K and at
    1M keys (1,024 and 8,192 sampled), ⌈4M / 8192⌉ = 512 at 4M."""
    from glm_dsa.kernels.indexer import sample_stride

    assert sample_stride(131_072, 2048) == 128
    assert sample_stride(1_048_576, 2048) == 128
    assert sample_stride(4_194_304, 2048) == 512
    assert sample_stride(300, 8) == 1
    assert sample_stride(12_289, 2048) == 128


def _assert_exact_topk_of(out, logits, ks, ke, topk):
    """``out`` is a top-k of ``logits``' rows: distinct, inside the window, no unselected
    entry scoring above a selected one, and, among the keys tied at the k-th value, the lowest
    columns: the oracle's stable-order choice, in ascending column order."""
    assert out.shape == (logits.shape[0], topk) and out.dtype == torch.int32
    expected = oracle.topk_per_row(logits, ks, ke, topk)
    for m in range(out.shape[0]):
        assert out[m].tolist() == ascending(expected[m].tolist()), m
    for m in range(out.shape[0]):
        s, e = int(ks[m]), int(ke[m])
        n = e - s
        if n <= topk:
            assert out[m].tolist() == list(range(n)) + [-1] * (topk - n), m
            continue
        idx = out[m].long()
        assert len(set(idx.tolist())) == topk and bool(((idx >= 0) & (idx < n)).all()), m
        row = logits[m, s:e]
        chosen = torch.zeros(n, dtype=torch.bool, device=row.device)
        chosen[idx] = True
        assert row[chosen].min() >= row[~chosen].max(), m


def pin_logits_configs(monkeypatch):
    """One config for the candidate and logits kernels, so that ``_kernel_logits`` computes
    the tiles ``indexer_topk`` computes (the head sum's order follows the tile shape)."""
    from glm_dsa.kernels import mqa_logits

    one = mqa_logits._mqa_candidates_tuned.configs[0]
    monkeypatch.setattr(mqa_logits._mqa_candidates_tuned, "configs", [one])
    # The rows redone from full logits: the logits kernel with the same tiles.
    monkeypatch.setattr(mqa_logits._mqa_logits_tuned, "configs", [mqa_logits.logits_config_of(one)])


def _tied_keys(N, D, levels, seed):
    """fp8 keys drawn from ``levels`` distinct vectors, scale 1: logits take ≤ ``levels``
    values per row, so the k-th value is tied with hundreds of keys."""
    g = torch.Generator().manual_seed(seed)
    table = torch.randn(levels, D, generator=g).to(torch.float8_e4m3fn)
    k = table[torch.randint(0, levels, (N,), generator=g)]
    return k.to(DEV), torch.ones(N, device=DEV)


def _causal_case(S, N, keys, seed, later_from):
    """A causal chunk of ``S`` rows over ``N`` keys (4 heads of 128): random keys, or ``tied``
    ones (``_tied_keys``, 3 levels); windows ``[0, ke)``, ``[100, ke)`` from row ``later_from``."""
    q, k, k_scale, w = _inputs(S, 4, 128, N, seed=seed)
    if keys == "tied":
        k, k_scale = _tied_keys(N, 128, 3, seed=seed + 1)
    ks = torch.zeros(S, dtype=torch.int32, device=DEV)
    ks[later_from:] = 100
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=DEV)
    return q, k, k_scale, w, ks, ke


# Module constants indexer_topk reads at each call: the sample threshold with a stride > 1
# (SAMPLE below the longest window), a threshold aimed too high (fewer than topk
# candidates: those rows are redone from their full logits), and a stride set by the sample
# hits (topk / SAMPLE_HITS = 4 keys) rather than by SAMPLE.
CANDIDATE_PATHS = {"sample_stride": {"SAMPLE": 16}, "too_few_candidates": {"SAMPLE": 16, "TARGET_FACTOR": 0.2},
                   "hits_stride": {"SAMPLE_HITS": 2}}


@pytest.mark.parametrize("path", list(CANDIDATE_PATHS))
@pytest.mark.parametrize("keys", ["random", "tied"])
def test_indexer_topk_is_an_exact_topk_of_the_kernels_own_logits(monkeypatch, path, keys):
    """Windows longer than the candidate buffer (``CAND_FACTOR · topk`` = 48 slots), shorter
    than it, shorter than topk and empty, from key 0 (causal) and from a later start."""
    from glm_dsa.kernels import indexer as fast, topk as topk_mod

    pin_logits_configs(monkeypatch)
    for name, value in CANDIDATE_PATHS[path].items():
        monkeypatch.setattr(fast if name == "SAMPLE" else topk_mod, name, value)
    topk = 8
    q, k, k_scale, w, ks, ke = _causal_case(24, 300, keys, seed=41, later_from=20)
    ke[:6] = torch.tensor([0, 3, 8, 9, 40, 48], dtype=torch.int32)  # empty … at the buffer size
    fast_out = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    _assert_exact_topk_of(fast_out, _kernel_logits(q, w, k, k_scale, ks, ke), ks, ke, topk)


@pytest.mark.parametrize("keys", ["random", "tied"])
def test_indexer_topk_is_the_same_bits_whatever_order_its_candidates_land_in(monkeypatch,
                                                                             shuffled_atomics,
                                                                             keys):
    """The candidate kernel appends a row's kept keys in the order its atomics are served (on
    the CPU shuffled by tests/conftest.py's ``shuffled_atomics``; the bare interpreter appends
    in column order). Three orders: each an exact top-k of the kernel's logits, ascending, all
    the same bits (what lets a captured step and an eager one agree)."""
    from glm_dsa.kernels import indexer as fast

    pin_logits_configs(monkeypatch)
    monkeypatch.setattr(fast, "SAMPLE", 16)
    topk = 8
    q, k, k_scale, w, ks, ke = _causal_case(12, 300, keys, seed=44, later_from=8)
    logits = _kernel_logits(q, w, k, k_scale, ks, ke)
    outs = []
    for seed in range(3):
        shuffled_atomics(seed)
        out = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
        _assert_exact_topk_of(out, logits, ks, ke, topk)
        outs.append(out.cpu())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_indexer_topk_redoes_rows_whose_ties_overflow_the_buffer(monkeypatch):
    """Every key equal: each candidate buffer overflows, every long row is redone from its
    full logits, and the window's first ``topk`` keys are taken."""
    from glm_dsa.kernels import indexer as fast

    monkeypatch.setattr(fast, "SAMPLE", 16)
    S, H, D, N, topk = 6, 4, 128, 200, 4
    q = torch.full((S, H, D), 0.5).to(torch.float8_e4m3fn).to(DEV)
    k = torch.full((N, D), 0.25).to(torch.float8_e4m3fn).to(DEV)
    k_scale, w = torch.ones(N, device=DEV), torch.ones(S, H, device=DEV)
    ks = torch.zeros(S, dtype=torch.int32, device=DEV)
    ke = torch.tensor([200, 150, 30, 4, 25, 199], dtype=torch.int32, device=DEV)
    out = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    logits = torch.full((S, N), 1.0, device=DEV)
    _assert_exact_topk_of(out, logits, ks, ke, topk)


@pytest.mark.parametrize("rows_per_launch", [1, 4])
def test_indexer_topk_launches_of_few_rows_give_the_same_sets(monkeypatch, rows_per_launch):
    """A small budget splits the rows into several launches (each with its own span and
    sample); the sets are those of one launch (exact top-k of the same logits, ties apart)."""
    from glm_dsa.kernels import indexer as fast

    pin_logits_configs(monkeypatch)
    monkeypatch.setattr(fast, "SAMPLE", 16)
    S, H, D, N, topk = 9, 4, 128, 200, 6
    q, k, k_scale, w = _inputs(S, H, D, N, seed=43)
    ks = torch.zeros(S, dtype=torch.int32, device=DEV)
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=DEV)
    whole = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    monkeypatch.setattr(fast, "candidate_rows", lambda *a: rows_per_launch)
    split = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    logits = _kernel_logits(q, w, k, k_scale, ks, ke)
    _assert_exact_topk_of(split, logits, ks, ke, topk)
    assert torch.equal(whole, split)


def test_indexer_topk_reads_the_host_twice_whatever_its_row_chunks(monkeypatch):
    """The input checks' read and one after the last launch (any row redone, any NaN): no
    read of a chunk's span, so the host queues every launch without waiting for the GPU.
    Counted at the reads glm_dsa's own code makes (``bool``, ``int``, ``item``, ``tolist``,
    ``nonzero``), three row chunks."""
    import sys

    from glm_dsa.kernels import indexer as fast

    pin_logits_configs(monkeypatch)
    # Every key sampled (stride 1 at this length): the thresholds hold every row's top-k, no
    # row is redone (a redone row's own loop reads more).
    monkeypatch.setattr(fast, "candidate_rows", lambda *a: 4)
    S, H, D, N, topk = 11, 4, 128, 200, 6
    q, k, k_scale, w = _inputs(S, H, D, N, seed=44)
    ks = torch.zeros(S, dtype=torch.int32, device=DEV)
    ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=DEV)
    reads = []
    for name in ("__bool__", "__int__", "item", "tolist", "nonzero"):
        real = getattr(torch.Tensor, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            if sys._getframe(1).f_globals.get("__name__", "").startswith("glm_dsa"):
                reads.append(_name)
            return _real(self, *a, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    out = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**30)
    assert reads == ["__bool__", "tolist"], reads
    monkeypatch.undo()
    _assert_exact_topk_of(out, _kernel_logits(q, w, k, k_scale, ks, ke), ks, ke, topk)


def test_candidate_rows_stay_within_what_the_logits_budget_holds():
    from glm_dsa.budget import max_logit_rows
    from glm_dsa.kernels.indexer import candidate_row_bytes, candidate_rows

    S, N, D, topk, budget = 32_768, 1_015_808, 128, 2048, 6_004_395_212
    rows = candidate_rows(S, N, D, topk, budget)
    assert rows == S  # the whole GLM-5.3 chunk in one launch on an H200's budget
    assert rows * candidate_row_bytes(N, topk) + 8192 * (D + 4) <= 4 * max_logit_rows(S, N, budget) * N
    small = candidate_rows(S, N, D, topk, 1 << 28)
    assert 1 <= small < S
    assert small * candidate_row_bytes(N, topk) <= 1 << 28
    # SGLang's rule keeps at least one row of logits: 4 · N bytes.
    assert candidate_rows(S, N, D, topk, 0) * candidate_row_bytes(N, topk) <= 4 * N


@pytest.mark.cuda
@pytest.mark.parametrize("case", ["1m_keys", "ties", "short_rows"])
def test_indexer_topk_is_an_exact_topk_of_the_kernels_own_logits_at_glm_shapes(monkeypatch, case):
    """GLM-5.3's indexer (H 32, D 128, topk 2048) on rows of ~1M keys (the last step of a
    1M-token prefill), on keys with massive exact ties, and on causal rows around topk and
    the candidate buffer's size; checked against the kernel's own float32 logits."""
    pin_logits_configs(monkeypatch)
    topk = 2048
    if case == "1m_keys":
        S, N = 8, 1_048_576
        q, k, k_scale, w = _inputs(S, 32, 128, N, seed=51)
        ks = torch.zeros(S, dtype=torch.int32, device=DEV)
        ke = torch.arange(N - S + 1, N + 1, dtype=torch.int32, device=DEV)
    elif case == "ties":
        S, N = 16, 65_536
        q, _, _, w = _inputs(S, 32, 128, N, seed=52)
        k, k_scale = _tied_keys(N, 128, 5, seed=53)
        ks = torch.zeros(S, dtype=torch.int32, device=DEV)
        ke = torch.linspace(1000, N, S).to(torch.int32).to(DEV)
    else:
        S, N = 64, 20_000
        q, k, k_scale, w = _inputs(S, 32, 128, N, seed=54)
        ks = torch.zeros(S, dtype=torch.int32, device=DEV)
        ke = torch.tensor([0, 1, 2047, 2048, 2049, 12287, 12288, 12289] * 8, dtype=torch.int32,
                          device=DEV)  # fmt: skip
        ke[8:] = torch.randint(1, N + 1, (S - 8,), generator=torch.Generator().manual_seed(5)).to(DEV).int()
    out = indexer_topk(q, w, k, k_scale, ks, ke, topk, 2**33)
    _assert_exact_topk_of(out, _kernel_logits(q, w, k, k_scale, ks, ke), ks, ke, topk)
