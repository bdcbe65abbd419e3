"""The DSA indexer: logits, top-k, index transforms, row chunking and the Indexer module.

Expected values come from computations written here: a float64 loop over heads on the
dequantized FP8 inputs (the dot products of E4M3 vectors are exact in float64), DeepGEMM's
unquantized float32 reference formula, Python's ``sorted`` with the canonical key
``(-score, index)``, explicit loops for the index transforms, and a float64 re-derivation of
the projections (dense Sylvester Hadamard matrix, explicit RoPE pairs, LayerNorm formula).
"""

from __future__ import annotations

import math
import contextlib
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import glm_dsa.budget as budget_mod
import glm_dsa.indexer as ix
from glm_dsa.batch import ForwardBatch
from glm_dsa.config import get_config
from glm_dsa.fp8 import act_quant
from glm_dsa.hadamard import hadamard_transform
from glm_dsa.indexer import (
    Indexer,
    indexer_topk,
    mqa_logits,
    paged_mqa_logits,
    topk_per_row,
    topk_transform_paged,
    topk_transform_ragged,
)
from glm_dsa.budget import logits_budget_bytes, max_logit_rows
from glm_dsa.kv_format import index_k_load, index_k_page_bytes, index_k_store

D = 128
PAGE = 64
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- helpers
def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """DeepGEMM's ``1 - 2Σxy / Σ(x² + y²)`` in float64 over the entries finite in both."""
    x, y = x.double(), y.double()
    both = torch.isfinite(x) & torch.isfinite(y)
    x, y = x[both], y[both]
    denom = (x * x + y * y).sum()
    return 0.0 if denom == 0 else float(1 - 2 * (x * y).sum() / denom)


def fp8_inputs(seed: int, S: int, H: int, S_kv: int, weights_dtype=torch.float32):
    """Random q_fp8 [S, H, D], k_fp8 [S_kv, D], k_scale [S_kv], weights [S, H]."""
    g = torch.Generator().manual_seed(seed)
    q_fp8, _ = act_quant(torch.randn(S, H, D, generator=g), D)
    k_fp8, k_scale = act_quant(torch.randn(S_kv, D, generator=g) * 3, D, "ue8m0")
    weights = torch.randn(S, H, generator=g, dtype=torch.float64).to(weights_dtype)
    return q_fp8, k_fp8, k_scale[:, 0], weights


def logits_loop64(q_fp8, k_fp8, k_scale, weights, ks, ke) -> torch.Tensor:
    """float64 ``Σ_h w · relu(q_h · k) · k_scale``, one head at a time, −inf outside [ks, ke)."""
    q, k = q_fp8.double(), k_fp8.double()
    S, H, _ = q.shape
    out = torch.zeros(S, k.shape[0], dtype=torch.float64)
    for h in range(H):
        out += weights.double()[:, h, None] * torch.relu(q[:, h] @ k.T)
    out *= k_scale.double()[None, :]
    for m in range(S):
        out[m, : int(ks[m])] = NEG_INF
        out[m, int(ke[m]) :] = NEG_INF
    return out


def canonical_topk(logits: torch.Tensor, starts, ends, topk: int) -> torch.Tensor:
    """Per row: ``0..len-1`` then −1 if ``len ≤ topk``, else ``sorted`` by (−score, index)."""
    rows = []
    for m in range(logits.shape[0]):
        s, e = int(starts[m]), int(ends[m])
        if e - s <= topk:
            chosen = list(range(e - s))
        else:
            vals = logits[m].tolist()
            chosen = [j - s for j in sorted(range(s, e), key=lambda j: (-vals[j], j))[:topk]]
        rows.append(chosen + [-1] * (topk - len(chosen)))
    return torch.tensor(rows, dtype=torch.int32).reshape(len(rows), topk)


def ragged_batch(requests: list[tuple[int, int]]) -> ForwardBatch:
    """Contiguous ragged batch of (prefix_len, extend_len) requests."""
    return ForwardBatch.contiguous([e for _, e in requests], [p for p, _ in requests])


@contextmanager
def patched(**values):
    """Set module constants of glm_dsa.indexer (or, for the budget rule's, of glm_dsa.budget)
    for the duration of a block."""
    in_budget = {k: v for k, v in values.items() if hasattr(budget_mod, k)}
    in_indexer = {k: v for k, v in values.items() if k not in in_budget}
    with mock.patch.multiple(budget_mod, **in_budget) if in_budget else contextlib.nullcontext():
        with mock.patch.multiple(ix, **in_indexer) if in_indexer else contextlib.nullcontext():
            yield


requests_st = st.lists(
    st.tuples(st.integers(0, 90), st.integers(1, 40)), min_size=1, max_size=3
)


# ----------------------------------------------------------------------------- logits
@given(
    requests=requests_st,
    H=st.sampled_from([4, 8]),
    seed=st.integers(0, 2**31 - 1),
    tile_bytes=st.sampled_from([3000, 40_000, 256 * 2**20]),
    weights_dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_mqa_logits_equal_float64_loop_over_heads(requests, H, seed, tile_bytes, weights_dtype):
    batch = ragged_batch(requests)
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(seed, S, H, S_kv, weights_dtype)
    with patched(TILE_BYTES=tile_bytes):
        got = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    expected = logits_loop64(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    assert got.dtype == weights_dtype and got.shape == (S, S_kv)
    assert torch.equal(torch.isneginf(got), torch.isneginf(expected))
    assert not torch.isnan(got).any()
    assert calc_diff(got, expected) < 1e-9
    # Elementwise: a rounding per gate product and head sum, plus the key scale, each at most
    # eps relative to Σ_h |w_h| · relu(q_h · k) · k_scale (the dot products are exact).
    magnitude = logits_loop64(q_fp8, k_fp8, k_scale, w.abs(), batch.ks, batch.ke)
    finite = torch.isfinite(expected)
    err = (got.double() - expected)[finite].abs()
    eps = torch.finfo(weights_dtype).eps
    assert bool((err <= 2 * (H + 3) * eps * magnitude[finite]).all())


@given(
    requests=requests_st,
    seed=st.integers(0, 2**31 - 1),
    tile_bytes=st.sampled_from([1, 6000, 30_000]),
)
def test_mqa_logits_are_bitwise_independent_of_tiling(requests, seed, tile_bytes):
    batch = ragged_batch(requests)
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(seed, S, 8, S_kv)
    whole = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    with patched(TILE_BYTES=tile_bytes):
        tiled = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    assert torch.equal(whole, tiled)


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_mqa_logits_match_unquantized_formula_within_deepgemm_bound(scale_fmt):
    # DeepGEMM test_attention.py: bf16 q / kv, fp32 reference einsum, calc_diff < 1e-3.
    g = torch.Generator().manual_seed(7)
    S, H, S_kv = 96, 8, 300
    q = torch.randn(S, H, D, generator=g).bfloat16()
    kv = torch.randn(S_kv, D, generator=g).bfloat16()
    weights = torch.randn(S, H, generator=g)
    ks = torch.randint(0, 100, (S,), generator=g, dtype=torch.int32)
    ke = torch.minimum(ks + torch.randint(1, 250, (S,), generator=g, dtype=torch.int32),
                       torch.tensor(S_kv, dtype=torch.int32))
    score = torch.einsum("mhd,nd->hmn", q.float(), kv.float()).relu() * weights.T[:, :, None]
    ref = score.sum(dim=0)
    col = torch.arange(S_kv)
    ref = ref.masked_fill((col < ks[:, None]) | (col >= ke[:, None]), NEG_INF)

    q_fp8, q_scale = act_quant(q, D, scale_fmt)  # one scale per (token, head), folded in w
    k_fp8, k_scale = act_quant(kv, D, scale_fmt)
    got = mqa_logits(q_fp8, k_fp8, k_scale[:, 0], weights * q_scale[..., 0], ks, ke)
    assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
    diff = calc_diff(got, ref)
    print(f"\nFP8 logits vs unquantized fp32 formula (scale_fmt={scale_fmt}): calc_diff {diff:.2e}")
    assert diff < 1e-3


@given(requests=requests_st, seed=st.integers(0, 2**31 - 1))
def test_unclean_logits_equal_clean_logits_inside_each_range(requests, seed):
    batch = ragged_batch(requests)
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(seed, S, 4, S_kv)
    clean = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    raw = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke, clean_logits=False)
    inside = ~torch.isneginf(clean)
    assert torch.equal(raw[inside], clean[inside])
    assert torch.isfinite(raw).all()


def test_mqa_logits_reject_ranges_past_the_keys():
    q_fp8, k_fp8, k_scale, w = fp8_inputs(0, 3, 4, 10)
    ks = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="ke"):
        mqa_logits(q_fp8, k_fp8, k_scale, w, ks, torch.tensor([1, 11, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="ks"):
        mqa_logits(q_fp8, k_fp8, k_scale, w, ks, torch.tensor([1, 1, 6], dtype=torch.int32))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        mqa_logits(q_fp8.float(), k_fp8, k_scale, w, ks, ks)


# ----------------------------------------------------------------------------- paged logits
def build_page_pool(seed: int, ctx_lens: list[int], spare_pages: int = 3):
    """Index-K pages holding each request's keys on shuffled pages, and its block table."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-c // PAGE) for c in ctx_lens]
    num_pages = sum(n_pages) + spare_pages
    perm = torch.randperm(num_pages, generator=g)
    pages = torch.zeros(num_pages, index_k_page_bytes(PAGE, D), dtype=torch.uint8)
    block_table = torch.zeros(len(ctx_lens), max(n_pages) + 1, dtype=torch.int32)
    keys, used = [], 0
    for b, (c, n) in enumerate(zip(ctx_lens, n_pages)):
        block_table[b, :n] = perm[used : used + n].to(torch.int32)
        used += n
        k_fp8, k_scale = act_quant(torch.randn(c, D, generator=g), D, "ue8m0")
        pos = torch.arange(c)
        slots = block_table[b, pos // PAGE].long() * PAGE + pos % PAGE
        index_k_store(pages, slots, k_fp8, k_scale[:, 0], PAGE)
        keys.append((k_fp8, k_scale[:, 0]))
    return pages, block_table, keys


@given(
    ctx_lens=st.lists(st.integers(2, 150), min_size=1, max_size=3),
    next_n=st.sampled_from([1, 2]),
    two_d=st.booleans(),
    seed=st.integers(0, 2**31 - 1),
)
def test_paged_logits_equal_ragged_logits_and_the_float64_loop(ctx_lens, next_n, two_d, seed):
    H = 4
    B = len(ctx_lens)
    pages, block_table, keys = build_page_pool(seed, ctx_lens)
    g = torch.Generator().manual_seed(seed + 1)
    q_fp8, _ = act_quant(torch.randn(B, next_n, H, D, generator=g), D)
    weights = torch.randn(B * next_n, H, generator=g)
    if two_d:
        ends = [
            [int(torch.randint(0, c + 1, (), generator=g)) for _ in range(next_n)]
            for c in ctx_lens
        ]
        context_lens = torch.tensor(ends, dtype=torch.int32)
    else:
        ends = [[c - next_n + j + 1 for j in range(next_n)] for c in ctx_lens]
        context_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    max_ctx = max(ctx_lens) + 5
    paged = paged_mqa_logits(q_fp8, pages, weights, context_lens, block_table, max_ctx)
    assert paged.shape == (B * next_n, max_ctx)

    # The same rows against the requests' keys concatenated (ragged layout).
    k_all = torch.cat([k for k, _ in keys])
    s_all = torch.cat([s for _, s in keys])
    offsets = [0]
    for c in ctx_lens:
        offsets.append(offsets[-1] + c)
    ks = torch.tensor([offsets[b] for b in range(B) for _ in range(next_n)], dtype=torch.int32)
    ke = torch.tensor([offsets[b] + e for b in range(B) for e in ends[b]], dtype=torch.int32)
    ragged = mqa_logits(q_fp8.reshape(B * next_n, H, D), k_all, s_all, weights, ks, ke)
    expected = logits_loop64(q_fp8.reshape(B * next_n, H, D), k_all, s_all, weights, ks, ke)
    for b, c in enumerate(ctx_lens):
        rows = slice(b * next_n, (b + 1) * next_n)
        cols = slice(offsets[b], offsets[b] + c)
        assert torch.equal(paged[rows, :c], ragged[rows, cols])
        assert torch.isneginf(paged[rows, c:]).all()
        assert torch.equal(torch.isneginf(paged[rows, :c]), torch.isneginf(expected[rows, cols]))
        assert calc_diff(paged[rows, :c], expected[rows, cols]) < 1e-9


def test_paged_logits_reject_a_short_block_table():
    pages, block_table, _ = build_page_pool(0, [130])
    q_fp8, _ = act_quant(torch.randn(1, 1, 4, D), D)
    with pytest.raises(ValueError, match="pages"):
        paged_mqa_logits(q_fp8, pages, torch.ones(1, 4), torch.tensor([130], dtype=torch.int32),
                         block_table[:, :2], 130)


# ----------------------------------------------------------------------------- top-k
@given(
    requests=st.lists(st.tuples(st.integers(0, 60), st.integers(1, 30)), min_size=1, max_size=3),
    topk=st.sampled_from([8, 16, 64]),
    seed=st.integers(0, 2**31 - 1),
    chunk_rows=st.lists(st.integers(2, 40), min_size=1, max_size=2),
)
def test_topk_is_independent_of_row_budget(requests, topk, seed, chunk_rows):
    batch = ragged_batch(requests)
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(seed, S, 4, S_kv)
    logits = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    expected = canonical_topk(logits, batch.ks, batch.ke, topk)

    seen_rows: list[int] = []
    real_mqa_logits = ix._mqa_logits

    def spy(q, *args, **kwargs):
        seen_rows.append(q.shape[0])
        return real_mqa_logits(q, *args, **kwargs)

    # One row per chunk, a few row counts, all rows in one chunk (4·S·S_kv bytes), no limit.
    budgets = [4 * S_kv] + [4 * S_kv * r for r in chunk_rows] + [4 * S * S_kv, 2**62]
    with patched(NO_CHUNK_LOGITS=0, _mqa_logits=spy):
        for budget in budgets:
            seen_rows.clear()
            got = indexer_topk(q_fp8, w, k_fp8, k_scale, batch.ks, batch.ke, topk, budget)
            assert torch.equal(got, expected), f"budget {budget} bytes"
            assert max(seen_rows, default=0) <= max_logit_rows(S, S_kv, budget)
    rel = torch.arange(topk)
    lens = (batch.ke - batch.ks).long()[:, None]
    # A future key (past the row's causal end) is never selected.
    assert bool(((expected == -1) | ((expected >= 0) & (expected < lens))).all())
    assert bool((expected[rel[None, :].expand(S, -1) >= lens] == -1).all())


@given(
    lens=st.lists(st.integers(0, 40), min_size=1, max_size=6),
    topk=st.sampled_from([16, 40, 64]),
    seed=st.integers(0, 2**31 - 1),
)
def test_short_rows_return_positions_then_minus_one(lens, topk, seed):
    g = torch.Generator().manual_seed(seed)
    N = 50
    starts = torch.tensor([int(torch.randint(0, N - n + 1, (), generator=g)) for n in lens],
                          dtype=torch.int32)
    ends = starts + torch.tensor(lens, dtype=torch.int32)
    logits = torch.randn(len(lens), N, generator=g) * 1e6
    got = topk_per_row(logits, starts, ends, topk)
    for m, n in enumerate(lens):
        if n <= topk:
            assert got[m].tolist() == list(range(n)) + [-1] * (topk - n)
    assert torch.equal(got, canonical_topk(logits, starts, ends, topk))


@given(
    rows=st.integers(1, 6),
    N=st.integers(1, 80),
    topk=st.sampled_from([1, 4, 16]),
    levels=st.integers(0, 4),
    seed=st.integers(0, 2**31 - 1),
)
def test_topk_breaks_ties_by_lower_index_and_ignores_columns_outside_the_range(
    rows, N, topk, levels, seed
):
    g = torch.Generator().manual_seed(seed)
    # Few distinct values (ties everywhere), including valid -inf and +inf entries.
    palette = torch.tensor([NEG_INF, -1.0, 0.0, -0.0, 2.5, float("inf")])[: levels + 2]
    logits = palette[torch.randint(0, len(palette), (rows, N), generator=g)]
    starts = torch.randint(0, N + 1, (rows,), generator=g)
    ends = torch.minimum(starts + torch.randint(0, N + 1, (rows,), generator=g), torch.tensor(N))
    # Garbage outside the range (uncleaned kernel output), NaN included, is never read.
    outside = (torch.arange(N) < starts[:, None]) | (torch.arange(N) >= ends[:, None])
    garbage = torch.tensor([float("nan"), float("inf"), 1e30])[
        torch.randint(0, 3, (rows, N), generator=g)
    ]
    logits = torch.where(outside, garbage, logits)
    got = topk_per_row(logits, starts.int(), ends.int(), topk)
    assert torch.equal(got, canonical_topk(logits, starts, ends, topk))


def test_topk_rejects_nan_inside_a_row_range():
    logits = torch.randn(2, 30)
    logits[1, 7] = float("nan")
    starts = torch.tensor([0, 0], dtype=torch.int32)
    ends = torch.tensor([30, 30], dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        topk_per_row(logits, starts, ends, 8)


def test_topk_selection_is_deterministic_across_runs():
    batch = ragged_batch([(150, 40), (0, 30)])
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(3, S, 8, S_kv)
    runs = [indexer_topk(q_fp8, w, k_fp8, k_scale, batch.ks, batch.ke, 16, 2**30) for _ in range(3)]
    assert all(torch.equal(runs[0], r) for r in runs[1:])


# ----------------------------------------------------------------------------- index transforms
@given(
    rows=st.integers(1, 6),
    topk=st.integers(1, 20),
    max_pages=st.integers(1, 5),
    seed=st.integers(0, 2**31 - 1),
)
def test_topk_transforms_map_request_positions_and_keep_minus_one(rows, topk, max_pages, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(-1, max_pages * PAGE, (rows, topk), generator=g, dtype=torch.int32)
    offsets = torch.randint(0, 10_000, (rows,), generator=g)
    page_table = torch.randint(0, 1000, (rows, max_pages), generator=g, dtype=torch.int32)
    ragged = topk_transform_ragged(idx, offsets)
    paged = topk_transform_paged(idx, page_table, PAGE)
    for r in range(rows):
        for t in range(topk):
            i = int(idx[r, t])
            exp_ragged = -1 if i == -1 else i + int(offsets[r])
            exp_paged = -1 if i == -1 else int(page_table[r, i // PAGE]) * PAGE + i % PAGE
            assert int(ragged[r, t]) == exp_ragged
            assert int(paged[r, t]) == exp_paged
    assert ragged.dtype == paged.dtype == torch.int32


def test_topk_transform_paged_rejects_an_index_past_the_page_table():
    with pytest.raises(ValueError, match="pages"):
        topk_transform_paged(torch.tensor([[2 * PAGE]], dtype=torch.int32),
                      torch.zeros(1, 2, dtype=torch.int32), PAGE)


# ----------------------------------------------------------------------------- budget
def test_logits_budget_follows_the_sglang_rule(monkeypatch):
    total = 141 * 10**9
    for free, expected in [(100 * 10**9, 0.2 * 0.2 * total), (20 * 10**9, 0.2 * 20 * 10**9)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, total))
        # 1 − 0.8 is 0.19999999999999996 in binary, and the result is truncated to bytes.
        assert abs(logits_budget_bytes("cuda:0", mem_fraction_static=0.8) - expected) < 2
    # ≈ 5.6 GB on a 141 GB H200 → ≈ 1340 rows of logits at 1M keys (docs/conventions.md §12).
    rows = max_logit_rows(32768, 2**20, int(0.2 * 0.2 * total))
    assert rows == int(0.2 * 0.2 * total) // (4 * 2**20) and 1300 < rows < 1400


def test_logits_budget_needs_explicit_bytes_on_cpu():
    with pytest.raises(ValueError, match="on CPU pass an explicit budget in bytes"):
        logits_budget_bytes("cpu")


@given(
    num_q=st.integers(1, 5000),
    num_k=st.integers(0, 5000),
    budget=st.integers(0, 10**8),
)
def test_max_logit_rows_follows_the_sglang_rule(num_q, num_k, budget):
    rows = max_logit_rows(num_q, num_k, budget)
    if num_q * num_k < 8_000_000 or 4 * num_q * num_k <= budget:
        assert rows == num_q
    else:
        assert rows == max(1, budget // (4 * num_k))
        assert rows == 1 or 4 * rows * num_k <= budget


# ----------------------------------------------------------------------------- Hadamard
def logits_formula64(q, k, w) -> torch.Tensor:
    """Unquantized ``Σ_h w · relu(q_h · k)`` in float64: q [S, H, D], k [N, D], w [S, H]."""
    dots = torch.einsum("shd,nd->shn", q.double(), k.double())
    return (dots.relu() * w.double()[:, :, None]).sum(dim=1)


def fp8_logits(q, k, w, scale_fmt):
    q_fp8, q_scale = act_quant(q, D, scale_fmt)
    k_fp8, k_scale = act_quant(k, D, scale_fmt)
    S, N = q.shape[0], k.shape[0]
    return mqa_logits(q_fp8, k_fp8, k_scale[:, 0], (w * q_scale[..., 0]).float(),
                      torch.zeros(S, dtype=torch.int32), torch.full((S,), N, dtype=torch.int32))


def outlier_inputs(seed: int, shared: bool, magnitude: float = 30.0):
    """Keys with 4 large channels (scaled and offset, like LayerNorm gains and biases)."""
    g = torch.Generator().manual_seed(seed)
    S, H, N = 64, 8, 512
    channels = torch.randperm(D, generator=g)[:4]
    q = torch.randn(S, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(N, D, generator=g, dtype=torch.float64)
    k[:, channels] = k[:, channels] * magnitude + magnitude
    if shared:  # queries that attend along the keys' dominant channels
        q[:, :, channels] *= magnitude / 4
    w = torch.rand(S, H, generator=g, dtype=torch.float64)
    return q, k, w


def test_rotation_leaves_unquantized_logits_unchanged():
    q, k, w = outlier_inputs(0, shared=True)
    plain = logits_formula64(q, k, w)
    rotated = logits_formula64(hadamard_transform(q, D**-0.5), hadamard_transform(k, D**-0.5), w)
    assert torch.allclose(rotated, plain, rtol=1e-12, atol=1e-12 * plain.abs().max().item())


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_rotation_reduces_fp8_logit_error_on_outlier_channels(scale_fmt):
    report = []
    for shared in (True, False):
        q, k, w = outlier_inputs(1, shared)
        exact = logits_formula64(q, k, w)
        plain = fp8_logits(q.float(), k.float(), w.float(), scale_fmt)
        rot = fp8_logits(
            hadamard_transform(q, D**-0.5).float(), hadamard_transform(k, D**-0.5).float(),
            w.float(), scale_fmt,
        )
        errs = [calc_diff(x, exact) for x in (plain, rot)]
        rels = [float((x.double() - exact).norm() / exact.norm()) for x in (plain, rot)]
        report.append((shared, errs, rels))
        print(
            f"\nscale_fmt={scale_fmt} outlier keys, "
            f"{'shared q channels' if shared else 'gaussian q'}: "
            f"calc_diff {errs[0]:.2e} -> {errs[1]:.2e} with Hadamard, "
            f"relative L2 error {rels[0]:.2e} -> {rels[1]:.2e}"
        )
    (_, shared_errs, shared_rels), (_, plain_q_errs, _) = report
    # Queries aligned with the keys' outlier channels: the rotation spreads the few dominant
    # products over all 128 dims, and their FP8 rounding errors average out.
    assert shared_errs[1] < shared_errs[0] / 4 and shared_rels[1] < shared_rels[0] / 2
    # Gaussian queries: E4M3's relative error does not depend on scale, so no gain is expected
    # (nor a loss beyond noise).
    assert plain_q_errs[1] < 2 * plain_q_errs[0]


# ----------------------------------------------------------------------------- Indexer module
def sylvester_hadamard(d: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def rope_pairs64(x, positions, theta: float, interleaved: bool) -> torch.Tensor:
    """Rotate pairs of x [n, ..., r] by positions · theta^(−2i/r); explicit pair indices."""
    r = x.shape[-1]
    out = x.clone()
    for i in range(r // 2):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
        angle = positions.double() * theta ** (-2 * i / r)
        shape = (-1,) + (1,) * (x.dim() - 2)
        c, s = angle.cos().reshape(shape), angle.sin().reshape(shape)
        out[..., a] = x[..., a] * c - x[..., b] * s
        out[..., b] = x[..., a] * s + x[..., b] * c
    return out


def random_indexer(config, seed: int, dtype=torch.float32) -> Indexer:
    torch.manual_seed(seed)
    model = Indexer(config)
    with torch.no_grad():
        model.k_norm.weight.uniform_(0.5, 1.5)
        model.k_norm.bias.normal_(0.0, 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("interleave", [True, False])
def test_projections_equal_a_float64_rederivation(interleave):
    cfg = get_config("tiny").replace(indexer_rope_interleave=interleave)
    model = random_indexer(cfg, 0, torch.float64)
    g = torch.Generator().manual_seed(1)
    n, H, r = 9, cfg.index_n_heads, cfg.qk_rope_head_dim
    x = torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64)
    q_latent = torch.randn(n, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    positions = torch.randperm(5000, generator=g)[:n]
    had = sylvester_hadamard(D) * D**-0.5

    k = x @ model.wk.weight.T
    k = (k - k.mean(-1, keepdim=True)) / torch.sqrt(k.var(-1, unbiased=False, keepdim=True)
                                                    + cfg.index_k_norm_eps)
    k = k * model.k_norm.weight + model.k_norm.bias
    k = torch.cat([rope_pairs64(k[:, :r], positions, cfg.rope_theta, interleave), k[:, r:]], -1)
    expected_k = k @ had.T
    assert torch.allclose(model.project_k(x, positions), expected_k, rtol=0, atol=1e-12)

    q = (q_latent @ model.wq_b.weight.T).view(n, H, D)
    q = torch.cat([rope_pairs64(q[..., :r], positions, cfg.rope_theta, interleave), q[..., r:]], -1)
    q = q @ had.T
    q_fp8, weights = model.project_q(x, q_latent, positions)
    expected_fp8, q_scale = act_quant(q, D, cfg.scale_fmt)
    assert torch.equal(q_fp8.view(torch.uint8), expected_fp8.view(torch.uint8))
    expected_w = (x @ model.weights_proj.weight.T) * H**-0.5 * q_scale[..., 0].double() * D**-0.5
    assert weights.dtype == torch.float64
    assert torch.allclose(weights, expected_w, rtol=1e-13, atol=0)


def test_head_gates_run_in_float32_for_bf16_activations():
    cfg = get_config("tiny")  # scale_fmt ue8m0: q scales are powers of two
    model = random_indexer(cfg, 0, torch.bfloat16)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, cfg.hidden_size, generator=g).bfloat16()
    q_latent = torch.randn(5, cfg.q_lora_rank, generator=g).bfloat16()
    q_fp8, weights = model.project_q(x, q_latent, torch.arange(5))
    assert weights.dtype == torch.float32 and q_fp8.dtype == torch.float8_e4m3fn
    gates = x.double() @ model.weights_proj.weight.double().T  # bf16 values are exact in fp64
    q_scale = weights.double() / (gates * cfg.index_n_heads**-0.5 * D**-0.5)
    # What is left is a power-of-two q scale, up to float32 rounding (a bf16 projection would
    # be off by ~1e-3).
    log2 = q_scale.log2()
    assert (log2 - log2.round()).abs().max() < 1e-5


def make_pages(num_pages: int) -> torch.Tensor:
    return torch.zeros(num_pages, index_k_page_bytes(PAGE, D), dtype=torch.uint8)


def test_forward_writes_the_chunk_keys_before_scoring_and_picks_the_best_keys():
    cfg = get_config("tiny")
    model = random_indexer(cfg, 3)
    g = torch.Generator().manual_seed(4)
    n = 150 + 70
    x = torch.randn(n, cfg.hidden_size, generator=g)
    q_latent = torch.randn(n, cfg.q_lora_rank, generator=g)
    perm = torch.randperm(6, generator=g)
    pos_a, pos_b = torch.arange(150), torch.arange(70)
    slots_a = perm[pos_a // PAGE] * PAGE + pos_a % PAGE  # pages perm[0..2]
    slots_b = perm[3 + pos_b // PAGE] * PAGE + pos_b % PAGE  # pages perm[3..4]
    batch = ForwardBatch.from_slots([0, 0], [150, 70], [slots_a, slots_b])
    pages = make_pages(6)
    with torch.no_grad():
        got = model(x, q_latent, batch, pages, 2**30)
        k_fp8, k_scale = act_quant(model.project_k(x, batch.positions), D, cfg.scale_fmt)
        q_fp8, weights = model.project_q(x, q_latent, batch.positions)
    stored_fp8, stored_scale = index_k_load(pages, batch.out_slots, D, PAGE)
    assert torch.equal(stored_fp8.view(torch.uint8), k_fp8.view(torch.uint8))
    assert torch.equal(stored_scale, k_scale[:, 0])

    # Each row's selection scores the best keys by the float64 loop; near-ties may swap.
    expected = logits_loop64(q_fp8, k_fp8, k_scale[:, 0], weights, batch.ks, batch.ke)
    assert got.shape == (n, cfg.index_topk) and got.dtype == torch.int32
    for m in range(n):
        s, e = int(batch.ks[m]), int(batch.ke[m])
        sel = got[m][got[m] >= 0].long()
        assert len(sel) == min(cfg.index_topk, e - s)
        assert int(sel.max()) < e - s and len(set(sel.tolist())) == len(sel)
        best = expected[m, s:e].sort(descending=True).values[: len(sel)]
        picked = expected[m, s + sel].sort(descending=True).values
        assert torch.allclose(picked, best, rtol=1e-6, atol=1e-6 * best.abs().max().item())


@given(split=st.integers(1, 99), other=st.integers(1, 30), seed=st.integers(0, 2**31 - 1))
def test_forward_with_cached_prefix_equals_cold_prefill(split, other, seed):
    # float64 activations: CPU GEMMs round a row differently depending on how many rows they
    # get, and float32 projection noise would swap near-tied keys; the scoring is exact anyway.
    cfg = get_config("tiny")
    model = random_indexer(cfg, seed % 7, torch.float64)
    g = torch.Generator().manual_seed(seed)
    L = 100  # > index_topk = 64, so late rows really select
    x = torch.randn(L, cfg.hidden_size, generator=g, dtype=torch.float64)
    q_latent = torch.randn(L, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    x_other = torch.randn(other, cfg.hidden_size, generator=g, dtype=torch.float64)
    ql_other = torch.randn(other, cfg.q_lora_rank, generator=g, dtype=torch.float64)
    perm = torch.randperm(8, generator=g)
    pos = torch.arange(L)
    slots_a = perm[pos // PAGE] * PAGE + pos % PAGE  # pages perm[0..1]
    with torch.no_grad():
        cold_batch = ForwardBatch.from_slots([0], [L], [slots_a])
        cold = model(x, q_latent, cold_batch, make_pages(8), 2**30)

        # Chunked prefill: the second chunk scores the first chunk's keys from the pages.
        pages = make_pages(8)
        first = model(x[:split], q_latent[:split],
                      ForwardBatch.from_slots([0], [split], [slots_a[:split]]), pages, 2**30)
        second = model(x[split:], q_latent[split:],
                       ForwardBatch.from_slots([split], [L - split], [slots_a]), pages, 2**30)
        assert torch.equal(torch.cat([first, second]), cold)

        # Prefix-cache hit: request B shares A's prefix pages and computes only its suffix,
        # batched with an unrelated request C.
        pos_b = torch.arange(split, L)
        slots_b = torch.cat([slots_a[:split], perm[3 + pos_b // PAGE] * PAGE + pos_b % PAGE])
        slots_c = perm[6 + torch.arange(other) // PAGE] * PAGE + torch.arange(other) % PAGE
        batch = ForwardBatch.from_slots([split, 0], [L - split, other], [slots_b, slots_c])
        hit = model(torch.cat([x[split:], x_other]), torch.cat([q_latent[split:], ql_other]),
                    batch, pages, 2**30)
        assert torch.equal(hit[: L - split], cold[split:])


# ----------------------------------------------------------------------------- CUDA
@pytest.mark.cuda
def test_cuda_logits_are_bitwise_equal_to_cpu():
    batch = ragged_batch([(300, 200), (0, 150), (1000, 64)])
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(5, S, 32, S_kv)
    cpu = mqa_logits(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    dev = batch.to("cuda")
    gpu = mqa_logits(q_fp8.cuda(), k_fp8.cuda(), k_scale.cuda(), w.cuda(), dev.ks, dev.ke)
    assert torch.equal(gpu.cpu(), cpu)
    expected = logits_loop64(q_fp8, k_fp8, k_scale, w, batch.ks, batch.ke)
    assert calc_diff(gpu.cpu(), expected) < 1e-9


@pytest.mark.cuda
def test_cuda_topk_is_independent_of_row_budget_and_equals_cpu():
    batch = ragged_batch([(2000, 500), (0, 700)])
    S, S_kv = batch.num_tokens, int(batch.cu_seqlens_k[-1])
    q_fp8, k_fp8, k_scale, w = fp8_inputs(6, S, 32, S_kv)
    cpu = indexer_topk(q_fp8, w, k_fp8, k_scale, batch.ks, batch.ke, 256, 2**40)
    dev = batch.to("cuda")
    args = (q_fp8.cuda(), w.cuda(), k_fp8.cuda(), k_scale.cuda(), dev.ks, dev.ke, 256)
    with patched(NO_CHUNK_LOGITS=0):
        for rows in (1, 37, 512, S):
            assert torch.equal(indexer_topk(*args, 4 * S_kv * rows).cpu(), cpu)


@pytest.mark.cuda
def test_cuda_forward_equals_cpu():
    cfg = get_config("small")
    model = random_indexer(cfg, 8)
    g = torch.Generator().manual_seed(9)
    n = 300
    x = torch.randn(n, cfg.hidden_size, generator=g)
    q_latent = torch.randn(n, cfg.q_lora_rank, generator=g)
    batch = ForwardBatch.contiguous([n])
    pages = make_pages(math.ceil(n / PAGE))
    with torch.no_grad():
        cpu = model(x, q_latent, batch, pages.clone(), 2**30)
        gpu = model.cuda()(x.cuda(), q_latent.cuda(), batch.to("cuda"), pages.cuda(), 2**30)
    # Projections may round differently on the GPU (cuBLAS vs CPU GEMMs); selections must
    # agree except for near-ties.
    agree = (gpu.cpu() == cpu).float().mean().item()
    assert agree > 0.99
