"""glm_dsa.fidelity's pure figures at their edges: sampled positions (rows = tokens, one more,
one fewer), position buckets around powers of two, recall with an index equal to a row's length
(outside), ``-1`` and repeats, attention mass with a length of 1 and of L, and every refusal of
``attention_mass`` one step either side."""

from __future__ import annotations

import math

import pytest
import torch

from glm_dsa.fidelity import attention_mass, position_buckets, sample_positions, topk_recall


@pytest.mark.parametrize("n, rows", [(5, 5), (5, 6), (5, 4), (1, 1), (100, 7), (7, 1)])
def test_sample_positions_edges(n, rows):
    got = sample_positions(n, rows, seed=3)
    if rows >= n:
        assert got.tolist() == list(range(n))
        return
    edges = [i * n // rows for i in range(rows + 1)]
    assert got.dtype == torch.int64 and len(got) == rows
    assert all(edges[i] <= int(got[i]) < edges[i + 1] for i in range(rows))
    assert torch.equal(got, sample_positions(n, rows, seed=3))


@pytest.mark.parametrize("n, rows, match", [(0, 1, "num_tokens=0"), (1, 0, "rows=0"), (1.0, 1, "num_tokens"),
                                            (1, True, None), (2, -1, "rows=-1")])
def test_sample_positions_refusals(n, rows, match):
    if match is None:  # a bool is an int here: rows=True is one row
        assert sample_positions(n, rows).tolist() == [0]
        return
    with pytest.raises(ValueError, match=match):
        sample_positions(n, rows)


@pytest.mark.parametrize("n, k, want", [
    (4, 4, [(0, 4)]), (5, 4, [(0, 4), (4, 5)]), (3, 4, [(0, 3)]), (8, 4, [(0, 4), (4, 8)]),
    (9, 4, [(0, 4), (4, 8), (8, 9)]), (16, 4, [(0, 4), (4, 8), (8, 16)]),
    (17, 4, [(0, 4), (4, 8), (8, 16), (16, 17)]),
])
def test_position_buckets_edges(n, k, want):
    assert position_buckets(n, k) == want


def test_recall_counts_only_valid_distinct_keys():
    lengths = torch.tensor([4, 4, 3, 2])
    ref = torch.tensor([[0, 1, 2, 3], [0, 1, -1, -1], [0, 1, 2, 3], [-1, -1, -1, -1]])
    # Row 0: 3 of 4 (4 is the row's length: outside); row 1: repeats count once, 1 of 2;
    # row 2: the reference's 3 is outside a length of 3, so 2 of 3; row 3: no valid key → 1.
    topk = torch.tensor([[0, 1, 2, 4], [1, 1, 1, 5], [0, 2, 3, 3], [0, 1, -1, -1]])
    assert topk_recall(topk, ref, lengths).tolist() == [0.75, 0.5, 2 / 3, 1.0]
    assert topk_recall(topk, ref, lengths).dtype == torch.float64
    assert topk_recall(topk[:0], ref[:0], lengths[:0]).shape == (0,)


@pytest.mark.parametrize("shapes, match", [
    (((2, 3), (2, 3), (3,)), r"lengths must be \[r=2\]"),
    (((2, 3), (3, 3), (2,)), "topk and reference must be"),
    (((2,), (2, 3), (2,)), "topk and reference must be"),
])
def test_recall_refusals(shapes, match):
    a, b, n = (torch.zeros(s, dtype=torch.int64) for s in shapes)
    with pytest.raises(ValueError, match=match):
        topk_recall(a, b, n)


def _mass_args(r=2, H=2, d=4, L=5):
    g = torch.Generator().manual_seed(0)
    return dict(query=torch.randn(r, H, d, generator=g, dtype=torch.float64),
                kv=torch.randn(L, d, generator=g, dtype=torch.float64),
                lengths=torch.tensor([1, L])[:r] if r == 2 else torch.full((r,), L),
                topk=torch.tensor([[0, -1], [L - 1, L]])[:r] if r == 2 else torch.zeros(r, 2, dtype=torch.int64),
                sm_scale=0.5, index_topk=1, d_v=3)


def test_attention_mass_by_hand_at_lengths_1_and_L():
    a = _mass_args()
    res = attention_mass(**a)
    q, kv = a["query"], a["kv"]
    # Row 0 sees key 0 only: every head's mass is on it, selected; outputs equal its value.
    assert torch.allclose(res.kept[0], torch.ones(2, dtype=torch.float64))
    assert torch.allclose(res.out_dense[0], kv[0, :3].expand(2, 3))
    assert torch.allclose(res.out_sparse[0], kv[0, :3].expand(2, 3))
    # Row 1 sees 5 keys; its selection is key 4 (index 5 = L is outside): kept = p[4].
    p = torch.softmax(q[1] @ kv.T * 0.5, dim=-1)  # [H, L]
    assert torch.allclose(res.kept[1], p[:, 4])
    assert torch.allclose(res.out_dense[1], p @ kv[:, :3])
    assert torch.allclose(res.out_sparse[1], kv[4, :3].expand(2, 3))
    best = int(p.mean(0).argmax())
    assert torch.allclose(res.best[1], p[:, best])
    assert res.overlap.tolist() == [1.0, 1.0 if best == 4 else 0.0]
    # A budget of one row per chunk gives the same figures.
    small = attention_mass(**a, budget_bytes=1)
    assert all(torch.equal(x, y) for x, y in zip(res, small))


def test_attention_mass_of_a_row_with_no_valid_selection_is_zero():
    a = _mass_args()
    a["topk"] = torch.tensor([[-1, 3], [7, -1]])  # row 0: 3 ≥ its length 1; row 1: 7 ≥ 5
    res = attention_mass(**a)
    assert not res.kept.any() and not res.out_sparse.any()


@pytest.mark.parametrize("key, value, match", [
    ("query", torch.zeros(2, 2, 4, dtype=torch.int64), "query must be floating"),
    ("query", torch.zeros(2, 4), "query must be floating"),
    ("kv", torch.zeros(5, 3, dtype=torch.float64), r"kv must be floating \[L, d_qk=4\]"),
    ("lengths", torch.tensor([0, 5]), r"lengths must lie in \[1, L=5\]"),
    ("lengths", torch.tensor([1, 6]), r"lengths must lie in \[1, L=5\]"),
    ("lengths", torch.tensor([1.0, 5.0]), "lengths must be int"),
    ("lengths", torch.tensor([1, 5, 5]), r"lengths must be int \[r=2\]"),
    ("topk", torch.zeros(3, 2, dtype=torch.int64), r"topk must be int \[r=2, k\]"),
    ("topk", torch.zeros(2, 2), "topk must be int"),
    ("index_topk", 0, "index_topk=0"),
    ("d_v", 0, r"d_v=0 must lie in \[1, d_qk=4\]"),
    ("d_v", 5, r"d_v=5 must lie in \[1, d_qk=4\]"),
    ("sm_scale", math.inf, "sm_scale=inf must be finite"),
    ("sm_scale", math.nan, "sm_scale=nan"),
    ("budget_bytes", 0, "budget_bytes=0"),
    ("budget_bytes", 2.0, "budget_bytes=2.0"),
])
def test_attention_mass_refusals(key, value, match):
    a = _mass_args()
    a[key] = value
    with pytest.raises(ValueError, match=match):
        attention_mass(**a)


@pytest.mark.parametrize("key, value", [("d_v", 4), ("d_v", 1), ("index_topk", 5), ("index_topk", 9),
                                        ("budget_bytes", None), ("lengths", torch.tensor([5, 1], dtype=torch.int32))])
def test_attention_mass_one_step_inside(key, value):
    a = _mass_args()
    a[key] = value
    res = attention_mass(**a)
    assert res.out_dense.shape[-1] == a["d_v"]
