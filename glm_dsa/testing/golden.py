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
and each data file's: a hand-loosened tolerance is refused, not obeyed; every manifest problem
(not JSON, a key missing or of the wrong type, a file listed but absent or one not listed) is
one line naming the file and the fix. The hashes catch accidents, not a wrong set:
``verify_golden`` (``compare --verify``) recomputes each expected output from the stored inputs
with the installed oracle.

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
from glm_dsa.testing.isolation import kernel_session

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
    "verify_golden",
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
    """Read ``manifest.json`` and every golden tensor, checking the manifest's own sha256, its
    structure (every key the cases are read from, of its type; every tensor a case names
    present), each file's sha256, that the directory holds no data file the manifest does not
    list, and that each case's metrics are the case table's. Any problem is a ValueError of one
    line naming the file and what to do."""
    golden_dir = os.fspath(golden_dir)
    path = os.path.join(golden_dir, MANIFEST)
    if not os.path.isfile(path):
        raise ValueError(f"{path} not found; write golden vectors with: glm-dsa golden --out {golden_dir}")
    manifest = _read_manifest(path, golden_dir)
    seed = manifest.get("seed")
    again = (f"regenerate the set with: glm-dsa golden --out {golden_dir}"
             + (f" --seed {seed}" if isinstance(seed, int) and not isinstance(seed, bool) else ""))
    if manifest.get("manifest_sha256") != _manifest_digest(manifest):
        raise ValueError(f"{path} was edited after it was written (its manifest_sha256 does not "
                         f"match its content); {again}")
    _check_structure(path, manifest, again)
    _check_directory(path, golden_dir, manifest["files"], again)
    tensors: dict[str, Tensor] = {}
    for name in sorted(manifest["files"]):
        try:
            tensors.update(load_file(os.path.join(golden_dir, name)))
        except Exception:  # safetensors raises its own error type for a malformed file
            raise ValueError(f"{os.path.join(golden_dir, name)} is not a readable safetensors file "
                             f"though its sha256 matches the manifest's; {again}") from None
    _check_tensors_named(path, manifest["cases"], tensors, again)
    load_cases(manifest, tensors, where=path)  # the metrics are the case table's
    return manifest, tensors


def _read_manifest(path: str, golden_dir: str) -> dict:
    """The manifest as a JSON object of this format."""
    again = f"regenerate the set with: glm-dsa golden --out {golden_dir}"
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except PermissionError:
        raise ValueError(f"{path} is not readable; check its permissions") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not JSON (not UTF-8 text); {again}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"{again}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a JSON object (it holds a {type(manifest).__name__}); {again}")
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path} has format {manifest.get('format')!r}, expected {FORMAT!r}; {again}")
    return manifest


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _check_structure(path: str, manifest: dict, again: str) -> None:
    """Every key the cases are read from, of its type."""

    def bad(where: str, what: str) -> ValueError:
        return ValueError(f"{path}: {where} {what}; {again}")

    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("'files'", "is not a non-empty {file name: {sha256, bytes, contract}} object")
    for name, info in files.items():
        if os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(f"{path}: its files entry {name!r} is not a file name in "
                             f"{os.path.dirname(path)} (the golden writer names "
                             f"<contract>.safetensors beside the manifest); {again}")
        if not isinstance(info, dict) or not _is_sha256(info.get("sha256")):
            raise bad(f"files entry {name!r}", "has no sha256 of 64 hex digits")
        if isinstance(info.get("bytes"), bool) or not isinstance(info.get("bytes"), int):
            raise bad(f"files entry {name!r}", "has no 'bytes' count")
    cases = manifest.get("cases")
    if not isinstance(cases, list) or not cases:
        raise bad("'cases'", "is not a non-empty list of cases")
    kinds = {"contract": str, "case": str, "file": str, "args": list, "kwargs": dict,
             "outputs": dict, "aux": dict}
    seen = set()
    for i, entry in enumerate(cases):
        if not isinstance(entry, dict):
            raise bad(f"case #{i}", "is not a JSON object")
        for key, kind in kinds.items():
            if not isinstance(entry.get(key), kind):
                raise bad(f"case #{i} ({entry.get('contract')}.{entry.get('case')})",
                          f"has no {key!r} {kind.__name__}")
        label = f"case {entry['contract']}.{entry['case']}"
        if (entry["contract"], entry["case"]) in seen:
            raise bad(label, "is given twice")
        seen.add((entry["contract"], entry["case"]))
        if entry["file"] not in files:
            raise bad(label, f"is in {entry['file']!r}, which 'files' does not list")
        for spec in (*entry["args"], *entry["kwargs"].values()):
            if not _is_call_spec(spec):
                raise bad(label, f"has the argument {spec!r}, which is none of {{\"tensor\": NAME}}, "
                                 f"{{\"tuple\": [...]}}, {{\"value\": JSON}}")
        if not all(isinstance(v, dict) for v in entry["outputs"].values()):
            raise bad(label, "has an output whose metric is not a JSON object")
        if not isinstance(entry.get("pinned", []), list):
            raise bad(label, "has a 'pinned' that is not a list")
        for key in ("repro", "clause"):
            if not isinstance(entry.get(key, ""), str):
                raise bad(label, f"has a {key!r} that is not a string")


def _is_call_spec(spec: object) -> bool:
    if not isinstance(spec, dict) or len(spec) != 1:
        return False
    (kind, value), = spec.items()
    if kind == "tensor":
        return isinstance(value, str)
    if kind == "tuple":
        return isinstance(value, list) and all(_is_call_spec(s) for s in value)
    return kind == "value"


def _check_directory(path: str, golden_dir: str, files: dict, again: str) -> None:
    """Each listed file present with its sha256, and no data file the manifest does not list."""
    for name, info in sorted(files.items()):
        file_path = os.path.join(golden_dir, name)
        if not os.path.isfile(file_path):
            raise ValueError(f"{file_path} is listed in {path} but absent; restore it or {again}")
        if _sha256(file_path) != info["sha256"]:
            raise ValueError(f"{file_path} differs from the manifest's sha256 (a changed or "
                             f"truncated file); restore it or {again}")
    strays = sorted(n for n in os.listdir(golden_dir) if n.endswith(".safetensors") and n not in files)
    if strays:
        raise ValueError(f"{golden_dir} holds {', '.join(strays[:5])}, which {path} does not list "
                         f"(a file of another golden set?); remove it or {again}")


def _check_tensors_named(path: str, cases: list[dict], tensors: Mapping[str, Tensor], again: str) -> None:
    """Every tensor a case reads (its call, expected outputs and metric tensors) is in the files."""
    for entry in cases:
        names = _tensor_names(entry["args"], entry["kwargs"]) + list(entry["outputs"]) + list(entry["aux"])
        absent = [n for n in names if n not in tensors]
        if absent:
            raise ValueError(f"{path}: case {entry['contract']}.{entry['case']} reads the tensor "
                             f"{absent[0]!r}, which no listed file holds; {again}")


def load_cases(manifest: dict, golden: Mapping[str, Tensor],
               where: str = MANIFEST) -> list[tuple[Case, dict[str, Tensor]]]:
    """Each manifest case as a ``Case`` (tensors from ``golden``, metrics from the case table)
    with its expected outputs by full name. A manifest (``where``, for the message) naming a
    contract this glm-dsa does not know, or whose recorded metric or tolerance differs from the
    case table's, is a ValueError."""
    fix = "regenerate it with this glm-dsa's golden command: glm-dsa golden --out DIR"
    out = []
    for entry in manifest["cases"]:
        contract, prefix = entry["contract"], f"{entry['contract']}.{entry['case']}."
        if contract not in CONTRACTS:
            raise ValueError(f"{where} names contract {contract!r}, which glm-dsa does not know; {fix}")
        args = tuple(_decode(a, golden) for a in entry["args"])
        kwargs = {n: _decode(v, golden) for n, v in entry["kwargs"].items()}
        spec = CONTRACTS[contract]
        checks = spec.checks(kwargs)
        aux = {n.removeprefix(prefix): golden[n] for n in entry["aux"]}
        for name, check in checks.items():
            if prefix + name not in entry["outputs"]:
                raise ValueError(f"{where}: case {prefix[:-1]} has no expected output {name!r}; {fix}")
            recorded = {k: v for k, v in entry["outputs"][prefix + name].items()
                        if k not in ("shape", "dtype")}
            if recorded != _resolve(check, prefix):
                raise ValueError(
                    f"{where}: the metric of {prefix + name} ({recorded}) differs from "
                    f"glm-dsa's case table ({check}); {fix}")
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
    when the kernel takes that convention's keywords); recomputed: the checks are of the golden
    set's own outputs against the installed oracle (``verify_golden``). Nothing checked is not
    a pass.
    """

    checks: tuple[TensorCheck, ...]
    not_in_candidate: tuple[str, ...]
    conventions: tuple[str, ...] = ()
    not_run: tuple[tuple[str, str], ...] = ()
    recomputed: bool = False

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c.passed for c in self.checks)

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


def compare_kernel(golden_dir: str | os.PathLike, fn: Callable | str, *,
                   device: str | torch.device = "cpu", timeout: float | None = DEFAULT_TIMEOUT_S,
                   contracts: tuple[str, ...] | None = None,
                   convention: str | None = None) -> CompareReport:
    """Run ``fn`` on the golden inputs of every case of ``contracts`` (default: every contract
    whose name is ``fn``'s ``__name__``) and check its outputs against the golden outputs.

    Only the cases of ``convention`` (default the newest) run, and those of another convention
    whose keywords the kernel takes (it is then told which convention to follow): a kernel with
    an upstream signature implements one convention and is judged by it. The kernel is called
    as ``check_kernel`` calls it (a callable in this process, a ``"MODULE:FUNCTION"`` name in a
    process of its own, restarted after it dies; inputs moved to ``device``, a per-call
    ``timeout`` in seconds; an exception, ``sys.exit``, a change to an input, or the kernel's
    process ending, forking or crashing is a FAIL of every output of that case).
    """
    manifest, golden = load_golden(golden_dir)
    loaded = load_cases(manifest, golden)
    with kernel_session(fn, timeout) as kernel:
        return _compare_cases(loaded, kernel, device, timeout, contracts, convention)


def _compare_cases(loaded: list[tuple[Case, dict[str, Tensor]]], fn: Callable, device,
                   timeout: float | None, contracts: tuple[str, ...] | None,
                   convention: str | None) -> CompareReport:
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


def verify_golden(golden_dir: str | os.PathLike, contracts: tuple[str, ...] | None = None) -> CompareReport:
    """Recompute every expected output of the golden set (of ``contracts``; default all) from
    its stored inputs with the installed oracle, and judge each stored output against it by the
    contract's metric (``glm-dsa compare --verify``).

    The manifest's hashes catch accidents, not a wrong set: an expected output replaced, or an
    input replaced, and the hashes recomputed, passes ``load_golden`` but fails here, naming the
    case, the output and how far it is (the elements that differ, then the metric's criteria).
    Recomputed outputs are bitwise the stored ones on the machine and torch that wrote the set;
    elsewhere they may differ in the last bits, within the metric.
    """
    manifest, golden = load_golden(golden_dir)
    loaded = load_cases(manifest, golden)
    known = {case.contract for case, _ in loaded}
    for c in contracts or ():
        if c not in known:
            raise ValueError(f"the golden set has no contract {c!r}; one of: {', '.join(sorted(known))}")
    checks = []
    for case, stored in loaded:
        if contracts is not None and case.contract not in contracts:
            continue
        prefix = f"{case.contract}.{case.name}."
        got = {n.removeprefix(prefix): t for n, t in stored.items()}
        try:
            recomputed = dict(zip(case.checks, expected_outputs(case)))
        except ValueError as e:  # the oracle refuses the stored inputs
            checks += [TensorCheck(prefix + n, case.checks[n]["metric"], False, float("nan"),
                                   f"the oracle refuses the stored inputs: {e}") for n in got]
            continue
        for n, v in verdicts_of(case, got, recomputed).items():
            check = _tensor_check(case, prefix + n, v, lambda: [])
            detail = f"{_difference(got[n], recomputed[n])}; {check.detail}"
            checks.append(TensorCheck(check.name, check.metric, check.passed, check.value, detail))
    return CompareReport(tuple(checks), (), recomputed=True)


def _difference(stored: Tensor, recomputed: Tensor) -> str:
    """How far a stored output is from the recomputed one, element by element."""
    if stored.shape != recomputed.shape or stored.dtype != recomputed.dtype:
        return (f"stored {tuple(stored.shape)} {stored.dtype}, recomputed {tuple(recomputed.shape)} "
                f"{recomputed.dtype}")
    a, b = stored.reshape(-1), recomputed.reshape(-1)
    if a.numel() == 0:
        return "bitwise the recomputed output (no elements)"
    same = (a.view(torch.uint8) == b.view(torch.uint8)).reshape(a.numel(), -1).all(1)
    differ = int((~same).sum())
    if differ == 0:
        return "bitwise the recomputed output"
    first = int((~same).nonzero()[0])
    return (f"{differ} of {a.numel()} elements differ from the recomputed output, the first at flat "
            f"index {first}: stored {a[first].item()}, recomputed {b[first].item()}")


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
    counts = f"{len(report.checks)} checked: {len(report.checks) - failed} passed, {failed} failed; "
    if report.recomputed:
        lines.append(counts + "each golden output judged against the installed oracle run on "
                     "its stored inputs")
    else:
        lines.append(counts + f"{len(report.not_in_candidate)} golden outputs not in the candidate")
    if not report.checks:
        lines.append("FAIL: no case ran, so nothing passed")
    if report.conventions or report.not_run:
        line = f"conventions checked: {', '.join(report.conventions) or 'none'}"
        line += "".join(f"; {name} not run ({why})" for name, why in report.not_run)
        lines.append(line)
    return "\n".join(lines)

