"""The ``glm-dsa`` command: a thin shell over the package's functions.

    glm-dsa ledger --config glm-5.3 --tokens 1048576 --chunk 32768 [--json]
    glm-dsa prefill --config tiny --tokens 1024 --chunk 256 --requests 2
    glm-dsa golden --out golden [--seed 0]
    glm-dsa compare --golden golden --candidate my_kernel.safetensors
    glm-dsa fidelity --config small --tokens 2048 --rows 64
    python -m glm_dsa ledger ...            (same, without installing)
    glm-dsa --version

One ``_add_<command>`` function per subcommand registers its arguments and handler.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import resource
import signal
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from glm_dsa.backend import ATTENTION_PRECISIONS, BACKENDS, Backend, get_backend
from glm_dsa import __version__
from glm_dsa.batch import COMM_OPS, CP_SPLITS
from glm_dsa.cache import KV_DTYPES
from glm_dsa.config import DSAConfig, get_config
from glm_dsa.kv_format import MLA_KV_FORMATS, mla_kv_unsupported
from glm_dsa.layer_major import ORDERS
from glm_dsa.ledger import GpuSpec, build_ledger
from glm_dsa.ledger_text import format_ledger
from glm_dsa.outputs import Terminated, raise_terminated
from glm_dsa.report import table
from glm_dsa.testing import cli as testing_cli

if TYPE_CHECKING:
    from glm_dsa.weights import Checkpoint

__all__ = ["build_parser", "main"]

_GPU = GpuSpec()


def _check_chunk(chunk: int, page_size: int) -> None:
    """ledger and prefill take the same chunks: whole pages (the engine's rule)."""
    if chunk < page_size or chunk % page_size:
        near = max(page_size, chunk // page_size * page_size)
        raise ValueError(f"--chunk {chunk} must be a positive multiple of page_size={page_size}, "
                         f"e.g. --chunk {near}")


def _check_kv_format(kv_dtype: str, config: DSAConfig) -> None:
    """ledger and prefill take the same KV formats for a config: those its cache can hold."""
    why = mla_kv_unsupported(config.kv_lora_rank, kv_dtype)
    if why is not None:
        raise ValueError(f"--kv-dtype {kv_dtype} does not apply to this config: {why}; use --kv-dtype bf16")


def _run_ledger(args: argparse.Namespace) -> int:
    config = get_config(args.config)
    for flag, value, low in (("--tokens", args.tokens, 1), ("--chunk", args.chunk, 1), ("--prefix", args.prefix, 0),
                             ("--gpus", args.gpus, 1)):
        if value < low:
            raise ValueError(f"{flag} {value} must be ≥ {low}")
    if args.prefix >= args.tokens:
        raise ValueError(f"--prefix {args.prefix} must be < --tokens {args.tokens}: at least one new token")
    _check_chunk(args.chunk, config.page_size)
    _check_kv_format(args.kv_dtype, config)
    for flag in ("gpu_mem_gb", "hbm_tbps", "indexer_tflops", "backbone_tflops", "nvlink_gbps"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} {getattr(args, flag)} must be > 0")
    if not 0.0 <= args.mem_fraction_static <= 1.0:
        raise ValueError(f"--mem-fraction-static {args.mem_fraction_static} must lie in [0, 1]")
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
        config,
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
    p.add_argument("--kv-dtype", choices=MLA_KV_FORMATS, default="fp8", help="main KV cache format (default fp8)")
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


def _model_and_input_flags() -> argparse.ArgumentParser:
    """The flags ``prefill`` and ``fidelity`` share (the model, its inputs, where and how it runs),
    as a parent parser; ``_resolve`` reads them."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--config", required=True, help="preset name or a Hugging Face config.json / directory")
    p.add_argument("--weights", metavar="DIR",
                   help="Hugging Face checkpoint directory: config.json and model.safetensors, or shards named by "
                        "model.safetensors.index.json (bf16 or FP8 with 128x128 weight_scale_inv); only the "
                        "tensors of --layers and the embedding, final norm and head are read. Random weights if absent")
    p.add_argument("--layers", metavar="SPEC",
                   help="keep only these layers of the config: a count N (the first N) or a range a:b of "
                        "layer indices, e.g. 6:7 = GLM-5.3's first full MoE layer (default: all); outputs name "
                        "layers by the config's numbering")
    p.add_argument("--tokens", type=int, help="prompt length of each request, in tokens")
    p.add_argument("--input-ids", help="safetensors file with request.{i}.input_ids to run instead of random tokens")
    p.add_argument("--input-hidden", metavar="FILE.safetensors",
                   help="start from hidden states instead of tokens: request.{i}.hidden [L, hidden_size] is the input "
                        "of the first kept layer (e.g. request.{i}.layer.{a-1}.hidden of a --save-layer-outputs run)")
    p.add_argument("--text", metavar="FILE",
                   help="prefill this UTF-8 text as one request, tokenized with the tokenizer.json of the checkpoint "
                        "directory (needs the 'text' extra: pip install 'glm-dsa[text]')")
    p.add_argument("--seed", type=int, default=0, help="seed for random weights and token ids")
    p.add_argument("--chunk", type=int, default=32768, help="chunked_prefill_size: tokens per step (default 32768)")
    p.add_argument("--kv-dtype", default="fp8", choices=KV_DTYPES, help="main KV cache format")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float64"],
                   help="weights/activations dtype (default float32 on CPU, bfloat16 on CUDA)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    p.add_argument("--backend", choices=BACKENDS, default="auto",
                   help="indexer top-k and sparse attention: the reference, the Triton kernels, or the "
                        "DeepGEMM/FlashMLA peers (default auto: triton on CUDA when Triton imports, "
                        "else reference)")
    p.add_argument("--budget-bytes", type=int,
                   help="indexer logits, attention row-chunk and MoE row-block budgets in bytes "
                        "(default: SGLang's rule on CUDA, docs/conventions.md §12, the MoE's capped at 3 GiB; "
                        "256 MiB on CPU)")
    p.add_argument("--mem-fraction-static", type=float, default=0.8, help="for the CUDA logits budget rule")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    return p


def _add_prefill(sub) -> None:
    p = sub.add_parser(
        "prefill",
        parents=[_model_and_input_flags()],
        help="run a chunked prefill (the main job)",
        description="Run requests through the layer stack in page-aligned chunks over paged caches, "
        "print the per-step timeline and the cache usage.",
    )
    p.add_argument("--requests", type=int, default=1, help="number of requests (default 1)")
    p.add_argument("--prefix", type=int, default=0,
                   help="the requests share their first P tokens, cached beforehand by a warm-up request; "
                        "each request then hits floor(P/64)*64 tokens of prefix cache")
    p.add_argument("--batch-invariant", action="store_true",
                   help="bitwise the same outputs for a request whatever the chunk size, the requests "
                        "sharing its steps, the budgets and graph replay (always so on the triton backend; "
                        "the reference backend runs 1.4-15x slower with it; README, Chunked prefill)")
    p.add_argument("--attention-precision", choices=ATTENTION_PRECISIONS, default="bf16",
                   help="sparse attention's products: bf16 (default), or fp8: SGLang's Q8KV8 form on the triton "
                        "backend, e4m3 query and context with one scale each per step (not batch-invariant, no "
                        "CUDA graphs; the top-k is unchanged)")
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay steps of up to 16,384 tokens from CUDA graphs captured per padded token bucket "
                        "(default: on with the triton backend on CUDA, one rank, no --save-layer-outputs; "
                        "such steps print no per-component split)")
    p.add_argument("--save-outputs", metavar="FILE.safetensors",
                   help="write request.{i}.input_ids, request.{i}.hidden (every position, last layer before the "
                        "final norm) and request.{i}.logits (float32 [vocab], the last position only)")
    p.add_argument("--save-layer-outputs", nargs="?", const="all", default=None, metavar="LAYERS",
                   help="with --save-outputs, also write request.{i}.layer.{l}.hidden (float32 [L, hidden], kept layer "
                        "l's output) and request.{i}.layer.{l}.topk (int32 [L, index_topk], each full layer's "
                        "request-relative top-k, -1 padded) of every kept layer, or of LAYERS only (config numbering: "
                        "comma-separated indices and a:b ranges, e.g. 6,40:42); one rank only")
    p.add_argument("--order", choices=ORDERS, default=None,
                   help="chunk: each step through the whole stack; layer: every step through one layer before the "
                        "next, one layer's weights resident at a time (same bits; prints a memory plan first). "
                        "Default: chunk, or layer when the whole model does not fit the device but one layer does")
    p.add_argument("--plot", metavar="FILE.png", help="draw the per-step cost curve (needs the 'plot' extra)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--cp", type=int,
                   help="context-parallel ranks: spawned here (gloo on CPU, NCCL with rank r on cuda:r); "
                        "under torchrun the group torchrun made is joined (default: 1, or torchrun's world size)")
    p.add_argument("--cp-split", choices=CP_SPLITS, default="interleave",
                   help="how a chunk's tokens are dealt to the ranks (default interleave: token i to rank i %% cp)")
    p.add_argument("--cp-timeout", type=float, default=60.0, metavar="SECONDS",
                   help="end the run when a rank spawned by --cp shows no sign of life (stopped, or stuck in a "
                        "call holding the GIL) for this long (default 60; a slow rank keeps beating)")
    p.set_defaults(func=_cmd_prefill)


def _progress_bar(total_tokens: int, enabled: bool, every_s: float = 10.0):
    """A tqdm bar on a terminal; otherwise a plain line at most every ``every_s`` seconds and at
    the end (a redirected stderr gets no carriage-return frames)."""
    if not enabled:
        return lambda record: None, lambda: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=total_tokens, unit="tok", unit_scale=True, file=sys.stderr, desc="prefill")

        def update(record) -> None:
            bar.update(sum(end - start for _, start, end in record.chunks))
            bar.set_postfix(step=record.step, s=f"{record.seconds:.3f}")

        return update, bar.close
    done = [0]
    last = [time.monotonic()]

    def update_line(record) -> None:
        done[0] += sum(end - start for _, start, end in record.chunks)
        now = time.monotonic()
        if now - last[0] >= every_s or done[0] >= total_tokens:
            last[0] = now
            print(f"prefill: step {record.step}, {done[0]}/{total_tokens} tokens, {record.seconds:.3f} s",
                  file=sys.stderr, flush=True)

    return update_line, lambda: None


def _layer_progress_bar(num_layers: int, first_layer: int, enabled: bool, layer_weights=None):
    """Layer-major progress: a tqdm bar over the layers (its ETA from the layers done) on a
    terminal; otherwise one line per layer with the ETA from the mean layer so far, and where
    the layers are read ahead from a checkpoint, what the layer's read took."""
    if not enabled:
        return lambda record: None, lambda: None
    if sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=num_layers, unit="layer", file=sys.stderr, desc="prefill (layer-major)")

        def update(record) -> None:
            bar.update(1)
            bar.set_postfix(layer=first_layer + record.layer, s=f"{record.weight_seconds + record.seconds:.2f}")

        return update, bar.close
    spent = [0.0]

    def update_line(record) -> None:
        spent[0] += record.weight_seconds + record.seconds
        done = record.layer + 1
        eta = spent[0] / done * (num_layers - done)
        read = getattr(layer_weights, "read_times", {}).get(record.layer)
        print(f"prefill: layer {first_layer + record.layer} ({done}/{num_layers}), weights {record.weight_seconds:.2f} s, "
              f"{record.tokens} tokens {record.seconds:.2f} s, ETA {eta:.0f} s" + (f"; {read.line()}" if read else ""),
              file=sys.stderr, flush=True)

    return update_line, lambda: None


def _layer_set(spec: str, first_layer: int, num_layers: int) -> frozenset[int] | bool:
    """``--save-layer-outputs LAYERS`` as stack indices (``True``: every layer): comma-separated
    config layer indices and ``a:b`` ranges, each within the kept layers."""
    if spec == "all":
        return True
    kept = range(first_layer, first_layer + num_layers)
    chosen: set[int] = set()
    for part in spec.split(","):
        try:
            a, _, b = part.strip().partition(":")
            span = range(int(a), int(b)) if b else range(int(a), int(a) + 1)
        except ValueError:
            raise ValueError(f"--save-layer-outputs {spec}: {part!r} is neither a layer index nor a range a:b "
                             "(e.g. 6,40:42)") from None
        if not span or span.start not in kept or span.stop - 1 not in kept:
            raise ValueError(f"--save-layer-outputs {spec}: {part.strip()} is outside the kept layers "
                             f"{kept.start}:{kept.stop} (config numbering)")
        chosen.update(i - first_layer for i in span)
    return frozenset(chosen)


def _cmd_prefill(args) -> int:
    """One rank, ``--cp N`` ranks spawned here, or this rank of a torchrun group."""
    import torch.multiprocessing as mp

    from glm_dsa.cp import RankStalled, check_launch, launch, launched_by_torchrun, leave_group

    from glm_dsa.preflight import check_device

    if args.cp is not None and args.cp < 1:
        raise ValueError(f"--cp {args.cp} must be ≥ 1")
    if not (math.isfinite(args.cp_timeout) and args.cp_timeout > 0):
        raise ValueError(f"--cp-timeout {args.cp_timeout:g} must be a positive number of seconds")
    device = check_device("--device", args.device)
    if launched_by_torchrun():
        try:
            return _run_prefill(args)
        finally:
            leave_group()
    if (args.cp or 1) == 1:
        return _run_prefill(args)
    check_launch(args.cp, device, f"--cp {args.cp}")
    inputs = _preflight_prefill(args, _resolve(args, device), ranks_on_host=args.cp if device.type == "cpu" else 1)
    try:
        launch(_run_prefill, args.cp, args.device, (args, inputs), timeout_s=args.cp_timeout)
    except RankStalled as e:
        raise RuntimeError(f"{e}; --cp-timeout SECONDS sets the limit") from None
    except mp.ProcessRaisedException as e:
        # the child's traceback as text; its last line is the exception
        last = [line for line in str(e).splitlines() if line.strip()][-1]
        raise RuntimeError(f"rank {e.error_index} of {args.cp} failed: {last}") from None
    except mp.ProcessExitedException as e:
        raise RuntimeError(f"rank {e.error_index} of {args.cp} exited with status {e.exit_code}") from None
    return 0


@dataclass(frozen=True)
class _Resolved:
    """What ``prefill`` and ``fidelity`` share, resolved once from their common flags
    (``_resolve``): the device; the activation ``dtype``; the ``backend``, checked for the dtype,
    the KV format and batch invariance; the model ``config``, cut to ``--layers``, whose layer
    ``i`` is the full config's layer ``first_layer + i``; and the ``checkpoint`` of ``--weights``,
    opened (its headers checked) once, or None for random weights."""

    device: torch.device
    dtype: torch.dtype
    backend: Backend
    config: DSAConfig
    first_layer: int
    checkpoint: Checkpoint | None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def _resolve(args, device: torch.device) -> _Resolved:
    """``_Resolved`` from the common flags, for models on ``device``; a ValueError naming the
    flag otherwise."""
    from glm_dsa.config import keep_layers, parse_layers
    from glm_dsa.weights import open_checkpoint

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    backend = get_backend(args.backend, device, dtype, args.kv_dtype, args.batch_invariant,
                          args.attention_precision)
    if args.weights:
        if not os.path.isdir(args.weights):
            raise ValueError(f"--weights {args.weights} is not a directory (config.json + model.safetensors)")
        if not os.path.isfile(os.path.join(args.weights, "config.json")):
            raise ValueError(f"--weights {args.weights} has no config.json")
    config = get_config(args.weights or args.config)
    if args.weights and args.config != args.weights:
        _check_same_model(args.config, args.weights, config)
    checkpoint = open_checkpoint(args.weights, layers=args.layers) if args.weights else None
    first_layer = 0
    if args.layers is not None:
        first_layer = parse_layers(args.layers, config.num_hidden_layers).start
        config = keep_layers(config, args.layers)
    return _Resolved(device, dtype, backend, config, first_layer, checkpoint)


def _check_same_model(config_flag: str, weights: str, config: DSAConfig) -> None:
    """``--config`` describes the model of ``--weights`` (whose ``config`` is given). A config's
    name is where it was read from, so only the model's fields are compared."""
    import dataclasses

    given = get_config(config_flag)
    differ = [f.name for f in dataclasses.fields(config) if f.name != "name"
              and getattr(given, f.name) != getattr(config, f.name)]
    if differ:
        raise ValueError(f"--config {config_flag} differs from {weights}/config.json in {', '.join(differ)}; "
                         "pass the checkpoint directory as --config or leave them consistent")


def _load_model(args, run: _Resolved, quiet: bool = False):
    """The checkpoint of ``--weights`` (its one-line note of what is read and skipped on stderr
    unless ``quiet``), or seeded random weights, cut to ``--layers``; parameters are allocated
    on the run's device directly, in its dtype."""
    from glm_dsa.weights import build_model, init_weights

    if run.checkpoint is not None:
        if not quiet:
            print(run.checkpoint.note, file=sys.stderr)
        model = run.checkpoint.load(run.dtype, run.device)
    else:
        model = init_weights(build_model(run.config, run.dtype, run.device), args.seed, run.first_layer)
    return model.eval()


def _load_outer_model(args, run: _Resolved):
    """For layer-major order: the model with its embedding, final norm and head filled (from
    ``--weights`` or seeded random weights) and its layers on the meta device, and the
    ``LayerWeights`` that fills each layer on its turn."""
    from glm_dsa.layer_major import CheckpointLayerWeights, RandomLayerWeights
    from glm_dsa.weights import build_outer_model, init_outer_weights

    if run.checkpoint is not None:
        print(run.checkpoint.note, file=sys.stderr)
        return run.checkpoint.load_outer(run.dtype, run.device).eval(), CheckpointLayerWeights(run.checkpoint)
    model = init_outer_weights(build_outer_model(run.config, run.dtype, run.device), args.seed)
    return model.eval(), RandomLayerWeights(args.seed, run.first_layer)


def _numbered_requests(flag: str, path: str, suffix: str) -> list[tuple[str, dict]]:
    """``(name, header entry)`` of ``request.{i}.{suffix}`` for i = 0..n-1 in an input file,
    from its header; other numberings are refused, other tensors ignored."""
    from glm_dsa.preflight import safetensors_header

    header = safetensors_header(flag, path)
    names = [k for k in header if re.fullmatch(rf"request\.[^.]+\.{suffix}", k)]
    if not names:
        raise ValueError(f"{flag} {path} holds no request.{{i}}.{suffix} tensors")
    want = [f"request.{i}.{suffix}" for i in range(len(names))]
    if sorted(names) != sorted(want):
        raise ValueError(f"{flag} {path}: requests must be numbered request.0 .. request.{len(names) - 1}, "
                         f"found {', '.join(sorted(names))}")
    return [(name, header[name]) for name in want]


def _input_id_lengths(path: str) -> list[int]:
    """Prompt lengths of an ``--input-ids`` file, from its header: ``request.{i}.input_ids`` for
    i = 0..n-1, each 1-D, non-empty and of an integer dtype."""
    lengths = []
    for name, info in _numbered_requests("--input-ids", path, "input_ids"):
        dtype, shape = info["dtype"], info["shape"]
        if dtype not in ("I64", "I32", "I16", "I8", "U8", "U16", "U32", "U64"):
            raise ValueError(f"--input-ids {path}: {name} has dtype {dtype}; token ids must be integers")
        if len(shape) != 1 or shape[0] < 1:
            raise ValueError(f"--input-ids {path}: {name} has shape {shape}; expected [L] with L ≥ 1")
        lengths.append(shape[0])
    return lengths


def _input_hidden_lengths(path: str, hidden_size: int) -> list[int]:
    """Prompt lengths of an ``--input-hidden`` file, from its header: ``request.{i}.hidden`` for
    i = 0..n-1, each ``[L ≥ 1, hidden_size]`` and floating point."""
    lengths = []
    for name, info in _numbered_requests("--input-hidden", path, "hidden"):
        dtype, shape = info["dtype"], info["shape"]
        if dtype not in ("F64", "F32", "BF16", "F16"):
            raise ValueError(f"--input-hidden {path}: {name} has dtype {dtype}; hidden states must be F32, BF16, "
                             "F16 or F64")
        if len(shape) != 2 or shape[0] < 1 or shape[1] != hidden_size:
            raise ValueError(f"--input-hidden {path}: {name} has shape {shape}; expected [L, {hidden_size}] "
                             "(L ≥ 1, the model's hidden_size)")
        lengths.append(shape[0])
    return lengths


def _text_ids(args, vocab_size: int) -> list[int]:
    """``--text`` tokenized with the checkpoint directory's ``tokenizer.json``."""
    from glm_dsa.preflight import check_optional_module

    dirs = [d for d in (args.weights, args.config) if d and os.path.isdir(d)]
    found = [os.path.join(d, "tokenizer.json") for d in dirs if os.path.isfile(os.path.join(d, "tokenizer.json"))]
    if not found:
        raise ValueError("--text needs a tokenizer.json in the checkpoint directory (--weights DIR or --config DIR)")
    check_optional_module("--text", "tokenizers", "text")
    from tokenizers import Tokenizer

    try:
        with open(args.text, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        raise ValueError(f"--text {args.text} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {args.text} is not a readable UTF-8 text file ({e})") from None
    try:
        ids = Tokenizer.from_file(found[0]).encode(text).ids
    except Exception as e:  # tokenizers raises its own exception type for a malformed file
        raise ValueError(f"--text: {found[0]} is not a tokenizers tokenizer.json ({e})") from None
    if not ids:
        raise ValueError(f"--text {args.text} tokenizes to no tokens; give a non-empty prompt")
    if max(ids) >= vocab_size:
        raise ValueError(f"--text: {found[0]} gives token id {max(ids)}, outside the model's vocab_size={vocab_size}; "
                         "use the checkpoint's own tokenizer")
    return ids


def _preflight_prefill(args, run: _Resolved, ranks_on_host: int = 1) -> _Prompts:
    """Every prefill input beyond the common flags (``run``), before a model is built: the
    input files by their headers, the lengths, the outputs and the memory, then the prompts
    themselves, read once and checked by value (``_prompts``), which it returns. The memory
    check counts ``ranks_on_host`` copies of the run's peak (every CP rank holds the whole
    model and caches)."""
    from glm_dsa.cp import launched_by_torchrun
    from glm_dsa.preflight import (
        available_bytes,
        check_fits,
        check_optional_module,
        host_baseline_bytes,
        resident_bytes,
    )
    from glm_dsa.ledger import param_counts

    device, config = run.device, run.config
    if args.order == "layer" and ((args.cp or 1) > 1 or launched_by_torchrun()):
        raise ValueError("--order layer runs on one rank; drop --cp (context parallel runs in chunk order)")
    if args.order == "layer" and args.cuda_graphs:
        raise ValueError("--cuda-graphs replays whole-stack steps; --order layer runs one layer at a time: drop one")
    if args.cuda_graphs:
        from glm_dsa.graphs import unsupported

        why = unsupported(device, run.backend, cp=(args.cp or 1) > 1 or launched_by_torchrun(),
                          observed=bool(args.save_layer_outputs),
                          batch_invariant=args.batch_invariant or run.backend.invariant_by_default,
                          dtype=run.dtype)
        if why:
            raise ValueError(f"--cuda-graphs: {why}; drop the flag")
    if args.requests < 1:
        raise ValueError(f"--requests {args.requests} must be ≥ 1")
    if args.budget_bytes is not None and args.budget_bytes < 1:
        raise ValueError(f"--budget-bytes {args.budget_bytes} must be ≥ 1")
    if not 0.0 <= args.mem_fraction_static <= 1.0:
        raise ValueError(f"--mem-fraction-static {args.mem_fraction_static} must lie in [0, 1]")
    _check_chunk(args.chunk, config.page_size)
    _check_kv_format(args.kv_dtype, config)
    given = [flag for flag, v in (("--input-ids", args.input_ids), ("--input-hidden", args.input_hidden),
                                  ("--text", args.text)) if v]
    if len(given) > 1:
        raise ValueError(f"{' and '.join(given)} are alternatives; give one")
    if given and (args.cp or 1) > 1 and given[0] == "--input-hidden":
        raise ValueError("--input-hidden runs on one rank; drop --cp")
    if args.save_layer_outputs and not args.save_outputs:
        raise ValueError("--save-layer-outputs adds to the --save-outputs file; give --save-outputs FILE.safetensors")
    if args.save_layer_outputs and (args.cp or 1) > 1:
        raise ValueError("--save-layer-outputs runs on one rank (a context-parallel rank holds a share of each "
                         "layer's rows); drop --cp")
    if args.save_layer_outputs:
        _layer_set(args.save_layer_outputs, run.first_layer, config.num_hidden_layers)
    text_ids = None  # --text is read here, once: a FIFO or a pipe (/dev/fd/N) gives its text to one read
    if given:
        flag = given[0]
        if flag == "--input-ids":
            lengths = _input_id_lengths(args.input_ids)
        elif flag == "--input-hidden":
            lengths = _input_hidden_lengths(args.input_hidden, config.hidden_size)
        else:
            text_ids = _text_ids(args, config.vocab_size)
            lengths = [len(text_ids)]
        if args.tokens is not None and any(n != args.tokens for n in lengths):
            raise ValueError(f"--tokens {args.tokens} disagrees with {flag} (lengths {lengths}); drop --tokens")
        if args.requests not in (1, len(lengths)):
            raise ValueError(f"--requests {args.requests} disagrees with {flag} ({len(lengths)} requests); "
                             "drop --requests")
        if args.prefix:
            raise ValueError(f"--prefix does not apply to {flag} (the prompts are run as given)")
    else:
        if args.tokens is None or args.tokens < 1:
            raise ValueError("--tokens N (≥ 1) is required unless --input-ids, --input-hidden or --text is given")
        if not 0 <= args.prefix < args.tokens:
            raise ValueError(f"--prefix {args.prefix} must lie in [0, --tokens {args.tokens})")
        lengths = [args.tokens] * args.requests + ([args.prefix] if args.prefix else [])
    _check_positions(given[0] if given else "--tokens", args, config, lengths)
    _check_prefill_outputs(args)
    if args.plot:
        check_optional_module("--plot", "matplotlib", "plot")
    dtype_bytes = run.dtype.itemsize
    need = _estimated_peak_bytes(args, run, lengths)
    lower = "lower --tokens / --requests / --chunk or use a smaller --config"
    weights = param_counts(config)["total"] * dtype_bytes
    have = available_bytes(device)
    if have is not None and weights > have:  # no token count fits: say what does need the memory
        # one layer of the heaviest kind (full indexer, MoE FFN): GLM-5.3's 6:7
        heaviest = next((i for i in range(config.num_hidden_layers) if config.is_full(i) and config.is_moe(i)), 0)
        fewer = "" if args.layers else f"keep fewer layers (--layers {heaviest}:{heaviest + 1}), "
        lower = (f"the weights alone take {weights / 1e9:.1f} GB at {dtype_bytes} bytes per "
                 f"parameter: {fewer}use a smaller --config or --dtype bfloat16")
    # The part of the estimate this process holds already: its own memory, at most the estimate's
    # share for it (a process that held more before, as a test run does, frees no room for the run).
    held = min(resident_bytes(), host_baseline_bytes()) if device.type == "cpu" and ranks_on_host == 1 else 0
    if ranks_on_host > 1:  # each rank a process of its own: this one's memory is not theirs
        need *= ranks_on_host
        lower = f"{ranks_on_host} ranks each hold the model and caches: lower --cp, " + lower[len("lower "):]
    lower = lower if args.kv_dtype == "fp8" else lower + " or --kv-dtype fp8"
    _choose_order(args, run, lengths, need, have, lower, held)
    return _prompts(args, config, text_ids)


def _estimated_peak_bytes(args, run: _Resolved, lengths: list[int]) -> int:
    """The pre-flight estimate of one rank's peak memory (an upper bound): on CUDA the bytes the
    run allocates on the device (``ledger.prefill_peak_bytes``), on the host those and the
    process's own (``preflight.host_baseline_bytes``). ``lengths``: every request's tokens, the
    shared prefix's warm-up request included."""
    from glm_dsa.ledger import prefill_peak_bytes
    from glm_dsa.preflight import host_baseline_bytes

    device = run.device
    # On CUDA the default budgets follow free memory, so they are what is left, not a demand.
    budgets = _budgets(args, device) if args.budget_bytes or device.type == "cpu" else None
    inputs = [path for path in (args.input_ids, args.input_hidden) if path]
    need = prefill_peak_bytes(
        run.config, lengths, args.chunk, args.kv_dtype, run.dtype.itemsize,
        budgets.logits_bytes if budgets else 0,
        attention_bytes=budgets.attention_bytes if budgets else 0,
        moe_bytes=budgets.moe_bytes if budgets else 0,
        prefix=args.prefix if not inputs and not args.text else 0,
        save_outputs=bool(args.save_outputs), layer_outputs=bool(args.save_layer_outputs),
        input_bytes=sum(os.path.getsize(p) for p in inputs))
    return need + (host_baseline_bytes() if device.type == "cpu" else 0)


def _choose_order(args, run: _Resolved, lengths: list[int], chunk_need: int, have: int | None, lower: str,
                  held: int = 0) -> None:
    """Settle ``args.order`` (None: chunk when its estimate ``chunk_need`` fits, else, on CUDA,
    layer when the layer-major plan does, saying so in one line; on the host the refusal names
    ``--order layer`` when its plan fits) and, for layer order, print its memory plan
    on stderr, before any model is built; a run neither order fits is refused in one line (the
    chunk-major hint ``lower`` when no order was asked for). ``held``: the part of
    ``chunk_need`` this process holds already (``preflight.check_fits``)."""
    from glm_dsa.preflight import check_fits

    args.hidden_on_device = True
    if args.order == "chunk" or (args.order is None and (have is None or chunk_need <= have + held)):
        args.order = "chunk"
        check_fits(chunk_need, run.device, lower, held)
        return
    from glm_dsa.preflight import available_bytes, host_baseline_bytes

    plan = _layer_plan(args, run, lengths, have)
    on_cpu = run.device.type == "cpu"
    host = have if on_cpu else available_bytes(torch.device("cpu"))
    # on the host: the layer modules (meta), what the plan keeps there (rows, a checkpoint's
    # layers read ahead) and, on the CPU, everything else with the process itself (as in the
    # chunk-major estimate)
    host_need = plan.module_bytes + plan.host_bytes + (plan.device_bytes + host_baseline_bytes() if on_cpu else 0)
    host_fits = host is None or host_need <= host + held
    fits = host_fits and (on_cpu or have is None or plan.device_bytes <= have)
    if args.order is None:
        # On the host layer order is the user's choice, never made for them: a layer-major run
        # builds every layer's modules before its first (64 KiB each), so a deep stack that a
        # large host holds (10^6 layers: 64 GB) would be built for most of an hour before it ran.
        if on_cpu or not fits or (args.cp or 1) > 1:
            hint = (f", or run one layer at a time: --order layer ({host_need / 1e9:.1f} GB by its memory plan)"
                    if on_cpu and fits and (args.cp or 1) == 1 else "")
            check_fits(chunk_need, run.device, lower + hint, held)  # refuses: the chunk-major estimate did not fit
        assert have is not None  # chunk_need > have brought us here
        print(f"prefill: the whole model ({chunk_need / 1e9:.1f} GB with its caches) does not fit on {run.device} "
              f"({have / 1e9:.1f} GB free), one layer at a time does "
              f"({plan.device_bytes / 1e9:.1f} GB): running in layer-major order (--order layer)", file=sys.stderr)
        args.order = "layer"
    for line in plan.lines(run.device):
        print(line, file=sys.stderr)
    if not on_cpu and have is not None and plan.device_bytes > have:
        raise ValueError(f"--order layer needs {plan.device_bytes / 1e9:.1f} GB on {run.device} by its memory plan, "
                         f"{have / 1e9:.1f} GB free; lower --tokens / --requests / --chunk, "
                         "use --kv-dtype fp8 or --dtype bfloat16")
    if not host_fits:
        assert host is not None
        raise ValueError(f"--order layer needs {host_need / 1e9:.1f} GB of host memory by its memory plan "
                         f"({plan.module_bytes / 1e9:.1f} GB of it the {run.config.num_hidden_layers:,} layers' "
                         f"modules), {(host + held) / 1e9:.1f} GB available; lower --tokens / --requests, "
                         "or keep fewer layers (--layers)")
    args.hidden_on_device = plan.hidden_on_device


def _layer_plan(args, run: _Resolved, lengths: list[int], have: int | None):
    """The layer-major ``MemoryPlan`` of the run (transients: its budgets, the largest of which
    a step holds at once)."""
    from glm_dsa.layer_major import memory_plan

    budgets = _budgets(args, run.device)
    transient = max(budgets.logits_bytes, budgets.attention_bytes, budgets.moe_bytes)
    ahead = 0
    if run.checkpoint is not None:  # CheckpointLayerWeights' two buffers, each of the largest layer
        ahead = max(run.checkpoint.read_bytes(i) for i in range(run.config.num_hidden_layers))
    return memory_plan(run.config, lengths, args.chunk, args.kv_dtype, run.dtype, transient, have, ahead,
                       staged=run.device.type == "cuda")


def _check_positions(flag: str, args, config, lengths: list[int]) -> None:
    """Every prompt of ``flag`` within the config's ``max_position_embeddings`` (as
    ``add_request`` requires)."""
    longest = config.max_position_embeddings
    fix = "or use a config whose config.json has a larger max_position_embeddings"
    for i, n in enumerate(lengths):
        if n <= longest:
            continue
        past = f"past max_position_embeddings={longest} of config {config.name}"
        if flag == "--tokens":
            raise ValueError(f"--tokens {n} runs {past}; lower --tokens {fix}")
        what = {"--input-ids": f"request.{i}.input_ids has", "--input-hidden": f"request.{i}.hidden has",
                "--text": "tokenizes to"}[flag]
        path = getattr(args, flag[2:].replace("-", "_"))
        raise ValueError(f"{flag} {path}: {what} {n} tokens, {past}; shorten it {fix}")


def _check_prefill_outputs(args) -> None:
    """``--save-outputs`` and ``--plot`` against the run's inputs and each other."""
    from glm_dsa.outputs import check_output_paths

    inputs = {"--input-ids": args.input_ids, "--input-hidden": args.input_hidden, "--text": args.text,
              "--weights": args.weights, "--config": args.config if os.path.exists(args.config) else None}
    check_output_paths({"--save-outputs": args.save_outputs, "--plot": args.plot}, inputs)


_Prompts = tuple[list[torch.Tensor], torch.Tensor | None]
"""``(prompts, shared prefix)``: int64 token ids ``[L]`` or float hidden states ``[L, hidden]`` per
request, and the token ids of the prefix they share (random prompts only)."""


def _prompts(args, config: DSAConfig, text_ids: list[int] | None = None) -> _Prompts:
    """The ``--input-ids`` file's requests, the ``--input-hidden`` file's, the ``--text`` prompt
    (``text_ids`` when it was read already; no prefix for these), or ``--requests`` random prompts
    of ``--tokens`` sharing their first ``--prefix`` tokens. A value the model cannot take (a
    hidden state NaN or inf, a token id outside the vocabulary) is refused here, before any model
    is built; the files' headers were checked by ``_preflight_prefill``."""
    from safetensors.torch import load_file

    if args.input_hidden:
        stored = load_file(args.input_hidden)
        prompts = [stored[f"request.{i}.hidden"] for i in range(len(stored)) if f"request.{i}.hidden" in stored]
        for i, p in enumerate(prompts):
            if not bool(torch.isfinite(p).all()):
                raise ValueError(f"--input-hidden {args.input_hidden}: request.{i}.hidden holds NaN or inf")
        return prompts, None
    if args.text:
        ids = text_ids if text_ids is not None else _text_ids(args, config.vocab_size)
        return [torch.tensor(ids, dtype=torch.int64)], None
    if args.input_ids:
        stored = load_file(args.input_ids)
        prompts = [stored[f"request.{i}.input_ids"].to(torch.int64) for i in range(len(stored))
                   if f"request.{i}.input_ids" in stored]
        for i, p in enumerate(prompts):
            outside = ((p < 0) | (p >= config.vocab_size)).nonzero()
            if outside.numel():
                at = int(outside[0, 0])
                raise ValueError(f"--input-ids {args.input_ids}: request.{i}.input_ids holds token id {int(p[at])} "
                                 f"(position {at}), outside [0, vocab_size={config.vocab_size}); use ids of this "
                                 "model's tokenizer")
        return prompts, None
    gen = torch.Generator().manual_seed(args.seed)
    prefix_ids = torch.randint(0, config.vocab_size, (args.prefix,), generator=gen)
    prompts = [
        torch.cat([prefix_ids, torch.randint(0, config.vocab_size, (args.tokens - args.prefix,), generator=gen)])
        for _ in range(args.requests)
    ]
    return prompts, prefix_ids


PREFILL_SCHEMA = "glm-dsa.prefill/1"


def _budgets(args, device: torch.device):
    """The step budgets of ``--budget-bytes`` and ``--mem-fraction-static`` on ``device``
    (``Budgets.default``: on CUDA from the memory free now, so taken once the weights are in)."""
    from glm_dsa.budget import Budgets

    return Budgets.default(device, args.budget_bytes, args.mem_fraction_static)


def _run_prefill(args, inputs: _Prompts | None = None) -> int:
    """One rank's prefill. ``inputs``: the prompts ``_preflight_prefill`` read in the process
    that spawned this rank; None to check and read them here (one rank, or a torchrun rank)."""
    from safetensors.torch import save_file

    from glm_dsa.cp import CPGroup, init_from_env, launched_by_torchrun
    from glm_dsa.outputs import write_file
    from glm_dsa.prefill import PrefillEngine

    device = torch.device(args.device)
    cp_group = None
    if launched_by_torchrun():
        device = init_from_env(device)
        cp_group = CPGroup(args.cp_split)
        if args.cp not in (None, cp_group.size):
            raise ValueError(f"--cp {args.cp} but torchrun started {cp_group.size} ranks")
    quiet = cp_group is not None and cp_group.rank != 0  # only rank 0 reports
    run = _resolve(args, device)  # before the weights are drawn
    if inputs is None:
        if cp_group is None or cp_group.rank == 0:
            on_host = cp_group.size if cp_group is not None and device.type == "cpu" else 1
            inputs = _preflight_prefill(args, run, ranks_on_host=on_host)
        else:
            inputs = _prompts(args, run.config)
            args.order, args.hidden_on_device = args.order or "chunk", True
    cuda = device.type == "cuda"
    lengths = [p.shape[0] for p in inputs[0]] + ([] if inputs[1] is None else [inputs[1].numel()])
    if args.order == "layer":  # its own plan: one layer's weights, not the whole model's
        from glm_dsa.preflight import available_bytes, host_baseline_bytes

        plan = _layer_plan(args, run, lengths, available_bytes(device))
        estimate = plan.device_bytes + plan.host_bytes + (host_baseline_bytes() if device.type == "cpu" else 0)
    else:
        estimate = _estimated_peak_bytes(args, run, lengths)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    layer_weights = None
    if args.order == "layer":
        model, layer_weights = _load_outer_model(args, run)
    else:
        model = _load_model(args, run, quiet)
    # meta parameters count too: a layer-major run builds every layer, one at a time
    memory = {"weight_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
              "weights_peak_bytes": torch.cuda.max_memory_allocated(device) if cuda else None,
              "estimate_peak_bytes": estimate}
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    config = model.config
    prompts, prefix_ids = inputs
    shared = [] if prefix_ids is None else [prefix_ids.numel()]
    engine = PrefillEngine.for_prompts(
        model, [p.shape[0] for p in prompts] + shared, kv_dtype=args.kv_dtype,
        chunked_prefill_size=args.chunk,
        budget_bytes=_budgets(args, device), timing=True, cp_group=cp_group, backend=run.backend,
        attention_precision=args.attention_precision,
        layer_outputs=(_layer_set(args.save_layer_outputs, run.first_layer, config.num_hidden_layers)
                       if args.save_layer_outputs else False),
        batch_invariant=args.batch_invariant or None, cuda_graphs=args.cuda_graphs,
        order=args.order, layer_weights=layer_weights, hidden_on_device=args.hidden_on_device)
    warm = engine.warm_up(prefix_ids) if prefix_ids is not None else None
    rids = [engine.add_request(p) if p.dtype == torch.int64 else engine.add_request(None, input_hidden=p)
            for p in prompts]
    progress = not (args.no_progress or args.json or quiet)
    if args.order == "layer":
        update, close = _layer_progress_bar(config.num_hidden_layers, run.first_layer, progress, layer_weights)
        engine.run(layer_progress=update)
    else:
        update, close = _progress_bar(engine.tokens_to_run(), progress)
        engine.run(update)
    close()
    memory["prefill_peak_bytes"] = torch.cuda.max_memory_allocated(device) if cuda else None
    # the process's peak resident memory so far (Linux reports ru_maxrss in KiB)
    memory["host_peak_rss_bytes"] = None if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    weights = args.weights or f"random, seed {args.seed}"
    report = {"schema": PREFILL_SCHEMA, "config": config.name, "weights": weights, "device": str(device),
              "dtype": run.dtype_name, "kv_dtype": args.kv_dtype, "backend": run.backend.name,
              "attention_precision": args.attention_precision, "chunk": args.chunk,
              "order": args.order, "memory": memory,
              **engine.report(rids)}
    for layer in report.get("layers", []):  # the config's numbering, as the outputs name layers
        layer["layer"] += run.first_layer
    if quiet:
        return 0
    if args.save_outputs:
        outputs = _config_layer_names(engine.outputs(rids), run.first_layer)
        write_file(args.save_outputs, lambda tmp: save_file(outputs, tmp))
    if args.plot:
        lengths = [r["tokens"] for r in report["requests"]]
        tokens = f"{len(lengths)} x {lengths[0]}" if len(set(lengths)) == 1 else "+".join(map(str, lengths))
        _plot_steps(engine.timeline, args.plot,
                    f"prefill cost per step: {config.name}, {tokens} tokens, chunk {args.chunk}")
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"prefill: config {config.name}, {len(rids)} request(s) of "
          f"{', '.join(str(r['tokens']) for r in report['requests'])} tokens, chunk {args.chunk}"
          + (f"; prefix cache warmed with {args.prefix} tokens" if warm is not None else ""))
    print(f"weights {weights}; dtype {run.dtype_name}; KV {args.kv_dtype}; backend {run.backend.name} on {device}"
          + ("; attention in FP8 (Q8KV8)" if args.attention_precision == "fp8" else ""))
    print(f"memory: weights {memory['weight_bytes'] / 1e9:.2f} GB"
          + (" (one layer resident at a time)" if args.order == "layer" else "") + (
        f"; peak {memory['weights_peak_bytes'] / 1e9:.2f} GB while building them, "
        f"{memory['prefill_peak_bytes'] / 1e9:.2f} GB during the prefill" if cuda else
        f"; peak RSS {memory['host_peak_rss_bytes'] / 1e9:.2f} GB") +
        f" ({'memory plan' if args.order == 'layer' else 'pre-flight estimate'} {estimate / 1e9:.2f} GB)")
    print(_format_prefill_report(report))
    return 0


def _config_layer_names(outputs: dict, start: int) -> dict:
    """``request.{i}.layer.{l}.*`` renamed from the kept stack's numbering to the config's (``l +
    start``, ``a`` under ``--layers a:b``), so a file names layers as the checkpoint does."""

    def rename(name: str) -> str:
        m = re.fullmatch(r"(request\.\d+\.layer\.)(\d+)(\..+)", name)
        return name if m is None else f"{m.group(1)}{int(m.group(2)) + start}{m.group(3)}"

    return {rename(k): v for k, v in outputs.items()}


def _format_prefill_report(report: dict) -> str:
    """The timeline, cache-usage and (under CP) per-rank tables of a prefill report."""
    timeline = table(
        "timeline (seconds per component, summed over layers)",
        ["step", "tokens (request:start-end)", "prefix at start", "indexer s", "attention s",
         "moe s", "projections s", "total s"],
        [[str(s["step"]), " ".join(f"{c['request']}:{c['start']}-{c['end'] - 1}" for c in s["chunks"]),
          " ".join(str(p) for p in s["prefix_at_start"]),
          *(("—" if s.get("cuda_graph") else f"{s[k]:.4f}") for k in
            ("indexer_s", "attention_s", "moe_s", "projections_s")), f"{s['seconds']:.4f}"]
         for s in report["steps"]],
    )
    usage = report["cache"]
    blocks = [timeline]
    if report.get("layers"):
        blocks.append(table(
            "layers (layer-major order: every step through one layer before the next)",
            ["layer", "kind", "weights s", "steps s"],
            [[str(r["layer"]), r["kind"], f"{r['weight_seconds']:.3f}", f"{r['seconds']:.3f}"] for r in report["layers"]],
        ))
    blocks += [table("cache usage", ["cache", "value"], [
        ["pages (total / peak in use)", f"{usage['pages_total']} / {usage['pages_peak']}"],
        ["main KV page bytes", f"{usage['page_bytes_main_kv']:,}"],
        ["index-K page bytes", f"{usage['page_bytes_index_k']:,}"],
        ["main KV pool bytes (all layers)", f"{usage['pool_bytes_main_kv']:,}"],
        ["index-K pool bytes (full layers)", f"{usage['pool_bytes_index_k']:,}"],
        ["main KV bytes written", f"{usage['bytes_written_main_kv']:,}"],
        ["index-K bytes written", f"{usage['bytes_written_index_k']:,}"],
    ])]
    if report.get("cuda_graphs", {}).get("graphs"):
        g = report["cuda_graphs"]
        blocks.append(table(
            f"CUDA graphs (steps marked — in the timeline replayed them; {g['replays']} replays, "
            f"pool {g['pool_bytes'] / 1e6:.1f} MB)",
            ["tokens", "context rows", "capture s", "pool MB"],
            [[str(b["tokens"]), str(b["context"]),
              f"{b['capture_seconds']:.3f}", f"{b['pool_bytes'] / 1e6:.1f}"] for b in g["graphs"]],
        ))
    if "context_parallel" in report:
        cp = report["context_parallel"]
        blocks.append(table(
            f"context parallel: {cp['cp']} ranks, {cp['split']} split (bytes: whole chunks gathered / "
            "this rank's padded share)",
            ["rank", "indexer pairs", "index-K gathered", "latent gathered", "hidden gathered", "bytes sent"],
            [[str(r["rank"]), f"{r['indexer_pairs']:,}",
              *(f"{r['comm'][op]['bytes']:,}" for op in COMM_OPS),
              f"{sum(r['comm'][op]['local_bytes'] for op in COMM_OPS):,}"]
             for r in cp["ranks"]],
        ))
    return "\n\n".join(blocks)


def _plot_steps(timeline, path: str, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ValueError("--plot needs matplotlib: pip install 'glm-dsa[plot]'") from exc
    steps = [s.step for s in timeline]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(steps)
    for name in ("indexer", "attention", "moe", "projections"):
        vals = [getattr(s, name) for s in timeline]
        ax.bar(steps, vals, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.plot(steps, [s.seconds for s in timeline], "k.-", label="step total")
    ax.set_xticks(steps)
    ax.set_xlabel("step (chunk)")
    ax.set_ylabel("seconds")
    ax.set_title(title)
    # Outside the axes, so the legend never covers a bar.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    fig.tight_layout()
    from glm_dsa.outputs import write_file

    write_file(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))


def _cmd_golden(args) -> int:
    from glm_dsa.outputs import check_output_dir
    from glm_dsa.testing.cases import check_seed
    from glm_dsa.testing.golden import write_golden

    check_seed(args.seed, "--seed")
    check_output_dir("--out", args.out)
    manifest = write_golden(args.out, seed=args.seed)
    cases: dict[str, int] = {}
    for case in manifest["cases"]:
        cases[case["contract"]] = cases.get(case["contract"], 0) + 1
    rows = [[name, str(cases[info["contract"]]), f"{info['bytes']:,}"]
            for name, info in manifest["files"].items()]
    total = sum(info["bytes"] for info in manifest["files"].values())
    print(table(f"golden vectors, seed {args.seed}, in {args.out}", ["file", "cases", "bytes"], rows))
    print(f"{len(manifest['cases'])} cases, {total:,} bytes; metrics and tolerances in "
          f"{args.out}/manifest.json")
    return 0


def _add_golden(sub) -> None:
    p = sub.add_parser(
        "golden",
        help="write golden vectors (inputs + expected outputs) of every kernel contract",
        description="Write one safetensors file per glm_dsa.oracle contract (the case table of "
        "glm_dsa.testing: every edge case and a random case, at GLM-5.3 and DeepSeek-V3.2 head "
        "counts) and manifest.json giving each call as data and each output's metric and "
        "tolerance. Same seed, same bytes.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if absent)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.set_defaults(func=_cmd_golden)


def _cmd_fidelity(args) -> int:
    from glm_dsa.fidelity import format_fidelity, plot_fidelity, selection_fidelity
    from glm_dsa.preflight import check_device

    if args.rows < 1:
        raise ValueError(f"--rows {args.rows} must be ≥ 1")
    device = check_device("--device", args.device)
    run = _resolve(args, device)
    prompts, _ = _preflight_prefill(args, run)
    if not 0 <= args.request < len(prompts):
        raise ValueError(f"--request {args.request} must lie in [0, {len(prompts)}): the prompts of the input file")
    model = _load_model(args, run)
    measured = selection_fidelity(model, prompts[args.request], rows=args.rows, seed=args.seed,
                                  chunked_prefill_size=args.chunk, kv_dtype=args.kv_dtype, backend=run.backend,
                                  budget_bytes=_budgets(args, device))
    for layer in measured["layers"]:  # the config's numbering, as prefill's outputs name layers
        layer["layer"] += run.first_layer
        layer["topk_from"] += run.first_layer
    report = {"weights": args.weights or f"random, seed {args.seed}", "random_weights": not args.weights,
              **measured}
    if args.plot:
        from glm_dsa.outputs import write_file

        write_file(args.plot, lambda tmp: plot_fidelity(report, tmp))
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"fidelity: config {report['config']}, 1 prompt of {report['tokens']} tokens, "
          f"{len(report['positions'])} sampled rows (seed {args.seed}), top-{report['index_topk']}, "
          f"chunk {args.chunk}")
    print(f"weights {report['weights']}; dtype {report['dtype']}; KV {args.kv_dtype}; "
          f"backend {report['backend']} on {device}; prefill {report['seconds']['prefill']:.1f} s, "
          f"measurement {report['seconds']['measurement']:.1f} s")
    print(format_fidelity(report))
    return 0


def _add_fidelity(sub) -> None:
    p = sub.add_parser(
        "fidelity",
        parents=[_model_and_input_flags()],
        help="how much attention the FP8 indexer and the shared-layer top-k reuse keep",
        description="Prefill one prompt and, on sampled query rows of every kept layer, measure the "
        "indexer's recall against unquantized scoring, the share of the dense attention mass on the "
        "selected keys beside the best possible share, and the sparse output's calc_diff against "
        "dense attention (docs/fidelity.md). Model and inputs as for glm-dsa prefill.",
    )
    p.add_argument("--request", type=int, default=0,
                   help="which prompt of --input-ids / --input-hidden to measure (default 0)")
    p.add_argument("--rows", type=int, default=256,
                   help="query rows to sample, one per equal stretch of positions (default 256)")
    p.add_argument("--plot", metavar="FILE.png", help="draw mass kept against position (needs the 'plot' extra)")
    # _preflight_prefill reads these prefill flags: one request, no shared prefix, no saved outputs.
    p.set_defaults(func=_cmd_fidelity, requests=1, prefix=0, save_outputs=None, save_layer_outputs=None, cp=None,
                   order="chunk", attention_precision="bf16",
                   batch_invariant=False, cuda_graphs=None)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="glm-dsa",
        description="Reference GLM-5.3 DSA layer: cost ledger and tools.",
    )
    parser.add_argument("--version", action="version", version=f"glm-dsa {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_ledger(subparsers)
    _add_prefill(subparsers)
    _add_golden(subparsers)
    testing_cli.add_compare_parser(subparsers)
    _add_fidelity(subparsers)
    testing_cli.add_parser(subparsers)
    for sub in subparsers.choices.values():
        sub.add_argument("--debug", action="store_true", help="show the traceback of an error")
    return parser


@contextlib.contextmanager
def _signals_unwind(command: str):
    """While a command runs: SIGTERM unwinds like Ctrl-C does, and a library warning prints as
    one line ``glm-dsa <command>: warning: …``. Both are restored afterwards (``main`` may be
    called from Python)."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, raise_terminated) if in_main_thread else None
    show = warnings.showwarning
    warnings.showwarning = lambda message, *rest, **kw: print(f"glm-dsa {command}: warning: {message}",
                                                              file=sys.stderr)
    try:
        yield
    finally:
        warnings.showwarning = show
        if in_main_thread:
            signal.signal(signal.SIGTERM, previous)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``glm-dsa`` with ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Every error is one line ``glm-dsa <command>: error: <what and how to fix>`` on stderr (a
    config with several bad keys gives one such line per key): exit status 2 for bad input (a
    ValueError: every command checks its inputs before computing), 1 for a failure during the
    run, 130 for Ctrl-C and 143 for SIGTERM (``glm-dsa <command>: interrupted`` /
    ``terminated``, partial outputs removed), 141 without a word when the reader of stdout
    goes away (``| head``); ``--debug`` raises instead, with the traceback.
    """
    args = build_parser().parse_args(argv)
    try:
        with _signals_unwind(args.command):
            status = args.func(args)
            sys.stdout.flush()  # a reader that went away shows here, not at interpreter exit
            return status
    except BrokenPipeError:
        # The reader went away (``| head``): stop quietly, as a shell tool does on SIGPIPE, and
        # keep the interpreter's final flush from printing another BrokenPipeError.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE
    except (KeyboardInterrupt, Terminated) as e:
        if args.debug:
            raise
        terminated = isinstance(e, Terminated)
        print(f"glm-dsa {args.command}: {'terminated' if terminated else 'interrupted'}", file=sys.stderr)
        return 128 + (signal.SIGTERM if terminated else signal.SIGINT)
    except Exception as e:
        if args.debug:
            raise
        bad_input = isinstance(e, ValueError)
        what = str(e) if bad_input else f"{type(e).__name__}: {e} (rerun with --debug for the traceback)"
        for line in what.splitlines() or [""]:
            print(f"glm-dsa {args.command}: error: {line}", file=sys.stderr)
        return 2 if bad_input else 1


if __name__ == "__main__":
    sys.exit(main())
