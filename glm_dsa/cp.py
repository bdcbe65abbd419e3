"""Context-parallel prefill on ``torch.distributed``: each rank scores its own share of a chunk.

A prefill step (one chunk of ``n`` query tokens, possibly from several requests) is dealt to the
``cp`` ranks of a process group (docs/conventions.md §13):

* **Split.** ``"interleave"`` (SGLang's round-robin, the default) gives token ``i`` of the chunk
  to rank ``i % cp``, so every rank gets an even share of short and long causal rows;
  ``"contiguous"`` and ``"zigzag"`` are there for the load-balance comparison. Positions, ``ks``
  and ``ke`` travel with the tokens. Ranks are padded with zero rows to ``ceil(n / cp)``; a
  padded row has the empty context ``[0, 0)`` (it scores and attends to nothing) and is kept out
  of MoE routing, so it stays exactly zero through the stack.
* **Gathers.** Per layer, the chunk's latent rows ``[c | k_pe]`` and, per full layer, its index
  keys (after RoPE and Hadamard, before quantization) are all-gathered, so every rank writes the
  whole chunk into its own caches and holds the full context. Queries, logits rows, top-k and
  attention outputs stay local. After the last layer the hidden states are gathered once and
  put back in chunk order.
* **Same answer as one rank.** Every rank runs the same deterministic scheduling
  (``PrefillEngine`` with the same requests), so all ranks agree on every step's batch. Each
  token's values are computed by the same functions as on one rank; only the number of rows in
  each GEMM differs, which can change the last bit of a float32 result (see ``tests/test_cp.py``
  for what that does to FP8 / bf16 roundings and near-tied top-k choices).

The MHA one-shot form (a batch whose longest context is ≤ ``min(dense_attn_kv_len_threshold,
index_topk)``) stays on under CP. SGLang turns it off because its varlen kernel wants each
request's queries contiguous; ``dense_causal_mha`` takes any rows with their own ``[ks, ke)``.

Counters (per rank, for checks against ``glm_dsa.ledger``): ``CPGroup.comm[op]`` counts the
collectives, the bytes of the whole gathered chunk (the ledger's ``bytes_each``) and this rank's
padded share (its ``local_bytes_each``); ``CPGroup.indexer_pairs`` counts the (query, key) pairs
this rank's indexer scores, summed over full layers and steps.

Launch: ``launch(fn, nprocs, ...)`` spawns the ranks on one host (gloo on CPU, NCCL on CUDA);
under ``torchrun``, ``init_from_env()`` joins the group torchrun set up.
"""

from __future__ import annotations

import ctypes
import importlib
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor

from glm_dsa.batch import COMM_OPS, CP_BOUNDARY_GATHER, CP_SPLITS, ForwardBatch
from glm_dsa.processes import die_with_parent

_PR_SET_NAME = 15  # <linux/prctl.h>
# A rank's first heartbeat comes once it has imported torch and this module, which on a loaded
# host can take a minute; until then it is allowed this long, or the timeout if that is longer.
RANK_START_S = 120.0

if TYPE_CHECKING:
    from glm_dsa.layer import DSAModel, StepContext

__all__ = [
    "split_rows",
    "CommCount",
    "CPChunk",
    "CPGroup",
    "dist_backend_for",
    "launched_by_torchrun",
    "init_from_env",
    "usable_cores",
    "check_launch",
    "RANK_START_S",
    "RankStalled",
    "launch",
]


def split_rows(n: int, cp: int, split: str = "interleave") -> list[Tensor]:
    """The chunk-relative rows each of ``cp`` ranks runs, int64 ascending, in rank order.

    ``"interleave"``: token ``i`` on rank ``i % cp``. ``"contiguous"``: ``cp`` consecutive blocks.
    ``"zigzag"``: ``2 cp`` consecutive blocks, rank ``r`` taking blocks ``r`` and ``2 cp - 1 - r``.
    Blocks hold ``n // blocks`` tokens, the first ``n % blocks`` one more (as
    ``glm_dsa.ledger.cp_rank_positions``). Every rank holds at most ``ceil(n / cp)`` rows; with
    ``n < cp`` some hold none.
    """
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r} must be a positive number of tokens")
    if not isinstance(cp, int) or cp < 1:
        raise ValueError(f"cp={cp!r} must be a positive number of ranks")
    if split not in CP_SPLITS:
        raise ValueError(f"split={split!r}: choose one of {CP_SPLITS}")
    if split == "interleave":
        return [torch.arange(min(r, n), n, cp) for r in range(cp)]  # r ≥ n: no token
    blocks = cp if split == "contiguous" else 2 * cp
    sizes = [n // blocks + (1 if b < n % blocks else 0) for b in range(blocks)]
    starts = [sum(sizes[:b]) for b in range(blocks)]
    block = [torch.arange(starts[b], starts[b] + sizes[b]) for b in range(blocks)]
    if split == "contiguous":
        return block
    return [torch.cat([block[r], block[2 * cp - 1 - r]]) for r in range(cp)]


@dataclass
class CommCount:
    """One kind of gather, summed over a run: ``collectives`` calls, ``bytes`` of the whole
    chunks gathered (unpadded, the ledger's ``bytes_each``), ``local_bytes`` this rank sent
    (its padded share, the ledger's ``local_bytes_each``)."""

    collectives: int = 0
    bytes: int = 0
    local_bytes: int = 0


@dataclass(frozen=True)
class CPChunk:
    """One step as one rank runs it.

    Attributes:
        group: the rank's ``CPGroup`` (communication and counters).
        batch: the local ragged batch, ``L = ceil(n / cp)`` rows: this rank's tokens in chunk
            order, then padding rows (position 0, context ``[0, 0)``, ``out_slots`` -1). Its
            ``kv_slots``, ``cu_seqlens_k`` and request lengths are the whole step's.
        rows: int64 ``[m]``, the chunk-relative rows of this rank's tokens, ascending (``m ≤ L``).
        row_mask: bool ``[L]``, False on padding rows.
        out_slots: int64 ``[n]``, the whole chunk's cache slots, where the gathered rows go.
        order: int64 ``[n]``, for each chunk row its row in the gathered ``[cp * L]`` buffer.
    """

    group: CPGroup
    batch: ForwardBatch
    rows: Tensor
    row_mask: Tensor
    out_slots: Tensor
    order: Tensor

    def gather(self, local: Tensor, op: str) -> Tensor:
        """All ranks' ``local [L, ...]`` rows → the chunk's ``[n, ...]``, in chunk order."""
        return self.group.all_gather_rows(local, self.order, op)


def _local_batch(batch: ForwardBatch, rows: Tensor, padded: int) -> ForwardBatch:
    """``batch`` restricted to ``rows`` (chunk-relative, ascending), padded to ``padded`` rows."""
    dev = batch.positions.device
    rows = rows.to(dev)
    pad = padded - rows.numel()

    def take(t: Tensor, fill: int) -> Tensor:
        return torch.cat([t[rows], t.new_full((pad,), fill)])

    # Request r's local rows are those of its chunk rows [cu_q[r], cu_q[r+1]) this rank holds.
    cu_q = torch.searchsorted(rows, batch.cu_seqlens_q)
    return ForwardBatch(
        positions=take(batch.positions, 0),
        out_slots=take(batch.out_slots, -1),
        kv_slots=batch.kv_slots,
        ks=take(batch.ks, 0),
        ke=take(batch.ke, 0),
        cu_seqlens_q=cu_q,
        cu_seqlens_k=batch.cu_seqlens_k,
        prefix_lens=batch.prefix_lens,
        extend_lens=batch.extend_lens,
    )


class CPGroup:
    """This rank's view of a process group running one prefill together, with its counters.

    Args:
        split: one of ``CP_SPLITS``.
        group: a ``torch.distributed`` process group (None: the default group, which must be
            initialized).

    Attributes:
        rank, size: this rank and the number of ranks (the CP degree).
        comm: ``{op: CommCount}`` for each of ``COMM_OPS``.
        indexer_pairs: (query, key) pairs this rank's indexer scored, over full layers and steps.
    """

    def __init__(self, split: str = "interleave", group: Any = None) -> None:
        if split not in CP_SPLITS:
            raise ValueError(f"split={split!r}: choose one of {CP_SPLITS}")
        if not dist.is_initialized():
            raise ValueError(
                "torch.distributed is not initialized: launch the ranks with glm_dsa.cp.launch, "
                "torchrun (then glm_dsa.cp.init_from_env) or init_process_group"
            )
        self.split, self.group = split, group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self.reset_counters()

    def reset_counters(self) -> None:
        """Zero ``comm`` and ``indexer_pairs`` (e.g. after a warm-up run)."""
        self.comm = {op: CommCount() for op in COMM_OPS}
        self.indexer_pairs = 0

    def chunk(self, batch: ForwardBatch) -> CPChunk:
        """This rank's share of the step ``batch`` (same on every rank: no communication)."""
        n = batch.num_tokens
        per_rank = split_rows(n, self.size, self.split)
        padded = -(-n // self.size)
        order = torch.empty(n, dtype=torch.int64)
        for r, rows in enumerate(per_rank):
            order[rows] = r * padded + torch.arange(rows.numel())
        mine = per_rank[self.rank]
        dev = batch.positions.device
        return CPChunk(
            group=self,
            batch=_local_batch(batch, mine, padded),
            rows=mine.to(dev),
            row_mask=torch.arange(padded, device=dev) < mine.numel(),
            out_slots=batch.out_slots,
            order=order.to(dev),
        )

    def all_gather_rows(self, local: Tensor, order: Tensor, op: str) -> Tensor:
        """Gather every rank's ``local [L, ...]`` (same shape on all ranks) and return the rows
        ``order [n]`` of the ``[cp * L, ...]`` result; counts the traffic under ``op``."""
        if op not in self.comm:
            raise ValueError(f"op={op!r}: choose one of {COMM_OPS}")
        local = local.contiguous()
        gathered = local.new_empty((self.size * local.shape[0], *local.shape[1:]))
        dist.all_gather(list(gathered.chunk(self.size)), local, group=self.group)
        row_bytes = math.prod(local.shape[1:]) * local.element_size()
        count = self.comm[op]
        count.collectives += 1
        count.bytes += order.numel() * row_bytes
        count.local_bytes += local.shape[0] * row_bytes
        return gathered[order]

    def forward(
        self,
        model: DSAModel,
        ids: Tensor,
        step: StepContext,
    ) -> Tensor:
        """Run ``model`` on this rank's share of the step; returns the whole chunk's last-layer
        output ``[n, hidden]`` in chunk order (``DSAModel.forward`` of one rank, split).

        Args:
            ids: int64 ``[n]``, the step's token ids (the same on every rank).
            step: the step's context for one rank (the same on every rank); this rank runs it
                on its share of the rows (``StepContext.cp_chunk``).
        """
        batch = step.batch
        if ids.dtype != torch.int64 or ids.shape != (batch.num_tokens,):
            raise ValueError(
                f"ids must be int64 [{batch.num_tokens}] (one per query token of the batch), got "
                f"{ids.dtype} {tuple(ids.shape)}"
            )
        chunk = self.chunk(batch)
        x = model.embed_tokens(ids[chunk.rows])
        x = torch.cat([x, x.new_zeros(chunk.batch.num_tokens - x.shape[0], x.shape[1])])
        out = model(x, replace(step, batch=chunk.batch, row_mask=chunk.row_mask, cp_chunk=chunk))
        # What indexer_topk scores: row m against [ks[m], ke[m]); padding rows score nothing.
        full_layers = len(model.config.full_layers)
        self.indexer_pairs += full_layers * int((chunk.batch.ke - chunk.batch.ks).sum())
        return chunk.gather(out, CP_BOUNDARY_GATHER)

    def stats(self) -> list[dict[str, Any]]:
        """Every rank's counters, in rank order (a collective: every rank must call it)."""
        mine = {
            "rank": self.rank,
            "indexer_pairs": self.indexer_pairs,
            "comm": {op: vars(c).copy() for op, c in self.comm.items()},
        }
        out: list[Any] = [None] * self.size
        dist.all_gather_object(out, mine, group=self.group)
        return out


# ----------------------------------------------------------------------------- launching
def dist_backend_for(device: torch.device | str) -> str:
    """The ``torch.distributed`` backend for ``device``: ``"nccl"`` for CUDA, ``"gloo"`` otherwise."""
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def launched_by_torchrun() -> bool:
    """True when the torchrun environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``) is set."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR"))


def init_from_env(device: torch.device | str) -> torch.device:
    """Join the process group torchrun set up; returns this rank's device.

    On CUDA each rank takes ``cuda:LOCAL_RANK``; on CPU the ranks share the cores.
    """
    device = torch.device(device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # torch._dynamo, once imported, keeps references to every process group that exists
        # at that moment, so ``destroy_process_group`` no longer frees the group's gloo worker
        # threads. It is imported lazily by the first op on a meta tensor (``build_model``); a
        # worker thread that outlives the interpreter's teardown aborts the rank with SIGABRT
        # (pytorch/pytorch#190489; 7 of 40 two-rank runs here). Importing it before the group
        # exists keeps the group freeable.
        importlib.import_module("torch._dynamo")
        dist.init_process_group(dist_backend_for(device))
    return device


def leave_group() -> None:
    """Destroy the default process group, if there is one, and with it its worker threads.

    Call it before the process exits: a group left to the interpreter's teardown can abort
    the process (see ``init_from_env``).
    """
    if dist.is_initialized():
        dist.destroy_process_group()


def _free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the system has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _name_process(name: str) -> None:
    """``name`` as this process's name in ``ps`` / ``top`` (Linux, at most 15 bytes)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _beat(beats: Any, rank: int, every_s: float) -> None:
    """Count up ``beats[rank]`` now, then every ``every_s`` seconds from a thread of its own:
    the count stops when the whole process stops (SIGSTOP, a debugger, a call holding the GIL)."""
    beats[rank] += 1

    def run() -> None:
        while True:
            time.sleep(every_s)
            beats[rank] += 1

    threading.Thread(target=run, daemon=True, name="glm-dsa-heartbeat").start()


def _rank_entry(rank: int, fn: Callable[..., Any], nprocs: int, port: int, device: str,
                args: tuple, parent_pid: int, beats: Any, beat_s: float) -> None:
    die_with_parent(parent_pid)
    _beat(beats, rank, beat_s)
    _name_process(f"glm-dsa rank {rank}")
    # Ctrl-C reaches the whole process group; the parent alone handles it and ends the ranks.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(nprocs))
    if torch.device(device).type == "cpu":
        # The ranks share the host's cores; oversubscribing them only slows every rank down.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nprocs))
    init_from_env(device)
    try:
        fn(*args)
    finally:
        leave_group()


def check_launch(nprocs: int, device: torch.device | str, label: str = "", bound_by_cores: bool = True) -> None:
    """Refuse ``nprocs`` ranks the machine cannot hold: more than its GPUs on CUDA and, with
    ``bound_by_cores``, more than its usable CPU cores on CPU (each rank is a process with its
    own model and caches). ``label`` names the request in the message (default ``nprocs=N``)."""
    label = label or f"nprocs={nprocs!r}"
    if not isinstance(nprocs, int) or nprocs < 1:
        raise ValueError(f"{label} must be a positive number of ranks")
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.device_count() < nprocs:
        raise ValueError(f"{label}: {nprocs} ranks need {nprocs} CUDA devices, torch sees "
                         f"{torch.cuda.device_count()}")
    if bound_by_cores and device.type == "cpu" and nprocs > usable_cores():
        raise ValueError(f"{label}: {nprocs} ranks on {usable_cores()} usable CPU core(s), each rank a process with "
                         f"its own model and caches; use at most {usable_cores()}")


class RankStalled(RuntimeError):
    """A rank of ``launch`` showed no sign of life for ``seconds``; every rank has been ended."""

    def __init__(self, rank: int, nprocs: int, seconds: float, started: bool) -> None:
        self.rank, self.nprocs, self.seconds = rank, nprocs, seconds
        what = f"made no progress for {seconds:g} s" if started else f"did not start within {seconds:g} s"
        super().__init__(f"rank {rank} of {nprocs} {what} (stopped, or stuck in a call that holds the GIL); "
                         f"all {nprocs} ranks were ended")


def launch(fn: Callable[..., Any], nprocs: int, device: torch.device | str = "cpu",
           args: tuple = (), timeout_s: float = 60.0) -> None:
    """Run ``fn(*args)`` on ``nprocs`` new processes forming one group (gloo on CPU, NCCL on
    CUDA with rank ``r`` on ``cuda:r``), rendezvous on a free loopback port; returns when all
    are done and raises if one failed. ``fn`` must be importable (a module-level function).

    On CUDA one rank per device; on CPU more ranks than cores are admitted here (the tests run
    4 ranks on 2 cores, slowly but correctly), while ``glm-dsa prefill --cp`` refuses them with
    ``check_launch``. The ranks never outlive this process:
    they die with it (parent-death signal), and an exception here (Ctrl-C, SIGTERM under
    ``glm-dsa``) terminates them before it propagates.

    Each rank (named ``glm-dsa rank R`` in ``ps``) beats a heartbeat from a thread of its own;
    a rank whose beat stops for ``timeout_s`` seconds (``RANK_START_S`` or ``timeout_s``,
    whichever is longer, before its first beat) is stopped or frozen, and the others would wait
    for it in their next collective forever: every rank is killed and ``RankStalled`` raised.
    A rank that is only slow keeps beating.
    """
    check_launch(nprocs, device, bound_by_cores=False)
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a positive finite number of seconds")
    beat_s = min(1.0, timeout_s / 4)
    beats = mp.get_context("spawn").RawArray("Q", nprocs)
    context = mp.start_processes(
        _rank_entry, args=(fn, nprocs, _free_loopback_port(), str(device), args, os.getpid(), beats, beat_s),
        nprocs=nprocs, join=False, start_method="spawn")
    seen = [0] * nprocs
    start = time.monotonic()
    last = [start] * nprocs
    try:
        while not context.join(timeout=beat_s):
            now = time.monotonic()
            for rank in range(nprocs):
                if beats[rank] != seen[rank]:
                    seen[rank], last[rank] = beats[rank], now
                allowed = timeout_s if seen[rank] else max(timeout_s, RANK_START_S)
                if now - last[rank] > allowed and context.processes[rank].is_alive():
                    context.processes[rank].kill()  # SIGKILL: a stopped process keeps a SIGTERM pending
                    raise RankStalled(rank, nprocs, allowed, started=bool(seen[rank]))
    except BaseException:
        for process in context.processes:
            if process.is_alive():
                process.terminate()
        for process in context.processes:
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join()
        raise
