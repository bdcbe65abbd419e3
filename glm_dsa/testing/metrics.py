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
  columns of equal score (kernels break ties arbitrarily), nothing else. For kernels handed
  the logits (they rank exactly our scores).
* ``topk_margin``: per row, the same checks of range, repeats and pads, then a member is wrong
  only if its exact score is below the row's k-th best by more than ``rel_tol`` times the
  row's largest |score|. For kernels that score the keys themselves (a fused score + top-k
  kernel ranks its own float32 logits, whose order of summation decides near-ties).
* ``index_set``: per row, the same multiset of indices (order free).
"""

from __future__ import annotations

import math
import sys
from collections import Counter
from typing import Callable, Mapping, NamedTuple

import torch
from torch import Tensor

from glm_dsa import oracle

__all__ = [
    "CALC_DIFF_MAX",
    "CALC_DIFF_MAX_BF16",
    "SPARSE_OUT_TOL",
    "SPARSE_STAT_TOL",
    "Q8KV8_OUT_TOL",
    "Q8KV8_STAT_TOL",
    "DECODE_OUT_TOL",
    "DECODE_LSE_TOL",
    "HADAMARD_TOL",
    "TOPK_REL_TOL",
    "FLOAT16_MAX",
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
# The Q8KV8 kernel (SGLang #25751) against the dequantized-FP8 reference. Its second
# GEMM takes the softmax weights in e4m3: rounding a weight in (0, 1] errs by up to 2**-4
# relative (rms 2**-4/sqrt(3) = 3.6 %), so `out` may err by ~3.6 % rms relative, cos_diff
# e**2 / 2 = 6.5e-4 at worst: bound 1e-3 (SGLang measures 0.7 % rel-mean, cos_diff < 1e-4, on
# its kernel). Per element: SGLang's rel 8e-2 (its assert_close), or abs 2**-4 * 0.1 (one
# weight's rounding times a value of the inputs' std 0.1: a row of two or three valid entries
# averages too few values for the errors to cancel).
Q8KV8_OUT_TOL = {"abs_tol": 2**-4 * 0.1, "rel_tol": 8e-2, "cos_diff_tol": 1e-3}
# Its max_logits and lse: the e4m3 products are exact, but Hopper's FP8 wgmma adds them into an
# accumulator that keeps about 14 bits (DeepSeek-V3 report §3.3.2; DeepGEMM moves its FP8 sums
# to float32 registers every 128 products for this), so a score errs by up to ~2**-13 of the
# sum of its products' magnitudes, not of the score: sm_scale * sum|q_i k_i| * 2**-13, and
# sum|q_i k_i| <= |q| |k| ~ 5.8 for the cases' std-0.1 inputs over 576 dims (7 in the tails);
# at the size tables' largest sm_scale, 0.5: 8.5e-4, hence abs 2**-10. Measured on the H200
# (2026-12-04, run A, the Gluon Q8KV8 kernel at sm_scale 1/24 and 1/sqrt(192)): 2.3e-5 to
# 4.0e-5, cos_diff 1.0e-8 to 1.7e-8 against FlashMLA's 1e-7, which stays (it is scale-free and
# catches a systematic error that the per-element bound lets through).
Q8KV8_STAT_TOL = {"abs_tol": 2**-10, "rel_tol": 2.01 / 65536, "cos_diff_tol": 1e-7}
DECODE_OUT_TOL = {"abs_tol": 1e-3, "rel_tol": 2.01 / 128, "cos_diff_tol": 5e-6}
DECODE_LSE_TOL = {"abs_tol": 1e-6, "rel_tol": 8.01 / 65536, "cos_diff_tol": 1e-7}
# A bf16 Hadamard output is the float32 result rounded once (relative error ≤ 2**-8); allow one
# bf16 ulp (2**-7) for a float32 sum that lands on the other side of a rounding boundary, and
# 1e-5 absolute for the float32 summation error of entries that cancel to nearly zero.
HADAMARD_TOL = {"abs_tol": 1e-5, "rel_tol": 2.01 / 256, "cos_diff_tol": 7e-6}

# A fused score + top-k kernel's logits differ from the exact ones by its dot products'
# accumulation error: Hopper's FP8 MMA keeps about 14 bits of the running sum (DeepSeek-V3
# report §3.3.2), so a q·k over 128 dims may be off by ~2**-14 of its terms' magnitude, and
# DeepGEMM 54e2261's fp8_mqa_logits then top-k chose a member 2.8e-05 of the row's largest
# |score| below the k-th best on the H200 (2026-12-02, evening R1). 2**-12 of the row's largest
# |score| leaves 8x that and stays far below the gap a wrong member makes (a missing ReLU, gate
# or key scale moves members by whole fractions of the scale).
TOPK_REL_TOL = 2**-12
FLOAT16_MAX = 65504.0

METRICS = ("bitwise", "calc_diff", "allclose", "topk_set", "topk_margin", "index_set")


class Verdict(NamedTuple):
    """One metric on one tensor.

    passed: the verdict. value: the metric's value (differing elements for bitwise, calc_diff,
    cos_diff for allclose, differing rows for topk_set / index_set; on a failure, the failing
    criterion's own number, NaN where it has none). bound: the value's bound (NaN where the bound
    is not one number). detail: one line, the failing criterion first with its numbers (on a
    pass, what was compared). criteria: one line per criterion, ``PASS`` / ``FAIL`` first.
    hint: what a recognisable failure pattern usually means ("" when none is recognised).
    """

    passed: bool
    value: float
    bound: float
    detail: str
    criteria: tuple[str, ...] = ()
    hint: str = ""

    def text(self) -> str:
        """The detail, then (on a failure) every criterion and the hint, one per line."""
        if self.passed:
            return self.detail
        rest = [f"  {c}" for c in self.criteria if c != f"FAIL {self.detail}"]
        return "\n".join([self.detail, *rest] + ([f"  hint: {self.hint}"] if self.hint else []))


def _pos(index: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(i) for i in index) + ")"


def _first(mask: Tensor) -> tuple[int, ...]:
    return tuple(int(v) for v in mask.nonzero()[0])


def _verdict(criteria: list[tuple[bool, float, float, str]], hint: str = "") -> Verdict:
    """A verdict from its criteria (passed, value, bound, line), the first failing one leading."""
    lines = tuple(f"{'PASS' if ok else 'FAIL'} {line}" for ok, _, _, line in criteria)
    failed = [c for c in criteria if not c[0]]
    if not failed:
        ok, value, bound, line = criteria[-1]
        return Verdict(True, value, bound, "; ".join(c[3] for c in criteria), lines)
    _, value, bound, line = failed[0]
    return Verdict(False, value, bound, line, lines, hint)


LOG2E = 1 / math.log(2)


def _ratio_hint(cand: Tensor, exp: Tensor, where: Tensor, tol: float) -> str:
    """A hint when the candidate is the expected value times one constant: every ratio within
    ``tol`` (relative) of the median, and the median further than that from 1."""
    c, e = cand.double(), exp.double()
    sel = where & torch.isfinite(c) & torch.isfinite(e) & (e.abs() > 1e-6)
    if int(sel.sum()) < 2:
        return ""
    ratio = c[sel] / e[sel]
    med = float(ratio.median())
    if not math.isfinite(med) or med == 0:
        return ""
    spread = float((ratio - med).abs().max()) / abs(med)
    if spread > tol or abs(med - 1) <= 4 * max(spread, tol):
        return ""
    if abs(med - LOG2E) < 1e-3:
        return ("every value is 1/ln 2 = 1.4427 times the oracle's: a base-2 lse / max_logits "
                "where natural log is due (a kernel with that convention checks with "
                "--convention sep2025)")
    if abs(med - 1 / LOG2E) < 1e-3:
        return "every value is ln 2 = 0.6931 times the oracle's: natural log where base 2 is pinned"
    return (f"every value is {med:.6g} times the oracle's (to within {spread:.2g}): a uniform "
            f"scale error (a scale missing, doubled or applied to the wrong operand)")


def _regions_line(differ: Tensor, spec: dict) -> str:
    """How many bytes differ in each named region of a byte format (``spec["regions"]``: name,
    first byte, end byte over the last ``region_dims`` dims flattened)."""
    dims = spec.get("region_dims", 1)
    per = differ.reshape(-1, math.prod(differ.shape[-dims:]))
    parts = []
    for name, lo, hi in spec["regions"]:
        part = per[:, lo:hi]
        parts.append(f"{name} {int(part.sum())} of {part.numel()}")
    return "bytes differing by region: " + ", ".join(parts)


def _bitwise(cand: Tensor, exp: Tensor, spec: dict) -> Verdict:
    if cand.element_size() != exp.element_size():
        return _verdict([(False, math.nan, 0.0, (
            f"element size: {cand.dtype} has {cand.element_size()}-byte elements, the expected "
            f"{exp.dtype} {exp.element_size()}-byte ones"))])
    width = exp.element_size()
    a = cand.contiguous().reshape(-1).view(torch.uint8).view(-1, width)
    b = exp.contiguous().reshape(-1).view(torch.uint8).view(-1, width)
    differ = (a != b).any(dim=1).view(exp.shape)
    n = int(differ.sum())
    if n == 0:
        return _verdict([(True, 0.0, 0.0, f"bitwise equal ({exp.numel()} elements)")])
    at = _first(differ)
    # the element's bit pattern as a number (most significant byte first), as 0x3c800000 is 2**-6
    hex_ = lambda t: f"0x{int.from_bytes(bytes(t[at].reshape(1).view(torch.uint8).tolist()), sys.byteorder):0{2 * width}x}"  # noqa: E731
    criteria = [(False, float(n), 0.0, (
        f"bitwise: {n} of {exp.numel()} elements differ; first at {_pos(at)}: {hex_(cand)} vs "
        f"{hex_(exp)}"))]
    if "regions" in spec:
        criteria.append((False, float(n), 0.0, _regions_line(differ, spec)))
    return _verdict(criteria)


def _window_hint(finite: Tensor, mask: Tensor) -> str:
    """A hint when, row by row, the candidate's finite region is the valid region shifted or cut
    by one column at one end."""
    if finite.dim() != 2 or bool((finite == mask).all()):
        return ""
    width = mask.shape[1]
    col = torch.arange(width)
    patterns: dict[str, int] = {}
    at_last = 0  # rows cut short whose window ends at the output's last column
    for r in range(mask.shape[0]):
        if bool((finite[r] == mask[r]).all()):
            continue
        valid, got = col[mask[r]], col[finite[r]]
        if valid.numel() == 1 and got.numel() == 0:  # a one-key window cut to none
            key = "ends one column early"
        elif valid.numel() == 0 and got.numel() == 1:  # an empty window grown by one
            key = "ends one column late"
        elif valid.numel() == 0 or got.numel() == 0 or got.numel() != int(got[-1] - got[0]) + 1:
            return ""
        else:
            lo, hi, glo, ghi = int(valid[0]), int(valid[-1]), int(got[0]), int(got[-1])
            found = {(0, -1): "ends one column early", (0, 1): "ends one column late",
                     (1, 0): "starts one column late", (-1, 0): "starts one column early"}.get(
                (glo - lo, ghi - hi))
            if found is None:
                return ""
            key = found
            at_last += key == "ends one column early" and hi == width - 1
        patterns[key] = patterns.get(key, 0) + 1
    if len(patterns) != 1:
        return ""
    (what, rows), = patterns.items()
    if what == "ends one column early" and at_last == rows:
        what = "drops the output's last column"
    why = {"ends one column early": "an exclusive end read as inclusive (< ke - 1), or the last key "
                                    "of a block dropped",
           "ends one column late": "the end is exclusive: a row sees keys < ke (< ctx)",
           "starts one column late": "the start is inclusive: a row sees keys >= ks",
           "starts one column early": "the start is inclusive at ks, not ks - 1",
           "drops the output's last column": "a tile's tail column not written"}[what]
    return f"off-by-one window: in {rows} rows the kernel's finite region {what} ({why})"


def _calc_diff(cand: Tensor, exp: Tensor, spec: dict, mask: Tensor) -> Verdict:
    bound = spec["max_bf16"] if cand.dtype == torch.bfloat16 and "max_bf16" in spec else spec["max"]
    if not cand.is_floating_point():
        return _verdict([(False, math.nan, bound, f"dtype: {cand.dtype} is not floating point")])
    c, e = cand.double(), exp.double()
    finite = torch.isfinite(c)
    criteria = []
    bad_inside = mask & ~finite
    n_in = int(bad_inside.sum())
    line = f"finite inside the valid region: {n_in} of {int(mask.sum())} entries are not"
    if n_in:
        at = _first(bad_inside)
        line += f"; first at {_pos(at)}: {float(c[at])} (expected {float(e[at])})"
    criteria.append((n_in == 0, float(n_in), 0.0, line))
    cleaned = spec["outside_mask"] == "-inf"
    if cleaned:
        bad_outside = ~mask & ~torch.isneginf(c)
        n_out = int(bad_outside.sum())
        line = f"-inf outside the valid region: {n_out} of {int((~mask).sum())} entries are not"
        if n_out:
            at = _first(bad_outside)
            line += f"; first at {_pos(at)}: {float(c[at])}"
        criteria.append((n_out == 0, float(n_out), 0.0, line))
    d = oracle.calc_diff(torch.where(mask & finite, c, 0.0), torch.where(mask, e, 0.0))
    ok = d < bound
    line = (f"calc_diff {d:.3g} {'<' if ok else '>='} {bound:g} inside the valid region "
            f"({'-inf outside exact' if cleaned else 'outside ignored'})")
    if not ok:
        # A non-finite entry inside the region is the worst error, whatever the finite ones.
        err = torch.where(mask, torch.where(finite, (c - e).abs(), math.inf), 0.0)
        at = _first(err == err.max())
        line += f"; largest error at {_pos(at)}: {float(c[at])} vs {float(e[at])}"
    criteria.append((ok, d, bound, line))
    # Outside the valid region an uncleaned candidate's entries say nothing about its window.
    hint = _window_hint(finite if cleaned else finite & mask, mask)
    if not hint and not ok:
        hint = _ratio_hint(c, e, mask, 2.0**-8 if cand.dtype == torch.bfloat16 else 1e-6)
    return _verdict(criteria, hint)


def _worst_element(cand: Tensor, exp: Tensor, spec: dict) -> tuple[int, ...]:
    """The element furthest outside the tolerance (FlashMLA's per-element test: the smaller of
    abs_err / abs_tol and rel_err / rel_tol), among the elements finite in both."""
    c, e = cand.double(), exp.double()
    both = torch.isfinite(c) & torch.isfinite(e)
    err = torch.where(both, (c - e).abs(), 0.0)
    rel = err / (e.abs() + 1e-6)
    over = torch.minimum(err / spec["abs_tol"], rel / spec["rel_tol"])
    return _first(over == over.max())


def _allclose(cand: Tensor, exp: Tensor, spec: dict) -> Verdict:
    bound = spec["cos_diff_tol"]
    if not cand.is_floating_point():
        return _verdict([(False, math.nan, bound, f"dtype: {cand.dtype} is not floating point")])
    r = oracle.check_allclose(cand, exp, spec["abs_tol"], spec["rel_tol"], spec["cos_diff_tol"])
    criteria = []
    hint = ""
    if r.anomaly is not None:
        n = sum(int((special(cand) ^ special(exp)).sum())
                for special in (torch.isposinf, torch.isneginf, torch.isnan))
        where = r.anomaly.replace(" ans", " the kernel").replace(" ref", " the oracle")
        criteria.append((False, float(n), 0.0, f"inf/NaN positions: {where}"))
        if bool((torch.isneginf(cand) & torch.isposinf(exp)).any()):
            hint = ("lonely rows (no valid index): the kernel gives -inf where the contract gives "
                    "+inf (the older FlashMLA convention; a kernel with it pins lonely_lse='-inf')")
        elif bool((torch.isposinf(cand) & torch.isneginf(exp)).any()):
            hint = "lonely rows: the kernel gives +inf where the pinned convention gives -inf"
    else:
        criteria.append((True, 0.0, 0.0, "inf/NaN positions equal"))
    # An element fails only when it is outside both the absolute and the relative tolerance.
    line = (f"elements: {r.num_failed} of {exp.numel()} outside both abs {spec['abs_tol']:g} and rel "
            f"{spec['rel_tol']:.4g} (worst element {r.worst_element:.3g} of its bound, fails at >= 1)")
    if r.num_failed and r.anomaly is None:
        at = _worst_element(cand, exp, spec)
        line += f"; worst at {_pos(at)}: {float(cand[at])} vs {float(exp[at])}"
    criteria.append((r.num_failed == 0, float(r.num_failed), 0.0, line))
    cos_ok = abs(r.cos_diff) <= bound
    criteria.append((cos_ok, r.cos_diff, bound, (
        f"cos_diff {r.cos_diff:.3g} {'<=' if cos_ok else '>'} {bound:g} (info: max abs err "
        f"{r.max_abs_err:.3g}, max rel err {r.max_rel_err:.3g})")))
    everywhere = torch.ones_like(exp, dtype=torch.bool)
    verdict = _verdict(criteria, hint or _ratio_hint(cand, exp, everywhere, spec["rel_tol"]))
    if verdict.passed:  # the pass line leads with the metric's value, cos_diff
        return verdict._replace(value=r.cos_diff, bound=bound,
                                detail=f"{criteria[1][3]}; {criteria[2][3]}")
    return verdict


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
        return _verdict([(False, math.nan, 0.0, f"dtype: {cand.dtype} is not an integer type")])
    starts_, ends_ = starts.tolist(), ends.tolist()
    pad, absolute = spec["pad"], spec["base"] == "absolute"
    topk = exp.shape[1]
    bad, first, last_dropped, at_end, looks_absolute = 0, None, 0, 0, 0
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
                at_end += e in cols and all(s <= c <= e for c in cols)
                looks_absolute += not absolute and s > 0 and all(s <= v < e for v in picked)
            elif len(set(cols)) != k:
                why = "a repeated index"
            elif e - s > topk and wanted is not None:
                wanted_cols = [v if absolute else v + s for v in wanted]
                got = sorted(scores[r, cols].tolist())
                if got != sorted(scores[r, wanted_cols].tolist()):
                    why = "a selected score differs from the top-k scores"
        if why is not None and picked is not None and wanted is not None and e > s:
            got_cols = {v if absolute else v + s for v in picked}
            want_cols = {v if absolute else v + s for v in wanted}
            last_dropped += (e - 1) in want_cols and (e - 1) not in got_cols
        if why is not None:
            bad += 1
            first = first or f"row {r}: {why}; got {c_row[:8]}…, expected {e_row[:8]}…"
    if bad == 0:
        return _verdict([(True, 0.0, 0.0,
                          f"{exp.shape[0]} rows equal as sets (equal scores interchangeable)")])
    hint = ""
    if looks_absolute == bad:
        hint = ("the indices look like column numbers: the contract's are relative to row_start "
                "(a kernel returning columns pins base='absolute')")
    elif at_end:
        hint = f"{at_end} rows select column row_end: the range [row_start, row_end) is exclusive"
    elif last_dropped == bad:
        hint = (f"{bad} rows never select their last column (row_end - 1): the range is read as "
                f"[row_start, row_end - 1)")
    return _verdict([(False, float(bad), 0.0,
                      f"rows as sets: {bad} of {exp.shape[0]} rows differ; first {first}")], hint)


def _topk_margin(cand: Tensor, exp: Tensor, spec: dict, scores: Tensor, starts: Tensor,
                 ends: Tensor) -> Verdict:
    """Per row: ``min(topk, len)`` distinct in-range positions then -1 pads; when the row has
    more than ``topk`` positions, each member's exact score at most ``rel_tol · max |score|``
    below the row's k-th best. Value: the worst member's shortfall in units of the row's
    largest |score|."""
    if not _is_integer(cand):
        return _verdict([(False, math.nan, 0.0, f"dtype: {cand.dtype} is not an integer type")])
    rel_tol, topk = spec["rel_tol"], exp.shape[1]
    bad, first, worst, dropped_last = 0, None, 0.0, 0
    for r, row in enumerate(cand.tolist()):
        s, e = int(starts[r]), int(ends[r])
        k = min(topk, e - s)
        picked = _selection(row, k, -1)
        why = None
        if picked is None:
            why = f"fewer than {topk - k} pad entries (-1)"
        elif any(not 0 <= v < e - s for v in picked):
            why = f"a position outside the row's [0, {e - s})"
        elif len(set(picked)) != k:
            why = "a repeated position"
        elif e - s > topk:
            row_scores = scores[r, s:e].double()
            kth = float(row_scores.topk(topk).values[-1])
            scale = float(row_scores.abs().max()) or 1.0
            short = (kth - row_scores[picked]).clamp_min(0) / scale
            at = int(short.argmax())
            worst = max(worst, float(short[at]))
            if float(short[at]) > rel_tol:
                why = (f"position {picked[at]} scores {float(row_scores[picked[at]]):.9g}, "
                       f"{float(short[at]):.3g} of the row's largest |score| below the k-th "
                       f"best {kth:.9g} (tolerance {rel_tol:g})")
                best = set(row_scores.topk(topk).indices.tolist())
                dropped_last += (e - s - 1) in best and (e - s - 1) not in picked
        if why is not None:
            bad += 1
            first = first or f"row {r}: {why}"
    if bad == 0:
        return _verdict([(True, worst, rel_tol, (
            f"{exp.shape[0]} rows hold a top-{topk}: worst member {worst:.3g} of the row's "
            f"largest |score| below the k-th best (tolerance {rel_tol:g})"))])
    hint = ""
    if dropped_last == bad:
        hint = (f"{bad} rows leave out their last position though it ranks in the top-k: the "
                f"row's range is read as [0, len - 1)")
    return _verdict([(False, float(bad), 0.0,
                      f"top-k members: {bad} of {exp.shape[0]} rows wrong; first {first}")], hint)


def _index_set(cand: Tensor, exp: Tensor) -> Verdict:
    if not _is_integer(cand):
        return _verdict([(False, math.nan, 0.0, f"dtype: {cand.dtype} is not an integer type")])
    c_sorted, e_sorted = cand.long().sort(dim=-1).values, exp.long().sort(dim=-1).values
    differ = (c_sorted != e_sorted).any(dim=-1)
    n = int(differ.sum())
    if n == 0:
        return _verdict([(True, 0.0, 0.0, f"{exp.shape[0]} rows equal as multisets")])
    row = _first(differ)
    hint = ""
    got_counts, want_counts = Counter(c_sorted[row].tolist()), Counter(e_sorted[row].tolist())
    if any(v >= 0 and n > 1 and got_counts[v] < n for v, n in want_counts.items()):
        hint = "a repeated index appears fewer times than listed: are repeats de-duplicated?"
    return _verdict([(False, float(n), 0.0, (
        f"rows as multisets: {n} of {exp.shape[0]} rows differ; first row {_pos(row)}: sorted "
        f"{c_sorted[row].tolist()[:8]}… vs {e_sorted[row].tolist()[:8]}…"))], hint)


def check_tensor(spec: Mapping, cand: Tensor, exp: Tensor, ref: Callable[[str], Tensor]) -> Verdict:
    """Check ``cand`` against the expected ``exp`` with the metric ``spec`` names.

    ``ref(name)`` returns the auxiliary tensor a spec reference names (``spec["mask"]`` …).
    Shapes must be equal; both tensors on the CPU. An unknown metric is a ValueError.
    """
    metric = spec["metric"]
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; one of {', '.join(METRICS)}")
    if tuple(cand.shape) != tuple(exp.shape):
        return _verdict([(False, math.nan, math.nan,
                          f"shape: {tuple(cand.shape)}, expected {tuple(exp.shape)}")])
    if metric == "bitwise":
        return _bitwise(cand, exp, dict(spec))
    if metric == "calc_diff":
        return _calc_diff(cand, exp, dict(spec), ref(spec["mask"]))
    if metric == "allclose":
        return _allclose(cand, exp, dict(spec))
    if metric == "topk_set":
        return _topk_set(cand, exp, dict(spec), ref(spec["scores"]), ref(spec["row_starts"]),
                         ref(spec["row_ends"]))
    if metric == "topk_margin":
        return _topk_margin(cand, exp, dict(spec), ref(spec["scores"]), ref(spec["row_starts"]),
                            ref(spec["row_ends"]))
    return _index_set(cand, exp)
