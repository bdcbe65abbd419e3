"""The ``glm-dsa`` command: a thin shell over the package's functions.

    glm-dsa ledger --config glm-5.3 --tokens 1048576 --chunk 32768 [--json]
    python -m glm_dsa.cli ledger ...        (same, without installing)

One ``_add_<command>`` function per subcommand registers its arguments and handler.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from glm_dsa.config import get_config
from glm_dsa.ledger import KV_DTYPES, GpuSpec, build_ledger, format_ledger

__all__ = ["build_parser", "main"]

_GPU = GpuSpec()


def _run_ledger(args: argparse.Namespace) -> int:
    gpu = GpuSpec(
        name=args.gpu_name,
        gpus=args.gpus,
        mem_bytes=round(args.gpu_mem_gb * 1e9),
        hbm_bytes_per_s=args.hbm_tbps * 1e12,
        indexer_flops_per_s=args.indexer_tflops * 1e12,
        backbone_flops_per_s=args.backbone_tflops * 1e12,
        nvlink_bytes_per_s=args.nvlink_gbps * 1e9,
    )
    ledger = build_ledger(
        get_config(args.config),
        tokens=args.tokens,
        chunk=args.chunk,
        prefix=args.prefix,
        cp=args.cp,
        kv_dtype=args.kv_dtype,
        mem_fraction_static=args.mem_fraction_static,
        gpu=gpu,
    )
    if args.json:
        json.dump(ledger, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_ledger(ledger))
    return 0


def _add_ledger(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ledger",
        help="FLOPs, bytes, budgets, CP balance, communication and TTFT floor of one prefill",
        description="The design article's cost accounts, computed from a config. "
        "FLOPs count 2 per multiply-add; GB = 1e9 bytes. Keys of --json: docs/ledger.md.",
    )
    p.add_argument("--config", required=True, help="preset name (glm-5.3, deepseek-v3.2, small, tiny) "
                   "or a Hugging Face config.json path")
    p.add_argument("--tokens", type=int, required=True, help="prompt length L in tokens (prefix included)")
    p.add_argument("--chunk", type=int, required=True, help="chunked-prefill size B in tokens")
    p.add_argument("--prefix", type=int, default=0, help="cached prefix P in tokens (default 0)")
    p.add_argument("--cp", type=int, default=8, help="context-parallel degree for the CP tables (default 8)")
    p.add_argument("--kv-dtype", choices=KV_DTYPES, default="fp8", help="main KV cache format (default fp8)")
    p.add_argument("--mem-fraction-static", type=float, default=0.8,
                   help="SGLang --mem-fraction-static for the logits budget (default 0.8)")
    p.add_argument("--gpu-mem-gb", type=float, default=_GPU.mem_bytes / 1e9,
                   help="memory per GPU in GB = 1e9 bytes (default 141, the article's H200)")
    p.add_argument("--gpu-name", default=_GPU.name, help="GPU name shown in the TTFT table")
    p.add_argument("--gpus", type=int, default=_GPU.gpus, help="GPUs for the TTFT floor (default 8)")
    p.add_argument("--hbm-tbps", type=float, default=_GPU.hbm_bytes_per_s / 1e12,
                   help="HBM bandwidth per GPU in TB/s (default 4.8)")
    p.add_argument("--indexer-tflops", type=float, default=_GPU.indexer_flops_per_s / 1e12,
                   help="effective indexer TFLOP/s per GPU (default 300)")
    p.add_argument("--backbone-tflops", type=float, default=_GPU.backbone_flops_per_s / 1e12,
                   help="effective backbone TFLOP/s per GPU (default 1500)")
    p.add_argument("--nvlink-gbps", type=float, default=_GPU.nvlink_bytes_per_s / 1e9,
                   help="NVLink bandwidth per GPU in GB/s (default 900; 8 GPUs = 7.2 TB/s)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    p.set_defaults(func=_run_ledger)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glm-dsa",
        description="Reference GLM-5.3 DSA layer: cost ledger and tools.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_ledger(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``glm-dsa`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    A ValueError from the library (bad sizes, unknown config) becomes a one-line message on
    stderr and exit status 2, the status argparse uses for bad arguments.
    """
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as e:
        print(f"glm-dsa {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
