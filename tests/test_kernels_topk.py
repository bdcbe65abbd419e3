"""The Triton top-k select (glm_dsa.kernels.topk) against torch.topk and the oracle's contract.

A selection is right when its indices are distinct, inside the row, their scores are, as a
multiset, torch.topk's values, and of several equal k-th values it takes the lowest columns:
as a set, the oracle's, written in ascending column order.
On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); the ``cuda`` test runs
it at the indexer's size (1,477 rows of 1M columns, k = 2048).
"""

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa import oracle, testing  # noqa: E402
from glm_dsa.kernels import topk as topk_mod  # noqa: E402
from glm_dsa.kernels import topk_per_row  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NEG_INF = float("-inf")


def ascending(indices):
    """A row's indices as the kernels write them: the valid ones in ascending order, then -1."""
    return sorted(i for i in indices if i >= 0) + [-1] * sum(i < 0 for i in indices)


def _assert_exact_topk(out, logits, starts, ends, k):
    """``out`` is an exact top-k of each row and, among the scores tied at the k-th value, takes
    the lowest columns: the oracle's set (torch's stable sort), in ascending column order."""
    assert out.shape == (logits.shape[0], k) and out.dtype == torch.int32
    out, logits = out.cpu(), logits.cpu()
    expected = oracle.topk_per_row(logits, starts.cpu(), ends.cpu(), k)
    for r in range(out.shape[0]):
        assert out[r].tolist() == ascending(expected[r].tolist()), r
    for r in range(out.shape[0]):
        s, e = int(starts[r]), int(ends[r])
        n = e - s
        if n <= k:
            assert out[r].tolist() == list(range(n)) + [-1] * (k - n), r
            continue
        idx = out[r].long()
        assert len(set(idx.tolist())) == k and bool(((idx >= 0) & (idx < n)).all()), r
        row = logits[r, s:e]
        expected = row.topk(k).values.sort().values
        assert torch.equal(row[idx].sort().values, expected), r


def _rows(kind, R, N, seed):
    g = torch.Generator().manual_seed(seed)
    if kind == "random":
        return torch.randn(R, N, generator=g)
    if kind == "ties":  # eight levels: the k-th value is tied with hundreds of others
        return torch.randint(0, 8, (R, N), generator=g).float() / 2
    if kind == "all_equal":
        return torch.full((R, N), 0.25)
    if kind == "offset":  # scores far from zero in a narrow band, as gated logit sums can be
        return 1000.0 + torch.rand(R, N, generator=g)
    if kind == "signed_zeros_and_infs":
        x = torch.randn(R, N, generator=g)
        x[:, ::3] = -0.0
        x[:, 1::7] = 0.0
        x[:, 2::11] = NEG_INF
        x[:, 5::13] = float("inf")
        return x
    raise ValueError(kind)


# Module constants the wrapper reads at each call: the default path (candidate buffer), a
# sample with a stride > 1, a threshold aimed too high (fewer than k candidates: the select
# falls back to the whole row), and a stride of k / SAMPLE_HITS = 4 keys.
PATHS = {"default": {}, "strided_sample": {"SAMPLE": 64}, "fallback": {"TARGET_FACTOR": 0.25},
         "hits_stride": {"SAMPLE_HITS": 4}}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kind", ["random", "ties", "all_equal", "offset", "signed_zeros_and_infs"])
def test_topk_per_row_equals_torch_topk_sets(monkeypatch, path, kind):
    for name, value in PATHS[path].items():
        monkeypatch.setattr(topk_mod, name, value)
    k, N = 16, 1100
    logits = _rows(kind, 6, N, seed=len(kind))
    # Full rows, an offset window, len = k + 1, len = k, len < k, and an empty row.
    starts = torch.tensor([0, 37, 5, 9, 0, 40], dtype=torch.int32)
    ends = torch.tensor([N, N - 50, 5 + k + 1, 9 + k, 3, 40], dtype=torch.int32)
    out = topk_per_row(logits.to(DEV), starts.to(DEV), ends.to(DEV), k)
    _assert_exact_topk(out, logits, starts, ends, k)


@pytest.mark.parametrize("kind", ["random", "ties"])
def test_topk_per_row_is_the_same_bits_whatever_order_its_candidates_land_in(shuffled_atomics,
                                                                              kind):
    """A long row's candidates fill its buffer in the order the atomics serve them: on a GPU
    the warps', on the CPU a shuffled one (tests/conftest.py's ``shuffled_atomics``; the bare
    interpreter fills in column order, which would hide a missing sort). Three orders: each
    the exact top-k in ascending order, all the same bits."""
    k, N = 16, 1100
    logits = _rows(kind, 6, N, seed=7)
    starts = torch.tensor([0, 37, 5, 9, 0, 40], dtype=torch.int32)
    ends = torch.tensor([N, N - 50, 5 + 7 * k, 9 + k, 3, 900], dtype=torch.int32)
    outs = []
    for seed in range(3):
        shuffled_atomics(seed)
        out = topk_per_row(logits.to(DEV), starts.to(DEV), ends.to(DEV), k)
        _assert_exact_topk(out, logits, starts, ends, k)
        outs.append(out.cpu())
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_topk_per_row_never_reads_outside_the_rows():
    k, N = 8, 300
    logits = torch.randn(3, N)
    starts = torch.tensor([10, 0, 150], dtype=torch.int32)
    ends = torch.tensor([200, 120, 300], dtype=torch.int32)
    dirty = logits.clone()
    for r in range(3):
        dirty[r, : int(starts[r])] = float("nan")
        dirty[r, int(ends[r]) :] = 1e30
    out = topk_per_row(dirty.to(DEV), starts.to(DEV), ends.to(DEV), k)
    _assert_exact_topk(out, logits, starts, ends, k)


def test_topk_per_row_with_k_larger_than_every_row():
    logits = torch.randn(3, 40)
    starts = torch.tensor([0, 10, 40], dtype=torch.int32)
    ends = torch.tensor([40, 30, 40], dtype=torch.int32)
    out = topk_per_row(logits.to(DEV), starts.to(DEV), ends.to(DEV), 64)
    _assert_exact_topk(out, logits, starts, ends, 64)


def test_nan_inside_a_read_row_raises_like_the_reference():
    logits = torch.randn(2, 100)
    logits[1, 50] = float("nan")
    starts = torch.zeros(2, dtype=torch.int32)
    ends = torch.full((2,), 100, dtype=torch.int32)
    with pytest.raises(ValueError, match="row 1 holds NaN"):
        topk_per_row(logits.to(DEV), starts.to(DEV), ends.to(DEV), 8)
    short = torch.tensor([100, 60], dtype=torch.int32)  # row 1 keeps all 60: scores not read
    out = topk_per_row(logits.to(DEV), starts.to(DEV), short.to(DEV), 60)
    assert out[1].tolist() == list(range(60))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_candidate_select_takes_the_lowest_tied_columns_in_order_whatever_the_buffer_order(seed):
    """On the GPU the candidate kernel appends a row's keys in the order its atomics land; the
    select must not care. Candidates with 4 score levels, in a shuffled order: the set is
    the lowest columns among those tied at the k-th value, as the oracle chooses, written in
    ascending order (the same bits whatever order the buffer came in)."""
    from glm_dsa.kernels.topk import COUNTERS, launch_select_candidates

    g = torch.Generator().manual_seed(seed)
    R, n, k = 3, 300, 37
    scores = torch.randint(0, 4, (R, n), generator=g).float()
    order = torch.stack([torch.randperm(n, generator=g) for _ in range(R)])
    bits = (scores.gather(1, order) + 0.0).view(torch.int32)
    # The kernels' order keys: a positive score's bits with the sign bit set, a negative's flipped.
    keys = torch.where(bits < 0, ~bits, bits ^ torch.iinfo(torch.int32).min)
    counters = torch.zeros((R, COUNTERS), dtype=torch.int32)
    counters[:, 0] = n
    lens = torch.full((R,), n + 100, dtype=torch.int32)  # a window longer than its candidates
    out, redo, nans = launch_select_candidates(keys.to(DEV), order.to(torch.int32).to(DEV),
                                               counters.to(DEV), lens.to(DEV), k)
    assert redo.tolist() == [0] * R and nans.tolist() == [0] * R
    expected = oracle.topk_per_row(scores, torch.zeros(R, dtype=torch.int32),
                                   torch.full((R,), n, dtype=torch.int32), k)
    for r in range(R):
        assert out[r].tolist() == ascending(expected[r].tolist()), r


def test_topk_per_row_rejects_bad_arguments():
    logits = torch.randn(2, 10, device=DEV)
    starts = torch.zeros(2, dtype=torch.int32, device=DEV)
    ends = torch.full((2,), 10, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="float32"):
        topk_per_row(logits.double(), starts, ends, 4)
    with pytest.raises(ValueError, match="topk"):
        topk_per_row(logits, starts, ends, 0)
    with pytest.raises(ValueError):
        topk_per_row(logits, ends, starts, 4)


def test_topk_per_row_passes_the_harness():
    report = testing.check_kernel("topk_per_row", topk_per_row, cases=12, device=DEV)
    assert report.cases_run == 12


@pytest.mark.cuda
def test_topk_per_row_passes_the_harness_at_glm_shapes():
    testing.check_kernel("topk_per_row", topk_per_row, cases=20, device=DEV, shapes="glm-5.3")


@pytest.mark.cuda
def test_topk_per_row_at_indexer_size():
    """1,477 causal rows of a 1M-column chunk (prefix 983,040 + 32,768 queries), k = 2048."""
    R, N, k = 1477, 1_015_808, 2048
    g = torch.Generator(device=DEV).manual_seed(0)
    logits = torch.randn(R, N, generator=g, device=DEV)
    ends = torch.arange(N - R + 1, N + 1, dtype=torch.int32, device=DEV)
    starts = torch.zeros(R, dtype=torch.int32, device=DEV)
    out = topk_per_row(logits, starts, ends, k)
    assert out.shape == (R, k) and bool((out >= 0).all())
    assert bool((out[:, 1:] > out[:, :-1]).all())  # ascending: the same bits every run
    for r in range(0, R, 97):  # a spread of rows against torch.topk, on the GPU
        row = logits[r, : int(ends[r])]
        idx = out[r].long()
        assert idx.unique().numel() == k
        assert torch.equal(row[idx].sort().values, row.topk(k).values.sort().values), r
