"""glm_dsa.testing.metrics at each bound: a value equal to a strict bound fails and the next
float below passes (calc_diff), an inclusive bound passes at equality (cos_diff, topk_margin),
an element outside only one of abs / rel passes, an index equal to the row's end is outside,
signed zeros differ bitwise, equal scores are interchangeable and nothing else."""

from __future__ import annotations

import math

import pytest
import torch

from glm_dsa import oracle
from glm_dsa.testing.metrics import check_tensor


def _check(spec, cand, exp, **refs):
    return check_tensor(spec, cand, exp, refs.__getitem__)


# ----------------------------------------------------------------------------- bitwise
def test_bitwise_edges():
    spec = {"metric": "bitwise"}
    assert _check(spec, torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0])).passed
    nan = torch.tensor([float("nan")])
    assert _check(spec, nan, nan.clone()).passed  # the same bits
    v = _check(spec, torch.tensor([1.0, -0.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 2.0, 4.0]))
    assert not v.passed and v.value == 2.0
    assert "2 of 4 elements differ; first at (1): 0x80000000 vs 0x00000000" in v.detail  # -0.0, +0.0
    size = _check(spec, torch.zeros(2, dtype=torch.float16), torch.zeros(2, dtype=torch.float32))
    assert not size.passed and "2-byte elements, the expected torch.float32 4-byte ones" in size.detail
    same_size = _check(spec, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.float32))
    assert same_size.passed  # bytes, not dtypes
    rows = torch.zeros(2, 4, dtype=torch.uint8)
    other = rows.clone()
    other[1, 3] = 1
    v = _check({"metric": "bitwise", "regions": [("codes", 0, 3), ("scale", 3, 4)]}, other, rows)
    assert v.criteria[1] == "FAIL bytes differing by region: codes 0 of 6, scale 1 of 2"


# ----------------------------------------------------------------------------- calc_diff
def _calc_case():
    g = torch.Generator().manual_seed(0)
    exp = torch.randn(3, 6, generator=g)
    cand = exp + 1e-3 * torch.randn(3, 6, generator=g)
    mask = torch.ones(3, 6, dtype=torch.bool)
    mask[0, 4:] = False
    exp = exp.masked_fill(~mask, float("-inf"))
    cand = cand.masked_fill(~mask, float("-inf"))
    d = oracle.calc_diff(torch.where(mask, cand.double(), 0.0), torch.where(mask, exp.double(), 0.0))
    return cand, exp, mask, d


def test_calc_diff_bound_is_strict():
    cand, exp, mask, d = _calc_case()
    spec = {"metric": "calc_diff", "outside_mask": "-inf", "mask": "m"}
    assert not _check({**spec, "max": d}, cand, exp, m=mask).passed
    assert _check({**spec, "max": math.nextafter(d, math.inf)}, cand, exp, m=mask).passed
    # bf16 candidates take max_bf16 when the spec has one.
    bf = {**spec, "max": 0.0, "max_bf16": 1.0}
    assert _check(bf, cand.bfloat16(), exp, m=mask).passed
    assert not _check(bf, cand, exp, m=mask).passed


def test_calc_diff_regions():
    cand, exp, mask, _ = _calc_case()
    cleaned = {"metric": "calc_diff", "outside_mask": "-inf", "mask": "m", "max": 1.0}
    ignored = {**cleaned, "outside_mask": "ignored"}
    outside = cand.clone()
    outside[0, 5] = 7.0  # a finite entry outside the valid region
    assert not _check(cleaned, outside, exp, m=mask).passed
    assert _check(ignored, outside, exp, m=mask).passed
    inside = cand.clone()
    inside[2, 2] = float("inf")
    v = _check(ignored, inside, exp, m=mask)
    assert not v.passed and v.detail.startswith("finite inside the valid region: 1 of 16 entries are not")
    assert not _check(cleaned, cand.long(), exp, m=mask).passed


# ----------------------------------------------------------------------------- allclose
ALL = {"metric": "allclose", "abs_tol": 1e-3, "rel_tol": 1e-2, "cos_diff_tol": 1.0}


@pytest.mark.parametrize("cand, ok", [
    (100.5, True),     # abs err 0.5 > 1e-3 but rel 5e-3 < 1e-2: inside one tolerance
    (102.0, False),    # outside both
    (0.0005, True),    # exp 0: abs err 5e-4 < 1e-3
    (0.002, False),    # exp 0: abs 2e-3, rel huge
])
def test_allclose_fails_an_element_only_outside_both(cand, ok):
    exp = torch.tensor([100.0, 0.0])
    c = torch.tensor([cand, 0.0]) if cand > 1 else torch.tensor([100.0, cand])
    assert _check(ALL, c, exp).passed is ok


def test_allclose_cos_diff_bound_is_inclusive_and_specials_must_match():
    g = torch.Generator().manual_seed(1)
    exp = torch.randn(50, generator=g)
    cand = exp + 1e-4 * torch.randn(50, generator=g)
    cos = oracle.check_allclose(cand, exp, 1.0, 1.0, 1.0).cos_diff
    loose = {**ALL, "abs_tol": 1.0, "rel_tol": 1.0}
    assert _check({**loose, "cos_diff_tol": abs(cos)}, cand, exp).passed
    assert not _check({**loose, "cos_diff_tol": math.nextafter(abs(cos), 0.0)}, cand, exp).passed
    inf = torch.tensor([1.0, float("inf")])
    v = _check(loose, torch.tensor([1.0, float("-inf")]), inf)
    assert not v.passed and "lonely rows" in v.hint
    assert _check(loose, inf.clone(), inf).passed


# ----------------------------------------------------------------------------- top-k sets
def _topk_spec(base="relative"):
    return {"metric": "topk_set", "pad": -1, "base": base, "scores": "s", "row_starts": "a", "row_ends": "b"}


def test_topk_set_edges():
    scores = torch.tensor([[5.0, 4.0, 4.0, 1.0, 9.0]])
    a, b = torch.tensor([0]), torch.tensor([4])  # the window [0, 4): column 4 is outside
    exp = torch.tensor([[0, 1]])
    spec = _topk_spec()
    assert _check(spec, torch.tensor([[1, 0]]), exp, s=scores, a=a, b=b).passed
    assert _check(spec, torch.tensor([[0, 2]]), exp, s=scores, a=a, b=b).passed  # equal score swapped
    assert not _check(spec, torch.tensor([[0, 3]]), exp, s=scores, a=a, b=b).passed
    at_end = _check(spec, torch.tensor([[0, 4]]), exp, s=scores, a=a, b=b)
    assert not at_end.passed and "select column row_end" in at_end.hint
    assert not _check(spec, torch.tensor([[0, 0]]), exp, s=scores, a=a, b=b).passed
    assert not _check(spec, torch.tensor([[0, -1]]), exp, s=scores, a=a, b=b).passed
    # A window of exactly k keys: all of them, any order; one of k - 1: one pad.
    full = torch.tensor([2])
    assert _check(spec, torch.tensor([[1, 0]]), exp, s=scores, a=a, b=full).passed
    short = torch.tensor([1])
    assert _check(spec, torch.tensor([[0, -1]]), torch.tensor([[0, -1]]), s=scores, a=a, b=short).passed
    assert not _check(spec, torch.tensor([[0, 1]]), torch.tensor([[0, -1]]), s=scores, a=a, b=short).passed
    # Absolute columns from an offset start: relative indices read as columns are outside.
    off_a, off_b = torch.tensor([1]), torch.tensor([5])
    assert _check(_topk_spec("absolute"), torch.tensor([[4, 1]]), torch.tensor([[1, 4]]),
                  s=scores, a=off_a, b=off_b).passed
    rel = _check(spec, torch.tensor([[4, 1]]), torch.tensor([[0, 3]]), s=scores, a=off_a, b=off_b)
    assert not rel.passed and "look like column numbers" in rel.hint
    assert not _check(spec, torch.tensor([[0.0, 1.0]]), exp, s=scores, a=a, b=b).passed


def test_topk_margin_bound_is_inclusive():
    scores = torch.tensor([[8.0, 7.0, 6.0, 5.0]])  # largest |score| 8; the 2nd best is 7
    a, b = torch.tensor([0]), torch.tensor([4])
    exp = torch.tensor([[0, 1]])
    spec = {"metric": "topk_margin", "rel_tol": 1.0 / 8, "scores": "s", "row_starts": "a", "row_ends": "b"}
    # Position 2 scores 6: 1/8 of the largest |score| below the k-th best: at the bound.
    assert _check(spec, torch.tensor([[0, 2]]), exp, s=scores, a=a, b=b).passed
    assert not _check({**spec, "rel_tol": math.nextafter(1 / 8, 0)}, torch.tensor([[0, 2]]), exp,
                      s=scores, a=a, b=b).passed
    assert not _check(spec, torch.tensor([[0, 4]]), exp, s=scores, a=a, b=b).passed  # position = len
    assert not _check(spec, torch.tensor([[1, 1]]), exp, s=scores, a=a, b=b).passed


def test_index_set_is_a_multiset():
    spec = {"metric": "index_set"}
    assert _check(spec, torch.tensor([[3, 1, 1]]), torch.tensor([[1, 3, 1]])).passed
    v = _check(spec, torch.tensor([[3, 1, -1]]), torch.tensor([[1, 3, 1]]))
    assert not v.passed and "fewer times than listed" in v.hint
    assert not _check(spec, torch.tensor([[3.0, 1.0, 1.0]]), torch.tensor([[1, 3, 1]])).passed
