"""Check a kernel against the oracle, case by case, with each contract's own metric."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.testing.cases import Case, edge_case_names, make_case
from glm_dsa.testing.metrics import Verdict, check_tensor

__all__ = ["Worst", "CheckReport", "check_case", "check_kernel", "run_checks"]


@dataclass
class Worst:
    """The worst verdict one output got over the cases run (largest metric value)."""

    metric: str
    value: float
    bound: float
    case: str
    passed: bool = True
    detail: str = ""


@dataclass
class CheckReport:
    """Outcome of ``check_kernel``: cases run, and per output its worst metric value.

    failure: the first failure's message (None when every case passed); skipped: cases whose
    arguments conflict with the pinned ``kernel_options`` (the oracle rejects them).
    """

    contract: str
    cases_run: int = 0
    worst: dict[str, Worst] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def lines(self) -> list[str]:
        """One line per output: PASS/FAIL, the worst metric value and its bound."""
        out = []
        for name, w in self.worst.items():
            bound = "" if math.isnan(w.bound) else f" (bound {w.bound:g})"
            value = "n/a" if math.isnan(w.value) else f"{w.value:.3g}"
            out.append(f"{'PASS' if w.passed else 'FAIL'}  {self.contract}.{name}  {w.metric}: "
                       f"worst {value}{bound} over {self.cases_run} cases, at case {w.case}")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())


class _MetricFailure(AssertionError):
    """A failed metric, with the output and verdict for the report."""

    def __init__(self, message: str, output: str, verdict: Verdict):
        super().__init__(message)
        self.output, self.verdict = output, verdict


def _to(x, device):
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(_to(v, device) for v in x)
    if isinstance(x, dict):
        return {k: _to(v, device) for k, v in x.items()}
    return x


def _reference(case: Case) -> tuple[Tensor, ...]:
    fn = getattr(oracle, case.contract)
    args = case.args
    if case.contract == "hadamard_transform":
        args = (args[0].float(),) + args[1:]  # the float32 truth a bf16 output is rounded from
    out = fn(*args, **case.kwargs)
    return out if isinstance(out, tuple) else (out,)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_case(case: Case, fn: Callable, *, device: str | torch.device = "cpu") -> dict[str, Verdict]:
    """Run ``fn`` and the oracle on one case; the verdict per output.

    The kernel's inputs are moved to ``device`` and its outputs back to the CPU; the oracle runs
    on the CPU. Raises AssertionError (one line: contract, case, what went wrong, how to rebuild
    the case) when the kernel raises, returns the wrong number, shape or dtype of outputs, or
    fails a metric.
    """
    where = f"{case.contract} [case {case.name}]"
    again = f" — rebuild with {case.repro}" if case.repro else ""
    expected = _reference(case)
    try:
        got = fn(*_to(case.args, device), **_to(case.kwargs, device))
    except Exception as e:  # a kernel's own failure is a verdict, not a crash of the harness
        raise AssertionError(f"{where}: the kernel raised {_one_line(e)}{again}") from None
    got = got if isinstance(got, (tuple, list)) else (got,)
    names = list(case.checks)
    if len(got) != len(names) or not all(isinstance(t, Tensor) for t in got):
        kinds = ", ".join(type(t).__name__ for t in got)
        raise AssertionError(
            f"{where}: the kernel returned ({kinds}); the contract returns {len(names)} "
            f"tensor(s) ({', '.join(names)}){again}")
    verdicts = {}
    for name, cand, exp in zip(names, got, expected):
        cand = cand.detach().cpu()
        if tuple(cand.shape) != tuple(exp.shape):
            raise AssertionError(
                f"{where}: output {name!r} has shape {tuple(cand.shape)}, expected "
                f"{tuple(exp.shape)}{again}")
        allowed = case.dtypes[name]
        if cand.dtype not in allowed:
            raise AssertionError(
                f"{where}: output {name!r} has dtype {cand.dtype}; the contract allows "
                f"{', '.join(str(d) for d in allowed)}{again}")
        spec = case.checks[name]
        v = check_tensor(spec, cand, exp, case.aux.__getitem__)
        verdicts[name] = v
        if not v.passed:
            raise _MetricFailure(
                f"{where}: output {name!r} fails {spec['metric']}: value {v.value:.4g}, bound "
                f"{v.bound:g}; {v.detail}{again}", name, v)
    return verdicts


def run_checks(contract: str, fn: Callable, *, cases: int = 50, seed: int = 0,
               device: str | torch.device = "cpu", shapes: str = "small",
               **kernel_options) -> CheckReport:
    """``check_kernel`` that returns the report with ``failure`` set instead of raising."""
    if not isinstance(cases, int) or isinstance(cases, bool) or cases < 0:
        raise ValueError(f"cases={cases!r} must be a non-negative int")
    edges = edge_case_names(contract)
    whichs: list[str | int] = list(edges) + list(range(max(cases - len(edges), 0)))
    report = CheckReport(contract)
    for which in whichs:
        case = make_case(contract, which, seed=seed, shapes=shapes, **kernel_options)
        try:
            verdicts = check_case(case, fn, device=device)
        except ValueError:
            if not kernel_options:
                raise
            report.skipped.append(case.name)  # a pinned option the case cannot take
            continue
        except AssertionError as e:
            report.failure = str(e)
            report.cases_run += 1
            if isinstance(e, _MetricFailure):
                name, value, bound = e.output, e.verdict.value, e.verdict.bound
            else:  # the kernel raised or returned the wrong shape: no metric value
                name, value, bound = next(iter(case.checks)), math.nan, math.nan
            report.worst[name] = Worst(case.checks[name]["metric"], value, bound, case.name,
                                       False, str(e))
            return report
        report.cases_run += 1
        for name, v in verdicts.items():
            magnitude = abs(v.value)
            w = report.worst.get(name)
            if w is None or magnitude > w.value:
                report.worst[name] = Worst(case.checks[name]["metric"], magnitude, v.bound,
                                           case.name)
    return report


def check_kernel(contract: str, fn: Callable, *, cases: int = 50, seed: int = 0,
                 device: str | torch.device = "cpu", shapes: str = "small",
                 **kernel_options) -> CheckReport:
    """Check ``fn`` against ``glm_dsa.oracle.<contract>`` on generated cases.

    ``fn`` takes the oracle function's arguments (the upstream kernel's own): required ones
    positionally, the optional ones a case sets by keyword. Every named edge case of the
    contract runs (``edge_case_names``), then random cases up to ``cases`` in all, drawn from
    ``seed`` over the size table ``shapes`` (``"small"``, or ``"glm-5.3"`` for GPU runs). Inputs
    are built on the CPU and moved to ``device``; outputs come back to the CPU and are compared
    with the contract's metric (``glm_dsa.testing.metrics``): ``calc_diff`` and exact ``-inf``
    masks for logits, top-k as sets (ties interchangeable), FlashMLA's ``check_is_allclose``
    tolerances for sparse attention, bitwise for quantizers and cache bytes.

    Sparse-attention inputs have std 0.1 (``randn / 10``), as FlashMLA's own tests; small shapes
    use FlashMLA's ``sm_scale = 0.5``, ``"glm-5.3"`` the models' softmax scales.

    ``kernel_options`` are passed to both in every case (pin a convention the kernel implements:
    ``scale_fmt="ue8m0"``, ``clean_logits=False``, ``lse_base="2", lonely_lse="-inf"`` for the
    Sep-2025 FlashMLA, ``base="absolute", pad=0`` for TileLang's top-k); a convention the
    upstream kernel does not take as an argument reaches ``fn`` only when pinned. Cases that
    cannot take a pinned option are skipped.

    Raises AssertionError at the first failing case, naming the contract, the case, the output,
    the metric, its value and bound, the first differing element, and the ``make_case`` call that
    rebuilds the case. Returns the report (cases run, worst metric per output) otherwise.
    """
    report = run_checks(contract, fn, cases=cases, seed=seed, device=device, shapes=shapes,
                        **kernel_options)
    if report.failure is not None:
        raise AssertionError(report.failure)
    return report

