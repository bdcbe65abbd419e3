"""Chunked prefill: admission, the per-step chunk planner, a prefix cache, and the driver.

The planner follows SGLang's ``PrefillAdder`` (docs/conventions.md §11): a step has a token budget
``chunked_prefill_size``; each admitted request takes ``ceil_to_page(extend_len)`` of it; a
request that does not fit is truncated so its chunk ends on a page boundary in absolute
position, and at most one request is left part-way ("chunked") at a time. Admission reserves
pages for the whole prompt plus ``max_new_tokens``; a request that cannot be reserved waits,
and one larger than the whole pool is rejected — nothing is ever overwritten.

A prefix-cache hit reuses the pages of an earlier request's identical whole-page prefix: the
hit tokens skip projections and KV writes, but the indexer still scores them (they are part of
every later query's context).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Collection, Sequence

import torch

from glm_dsa import graphs, invariant
from glm_dsa.backend import Backend, get_backend
from glm_dsa.batch import ForwardBatch
from glm_dsa.budget import Budgets
from glm_dsa.cache import KVCache, PageAllocator
from glm_dsa.kv_format import index_k_page_bytes
from glm_dsa.layer import DecoderLayer, DSAForCausalLM, LayerTimes, StepContext, StepObserver
from glm_dsa.layer_major import ORDERS, LayerRecord, LayerWeights, run_layer_major

if TYPE_CHECKING:
    from glm_dsa.cp import CPGroup

__all__ = [
    "Request",
    "ScheduledStep",
    "StepRecord",
    "PrefixCache",
    "PrefillEngine",
    "plan_step",
    "pages_for",
]

@dataclass
class ScheduledStep:
    """One step's work: ``plan``, each request's chunk ``(request, tokens)``; the requests'
    ``prefix_lens`` at the start of the step; the ragged ``batch``; and the model ``inputs``,
    token ids ``[n]`` or hidden rows ``[n, hidden]``."""

    plan: list[tuple[Request, int]]
    prefix_lens: list[int]
    batch: ForwardBatch
    inputs: torch.Tensor

    def rows(self) -> list[tuple[int, int]]:
        """``(first row, tokens)`` of each request's chunk in the step's rows."""
        return [(int(self.batch.cu_seqlens_q[i]), e) for i, (_, e) in enumerate(self.plan)]


@dataclass
class _Ran:
    """A step's last-layer output ``hidden [n, hidden]``, its per-component ``times`` (zeros
    from CUDA graphs or without timing) and whether it ran from CUDA graphs."""

    hidden: torch.Tensor
    times: LayerTimes
    cuda_graph: bool


class _LayerOutputs(StepObserver):
    """``layer_outputs``: the output rows of each kept layer (``layers``: stack indices, None for
    all; and a full layer's top-k rows) of a step appended to the step's requests, copied to the
    host when ``to_host`` (a layer-major run keeps no layer's rows on the device)."""

    def __init__(self, scheduled: ScheduledStep, layers: frozenset[int] | None, to_host: bool) -> None:
        self.requests = [r for r, _ in scheduled.plan]
        self.rows = scheduled.rows()
        self.layers, self.to_host = layers, to_host

    def layer_output(self, layer: DecoderLayer, out: torch.Tensor, topk_indices: torch.Tensor | None) -> None:
        if self.layers is not None and layer.layer_idx not in self.layers:
            return

        def keep(t: torch.Tensor) -> torch.Tensor:
            return t.detach().cpu() if self.to_host else t.detach()

        for req, (q0, e) in zip(self.requests, self.rows):
            req.layer_hidden.setdefault(layer.layer_idx, []).append(keep(out[q0 : q0 + e]))
            if layer.is_full:
                assert topk_indices is not None  # a full layer's indexer gave it
                req.layer_topk.setdefault(layer.layer_idx, []).append(keep(topk_indices[q0 : q0 + e]))


def pages_for(lengths: Sequence[int], page_size: int) -> int:
    """Pages that hold prompts of ``lengths`` tokens all at once, none shared (an upper bound
    on what an engine running them needs)."""
    return sum(-(-n // page_size) for n in lengths)


@dataclass
class Request:
    """One prompt being prefilled. ``prefix_len`` counts tokens already in the cache.

    The prompt is token ids (``input_ids``, int64 ``[L]``) or, for a run that starts at a later
    layer, that layer's input hidden states (``input_hidden``, ``[L, hidden]``, on the host;
    ``input_ids`` is then empty). ``layer_hidden[l]`` / ``layer_topk[l]`` collect each kept
    layer's output rows and each full layer's top-k rows per step when the engine keeps them.
    """

    rid: int
    input_ids: torch.Tensor
    max_new_tokens: int = 0
    pages: list[int] = field(default_factory=list)
    prefix_len: int = 0
    cached_len: int = 0
    hidden: list[torch.Tensor] = field(default_factory=list)
    logits: torch.Tensor | None = None
    input_hidden: torch.Tensor | None = None
    layer_hidden: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    layer_topk: dict[int, list[torch.Tensor]] = field(default_factory=dict)

    @property
    def length(self) -> int:
        return int(self.input_ids.numel() if self.input_hidden is None else self.input_hidden.shape[0])

    @property
    def done(self) -> bool:
        return self.prefix_len >= self.length


@dataclass(frozen=True)
class StepRecord:
    """One step of the timeline: each request's token range, and seconds per component."""

    step: int
    chunks: tuple[tuple[int, int, int], ...]  # (rid, start, end) of the tokens run this step
    prefix_at_start: tuple[int, ...]
    seconds: float
    projections: float
    indexer: float
    attention: float
    moe: float
    cuda_graph: bool = False  # replayed from CUDA graphs: no per-component split (all 0)


def _ceil_page(n: int, page: int) -> int:
    return -(-n // page) * page


def plan_step(
    requests: Sequence[Request], chunked_prefill_size: int, page_size: int
) -> list[tuple[Request, int]]:
    """The ``(request, extend_len)`` pairs of one step, in order (SGLang ``PrefillAdder``).

    ``requests`` are admitted and unfinished, the chunked one (if any) first. Each takes
    ``ceil_to_page(extend)`` of the budget; the first that does not fit is truncated to end on
    a page boundary in absolute position and closes the step.
    """
    rem = chunked_prefill_size
    plan: list[tuple[Request, int]] = []
    for req in requests:
        extend = req.length - req.prefix_len
        if _ceil_page(extend, page_size) <= rem:
            plan.append((req, extend))
            rem -= _ceil_page(extend, page_size)
            continue
        end = (req.prefix_len + rem) // page_size * page_size
        if end - req.prefix_len > 0:
            plan.append((req, end - req.prefix_len))
        break
    return plan


class PrefixCache:
    """Whole-page prefixes of finished requests, in a tree of pages (SGLang's radix cache with
    one page per edge): a page is found by its parent's node and its own token ids, so looking
    up or inserting a prefix costs its length, and a hit is exact (the ids compared, never a
    hash). Keying each page by the whole prefix before it (as this did) cost the square of the
    prompt's length: 1.2 s at 131K tokens on the H200's host, so about 75 s and 68 GB of host
    memory for one 1M-token request.

    Holds one reference on each cached page; ``flush`` gives them back to the allocator.
    """

    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator, self.page_size = allocator, page_size
        # (parent node, the page's token ids as int64 bytes) -> (node, page); node 0 is the root
        self._children: dict[tuple[int, bytes], tuple[int, int]] = {}

    def _page_ids(self, ids: torch.Tensor, n_pages: int) -> list[bytes]:
        """The token ids of ``ids``'s first ``n_pages`` whole pages, one bytes object each."""
        data = ids[: n_pages * self.page_size].to(torch.int64).cpu().numpy()
        p = self.page_size
        return [data[j * p : (j + 1) * p].tobytes() for j in range(data.size // p)]

    def match(self, ids: torch.Tensor, max_tokens: int) -> list[int]:
        """Pages holding the longest cached whole-page prefix of ``ids`` (≤ ``max_tokens``)."""
        pages: list[int] = []
        node = 0
        for page_ids in self._page_ids(ids, max(max_tokens, 0) // self.page_size):
            hit = self._children.get((node, page_ids))
            if hit is None:
                break
            node, page = hit
            pages.append(page)
        return pages

    def insert(self, ids: torch.Tensor, pages: list[int], length: int) -> None:
        """Cache the whole pages of ``ids[:length]``, held in ``pages``; a page whose prefix is
        cached already keeps the cached copy."""
        node = 0
        for j, page_ids in enumerate(self._page_ids(ids, length // self.page_size)):
            key = (node, page_ids)
            hit = self._children.get(key)
            if hit is None:
                hit = (len(self._children) + 1, pages[j])
                self._children[key] = hit
                self.allocator.retain([pages[j]])
            node = hit[0]

    def flush(self) -> None:
        self.allocator.release([page for _, page in self._children.values()])
        self._children.clear()


class PrefillEngine:
    """Runs prompts through ``model`` step by step as ragged batches over a paged cache.

    Args:
        model: the layer stack (weights in their final dtype and device).
        num_pages: pages in the pool (each ``page_size`` tokens, every layer).
        kv_dtype: main KV format, see ``glm_dsa.cache``.
        chunked_prefill_size: tokens per step, shared by the requests in the step.
        budget_bytes: the indexer-logits and attention row-chunk budgets (``glm_dsa.budget``):
            a ``Budgets``, one int for both, or None for ``Budgets.default`` on the model's
            device.
        prefix_caching: reuse whole-page prefixes of finished requests.
        compute_logits: compute each request's last-position logits with ``lm_head``.
        timing: synchronize and record per-component seconds in each ``StepRecord``.
        cp_group: context parallel (None: one rank). Every rank of the group builds the same engine
            and adds the same requests; each step then runs split over the ranks
            (``glm_dsa.cp``), and every rank ends with the same outputs and caches.
        backend: ``"auto"`` (triton on CUDA when Triton imports, else reference),
            ``"reference"`` (the oracle), ``"triton"`` (``glm_dsa.kernels``), ``"peers"``
            (DeepGEMM and FlashMLA), or a ``Backend`` object; see ``glm_dsa.backend``.
        attention_precision: ``"bf16"`` (default): attention on the activation dtype's query
            and the cache's rows; ``"fp8"``: SGLang's Q8KV8 form on the triton backend (e4m3
            query and context with one scale each, both products in FP8; not batch-invariant,
            no CUDA graphs); see ``glm_dsa.backend``.
        layer_outputs: keep every layer's output and every full layer's top-k of each request
            (``outputs`` writes them; one rank only); or a set of stack layer indices to keep
            those layers' only.
        observer: a ``glm_dsa.layer.StepObserver`` told each layer's attention input, top-k and
            output at every step (one rank only; not with ``layer_outputs``, which is one).
        batch_invariant: every row-wise product on fixed-shape tiles (on the tokens' positions
            off CUDA), fixed-order row sums and the absorbed attention at every length
            (``glm_dsa.invariant``), so a request's outputs are bitwise the same whatever the
            chunk size, the requests sharing its steps, its prefix-cache hits, the budgets and
            graph replay (same device, library and thread count). The reference and triton
            backends; None (default): the backend's ``invariant_by_default`` (on for triton,
            whose cost is a few per cent; off for the reference, 1.4-15x).
        cuda_graphs: replay steps of up to ``graphs.MAX_GRAPH_TOKENS`` tokens over up to
            ``graphs.MAX_GRAPH_CONTEXT`` context rows from CUDA graphs captured per padded
            bucket (``glm_dsa.graphs``; the results are the eager step's on the padded inputs).
            None (default): on wherever it can run — CUDA, a graph-capturable backend (triton),
            one rank, no ``layer_outputs`` or ``observer``; True there or a ValueError saying why not; False: every step
            eager. Steps from graphs have no per-component ``timing`` split. The pool gets
            ``graphs.max_padding`` scratch slots more, outside the allocator, for padded rows.
        order: ``"chunk"`` (default): each step through the whole stack; ``"layer"``: every step
            through one layer before the next (``glm_dsa.layer_major``: the same steps and the
            same bits, one layer's weights resident at a time; one rank, no CUDA graphs).
        layer_weights: with ``order="layer"``, fills each layer just before it runs (its
            parameters are allocated then and freed after: build the model with
            ``glm_dsa.weights.build_outer_model``); None: the layers are resident.
        hidden_on_device: with ``order="layer"``, keep the hidden rows and top-k between layers
            on the device (default) or, on CUDA, in pinned host memory.
    """

    pages_peak: int  # most pages in use at once since the last reset_stats
    bytes_written: dict[str, int]  # per pool kind ("mla", "index_k"), since the last reset_stats

    def __init__(
        self,
        model: DSAForCausalLM,
        num_pages: int,
        kv_dtype: str = "fp8",
        chunked_prefill_size: int = 32768,
        budget_bytes: Budgets | int | None = None,
        prefix_caching: bool = True,
        compute_logits: bool = True,
        timing: bool = False,
        cp_group: CPGroup | None = None,
        backend: str | Backend = "auto",
        attention_precision: str = "bf16",
        layer_outputs: bool | Collection[int] = False,
        batch_invariant: bool | None = None,
        cuda_graphs: bool | None = None,
        observer: StepObserver | None = None,
        order: str = "chunk",
        layer_weights: LayerWeights | None = None,
        hidden_on_device: bool = True,
    ) -> None:
        cfg = model.config
        if order not in ORDERS:
            raise ValueError(f"order={order!r}: choose one of {', '.join(ORDERS)}")
        if order == "layer" and cp_group is not None:
            raise ValueError("order='layer' runs on one rank; context parallel runs in chunk order")
        if order == "layer" and cuda_graphs:
            raise ValueError("cuda_graphs=True replays whole-stack steps; order='layer' runs one layer at a time: "
                             "pass cuda_graphs=None or False")
        if order == "chunk" and layer_weights is not None:
            raise ValueError("layer_weights fill one layer at a time: they need order='layer'")
        if layer_outputs and cp_group is not None:
            raise ValueError("layer_outputs is for one rank: a context-parallel rank sees only its share of the rows")
        if observer is not None and (cp_group is not None or layer_outputs):
            raise ValueError("a step observer runs on one rank without layer_outputs (itself an observer)")
        if chunked_prefill_size < cfg.page_size or chunked_prefill_size % cfg.page_size:
            raise ValueError(
                f"chunked_prefill_size={chunked_prefill_size} must be a positive multiple of "
                f"page_size={cfg.page_size}"
            )
        self.model, self.config = model, cfg
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.backend = get_backend(backend, self.device, self.dtype, kv_dtype, bool(batch_invariant),
                                   attention_precision)
        self.batch_invariant = (self.backend.invariant_by_default if batch_invariant is None
                                else batch_invariant)
        why_not = graphs.unsupported(self.device, self.backend, cp=cp_group is not None,
                                     observed=bool(layer_outputs) or observer is not None,
                                     batch_invariant=self.batch_invariant, dtype=self.dtype)
        if cuda_graphs and why_not:
            raise ValueError(f"cuda_graphs=True: {why_not}; pass cuda_graphs=False (or None to choose)")
        use_graphs = why_not is None and cuda_graphs is not False and order == "chunk"
        scratch = graphs.max_padding(graphs.MAX_GRAPH_TOKENS, cfg.page_size) if use_graphs else 0
        scratch_pages = -(-scratch // cfg.page_size)
        self.cache = KVCache(cfg, num_pages + scratch_pages, kv_dtype, self.device)
        self.allocator = PageAllocator(num_pages)
        self.prefix_cache = PrefixCache(self.allocator, cfg.page_size) if prefix_caching else None
        self.chunked_prefill_size = chunked_prefill_size
        if not isinstance(budget_bytes, Budgets):
            budget_bytes = Budgets.default(self.device, budget_bytes)
        self.budgets = budget_bytes
        # The scratch pages follow the allocator's: padded rows of a graph step write there.
        self.graphs = graphs.StepGraphs(
            model.model, self.cache, self.budgets, self.backend,
            torch.arange(num_pages * cfg.page_size, (num_pages + scratch_pages) * cfg.page_size,
                         device=self.device),
        ) if use_graphs else None
        self.compute_logits = compute_logits
        self.timing = timing
        self.cp_group = cp_group
        self.layer_outputs = layer_outputs
        self.observer = observer
        self.order, self.layer_weights, self.hidden_on_device = order, layer_weights, hidden_on_device
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.finished: dict[int, Request] = {}
        self.timeline: list[StepRecord] = []
        self.warm_rid: int | None = None
        self._next_rid = 0
        self.reset_stats()

    @classmethod
    def for_prompts(cls, model: DSAForCausalLM, lengths: Sequence[int], **kwargs) -> PrefillEngine:
        """An engine whose pool holds prompts of ``lengths`` tokens all at once (``pages_for``);
        ``kwargs`` are the other ``PrefillEngine`` arguments. The CLI and the scripts build
        their engines here."""
        return cls(model, pages_for(lengths, model.config.page_size), **kwargs)

    # ------------------------------------------------------------------ requests
    def add_request(self, input_ids: torch.Tensor | None, max_new_tokens: int = 0,
                    input_hidden: torch.Tensor | None = None) -> int:
        """Queue a prompt, int64 token ids ``[L]`` or (``input_ids=None``) ``input_hidden``, the
        first layer's input ``[L, hidden]`` (floating point, finite; cast to the model's dtype
        step by step, never matched against the prefix cache); returns its request id."""
        if (input_ids is None) == (input_hidden is None):
            raise ValueError("give a request its input_ids or its input_hidden, not both or neither")
        if input_hidden is not None:
            h = self.config.hidden_size
            if not input_hidden.is_floating_point() or input_hidden.dim() != 2 or input_hidden.shape[0] == 0 \
                    or input_hidden.shape[1] != h:
                raise ValueError(f"input_hidden must be a floating-point [L ≥ 1, hidden_size={h}] tensor, got "
                                 f"{input_hidden.dtype} {tuple(input_hidden.shape)}")
            if self.cp_group is not None:
                raise ValueError("input_hidden is for one rank: context parallel runs from token ids")
            if not bool(torch.isfinite(input_hidden).all()):
                raise ValueError("input_hidden holds NaN or inf")
            n = input_hidden.shape[0]
        else:
            assert input_ids is not None  # exactly one of input_ids / input_hidden (checked above)
            if input_ids.dtype != torch.int64 or input_ids.dim() != 1 or input_ids.numel() == 0:
                raise ValueError(f"input_ids must be a non-empty 1-D int64 tensor, got {input_ids.dtype} "
                                 f"{tuple(input_ids.shape)}")
            if int(input_ids.min()) < 0 or int(input_ids.max()) >= self.config.vocab_size:
                raise ValueError(f"token ids must lie in [0, vocab_size={self.config.vocab_size})")
            n = input_ids.numel()
        longest = self.config.max_position_embeddings
        if n + max_new_tokens > longest:
            raise ValueError(
                f"request of {n} + {max_new_tokens} tokens runs past max_position_embeddings={longest} of config "
                f"{self.config.name} (positions the model was not built for): shorten it, or use a config with a "
                "larger max_position_embeddings"
            )
        need = math.ceil((n + max_new_tokens) / self.config.page_size)
        if need > self.allocator.num_pages:
            raise ValueError(
                f"request of {n} + {max_new_tokens} tokens needs {need} pages; the pool "
                f"has {self.allocator.num_pages}: raise num_pages or shorten the request"
            )
        rid = self._next_rid
        self._next_rid += 1
        if input_hidden is None:
            assert input_ids is not None  # exactly one of input_ids / input_hidden (checked above)
            self.waiting.append(Request(rid, input_ids.cpu(), max_new_tokens))
        else:
            self.waiting.append(Request(rid, torch.empty(0, dtype=torch.int64), max_new_tokens,
                                        input_hidden=input_hidden.detach().cpu()))
        return rid

    def _prefix_cache_for(self, req: Request) -> PrefixCache | None:
        """The prefix cache when ``req`` takes part in it (keyed by token ids: not hidden inputs),
        else None."""
        return self.prefix_cache if req.input_hidden is None else None

    def _admit(self) -> None:
        """Reserve pages for waiting requests in FIFO order while the pool has room."""
        while self.waiting:
            req = self.waiting[0]
            page = self.config.page_size
            # A hit must leave at least one token to run: its last position's logits are needed.
            prefix_cache = self._prefix_cache_for(req)
            hit = prefix_cache.match(req.input_ids, req.length - 1) if prefix_cache is not None else []
            total = math.ceil((req.length + req.max_new_tokens) / page)
            fresh = self.allocator.alloc(total - len(hit))
            if fresh is None:
                return
            self.allocator.retain(hit)
            req.pages = hit + fresh
            req.prefix_len = req.cached_len = len(hit) * page
            self.running.append(self.waiting.pop(0))

    # ------------------------------------------------------------------ stepping
    def step(self) -> StepRecord | None:
        """Schedule, run and collect one step (nano-vllm's ``schedule → run → postprocess``);
        None when nothing is left to run."""
        if self.order == "layer":
            raise ValueError("a layer-major engine runs every step of a layer together: call run()")
        scheduled = self._schedule()
        if scheduled is None:
            return None
        t0 = time.perf_counter()
        with torch.no_grad(), invariant.batch_invariant(self.batch_invariant):
            ran = self._run(scheduled)
            self._keep(scheduled, ran.hidden)
            self._advance(scheduled)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        record = self._timeline_record(scheduled, ran.times, time.perf_counter() - t0, ran.cuda_graph)
        self._retire(scheduled)
        return record

    def _schedule(self) -> ScheduledStep | None:
        """Admit what fits, plan the step's chunks and build its batch and input; None when
        nothing is left to run."""
        self._admit()
        if not self.running:
            if self.waiting:
                raise RuntimeError("no request can be admitted although nothing is running")
            return None
        plan = plan_step(self.running, self.chunked_prefill_size, self.config.page_size)
        if not plan:
            raise RuntimeError("the planner scheduled no tokens; chunked_prefill_size is too small")
        prefix_lens = [r.prefix_len for r, _ in plan]
        context_slots = [self.cache.slots_of(r.pages, r.prefix_len + e) for r, e in plan]
        batch = ForwardBatch.from_slots(prefix_lens, [e for _, e in plan], context_slots, device=self.device)
        return ScheduledStep(plan, prefix_lens, batch, self._step_inputs(plan))

    def _run(self, scheduled: ScheduledStep) -> _Ran:
        """The step's last-layer output: from CUDA graphs when its bucket fits, else eagerly
        (split over the ranks under CP), observed by the step's observer."""
        batch = scheduled.batch
        if self.graphs is not None and self.graphs.fits(batch):
            return _Ran(self.graphs.run(scheduled.inputs, batch), LayerTimes(), cuda_graph=True)
        times = LayerTimes() if self.timing else None
        step = StepContext(batch, self.cache, self.budgets, self.backend, times=times,
                           observer=self._observer_for(scheduled))
        if self.cp_group is None:
            hidden = self.model.model(scheduled.inputs, step)
        else:
            hidden = self.cp_group.forward(self.model.model, scheduled.inputs, step)
        return _Ran(hidden, times or LayerTimes(), cuda_graph=False)

    def _observer_for(self, scheduled: ScheduledStep) -> StepObserver | None:
        """The observer of ``scheduled``'s layers: the engine's ``layer_outputs`` or its own."""
        if not self.layer_outputs:
            return self.observer
        layers = None if self.layer_outputs is True else frozenset(self.layer_outputs)
        return _LayerOutputs(scheduled, layers, to_host=self.order == "layer")

    def _keep(self, scheduled: ScheduledStep, hidden: torch.Tensor) -> None:
        """Each request's rows of the step's last-layer output ``hidden [n, hidden]`` (where
        they are: on the model's device, or on the host for a layer-major run that keeps them
        there), and the logits of the requests the step completes."""
        last_rows = []
        for (req, _), p, (q0, e) in zip(scheduled.plan, scheduled.prefix_lens, scheduled.rows()):
            # Kept on the model's device: a per-step copy to the host costs more than the
            # step's attention at a few thousand tokens (pageable copies are slow).
            req.hidden.append(hidden[q0 : q0 + e].detach())
            if p + e == req.length:
                last_rows.append((req, q0 + e - 1))
        if self.compute_logits and last_rows:
            rows = [row for _, row in last_rows]
            logits = self.model.logits(hidden[rows].to(self.device), scheduled.batch.positions[rows])
            for (req, _), lg in zip(last_rows, logits):
                req.logits = lg.cpu()

    def _advance(self, scheduled: ScheduledStep) -> None:
        """Each request of the step has run its chunk."""
        for req, e in scheduled.plan:
            req.prefix_len += e

    def _timeline_record(self, scheduled: ScheduledStep, t: LayerTimes, seconds: float,
                         cuda_graph: bool) -> StepRecord:
        """The step's timeline record (``t``: its per-component seconds), appended with the
        bytes it wrote."""
        plan = scheduled.plan
        record = StepRecord(
            step=len(self.timeline) + 1,
            chunks=tuple((r.rid, p, p + e) for (r, e), p in zip(plan, scheduled.prefix_lens)),
            prefix_at_start=tuple(scheduled.prefix_lens),
            seconds=seconds,
            projections=t.projections,
            indexer=t.indexer,
            attention=t.attention,
            moe=t.moe,
            cuda_graph=cuda_graph,
        )
        self.timeline.append(record)
        self._count_writes(scheduled.batch.num_tokens)
        return record

    def _retire(self, scheduled: ScheduledStep) -> None:
        """After a step has advanced its requests: those it completed are finished (pages freed,
        prefixes cached) and the one left part-way goes first."""
        for req, _ in scheduled.plan:
            if req.done:
                self._finish(req)
        # The one request left part-way runs first next step (PrefillAdder's new_chunked_req).
        self.running.sort(key=lambda r: r.prefix_len == 0)
        self.pages_peak = max(self.pages_peak, self.allocator.num_pages - self.allocator.num_free)

    def _count_writes(self, tokens: int) -> None:
        """Bytes the step stored: ``tokens`` rows of main KV in every layer and of index K in
        every full layer (under CP every rank stores the whole chunk; a step from CUDA graphs
        also wrote its padded rows, to scratch slots, which are not counted)."""
        cache = self.cache
        self.bytes_written["mla"] += tokens * cache.mla_row_bytes * len(cache.mla)
        self.bytes_written["index_k"] += tokens * (self.config.index_head_dim + 4) * len(cache.index_k)

    def _step_inputs(self, plan: list[tuple[Request, int]]) -> torch.Tensor:
        """The step's model input: token ids ``[n]``, or hidden rows ``[n, hidden]`` in the model's
        dtype when a request of the step starts from hidden states (token requests embedded)."""
        if all(r.input_hidden is None for r, _ in plan):
            return torch.cat([r.input_ids[r.prefix_len : r.prefix_len + e] for r, e in plan]).to(self.device)
        rows = []
        for r, e in plan:
            if r.input_hidden is None:
                rows.append(self.model.model.embed_tokens(r.input_ids[r.prefix_len : r.prefix_len + e].to(self.device)))
            else:
                rows.append(r.input_hidden[r.prefix_len : r.prefix_len + e].to(self.device, self.dtype))
        return torch.cat(rows)

    def _finish(self, req: Request) -> None:
        self.running.remove(req)
        prefix_cache = self._prefix_cache_for(req)
        if prefix_cache is not None:
            prefix_cache.insert(req.input_ids, req.pages, req.length)
        self.allocator.release(req.pages)
        self.finished[req.rid] = req

    def run(self, progress: Callable[[StepRecord], None] | None = None,
            layer_progress: Callable[[LayerRecord], None] | None = None) -> dict[int, Request]:
        """Step until every request is finished; returns them by id. ``progress`` is told each
        step's record as it ends (chunk order), ``layer_progress`` each layer's (layer order)."""
        if self.order == "layer":
            run_layer_major(self, self.layer_weights, self.hidden_on_device, layer_progress)
            return self.finished
        while (record := self.step()) is not None:
            if progress is not None:
                progress(record)
        return self.finished

    # ------------------------------------------------------------------ warm-up and reports
    def reset_stats(self) -> None:
        """Start the timeline, the peak page count, the bytes-written counts and the CP
        counters afresh (e.g. after a warm-up run)."""
        self.timeline.clear()
        self.layer_timeline: list[LayerRecord] = []  # layer-major order: one record per layer
        self.pages_peak = 0
        self.bytes_written = {"mla": 0, "index_k": 0}
        if self.cp_group is not None:
            self.cp_group.reset_counters()

    def warm_up(self, prefix_ids: torch.Tensor) -> int | None:
        """Run ``prefix_ids`` (int64 ``[P]``) alone so its whole pages enter the prefix cache,
        then ``reset_stats``; returns its request id, or None (nothing run) when ``P`` is shorter
        than a page. Later requests sharing the prefix hit ``floor(P / page_size)`` pages."""
        if prefix_ids.numel() < self.config.page_size:
            return None
        self.warm_rid = self.add_request(prefix_ids)
        self.run()
        self.reset_stats()
        return self.warm_rid

    def tokens_to_run(self) -> int:
        """Tokens the queued requests will run: their prompts minus the prefix-cache hits they
        would get now (what a progress bar counts to)."""
        page = self.config.page_size
        hits = 0
        if self.prefix_cache is not None:
            hits = sum(len(self.prefix_cache.match(r.input_ids, r.length - 1)) * page for r in self.waiting
                       if self._prefix_cache_for(r) is not None)
        return sum(r.length for r in self.waiting) - hits

    def report(self, rids: Sequence[int]) -> dict:
        """The run since the last ``reset_stats`` as a JSON-ready dict: ``requests`` (tokens,
        cached), ``budget_bytes`` (the logits budget), ``attention_budget_bytes``,
        ``total_seconds``, ``steps`` (each request named by its index in ``rids``), in layer order
        ``layers`` (per layer: its kind and the seconds its weights and its steps took), ``cache``
        usage in pages and bytes (the pools' bytes include the scratch pages of CUDA-graph
        padding), with CUDA graphs ``cuda_graphs`` (``graphs.StepGraphs.report``: per bucket its
        capture seconds and pool memory), and under CP ``context_parallel`` with every rank's
        counters (a collective: every rank must call it)."""
        cache, page = self.cache, self.config.page_size
        pool = cache.pool_bytes()
        report = {
            "requests": [{"tokens": self._finished(r).length, "cached": self._finished(r).cached_len}
                         for r in rids],
            "budget_bytes": self.budgets.logits_bytes,
            "attention_budget_bytes": self.budgets.attention_bytes,
            "total_seconds": sum(s.seconds for s in self.timeline),
            "steps": [_step_json(s, rids) for s in self.timeline],
            "cache": {
                "pages_total": self.allocator.num_pages,
                "pages_peak": self.pages_peak,
                "page_bytes_main_kv": cache.mla_row_bytes * page,
                "page_bytes_index_k": index_k_page_bytes(page, self.config.index_head_dim),
                "pool_bytes_main_kv": pool["mla"],
                "pool_bytes_index_k": pool["index_k"],
                "bytes_written_main_kv": self.bytes_written["mla"],
                "bytes_written_index_k": self.bytes_written["index_k"],
            },
        }
        if self.order == "layer":
            layers = self.model.model.layers
            report["layers"] = [{"layer": r.layer, "kind": "full" if layers[r.layer].is_full else "shared",
                                 "weight_seconds": r.weight_seconds, "seconds": r.seconds, "tokens": r.tokens}
                                for r in self.layer_timeline]
        if self.graphs is not None:
            report["cuda_graphs"] = self.graphs.report()
        if self.cp_group is not None:
            g = self.cp_group
            report["context_parallel"] = {"cp": g.size, "split": g.split, "ranks": g.stats()}
        return report

    def outputs(self, rids: Sequence[int]) -> dict[str, torch.Tensor]:
        """``request.{i}.input_ids`` (token requests), ``.hidden`` (float32 ``[L, hidden]``, every
        token of the prompt) and ``.logits`` of the finished requests ``rids``, on the host; with
        ``layer_outputs`` also ``request.{i}.layer.{l}.hidden`` (float32 ``[L, hidden]``, layer
        ``l``'s output) and, for each full layer, ``request.{i}.layer.{l}.topk`` (int32 ``[L,
        index_topk]``, request-relative key positions, ``-1`` padded).

        Tokens served from the prefix cache were computed by the ``warm_up`` request (same
        tokens, same positions): their rows are taken from it.
        """
        warm = self.finished[self.warm_rid] if self.warm_rid is not None else None

        def rows(r: Request, own: list[torch.Tensor], cached: list[torch.Tensor]) -> torch.Tensor:
            head = [torch.cat(cached)[: r.cached_len]] if r.cached_len else []
            return torch.cat(head + own).cpu().contiguous()

        out = {}
        for i, rid in enumerate(rids):
            r = self._finished(rid)
            if r.cached_len and (warm is None or warm.length < r.cached_len):
                raise ValueError(f"request {rid} hit {r.cached_len} cached tokens that no warm_up "
                                 "request computed; run the shared prefix with warm_up first")
            if r.input_hidden is None:
                out[f"request.{i}.input_ids"] = r.input_ids.contiguous()
            out[f"request.{i}.hidden"] = rows(r, r.hidden, warm.hidden if warm is not None else []).float()
            if r.logits is not None:
                out[f"request.{i}.logits"] = r.logits.float().contiguous()
            for layer, parts in r.layer_hidden.items():
                cached = warm.layer_hidden[layer] if warm is not None else []
                out[f"request.{i}.layer.{layer}.hidden"] = rows(r, parts, cached).float()
            for layer, parts in r.layer_topk.items():
                cached = warm.layer_topk[layer] if warm is not None else []
                out[f"request.{i}.layer.{layer}.topk"] = rows(r, parts, cached).to(torch.int32)
        return out

    def output_hidden(self, rid: int) -> torch.Tensor:
        """The last layer's output ``[L - cached_len, hidden]`` for the tokens request ``rid`` ran,
        on the model's device (``L × hidden_size × 2`` bytes in bf16: 12.9 GB for 1M tokens of
        GLM-5.3)."""
        return torch.cat(self._finished(rid).hidden)

    def _finished(self, rid: int) -> Request:
        """The finished request ``rid``; a ``ValueError`` naming its state otherwise."""
        if rid in self.finished:
            return self.finished[rid]
        for state, queue in (("waiting", self.waiting), ("running", self.running)):
            for req in queue:
                if req.rid == rid:
                    raise ValueError(f"request {rid} is {state} ({req.prefix_len} of {req.length} tokens run); "
                                     "call run() (or step() until it returns None) before reading its outputs")
        added = f"ids 0 … {self._next_rid - 1}" if self._next_rid else "no request yet"
        raise ValueError(f"no request {rid}: add_request has returned {added}")


def _step_json(s: StepRecord, rids: Sequence[int]) -> dict:
    return {
        "step": s.step,
        "chunks": [{"request": list(rids).index(rid), "start": a, "end": b} for rid, a, b in s.chunks],
        "prefix_at_start": list(s.prefix_at_start),
        "seconds": s.seconds,
        "indexer_s": s.indexer,
        "attention_s": s.attention,
        "moe_s": s.moe,
        "projections_s": s.projections,
        "cuda_graph": s.cuda_graph,
    }
