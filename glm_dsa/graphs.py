"""CUDA-graph replay of prefill steps (``PrefillEngine(cuda_graphs=True)``, the default on CUDA
with the triton backend).

A step of ``n`` tokens over ``S_kv`` context rows runs from graphs captured for its bucket
``(token_bucket(n), token_bucket(S_kv))``: powers of two from one page up to 4,096, then
multiples of 4,096 (SGLang pads its piecewise graphs to preset token counts the same way).
Steps above ``max_tokens`` tokens or ``max_context`` context rows run eagerly: there the
launch overhead a graph removes is a small share of the step.

**One graph per bucket.** The step is a list of stages — the embedding, then per layer its
attention half (norms, projections, KV and index-K writes, indexer, sparse attention, residual;
``DecoderLayer.attention_block``) and its FFN half (``ffn_block``) — captured as one graph.
Every stage can be captured: the MoE's CUDA path keeps its expert counts and offsets on the
device (no host synchronisation). A module whose CUDA path read data on the host would have to
run eagerly between graph pieces, as vLLM keeps such parts outside its piecewise graphs.

**What makes the step capturable.** It runs in ``glm_dsa.syncfree`` mode: its data checks stay
on the device and are read once after each replay, and the indexer's row-chunk loop is planned
from sizes alone. The step's metadata lives in static buffers that every replay refills. Before
the first capture of a bucket the stages run once eagerly in the same mode on a side stream, so
that Triton compiles and autotunes (and cuBLAS sets up) outside the capture; that run is a real
run of the step (same inputs, same cache writes).

**Above ``index_topk``.** Inside a capture the indexer cannot read on the host which rows its
candidate filter must redo, so a captured step takes every row's top-k from the full logits
(``glm_dsa.kernels.indexer``) where an eager step filters candidates first. Both write the same
set (ties to the lowest columns) in ascending order, so the two agree bitwise when the logits
kernel and the candidate kernel take the same tiles (``tests/test_graphs.py`` pins one config;
on the H200 the autotuned ones agreed too); tiles autotuned apart may sum a logit's heads in
another order, and so pick another key where two tie to the last bit.

**Padding** (rows ``n … n_pad − 1`` and context rows ``S_kv … S_kv_pad − 1``): padded tokens
are token 0 (or zero hidden rows) at position 0 with an empty window ``[0, 0)``, so no real row
ever sees them and they see nothing (attention output 0); they write their KV and index K to
``scratch_slots``, pages of the pool outside the allocator, so no request's slot is touched; the
FFN's ``row_mask`` keeps them out of MoE routing. Padded context rows read a scratch slot and
lie outside every window. Real rows therefore compute what they compute unpadded, up to the
row blocking of GEMMs whose row count changed (``tests/test_graphs.py`` measures it).

**Memory.** All graphs of an engine share one memory pool: a graph's temporaries are freed at
the end of its capture and reused by the next capture, so the pool holds about one step's
temporaries for the largest bucket, plus each graph's static inputs and outputs
(``StepGraphs.report``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

from glm_dsa import syncfree
from glm_dsa.backend import Backend, graph_capturable_names
from glm_dsa.batch import ForwardBatch
from glm_dsa.budget import Budgets
from glm_dsa.cache import KVCache
from glm_dsa.layer import DSAModel, StepContext
from glm_dsa.moe import fused_grouped_mm

__all__ = ["MAX_GRAPH_TOKENS", "MAX_GRAPH_CONTEXT", "LINEAR_BUCKET",
           "token_bucket", "max_padding", "unsupported", "StepGraphs"]

# Largest step (tokens) and context (rows) run from graphs by default.
MAX_GRAPH_TOKENS = 16384
MAX_GRAPH_CONTEXT = 65536
# Buckets are powers of two up to this, then its multiples.
LINEAR_BUCKET = 4096


def token_bucket(n: int, page_size: int) -> int:
    """The padded size of ``n ≥ 1`` tokens: the next power of two ≥ ``max(n, page_size)`` up to
    ``LINEAR_BUCKET``, then the next multiple of ``LINEAR_BUCKET``."""
    if n <= LINEAR_BUCKET:
        return max(page_size, 1 << (n - 1).bit_length())
    return -(-n // LINEAR_BUCKET) * LINEAR_BUCKET


def max_padding(max_tokens: int, page_size: int) -> int:
    """The most padded tokens a step of at most ``max_tokens`` tokens gets (scratch slots)."""
    return max((token_bucket(n, page_size) - n for n in _bucket_floors(max_tokens, page_size)), default=0)


def _bucket_floors(max_tokens: int, page_size: int) -> list[int]:
    """The smallest token count of every bucket up to ``max_tokens`` (where padding is largest)."""
    floors, n = [], 1
    while n <= max_tokens:
        floors.append(n)
        n = token_bucket(n, page_size) + 1
    return floors


def unsupported(device: torch.device, backend: Backend, *, cp: bool = False,
                observed: bool = False, batch_invariant: bool = False,
                dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why steps on ``device`` with ``backend`` cannot run from CUDA graphs (one line), or None
    when they can; ``observed``: a step observer (``glm_dsa.layer.StepObserver``) watches them;
    ``batch_invariant``, ``dtype``: the mode and the activations of the steps."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, not {device.type}"
    if backend.attention_precision != "bf16":
        return (f"{backend.attention_precision} attention scales each step's context by its own amax, which "
                "a replayed graph's padded rows would change; CUDA graphs need bf16 attention")
    if not backend.graph_capturable:
        return (f"the {backend.name} backend reads values on the host during a step; CUDA graphs need "
                f"backend {' or '.join(graph_capturable_names())}")
    if cp:
        return "context parallel steps communicate between ranks; CUDA graphs run one rank"
    if observed:
        return "a step observer (layer_outputs) sees every layer's tensors, which a replayed graph does not hand out"
    if batch_invariant and not fused_grouped_mm(device, dtype):
        return (f"batch-invariant mode runs {str(dtype).removeprefix('torch.')} experts one at a time "
                "from the host (torch's fused grouped GEMM takes bf16 on sm90/sm100)")
    return None


def _run_stages(stages: list[Callable], state: tuple) -> tuple:
    for stage in stages:
        state = stage(state)
    return state


class _BucketGraph:
    """The graph of one bucket ``(tokens, context)`` and its static buffers."""

    def __init__(self, model: DSAModel, cache: KVCache, budgets: Budgets, backend: Backend,
                 scratch_slots: Tensor, tokens: int, context: int, from_ids: bool) -> None:
        dev = cache.device
        self.model, self.cache, self.tokens, self.context = model, cache, tokens, context
        self.scratch_slots = scratch_slots
        self._scratch0 = int(scratch_slots[0])  # padded context rows read this slot
        hidden = model.config.hidden_size
        dtype = model.embed_tokens.weight.dtype
        self.inputs = (torch.zeros(tokens, dtype=torch.int64, device=dev) if from_ids
                       else torch.zeros(tokens, hidden, dtype=dtype, device=dev))
        self.row_mask = torch.zeros(tokens, dtype=torch.bool, device=dev)
        # Nothing on the captured path reads prefix_lens / extend_lens (the triton backend never
        # takes the MHA form): they describe the padded step as one request of its sizes.
        self.batch = ForwardBatch(
            positions=torch.zeros(tokens, dtype=torch.int64, device=dev),
            out_slots=torch.zeros(tokens, dtype=torch.int64, device=dev),
            kv_slots=torch.zeros(context, dtype=torch.int64, device=dev),
            ks=torch.zeros(tokens, dtype=torch.int32, device=dev),
            ke=torch.zeros(tokens, dtype=torch.int32, device=dev),
            cu_seqlens_q=torch.tensor([0, tokens], device=dev),
            cu_seqlens_k=torch.tensor([0, context], device=dev),
            prefix_lens=(context - tokens,), extend_lens=(tokens,),
        )
        step = StepContext(self.batch, cache, budgets, backend, row_mask=self.row_mask)
        self.stages = self._stages(model, step, from_ids)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_out: tuple | None = None
        self.checks: syncfree.Checks | None = None
        self.verdicts: Tensor | None = None
        self.capture_seconds = 0.0
        self.pool_bytes = 0

    @staticmethod
    def _stages(model: DSAModel, step: StepContext, from_ids: bool) -> list[Callable]:
        """The step as functions of the state ``(x [tokens, hidden], topk)``."""
        stages: list[Callable] = []
        if from_ids:
            stages.append(lambda s: (model.embed_tokens(s[0]), None))
        for layer in model.layers:
            stages.append(lambda s, layer=layer: layer.attention_block(s[0], step, s[1]))
            stages.append(lambda s, layer=layer: (layer.ffn_block(s[0], step), s[1]))
        return stages

    def load(self, inputs: Tensor, batch: ForwardBatch) -> None:
        """Copy the step's inputs and metadata into the static buffers, padded."""
        n, s = batch.num_tokens, batch.kv_slots.numel()
        b = self.batch
        for buf, src in ((self.inputs, inputs), (b.positions, batch.positions), (b.ks, batch.ks),
                         (b.ke, batch.ke)):
            buf[:n].copy_(src)
            buf[n:].zero_()
        b.out_slots[:n].copy_(batch.out_slots)
        b.out_slots[n:].copy_(self.scratch_slots[: self.tokens - n])
        b.kv_slots[:s].copy_(batch.kv_slots)
        b.kv_slots[s:].fill_(self._scratch0)
        self.row_mask[:n].fill_(True)
        self.row_mask[n:].fill_(False)

    def run_eager(self) -> tuple:
        """Every stage on the loaded buffers without graphs, sync-free; the checks are raised at
        the end. Returns the final state ``(x [tokens, hidden], topk)``."""
        with syncfree.sync_free() as checks:
            state = _run_stages(self.stages, (self.inputs, None))
        checks.raise_first()
        return state

    def capture(self, pool) -> None:
        """Warm up (one eager run of the loaded step on a side stream), then capture the step."""
        t0 = time.perf_counter()
        side = torch.cuda.Stream(self.cache.device)
        side.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(side):
            self.run_eager()
        torch.cuda.current_stream(self.cache.device).wait_stream(side)
        torch.cuda.synchronize(self.cache.device)
        # Without the warm-up's cached blocks (a capture empties the cache itself), so that the
        # growth of the reserved memory is what the graph's pool took.
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(self.cache.device)
        self.graph = torch.cuda.CUDAGraph()
        with syncfree.sync_free() as checks, torch.cuda.graph(self.graph, pool=pool):
            self.static_out = _run_stages(self.stages, (self.inputs, None))
            self.verdicts = checks.verdicts()
        self.checks = checks
        torch.cuda.synchronize(self.cache.device)
        self.pool_bytes = torch.cuda.memory_reserved(self.cache.device) - reserved
        self.capture_seconds = time.perf_counter() - t0

    @property
    def captured(self) -> bool:
        return self.graph is not None

    def replay(self) -> Tensor:
        """Replay the graph on the loaded buffers; raises the first failed data check (one copy
        of the verdicts); returns the final hidden rows ``[tokens, hidden]`` (static memory)."""
        assert self.graph is not None and self.static_out is not None and self.checks is not None
        self.graph.replay()
        if self.verdicts is not None:
            self.checks.raise_first(self.verdicts)
        return self.static_out[0]


class StepGraphs:
    """The CUDA graphs of one engine's steps, by bucket, sharing one memory pool.

    Args:
        model: the layer stack (``DSAForCausalLM.model``).
        cache: the engine's pools; ``scratch_slots`` (int64, ≥ ``max_padding(max_tokens)``
            distinct slots on the cache's device) lie in pages no request is given.
        budgets, backend: the engine's.
        max_tokens, max_context: the largest step and context run from graphs.
    """

    def __init__(self, model: DSAModel, cache: KVCache, budgets: Budgets, backend: Backend,
                 scratch_slots: Tensor, max_tokens: int = MAX_GRAPH_TOKENS,
                 max_context: int = MAX_GRAPH_CONTEXT) -> None:
        page = model.config.page_size
        if scratch_slots.numel() < max(1, max_padding(max_tokens, page)):
            raise ValueError(f"{scratch_slots.numel()} scratch slots; steps of up to {max_tokens} tokens "
                             f"pad by up to {max_padding(max_tokens, page)}")
        self.model, self.cache, self.budgets, self.backend = model, cache, budgets, backend
        self.scratch_slots = scratch_slots
        self.max_tokens, self.max_context = max_tokens, max_context
        self._graphs: dict[tuple[int, int, bool], _BucketGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cache.device.type == "cuda" else None
        self.replays = 0

    def fits(self, batch: ForwardBatch) -> bool:
        """True when ``batch``'s step runs from graphs: its sizes are within the limits. (A replay
        runs no Python: a step is observed through a ``StepObserver``, which the engine runs
        eagerly, never through module hooks, which a replay would not call.)"""
        return batch.num_tokens <= self.max_tokens and batch.kv_slots.numel() <= self.max_context

    def _bucket(self, inputs: Tensor, batch: ForwardBatch) -> _BucketGraph:
        page = self.model.config.page_size
        key = (token_bucket(batch.num_tokens, page), token_bucket(batch.kv_slots.numel(), page),
               inputs.dtype == torch.int64)
        if key not in self._graphs:
            self._graphs[key] = _BucketGraph(self.model, self.cache, self.budgets, self.backend,
                                             self.scratch_slots, *key)
        return self._graphs[key]

    def run(self, inputs: Tensor, batch: ForwardBatch) -> Tensor:
        """The step's last-layer output ``[n, hidden]`` (a fresh tensor), from its bucket's graphs
        (captured on first use). ``inputs``: token ids ``[n]`` or hidden rows ``[n, hidden]``."""
        graph = self._bucket(inputs, batch)
        graph.load(inputs, batch)
        if not graph.captured:
            graph.capture(self._pool)
        out = graph.replay()[: batch.num_tokens].clone()
        self.replays += 1
        return out

    def run_eager(self, inputs: Tensor, batch: ForwardBatch) -> Tensor:
        """What ``run`` computes, without graphs: the padded step in the bucket's static buffers,
        every stage eager (capturable ones sync-free). Works on any device."""
        graph = self._bucket(inputs, batch)
        graph.load(inputs, batch)
        return graph.run_eager()[0][: batch.num_tokens].clone()

    def report(self) -> dict:
        """``graphs``: per bucket its tokens, context rows, capture seconds and the pool memory its
        capture added; ``pool_bytes``, their sum; ``replays``."""
        graphs = [{"tokens": g.tokens, "context": g.context, "from_ids": key[2],
                   "capture_seconds": g.capture_seconds, "pool_bytes": g.pool_bytes}
                  for key, g in self._graphs.items() if g.captured]
        return {"graphs": graphs, "pool_bytes": sum(g["pool_bytes"] for g in graphs), "replays": self.replays}
