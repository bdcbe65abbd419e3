"""``glm-dsa check MODULE:FUNCTION --contract NAME``: check a kernel from the shell.

Prints one line per output (worst metric value, bound, PASS/FAIL) and, on a failure, the first
failure; exit status 0 (pass) or 1 (fail). Usage errors (unknown contract or shapes, a kernel
that cannot be imported) are ValueErrors, which ``glm-dsa`` prints as one line with status 2.
"""

from __future__ import annotations

import argparse
import importlib

__all__ = ["add_parser", "run", "load_kernel"]


def load_kernel(path: str):
    """The callable ``MODULE:FUNCTION`` (dotted module path, then an attribute path)."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"kernel {path!r} must be MODULE:FUNCTION, e.g. glm_dsa.oracle:act_quant")
    try:
        obj = importlib.import_module(module_name)
    except Exception as e:  # any import-time failure of user code is a usage error
        raise ValueError(f"cannot import {module_name!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{path} is a {type(obj).__name__}, not a function")
    return obj


def add_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "check",
        help="check a kernel against the oracle on generated cases (exit status 1 on failure)",
        description="Import MODULE:FUNCTION, call it and the oracle on the contract's edge cases "
        "and seeded random cases, and compare with the contract's metric.",
    )
    p.add_argument("kernel", metavar="MODULE:FUNCTION", help="the kernel, e.g. mypkg.kernels:fp8_mqa_logits")
    p.add_argument("--contract", required=True, metavar="NAME",
                   help="the glm_dsa.oracle function the kernel implements, e.g. fp8_mqa_logits")
    p.add_argument("--device", default="cpu", help="device of the kernel's inputs (default cpu)")
    p.add_argument("--cases", type=int, default=50, metavar="N",
                   help="cases in all, edge cases included (default 50)")
    p.add_argument("--shapes", default="small", metavar="NAME",
                   help="size table: small (CPU) or glm-5.3 (GPU) (default small)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the random cases")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from glm_dsa.testing.cases import CONTRACTS, SHAPES
    from glm_dsa.testing.check import run_checks

    if args.contract not in CONTRACTS:
        raise ValueError(f"unknown contract {args.contract!r}; one of: {', '.join(CONTRACTS)}")
    if args.shapes not in SHAPES:
        raise ValueError(f"unknown shapes {args.shapes!r}; one of: {', '.join(SHAPES)}")
    fn = load_kernel(args.kernel)
    report = run_checks(args.contract, fn, cases=args.cases, seed=args.seed, device=args.device,
                        shapes=args.shapes)
    for line in report.lines():
        print(line)
    if report.skipped:
        print(f"skipped {len(report.skipped)} cases: {', '.join(report.skipped)}")
    if report.failure is not None:
        print(f"FAIL: {report.failure}")
        return 1
    print(f"PASS: {args.kernel} matches {args.contract} on {report.cases_run} cases")
    return 0
