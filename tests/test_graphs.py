"""CUDA-graph replay of prefill steps (``glm_dsa.graphs``) and the sync-free mode it captures in
(``glm_dsa.syncfree``).

On the CPU: the buckets, the deferred data checks, the size-only indexer plan, and the padded
step (``StepGraphs.run_eager``, Triton's interpreter) against the unpadded eager step — what
graphs replay is that padded step. On CUDA: engines with and without graphs on the same prompts,
bitwise, a data check failing inside a replayed graph, and the pool memory reported.
"""

from __future__ import annotations

import pytest
import torch

import glm_dsa
from glm_dsa import syncfree
from glm_dsa.backend import get_backend
from glm_dsa.batch import ForwardBatch
from glm_dsa.budget import Budgets
from glm_dsa.cache import KVCache, PageAllocator
from glm_dsa.fp8 import act_quant
from glm_dsa.graphs import StepGraphs, max_padding, token_bucket
from glm_dsa.kv_format import index_k_page_bytes, index_k_store
from glm_dsa.layer import StepContext
from glm_dsa.prefill import PrefillEngine


# ----------------------------------------------------------------------------- buckets
def test_token_buckets_are_powers_of_two_then_multiples_of_4096():
    got = {n: token_bucket(n, 64) for n in (1, 64, 65, 100, 128, 129, 2048, 2049, 4096, 4097, 8192,
                                            8193, 16384)}
    assert got == {1: 64, 64: 64, 65: 128, 100: 128, 128: 128, 129: 256, 2048: 2048, 2049: 4096,
                   4096: 4096, 4097: 8192, 8192: 8192, 8193: 12288, 16384: 16384}


def test_max_padding_is_the_worst_bucket_gap():
    # 4097 tokens pad to 8192; below 4096 a bucket 2p holds p + 1 tokens at worst.
    assert max_padding(16384, 64) == 8192 - 4097
    assert max_padding(4096, 64) == 4096 - 2049
    assert max_padding(64, 64) == 63


# ----------------------------------------------------------------------------- sync-free checks
def test_check_raises_now_outside_and_later_inside_sync_free():
    with pytest.raises(ValueError, match="bad thing"):
        syncfree.check(torch.tensor(False), "bad thing")
    syncfree.check(torch.tensor(True), "never")
    with syncfree.sync_free() as checks:
        syncfree.check(torch.tensor(True), "fine")
        syncfree.check(torch.tensor(False), "second check failed")
        syncfree.check(torch.tensor(False), "third check failed")
    assert not syncfree.active()
    with pytest.raises(ValueError, match="second check failed"):
        checks.raise_first()


def test_sync_free_blocks_do_not_nest():
    with syncfree.sync_free(), pytest.raises(RuntimeError, match="do not nest"):
        with syncfree.sync_free():
            pass


def test_data_checks_are_deferred_not_dropped():
    x = torch.ones(2, 128)
    x[1, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        act_quant(x, 128)
    with syncfree.sync_free() as checks:
        act_quant(x, 128)  # no raise here: the verdict stays on the device
    with pytest.raises(ValueError, match="act_quant got NaN or inf"):
        checks.raise_first()

    pages = torch.zeros(2, index_k_page_bytes(64, 128), dtype=torch.uint8)
    k = torch.zeros(2, 128).to(torch.float8_e4m3fn)
    slots = torch.tensor([3, 3])
    with pytest.raises(ValueError, match="distinct"):
        index_k_store(pages, slots, k, torch.ones(2))
    with syncfree.sync_free() as checks:
        index_k_store(pages, slots, k, torch.ones(2))
    with pytest.raises(ValueError, match="slots to store must be distinct"):
        checks.raise_first()


def test_write_mla_check_is_deferred():
    cfg = glm_dsa.get_config("tiny")
    cache = KVCache(cfg, 2, "bf16")
    rows = torch.zeros(3, cfg.kv_latent_dim)
    rows[2, 0] = float("inf")
    with syncfree.sync_free() as checks:
        cache.write_mla(0, torch.tensor([0, 1, 2]), rows)
    with pytest.raises(ValueError, match="write_mla of layer 0: a kv_latent row holds NaN or inf"):
        checks.raise_first()


def test_sync_free_indexer_plan_selects_the_eager_sets():
    """Size-only plan (every chunk over all columns) against the eager spans, Triton kernels in the
    interpreter: two requests with prefixes, a budget of several row chunks."""
    from glm_dsa.kernels import indexer_topk

    g = torch.Generator().manual_seed(0)
    batch = ForwardBatch.contiguous([40, 30], prefix_lens=[90, 20])
    S, S_kv, H, D, topk = batch.num_tokens, batch.kv_slots.numel(), 4, 32, 16
    q = (torch.randn(S, H, D, generator=g)).to(torch.float8_e4m3fn)
    k = (torch.randn(S_kv, D, generator=g)).to(torch.float8_e4m3fn)
    scale, w = torch.rand(S_kv, generator=g) + 0.5, torch.randn(S, H, generator=g)
    budget = 4 * 16 * S_kv  # 16 rows of logits at a time: 5 row chunks
    eager = indexer_topk(q, w, k, scale, batch.ks, batch.ke, topk, budget)
    with syncfree.sync_free() as checks:
        planned = indexer_topk(q, w, k, scale, batch.ks, batch.ke, topk, budget)
    checks.raise_first()
    assert torch.equal(eager.sort(dim=1).values, planned.sort(dim=1).values)
    # Context no longer than topk: no scoring at all, 0 … len − 1 then -1.
    short = ForwardBatch.contiguous([10])
    with syncfree.sync_free():
        got = indexer_topk(q[:10], w[:10], k[:10], scale[:10], short.ks, short.ke, topk, budget)
    want = torch.where(torch.arange(topk) <= torch.arange(10)[:, None], torch.arange(topk), -1)
    assert torch.equal(got, want.to(torch.int32))


# ----------------------------------------------------------------------------- padding
def _tiny_two_layers():
    cfg = glm_dsa.keep_layers(glm_dsa.get_config("tiny"), 2)
    return glm_dsa.init_weights(glm_dsa.build_model(cfg, torch.float32), seed=0).eval()


def test_padded_step_gives_the_unpadded_rows():
    """Two requests (one with a cached prefix) padded from 30 to 64 tokens and from 126 to 128
    context rows: the real rows' outputs and cache rows are the unpadded step's, the allocator's
    pages beyond the real slots are untouched, and the padded rows wrote only scratch pages."""
    model = _tiny_two_layers()
    cfg = model.config
    backend = get_backend("triton", "cpu")
    pages, scratch = 4, -(-max_padding(64, cfg.page_size) // cfg.page_size)
    budgets = Budgets(1 << 24, 1 << 24)
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, cfg.vocab_size, (96,), generator=g)
    ids = torch.randint(0, cfg.vocab_size, (30,), generator=g)
    slots = [torch.arange(0, 96 + 20), torch.arange(192, 192 + 10)]
    batch = ForwardBatch.from_slots([96, 0], [20, 10], slots)
    # the prefix, written once by an eager step of its own, then copied into both caches
    # (the same step twice gives the same bytes; it took a third of this test's time)
    written = KVCache(cfg, pages + scratch, "fp32")
    with torch.no_grad():
        model.model(prefix, StepContext(ForwardBatch.from_slots([0], [96], [torch.arange(96)]), written,
                                        budgets, backend))
    caches = []
    outs = []
    for padded in (False, True):
        cache = KVCache(cfg, pages + scratch, "fp32")
        for pool, source in ((cache.mla, written.mla), (cache.index_k, written.index_k)):
            for layer, t in pool.items():
                t.copy_(source[layer])
        with torch.no_grad():
            if padded:
                graphs = StepGraphs(model.model, cache, budgets, backend,
                                    torch.arange(pages * cfg.page_size, (pages + scratch) * cfg.page_size),
                                    max_tokens=64)
                out = graphs.run_eager(ids, batch)
            else:
                out = model.model(ids, StepContext(batch, cache, budgets, backend))
        caches.append(cache)
        outs.append(out)
    assert outs[1].shape == (30, cfg.hidden_size)
    torch.testing.assert_close(outs[1], outs[0], rtol=1e-5, atol=1e-5 * float(outs[0].abs().max()))
    real = pages * cfg.page_size
    for layer in caches[0].mla:
        a, b = (c.mla[layer].view(-1, cfg.kv_latent_dim) for c in caches)
        torch.testing.assert_close(b[:real], a[:real], rtol=1e-5, atol=1e-5)
        assert bool((a[real:] == 0).all()) and bool((b[real:] != 0).any())  # scratch only when padded
    for layer in caches[0].index_k:
        a, b = (c.index_k[layer] for c in caches)
        assert bool((a[pages:] == 0).all()) and bool((b[pages:] != 0).any())



def test_a_padded_step_counts_the_bytes_of_its_real_rows():
    """An engine whose steps run padded in a bucket (``StepGraphs.run_eager``, what a replay
    computes) reports the bytes written of its real rows, as the eager engine does: the padded
    rows' scratch writes are not counted."""
    model = _tiny_two_layers()
    page = model.config.page_size
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n))
               for n in (90, 30)]
    counts = []
    for padded in (False, True):
        eng = PrefillEngine(model, 8, kv_dtype="fp32", chunked_prefill_size=128, budget_bytes=1 << 24,
                            backend="reference", cuda_graphs=False, prefix_caching=False)
        if padded:  # the pool's last 4 pages serve as the scratch slots no request is given
            eng.allocator = PageAllocator(4)
            eng.graphs = StepGraphs(model.model, eng.cache, eng.budgets, eng.backend,
                                    torch.arange(4 * page, 8 * page), max_tokens=128)
            eng.graphs.run = eng.graphs.run_eager  # type: ignore[method-assign]
        for p in prompts:
            eng.add_request(p)
        eng.run()
        counts.append(dict(eng.bytes_written))
        assert all(s.cuda_graph == padded for s in eng.timeline)
    assert counts[0] == counts[1] and counts[0]["mla"] > 0


# ----------------------------------------------------------------------------- the engine switch
def test_engine_switch_on_the_cpu():
    model = _tiny_two_layers()
    assert PrefillEngine(model, 4).graphs is None  # auto: off on the CPU
    assert PrefillEngine(model, 4, cuda_graphs=False).graphs is None
    with pytest.raises(ValueError, match="cuda_graphs=True: CUDA graphs need a CUDA device, not cpu"):
        PrefillEngine(model, 4, cuda_graphs=True)


# ----------------------------------------------------------------------------- CUDA
def _small_cuda(**changes):
    cfg = glm_dsa.get_config("small").replace(**changes)
    return glm_dsa.init_weights(glm_dsa.build_model(cfg, torch.bfloat16), seed=0).cuda().eval()


def _calc_diff(x, y):
    """DeepGEMM's ``calc_diff``: 1 − 2⟨x, y⟩ / (‖x‖² + ‖y‖²)."""
    x, y = x.double(), y.double()
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def _prefill(model, prompts, chunk, graphs, engine=None, prefix=None, kv_dtype="bf16"):
    if engine is None:
        lengths = [p.numel() for p in prompts] + ([prefix.numel()] if prefix is not None else [])
        engine = PrefillEngine.for_prompts(model, lengths, chunked_prefill_size=chunk, compute_logits=False,
                                           prefix_caching=prefix is not None, cuda_graphs=graphs,
                                           kv_dtype=kv_dtype)
        if prefix is not None:
            engine.warm_up(prefix)
    rids = [engine.add_request(p) for p in prompts]
    engine.run()
    return [engine.output_hidden(r) for r in rids], engine


def _padded_eager(engine: PrefillEngine) -> PrefillEngine:
    """``engine`` running each graph step's padded inputs eagerly (what its graphs replay)."""
    assert engine.graphs is not None
    engine.graphs.run = engine.graphs.run_eager  # type: ignore[method-assign]
    return engine


@pytest.mark.cuda
# FP8 KV on sm_90: the Gluon kernel over the context dequantized per step, inside the graph too.
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("lengths, chunk, prefix", [
    ([2048], 2048, 0),                # one request on a bucket
    ([1000], 2048, 0),                # padded to 1024
    ([700, 450, 1100], 512, 300),     # several steps, shared steps, prefix-cache hits, padding
    ([2000], 16384, 0),               # one step of 2000 tokens padded to 2048 (context too)
])
def test_graphs_replay_equals_eager_bitwise(lengths, chunk, prefix, kv_dtype):
    """Every context within ``index_topk``, where the eager step is deterministic (the triton
    select keeps every key, in order). Replayed steps give the bits of the same padded steps run
    eagerly. Against the unpadded eager engine they are bitwise where no step was padded; a padded
    step hands cuBLAS more rows, which may round real rows otherwise (on the H200, 2026-12-01,
    one request of 1000 and of 2000 tokens came out bitwise; the three requests did not)."""
    model = _small_cuda(index_topk=2048, kv_lora_rank=512, qk_rope_head_dim=64)
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    pre = torch.randint(0, cfg.vocab_size, (prefix,), generator=g) if prefix else None
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g) for n in lengths]
    if pre is not None:
        prompts = [torch.cat([pre, p[prefix:]]) for p in prompts]
    lengths_run = [p.numel() for p in prompts] + ([pre.numel()] if pre is not None else [])
    with torch.no_grad():
        eager, _ = _prefill(model, prompts, chunk, False, prefix=pre, kv_dtype=kv_dtype)
        graph, engine = _prefill(model, prompts, chunk, True, prefix=pre, kv_dtype=kv_dtype)
        padded = PrefillEngine.for_prompts(model, lengths_run, chunked_prefill_size=chunk, compute_logits=False,
                                           prefix_caching=pre is not None, cuda_graphs=True,
                                           kv_dtype=kv_dtype)
        if pre is not None:
            _padded_eager(padded).warm_up(pre)
        padded_eager, _ = _prefill(model, prompts, chunk, None, engine=_padded_eager(padded))
    assert all(s.cuda_graph for s in engine.timeline)
    for a, b in zip(padded_eager, graph):
        assert torch.equal(a, b)
    sizes = [sum(e - s for _, s, e in st.chunks) for st in engine.timeline]
    unpadded = all(token_bucket(n, cfg.page_size) == n for n in sizes)
    for a, b in zip(eager, graph):
        if unpadded:
            assert torch.equal(a, b)
        # Rounding, or a MoE routing near-tie flipped by it, on a few rows; misplaced rows are ~1.
        assert _calc_diff(a, b) < 1e-2
    report = engine.report(list(engine.finished))["cuda_graphs"]
    assert report["graphs"] and report["pool_bytes"] > 0
    if pre is None:  # the same engine again: replays only, the same bits
        with torch.no_grad():
            again, _ = _prefill(model, prompts, chunk, None, engine=engine)
        assert engine.report(list(engine.finished))["cuda_graphs"]["graphs"] == report["graphs"]
        for a, b in zip(graph, again):
            assert torch.equal(a, b)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
@pytest.mark.parametrize("lengths", [(1536, 512), (1500, 700)])
def test_graphs_above_index_topk_replay_equals_eager_bitwise(lengths, kv_dtype, monkeypatch):
    """Contexts longer than ``index_topk`` (the small config's 64). A captured step selects from
    the full logits where an eager one filters candidates first; both write the same set (ties
    to the lowest columns) of the same logits in ascending order. So two eager runs give the same
    bits, replayed steps those of the same padded steps run eagerly, and where no step was padded
    (1536 + 512 tokens in steps of 1024) those of the eager engine. The logits are the same bits
    in both kernels when they take the same tiles (the head sum's order follows the tile shape),
    so here both take one config; autotuned apart, the two paths may differ in the last bits of
    a logit and so pick another key on a near tie."""
    from test_kernels_indexer import pin_logits_configs

    pin_logits_configs(monkeypatch)
    model = _small_cuda()
    cfg = model.config
    ids = [torch.randint(0, cfg.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lengths]
    with torch.no_grad():
        eager, _ = _prefill(model, ids, 1024, False, kv_dtype=kv_dtype)
        again, _ = _prefill(model, ids, 1024, False, kv_dtype=kv_dtype)
        graph, engine = _prefill(model, ids, 1024, True, kv_dtype=kv_dtype)
        padded = PrefillEngine.for_prompts(model, list(lengths), chunked_prefill_size=1024,
                                           compute_logits=False, prefix_caching=False,
                                           cuda_graphs=True, kv_dtype=kv_dtype)
        padded_eager, _ = _prefill(model, ids, 1024, None, engine=_padded_eager(padded))
    assert all(s.cuda_graph for s in engine.timeline)
    for a, b in zip(eager, again):
        assert torch.equal(a, b), ("eager twice", _calc_diff(a, b))
    for a, b in zip(padded_eager, graph):
        assert torch.equal(a, b), ("graph against its padded steps run eagerly", _calc_diff(a, b))
    sizes = [sum(e - s for _, s, e in st.chunks) for st in engine.timeline]
    if all(token_bucket(n, cfg.page_size) == n for n in sizes):
        for a, b in zip(eager, graph):
            assert torch.equal(a, b), ("graph against eager", _calc_diff(a, b))
    else:
        assert lengths == (1500, 700)


@pytest.mark.cuda
def test_failed_check_inside_a_replayed_graph_raises():
    model = _small_cuda()
    ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, engine = _prefill(model, [ids], 512, True)
        model.model.layers[0].self_attn.kv_a_proj_with_mqa.weight[0, 0] = float("nan")
        engine.add_request(ids)
        with pytest.raises(ValueError, match="NaN or inf"):
            engine.run()
