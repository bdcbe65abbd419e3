"""flashinfer-bench definitions, checked against the oracle's contracts in one command.

A flashinfer-bench definition (the FlashInfer Trace schema: ``name``, ``op_type``, ``axes``
whose entries are ``{"type": "const", "value": N}`` or ``{"type": "var"}``, ``inputs`` and
``outputs`` as ``{"shape": [axis names] or null, "dtype": ...}``, ``reference``: Python source
with a top-level ``run``) names a kernel's arguments and outputs, not a contract. The DSA
definitions map onto two contracts, recognised by their input and output names:

* ``dsa_topk_indexer`` (``q_index_fp8, k_index_cache_fp8, weights, seq_lens, block_table`` →
  ``topk_indices``) is ``fp8_paged_mqa_topk`` for one query per request (``next_n = 1``), the
  132-byte DeepGEMM pages typed int8, and outputs that are physical slots
  (``block * page_size + offset``, ``-1`` padded), turned back into positions through the block
  table before the ``topk_margin`` metric reads them.
* ``dsa_sparse_attention`` (``q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale`` →
  ``output, lse``) is ``flash_mla_sparse_fwd`` with the 576-dim q and kv split 512 + 64, the kv
  rows laid out as ``[num_pages, page_size, dim]`` pages (a slot is a kv row), ``-1`` as the only
  padding (every invalid index of a case is given as ``-1``, which the contract skips alike),
  no ``attn_sink`` or ``topk_length``, and the Sep-2025 FlashMLA convention: a base-2 ``lse``
  and ``-inf`` for a row with no valid index. ``max_logits`` is not an output there.

Cases are the contract's own edge and random cases, built at the definition's constant axes
(heads, top-k, page size); those the definition cannot express (two queries per request) are
skipped and listed. ``--against-reference`` also runs the definition's ``reference`` on every
case and reports how far it is from the oracle, by the same metric.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping

import torch
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.testing.cases import PAGE, SHAPES, Case, edge_case_names, make_case, positions_of_slots
from glm_dsa.testing.check import (
    DEFAULT_TIMEOUT_S,
    CheckReport,
    Worst,
    expected_outputs,
    failure_context,
    verdicts_of,
)
from glm_dsa.testing.isolation import InputsChanged, call_kernel, kernel_session, tensor_leaves

__all__ = ["Definition", "DefinitionMap", "KINDS", "load_definition", "definition_map",
           "definition_cases", "check_definition", "positions_of_slots", "reference_fn"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float8_e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn,
           "int32": torch.int32, "int64": torch.int64, "int8": torch.int8, "uint8": torch.uint8}


@dataclass(frozen=True)
class Definition:
    """A flashinfer-bench definition as read: ``axes`` maps each constant axis to its value
    (variable axes to None); ``inputs`` / ``outputs`` map names, in order, to their specs."""

    name: str
    op_type: str
    axes: dict[str, int | None]
    inputs: dict[str, dict]
    outputs: dict[str, dict]
    reference: str
    path: str = ""


def load_definition(path: str | os.PathLike) -> Definition:
    """Read and validate a definition JSON file; ValueError (one line) naming what is wrong."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise ValueError(f"--definition {path} does not exist")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"--definition {path} is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"--definition {path} holds a {type(raw).__name__}, not a definition object")
    # The schema's older files call op_type "type".
    missing = [k for k in ("name", "axes", "inputs", "outputs", "reference") if k not in raw]
    if "op_type" not in raw and "type" not in raw:
        missing.insert(1, "op_type")
    if missing:
        raise ValueError(f"--definition {path} lacks {', '.join(missing)}: a flashinfer-bench "
                         f"definition has name, op_type, axes, inputs, outputs and reference")
    axes: dict[str, int | None] = {}
    for name, spec in raw["axes"].items():
        kind = spec.get("type") if isinstance(spec, dict) else None
        if kind == "const" and isinstance(spec.get("value"), int) and spec["value"] > 0:
            axes[name] = spec["value"]
        elif kind == "var":
            axes[name] = None
        else:
            raise ValueError(f"--definition {path}: axis {name!r} must be {{\"type\": \"const\", "
                             f"\"value\": N > 0}} or {{\"type\": \"var\"}}, got {spec!r}")
    for where in ("inputs", "outputs"):
        for name, spec in raw[where].items():
            shape = spec.get("shape") if isinstance(spec, dict) else None
            if not isinstance(spec, dict) or spec.get("dtype") not in _DTYPES or not (
                    shape is None or all(a in axes for a in shape)):
                raise ValueError(f"--definition {path}: {where[:-1]} {name!r} needs a dtype of "
                                 f"{', '.join(_DTYPES)} and a shape of declared axes (or null), "
                                 f"got {spec!r}")
    return Definition(raw["name"], str(raw.get("op_type", raw.get("type"))), axes, dict(raw["inputs"]),
                      dict(raw["outputs"]), raw["reference"], path)


# ----------------------------------------------------------------------------- the two kinds
def _indexer_inputs(case: Case, axes: dict) -> dict[str, Any]:
    q, kv_cache, weights, ctx, table, _ = case.args
    if q.shape[1] != 1 or ctx.dim() != 1:
        raise ValueError("the definition has one query per request (no next_n axis)")
    return {"q_index_fp8": q[:, 0].contiguous(), "k_index_cache_fp8": kv_cache.view(torch.int8),
            "weights": weights, "seq_lens": ctx, "block_table": table}


def _indexer_outputs(case: Case, outs: Mapping[str, Tensor]) -> dict[str, Tensor]:
    slots = outs["topk_indices"]
    if slots.is_floating_point() or slots.dim() != 2:  # let the contract's checks say so
        return {"indices": slots}
    positions = positions_of_slots(slots.long(), case.args[4], case.args[1].shape[1])
    return {"indices": positions.to(slots.dtype)}


def _attention_inputs(case: Case, axes: dict) -> dict[str, Any]:
    q, kv, indices, sm_scale = case.args
    page = axes["page_size"]
    s_kv = kv.shape[0]
    pages = -(-s_kv // page)
    rows = torch.zeros(pages * page, oracle.MLA_DIM, dtype=kv.dtype)
    rows[:s_kv] = kv[:, 0]  # the rows past s_kv are never named by a valid index
    idx = indices[:, 0]
    return {"q_nope": q[..., : oracle.MLA_NOPE_DIM].contiguous(),
            "q_pe": q[..., oracle.MLA_NOPE_DIM:].contiguous(),
            "ckv_cache": rows[:, : oracle.MLA_NOPE_DIM].reshape(pages, page, oracle.MLA_NOPE_DIM),
            "kpe_cache": rows[:, oracle.MLA_NOPE_DIM:].reshape(pages, page, oracle.MLA_ROPE_DIM),
            "sparse_indices": idx.contiguous(),
            "sm_scale": float(sm_scale)}


def _only_minus_one(case: Case) -> Case:
    """The case with every invalid index given as -1, the definition's only padding (the
    contract skips every invalid index alike, so the expected outputs do not change)."""
    q, kv, indices, sm_scale = case.args
    idx = torch.where((indices < 0) | (indices >= kv.shape[0]), -1, indices)
    return replace(case, args=(q, kv, idx.to(torch.int32), sm_scale))


def _attention_outputs(case: Case, outs: Mapping[str, Tensor]) -> dict[str, Tensor]:
    return {"out": outs["output"], "lse": outs["lse"]}


def _indexer_shapes(axes: dict) -> dict:
    k = axes["topk"]
    return {**SHAPES["small"], "index_heads": (axes["num_index_heads"],), "topk": (k,),
            "next_n": (1,), "max_context": 2 * k + 100}


def _attention_shapes(axes: dict) -> dict:
    k = axes["topk"]
    return {**SHAPES["small"], "mla_heads": (axes["num_qo_heads"],), "mla_topk": (k,),
            "max_kv": 2 * k + 100, "sm_scale": SHAPES["glm-5.3"]["sm_scale"]}


@dataclass(frozen=True)
class DefinitionMap:
    """How one kind of definition reaches its contract.

    inputs: the definition's input names, in the order its kernels take them. names: each
    output of the definition (in its order) and the contract output it is judged as. fixed: constant axes the contract's byte layout or shapes fix. varied: constant axes the
    cases are built at (``shapes(axes)``). pinned: the contract's convention options.
    to_inputs(case, axes) → the definition's inputs by name (ValueError: the case cannot be
    expressed). from_outputs(case, outputs by definition name) → outputs by contract name.
    prepare(case) → the case as the definition can state it (same expected outputs).
    """

    kind: str
    contract: str
    inputs: tuple[str, ...]
    names: dict[str, str]
    fixed: dict[str, int]
    varied: tuple[str, ...]
    pinned: dict[str, Any]
    to_inputs: Callable[[Case, dict], dict[str, Any]]
    from_outputs: Callable[[Case, Mapping[str, Tensor]], dict[str, Tensor]]
    shapes: Callable[[dict], dict]
    prepare: Callable[[Case], Case] = lambda case: case


KINDS: dict[str, DefinitionMap] = {
    "dsa_topk_indexer": DefinitionMap(
        "dsa_topk_indexer", "fp8_paged_mqa_topk",
        ("q_index_fp8", "k_index_cache_fp8", "weights", "seq_lens", "block_table"),
        {"topk_indices": "indices"},
        {"index_head_dim": 128, "page_size": PAGE, "kv_cache_num_heads": 1,
         "head_dim_with_scale": 132},
        ("num_index_heads", "topk"), {}, _indexer_inputs, _indexer_outputs, _indexer_shapes),
    "dsa_sparse_attention": DefinitionMap(
        "dsa_sparse_attention", "flash_mla_sparse_fwd",
        ("q_nope", "q_pe", "ckv_cache", "kpe_cache", "sparse_indices", "sm_scale"),
        {"output": "out", "lse": "lse"},
        {"head_dim_ckv": oracle.MLA_NOPE_DIM, "head_dim_kpe": oracle.MLA_ROPE_DIM},
        ("num_qo_heads", "topk", "page_size"), {"lse_base": "2", "lonely_lse": "-inf"},
        _attention_inputs, _attention_outputs, _attention_shapes, _only_minus_one),
}


def definition_map(defn: Definition) -> DefinitionMap:
    """The kind ``defn`` is, by its input and output names; ValueError (one line) for a
    definition no contract covers, or one whose constant axes the contract cannot take."""
    for m in KINDS.values():
        if set(defn.inputs) == set(m.inputs) and set(defn.outputs) == set(m.names):
            break
    else:
        known = "; ".join(f"{m.kind} ({', '.join(m.inputs)} -> {', '.join(m.names)})"
                          for m in KINDS.values())
        raise ValueError(f"definition {defn.name!r} (op_type {defn.op_type}) maps to no glm-dsa "
                         f"contract; the DSA definitions glm-dsa checks: {known}")
    for axis, value in {**m.fixed, **{a: None for a in m.varied}}.items():
        got = defn.axes.get(axis, "missing")
        if got is None or got == "missing" or (value is not None and got != value):
            want = "a constant" if value is None else f"the constant {value}"
            raise ValueError(f"definition {defn.name!r}: axis {axis!r} is {got!r}; {m.contract} "
                             f"needs {want} there")
    return m


def definition_cases(defn: Definition, cases: int = 50, seed: int = 0) -> tuple[list[Case], list[str]]:
    """The contract's edge cases and random cases (``cases`` in all) at ``defn``'s constant
    axes, with the definition's convention pinned; and the names of those it cannot express."""
    m = definition_map(defn)
    shapes = m.shapes(defn.axes)
    out, skipped = [], []
    whichs: list[str | int] = list(edge_case_names(m.contract))
    whichs += list(range(max(cases - len(whichs), 0)))
    for which in whichs:
        name = which if isinstance(which, str) else f"random #{which}"
        try:
            case = m.prepare(make_case(m.contract, which, seed=seed, shapes=shapes, **m.pinned))
            m.to_inputs(case, defn.axes)
        except ValueError:
            skipped.append(name)
            continue
        out.append(case)
    return out, skipped


# ----------------------------------------------------------------------------- the check
def _by_name(names: tuple[str, ...], got: Any) -> dict[str, Tensor]:
    """A kernel's result (a tensor, a tuple / list in the definition's output order, or a dict
    by output name) by output name; ValueError when it is none of those."""
    if isinstance(got, Mapping):
        if set(got) != set(names):
            raise ValueError(f"the kernel returned outputs {sorted(got)}; the definition's are {list(names)}")
        return {n: t.detach().cpu() for n, t in got.items()}
    got = got if isinstance(got, (tuple, list)) else (got,)
    if len(got) != len(names) or not all(isinstance(t, Tensor) for t in got):
        kinds = ", ".join(type(t).__name__ for t in got)
        raise ValueError(f"the kernel returned ({kinds}); the definition returns {len(names)} "
                         f"tensor(s) ({', '.join(names)})")
    return {n: t.detach().cpu() for n, t in zip(names, got)}


def reference_fn(defn: Definition) -> Callable:
    """The definition's own ``run``, compiled from its ``reference`` source."""
    namespace: dict[str, Any] = {}
    try:
        exec(compile(defn.reference, f"<{defn.name} reference>", "exec"), namespace)  # noqa: S102
    except Exception as e:  # the definition's code, not ours
        raise ValueError(f"definition {defn.name!r}: its reference does not run: "
                         f"{type(e).__name__}: {e}") from None
    if not callable(namespace.get("run")):
        raise ValueError(f"definition {defn.name!r}: its reference defines no run()")
    return namespace["run"]


def _positional(defn: Definition, inputs: dict[str, Any]) -> tuple:
    return tuple(inputs[n] for n in defn.inputs)


_CONVENTION_CAUSE = re.compile(r"the kernel follows convention '(\w+)' \((.*?)\): check it with .*")


def _in_definition_terms(line: str, m: DefinitionMap) -> str:
    """A cause naming another convention, said as the definition's: ``--convention`` does not
    go with ``--definition``."""
    flags = ", ".join(f"{k}={v!r}" for k, v in m.pinned.items())
    return _CONVENTION_CAUSE.sub(lambda hit: f"the kernel follows convention {hit[1]!r} ({hit[2]}); "
                                 f"the definition's is {flags}", line)


def check_definition(defn: Definition, fn: Callable | str, *, cases: int = 50, seed: int = 0,
                     device: str | torch.device = "cpu", timeout: float | None = DEFAULT_TIMEOUT_S,
                     against_reference: bool = False) -> tuple[CheckReport, list[str]]:
    """Check ``fn`` (taking the definition's inputs positionally, in its order, and returning
    its outputs; a callable, or its ``"MODULE:FUNCTION"`` name, run in a process of its own)
    on the mapped contract's cases; the report (``convention`` names the definition) and, with
    ``against_reference``, one line per output: how far the definition's ``reference`` is from
    the oracle over the same cases, by the contract's metric.

    A kernel that raises, hangs, writes to an input or returns other outputs fails its case
    (a named one also when it ends, forks or crashes its process); a failed metric fails it
    with the message ``check_kernel`` gives (cause, clause, criteria, the case's rebuild). No
    case run is a failure too.
    """
    m = definition_map(defn)
    run_reference = reference_fn(defn) if against_reference else None
    built, skipped = definition_cases(defn, cases, seed)
    report = CheckReport(m.contract, convention=f"definition {defn.name}", skipped=skipped)
    if not built:
        report.failure = (f"{defn.name}: no case ran; the definition cannot state any of "
                          f"{m.contract}'s cases")
        return report, []
    with kernel_session(fn, timeout) as kernel:  # a named kernel: one process for every case
        reference = _check_cases(defn, m, kernel, built, report, device, timeout, run_reference)
    alias = {ours: theirs for theirs, ours in m.names.items()}
    lines = [f"REFERENCE  {defn.name}.{alias[out]}  {built[0].checks[out]['metric']}: {ok} of {n} "
             f"cases within the contract's bound of the oracle (worst passing value {worst:.3g}){why}"
             for out, (ok, n, worst, why) in reference.items()]
    return report, lines


def _check_cases(defn: Definition, m: DefinitionMap, fn: Callable, built: list[Case],
                 report: CheckReport, device, timeout: float | None,
                 run_reference: Callable | None) -> dict[str, list]:
    """``check_definition``'s cases, until the first failure, into ``report``; per output,
    [passed, cases, worst passing value, first failure] of the reference."""
    alias = {ours: theirs for theirs, ours in m.names.items()}
    outputs = tuple(defn.outputs)  # the order the kernel returns them in
    reference: dict[str, list] = {}  # output → [passed, cases, worst passing value, first failure]
    for case in built:
        inputs = _positional(defn, m.to_inputs(case, defn.axes))
        expected = dict(zip(case.checks, expected_outputs(case)))
        message = None
        try:
            called = call_kernel(fn, inputs, {}, timeout, device)
            got = m.from_outputs(case, _by_name(outputs, called))
        except (RuntimeError, ValueError) as e:
            reason = str(e)
            if isinstance(e, InputsChanged):  # named as the definition names its inputs
                names = [p for n, v in zip(defn.inputs, inputs) for p, _ in tensor_leaves(v, n)]
                reason = str(InputsChanged(e.leaves, [names[i] for i in e.leaves]))
            out = next(iter(alias))
            message = f"{defn.name} [case {case.name}]: {reason} — rebuild with {case.repro}"
            report.worst[out] = Worst(case.checks[out]["metric"], math.nan, math.nan, case.name, False, reason)
        else:
            for out, v in verdicts_of(case, got, expected).items():
                w = report.worst.get(out)
                if v.passed and (w is None or abs(v.value) > w.value):
                    report.worst[out] = Worst(case.checks[out]["metric"], abs(v.value), v.bound, case.name)
                elif not v.passed and message is None:
                    first, *rest = v.text().splitlines()
                    context = [_in_definition_terms(line, m) for line in failure_context(case, got, expected)]
                    message = "\n".join([f"{defn.name} [case {case.name}]: output {alias[out]!r} fails "
                                         f"{case.checks[out]['metric']} on {first}", *context, *rest,
                                         f"  rebuild with {case.repro}"])
                    report.worst[out] = Worst(case.checks[out]["metric"], v.value, v.bound, case.name,
                                              False, v.detail)
        if run_reference is not None:
            with torch.no_grad():
                ref = m.from_outputs(case, _by_name(outputs, run_reference(*inputs)))
            for out, v in verdicts_of(case, ref, expected).items():
                row = reference.setdefault(out, [0, 0, 0.0, ""])
                row[0], row[1] = row[0] + v.passed, row[1] + 1
                row[2] = max(row[2], abs(v.value)) if v.passed else row[2]
                row[3] = row[3] or ("" if v.passed else f"; first outside at case {case.name}: {v.detail}")
        report.cases_run += 1
        report.edges_run += case.clause != ""
        report.results.append((case.name, message is None, message or ""))
        if message is not None:
            report.failure = message
            break
    return reference
