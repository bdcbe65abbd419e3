"""The comparison metrics of the kernel contracts, with their upstream tolerances.

One definition, used by ``glm-dsa compare`` (golden vectors on disk) and by ``check_kernel``
(cases generated on the fly). A metric spec is a dict: ``{"metric": name, <tolerances>,
<references>}``; references (``mask``, ``scores``, ``row_starts``, ``row_ends``) name auxiliary
tensors that the caller resolves.

* ``bitwise``: byte formats and quantized values, element by element.
* ``calc_diff``: DeepGEMM's metric inside the valid region; the candidate must be finite there
  and, for cleaned logits, exactly ``-inf`` outside; uncleaned entries outside are ignored.
* ``allclose``: FlashMLA's ``check_is_allclose`` (abs / rel per element, ±inf/NaN positions,
  cos_diff).
* ``topk_set``: per row, the selected columns as a set, pads counted; a candidate may swap
  columns of equal score (kernels break ties arbitrarily), nothing else.
* ``index_set``: per row, the same multiset of indices (order free).
"""

from __future__ import annotations

import math
from typing import Callable, Mapping, NamedTuple

import torch
from torch import Tensor

from glm_dsa import oracle

__all__ = [
    "CALC_DIFF_MAX",
    "CALC_DIFF_MAX_BF16",
    "SPARSE_OUT_TOL",
    "SPARSE_STAT_TOL",
    "DECODE_OUT_TOL",
    "DECODE_LSE_TOL",
    "HADAMARD_TOL",
    "METRICS",
    "Verdict",
    "check_tensor",
]

# Upstream tolerances (DeepGEMM and FlashMLA tests; docs/conventions.md §14).
# DeepGEMM's newest test against the reference on dequantized inputs: float32 logits < 5e-6,
# bf16 logits < 3e-5 (one bf16 rounding alone gives about 7e-7).
CALC_DIFF_MAX = 5e-6
CALC_DIFF_MAX_BF16 = 3e-5
SPARSE_OUT_TOL = {"abs_tol": 8e-4, "rel_tol": 3.01 / 128, "cos_diff_tol": 7e-6}
SPARSE_STAT_TOL = {"abs_tol": 1e-6, "rel_tol": 2.01 / 65536, "cos_diff_tol": 1e-7}
DECODE_OUT_TOL = {"abs_tol": 1e-3, "rel_tol": 2.01 / 128, "cos_diff_tol": 5e-6}
DECODE_LSE_TOL = {"abs_tol": 1e-6, "rel_tol": 8.01 / 65536, "cos_diff_tol": 1e-7}
# A bf16 Hadamard output is the float32 result rounded once (relative error ≤ 2**-8); allow one
# bf16 ulp (2**-7) for a float32 sum that lands on the other side of a rounding boundary, and
# 1e-5 absolute for the float32 summation error of entries that cancel to nearly zero.
HADAMARD_TOL = {"abs_tol": 1e-5, "rel_tol": 2.01 / 256, "cos_diff_tol": 7e-6}

METRICS = ("bitwise", "calc_diff", "allclose", "topk_set", "index_set")


class Verdict(NamedTuple):
    """One metric on one tensor.

    passed: the verdict. value: the metric's value (differing elements for bitwise, calc_diff,
    cos_diff for allclose, differing rows for topk_set / index_set; NaN when the check stopped
    before computing it). bound: the value's bound (NaN where the bound is not one number).
    detail: one line saying what was compared and, on failure, where it first fails.
    """

    passed: bool
    value: float
    bound: float
    detail: str


def _pos(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ")"


def _first(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in mask.nonzero()[0])


def _bitwise(cand: Tensor, exp: Tensor) -> Verdict:
    if cand.element_size() != exp.element_size():
        return Verdict(False, math.nan, 0.0, (
            f"{cand.dtype} has {cand.element_size()}-byte elements, the expected {exp.dtype} "
            f"{exp.element_size()}-byte ones"
        ))
    width = exp.element_size()
    a = cand.contiguous().reshape(-1).view(torch.uint8).view(-1, width)
    b = exp.contiguous().reshape(-1).view(torch.uint8).view(-1, width)
    differ = (a != b).any(dim=1).view(exp.shape)
    n = int(differ.sum())
    if n == 0:
        return Verdict(True, 0.0, 0.0, f"bitwise equal ({exp.numel()} elements)")
    at = _first(differ)
    hex_ = lambda t: "0x" + bytes(t[at].reshape(1).view(torch.uint8).tolist()).hex()  # noqa: E731
    return Verdict(False, float(n), 0.0, (
        f"{n} of {exp.numel()} elements differ; first at {_pos(at)}: {hex_(cand)} vs {hex_(exp)}"
    ))


def _calc_diff(cand: Tensor, exp: Tensor, spec: dict, mask: Tensor) -> Verdict:
    bound = spec["max_bf16"] if cand.dtype == torch.bfloat16 and "max_bf16" in spec else spec["max"]
    if not cand.is_floating_point():
        return Verdict(False, math.nan, bound, f"dtype {cand.dtype} is not floating point")
    c, e = cand.double(), exp.double()
    bad_inside = mask & ~torch.isfinite(c)
    if bool(bad_inside.any()):
        at = _first(bad_inside)
        return Verdict(False, math.nan, bound, (
            f"not finite inside the valid region at {_pos(at)}: {float(c[at])} "
            f"(expected {float(e[at])})"
        ))
    if spec["outside_mask"] == "-inf":
        bad_outside = ~mask & ~torch.isneginf(c)
        if bool(bad_outside.any()):
            at = _first(bad_outside)
            return Verdict(False, math.nan, bound, (
                f"{int(bad_outside.sum())} entries outside the valid region are not -inf; "
                f"first at {_pos(at)}: {float(c[at])}"
            ))
    d = oracle.calc_diff(torch.where(mask, c, 0.0), torch.where(mask, e, 0.0))
    outside = "-inf outside exact" if spec["outside_mask"] == "-inf" else "outside ignored"
    ok = d < bound
    detail = f"calc_diff {d:.3g} {'<' if ok else '>='} {bound:g} ({outside})"
    if not ok:
        err = torch.where(mask, (c - e).abs(), 0.0)
        at = _first(err == err.max())
        detail += f"; largest error at {_pos(at)}: {float(c[at])} vs {float(e[at])}"
    return Verdict(ok, d, bound, detail)


def _allclose(cand: Tensor, exp: Tensor, spec: dict) -> Verdict:
    bound = spec["cos_diff_tol"]
    if not cand.is_floating_point():
        return Verdict(False, math.nan, bound, f"dtype {cand.dtype} is not floating point")
    r = oracle.check_allclose(cand, exp, spec["abs_tol"], spec["rel_tol"], spec["cos_diff_tol"])
    # The two tests that decide, each beside its bound; an element fails only when it is outside
    # both the absolute and the relative tolerance, so the max abs / max rel errors (usually at
    # different elements) follow as information.
    cos_ok = abs(r.cos_diff) <= bound
    text = (
        f"{r.num_failed} of {exp.numel()} elements outside both abs {spec['abs_tol']:g} and rel "
        f"{spec['rel_tol']:.4g} (worst element {r.worst_element:.3g} of its bound, fails at ≥ 1); "
        f"cos_diff {r.cos_diff:.3g} {'≤' if cos_ok else '>'} {bound:g}; "
        f"info: max abs err {r.max_abs_err:.3g}, max rel err {r.max_rel_err:.3g}"
    )
    if r.anomaly is not None:
        text = f"inf/NaN positions differ: {r.anomaly}; " + text
    elif r.first_failure is not None:
        at = r.first_failure
        text += f"; first failure at {_pos(at)}: {float(cand[at])} vs {float(exp[at])}"
    return Verdict(r.passed, r.cos_diff, bound, text)


def _selection(row: list[int], k: int, pad: int) -> list[int] | None:
    """The k selected entries of a row once its ``len(row) - k`` pads are removed (None if the
    row has fewer pads than that)."""
    rest = list(row)
    for _ in range(len(row) - k):
        if pad not in rest:
            return None
        rest.remove(pad)
    return rest


def _is_integer(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def _topk_set(cand: Tensor, exp: Tensor, spec: dict, scores: Tensor, starts: Tensor,
              ends: Tensor) -> Verdict:
    if not _is_integer(cand):
        return Verdict(False, math.nan, 0.0, f"dtype {cand.dtype} is not an integer type")
    starts_, ends_ = starts.tolist(), ends.tolist()
    pad, absolute = spec["pad"], spec["base"] == "absolute"
    topk = exp.shape[1]
    bad, first = 0, None
    for r, (c_row, e_row) in enumerate(zip(cand.tolist(), exp.tolist())):
        s, e = starts_[r], ends_[r]
        k = min(topk, e - s)
        picked, wanted = _selection(c_row, k, pad), _selection(e_row, k, pad)
        why = None
        if picked is None:
            why = f"fewer than {topk - k} pad entries ({pad})"
        else:
            cols = [v if absolute else v + s for v in picked]
            if any(not s <= c < e for c in cols):
                why = f"an index outside the row's [{s}, {e})"
            elif len(set(cols)) != k:
                why = "a repeated index"
            elif e - s > topk:
                wanted_cols = [v if absolute else v + s for v in wanted]
                got = sorted(scores[r, cols].tolist())
                if got != sorted(scores[r, wanted_cols].tolist()):
                    why = "a selected score differs from the top-k scores"
        if why is not None:
            bad += 1
            first = first or f"row {r}: {why}; got {c_row[:8]}…, expected {e_row[:8]}…"
    if bad == 0:
        return Verdict(True, 0.0, 0.0,
                       f"{exp.shape[0]} rows equal as sets (equal scores interchangeable)")
    return Verdict(False, float(bad), 0.0, f"{bad} of {exp.shape[0]} rows differ; first {first}")


def _index_set(cand: Tensor, exp: Tensor) -> Verdict:
    if not _is_integer(cand):
        return Verdict(False, math.nan, 0.0, f"dtype {cand.dtype} is not an integer type")
    c_sorted, e_sorted = cand.long().sort(dim=-1).values, exp.long().sort(dim=-1).values
    differ = (c_sorted != e_sorted).any(dim=-1)
    n = int(differ.sum())
    if n == 0:
        return Verdict(True, 0.0, 0.0, f"{exp.shape[0]} rows equal as sets")
    row = _first(differ)
    return Verdict(False, float(n), 0.0, (
        f"{n} of {exp.shape[0]} rows differ as sets; first row {_pos(row)}: sorted "
        f"{c_sorted[row].tolist()[:8]}… vs {e_sorted[row].tolist()[:8]}…"
    ))


def check_tensor(spec: Mapping, cand: Tensor, exp: Tensor, ref: Callable[[str], Tensor]) -> Verdict:
    """Check ``cand`` against the expected ``exp`` with the metric ``spec`` names.

    ``ref(name)`` returns the auxiliary tensor a spec reference names (``spec["mask"]`` …).
    Shapes must be equal; both tensors on the CPU. An unknown metric is a ValueError.
    """
    metric = spec["metric"]
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    if tuple(cand.shape) != tuple(exp.shape):
        return Verdict(False, math.nan, math.nan,
                       f"shape {tuple(cand.shape)}, expected {tuple(exp.shape)}")
    if metric == "bitwise":
        return _bitwise(cand, exp)
    if metric == "calc_diff":
        return _calc_diff(cand, exp, dict(spec), ref(spec["mask"]))
    if metric == "allclose":
        return _allclose(cand, exp, dict(spec))
    if metric == "topk_set":
        return _topk_set(cand, exp, dict(spec), ref(spec["scores"]), ref(spec["row_starts"]),
                         ref(spec["row_ends"]))
    return _index_set(cand, exp)
