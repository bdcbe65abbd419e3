"""Each Triton kernel's host entry called directly, at the shapes and in the states the GPU path
hands it, against the torch computation it replaces (bitwise where the claim is bitwise).

Under Triton's interpreter on the CPU (tests/conftest.py): the top-k select's candidate stage
(which rows it must redo, NaN among candidates, a window at the buffer's edges), the threshold
kernel, the sort of a candidate row's picks, the ``shuffled_atomics`` fixture's slots and the
``shuffled_programs`` fixture's program order (tests/conftest.py), the row select on strided /
non-contiguous logits with NaN counted per row, the indexer's redo of a row that holds NaN, the
launch buffers, the packed top-k of the MoE's CUDA route, and the fused passes of
``glm_dsa.fused`` taken through the model's functions with ``TritonOnCuda("cpu")`` (the
decisions the model makes on CUDA, run here).
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa import fused, moe, oracle  # noqa: E402
from glm_dsa.kernels import topk as topk_mod  # noqa: E402
from glm_dsa.kernels.launch import launch_buffers  # noqa: E402
from glm_dsa.kernels.topk import (  # noqa: E402
    COUNTERS,
    TARGET_FACTOR,
    launch_select,
    launch_select_candidates,
    launch_thresholds,
    raise_on_nan,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INT_MIN = torch.iinfo(torch.int32).min


def order_keys(x):
    """The kernels' uint32 order keys of float32 ``x`` as int32 bits: a positive score's bits
    with the sign bit set, a negative one's flipped (``-0.0`` as ``+0.0``)."""
    bits = (x + 0.0).view(torch.int32)
    return torch.where(bits < 0, ~bits, bits ^ INT_MIN)


def ascending_oracle(scores, k):
    """The oracle's top-k set of each full row of ``scores``, ascending, -1 padded."""
    R, n = scores.shape
    sets = oracle.topk_per_row(scores, torch.zeros(R, dtype=torch.int32),
                               torch.full((R,), n, dtype=torch.int32), k)
    return [sorted(i for i in row if i >= 0) + [-1] * sum(i < 0 for i in row) for row in sets.tolist()]


# ----------------------------------------------------------------------------- order keys
def _special_floats():
    """float32 values at the keys' edges (signed zeros, infinities, NaN, subnormals, the
    extremes, ±1) and random bit patterns."""
    edges = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"),
                          1e-45, -1e-45, 1.17e-38, -1.17e-38, 3.4028235e38, -3.4028235e38])
    g = torch.Generator().manual_seed(5)
    bits = torch.randint(INT_MIN, -INT_MIN - 1, (4083,), generator=g, dtype=torch.int32)
    return torch.cat([edges, bits.view(torch.float32)])


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN + 0.0 in numpy
def test_order_keys_and_key_value_are_the_documented_bits_and_inverse_on_every_edge():
    """``order_keys`` (the select's and the candidate kernel's keys) against this file's torch
    form, bit for bit, on every float32 edge and random bits but NaN (whose payload a GPU's
    add may canonicalize; the kernels count NaNs, never rank them); ``key_value`` maps each
    key back to its score (``-0.0`` to ``+0.0``, a NaN to a NaN)."""
    import triton
    import triton.language as tl

    @triton.jit
    def keys_and_back(x_ptr, key_ptr, back_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + offs, mask=offs < n)
        key = topk_mod.order_keys(x)
        tl.store(key_ptr + offs, key.to(tl.int32, bitcast=True), mask=offs < n)
        tl.store(back_ptr + offs, topk_mod.key_value(key), mask=offs < n)

    x = _special_floats().to(DEV)
    keys = torch.empty(x.shape, dtype=torch.int32, device=DEV)
    back = torch.empty_like(x)
    keys_and_back[(triton.cdiv(x.numel(), 1024),)](x, keys, back, x.numel(), BLOCK=1024)
    nan = torch.isnan(x)
    assert int(nan.sum()) > 1
    assert torch.equal(keys[~nan].cpu(), order_keys(x[~nan].cpu()))
    assert torch.equal(back[~nan].cpu().view(torch.int32), (x[~nan] + 0.0).cpu().view(torch.int32))
    assert bool(torch.isnan(back[nan]).all())


# ------------------------------------------------------------------- the candidate select
def _candidates(scores, found):
    """Candidate buffers ``[R, cand]`` holding ``scores`` (``[R, cand]``), shuffled, with the
    candidate counts ``found`` (``[R]``; may exceed cand: the buffer overflowed)."""
    R, cand = scores.shape
    g = torch.Generator().manual_seed(R * cand)
    order = torch.stack([torch.randperm(cand, generator=g) for _ in range(R)])
    keys = order_keys(scores.gather(1, order))
    counters = torch.zeros((R, COUNTERS), dtype=torch.int32)
    counters[:, 0] = torch.as_tensor(found, dtype=torch.int32)
    return keys, order.to(torch.int32), counters


def test_candidate_select_redoes_exactly_the_rows_its_buffer_cannot_hold():
    """Row by row: a window of ≤ topk keys (prefix, never redone, whatever the counter); fewer
    candidates than topk (redo); exactly topk, exactly cand (selected); cand + 1 (redo)."""
    k, cand = 5, 12
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(8, cand, generator=g)
    found = [0, 0, k - 1, k, cand, cand + 1, 9, 200]
    lens = torch.tensor([k, k - 2, 50, 50, 50, 50, k + 1, 50], dtype=torch.int32)
    keys, cols, counters = _candidates(scores, found)
    out, redo, nans = launch_select_candidates(keys.to(DEV), cols.to(DEV), counters.to(DEV),
                                               lens.to(DEV), k)
    out, redo, nans = out.cpu(), redo.cpu(), nans.cpu()
    assert redo.tolist() == [0, 0, 1, 0, 0, 1, 0, 1]
    assert nans.tolist() == [0] * 8
    assert out[0].tolist() == list(range(k))
    assert out[1].tolist() == list(range(k - 2)) + [-1, -1]
    for r in (3, 4, 6):  # the top-k of the first found[r] slots (in buffer order)
        n = found[r]
        buf_scores = scores.gather(1, cols.long())[r, :n]
        buf_cols = cols[r, :n]
        best = ascending_oracle(buf_scores[None], k)[0]
        assert out[r].tolist() == sorted(buf_cols[best].tolist()), r


@pytest.mark.parametrize("warps", [1, 4])
@pytest.mark.parametrize("topk", [37, 64])
def test_the_row_sort_orders_long_rows_and_leaves_short_rows(warps, topk):
    """``_sort_rows_kernel`` called directly: rows of more than ``topk`` keys (shuffled,
    reversed, already ascending, columns up to 2^20) come back as ``sorted`` orders them; a row
    of ``≤ topk`` keys (its prefix, then ``-1``) is left as it is, bitwise; a power-of-two and an
    odd ``topk`` (masked slots past it)."""
    import triton

    g = torch.Generator().manual_seed(topk)
    rows = [torch.randperm(1 << 20, generator=g)[:topk].to(torch.int32) for _ in range(3)]
    rows[1] = rows[1].sort(descending=True).values
    rows[2] = rows[2].sort().values
    short = torch.tensor(list(range(topk - 5)) + [-1] * 5, dtype=torch.int32)
    out = torch.stack(rows + [short]).to(DEV)
    lens = torch.tensor([topk + 1, 5 * topk, topk + 1, topk - 5], dtype=torch.int32, device=DEV)
    expected = [sorted(r.tolist()) for r in rows] + [short.tolist()]
    topk_mod._sort_rows_kernel[(4,)](out, lens, topk, TOPK=triton.next_power_of_2(topk),
                                     num_warps=warps)
    assert out.cpu().tolist() == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's atomics")
def test_shuffled_atomics_hand_out_the_same_slots_in_another_order(shuffled_atomics):
    """Under the ``shuffled_atomics`` fixture the kept lanes of one ``atomic_add`` still get the
    slots ``0 … kept − 1``, once each, and the counter ends at ``kept``, but not in lane order
    (which the interpreter alone gives); another seed, another order."""
    import triton
    import triton.language as tl

    @triton.jit
    def take_slots(counter_ptr, keep_ptr, slot_ptr, N: tl.constexpr):
        # Each kept lane's slot from one relaxed atomic on one counter, as the candidates append.
        offs = tl.arange(0, N)
        keep = tl.load(keep_ptr + offs) != 0
        slot = tl.atomic_add(counter_ptr + tl.zeros([N], dtype=tl.int32), 1, mask=keep,
                             sem="relaxed")
        tl.store(slot_ptr + offs, slot, mask=keep)

    keep = (torch.arange(64) % 3 != 0).to(torch.int32)
    kept = int(keep.sum())
    orders = []
    for seed in (0, 1):
        shuffled_atomics(seed)
        counter = torch.zeros(1, dtype=torch.int32)
        slots = torch.full((64,), -1, dtype=torch.int32)
        take_slots[(1,)](counter, keep, slots, N=64)
        taken = slots[keep != 0]
        assert int(counter) == kept and sorted(taken.tolist()) == list(range(kept))
        assert bool((slots[keep == 0] == -1).all())
        orders.append(taken.tolist())
    assert orders[0] != list(range(kept)) and orders[1] != orders[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's program order")
@pytest.mark.parametrize("grid", [(64,), (4, 3, 5)])
def test_interpreted_programs_run_once_each_out_of_grid_order(grid):
    """Under the autouse ``shuffled_programs`` fixture every program of a launch runs once, with
    its own ids and the grid's sizes, but not in the grid's row-major order (the interpreter's
    alone); two launches in one test run in two orders."""
    import triton
    import triton.language as tl

    @triton.jit
    def record(counter_ptr, ran_ptr):
        # The order programs run in, from the count of those that ran before.
        x, y, z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        ny, nz = tl.num_programs(1), tl.num_programs(2)
        turn = tl.atomic_add(counter_ptr, 1)
        tl.store(ran_ptr + turn, (x * ny + y) * nz + z)

    n = math.prod(grid)
    orders = []
    for _ in range(2):
        counter = torch.zeros(1, dtype=torch.int32)
        ran = torch.full((n,), -1, dtype=torch.int32)
        record[grid](counter, ran)
        assert int(counter) == n and sorted(ran.tolist()) == list(range(n))
        orders.append(ran.tolist())
    assert orders[0] != list(range(n)) and orders[1] != orders[0]


@pytest.mark.parametrize("block", [1024, 16])
@pytest.mark.parametrize("digit", [8, 6, 5, 3, 1])
def test_candidate_select_at_every_radix_digit_is_the_oracles_set(monkeypatch, digit, block):
    """The candidate select's radix rounds at 8 bits (four rounds), 6 (the shipped: the top 2
    bits, then five of 6), 5 (2 + 6 · 5), 3 (2 + 10 · 3) and 1 (32 rounds), over its buffer in
    one block and in blocks of 16 slots: the same exact top-k, on scores with heavy exact ties
    at the k-th value (the tie-column select runs) and signed zeros, in buffers of mixed fill."""
    monkeypatch.setattr(topk_mod, "CANDIDATE_RADIX_BITS", digit)
    monkeypatch.setattr(topk_mod, "CANDIDATE_BLOCK", block)
    k, cand, R = 6, 40, 5
    g = torch.Generator().manual_seed(17)
    scores = torch.randint(-4, 5, (R, cand), generator=g).float() / 2
    scores[0] = 0.0
    scores[0, ::3] = -0.0
    scores[1] = torch.randn(cand, generator=g)
    found = [cand, cand, 17, k, 33]
    keys, cols, counters = _candidates(scores, found)
    lens = torch.full((R,), 500, dtype=torch.int32)
    out, redo, _ = launch_select_candidates(keys.to(DEV), cols.to(DEV), counters.to(DEV),
                                            lens.to(DEV), k)
    assert redo.cpu().tolist() == [0] * R
    for r in range(R):
        n = found[r]
        buf_scores = (scores.gather(1, cols.long())[r, :n] + 0.0)  # -0.0 ties +0.0
        # Ties by column, as the oracle orders them: a buffer position's column decides.
        order = cols[r, :n].long().argsort()
        best = ascending_oracle(buf_scores[order][None], k)[0]
        assert out[r].cpu().tolist() == sorted(cols[r, :n][order][best].tolist()), r


def test_candidate_select_counts_nan_among_the_candidates():
    k, cand = 3, 8
    scores = torch.arange(2 * cand, dtype=torch.float32).view(2, cand)
    scores[1, 6] = float("nan")
    keys, cols, counters = _candidates(scores, [cand, cand])
    lens = torch.full((2,), 40, dtype=torch.int32)
    _, redo, nans = launch_select_candidates(keys.to(DEV), cols.to(DEV), counters.to(DEV),
                                             lens.to(DEV), k)
    assert redo.tolist() == [0, 0]
    assert nans.tolist()[0] == 0 and nans.tolist()[1] >= 1
    # A NaN past the counted candidates is not read.
    keys, cols, counters = _candidates(scores, [cand, cand])
    where = (cols[1] == 6).nonzero()[0, 0]
    keys[1, where], keys[1, cand - 1] = keys[1, cand - 1].clone(), keys[1, where].clone()
    counters[1, 0] = cand - 1
    _, _, nans = launch_select_candidates(keys.to(DEV), cols.to(DEV), counters.to(DEV),
                                          lens.to(DEV), k)
    assert nans.tolist() == [0, 0]


def test_candidate_select_of_an_empty_launch():
    out, redo, nans = launch_select_candidates(
        torch.zeros(0, 6, dtype=torch.int32, device=DEV), torch.zeros(0, 6, dtype=torch.int32, device=DEV),
        torch.zeros(0, COUNTERS, dtype=torch.int32, device=DEV), torch.zeros(0, dtype=torch.int32, device=DEV), 2)
    assert out.shape == (0, 2) and redo.shape == (0,) and nans.shape == (0,)


# ------------------------------------------------------------------------- the thresholds
def _expected_threshold(sample, start, end, n, topk, cand):
    """The sample's ⌈target · n_sample / n⌉-th best score, clamped to [1, n_sample]; -inf for
    a window of ≤ cand keys or an empty sample."""
    n_sample = end - start
    if n <= cand or n_sample <= 0:
        return float("-inf")
    target = int(TARGET_FACTOR * topk)
    rank = min(max(-(-target * n_sample // n), 1), n_sample)
    return sample[start:end].sort(descending=True).values[rank - 1].item()


def test_thresholds_take_the_rank_the_window_length_asks_for():
    topk, cand = 4, 24  # target 10
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(8, 64, generator=g)
    # (start, end, window length): at the buffer's edge (cand, cand + 1), a rank that is not a
    # whole number (10 · 7 / 25 = 2.8 → 3), a rank below 1 (→ 1), above the sample (→ all of
    # it: a cand below the target), an empty sample, an offset sample.
    rows = [(0, 64, cand), (0, 64, cand + 1), (0, 7, 25), (0, 64, 10_000), (0, 30, 2),
            (5, 5, 100), (20, 50, 400), (0, 1, 30)]
    cands = [cand, cand, cand, cand, 1, cand, cand, cand]
    starts = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    ends = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    lens = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    for c in sorted(set(cands)):
        got = launch_thresholds(sample.to(DEV), starts.to(DEV), ends.to(DEV), lens.to(DEV), topk, c)
        for r, (s, e, n) in enumerate(rows):
            if cands[r] == c:
                want = _expected_threshold(sample[r], s, e, n, topk, c)
                assert got[r].item() == want, (r, got[r].item(), want)


def test_thresholds_read_rows_at_their_stride():
    wide = torch.randn(3, 100)
    sample = wide[:, :40]  # row stride 100
    starts = torch.zeros(3, dtype=torch.int32)
    ends = torch.full((3,), 40, dtype=torch.int32)
    lens = torch.full((3,), 400, dtype=torch.int32)
    got = launch_thresholds(sample.to(DEV), starts.to(DEV), ends.to(DEV), lens.to(DEV), 8, 48)
    for r in range(3):
        assert got[r].item() == _expected_threshold(sample[r], 0, 40, 400, 8, 48)


@pytest.mark.parametrize("width", [1, 127, 256, 257, 1024, 4097, 8192])
def test_thresholds_at_every_block_the_sample_width_picks(width):
    """The block follows the sample's width (256 … 4,096 keys, a warp per 512): the same rank at
    each, with windows that straddle block edges and tied, signed and infinite scores."""
    topk, cand = 64, 384  # target 160
    g = torch.Generator().manual_seed(width)
    sample = torch.randn(5, width, generator=g).round(decimals=1)  # many ties
    sample[1, ::3] = float("inf")
    sample[2] = -sample[2].abs()
    mid = width // 2
    rows = [(0, width, 10 * width), (0, width, cand + 1), (mid, width, 4 * width + cand),
            (max(mid - 300, 0), min(mid + 300, width), 1_000_000), (width - 1, width, cand + 7)]
    starts = torch.tensor([r[0] for r in rows], dtype=torch.int32)
    ends = torch.tensor([r[1] for r in rows], dtype=torch.int32)
    lens = torch.tensor([r[2] for r in rows], dtype=torch.int32)
    got = launch_thresholds(sample.to(DEV), starts.to(DEV), ends.to(DEV), lens.to(DEV), topk, cand)
    for r, (s, e, n) in enumerate(rows):
        want = _expected_threshold(sample[r], s, e, n, topk, cand)
        assert got[r].item() == want, (width, r, got[r].item(), want)


# ------------------------------------------------------------------------ the row select
def _nan_rows(N, k, seed):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(6, N, generator=g)
    starts = torch.tensor([0, 3, 10, 0, 0, 20], dtype=torch.int32)
    ends = torch.tensor([N, N, 10 + k, N, k + 1, N], dtype=torch.int32)
    logits[1, 5] = float("nan")          # inside a long row
    logits[2, 12] = float("nan")         # inside a row of exactly k keys: never read
    logits[3, :] = float("nan")          # every key NaN
    logits[4, k] = float("nan")          # the last key of a row of k + 1 keys
    logits[5, 19] = float("nan")         # just before the window
    return logits, starts, ends


@pytest.mark.parametrize("N", [60, 300])  # rows within the candidate buffer, and sampled rows
def test_row_select_counts_nan_in_exactly_the_rows_it_reads(N):
    k = 8
    logits, starts, ends = _nan_rows(N, k, seed=N)
    out, nans = launch_select(logits.to(DEV), starts.to(DEV), ends.to(DEV), k)
    assert [n > 0 for n in nans.tolist()] == [False, True, False, True, True, False]
    assert out[2].tolist() == list(range(k))
    for r in (0, 5):
        s, e = int(starts[r]), int(ends[r])
        assert out[r].tolist() == ascending_oracle(logits[r:r + 1, s:e], k)[0], r


def test_raise_on_nan_names_the_first_row_after_the_offset():
    raise_on_nan(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(ValueError, match="logits row 7 holds NaN"):
        raise_on_nan(torch.tensor([0, 0, 1, 3], dtype=torch.int32), first_row=5)
    with pytest.raises(ValueError, match="logits row 0 holds NaN"):
        raise_on_nan(torch.tensor([1, 0], dtype=torch.int32))


@pytest.mark.parametrize("layout", ["row_stride", "column_stride", "transposed"])
def test_row_select_on_strided_logits(layout):
    k, N = 6, 90
    g = torch.Generator().manual_seed(5)
    base = torch.randn(4, 3 * N, generator=g)
    if layout == "row_stride":
        logits = base[:, 7:7 + N]
    elif layout == "column_stride":
        logits = base[:, ::3]
    else:
        logits = torch.randn(N, 4, generator=g).T
    starts = torch.tensor([0, 11, 30, 0], dtype=torch.int32)
    ends = torch.tensor([N, 80, 30 + k + 1, k], dtype=torch.int32)
    out, nans = launch_select(logits.to(DEV), starts.to(DEV), ends.to(DEV), k)
    assert nans.tolist() == [0] * 4
    for r in range(4):
        s, e = int(starts[r]), int(ends[r])
        assert out[r].tolist() == ascending_oracle(logits[r:r + 1, s:e].contiguous(), k)[0], r


def test_row_select_of_no_rows():
    out, nans = launch_select(torch.zeros(0, 5, device=DEV), torch.zeros(0, dtype=torch.int32, device=DEV),
                              torch.zeros(0, dtype=torch.int32, device=DEV), 3)
    assert out.shape == (0, 3) and nans.shape == (0,)


# --------------------------------------------------------------- the indexer's redone rows
def test_indexer_redoes_only_the_tied_row_and_reports_its_nan(monkeypatch):
    """Row 0's logits all tie (zero gates): its candidate buffer overflows and it is redone from
    full logits, where a NaN key column (k_scale) of its window is found. Row 1 (random) never
    sees that column. The error names row 0: a redone row's NaN count is the redo's."""
    from glm_dsa.kernels import indexer as fast

    monkeypatch.setattr(fast, "SAMPLE", 16)
    S, H, D, N, topk = 2, 4, 128, 120, 4
    g = torch.Generator().manual_seed(9)
    q = torch.randn(S, H, D, generator=g).to(torch.float8_e4m3fn)
    k = torch.randn(N, D, generator=g).to(torch.float8_e4m3fn)
    k_scale = torch.ones(N)
    w = torch.rand(S, H, generator=g)
    w[0] = 0.0
    ks = torch.tensor([0, 40], dtype=torch.int32)
    ke = torch.tensor([N, N], dtype=torch.int32)
    args = [t.to(DEV) for t in (q, w, k, k_scale, ks, ke)]
    out = fast.indexer_topk(*args, topk, 2**30).cpu()
    assert out[0].tolist() == list(range(topk))  # all tied: the lowest columns
    logits = oracle.fp8_mqa_logits(q, (k, k_scale), w, ks, ke)
    assert set(out[1].tolist()) == set(logits[1, 40:].topk(topk).indices.tolist())
    k_scale[30] = float("nan")
    args[3] = k_scale.to(DEV)
    with pytest.raises(ValueError, match="logits row 0 holds NaN"):
        fast.indexer_topk(*args, topk, 2**30)


# --------------------------------------------------------------- the indexer's row windows
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_launch_windows_are_the_torch_windows_and_zero_the_counters(dtype):
    """The windows kernel on 2,500 rows (three programs, the last one masked) read through an
    offset slice, as a row chunk hands them: every row's scored window, length and sample
    window equal torch's integer arithmetic, and its counters (junk before) are zero. Windows
    empty, of ≤ topk keys, of ≤ cand keys and longer; starts on and off the stride."""
    from glm_dsa.kernels.indexer import launch_windows

    R, topk, cand, stride, off = 2500, 16, 96, 7, 13
    g = torch.Generator().manual_seed(12)
    ks_all = torch.randint(0, 5000, (R + off,), generator=g)
    lens = torch.randint(0, 300, (R + off,), generator=g)
    lens[off : off + 8] = torch.tensor([0, 1, topk, topk + 1, cand, cand + 1, 299, 0])
    ks_all, ke_all = ks_all.to(dtype).to(DEV), (ks_all + lens).to(dtype).to(DEV)
    counters_all = torch.full((R + 2, COUNTERS), 77, dtype=torch.int32, device=DEV)
    ks, ke, counters = ks_all[off:], ke_all[off:], counters_all[1 : R + 1]
    starts, ends, n, s_starts, s_ends = launch_windows(ks, ke, counters, topk, cand, stride)
    a, b = ks.long().cpu(), ke.long().cpu()
    length = b - a
    scored_end = torch.where(length > topk, b, a)
    ceil = lambda x: -(-x // stride)  # noqa: E731
    expected = (a, scored_end, length, ceil(a), torch.where(length > cand, ceil(scored_end), ceil(a)))
    for got, want in zip((starts, ends, n, s_starts, s_ends), expected):
        assert got.dtype == torch.int32 and torch.equal(got.cpu().long(), want)
    assert (counters == 0).all()
    assert (counters_all[0] == 77).all() and (counters_all[-1] == 77).all()  # outside the chunk


# ------------------------------------------------------------------------- launch buffers
def test_launch_buffers_shapes_dtypes_and_copies():
    q = torch.zeros(3, 4, 24, dtype=torch.bfloat16)
    indices = torch.arange(3 * 5, dtype=torch.int32).view(3, 1, 5)
    sink = torch.arange(8, dtype=torch.float32)[::2]  # strided, already float32 (no copy by .to)
    lengths = torch.tensor([5, 1, 3, 0, 0, 0], dtype=torch.int32)[::2]
    out, max_logits, lse, sink32, lens, idx = launch_buffers(q, 16, indices, sink, lengths)
    assert out.shape == (3, 4, 16) and out.dtype == torch.bfloat16
    assert max_logits.shape == lse.shape == (3, 4)
    assert max_logits.dtype == lse.dtype == torch.float32
    assert sink32.dtype == torch.float32 and sink32.is_contiguous()
    assert sink32.tolist() == [0.0, 2.0, 4.0, 6.0]
    wide = launch_buffers(q, 16, indices, torch.arange(8, dtype=torch.float64)[::2], None)[3]
    assert wide.dtype == torch.float32 and wide.is_contiguous() and wide.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert lens.is_contiguous() and lens.tolist() == [5, 3, 0]
    assert idx.shape == (3, 5) and torch.equal(idx, indices[:, 0, :])
    none = launch_buffers(q, 16, indices, None, None)
    assert none[3] is None and none[4] is None


# ----------------------------------------------------------- the MoE's CUDA top-k, on the CPU
@pytest.mark.parametrize("kind", ["random", "ties", "signed"])
def test_packed_top_is_the_stable_sort(kind):
    g = torch.Generator().manual_seed(len(kind))
    if kind == "random":
        scores = torch.randn(9, 33, generator=g)
    elif kind == "ties":
        scores = torch.randint(0, 3, (9, 33), generator=g).float()
    else:
        scores = torch.randn(9, 33, generator=g)
        scores[:, ::4] = -0.0
        scores[:, 1::4] = 0.0
        scores[:, 2::9] = float("-inf")
        scores[:, 3::10] = -1e-38
    for k in (1, 4, 33):
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(moe._packed_top(scores, k), want), k


# ------------------------------------------------ the fused passes through the model's functions
CPU_PASSES = fused.TritonOnCuda("cpu")


class _GatherOnly(fused.TritonOnCuda):
    """The CPU passes without SwiGLU (whose interpreter ``exp`` may differ from torch's in the
    last bit): every other pass there is bitwise its torch form."""

    def swiglu(self, gate, up, dtype):
        return None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's fused passes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_swiglu_takes_the_kernel_on_column_halves(dtype):
    from glm_dsa.kernels.swiglu import swiglu as kernel

    g = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(5, 2 * 40, generator=g) * 3).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    with fused.using(CPU_PASSES):
        got = moe.swiglu(gate, up, dtype)
        wide = moe.swiglu(gate.double(), up.double(), torch.float64)  # not taken: torch
    assert torch.equal(got, kernel(gate, up, dtype))
    want = (torch.nn.functional.silu(gate.double()) * up.double())
    assert torch.allclose(got.double(), want, rtol=2.0**-7, atol=1e-6)
    assert torch.equal(wide, torch.nn.functional.silu(gate.double()) * up.double())


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's fused passes")
@pytest.mark.parametrize("masked", [False, True])
def test_moe_combine_through_the_fused_pass_is_bitwise_torch(masked):
    g = torch.Generator().manual_seed(3)
    n, top_k, hidden = 6, 3, 40
    expert_out = torch.randn(n * top_k + 2, 2 * hidden, generator=g).bfloat16()[:, :hidden]
    position = torch.randperm(n * top_k, generator=g).view(n, top_k)
    weights = torch.rand(n, top_k, generator=g)
    shared = torch.randn(n, hidden + 8, generator=g).bfloat16()[:, 3:3 + hidden]
    row_mask = torch.tensor([True, False, True, True, False, True]) if masked else None
    out_cpu = torch.full((n, hidden + 4), 7.0).bfloat16()[:, :hidden]  # row stride 44
    with fused.using(CPU_PASSES):
        got = moe.combine_experts(expert_out, position, weights, shared, row_mask, out_cpu)
    with fused.using(fused.TORCH):
        want = moe.combine_experts(expert_out, position, weights, shared, row_mask)
    assert got.data_ptr() == out_cpu.data_ptr()
    assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's fused passes")
def test_moe_block_through_the_fused_passes_is_bitwise_torch():
    """The whole MoE of the tiny config (gather, combine; budget rows by the fused sizes)."""
    from glm_dsa.config import get_config

    torch.manual_seed(4)
    cfg = get_config("tiny")
    layer = moe.MoE(cfg).bfloat16()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.05)
    x = torch.randn(7, cfg.hidden_size).bfloat16()
    mask = torch.tensor([True] * 5 + [False, True])
    passes = _GatherOnly("cpu")
    with fused.using(passes):
        assert fused.moe_single_pass(torch.device("cpu"), torch.bfloat16)
        got, counts = layer(x, mask)
    with fused.using(fused.TORCH):
        want, want_counts = layer(x, mask)
    assert torch.equal(got, want) and torch.equal(counts, want_counts)
    assert torch.equal(got[5], torch.zeros_like(got[5]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's fused passes")
def test_grouped_experts_gather_through_the_fused_pass(monkeypatch):
    calls = []
    from glm_dsa.kernels import gather_rows as gather_mod

    real = gather_mod.gather_rows
    monkeypatch.setattr(gather_mod, "gather_rows", lambda x, rows: calls.append(rows) or real(x, rows))
    g = torch.Generator().manual_seed(5)
    E, H, inter = 3, 16, 8
    x = torch.randn(5, H, generator=g).bfloat16()
    gu = torch.randn(E, 2 * inter, H, generator=g).bfloat16()
    down = torch.randn(E, H, inter, generator=g).bfloat16()
    rows = torch.tensor([4, 0, 0, 2, 1, 3, 3, 4], dtype=torch.int64)
    offsets = torch.tensor([3, 5, 8], dtype=torch.int32)
    with fused.using(_GatherOnly("cpu")):
        got = moe.experts_grouped_mm(x, gu, down, offsets, rows)
    with fused.using(fused.TORCH):
        want = moe.experts_grouped_mm(x, gu, down, offsets, rows)
    assert len(calls) == 1 and torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's fused passes")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_indexer_quant_and_page_write_through_the_fused_pass_are_bitwise_torch(dtype):
    from glm_dsa.config import get_config
    from glm_dsa.indexer import Indexer

    cfg = get_config("tiny")
    idx = Indexer(cfg).to(dtype)
    g = torch.Generator().manual_seed(6)
    n = 5
    positions = torch.randint(0, 1000, (n,), generator=g)
    keys = (torch.randn(n, cfg.index_head_dim, generator=g) * 2).to(dtype)
    queries = (torch.randn(n, cfg.index_n_heads, cfg.index_head_dim, generator=g) * 2).to(dtype)
    page_bytes = cfg.page_size * (cfg.index_head_dim + 4)
    results = {}
    for name, passes in (("fused", CPU_PASSES), ("torch", fused.TORCH)):
        pages = torch.zeros(3, page_bytes, dtype=torch.uint8)
        slots = torch.tensor([0, 7, cfg.page_size, 2 * cfg.page_size + 1, 3], dtype=torch.int64)
        with fused.using(passes):
            qk = idx._rotated_fp8(queries, positions)
            kk = idx._rotated_fp8(keys, positions)
            idx._store_keys(keys, positions, pages, slots)
            # Not taken by the kernel (non-contiguous rows): the torch form, same bits.
            strided = idx._rotated_fp8(torch.cat([keys, keys], 1)[:, ::2], positions)
        results[name] = (qk[0].view(torch.uint8), qk[1], kk[0].view(torch.uint8), kk[1], pages,
                         strided[0].view(torch.uint8), strided[1])
    for a, b in zip(results["fused"], results["torch"]):
        assert torch.equal(a, b)
    assert results["torch"][4].any()


def test_fused_pass_math_fixture_is_meaningful():
    # The CPU passes' kernels must actually be reachable here (else the tests above compare
    # torch with torch): TritonOnCuda("cpu") takes a CPU bf16 row.
    assert CPU_PASSES.takes_index_rows(torch.zeros(2, 128, dtype=torch.bfloat16))
    assert math.isclose(TARGET_FACTOR * 4, 10.0)
    assert topk_mod.CAND_FACTOR == 6


# ------------------------------------------------------- block edges of the MoE's row kernels
@pytest.mark.parametrize("width", [1, 1023, 1024, 1025])
def test_swiglu_at_the_block_edge_with_free_row_strides(width):
    from glm_dsa.kernels.swiglu import BLOCK, swiglu

    assert BLOCK == 1024
    g = torch.Generator().manual_seed(width)
    gate = torch.randn(3, 2 * width + 5, generator=g)[:, :width]  # row stride 2w + 5
    up = torch.randn(3, width + 3, generator=g)[:, 3:]  # row stride w + 3, offset 3
    got = swiglu(gate.to(DEV), up.to(DEV), torch.float32).cpu()
    want = torch.nn.functional.silu(gate.double()) * up.double()
    assert got.shape == (3, width) and got.is_contiguous()
    assert torch.allclose(got.double(), want, rtol=2.0**-20, atol=1e-30)


@pytest.mark.parametrize("width", [1, 2047, 2048, 2049])
def test_gather_rows_at_the_block_edge(width):
    from glm_dsa.kernels.gather_rows import BLOCK, gather_rows

    assert BLOCK == 2048
    x = torch.arange(5 * (width + 3), dtype=torch.float32).view(5, width + 3)[:, 1:width + 1]
    rows = torch.tensor([4, 0, 4, 2], dtype=torch.int64)
    got = gather_rows(x.to(DEV), rows.to(DEV)).cpu()
    assert got.is_contiguous() and torch.equal(got, x.index_select(0, rows))


@pytest.mark.parametrize("width", [1023, 1025])
def test_combine_at_the_block_edge_with_strided_operands(width):
    from glm_dsa.kernels.moe_combine import combine_experts as kernel

    g = torch.Generator().manual_seed(width)
    n, top_k = 3, 2
    expert_out = torch.randn(n * top_k, width + 7, generator=g).bfloat16()[:, 2:width + 2]
    position = torch.tensor([[0, 3], [1, 4], [2, 5]])
    weights = torch.rand(n, top_k, generator=g)
    shared = torch.randn(n, width + 1, generator=g).bfloat16()[:, 1:]
    out = torch.zeros(n, width + 9).bfloat16()[:, :width]
    got = kernel(*(t.to(DEV) for t in (expert_out, position, weights, shared)), None, out.to(DEV)).cpu()
    want = moe.combine_experts(expert_out, position, weights, shared, None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("D, H, ok", [(16, 1, True), (32, 256, True), (8, 1, False), (24, 1, False),
                                      (0, 1, False), (16, 257, False), (16, 0, False)])
def test_logits_kernel_shape_edges(D, H, ok):
    from glm_dsa.kernels.mqa_logits import MAX_HEADS, check_kernel_shapes

    assert MAX_HEADS == 256
    if ok:
        check_kernel_shapes(H, D, torch.zeros(1, H))
    else:
        with pytest.raises(ValueError, match="head dim|heads"):
            check_kernel_shapes(H, D, torch.zeros(1, max(H, 1)))
    with pytest.raises(ValueError, match="weights must be float32"):
        check_kernel_shapes(1, 16, torch.zeros(1, 1, dtype=torch.float64))


def test_logits_autotune_buckets():
    from glm_dsa.kernels import mqa_logits

    assert [mqa_logits._pow2(n) for n in (1, 2, 3, 32, 33)] == [1, 2, 4, 32, 64]
    # Problems within a factor of 16 of rows × cols share a class: the bit length over 4.
    assert [mqa_logits._size_class(r, c) for r, c in ((1, 1), (1, 7), (1, 8), (16, 16), (1, 2**20))] == \
        [0, 0, 1, 2, 5]


@pytest.mark.parametrize("d_v, d_qk, row_bytes, stride, ok", [
    (128, 192, 128 + 4 + 128, 260, True), (256, 320, 256 + 8 + 128, 392, True),
    (384, 448, 384 + 12 + 128, 524, False), (128, 128, 132, 132, False), (0, 64, 0, 4, False),
    (128, 192, 259, 259, False), (128, 192, 260, 262, False), (512, 576, 656, 656, True),
])
def test_fp8_rows_layout_edges(d_v, d_qk, row_bytes, stride, ok):
    from glm_dsa.kernels.sparse_mla import sparse_mla_fwd_fp8

    q = torch.zeros(1, 2, d_qk)
    pool = torch.zeros(3, stride, dtype=torch.uint8)[:, :row_bytes]
    idx = torch.full((1, 1, 4), -1, dtype=torch.int32)
    if ok:
        out, _, lse = sparse_mla_fwd_fp8(q.to(DEV), pool.to(DEV), idx.to(DEV), 0.5, d_v)
        assert out.shape == (1, 2, d_v) and bool(torch.isinf(lse).all())  # no valid index
    else:
        with pytest.raises(ValueError, match="d_v=|kv_rows must have"):
            sparse_mla_fwd_fp8(q, pool, idx, 0.5, d_v)


@pytest.mark.cuda
def test_cuda_fused_passes_through_the_model_are_their_torch_forms():
    """The default passes on CUDA tensors: the combine, the gather and the index quantization
    (and its page write) bitwise their torch forms; SwiGLU within one rounding."""
    from glm_dsa.config import get_config
    from glm_dsa.indexer import Indexer

    dev = "cuda"
    g = torch.Generator().manual_seed(11)
    n, top_k, hidden = 37, 4, 1030
    expert_out = torch.randn(n * top_k, hidden, generator=g).bfloat16().to(dev)
    position = torch.randperm(n * top_k, generator=g).view(n, top_k).to(dev)
    weights = torch.rand(n, top_k, generator=g).to(dev)
    shared = torch.randn(n, hidden, generator=g).bfloat16().to(dev)
    mask = (torch.rand(n, generator=g) < 0.7).to(dev)
    gate_up = torch.randn(n, 2 * 96, generator=g).bfloat16().to(dev)
    rows = torch.randint(0, n, (50,), generator=g).to(dev)
    cfg = get_config("tiny")
    idx = Indexer(cfg).to(dev).bfloat16()
    keys = torch.randn(n, cfg.index_head_dim, generator=g).bfloat16().to(dev)
    positions = torch.randint(0, 1000, (n,), generator=g).to(dev)
    slots = torch.randperm(3 * cfg.page_size, generator=g)[:n].to(dev)
    got = {}
    for name, passes in (("fused", fused.TRITON_ON_CUDA), ("torch", fused.TORCH)):
        pages = torch.zeros(3, cfg.page_size * (cfg.index_head_dim + 4), dtype=torch.uint8, device=dev)
        with fused.using(passes):
            got[name] = (moe.combine_experts(expert_out, position, weights, shared, mask),
                         expert_out.index_select(0, rows) if passes is fused.TORCH
                         else fused.gather_rows(expert_out, rows),
                         *idx._rotated_fp8(keys, positions),
                         moe.swiglu(*gate_up.chunk(2, dim=-1), torch.bfloat16))
            idx._store_keys(keys, positions, pages, slots)
            got[name] += (pages,)
    f, t = got["fused"], got["torch"]
    assert torch.equal(f[0], t[0]) and torch.equal(f[1], t[1])
    assert torch.equal(f[2].view(torch.uint8), t[2].view(torch.uint8)) and torch.equal(f[3], t[3])
    assert torch.equal(f[5], t[5])
    assert torch.allclose(f[4].float(), t[4].float(), rtol=2**-7, atol=0)
