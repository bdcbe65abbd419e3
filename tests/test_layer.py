"""The decoder layer and stack: shared-layer top-k reuse, and equality with dense attention."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import glm_dsa.indexer as indexer_mod
from glm_dsa.batch import ForwardBatch
from glm_dsa.cache import KVCache
from glm_dsa.config import PRESETS
from glm_dsa.budget import Budgets
from glm_dsa.layer import DSAForCausalLM, StepContext
from glm_dsa.mla import MLA
from glm_dsa.weights import init_weights

from dense_reference import assert_close_rel, stack_dense


def _model(cfg, dtype=torch.float64, seed=0):
    return init_weights(DSAForCausalLM(cfg).to(dtype), seed).eval()


def _run(model, ids, kv_dtype="fp64", budget=1 << 24):
    batch = ForwardBatch.contiguous([ids.numel()])
    cache = KVCache(model.config, num_pages=-(-ids.numel() // 64), kv_dtype=kv_dtype)
    with torch.no_grad():
        return model.model(ids, StepContext(batch, cache, Budgets(budget, budget)))


def test_shared_layers_run_no_indexer_and_reuse_the_previous_full_layers_topk(monkeypatch):
    cfg = PRESETS["small"]  # FFFSSSFS
    model = _model(cfg, torch.float32)
    calls, used = [], {}
    real_forward = indexer_mod.Indexer.forward

    def counting_forward(self, *args, **kwargs):
        out = real_forward(self, *args, **kwargs)
        calls.append(id(self))
        return out

    real_attend = MLA.attend

    def recording_attend(self, proj, kv, batch, topk, budget_bytes=None):
        used[id(self)] = topk.clone()
        return real_attend(self, proj, kv, batch, topk, budget_bytes)

    monkeypatch.setattr(indexer_mod.Indexer, "forward", counting_forward)
    monkeypatch.setattr(MLA, "attend", recording_attend)
    ids = torch.randint(0, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(0))
    _run(model, ids, "fp32")
    layers = model.model.layers
    full_ids = [id(layers[i].self_attn.indexer) for i in cfg.full_layers]
    assert calls == full_ids  # each full layer once, in order; shared layers none
    for i in cfg.shared_layers:
        assert layers[i].self_attn.indexer is None
        src = cfg.topk_source(i)
        assert torch.equal(used[id(layers[i].self_attn)], used[id(layers[src].self_attn)])
    # Sparsity bites: 200 tokens, index_topk 64 — late rows keep 64 keys.
    last = used[id(layers[0].self_attn)][-1]
    assert int((last >= 0).sum()) == cfg.index_topk


@given(length=st.integers(1, 64), seed=st.integers(0, 2**16))
def test_stack_equals_dense_causal_stack_when_topk_covers_every_key(length, seed):
    cfg = PRESETS["tiny"]  # index_topk 64 ≥ length: the MHA one-shot path
    model = _model(cfg, seed=seed)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(seed))
    ref = stack_dense(model.state_dict(), cfg, ids)
    assert_close_rel(_run(model, ids), ref, 1e-10)


@pytest.mark.parametrize("length", [37, 64])
def test_absorbed_sparse_stack_equals_dense_stack_when_topk_covers_every_key(length):
    # Threshold 0 forces the absorbed sparse path even for short prompts.
    cfg = PRESETS["tiny"].replace(dense_attn_kv_len_threshold=0)
    model = _model(cfg, seed=3)
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(1))
    ref = stack_dense(model.state_dict(), cfg, ids)
    assert_close_rel(_run(model, ids), ref, 1e-10)


def test_sparse_stack_equals_dense_stack_masked_to_each_layers_topk(monkeypatch):
    cfg = PRESETS["tiny"]
    model = _model(cfg, seed=5)
    ids = torch.randint(0, cfg.vocab_size, (150,), generator=torch.Generator().manual_seed(2))
    used = {}
    real_attend = MLA.attend

    def recording_attend(self, proj, kv, batch, topk, budget_bytes=None):
        used[id(self)] = topk.clone()
        return real_attend(self, proj, kv, batch, topk, budget_bytes)

    monkeypatch.setattr(MLA, "attend", recording_attend)
    out = _run(model, ids)
    allowed = []
    for layer in model.model.layers:
        topk = used[id(layer.self_attn)]
        allowed.append([set(int(j) for j in row if j >= 0) for row in topk])
    assert any(len(a) < m + 1 for m, a in enumerate(allowed[0]))  # some rows are truly sparse
    ref = stack_dense(model.state_dict(), cfg, ids, allowed)
    assert_close_rel(out, ref, 1e-10)


def test_shared_layer_without_topk_is_an_error():
    cfg = PRESETS["small"]
    model = _model(cfg, torch.float32)
    layer = model.model.layers[cfg.shared_layers[0]]
    batch = ForwardBatch.contiguous([8])
    cache = KVCache(cfg, 1, "fp32")
    with pytest.raises(ValueError, match="shared layer"):
        layer(torch.zeros(8, cfg.hidden_size), StepContext(batch, cache, Budgets(1 << 20, 1 << 20)), None)


def test_model_rejects_inputs_that_are_neither_ids_nor_hidden_states():
    cfg = PRESETS["tiny"]
    model = _model(cfg, torch.float32)
    with pytest.raises(ValueError, match="token ids"):
        _run(model, torch.zeros(4, dtype=torch.int32))


def test_each_full_layer_checks_its_indexer_inputs_once_per_step(monkeypatch):
    """Cores call cores: ``Indexer.forward`` checks ``x``, ``positions`` and ``q_latent`` once
    and calls the bare key and query projections, not the checked ``project_k`` / ``project_q``."""
    cfg = PRESETS["tiny"]
    model = _model(cfg, torch.float32)
    calls = []
    real = indexer_mod.Indexer._check_tokens
    monkeypatch.setattr(indexer_mod.Indexer, "_check_tokens",
                        lambda self, *a: calls.append(1) or real(self, *a))
    _run(model, torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(0)),
         kv_dtype="fp32")
    assert len(calls) == len(cfg.full_layers)
