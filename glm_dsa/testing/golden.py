"""Golden vectors: the cases of ``glm_dsa.testing`` on disk, and the comparison of a kernel's
outputs with them.

``write_golden(dir, seed)`` (``glm-dsa golden``) writes, per contract of ``glm_dsa.oracle``, every
named edge case of the case table (``glm_dsa.testing.cases``) and ``RANDOM_CASES`` seeded random
ones, and the edge cases again under each documented convention (``CONVENTIONS``), at
GLM-5.3 / DeepSeek-V3.2 head counts (``SHAPES["golden"]``), in one safetensors file per
contract, and a ``manifest.json``. These are the inputs ``check_kernel(contract, fn,
seed=seed, shapes="golden")`` runs. Every tensor is named
``<contract>.<case>.<name>``: the oracle's parameter names for inputs (``q``, ``kv_cache``,
``indices`` …; ``kv[0]``, ``kv[1]`` for the elements of a tuple argument), the output names for
expected outputs (``logits``, ``out``, ``lse`` …) and the check's own names for the tensors a
metric reads (``mask``, ``scores``, ``row_starts``, ``row_ends``).

Each manifest case gives its call as data (``args``: a list, ``kwargs``: a dict, each value
``{"tensor": NAME}``, ``{"tuple": [...]}`` or ``{"value": JSON}``), its clause, and per output
the metric and tolerances. ``compare`` checks outputs with the metric of the case table (the
same definitions as ``check_kernel``, ``glm_dsa.testing.metrics``), refuses a manifest whose
recorded metric differs from it, and verifies the manifest's own sha256 (``manifest_sha256``)
and each data file's: a hand-loosened tolerance is refused, not obeyed.

Files are deterministic: CPU generators seeded from ``seed`` and the case name, sorted manifest
keys, one fixed metadata entry per file; regenerating with the same seed, torch version and CPU
gives identical bytes.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.outputs import replace_dir
from glm_dsa.testing.cases import (
    CONTRACTS,
    check_seed,
    CONVENTIONS,
    NEWEST,
    Case,
    convention_of,
    conventions,
    edge_case_names,
    make_case,
)
from glm_dsa.testing.check import (
    DEFAULT_TIMEOUT_S,
    expected_outputs,
    failure_context,
    kernel_outputs,
    takes_keywords,
    verdicts_of,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "RANDOM_CASES",
    "GOLDEN_SHAPES",
    "golden_cases",
    "write_golden",
    "load_golden",
    "load_cases",
    "TensorCheck",
    "CompareReport",
    "compare",
    "check_outputs",
    "compare_kernel",
    "format_report",
]

# /2: the cases are glm_dsa.testing's table (edge cases + random cases at GLM-5.3 shapes, one
# case table for golden and check_kernel), the call is data, and the manifest carries its own
# sha256. /1 had its own hand-written cases.
FORMAT = "glm-dsa-golden/2"
MANIFEST = "manifest.json"
RANDOM_CASES = 1  # per contract, beside the named edge cases
GOLDEN_SHAPES = "golden"


def _key(case_name: str, convention: str) -> str:
    """The case's name inside tensor names: ``random #0`` → ``random_0``, convention first."""
    name = case_name.replace(" #", "_")
    return f"{convention}_{name}" if convention else name


def golden_cases(seed: int = 0) -> list[tuple[str, str, Case]]:
    """(key, convention, case) of every golden case: the edge cases and ``RANDOM_CASES`` random
    cases of each contract, and its edge cases again under each convention of ``CONVENTIONS``
    (the default convention is ``""``); a case the pinned convention does not apply to (the
    oracle refuses it) is left out."""
    check_seed(seed)
    out = []
    for contract in CONTRACTS:
        conventions: dict[str, dict] = {"": {}, **CONVENTIONS.get(contract, {})}
        for convention, options in conventions.items():
            whichs: list[str | int] = list(edge_case_names(contract))
            whichs += [] if convention else list(range(RANDOM_CASES))
            for which in whichs:
                try:
                    case = make_case(contract, which, seed=seed, shapes=GOLDEN_SHAPES, **options)
                    if options:
                        expected_outputs(case)
                except ValueError:
                    if not options:
                        raise
                    continue  # the edge case does not exist under this convention
                out.append((_key(case.name, convention), convention, case))
    return out


# ----------------------------------------------------------------------------- encoding
def _param_names(contract: str) -> list[str]:
    return list(inspect.signature(getattr(oracle, contract)).parameters)


def _encode(value: Any, name: str, prefix: str, tensors: dict[str, Tensor]) -> dict:
    if isinstance(value, Tensor):
        tensors[prefix + name] = value.contiguous()
        return {"tensor": prefix + name}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v, f"{name}[{i}]", prefix, tensors) for i, v in enumerate(value)]}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"value": value}
    raise TypeError(f"argument {name!r} of type {type(value).__name__} has no golden encoding")


def _decode(spec: dict, tensors: Mapping[str, Tensor]) -> Any:
    if "tensor" in spec:
        return tensors[spec["tensor"]]
    if "tuple" in spec:
        return tuple(_decode(s, tensors) for s in spec["tuple"])
    return spec["value"]


def _written(spec: dict, prefix: str) -> str:
    if "tensor" in spec:
        return spec["tensor"].removeprefix(prefix)
    if "tuple" in spec:
        return "(" + ", ".join(_written(s, prefix) for s in spec["tuple"]) + ")"
    return repr(spec["value"])


def _resolve(spec: dict, prefix: str) -> dict:
    """The metric spec with its tensor references made full names."""
    return {k: prefix + v if k in ("mask", "scores", "row_starts", "row_ends") else v
            for k, v in spec.items()}


def _describe(t: Tensor) -> dict:
    return {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _manifest_digest(manifest: dict) -> str:
    body = {k: v for k, v in manifest.items() if k != "manifest_sha256"}
    return hashlib.sha256(json.dumps(body, indent=1, sort_keys=True).encode()).hexdigest()


# ----------------------------------------------------------------------------- files
def write_golden(out_dir: str | os.PathLike, seed: int = 0) -> dict:
    """Write ``<contract>.safetensors`` per contract and ``manifest.json`` as the directory
    ``out_dir``, written beside it and swapped in whole (``glm_dsa.outputs.replace_dir``): an
    interrupted write leaves an existing golden directory as it was.

    Returns the manifest (also written). An existing ``out_dir`` holding files this function
    does not write, or any directory (even one named as a file of ours), is refused (ValueError)
    before any case is computed.
    """
    check_seed(seed)
    out_dir = os.fspath(out_dir)
    if os.path.isdir(out_dir):
        ours = {MANIFEST, *(f"{c}.safetensors" for c in CONTRACTS)}
        # a directory, even under one of our file names, holds the user's files: swapped out, it is deleted
        dirs = {name for name in os.listdir(out_dir) if _is_real_dir(os.path.join(out_dir, name))}
        strangers = sorted(name + ("/" if name in dirs else "") for name in os.listdir(out_dir)
                           if name not in ours or name in dirs)
        if strangers:
            raise ValueError(f"{out_dir} holds {', '.join(strangers[:5])}"
                             f"{' …' if len(strangers) > 5 else ''}, which glm-dsa golden does not "
                             f"write; the directory is replaced whole: move those out or choose "
                             f"another directory")
    return replace_dir(out_dir, lambda tmp: _write_golden_into(tmp, seed))


def _is_real_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.path.islink(path)


def _write_golden_into(out_dir: str, seed: int) -> dict:
    cases = golden_cases(seed)
    by_contract: dict[str, list[tuple[str, str, Case]]] = {}
    for entry in cases:
        by_contract.setdefault(entry[2].contract, []).append(entry)

    files, entries = {}, []
    for contract, group in by_contract.items():
        tensors: dict[str, Tensor] = {}
        names = _param_names(contract)
        for key, convention, case in group:
            prefix = f"{contract}.{key}."
            args = [_encode(v, n, prefix, tensors) for v, n in zip(case.args, names)]
            kwargs = {n: _encode(v, n, prefix, tensors) for n, v in case.kwargs.items()}
            outputs = {}
            for (name, spec), t in zip(case.checks.items(), expected_outputs(case)):
                tensors[prefix + name] = t.contiguous()
                outputs[prefix + name] = {**_describe(t), **_resolve(spec, prefix)}
            for name, t in case.aux.items():  # a copy: an aux tensor may be an input too
                tensors[prefix + name] = t.contiguous().clone()
            written = ", ".join([_written(a, prefix) for a in args]
                                + [f"{n}={_written(v, prefix)}" for n, v in kwargs.items()])
            entries.append({
                "contract": contract, "case": key, "convention": convention or None,
                "file": f"{contract}.safetensors", "clause": case.clause,
                "call": f"{contract}({written})", "args": args, "kwargs": kwargs,
                "inputs": {n: _describe(tensors[n]) for n in _tensor_names(args, kwargs)},
                "outputs": outputs,
                "aux": {prefix + n: _describe(t) for n, t in case.aux.items()},
                "pinned": list(case.pinned), "repro": case.repro,
            })
        path = os.path.join(out_dir, f"{contract}.safetensors")
        # A single metadata entry: safetensors does not order several deterministically.
        save_file(tensors, path, metadata={"glm_dsa_golden": f"{FORMAT} {contract} seed={seed}"})
        files[f"{contract}.safetensors"] = {
            "sha256": _sha256(path), "bytes": os.path.getsize(path), "contract": contract
        }
    manifest = {"format": FORMAT, "seed": seed, "shapes": GOLDEN_SHAPES, "torch": torch.__version__,
                "files": files, "cases": entries}
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    with open(os.path.join(out_dir, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.write("\n")
    return manifest


def _tensor_names(args: list, kwargs: dict) -> list[str]:
    def walk(spec):
        if "tensor" in spec:
            yield spec["tensor"]
        for s in spec.get("tuple", ()):
            yield from walk(s)

    return [n for spec in (*args, *kwargs.values()) for n in walk(spec)]


def load_golden(golden_dir: str | os.PathLike) -> tuple[dict, dict[str, Tensor]]:
    """Read ``manifest.json`` and every golden tensor, checking the manifest's own sha256 and
    each file's."""
    golden_dir = os.fspath(golden_dir)
    path = os.path.join(golden_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found; write golden vectors with: glm-dsa golden --out {golden_dir}")
    with open(path) as f:
        try:
            manifest = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not JSON ({e}); regenerate with: glm-dsa golden --out {golden_dir}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        got = manifest.get("format") if isinstance(manifest, dict) else None
        raise ValueError(f"{path} has format {got!r}, expected {FORMAT!r}; regenerate with: "
                         f"glm-dsa golden --out {golden_dir}")
    again = f"regenerate with: glm-dsa golden --out {golden_dir} --seed {manifest.get('seed', 0)}"
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise ValueError(f"{path} was edited after it was written (its manifest_sha256 does not "
                         f"match its content); {again}")
    tensors: dict[str, Tensor] = {}
    for name in manifest["files"]:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"{path}: its files entry {name!r} is not a file name in {golden_dir} "
                             f"(the golden writer names <contract>.safetensors beside the "
                             f"manifest); {again}")
    for name, info in sorted(manifest["files"].items()):
        file_path = os.path.join(golden_dir, name)
        if not os.path.isfile(file_path) or _sha256(file_path) != info["sha256"]:
            raise ValueError(f"{file_path} is missing or differs from the manifest's sha256; {again}")
        tensors.update(load_file(file_path))
    return manifest, tensors


def load_cases(manifest: dict, golden: Mapping[str, Tensor]) -> list[tuple[Case, dict[str, Tensor]]]:
    """Each manifest case as a ``Case`` (tensors from ``golden``, metrics from the case table)
    with its expected outputs by full name. A manifest whose recorded metric or tolerance differs
    from the case table's is a ValueError."""
    out = []
    for entry in manifest["cases"]:
        contract, prefix = entry["contract"], f"{entry['contract']}.{entry['case']}."
        if contract not in CONTRACTS:
            raise ValueError(f"{MANIFEST} names contract {contract!r}, which glm-dsa does not know; "
                             f"regenerate it with this glm-dsa's golden command")
        args = tuple(_decode(a, golden) for a in entry["args"])
        kwargs = {n: _decode(v, golden) for n, v in entry["kwargs"].items()}
        spec = CONTRACTS[contract]
        checks = spec.checks(kwargs)
        aux = {n.removeprefix(prefix): golden[n] for n in entry["aux"]}
        for name, check in checks.items():
            recorded = {k: v for k, v in entry["outputs"][prefix + name].items()
                        if k not in ("shape", "dtype")}
            if recorded != _resolve(check, prefix):
                raise ValueError(
                    f"{MANIFEST}: the metric of {prefix + name} ({recorded}) differs from "
                    f"glm-dsa's case table ({check}); regenerate with: glm-dsa golden --out DIR")
        case = Case(contract, entry["case"], args, kwargs, checks, spec.dtypes, aux,
                    entry.get("repro", ""), entry.get("clause", ""), tuple(entry.get("pinned", ())))
        out.append((case, {prefix + n: golden[prefix + n] for n in checks}))
    return out


# ----------------------------------------------------------------------------- compare
@dataclass(frozen=True)
class TensorCheck:
    """The verdict on one candidate tensor.

    Attributes:
        name: the golden output name (``<contract>.<case>.<output>``).
        metric: ``bitwise``, ``calc_diff``, ``allclose``, ``topk_set`` or ``index_set``.
        passed: the verdict.
        value: the metric's value: differing elements (bitwise), calc_diff, cos_diff
            (allclose), differing rows (topk_set, index_set); NaN when the check stopped
            before computing it.
        detail: what was compared and, on failure, the failing criterion first, one line per
            criterion, then a hint where the pattern is recognisable.
    """

    name: str
    metric: str
    passed: bool
    value: float
    detail: str


@dataclass(frozen=True)
class CompareReport:
    """All checks of one candidate, and the golden outputs it did not provide.

    conventions: the conventions whose cases were checked; not_run: per convention left out,
    the reason (``compare --kernel`` runs another convention's cases only when asked to, or
    when the kernel takes that convention's keywords).
    """

    checks: tuple[TensorCheck, ...]
    not_in_candidate: tuple[str, ...]
    conventions: tuple[str, ...] = ()
    not_run: tuple[tuple[str, str], ...] = ()

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def to_json(self) -> dict:
        return {"passed": self.passed,
                "checks": [{"name": c.name, "metric": c.metric, "passed": c.passed,
                            "value": c.value, "detail": c.detail} for c in self.checks],
                "not_in_candidate": list(self.not_in_candidate),
                "conventions": list(self.conventions),
                "conventions_not_run": {name: why for name, why in self.not_run}}


def compare(golden_dir: str | os.PathLike, candidate: Mapping[str, Tensor]) -> CompareReport:
    """Check every candidate tensor against the golden output of the same name.

    ``candidate`` holds a kernel's outputs named like the golden outputs
    (``fp8_mqa_logits.empty_window.logits``); any subset of them. A name that is not a golden
    output is a ValueError (a typo would otherwise pass silently).
    """
    manifest, golden = load_golden(golden_dir)
    return check_outputs(manifest, golden, candidate)


def check_outputs(
    manifest: dict, golden: Mapping[str, Tensor], candidate: Mapping[str, Tensor]
) -> CompareReport:
    """``compare`` on an already loaded golden set (``load_golden``)."""
    loaded = load_cases(manifest, golden)
    owner = {name: case for case, expected in loaded for name in expected}
    unknown = sorted(set(candidate) - set(owner))
    if unknown:
        raise ValueError(
            f"candidate tensors {unknown[:5]} are not golden outputs; name them "
            f"<contract>.<case>.<output> as in the golden {MANIFEST}, e.g. {min(owner)}"
        )
    if not candidate:
        raise ValueError("the candidate holds no tensors")
    checks = []
    for name in sorted(candidate):
        case = owner[name]
        prefix = f"{case.contract}.{case.name}."
        out = name.removeprefix(prefix)
        got, exp = {out: candidate[name]}, {out: golden[name]}
        v = verdicts_of(case, got, exp)[out]
        checks.append(_tensor_check(case, prefix + out, v,
                                    lambda: failure_context(case, got, exp)))
    checked = sorted({case_convention(owner[n]) for n in candidate})
    return CompareReport(tuple(checks), tuple(sorted(set(owner) - set(candidate))), tuple(checked))


def case_convention(case: Case) -> str:
    """The name of the convention a golden case was written under."""
    return convention_of(case.contract, {k: case.kwargs[k] for k in case.pinned}) or "custom"


def _tensor_check(case: Case, name: str, v, context: Callable[[], list[str]]) -> TensorCheck:
    """The verdict on one output; a failure's deciding line first, then its cause and clause
    (``context()``, ``failure_context`` of the case), then the other criteria."""
    out = name.rsplit(".", 1)[1]
    detail = v.text()
    if not v.passed:
        first, *rest = detail.splitlines()
        detail = "\n".join([first, *(line.strip() for line in context()),
                            *(line.strip() for line in rest)])
    return TensorCheck(name, case.checks[out]["metric"], v.passed, v.value, detail)


def _once(fn: Callable[[], list[str]]) -> Callable[[], list[str]]:
    """``fn`` computed on the first call only (a case's diagnosis serves all its outputs)."""
    memo: list[list[str]] = []

    def once() -> list[str]:
        if not memo:
            memo.append(fn())
        return memo[0]

    return once


def compare_kernel(golden_dir: str | os.PathLike, fn: Callable, *, device: str | torch.device = "cpu",
                   timeout: float | None = DEFAULT_TIMEOUT_S,
                   contracts: tuple[str, ...] | None = None,
                   convention: str | None = None) -> CompareReport:
    """Run ``fn`` on the golden inputs of every case of ``contracts`` (default: every contract
    whose name is ``fn``'s ``__name__``) and check its outputs against the golden outputs.

    Only the cases of ``convention`` (default the newest) run, and those of another convention
    whose keywords the kernel takes (it is then told which convention to follow): a kernel with
    an upstream signature implements one convention and is judged by it. The kernel is called
    as ``check_kernel`` calls it (inputs moved to ``device``, a per-call ``timeout`` in
    seconds; an exception, ``sys.exit`` or a change to an input is a FAIL of every output of
    that case).
    """
    manifest, golden = load_golden(golden_dir)
    loaded = load_cases(manifest, golden)
    known = {case.contract for case, _ in loaded}
    if contracts is None:
        name = getattr(fn, "__name__", "")
        if name not in known:
            raise ValueError(f"cannot tell which contract {name or fn!r} implements; name it with "
                             f"--contract (one of: {', '.join(sorted(known))})")
        contracts = (name,)
    for c in contracts:
        if c not in known:
            raise ValueError(f"the golden set has no contract {c!r}; one of: {', '.join(sorted(known))}")
    wanted = convention or NEWEST
    for c in contracts:
        if wanted not in conventions(c):
            raise ValueError(f"{c} has no convention {wanted!r}; its conventions: "
                             f"{', '.join(conventions(c))}")
    checks, checked, not_run = [], set(), {}
    for case, expected in loaded:
        if case.contract not in contracts:
            continue
        conv = case_convention(case)
        if conv != wanted and not takes_keywords(fn, case.pinned or tuple(conventions(case.contract)[wanted])):
            keys = sorted(set(case.pinned) | set(conventions(case.contract)[wanted]))
            not_run[conv] = (f"the kernel takes no {', '.join(keys)}; --convention {conv} runs "
                             f"these cases")
            continue
        checked.add(conv)
        prefix = f"{case.contract}.{case.name}."
        exp = {n.removeprefix(prefix): t for n, t in expected.items()}
        try:
            got = kernel_outputs(case, fn, device=device, timeout=timeout)
        except AssertionError as e:
            checks += [TensorCheck(prefix + n, case.checks[n]["metric"], False, float("nan"), str(e))
                       for n in exp]
            continue
        got_by_name = dict(zip(case.checks, got))
        context = _once(lambda: failure_context(case, got_by_name, exp))
        for n, v in verdicts_of(case, got_by_name, exp).items():
            checks.append(_tensor_check(case, prefix + n, v, context))
    return CompareReport(tuple(checks), (), tuple(sorted(checked)), tuple(sorted(not_run.items())))


def format_report(report: CompareReport) -> str:
    """One line per checked tensor (PASS / FAIL, name, the deciding criterion; the other
    criteria and a hint indented below a failure) and a summary line."""
    width = max((len(c.name) for c in report.checks), default=0)
    lines = []
    for c in report.checks:
        first, *rest = c.detail.splitlines() or [""]
        lines.append(f"{'PASS' if c.passed else 'FAIL'}  {c.name:<{width}}  {c.metric}: {first}")
        lines += [f"      {line}" for line in rest] if not c.passed else []
    failed = sum(not c.passed for c in report.checks)
    lines.append(
        f"{len(report.checks)} checked: {len(report.checks) - failed} passed, {failed} failed; "
        f"{len(report.not_in_candidate)} golden outputs not in the candidate"
    )
    if report.conventions:
        line = f"conventions checked: {', '.join(report.conventions)}"
        line += "".join(f"; {name} not run ({why})" for name, why in report.not_run)
        lines.append(line)
    return "\n".join(lines)

