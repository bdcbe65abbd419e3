"""``glm-dsa check`` and ``glm-dsa compare``: check a kernel from the shell or in CI.

``check MODULE:FUNCTION --contract NAME`` runs the case table on the kernel; ``compare --golden
DIR`` checks a kernel's saved outputs (``--candidate FILE``), runs the kernel itself over the
golden inputs (``--kernel MODULE:FUNCTION``), or checks the golden set itself against the
installed oracle (``--verify``). All print one line per output (PASS/FAIL, the deciding
criterion and its bound) and a summary line, take ``--json`` (stdout: the report, with
``schema``) and ``--junit-xml FILE`` (one testcase per case, for CI), and exit 0 (pass) or 1
(fail). Usage errors (unknown contract or shapes, a kernel that cannot be imported, a device
this machine does not have, an output that is an input) are ValueErrors, which ``glm-dsa``
prints as one line with status 2.

A kernel is named ``MODULE:FUNCTION`` (the module imported, the current directory searched
first, as ``python -m`` does; FUNCTION may be dotted) or ``path/to/file.py:FUNCTION``, and runs
in a process of its own (``glm_dsa.testing.isolation``): whatever it does to that process, the
command reports it as a FAIL and ends with its summary line.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import xml.etree.ElementTree as ET
from typing import Any

__all__ = ["add_parser", "add_compare_parser", "run", "run_compare", "CHECK_SCHEMA", "COMPARE_SCHEMA"]

CHECK_SCHEMA = "glm-dsa.check/1"
COMPARE_SCHEMA = "glm-dsa.compare/1"


def _common(p) -> None:
    p.add_argument("--device", default="cpu", help="device of the kernel's inputs (default cpu)")
    p.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="seconds one kernel call may take before it fails the case (default 600)")
    p.add_argument("--json", action="store_true", help="print the report as JSON (with schema)")
    p.add_argument("--junit-xml", metavar="FILE",
                   help="also write the verdicts as JUnit XML, one testcase per case")
    g = p.add_argument_group(
        "conventions", "Which upstream convention the kernel follows (default: the newest). A "
        "kernel that takes the convention's keyword is told it; one that does not is judged by it.")
    g.add_argument("--convention", metavar="NAME",
                   help="newest; sep2025 (flash_mla_sparse_fwd: FlashMLA c28eca9, base-2 lse, "
                   "-inf lonely rows); tilelang (topk_per_row: absolute columns, 0 pads); "
                   "deepgemm (fp8_paged_mqa_logits, fp8_fp4_paged_mqa_logits: entries past the "
                   "context left uncleaned); sglang (kv_cache_cast_to_fp4: the scale floored, not "
                   "amax); flashinfer (flash_mla_sparse_decode_bf16: base-2 lse, -inf lonely rows)")
    for flag, (_, _, contract, choices, help_) in _OPTION_FLAGS.items():
        g.add_argument(flag, metavar="V", choices=choices, type=None if choices else int,
                       help=f"{contract}: {help_}")


# Explicit convention options: flag → (argparse dest, the oracle's keyword, its contract, the
# values allowed (None: an int), help).
_OPTION_FLAGS = {
    "--lse-base": ("lse_base", "lse_base", "flash_mla_sparse_fwd", ("e", "2"),
                   "base of lse and max_logits, e or 2"),
    "--lonely-lse": ("lonely_lse", "lonely_lse", "flash_mla_sparse_fwd", ("+inf", "-inf"),
                     "lse of a row with no valid index, +inf or -inf (write --lonely-lse=-inf)"),
    "--topk-base": ("topk_base", "base", "topk_per_row", ("relative", "absolute"),
                    "indices relative to row_start, or absolute columns"),
    "--pad": ("pad", "pad", "topk_per_row", None, "the value of unused entries (an int)"),
}


def _options(args, contract: str) -> dict:
    """The explicit convention options given, as the oracle's keywords; a flag of another
    contract is a one-line error naming it."""
    out = {}
    for flag, (dest, key, owner, _, _) in _OPTION_FLAGS.items():
        value = getattr(args, dest)
        if value is None:
            continue
        if owner != contract:
            raise ValueError(f"{flag} is an option of {owner}, not of {contract}")
        out[key] = value
    return out


def _convention(args, contract: str) -> tuple[dict, str]:
    from glm_dsa.testing.check import resolve_convention

    return resolve_convention(contract, args.convention, _options(args, contract))


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="check a kernel against the oracle on generated cases (exit status 1 on failure)",
        description="Import MODULE:FUNCTION (or path/to/file.py:FUNCTION), call it and the "
        "oracle on the contract's edge cases and seeded random cases, and compare with the "
        "contract's metric.",
    )
    p.add_argument("kernel", metavar="MODULE:FUNCTION",
                   help="the kernel, e.g. mypkg.kernels:fp8_mqa_logits or ./my_kernel.py:fn")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--contract", metavar="NAME",
                      help="the glm_dsa.oracle function the kernel implements, e.g. fp8_mqa_logits")
    what.add_argument("--definition", metavar="DEF.json",
                      help="a flashinfer-bench definition the kernel implements (its inputs "
                      "positionally, its outputs returned): the DSA indexer and sparse attention "
                      "ones map to their contracts, conventions and cases at its constant axes")
    p.add_argument("--against-reference", action="store_true",
                   help="with --definition: also run the definition's own reference on every case "
                   "and report how far it is from the oracle")
    p.add_argument("--cases", type=int, default=50, metavar="N",
                   help="cases in all, edge cases included (default 50)")
    p.add_argument("--shapes", default="small", metavar="NAME",
                   help="size table: small (CPU), golden or glm-5.3 (GPU); tp (every tensor-parallel "
                   "shard: heads 8-128, top-k 256-2048) or h8, h16, h32, h64, h128 (one shard); "
                   "sm90 (glm-5.3 with FP8 index keys in 64-token pages: what DeepGEMM's SM90 "
                   "MX entry points take); mxfp8, mxfp4 (small with one index-key format) "
                   "(default small)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random cases")
    _common(p)
    p.set_defaults(func=run)


def add_compare_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "compare",
        help="check a kernel (or its saved outputs) against golden vectors (exit status 1 on any failure)",
        description="Check each tensor of --candidate FILE, named like a golden output (e.g. "
        "fp8_mqa_logits.empty_window.logits), or the outputs of --kernel MODULE:FUNCTION run on "
        "the golden inputs, with the case table's metric; print PASS/FAIL per tensor with the "
        "deciding criterion. Exit status 0 if all pass, 1 otherwise.",
    )
    p.add_argument("--golden", required=True, metavar="DIR", help="directory written by glm-dsa golden")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--candidate", metavar="FILE.safetensors",
                      help="the kernel's outputs, named <contract>.<case>.<output>")
    what.add_argument("--kernel", metavar="MODULE:FUNCTION",
                      help="run this kernel on the golden inputs (its contract: --contract, or "
                      "the function's name)")
    what.add_argument("--verify", action="store_true",
                      help="check the golden set itself: recompute every expected output from its "
                      "stored inputs with the installed oracle and judge the stored one against it")
    p.add_argument("--contract", metavar="NAME",
                   help="with --kernel: the contract it implements; with --verify: only its cases")
    _common(p)
    p.set_defaults(func=run_compare)


def _check_common(args) -> None:
    from glm_dsa.preflight import check_device

    check_device("--device", args.device)
    if args.timeout is not None and not 0 < args.timeout < math.inf:
        raise ValueError(f"--timeout {args.timeout:g} must be a positive number of seconds, finite")


def _check_junit(args, inputs: dict[str, Any]) -> None:
    """``--junit-xml`` is no input of the run (``inputs``: {flag: path or paths}): checked with
    the kernel's file before the kernel starts, and with the files its import loaded after."""
    from glm_dsa.outputs import check_output_paths

    check_output_paths({"--junit-xml": args.junit_xml}, inputs)


def _kernel_file(spec: str) -> dict[str, str | None]:
    from glm_dsa.testing.isolation import kernel_file

    return {"kernel": kernel_file(spec)}


def _timeout(args) -> float:
    from glm_dsa.testing.check import DEFAULT_TIMEOUT_S

    return DEFAULT_TIMEOUT_S if args.timeout is None else args.timeout


def _write_junit(path: str, suite: str, cases: list[tuple[str, bool, str]]) -> None:
    """One testsuite; each (name, passed, message) a testcase, a failure carrying the message."""
    from glm_dsa.outputs import write_file

    root = ET.Element("testsuites")
    failures = sum(not ok for _, ok, _ in cases)
    ts = ET.SubElement(root, "testsuite", name=suite, tests=str(len(cases)),
                       failures=str(failures), errors="0", skipped="0")
    for name, ok, message in cases:
        tc = ET.SubElement(ts, "testcase", classname=suite, name=name)
        if not ok:
            failure = ET.SubElement(tc, "failure", message=message.splitlines()[0] if message else "")
            failure.text = message
    ET.indent(root)
    text = ET.tostring(root, encoding="unicode", xml_declaration=True) + "\n"

    def write(tmp: str) -> None:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)

    write_file(path, write)


def run(args: argparse.Namespace) -> int:
    from glm_dsa.testing.cases import CONTRACTS, SHAPES, check_seed
    from glm_dsa.testing.check import run_checks
    from glm_dsa.testing.isolation import KernelProcess

    if args.definition is not None:
        return _run_definition(args)
    if args.against_reference:
        raise ValueError("--against-reference goes with --definition (a definition carries the "
                         "reference it runs)")
    if args.contract not in CONTRACTS:
        raise ValueError(f"unknown contract {args.contract!r}; one of: {', '.join(CONTRACTS)}")
    if args.shapes not in SHAPES:
        raise ValueError(f"unknown shapes {args.shapes!r}; one of: {', '.join(SHAPES)}")
    check_seed(args.seed, "--seed")
    if args.cases < 1:
        raise ValueError(f"--cases {args.cases} must be at least 1 (the contract's edge cases "
                         f"always run; --cases counts them)")
    options, _ = _convention(args, args.contract)
    _check_common(args)
    _check_junit(args, _kernel_file(args.kernel))
    with KernelProcess(args.kernel, _timeout(args)) as fn:
        _check_junit(args, {"kernel module": fn.files})
        report = run_checks(args.contract, fn, cases=args.cases, seed=args.seed, device=args.device,
                            shapes=args.shapes, timeout=_timeout(args), **options)
    return _print_check(args, args.contract, report)


def _run_definition(args: argparse.Namespace) -> int:
    """``check --definition``: the definition's contract, cases at its constant axes."""
    from glm_dsa.testing.cases import check_seed
    from glm_dsa.testing.definitions import check_definition, definition_map, load_definition
    from glm_dsa.testing.isolation import KernelProcess

    given = [f for f, (dest, *_) in _OPTION_FLAGS.items() if getattr(args, dest) is not None]
    if args.convention is not None or given:
        raise ValueError(f"{(['--convention'] if args.convention else given)[0]} does not go with "
                         f"--definition: the definition fixes its convention")
    if args.shapes != "small":
        raise ValueError("--shapes does not go with --definition: its constant axes set the shapes")
    check_seed(args.seed, "--seed")
    if args.cases < 1:
        raise ValueError(f"--cases {args.cases} must be at least 1")
    defn = load_definition(args.definition)
    definition_map(defn)
    _check_common(args)
    _check_junit(args, {"--definition": args.definition, **_kernel_file(args.kernel)})
    with KernelProcess(args.kernel, _timeout(args)) as fn:
        _check_junit(args, {"kernel module": fn.files})
        report, reference = check_definition(defn, fn, cases=args.cases, seed=args.seed,
                                             device=args.device, timeout=_timeout(args),
                                             against_reference=args.against_reference)
    if args.json:
        return _print_check(args, defn.name, report, {"definition": defn.name,
                                                      "reference": reference})
    for line in reference:
        print(line)
    return _print_check(args, defn.name, report)


def _print_check(args: argparse.Namespace, name: str, report, extra: dict | None = None) -> int:
    """Print a check report (or its JSON, with ``extra``), write its JUnit XML; the status."""
    if args.junit_xml is not None:
        _write_junit(args.junit_xml, f"glm-dsa check {name}",
                     [(f"{name}.{case}", ok, message) for case, ok, message in report.results])
    if args.json:
        print(json.dumps({"schema": CHECK_SCHEMA, "kernel": args.kernel, "shapes": args.shapes,
                          "seed": args.seed, **report.to_json(), **(extra or {})}, indent=2))
        return 0 if report.passed else 1
    for line in report.lines():
        print(line)
    if report.skipped:
        why = ("the definition cannot state them" if report.convention.startswith("definition ")
               else "the convention lacks them, or the oracle refuses its options there")
        print(f"skipped {len(report.skipped)} cases under {report.convention} ({why}): "
              f"{', '.join(report.skipped)}")
    if report.failure is not None:
        print(f"FAIL: {report.failure}")
        return 1
    print(f"PASS: {args.kernel} matches {name} on {report.summary()}")
    return 0


def run_compare(args: argparse.Namespace) -> int:
    from glm_dsa.testing.golden import MANIFEST, compare, format_report, verify_golden

    if not os.path.isfile(os.path.join(args.golden, MANIFEST)):
        raise ValueError(f"--golden {args.golden}: {MANIFEST} not found; write it with glm-dsa golden --out DIR")
    given = [f for f, (dest, *_) in _OPTION_FLAGS.items() if getattr(args, dest) is not None]
    given = (["--convention"] if args.convention is not None else []) + given
    if args.verify:
        for flag, value, default in (("--device", args.device, "cpu"), ("--timeout", args.timeout, None)):
            if value != default:
                raise ValueError(f"{flag} does not go with --verify: the oracle runs on the CPU")
        if given:
            raise ValueError(f"{given[0]} does not go with --verify: it checks every convention's cases")
    _check_common(args)
    inputs: dict[str, Any] = {"--golden": args.golden, "--candidate": args.candidate}
    if args.kernel is not None:
        inputs.update(_kernel_file(args.kernel))
    _check_junit(args, inputs)
    if args.verify:
        report = verify_golden(args.golden, None if args.contract is None else (args.contract,))
    elif args.candidate is not None:
        from safetensors.torch import load_file

        from glm_dsa.preflight import safetensors_header

        if args.contract is not None:
            raise ValueError("--contract goes with --kernel; a --candidate's tensors name their contract")
        if given:
            raise ValueError(f"{given[0]} goes with --kernel; a --candidate's tensor names carry their "
                             f"convention (flash_mla_sparse_fwd.sep2025_lonely_row.lse)")
        safetensors_header("--candidate", args.candidate)
        try:
            candidate = load_file(args.candidate)
        except Exception as e:  # safetensors raises its own error type for a malformed file
            raise ValueError(f"--candidate {args.candidate} is not a readable safetensors file: {e}") from None
        report = compare(args.golden, candidate)
    else:
        report = _compare_kernel(args)
    if args.junit_xml is not None:
        by_case: dict[str, list] = {}
        for c in report.checks:
            by_case.setdefault(c.name.rsplit(".", 1)[0], []).append(c)
        _write_junit(args.junit_xml, "glm-dsa compare", [
            (case, all(c.passed for c in checks),
             "\n".join(f"{c.name}: {c.detail}" for c in checks if not c.passed))
            for case, checks in by_case.items()])
    if args.json:
        print(json.dumps({"schema": COMPARE_SCHEMA, "golden": args.golden, **report.to_json()}, indent=2))
    else:
        print(format_report(report))
    return 0 if report.passed else 1


def _compare_kernel(args: argparse.Namespace):
    """``compare --kernel``: the kernel in its own process, its contract from ``--contract`` or
    its name, run on the golden cases of its convention."""
    from glm_dsa.testing.cases import CONTRACTS
    from glm_dsa.testing.golden import compare_kernel
    from glm_dsa.testing.isolation import KernelProcess

    with KernelProcess(args.kernel, _timeout(args)) as fn:
        _check_junit(args, {"kernel module": fn.files})
        contract = args.contract or fn.__name__
        convention = args.convention
        if contract in CONTRACTS:
            _, convention = _convention(args, contract)
            if convention.startswith("custom"):
                raise ValueError(f"the golden set holds {contract}'s named conventions only; "
                                 f"{convention} is none of them: check it with glm-dsa check")
        contracts = None if args.contract is None else (args.contract,)
        return compare_kernel(args.golden, fn, device=args.device, timeout=_timeout(args),
                              contracts=contracts, convention=convention)
