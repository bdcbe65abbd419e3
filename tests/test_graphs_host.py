"""The CUDA-graph runner's host side (``glm_dsa.graphs``), on the CPU without a model run.

Buckets and padding at their edges, each refusal of ``unsupported`` in its order, which steps
``fits`` takes (one step inside and outside each limit), the scratch-slot check, how a bucket's
static buffers are refilled by a step smaller than the last (no stale rows), and the runner's
ownership rules driven through a stand-in for the captured graph: one capture per bucket, a
fresh output tensor per step (never the static memory a later replay overwrites), the replay
count and the report of captured graphs only.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from glm_dsa import graphs
from glm_dsa.backend import REFERENCE, TritonBackend
from glm_dsa.batch import ForwardBatch
from glm_dsa.budget import Budgets
from glm_dsa.graphs import (
    LINEAR_BUCKET,
    MAX_GRAPH_CONTEXT,
    MAX_GRAPH_TOKENS,
    StepGraphs,
    max_padding,
    token_bucket,
    unsupported,
)

CUDA = torch.device("cuda")


@pytest.mark.parametrize("n, page, bucket", [
    (1, 64, 64), (63, 64, 64), (64, 64, 64), (65, 64, 128), (1, 16, 16), (17, 16, 32),
    (16, 16, 16), (3, 1, 4), (4, 1, 4), (5, 1, 8), (1, 1, 1), (2, 1, 2),
    (LINEAR_BUCKET - 1, 64, LINEAR_BUCKET), (LINEAR_BUCKET, 64, LINEAR_BUCKET),
    (LINEAR_BUCKET + 1, 64, 2 * LINEAR_BUCKET), (2 * LINEAR_BUCKET, 64, 2 * LINEAR_BUCKET),
    (2 * LINEAR_BUCKET + 1, 64, 3 * LINEAR_BUCKET), (LINEAR_BUCKET + 1, 8192, 2 * LINEAR_BUCKET),
])
def test_token_bucket_edges(n, page, bucket):
    assert token_bucket(n, page) == bucket


@pytest.mark.parametrize("max_tokens, page, pad", [
    (0, 64, 0), (1, 64, 63), (64, 64, 63), (65, 64, 63), (128, 64, 63), (129, 64, 127),
    (4096, 64, 2047), (4097, 64, 4095), (8192, 64, 4095), (8193, 64, 4095), (2, 1, 0), (3, 1, 1),
])
def test_max_padding_edges(max_tokens, page, pad):
    assert max_padding(max_tokens, page) == pad


def test_bucket_floors_start_each_bucket():
    assert graphs._bucket_floors(300, 64) == [1, 65, 129, 257]
    assert graphs._bucket_floors(256, 64) == [1, 65, 129]
    assert graphs._bucket_floors(0, 64) == []


def test_default_limits():
    assert (MAX_GRAPH_TOKENS, MAX_GRAPH_CONTEXT, LINEAR_BUCKET) == (16384, 65536, 4096)


# ----------------------------------------------------------------------------- unsupported
class _Capturable(TritonBackend):
    def __init__(self):  # no kernels imported: only the class attributes are read
        pass


def test_unsupported_reasons_in_order(monkeypatch):
    ok = _Capturable()
    monkeypatch.setattr(graphs, "fused_grouped_mm", lambda device, dtype: dtype == torch.bfloat16)
    assert unsupported(CUDA, ok) is None
    assert unsupported(torch.device("cpu"), ok) == "CUDA graphs need a CUDA device, not cpu"
    assert unsupported(torch.device("cpu"), REFERENCE, cp=True).startswith("CUDA graphs need")
    assert unsupported(CUDA, REFERENCE, cp=True) == (
        "the reference backend reads values on the host during a step; CUDA graphs need backend triton")
    assert unsupported(CUDA, ok, cp=True, observed=True).startswith("context parallel")
    assert unsupported(CUDA, ok, observed=True, batch_invariant=True).startswith("a step observer")
    assert unsupported(CUDA, ok, batch_invariant=True) is None  # bf16: fused grouped GEMM
    why = unsupported(CUDA, ok, batch_invariant=True, dtype=torch.float32)
    assert why is not None and why.startswith("batch-invariant mode runs float32 experts")
    assert unsupported(CUDA, ok, dtype=torch.float32) is None  # outside the mode: any dtype


def test_fp8_attention_is_refused_for_its_per_step_scales_not_as_another_backend():
    # The fp8 triton backend is the capturable backend's class: the reason must name the
    # precision, not send the user to "backend triton".
    why = unsupported(CUDA, TritonBackend("fp8"))
    assert why is not None and why.startswith("fp8 attention scales each step's context")
    assert "bf16 attention" in why and "backend triton" not in why


# ----------------------------------------------------------------------------- StepGraphs
def _engine_parts(page=64):
    model = SimpleNamespace(config=SimpleNamespace(page_size=page, hidden_size=4))
    cache = SimpleNamespace(device=torch.device("cpu"))
    return model, cache, Budgets(1 << 20, 1 << 20), REFERENCE


def _batch(n, s):
    return SimpleNamespace(num_tokens=n, kv_slots=torch.zeros(s, dtype=torch.int64))


def test_fits_one_step_either_side_of_each_limit():
    model, cache, budgets, backend = _engine_parts()
    g = StepGraphs(model, cache, budgets, backend, torch.arange(63), max_tokens=100, max_context=300)
    assert g.fits(_batch(100, 300))
    assert not g.fits(_batch(101, 300))
    assert not g.fits(_batch(100, 301))
    assert g.fits(_batch(1, 0))
    default = StepGraphs(model, cache, budgets, backend, torch.arange(max_padding(MAX_GRAPH_TOKENS, 64)))
    assert default.fits(_batch(MAX_GRAPH_TOKENS, MAX_GRAPH_CONTEXT))
    assert not default.fits(_batch(MAX_GRAPH_TOKENS + 1, 1))
    assert not default.fits(_batch(1, MAX_GRAPH_CONTEXT + 1))


@pytest.mark.parametrize("max_tokens, have, ok", [(100, 63, True), (100, 62, False), (129, 127, True),
                                                  (129, 126, False), (2, 1, True), (2, 0, False)])
def test_scratch_slots_must_cover_the_worst_padding(max_tokens, have, ok):
    model, cache, budgets, backend = _engine_parts(page=64 if max_tokens > 2 else 1)
    args = (model, cache, budgets, backend, torch.arange(have))
    if ok:
        StepGraphs(*args, max_tokens=max_tokens)
    else:
        with pytest.raises(ValueError, match=f"{have} scratch slots; steps of up to {max_tokens} tokens"):
            StepGraphs(*args, max_tokens=max_tokens)


def test_no_graph_pool_off_cuda():
    model, cache, budgets, backend = _engine_parts()
    assert StepGraphs(model, cache, budgets, backend, torch.arange(63), max_tokens=64)._pool is None


class _FakeGraph:
    """A bucket's graph: ``replay`` returns its static output rows (what a captured graph
    hands back), overwritten by every replay."""

    made: list = []

    def __init__(self, model, cache, budgets, backend, scratch_slots, tokens, context, from_ids):
        self.tokens, self.context, self.from_ids = tokens, context, from_ids
        self.captures = 0
        self.static = torch.zeros(tokens, 4)
        self.loaded = None
        self.capture_seconds, self.pool_bytes = 0.5, 1000 * tokens
        _FakeGraph.made.append(self)

    @property
    def captured(self):
        return self.captures > 0

    def load(self, inputs, batch):
        self.loaded = (inputs, batch)

    def capture(self, pool):
        self.captures += 1

    def replay(self):
        self.static.add_(1.0)
        return self.static

    def run_eager(self):
        self.static.add_(10.0)
        return self.static, None


def test_run_captures_once_per_bucket_and_hands_out_fresh_rows(monkeypatch):
    _FakeGraph.made = []
    monkeypatch.setattr(graphs, "_BucketGraph", _FakeGraph)
    model, cache, budgets, backend = _engine_parts()
    g = StepGraphs(model, cache, budgets, backend, torch.arange(127), max_tokens=128)
    ids = torch.zeros(30, dtype=torch.int64)
    first = g.run(ids, _batch(30, 126))
    assert first.shape == (30, 4) and bool((first == 1).all())
    second = g.run(torch.zeros(40, dtype=torch.int64), _batch(40, 100))  # the same bucket (64, 128)
    assert len(_FakeGraph.made) == 1 and _FakeGraph.made[0].captures == 1
    assert (_FakeGraph.made[0].tokens, _FakeGraph.made[0].context) == (64, 128)
    assert bool((first == 1).all()), "a later replay overwrote an earlier step's output"
    assert second.shape == (40, 4) and bool((second == 2).all())
    assert first.data_ptr() != _FakeGraph.made[0].static.data_ptr()
    # Hidden rows in (not ids), another context bucket: graphs of their own.
    g.run(torch.zeros(30, 4), _batch(30, 126))
    g.run(ids, _batch(30, 129))
    keys = [(m.tokens, m.context, m.from_ids) for m in _FakeGraph.made]
    assert keys == [(64, 128, True), (64, 128, False), (64, 256, True)]
    assert g.replays == 4
    eager = g.run_eager(ids, _batch(30, 126))
    assert bool((eager == 12).all()) and eager.data_ptr() != _FakeGraph.made[0].static.data_ptr()
    assert g.replays == 4  # an eager run is not a replay
    report = g.report()
    assert report["replays"] == 4 and report["pool_bytes"] == 3 * 64_000
    assert [(r["tokens"], r["context"], r["from_ids"]) for r in report["graphs"]] == keys


def test_report_lists_captured_graphs_only(monkeypatch):
    _FakeGraph.made = []
    monkeypatch.setattr(graphs, "_BucketGraph", _FakeGraph)
    model, cache, budgets, backend = _engine_parts()
    g = StepGraphs(model, cache, budgets, backend, torch.arange(127), max_tokens=128)
    g.run_eager(torch.zeros(3, dtype=torch.int64), _batch(3, 3))  # built, never captured
    assert g.report() == {"graphs": [], "pool_bytes": 0, "replays": 0}


# ----------------------------------------------------------------------------- load
def _bucket_buffers(tokens, context, scratch):
    """A ``_BucketGraph``'s static buffers without its model (``load`` reads only these)."""
    b = object.__new__(graphs._BucketGraph)
    b.tokens, b.context = tokens, context
    b.scratch_slots = scratch
    b._scratch0 = int(scratch[0])
    b.inputs = torch.zeros(tokens, dtype=torch.int64)
    b.row_mask = torch.zeros(tokens, dtype=torch.bool)
    z = lambda n, dt=torch.int64: torch.zeros(n, dtype=dt)  # noqa: E731
    b.batch = SimpleNamespace(positions=z(tokens), out_slots=z(tokens), kv_slots=z(context),
                              ks=z(tokens, torch.int32), ke=z(tokens, torch.int32))
    return b


def test_load_pads_and_leaves_no_stale_rows_from_a_larger_step():
    scratch = torch.arange(1000, 1008)
    b = _bucket_buffers(8, 16, scratch)
    big = ForwardBatch.from_slots([4], [7], [torch.arange(100, 111)])
    b.load(torch.arange(1, 8), big)
    small = ForwardBatch.from_slots([2], [3], [torch.arange(200, 205)])
    b.load(torch.tensor([5, 6, 7]), small)
    assert b.inputs.tolist() == [5, 6, 7, 0, 0, 0, 0, 0]
    assert b.batch.positions.tolist() == [2, 3, 4, 0, 0, 0, 0, 0]
    assert b.batch.ks.tolist() == small.ks.tolist() + [0] * 5
    assert b.batch.ke.tolist() == small.ke.tolist() + [0] * 5  # padded rows: empty windows
    assert b.batch.out_slots.tolist() == [202, 203, 204, 1000, 1001, 1002, 1003, 1004]
    assert b.batch.kv_slots.tolist() == [200, 201, 202, 203, 204] + [1000] * 11
    assert b.row_mask.tolist() == [True] * 3 + [False] * 5


def test_load_of_a_full_bucket_pads_nothing():
    b = _bucket_buffers(4, 4, torch.arange(50, 54))
    full = ForwardBatch.from_slots([0], [4], [torch.arange(10, 14)])
    b.load(torch.arange(4), full)
    assert b.batch.out_slots.tolist() == [10, 11, 12, 13] and b.batch.kv_slots.tolist() == [10, 11, 12, 13]
    assert b.row_mask.all()
