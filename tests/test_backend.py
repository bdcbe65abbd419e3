"""The triton backend runs the same prefill as the reference (Triton's interpreter on the CPU)."""

import pytest
import torch

from glm_dsa.backend import REFERENCE, Backend, ReferenceBackend, TritonBackend, get_backend
from glm_dsa.batch import ForwardBatch
from glm_dsa.config import PRESETS, YarnScaling
from glm_dsa.indexer import mqa_logits
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.oracle import calc_diff
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights

triton = pytest.importorskip("triton")

# Absorbed path everywhere (threshold 0); one full and one shared layer, and one 96-token request
# in two chunks (64, then 32 over a 64-token prefix): Triton's interpreter is slow (about 0.1 s
# per query row of the sparse kernel), so the test stays this small.
CFG = PRESETS["tiny"].replace(dense_attn_kv_len_threshold=0, num_hidden_layers=2,
                              indexer_types=("full", "shared"), index_topk=64)
LENGTH, CHUNK = 96, 64


def _prefill(model, backend, kv_dtype):
    """Hidden states of the request, and every full layer's checks of its top-k."""
    eng = PrefillEngine(model, num_pages=8, kv_dtype=kv_dtype, chunked_prefill_size=CHUNK,
                        budget_bytes=1 << 20, backend=backend)
    rid = eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,),
                                        generator=torch.Generator().manual_seed(3)))
    eng.run()
    return eng.output_hidden(rid)


def _selection_is_a_top_k(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, picked):
    """Row by row, ``picked`` (request-relative, -1 padded) is a set of the ``topk`` best keys of
    the reference logits: every picked key scores at least the k-th best (ties may go either
    way: ReLU makes exact zeros common at these sizes)."""
    logits = mqa_logits(q_fp8, k_fp8, k_scale, weights, ks, ke)
    for m in range(q_fp8.shape[0]):
        row = logits[m, int(ks[m]) : int(ke[m])]
        chosen = picked[m][picked[m] >= 0].long()
        assert chosen.unique().numel() == chosen.numel() == min(topk, row.numel())
        if row.numel() > topk:
            kth = row.topk(topk).values[-1]
            assert bool((row[chosen] >= kth).all()), f"row {m} picked a key below the k-th score"


def test_backend_choice():
    assert get_backend("reference", "cpu") is REFERENCE
    assert get_backend("auto", "cpu") is REFERENCE
    assert get_backend("triton", "cpu").name == "triton"  # conftest sets TRITON_INTERPRET=1
    with pytest.raises(ValueError, match="choose one of auto, reference, triton, peers"):
        get_backend("cuda", "cpu")


def test_peers_backend_is_refused_with_one_line_when_it_cannot_run():
    with pytest.raises(ValueError, match="^the peers backend cannot run here: .*run on CUDA devices.*--device cuda$"):
        get_backend("peers", "cpu")


def test_peers_backend_is_refused_when_the_kernels_do_not_import(monkeypatch):
    from glm_dsa import peers

    monkeypatch.setattr(peers, "available", lambda module: module == "triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(ValueError, match="deep_gemm, flash_mla_sparse_sm90 do\\(es\\) not import; build"):
        get_backend("peers", "cuda")


def test_peers_backend_is_chosen_when_the_kernels_import(monkeypatch):
    from glm_dsa import backend as backend_mod, peers

    monkeypatch.setattr(peers, "available", lambda module: True)
    chosen = get_backend("peers", "cuda")
    assert isinstance(chosen, backend_mod.PeersBackend) and chosen.name == "peers"
    assert chosen.indexer_topk.__func__ is backend_mod.PeersBackend.indexer_topk


def test_peers_backend_refuses_what_flashmla_cannot_read_before_any_compute():
    from glm_dsa.backend import PeersBackend

    peers_backend = PeersBackend()
    peers_backend.require(torch.bfloat16, "fp8")
    peers_backend.require(torch.bfloat16, "bf16")
    with pytest.raises(ValueError, match="bfloat16 activations .*--dtype bfloat16"):
        peers_backend.require(torch.float32, "fp8")
    with pytest.raises(ValueError, match="fp8 or bf16 KV .*--kv-dtype"):
        peers_backend.require(torch.bfloat16, "fp32")
    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()  # float32: refused at construction
    with pytest.raises(ValueError, match="bfloat16 activations"):
        PrefillEngine(model, num_pages=8, backend=peers_backend)


class _CountingBackend(Backend):
    """A backend from outside glm_dsa: the reference's operations, counted. The seam is right
    when such an object runs the layer with no change anywhere else."""

    name = "counting"

    def __init__(self):
        self.calls = {"require": 0, "indexer_topk": 0, "attend": 0}

    def require(self, dtype, kv_dtype):
        self.calls["require"] += 1

    def indexer_topk(self, *args):
        self.calls["indexer_topk"] += 1
        return REFERENCE.indexer_topk(*args)

    def attend(self, attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes):
        self.calls["attend"] += 1
        return REFERENCE.attend(attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes)


def test_a_backend_object_injected_runs_the_layer_and_decides_its_attention():
    """``PrefillEngine(backend=obj)`` takes any object with the ``Backend`` methods; the layer
    calls its ``indexer_topk`` on full layers and its ``attend`` on every layer, and the
    result is the reference's (it delegates to it)."""
    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()
    ref = _prefill(model, "reference", "fp32")
    counting = _CountingBackend()
    eng = PrefillEngine(model, num_pages=8, kv_dtype="fp32", chunked_prefill_size=CHUNK,
                        budget_bytes=1 << 20, backend=counting)
    assert eng.backend is counting
    rid = eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,),
                                        generator=torch.Generator().manual_seed(3)))
    eng.run()
    steps = len(eng.timeline)
    assert counting.calls == {"require": 1, "indexer_topk": steps, "attend": 2 * steps}
    assert torch.equal(eng.output_hidden(rid), ref)


def test_engine_resolves_auto_once_and_takes_the_budgets_default():
    from glm_dsa.budget import CPU_BUDGET_BYTES, Budgets

    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()
    eng = PrefillEngine(model, num_pages=8)
    assert eng.backend is REFERENCE  # auto on the CPU
    # On the CPU the MoE's default is the same reservation (under its 3 GiB cap).
    assert eng.budgets == Budgets(CPU_BUDGET_BYTES, CPU_BUDGET_BYTES, CPU_BUDGET_BYTES)
    assert PrefillEngine(model, num_pages=8, budget_bytes=4096).budgets == Budgets(4096, 4096, 4096)
    with pytest.raises(ValueError, match="logits_bytes=0 must be a positive int"):
        Budgets(0, 1)
    with pytest.raises(ValueError, match="moe_bytes=0 must be a positive int"):
        Budgets(1, 1, 0)


def test_triton_backend_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        get_backend("triton", "cpu")


def test_triton_indexer_picks_a_top_k_of_the_reference_logits():
    """index_topk 64 < the second chunk's contexts: every Triton top-k is a top-k set of the
    reference's exact logits."""
    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()
    base = get_backend("triton", "cpu")
    calls = []

    def checked(*args):
        picked = base.indexer_topk(*args)
        _selection_is_a_top_k(*args[:7], picked)
        calls.append(args[0].shape[0])
        return picked

    eng = PrefillEngine(model, num_pages=8, kv_dtype="fp32", chunked_prefill_size=CHUNK,
                        budget_bytes=1 << 20, backend="triton")
    eng.backend.indexer_topk = checked
    eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,), generator=torch.Generator().manual_seed(3)))
    eng.run()
    assert calls == [CHUNK, LENGTH - CHUNK]


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp8"])
def test_triton_attention_equals_reference_for_the_same_selection(kv_dtype):
    """Selections forced equal (the reference indexer under both): the paged sparse attention
    reading the pool (fp32 rows, or FP8 rows dequantized in the kernel) gives the reference's
    hidden states; only float32 summation orders differ."""
    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()
    ref = _prefill(model, "reference", kv_dtype)
    eng = PrefillEngine(model, num_pages=8, kv_dtype=kv_dtype, chunked_prefill_size=CHUNK,
                        budget_bytes=1 << 20, backend="triton")
    eng.backend.indexer_topk = REFERENCE.indexer_topk
    rid = eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,),
                                        generator=torch.Generator().manual_seed(3)))
    eng.run()
    assert calc_diff(eng.output_hidden(rid).double(), ref.double()) <= 1e-5


def test_triton_backend_replaces_the_mha_form_of_short_contexts():
    """Contexts ≤ index_topk: the reference runs its expanded MHA one-shot form, the triton
    backend absorbed sparse attention over every key; the two are one function."""
    cfg = PRESETS["tiny"].replace(num_hidden_layers=2, indexer_types=("full", "shared"))
    model = init_weights(DSAForCausalLM(cfg), seed=5).eval()
    ids = torch.randint(0, cfg.vocab_size, (60,), generator=torch.Generator().manual_seed(4))
    hidden = {}
    for backend in ("reference", "triton"):
        eng = PrefillEngine(model, num_pages=2, kv_dtype="fp32", chunked_prefill_size=64,
                            budget_bytes=1 << 20, backend=backend)
        rid = eng.add_request(ids)
        eng.run()
        hidden[backend] = eng.output_hidden(rid).double()
    assert model.model.layers[0].self_attn.use_mha(ForwardBatch.contiguous([60]))  # the reference's form
    assert calc_diff(hidden["triton"], hidden["reference"]) <= 1e-5


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_peers_backend_runs_the_layer_with_stand_in_kernels(monkeypatch, kv_dtype):
    """The peers backend's plumbing on the CPU: DeepGEMM and FlashMLA stood in by the oracle
    functions with their signatures (``fp8_mqa_logits``, ``sparse_prefill_fwd``); its hidden
    states equal the reference backend's up to the bf16 absorbed query and GEMMs of the kernel
    backends (the FP8 pool is dequantized for FlashMLA, the bf16 pool read in place). On this
    bf16 tiny model the triton backend over the reference's own top-k measures 3.75e-3 against
    the reference; an index off by one gives 5.7e-2."""
    from types import SimpleNamespace

    from glm_dsa import oracle, peers
    from glm_dsa.backend import PeersBackend

    stand_ins = {
        peers.DEEP_GEMM: SimpleNamespace(fp8_mqa_logits=oracle.fp8_mqa_logits),
        peers.FLASH_MLA: SimpleNamespace(sparse_prefill_fwd=lambda *a: [
            t.to(torch.bfloat16) if i == 0 else t for i, t in enumerate(oracle.flash_mla_sparse_fwd(*a))]),
    }
    monkeypatch.setattr(peers, "_module", stand_ins.__getitem__)
    model = init_weights(DSAForCausalLM(CFG), seed=5).to(torch.bfloat16).eval()
    hidden = {}
    for name, backend in (("reference", "reference"), ("peers", PeersBackend())):
        eng = PrefillEngine(model, num_pages=8, kv_dtype=kv_dtype, chunked_prefill_size=CHUNK,
                            budget_bytes=1 << 20, backend=backend)
        rid = eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,),
                                            generator=torch.Generator().manual_seed(3)))
        eng.run()
        hidden[name] = eng.output_hidden(rid).double()
    assert calc_diff(hidden["peers"], hidden["reference"]) <= 5e-3


# YaRN scaling makes the softmax scale differ from qk_head_dim ** -0.5 (mscale² = 1.297).
MULTI = CFG.replace(rope_scaling=YarnScaling(factor=4.0, original_max_position_embeddings=64))
MULTI_LENGTHS = (70, 45, 30)


def _past_the_window(*args):
    """The reference top-k with, in every row, the next token's key (in the pool, one past the
    causal limit) and a key past the request's context listed too: both must be skipped."""
    picked = REFERENCE.indexer_topk(*args).clone()
    ks, ke = args[4].long(), args[5].long()
    picked[:, -1] = (ke - ks).to(torch.int32)
    picked[:, -2] = (ke - ks + 40).to(torch.int32)
    return picked


def _multi_prefill(model, name):
    backend = ReferenceBackend() if name == "reference" else get_backend(name, "cpu")
    backend.indexer_topk = _past_the_window  # an instance of its own: REFERENCE stays as it is
    row_bytes = MULTI.num_attention_heads * (MULTI.kv_latent_dim + MULTI.kv_lora_rank + MULTI.v_head_dim) * 4
    eng = PrefillEngine(model, num_pages=12, kv_dtype="fp32", chunked_prefill_size=128,
                        budget_bytes=24 * row_bytes, backend=backend)  # 24-row chunks, the last partial
    g = torch.Generator().manual_seed(8)
    rids = [eng.add_request(torch.randint(0, MULTI.vocab_size, (n,), generator=g)) for n in MULTI_LENGTHS]
    eng.run()
    return [eng.output_hidden(r) for r in rids]


def test_triton_forward_paged_equals_reference_over_requests_row_chunks_and_the_causal_limit():
    """The triton backend's whole attention path (slots from each request's ks, the causal
    limit, row chunks of 24 with a partial last one, the softmax scale, float32 values) against
    the reference, with the same selection: three requests sharing steps, fp32 KV."""
    model = init_weights(DSAForCausalLM(MULTI), seed=6).eval()
    assert MULTI.softmax_scale != MULTI.qk_head_dim ** -0.5
    ref, got = _multi_prefill(model, "reference"), _multi_prefill(model, "triton")
    for r, g in zip(ref, got):
        err = float((g.double() - r.double()).abs().max() / r.double().abs().max())
        assert err < 1e-4, err  # float32 summation order only; a bf16 rounding would be ~4e-3


def test_auto_on_any_cuda_device_is_triton_with_its_kernels(monkeypatch):
    from glm_dsa import kernels

    sentinel = object()
    monkeypatch.setattr(kernels, "indexer_topk", lambda *args: sentinel)
    for device in ("cuda", "cuda:0", "cuda:3", torch.device("cuda", 1)):
        backend = get_backend("auto", device)
        assert isinstance(backend, TritonBackend), device
        assert backend.indexer_topk(None) is sentinel  # wired to the Triton top-k, not the reference's
        assert type(backend).attend is TritonBackend.attend
    assert get_backend("triton", "cuda:0").indexer_topk(None) is sentinel
    assert get_backend("auto", "cpu") is REFERENCE
