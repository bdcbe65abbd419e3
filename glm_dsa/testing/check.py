"""Check a kernel against the oracle, case by case, with each contract's own metric.

The kernel is called through ``glm_dsa.testing.isolation``: a callable in a worker thread with
a per-call timeout (``DEFAULT_TIMEOUT_S``, generous so that a first call under Triton's
interpreter or autotuner fits), a kernel named ``"MODULE:FUNCTION"`` in a process of its own.
A kernel that hangs, raises, calls ``sys.exit`` or changes one of its inputs in place fails the
case with that reason (no contract lets a kernel write its inputs); a named one also when it
ends, forks or crashes its process. ``timeout=None`` calls a callable on the calling thread,
for debuggers.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.testing.cases import (
    NEWEST,
    Case,
    check_seed,
    convention_of,
    conventions,
    edge_case_names,
    expected_outputs,
    make_case,
)
from glm_dsa.testing.isolation import (
    DEFAULT_TIMEOUT_S,
    InputsChanged,
    call_kernel,
    kernel_session,
    tensor_leaves,
)
from glm_dsa.testing.metrics import Verdict, check_tensor
from glm_dsa.testing.mistakes import diagnose

__all__ = ["DEFAULT_TIMEOUT_S", "Worst", "CheckReport", "check_case", "check_kernel", "run_checks",
           "expected_outputs", "kernel_outputs", "verdicts_of", "failure_context",
           "resolve_convention", "takes_keywords"]


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
    arguments conflict with the pinned ``kernel_options`` (the oracle rejects them);
    convention: the name of the convention checked; edges_run: how many of ``cases_run`` were
    named edge cases; results: (case, passed, failure message) of each case run, in order.
    """

    contract: str
    cases_run: int = 0
    worst: dict[str, Worst] = field(default_factory=dict)
    convention: str = NEWEST
    edges_run: int = 0
    results: list[tuple[str, bool, str]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    failure: str | None = None

    @property
    def passed(self) -> bool:
        return self.failure is None

    def lines(self) -> list[str]:
        """One line per output: PASS with the worst metric value and its bound, or FAIL with the
        failing criterion and its numbers."""
        out = []
        # an output that passed did so over the cases that completed, not the one that failed
        completed = sum(ok for _, ok, _ in self.results)
        for name, w in self.worst.items():
            if not w.passed:
                out.append(f"FAIL  {self.contract}.{name}  {w.metric}: {w.detail} at case {w.case}")
                continue
            bound = "" if math.isnan(w.bound) else f" (bound {w.bound:g})"
            value = "n/a" if math.isnan(w.value) else f"{w.value:.3g}"
            out.append(f"PASS  {self.contract}.{name}  {w.metric}: worst {value}{bound} over "
                       f"{completed} cases, at case {w.case}")
        return out

    def summary(self) -> str:
        """What ran: cases (edge and random) and the convention."""
        return (f"{self.cases_run} cases ({self.edges_run} edge, {self.cases_run - self.edges_run} "
                f"random), convention {self.convention}")

    def to_json(self) -> dict:
        """The report as JSON-ready data (``glm-dsa check --json``)."""
        return {"contract": self.contract, "passed": self.passed, "cases_run": self.cases_run,
                "edge_cases_run": self.edges_run, "convention": self.convention,
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


def _kernel_kwargs(fn: Callable, case: Case) -> dict:
    """The keyword arguments the kernel gets: every one the case sets that the kernel takes,
    and the oracle's default of each optional argument the kernel declares without a default or
    with another default of the same kind (DeepGEMM's paged logits default to
    ``clean_logits=False``; the contract's call means ``True``). A pinned convention the kernel has no parameter for is its built-in
    convention and is not passed (the oracle still gets it); any other keyword it cannot take
    is a failure (ValueError naming it)."""
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
    n_args = len(case.args)
    oracle_params = list(inspect.signature(getattr(oracle, case.contract)).parameters.values())
    for p in oracle_params[n_args:]:
        mine = params.get(p.name)
        if p.name in kwargs or mine is None or mine.kind is inspect.Parameter.POSITIONAL_ONLY:
            continue
        if mine.default is inspect.Parameter.empty or _other_value_of_same_kind(mine.default, p.default):
            kwargs[p.name] = p.default
    return kwargs


def _other_value_of_same_kind(mine: Any, oracle_default: Any) -> bool:
    """A kernel default that means the same parameter with another value (a bool for a bool, a
    string for a string); a default of another kind is the kernel's own parameter, left alone."""
    if mine is None or oracle_default is None:
        return False
    return type(mine) is type(oracle_default) and mine != oracle_default


def takes_keywords(fn: Callable, names: tuple[str, ...] | list[str]) -> bool:
    """Whether ``fn`` accepts every keyword of ``names`` (by name, or through ``**kwargs``):
    such a kernel can be told a convention, so every convention's cases may run on it."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return True
    return bool(names) and all(n in params and params[n].kind is not inspect.Parameter.POSITIONAL_ONLY
                               for n in names)


def kernel_outputs(case: Case, fn: Callable | str, *, device: str | torch.device = "cpu",
                   timeout: float | None = DEFAULT_TIMEOUT_S) -> tuple[Tensor, ...]:
    """Run ``fn`` (a callable, or a ``"MODULE:FUNCTION"`` run in a process of its own) on
    ``case`` (inputs moved to ``device``) and return its outputs on the CPU.

    Raises AssertionError (one line: contract, case, the reason, the ``make_case`` call) when
    the kernel raises, calls ``sys.exit``, runs past ``timeout`` seconds, changes an input in
    place, takes no keyword the case sets, returns other than the contract's tensors, or (run
    in its own process) ends, forks or crashes that process.
    """
    where = f"{case.contract} [case {case.name}]"
    again = f" — rebuild with {case.repro}" if case.repro else ""

    def fail(reason: str) -> _KernelFailure:
        return _KernelFailure(f"{where}: {reason}{again}", reason)

    with kernel_session(fn, timeout) as kernel:
        try:
            names = _kernel_kwargs(kernel, case)
        except ValueError as e:
            raise fail(f"the kernel takes no argument {e.args[0]!r}, which this case sets") from None
        kwargs = {k: case.kwargs.get(k, v) for k, v in names.items()}
        params = list(inspect.signature(getattr(oracle, case.contract)).parameters)
        inputs = [n for i, a in enumerate(case.args)
                  for n, _ in tensor_leaves(a, params[i] if i < len(params) else f"[{i}]")]
        inputs += [n for n, _ in tensor_leaves(kwargs)]
        try:
            got = call_kernel(kernel, case.args, kwargs, timeout, device)
        except InputsChanged as e:
            raise fail(f"the kernel changed its input {inputs[e.leaves[0]]!r} in place (no contract "
                       f"allows it)") from None
        except RuntimeError as e:
            raise fail(str(e)) from None
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


def check_case(case: Case, fn: Callable | str, *, device: str | torch.device = "cpu",
               timeout: float | None = DEFAULT_TIMEOUT_S) -> dict[str, Verdict]:
    """Run ``fn`` and the oracle on one case; the verdict per output.

    The kernel's inputs are moved to ``device`` and its outputs back to the CPU; the oracle runs
    on the CPU. Raises AssertionError when the kernel cannot be judged (``kernel_outputs``:
    one line) or fails a metric: the first line names contract, case, output and the failing
    criterion with its numbers; then one line per criterion, a hint where the pattern is
    recognisable, and the ``make_case`` call that rebuilds the case.
    """
    __tracebackhide__ = True  # pytest: the failure is the kernel's, not this frame's
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
    got_by_name, expected_by_name = dict(zip(names, got)), dict(zip(names, expected))
    verdicts = verdicts_of(case, got_by_name, expected_by_name)
    for name, v in verdicts.items():
        if not v.passed:
            first, *rest = v.text().splitlines()
            rebuild = [f"  rebuild with {case.repro}"] if case.repro else []
            message = "\n".join([f"{case.contract} [case {case.name}]: output {name!r} fails "
                                 f"{case.checks[name]['metric']} on {first}",
                                 *failure_context(case, got_by_name, expected_by_name), *rest,
                                 *rebuild])
            raise _MetricFailure(message, name, v)
    return verdicts


def failure_context(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> list[str]:
    """The lines that lead a failure's explanation: each diagnosed cause (a classic mistake
    whose recomputed outputs the kernel's match, ``glm_dsa.testing.mistakes``), then the clause
    of the contract the edge case holds."""
    lines = [f"  cause: {c}" for c in diagnose(case, got, expected)]
    if case.clause:
        lines.append(f"  clause: {case.clause}")
    return lines


def resolve_convention(contract: str, convention: str | None, kernel_options: dict) -> tuple[dict, str]:
    """The options a check pins and the convention's name: ``convention``'s options (none for
    the newest), overridden by explicit ``kernel_options``; the name is that of the convention
    the result equals, else ``custom (k=v, …)``. ValueError for a convention the contract does
    not have, or an option its oracle does not take."""
    table = conventions(contract)
    if convention is not None and convention not in table:
        raise ValueError(f"{contract} has no convention {convention!r}; its conventions: "
                         f"{', '.join(table)}")
    params = inspect.signature(getattr(oracle, contract)).parameters
    for key in kernel_options:
        if key not in params:
            raise ValueError(f"{contract} takes no option {key!r}; its optional arguments: "
                             f"{', '.join(p for p in params if params[p].default is not inspect.Parameter.empty)}")
    options = {**table[convention or NEWEST], **kernel_options}
    name = convention_of(contract, options)
    if name is None:
        name = "custom (" + ", ".join(f"{k}={v!r}" for k, v in options.items()) + ")"
    return options, name


def run_checks(contract: str, fn: Callable | str, *, cases: int = 50, seed: int = 0,
               device: str | torch.device = "cpu", shapes: str = "small",
               timeout: float | None = DEFAULT_TIMEOUT_S, convention: str | None = None,
               **kernel_options) -> CheckReport:
    """``check_kernel`` that returns the report with ``failure`` set instead of raising."""
    if not isinstance(cases, int) or isinstance(cases, bool) or cases < 1:
        raise ValueError(f"cases={cases!r} must be an int >= 1 (every edge case of the contract "
                         f"runs whatever the number; cases counts them)")
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 < timeout < math.inf):
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, finite "
                         f"(None: no limit)")
    check_seed(seed)
    options, name = resolve_convention(contract, convention, kernel_options)
    edges = edge_case_names(contract)
    whichs: list[str | int] = list(edges) + list(range(max(cases - len(edges), 0)))
    report = CheckReport(contract, convention=name)
    refused = ""
    with kernel_session(fn, timeout) as kernel:  # a named kernel: one process for every case
        for which in whichs:
            try:
                case = make_case(contract, which, seed=seed, shapes=shapes, **options)
                verdicts = check_case(case, kernel, device=device, timeout=timeout)
            except ValueError as e:
                if not options:
                    raise
                # A pinned option the case cannot take, or an edge case the convention lacks.
                report.skipped.append(which if isinstance(which, str) else f"random #{which}")
                refused = refused or str(e)
                continue
            except AssertionError as e:
                report.failure = str(e)
                report.cases_run += 1
                report.edges_run += isinstance(which, str)
                report.results.append((case.name, False, str(e)))
                if isinstance(e, _MetricFailure):
                    out, value, bound, detail = e.output, e.verdict.value, e.verdict.bound, e.verdict.detail
                else:  # the kernel could not be judged: no metric value
                    out, value, bound = next(iter(case.checks)), math.nan, math.nan
                    detail = getattr(e, "reason", str(e))
                report.worst[out] = Worst(case.checks[out]["metric"], value, bound, case.name,
                                          False, detail)
                return report
            report.cases_run += 1
            report.edges_run += isinstance(which, str)
            report.results.append((case.name, True, ""))
            for out, v in verdicts.items():
                magnitude = abs(v.value)
                w = report.worst.get(out)
                if w is None or magnitude > w.value:
                    report.worst[out] = Worst(case.checks[out]["metric"], magnitude, v.bound,
                                              case.name)
    if report.cases_run == 0:
        report.failure = (f"{contract}: no case ran; the oracle refused every case under "
                          f"{name}: {refused}")
    return report


def check_kernel(contract: str, fn: Callable | str, *, cases: int = 50, seed: int = 0,
                 device: str | torch.device = "cpu", shapes: str = "small",
                 timeout: float | None = DEFAULT_TIMEOUT_S, convention: str | None = None,
                 **kernel_options) -> CheckReport:
    """Check ``fn`` against ``glm_dsa.oracle.<contract>`` on generated cases.

    ``fn`` takes the oracle function's arguments (the upstream kernel's own): required ones
    positionally, the optional ones a case sets by keyword. It is a callable, run in this
    process, or its name, ``"MODULE:FUNCTION"`` or ``"path/to/file.py:FUNCTION"``, imported and
    run in a process of its own (``glm_dsa.testing.isolation``; as ``glm-dsa check`` runs it). Every named edge case of the
    contract runs (``edge_case_names``; ``clauses`` says which contract clause each holds), then
    random cases up to ``cases`` in all, drawn from ``seed`` over the size table ``shapes``
    (``"small"``, or ``"glm-5.3"`` for GPU runs). Inputs are built on the CPU and moved to
    ``device``; outputs come back to the CPU and are compared with the contract's metric
    (``glm_dsa.testing.metrics``): ``calc_diff`` and exact ``-inf`` masks for logits, top-k as
    sets (ties interchangeable), FlashMLA's ``check_is_allclose`` tolerances for sparse
    attention, bitwise for quantizers and cache bytes.

    Each call runs with a ``timeout`` in seconds (None: no limit; a callable then runs on the
    calling thread); a kernel that hangs, raises, calls ``sys.exit`` or writes to an input fails
    the case. A named kernel also fails it, with the reason, when it ends its process
    (``os._exit``), forks it, crashes it (a segfault, ``abort``, SIGKILL), holds the GIL past
    the timeout, or its module hangs or exits at import; in this process any of those takes
    the caller down (a script giving a name guards its top level with ``if __name__ ==
    "__main__":``, as multiprocessing requires).

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
    __tracebackhide__ = True  # pytest: show the caller's line, then the kernel's failure
    report = run_checks(contract, fn, cases=cases, seed=seed, device=device, shapes=shapes,
                        timeout=timeout, convention=convention, **kernel_options)
    if report.failure is not None:
        raise AssertionError(report.failure)
    return report
