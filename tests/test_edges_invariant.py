"""glm_dsa.invariant's tilings at their edges (a tile exactly full, one row over, one short, no
rows), the CUDA tiling (``fixed_tiled``) run directly on the CPU, the summation tree of odd
widths spelled out by hand, and glm_dsa.syncfree's deferred checks."""

from __future__ import annotations

import pytest
import torch

from glm_dsa import invariant, syncfree
from glm_dsa.invariant import (
    BATCH_TILE,
    CUDA_ROW_TILE,
    ROW_TILE,
    batch_invariant,
    batch_tiled,
    fixed_tiled,
    row_sum,
    row_tile,
    row_tiled,
    row_wise,
    whole_tiles,
)


def test_tile_constants():
    assert (BATCH_TILE, ROW_TILE, CUDA_ROW_TILE) == (16, 64, 2048) and CUDA_ROW_TILE % ROW_TILE == 0


class _Recorder:
    """A row-wise function (``2x + 1``) that records the shape, contiguity and rows it is given."""

    def __init__(self):
        self.calls = []

    def __call__(self, t):
        self.calls.append((tuple(t.shape), t.is_contiguous(), t.clone()))
        return 2 * t + 1


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 16, 17])
def test_fixed_tiled_calls_every_tile_full_and_contiguous(n):
    x = torch.arange(n * 3, dtype=torch.float32).view(n, 3)
    f = _Recorder()
    out = fixed_tiled(f, x.T.contiguous().T, tile=8)  # a column-major view: tiles are made contiguous
    assert torch.equal(out, 2 * x + 1) and out.shape == (n, 3)
    if n == 0:
        assert len(f.calls) == 1 and f.calls[0][0] == (0, 3)
        return
    assert len(f.calls) == -(-n // 8)
    assert all(shape == (8, 3) and contiguous for shape, contiguous, _ in f.calls)
    last = f.calls[-1][2]
    pad = -n % 8
    if pad:
        assert not last[8 - pad:].any()  # the short tile is zero-padded


@pytest.mark.parametrize("n", [0, 15, 16, 17, 33])
def test_batch_tiled_calls_of_exactly_batch_tile_items(n):
    a = torch.randn(n, 2, 3)
    b = torch.randn(3, n, 4).transpose(0, 1)  # item-strided operand
    seen = []

    def fn(x, y):
        seen.append((x.shape[0], y.shape[0], y.stride()))
        return torch.bmm(x, y)

    out = batch_tiled(fn, a, b)
    assert torch.allclose(out, torch.bmm(a, b), atol=1e-6) and out.shape == (n, 2, 4)
    if n:
        assert all(s[0] == s[1] == BATCH_TILE for s in seen) and len(seen) == -(-n // BATCH_TILE)
        if n % BATCH_TILE:  # the padded tile keeps b's layout (item stride smallest but one)
            stride = seen[-1][2]
            assert stride[0] < stride[1]


def test_batch_tiled_refuses_two_batch_counts():
    with pytest.raises(ValueError, match="batch_tiled needs one batch count, got 2 and 3"):
        batch_tiled(torch.bmm, torch.zeros(2, 1, 1), torch.zeros(3, 1, 1))


def test_row_tiled_places_each_row_at_its_key_slot():
    keys = torch.tensor([0, 5, 8, 3, 13, 16, 21])  # slots mod 8: 0 5 0 3 5 0 5
    x = torch.arange(1, 8, dtype=torch.float32)[:, None].repeat(1, 2)
    f = _Recorder()
    out = row_tiled(f, x, keys, tile=8)
    assert torch.equal(out, 2 * x + 1)
    tiles = [c[2] for c in f.calls]
    assert len(tiles) == 3 and all(t.shape == (8, 2) for t in tiles)  # slot 0 and 5 hold 3 rows each
    # The r-th row of each slot, in row order, goes to tile r.
    assert [t[0, 0].item() for t in tiles] == [1.0, 3.0, 6.0]
    assert [t[5, 0].item() for t in tiles] == [2.0, 5.0, 7.0]
    assert [t[3, 0].item() for t in tiles] == [4.0, 0.0, 0.0]


@pytest.mark.parametrize("keys", [torch.zeros(3, dtype=torch.int16), torch.zeros(4, dtype=torch.int64),
                                  torch.zeros(3, 1, dtype=torch.int64), torch.zeros(3)])
def test_row_tiled_refuses_bad_keys(keys):
    with pytest.raises(ValueError, match=r"keys must be int32/int64 \[n=3\]"):
        row_tiled(lambda t: t, torch.zeros(3, 2), keys)


def test_row_tiled_of_no_rows():
    assert row_tiled(lambda t: t + 1, torch.zeros(0, 2), torch.zeros(0, dtype=torch.int64)).shape == (0, 2)


def test_row_wise_outside_and_inside_the_mode():
    x = torch.randn(5, 3)
    calls = []
    fn = lambda t: (calls.append(t.shape[0]), t * 3)[1]  # noqa: E731
    assert torch.equal(row_wise(fn, x, None), x * 3) and calls == [5]
    with batch_invariant():
        with pytest.raises(ValueError, match="needs each row's key"):
            row_wise(fn, x, None)
        calls.clear()
        assert torch.equal(row_wise(fn, x, torch.arange(5)), x * 3) and calls == [ROW_TILE]
    with batch_invariant(False):
        assert not invariant.active()


@pytest.mark.parametrize("rows, n, active, device, want", [
    (130, 1000, True, "cpu", 128), (128, 1000, True, "cpu", 128), (127, 1000, True, "cpu", 64),
    (63, 1000, True, "cpu", 64), (1000, 1000, True, "cpu", 1000), (999, 1000, True, "cpu", 960),
    (130, 1000, False, "cpu", 130), (5000, 10000, True, "cuda", 4096), (100, 10000, True, "cuda", 2048),
    (10000, 10000, True, "cuda", 10000),
])
def test_whole_tiles_edges(rows, n, active, device, want):
    with batch_invariant(active):
        assert whole_tiles(rows, n, torch.device(device)) == want


def test_row_tile_by_device():
    assert row_tile(torch.device("cuda")) == CUDA_ROW_TILE and row_tile(torch.device("cpu")) == ROW_TILE


# Values where the order of float32 additions shows: big + 1 loses the 1, big − big keeps it.
B = 2.0**25


@pytest.mark.parametrize("row, tree", [
    ([3.0], lambda x: x[0]),
    ([B, 1.0], lambda x: x[0] + x[1]),
    ([B, 1.0, -B], lambda x: (x[0] + x[2]) + x[1]),                     # 1.0, not 0
    ([B, 1.0, -B, 1.0], lambda x: (x[0] + x[2]) + (x[1] + x[3])),
    ([B, 1.0, 1.0, -B, 1.0], lambda x: ((x[0] + x[3]) + x[2]) + (x[1] + x[4])),
    ([1.0, B, 1.0, 1.0, -B, 1.0, 1.0], lambda x: ((x[0] + x[4]) + (x[2] + x[6])) + ((x[1] + x[5]) + x[3])),
])
def test_row_sum_tree_by_hand(row, tree):
    x = torch.tensor([row, row], dtype=torch.float32)
    want = tree(torch.tensor(row, dtype=torch.float32))
    with batch_invariant():
        got = row_sum(x)
        assert torch.equal(invariant.row_mean(x), (got / len(row))[:, None])
    assert got.tolist() == [want.item()] * 2
    assert torch.equal(row_sum(x), x.sum(-1))  # outside the mode: torch's sum
    assert torch.equal(invariant.row_mean(x), x.mean(-1, keepdim=True))


# ----------------------------------------------------------------------------- syncfree
def test_checks_without_flags_and_with_given_verdicts():
    with syncfree.sync_free() as checks:
        assert syncfree.active()
    assert checks.verdicts() is None
    checks.raise_first()
    with syncfree.sync_free() as checks:
        syncfree.check(torch.tensor(True), "first")
        syncfree.check(torch.tensor([False]), "second")  # a one-element verdict counts too
    assert checks.verdicts().tolist() == [True, False]
    checks.raise_first(torch.tensor([True, True]))  # a replay's verdicts, all good
    with pytest.raises(ValueError, match="^first$"):
        checks.raise_first(torch.tensor([False, False]))
    with pytest.raises(ValueError, match="^second$"):
        checks.raise_first()


def test_an_eager_check_raises_its_detail():
    with pytest.raises(ValueError, match="^row 3$"):
        syncfree.check(torch.tensor(False), "generic", lambda: "row 3")
    syncfree.check(torch.tensor(True), "generic", lambda: 1 / 0)  # detail only on failure


def test_sync_free_resets_after_an_error():
    with pytest.raises(RuntimeError, match="boom"):
        with syncfree.sync_free():
            raise RuntimeError("boom")
    assert not syncfree.active()
    with syncfree.sync_free():
        pass
