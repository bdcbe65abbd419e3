"""Layer-major prefill: every chunk of every request through one layer before the next.

Chunk-major order (``PrefillEngine.step``) runs each step through the whole stack, so every
layer's weights are resident; 744 G parameters of GLM-5.3 fit no single GPU. Layer-major order
runs the *same* steps — the engine's own schedule, pages, ragged batches and budgets, planned
once up front by the engine's scheduler — one layer at a time: the layer's weights are built
(drawn on the device, or read from the checkpoint), every step runs through it, and they are
freed before the next. Between layers it keeps the hidden rows of every token run (on the
device when the plan fits, else in pinned host memory on CUDA) and the top-k of the last full
layer for the shared layers after it. Each layer's attention reads that layer's KV pages, which
hold exactly what chunk-major order would have written there by the same step (a page freed by a
finished request and reused by a later one is reused at the same step in every layer), so the
outputs are bitwise chunk-major's (``tests/test_layer_major.py``).

``memory_plan`` is the arithmetic of the resident bytes, from the ledger's row sizes and the
exact parameter count of each layer; the CLI prints it and refuses a plan that cannot fit before
any model is built.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from glm_dsa import invariant
from glm_dsa.config import DSAConfig
from glm_dsa.layer import DecoderLayer, LayerTimes, StepContext
from glm_dsa.ledger import index_k_row_bytes, layer_cache_row_bytes, layer_kind_firsts, outer_weight_elements

if TYPE_CHECKING:
    from glm_dsa.prefill import PrefillEngine, ScheduledStep
    from glm_dsa.weights import Checkpoint, LayerTensors

__all__ = [
    "ORDERS",
    "LayerRecord",
    "LayerWeights",
    "RandomLayerWeights",
    "CheckpointLayerWeights",
    "MemoryPlan",
    "layer_weight_bytes",
    "memory_plan",
    "run_layer_major",
]

ORDERS = ("chunk", "layer")


@dataclass(frozen=True)
class LayerRecord:
    """One layer of a layer-major run: its stack index, the seconds its weights took to build
    (0 for resident weights), the seconds its steps took, and the tokens they ran."""

    layer: int
    weight_seconds: float
    seconds: float
    tokens: int


class LayerWeights(Protocol):
    """Fills one decoder layer, whose parameters were just allocated on the run's device."""

    def fill(self, layer: DecoderLayer) -> None: ...


@dataclass(frozen=True)
class RandomLayerWeights:
    """``init_weights``'s random weights of stack layer ``i`` = config layer ``first_layer + i``
    under ``seed``, drawn on the layer's device."""

    seed: int
    first_layer: int = 0

    def fill(self, layer: DecoderLayer) -> None:
        from glm_dsa.weights import init_layer_weights

        init_layer_weights(layer, self.seed, self.first_layer + layer.layer_idx)


@dataclass(frozen=True)
class ReadTimes:
    """Where ``CheckpointLayerWeights``' reader spent its time on one layer, in seconds:
    pinning the layer's host buffer (its first use only), reading the ``nbytes`` stored bytes,
    waiting for the device stage to be free (the layer before filled from it) and copying
    them on to it (0 off CUDA)."""

    nbytes: int
    pin: float
    read: float
    stage_wait: float
    stage: float

    def line(self) -> str:
        rate = self.nbytes / self.read / 1e9 if self.read > 0 else float("inf")
        return (f"read ahead: {self.nbytes / 1e9:.2f} GB in {self.read:.2f} s ({rate:.2f} GB/s), pinned "
                f"{self.pin:.2f} s, stage waited {self.stage_wait:.2f} s, copied {self.stage:.2f} s")


class CheckpointLayerWeights:
    """One layer of an opened checkpoint at a time.

    With ``read_ahead`` (default) a thread of its own reads the layers, in order, into two host
    buffers (pinned on CUDA), each allocated once, at first use, at the largest layer's
    ``read_bytes``: layer ``i``
    into buffer ``i % 2``, whose read is queued once layer ``i − 2`` has been copied out of it.
    So the disk reads without pause, up to two layers ahead, while the layers compute: a short
    layer (GLM-5.3's shared ones at 1M tokens) takes its time from a long one before it. The
    reads release the GIL (``Checkpoint.read_layer``), so the launches are not slowed. On CUDA
    the same thread then copies the layer's stored bytes into a device buffer of that size (the
    stage) on a stream of its own, once the layer before has been filled from it, so the copy
    to the GPU (10 GB a GLM-5.3 layer) overlaps the layer before's compute as well, and only
    the dequantization on the device is left between layers. Without ``read_ahead`` each tensor
    is read on its layer's turn, straight to the device, with host memory about one tensor. The
    layers' values are the same bits either way."""

    def __init__(self, checkpoint: Checkpoint, read_ahead: bool = True) -> None:
        self.checkpoint, self.read_ahead = checkpoint, read_ahead
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: dict[int, Future] = {}
        self._buffers: list[torch.Tensor | None] = []
        self._size = 0
        self._stage: torch.Tensor | None = None
        self._stream: torch.cuda.Stream | None = None
        # (layer, event after its fill's kernels): the stage is free for the next layer's bytes
        # once that event has passed; the reader waits on it, woken early by close().
        self._filled = threading.Condition()
        self._stage_free: tuple[int, torch.cuda.Event] | None = None
        self._first = 0
        self._closing = False
        self.read_times: dict[int, ReadTimes] = {}
        """By stack layer, what its read ahead took (filled by the reader thread)."""

    def fill(self, layer: DecoderLayer) -> None:
        if not self.read_ahead:
            self.checkpoint.load_layer(layer)
            return
        i, n = layer.layer_idx, self.checkpoint.config.num_hidden_layers
        device = next(layer.parameters()).device
        pin = device.type == "cuda"
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="glm-dsa read-ahead")
            self._size = max(self.checkpoint.read_bytes(j) for j in range(n))
            # Allocated by the reader on first use: pinning 10 GB takes seconds, which the second
            # buffer's allocation then spends beside the first layer's compute.
            self._buffers = [None] * min(2, n)
            if pin:
                self._stage = torch.empty(self._size, dtype=torch.uint8, device=device)
                self._stream = torch.cuda.Stream(device)
            self._first, self._closing, self._stage_free = i, False, None
        if i not in self._ahead:  # the first layer filled (a run may start anywhere)
            self._queue(i, pin)
        self._queue(i + 1, pin)
        read = self._ahead.pop(i).result()
        self.checkpoint.load_layer(layer, read)  # returns once the copies are done
        del read
        if self._stage is not None:
            free = torch.cuda.Event()
            free.record()  # after the dequantization kernels that read the stage
            with self._filled:
                self._stage_free = (i, free)
                self._filled.notify_all()
        self._queue(i + 2, pin)  # into the buffer just copied out of

    def _queue(self, i: int, pin: bool) -> None:
        if i < self.checkpoint.config.num_hidden_layers and i not in self._ahead:
            assert self._reader is not None
            self._ahead[i] = self._reader.submit(self._read, i, pin)

    def _read(self, i: int, pin: bool) -> LayerTensors:
        """Layer ``i`` read into its host buffer and, on CUDA, copied on to the stage."""
        t0 = time.perf_counter()
        host = self._buffers[i % 2]
        if host is None:
            host = self._buffers[i % 2] = torch.empty(self._size, dtype=torch.uint8, pin_memory=pin)
        t1 = time.perf_counter()
        read = self.checkpoint.read_layer(i, pin, host)
        t2 = time.perf_counter()
        used = self.checkpoint.read_bytes(i)
        if self._stage is None:
            self.read_times[i] = ReadTimes(used, t1 - t0, t2 - t1, 0.0, 0.0)
            return read
        with self._filled:
            self._filled.wait_for(lambda: self._closing or i == self._first
                                  or (self._stage_free is not None and self._stage_free[0] == i - 1))
            if self._closing:
                raise CancelledError
            free = None if i == self._first else self._stage_free
        assert self._stream is not None
        t3 = time.perf_counter()
        with torch.cuda.stream(self._stream):
            if free is not None:
                self._stream.wait_event(free[1])
            self._stage[:used].copy_(host[:used], non_blocking=True)
            staged = torch.cuda.Event()
            staged.record()
        staged.synchronize()  # the host buffer is free again, the stage holds the layer
        self.read_times[i] = ReadTimes(used, t1 - t0, t2 - t1, t3 - t2, time.perf_counter() - t3)
        return staged_views(read, host, self._stage)

    def close(self) -> None:
        """Drop the layers read ahead, end the reader thread and free its buffers."""
        with self._filled:
            self._closing = True
            self._filled.notify_all()
        for future in self._ahead.values():
            future.cancel()
        self._ahead = {}
        if self._reader is not None:
            self._reader.shutdown(wait=True)
            self._reader = None
        self._buffers, self._stage, self._stream, self._stage_free = [], None, None, None


def staged_views(read: LayerTensors, host: torch.Tensor, stage: torch.Tensor) -> LayerTensors:
    """``read`` (views of the uint8 buffer ``host``) as views of ``stage``, a buffer holding a copy
    of ``host``'s bytes: each tensor at its offset in ``host``, with its dtype and shape."""
    base, size = host.data_ptr(), host.numel()

    def moved(t: torch.Tensor) -> torch.Tensor:
        offset, nbytes = t.data_ptr() - base, t.numel() * t.element_size()
        if not (0 <= offset and offset + nbytes <= min(size, stage.numel()) and t.is_contiguous()):
            raise ValueError(f"staged_views: a tensor of {nbytes} bytes at offset {offset} is not a "
                             f"contiguous view of the {size}-byte buffer the stage copies")
        return stage[offset:offset + nbytes].view(t.dtype).view(t.shape)

    return replace(read, tensors={n: moved(t) for n, t in read.tensors.items()},
                   scales={n: moved(t) for n, t in read.scales.items()})


# ------------------------------------------------------------------ the memory plan
def layer_weight_bytes(config: DSAConfig, layer: int, dtype: torch.dtype) -> int:
    """Bytes of stack layer ``layer``'s parameters in ``dtype`` (the router bias stays float32),
    counted on the meta device: exact, nothing allocated."""
    with torch.device("meta"):
        module = DecoderLayer(config, layer).to(dtype)
    return sum(p.numel() * p.element_size() for p in module.parameters())


# The host memory one decoder layer's modules and parameters take on the meta device (about 20
# modules and 20 parameters; the same count for GLM-5.3's layers, whose experts are grouped
# tensors). Measured: 62 KB a layer over 3,000 layers of `tiny`, 2026-12-03. A stack of 10^6
# layers would take 62 GB of host memory before its first layer ran.
LAYER_MODULE_BYTES = 64 << 10


@dataclass(frozen=True)
class MemoryPlan:
    """The bytes a layer-major run keeps on its device (``items``, name → bytes, in print order)
    and those it keeps on the host instead (``host_items``); ``hidden_on_device`` says where the
    hidden rows and top-k between layers live."""

    items: tuple[tuple[str, int], ...]
    host_items: tuple[tuple[str, int], ...]
    hidden_on_device: bool
    module_bytes: int = 0
    """Host memory of the model's layer modules, built on the meta device (``LAYER_MODULE_BYTES``
    each): every layer's, whatever the device."""

    @property
    def device_bytes(self) -> int:
        return sum(b for _, b in self.items)

    @property
    def host_bytes(self) -> int:
        return sum(b for _, b in self.host_items)

    def lines(self, device: torch.device) -> list[str]:
        """The plan as printed before a run: one line per item, then the totals."""
        out = [f"memory plan (layer-major, on {device}):"]
        out += [f"  {name:<52} {b:>18,} B {b / 1e9:9.2f} GB" for name, b in self.items]
        where = " (host, pinned)" if device.type == "cuda" else " (host)"
        out += [f"  {name + where:<52} {b:>18,} B {b / 1e9:9.2f} GB" for name, b in self.host_items]
        out.append(f"  {'layer modules on the meta device (host)':<52} {self.module_bytes:>18,} B "
                   f"{self.module_bytes / 1e9:9.2f} GB")
        out.append(f"  {'total on the device':<52} {self.device_bytes:>18,} B {self.device_bytes / 1e9:9.2f} GB"
                   + (f"; {self.host_bytes / 1e9:.2f} GB on the host" if self.host_items else ""))
        return out


def memory_plan(
    config: DSAConfig,
    lengths: Sequence[int],
    chunk: int,
    kv_dtype: str,
    dtype: torch.dtype,
    transient_bytes: int,
    available: int | None,
    read_ahead_bytes: int = 0,
    staged: bool = False,
) -> MemoryPlan:
    """The resident bytes of a layer-major run of prompts of ``lengths`` tokens.

    Device: the main KV of every layer and the index K of every full layer (every page of every
    prompt at once, ``pages_for``), the embedding, final norm and head, the largest layer's
    weights plus one float32 copy of its largest tensor (its random draw or dequantisation), one
    chunk's activations (the step's input, residual, output and normed rows, and its top-k), and
    ``transient_bytes`` (the largest of the step's logits, attention and MoE budgets, which never
    coexist). The hidden rows of every token (``dtype``) and, when the stack has shared layers,
    the last full layer's int32 top-k of every token go on the device when ``available`` (None:
    unknown) holds them too, else on the host. ``read_ahead_bytes``: the largest layer's
    ``Checkpoint.read_bytes``, the size of each of the two host buffers (pinned on CUDA) a
    checkpoint is read ahead into; 0 for random weights. ``staged``: the run is on CUDA, where
    ``CheckpointLayerWeights`` also keeps a device buffer of that size (the next layer's stored
    bytes, copied while this layer computes).
    """
    c = config
    tokens = sum(lengths)
    pages = sum(-(-n // c.page_size) for n in lengths)
    row_main = layer_cache_row_bytes(c, False, kv_dtype)
    item = dtype.itemsize
    # One layer of each kind (full/shared x dense/MoE) is counted; the largest is resident.
    kinds = layer_kind_firsts(c)
    layer_bytes = max(layer_weight_bytes(c, i, dtype) for i in kinds.values())
    with torch.device("meta"):
        largest = max(t.numel() for i in kinds.values() for t in DecoderLayer(c, i).state_dict().values())
    outer = outer_weight_elements(c) * item
    rows = min(chunk, max(lengths))
    items = [
        (f"main KV, {c.num_hidden_layers} layers ({kv_dtype})", pages * c.page_size * c.num_hidden_layers * row_main),
        (f"index K, {len(c.full_layers)} full layers", pages * c.page_size * len(c.full_layers) * index_k_row_bytes(c)),
        ("embedding, final norm, head", outer),
        ("one layer's weights (+ float32 draw of a tensor)", layer_bytes + 4 * largest),
        ("one chunk's activations and top-k", rows * (4 * c.hidden_size * item + 2 * c.index_topk * 4)),
        ("transients (logits / attention / MoE budget)", transient_bytes),
    ]
    if staged and read_ahead_bytes:
        items.append(("a checkpoint's next layer, staged", read_ahead_bytes))
    between = [(f"hidden rows of {tokens:,} tokens", tokens * c.hidden_size * item)]
    if len(c.full_layers) < c.num_hidden_layers:
        between.append((f"top-k of the last full layer, {tokens:,} tokens", tokens * c.index_topk * 4))
    modules = c.num_hidden_layers * LAYER_MODULE_BYTES
    # CheckpointLayerWeights' buffers: the layer being copied out and the next being read
    ahead = [("a checkpoint's layers, two read ahead", 2 * read_ahead_bytes)] if read_ahead_bytes else []
    fits = available is None or sum(b for _, b in items + between) <= available
    if fits:
        return MemoryPlan(tuple(items + between), tuple(ahead), True, modules)
    return MemoryPlan(tuple(items), tuple(between + ahead), False, modules)


# ------------------------------------------------------------------ the run
class _Store:
    """Rows kept between layers, one tensor per step: on the run's device, or in pinned host
    memory (plain memory off CUDA) copied to the device for each step."""

    def __init__(self, device: torch.device, on_device: bool) -> None:
        self.device, self.on_device = device, on_device or device.type != "cuda"
        self.rows: list[torch.Tensor] = []

    def put(self, s: int, t: torch.Tensor) -> None:
        """Keep ``t`` as step ``s``'s rows (replacing what was there; on the host into the step's
        pinned buffer, allocated once)."""
        if not self.on_device:
            if s < len(self.rows) and self.rows[s].shape == t.shape and self.rows[s].dtype == t.dtype:
                self.rows[s].copy_(t)
                return
            t = torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t)
        if s == len(self.rows):
            self.rows.append(t)
        else:
            self.rows[s] = t

    def get(self, s: int) -> torch.Tensor:
        t = self.rows[s]
        return t if self.on_device else t.to(self.device, non_blocking=True)


def _plan(engine: PrefillEngine) -> list[ScheduledStep]:
    """Every step of the queued requests, scheduled in chunk-major order by the engine itself:
    each step's progress and its finished requests (their pages freed, their prefixes cached)
    are applied before the next is scheduled, exactly as ``step`` does after running it."""
    steps = []
    while (scheduled := engine._schedule()) is not None:
        engine._advance(scheduled)
        engine._retire(scheduled)
        steps.append(scheduled)
    return steps


def run_layer_major(
    engine: PrefillEngine,
    weights: LayerWeights | None,
    hidden_on_device: bool = True,
    progress: Callable[[LayerRecord], None] | None = None,
) -> None:
    """Run the engine's queued requests in layer-major order (see the module docstring).

    Args:
        engine: a one-rank engine with its requests added; its timeline gets one record per step
            (seconds and components summed over the layers) and its requests their hidden rows
            and logits, as ``PrefillEngine.run`` would give them.
        weights: fills each layer just before it runs; the layer is returned to the meta device
            afterwards. None: the layers are resident and stay so.
        hidden_on_device: keep the rows between layers on the device (else pinned host memory).
        progress: told each layer's ``LayerRecord`` when it is done.
    """
    steps = _plan(engine)
    if not steps:
        return
    device, model = engine.device, engine.model
    hidden, topk = _Store(device, hidden_on_device), _Store(device, hidden_on_device)
    times = [LayerTimes() if engine.timing else None for _ in steps]
    seconds = [0.0] * len(steps)
    observers = [engine._observer_for(s) for s in steps]
    tokens = sum(s.batch.num_tokens for s in steps)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda device=None: None)
    try:
        with torch.no_grad(), invariant.batch_invariant(engine.batch_invariant):
            for layer in model.model.layers:
                assert isinstance(layer, DecoderLayer)  # the stack holds nothing else
                t0 = time.perf_counter()
                if weights is not None:
                    layer.to_empty(device=device)
                    weights.fill(layer)
                    sync(device)
                t1 = time.perf_counter()
                for s, scheduled in enumerate(steps):
                    t = time.perf_counter()
                    if layer.layer_idx == 0:
                        x = model.model.input_rows(scheduled.inputs)
                        steps[s] = replace(scheduled, inputs=scheduled.inputs[:0])  # its rows live in `hidden` now
                    else:
                        x = hidden.get(s)
                    ctx = StepContext(scheduled.batch, engine.cache, engine.budgets, engine.backend,
                                      times=times[s], observer=observers[s])
                    out, k = layer(x, ctx, None if layer.is_full else topk.get(s))
                    hidden.put(s, out)
                    if layer.is_full:
                        assert k is not None  # a full layer's indexer gave it
                        topk.put(s, k)
                    sync(device)
                    seconds[s] += time.perf_counter() - t
                t2 = time.perf_counter()
                if weights is not None:
                    layer.to_empty(device="meta")
                record = LayerRecord(layer.layer_idx, t1 - t0, t2 - t1, tokens)
                engine.layer_timeline.append(record)
                if progress is not None:
                    progress(record)
            for s, scheduled in enumerate(steps):
                engine._keep(scheduled, hidden.get(s) if hidden.on_device else hidden.rows[s])
                engine._timeline_record(scheduled, times[s] or LayerTimes(), seconds[s], cuda_graph=False)
    finally:
        close = getattr(weights, "close", None)  # a reader thread of its own (CheckpointLayerWeights)
        if close is not None:
            close()
