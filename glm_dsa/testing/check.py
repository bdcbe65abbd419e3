"""Check a kernel against the oracle, case by case, with each contract's own metric.

The kernel runs in a worker thread with a per-call timeout (``DEFAULT_TIMEOUT_S``, generous so
that a first call under Triton's interpreter or autotuner fits): a kernel that hangs, raises,
calls ``sys.exit`` or changes one of its inputs in place fails the case with that reason (no
contract lets a kernel write its inputs). ``timeout=None`` calls it on the calling thread, for
debuggers. A kernel that kills the process (``os._exit``, a segfault) cannot be reported from
inside it.
"""

from __future__ import annotations

import inspect
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.testing.cases import Case, edge_case_names, make_case
from glm_dsa.testing.metrics import Verdict, check_tensor

__all__ = ["DEFAULT_TIMEOUT_S", "Worst", "CheckReport", "check_case", "check_kernel", "run_checks",
           "expected_outputs", "kernel_outputs", "verdicts_of"]

DEFAULT_TIMEOUT_S = 600.0


@dataclass
class Worst:
    """The worst verdict one output got over the cases run (largest metric value); on a failure,
    the failing case's verdict (``detail``: its failing criterion)."""

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
        """One line per output: PASS with the worst metric value and its bound, or FAIL with the
        failing criterion and its numbers."""
        out = []
        for name, w in self.worst.items():
            if not w.passed:
                out.append(f"FAIL  {self.contract}.{name}  {w.metric}: {w.detail} at case {w.case}")
                continue
            bound = "" if math.isnan(w.bound) else f" (bound {w.bound:g})"
            value = "n/a" if math.isnan(w.value) else f"{w.value:.3g}"
            out.append(f"PASS  {self.contract}.{name}  {w.metric}: worst {value}{bound} over "
                       f"{self.cases_run} cases, at case {w.case}")
        return out

    def to_json(self) -> dict:
        """The report as JSON-ready data (``glm-dsa check --json``)."""
        return {"contract": self.contract, "passed": self.passed, "cases_run": self.cases_run,
                "skipped": list(self.skipped), "failure": self.failure,
                "outputs": {n: {"metric": w.metric, "passed": w.passed,
                                "value": None if math.isnan(w.value) else w.value,
                                "bound": None if math.isnan(w.bound) else w.bound,
                                "case": w.case, "detail": w.detail} for n, w in self.worst.items()}}

    def __str__(self) -> str:
        return "\n".join(self.lines())


class _KernelFailure(AssertionError):
    """The kernel could not be judged by a metric (it raised, hung, exited, wrote an input, or
    returned the wrong outputs); ``reason`` is one line."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


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


def expected_outputs(case: Case) -> tuple[Tensor, ...]:
    """The oracle's outputs on ``case`` (CPU), in the order of ``case.checks``."""
    fn = getattr(oracle, case.contract)
    args = case.args
    if case.contract == "hadamard_transform":
        args = (args[0].float(),) + args[1:]  # the float32 truth a bf16 output is rounded from
    out = fn(*args, **case.kwargs)
    return out if isinstance(out, tuple) else (out,)


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


def _tensors(x, path: str = "") -> list[tuple[str, Tensor]]:
    if isinstance(x, Tensor):
        return [(path, x)]
    if isinstance(x, (tuple, list)):
        return [t for i, v in enumerate(x) for t in _tensors(v, f"{path}[{i}]")]
    if isinstance(x, dict):
        return [t for k, v in x.items() for t in _tensors(v, k)]
    return []


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def _kernel_kwargs(fn: Callable, case: Case) -> dict:
    """The case's keyword arguments the kernel takes: a pinned convention the kernel has no
    parameter for is its built-in convention and is not passed (the oracle still gets it); any
    other keyword it cannot take is a failure."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass everything
        return dict(case.kwargs)
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return dict(case.kwargs)
    kwargs = {}
    for name, value in case.kwargs.items():
        if name in params:
            kwargs[name] = value
        elif name not in case.pinned:
            raise ValueError(name)
    return kwargs


def _call(fn: Callable, args: tuple, kwargs: dict, timeout: float | None, device) -> Any:
    """``fn(*args, **kwargs)`` within ``timeout`` seconds; raises _KernelFailure's reason text as
    RuntimeError for a hang, an exit or an exception."""
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def target() -> None:
        try:
            with torch.set_grad_enabled(grad):
                dev = torch.device(device)
                if dev.type == "cuda":
                    with torch.cuda.device(dev):
                        box["out"] = fn(*args, **kwargs)
                else:
                    box["out"] = fn(*args, **kwargs)
        except SystemExit as e:
            box["error"] = f"the kernel called sys.exit({e.code!r})"
        except BaseException as e:  # noqa: BLE001 — any way out of the kernel is its verdict
            box["error"] = f"the kernel raised {_one_line(e)}"

    if timeout is None:
        target()
    else:
        worker = threading.Thread(target=target, name="glm-dsa-kernel", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            box["error"] = (f"the kernel did not return within {timeout:g} s (a hang, or a slow "
                            f"first call: raise the limit with --timeout / timeout=)")
    if "error" in box:
        raise RuntimeError(box["error"])
    return box["out"]


def kernel_outputs(case: Case, fn: Callable, *, device: str | torch.device = "cpu",
                   timeout: float | None = DEFAULT_TIMEOUT_S) -> tuple[Tensor, ...]:
    """Run ``fn`` on ``case`` (inputs moved to ``device``) and return its outputs on the CPU.

    Raises AssertionError (one line: contract, case, the reason, the ``make_case`` call) when
    the kernel raises, calls ``sys.exit``, runs past ``timeout`` seconds, changes an input in
    place, takes no keyword the case sets, or returns other than the contract's tensors.
    """
    where = f"{case.contract} [case {case.name}]"
    again = f" — rebuild with {case.repro}" if case.repro else ""

    def fail(reason: str) -> _KernelFailure:
        return _KernelFailure(f"{where}: {reason}{again}", reason)

    args, all_kwargs = _to(case.args, device), _to(case.kwargs, device)
    try:
        names = _kernel_kwargs(fn, case)
    except ValueError as e:
        raise fail(f"the kernel takes no argument {e.args[0]!r}, which this case sets") from None
    kwargs = {k: all_kwargs[k] for k in names}
    params = list(inspect.signature(getattr(oracle, case.contract)).parameters)
    inputs = [t for p, a in zip(params, args) for t in _tensors(a, p)] + _tensors(kwargs)
    watch = torch.device(device).type != "meta"  # meta tensors hold no bytes to compare
    before = [t.clone() for _, t in inputs] if watch else []
    try:
        got = _call(fn, args, kwargs, timeout, device)
    except RuntimeError as e:
        raise fail(str(e)) from None
    if watch:
        for (name, t), old in zip(inputs, before):
            if not _same_bytes(t, old):
                raise fail(f"the kernel changed its input {name!r} in place (no contract allows it)")
    got = got if isinstance(got, (tuple, list)) else (got,)
    outs = list(case.checks)
    if len(got) != len(outs) or not all(isinstance(t, Tensor) for t in got):
        kinds = ", ".join(type(t).__name__ for t in got)
        raise fail(f"the kernel returned ({kinds}); the contract returns {len(outs)} tensor(s) "
                   f"({', '.join(outs)})")
    return tuple(t.detach().cpu() for t in got)


def verdicts_of(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> dict[str, Verdict]:
    """The verdict per output name of ``got`` (CPU tensors): shape, dtype, then the metric."""
    out = {}
    for name, cand in got.items():
        exp = expected[name]
        allowed = case.dtypes[name]
        if tuple(cand.shape) != tuple(exp.shape):
            line = f"shape: {tuple(cand.shape)}, expected {tuple(exp.shape)}"
            out[name] = Verdict(False, math.nan, math.nan, line, (f"FAIL {line}",))
        elif cand.dtype not in allowed:
            line = f"dtype: {cand.dtype}; the contract allows {', '.join(str(d) for d in allowed)}"
            out[name] = Verdict(False, math.nan, math.nan, line, (f"FAIL {line}",))
        else:
            out[name] = check_tensor(case.checks[name], cand, exp, case.aux.__getitem__)
    return out


def check_case(case: Case, fn: Callable, *, device: str | torch.device = "cpu",
               timeout: float | None = DEFAULT_TIMEOUT_S) -> dict[str, Verdict]:
    """Run ``fn`` and the oracle on one case; the verdict per output.

    The kernel's inputs are moved to ``device`` and its outputs back to the CPU; the oracle runs
    on the CPU. Raises AssertionError when the kernel cannot be judged (``kernel_outputs``:
    one line) or fails a metric: the first line names contract, case, output and the failing
    criterion with its numbers; then one line per criterion, a hint where the pattern is
    recognisable, and the ``make_case`` call that rebuilds the case.
    """
    expected = expected_outputs(case)
    got = kernel_outputs(case, fn, device=device, timeout=timeout)
    names = list(case.checks)
    again = f" — rebuild with {case.repro}" if case.repro else ""
    for name, cand, exp in zip(names, got, expected):
        reason = None
        if tuple(cand.shape) != tuple(exp.shape):
            reason = f"output {name!r} has shape {tuple(cand.shape)}, expected {tuple(exp.shape)}"
        elif cand.dtype not in case.dtypes[name]:
            reason = (f"output {name!r} has dtype {cand.dtype}; the contract allows "
                      f"{', '.join(str(d) for d in case.dtypes[name])}")
        if reason is not None:
            raise _KernelFailure(f"{case.contract} [case {case.name}]: {reason}{again}", reason)
    verdicts = verdicts_of(case, dict(zip(names, got)), dict(zip(names, expected)))
    for name, v in verdicts.items():
        if not v.passed:
            first, *rest = v.text().splitlines()
            rebuild = [f"  rebuild with {case.repro}"] if case.repro else []
            message = "\n".join([f"{case.contract} [case {case.name}]: output {name!r} fails "
                                 f"{case.checks[name]['metric']} on {first}", *rest, *rebuild])
            raise _MetricFailure(message, name, v)
    return verdicts


def run_checks(contract: str, fn: Callable, *, cases: int = 50, seed: int = 0,
               device: str | torch.device = "cpu", shapes: str = "small",
               timeout: float | None = DEFAULT_TIMEOUT_S, **kernel_options) -> CheckReport:
    """``check_kernel`` that returns the report with ``failure`` set instead of raising."""
    if not isinstance(cases, int) or isinstance(cases, bool) or cases < 0:
        raise ValueError(f"cases={cases!r} must be a non-negative int")
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None")
    edges = edge_case_names(contract)
    whichs: list[str | int] = list(edges) + list(range(max(cases - len(edges), 0)))
    report = CheckReport(contract)
    for which in whichs:
        case = make_case(contract, which, seed=seed, shapes=shapes, **kernel_options)
        try:
            verdicts = check_case(case, fn, device=device, timeout=timeout)
        except ValueError:
            if not kernel_options:
                raise
            report.skipped.append(case.name)  # a pinned option the case cannot take
            continue
        except AssertionError as e:
            report.failure = str(e)
            report.cases_run += 1
            if isinstance(e, _MetricFailure):
                name, value, bound, detail = e.output, e.verdict.value, e.verdict.bound, e.verdict.detail
            else:  # the kernel could not be judged: no metric value
                name, value, bound = next(iter(case.checks)), math.nan, math.nan
                detail = getattr(e, "reason", str(e))
            report.worst[name] = Worst(case.checks[name]["metric"], value, bound, case.name,
                                       False, detail)
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
                 timeout: float | None = DEFAULT_TIMEOUT_S, **kernel_options) -> CheckReport:
    """Check ``fn`` against ``glm_dsa.oracle.<contract>`` on generated cases.

    ``fn`` takes the oracle function's arguments (the upstream kernel's own): required ones
    positionally, the optional ones a case sets by keyword. Every named edge case of the
    contract runs (``edge_case_names``; ``clauses`` says which contract clause each holds), then
    random cases up to ``cases`` in all, drawn from ``seed`` over the size table ``shapes``
    (``"small"``, or ``"glm-5.3"`` for GPU runs). Inputs are built on the CPU and moved to
    ``device``; outputs come back to the CPU and are compared with the contract's metric
    (``glm_dsa.testing.metrics``): ``calc_diff`` and exact ``-inf`` masks for logits, top-k as
    sets (ties interchangeable), FlashMLA's ``check_is_allclose`` tolerances for sparse
    attention, bitwise for quantizers and cache bytes.

    Each call runs with a ``timeout`` in seconds (None: no limit, on the calling thread); a
    kernel that hangs, raises, calls ``sys.exit`` or writes to an input fails the case.

    Sparse-attention inputs have std 0.1 (``randn / 10``), as FlashMLA's own tests; small shapes
    use FlashMLA's ``sm_scale = 0.5``, ``"glm-5.3"`` the models' softmax scales.

    ``kernel_options`` are passed to the oracle in every case (pin a convention the kernel
    implements: ``scale_fmt="ue8m0"``, ``clean_logits=False``, ``lse_base="2", lonely_lse="-inf"``
    for the Sep-2025 FlashMLA, ``base="absolute", pad=0`` for TileLang's top-k) and to the kernel
    when its signature has that parameter (or ``**kwargs``): a kernel without the keyword is taken
    to implement the pinned convention itself. Cases that cannot take a pinned option are skipped.

    Raises AssertionError at the first failing case: its first line names the contract, the
    case, the output and the failing criterion with its numbers; one line per criterion, a hint
    for recognisable patterns and the ``make_case`` call that rebuilds the case follow. Returns
    the report (cases run, worst metric per output) otherwise.
    """
    report = run_checks(contract, fn, cases=cases, seed=seed, device=device, shapes=shapes,
                        timeout=timeout, **kernel_options)
    if report.failure is not None:
        raise AssertionError(report.failure)
    return report
