"""Batch invariance on the triton backend: a request's bits whatever the chunking, the requests
beside it, its prefix-cache hits, the byte budgets and (on CUDA) graph replay.

Every expected value is the same request run alone in one step (or with other settings): the
property is bitwise equality. On the CPU the triton kernels run in Triton's interpreter
(``tests/conftest.py``); the CUDA tests run GLM-5.3's widths on the GPU.
"""

import pytest
import torch

from glm_dsa import invariant
from glm_dsa.config import PRESETS, keep_layers
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights

pytest.importorskip("triton")

TINY = PRESETS["tiny"]
_MODELS: dict = {}


def _model(config, seed=0, device="cpu", dtype=torch.float32):
    key = (repr(config), seed, device, dtype)
    if key not in _MODELS:
        model = DSAForCausalLM(config)
        _MODELS[key] = init_weights(model, seed=seed).to(device=device, dtype=dtype).eval()
    return _MODELS[key]


def _ids(n, seed, vocab):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _prefill(model, prompts, chunk, kv_dtype, budget, warm=None, **engine):
    """Per prompt: (hidden [L, hidden], logits [vocab], cached length), run together."""
    device = next(model.parameters()).device
    eng = PrefillEngine(model, num_pages=400, kv_dtype=kv_dtype, chunked_prefill_size=chunk,
                        budget_bytes=budget, backend="triton", batch_invariant=True, **engine)
    if warm is not None:
        eng.warm_up(warm.to(device))
    rids = [eng.add_request(p.to(device)) for p in prompts]
    eng.run()
    return [(eng.output_hidden(r), eng.finished[r].logits, eng.finished[r].cached_len) for r in rids]


def _assert_equal(got, want, what):
    for i, ((h, lg, _), (h1, lg1, _)) in enumerate(zip(got, want)):
        assert torch.equal(h, h1), f"{what}: request {i} hidden"
        assert torch.equal(lg, lg1), f"{what}: request {i} logits"


# --------------------------------------------------------------------------------- the tiles
def test_fixed_tiles_call_every_tile_with_one_shape_and_layout():
    seen = []

    def spy(t):
        seen.append((tuple(t.shape), t.is_contiguous(), t.clone()))
        return t * 2

    x = torch.arange(1, 12, dtype=torch.float32)[:, None].repeat(1, 3)[:, :2]  # 11 rows, strided
    out = invariant.fixed_tiled(spy, x, tile=4)
    assert torch.equal(out, x * 2)
    assert [(s, c) for s, c, _ in seen] == [((4, 2), True)] * 3
    assert torch.equal(seen[-1][2][3:], torch.zeros(1, 2))  # the last tile zero-padded
    assert torch.equal(seen[-1][2][:3], x[8:])


def test_the_mode_tiles_by_position_off_cuda_and_whole_tiles_on_cuda():
    assert invariant.row_tile(torch.device("cuda")) == invariant.CUDA_ROW_TILE
    assert invariant.row_tile(torch.device("cpu")) == invariant.ROW_TILE
    assert invariant.CUDA_ROW_TILE % invariant.ROW_TILE == 0
    with invariant.batch_invariant():
        assert invariant.whole_tiles(100, 1000, torch.device("cpu")) == 64
        assert invariant.whole_tiles(10, 1000, torch.device("cpu")) == 64
        assert invariant.whole_tiles(5000, 9000, torch.device("cuda")) == 4096
        assert invariant.whole_tiles(1000, 1000, torch.device("cuda")) == 1000  # no split
    assert invariant.whole_tiles(100, 1000, torch.device("cpu")) == 100  # outside the mode


# ----------------------------------------------------------------- the kernels, a row's own
def test_triton_sparse_attention_gives_a_row_the_same_bits_in_any_call():
    from glm_dsa import kernels
    from glm_dsa.kv_format import mla_kv_quantize

    g = torch.Generator().manual_seed(1)
    q = torch.randn(7, 4, 144, generator=g)
    kv = torch.randn(90, 1, 144, generator=g)
    idx = torch.randint(-2, 92, (7, 1, 40), generator=g).to(torch.int32)
    whole = kernels.flash_mla_sparse_fwd(q, kv, idx, 0.1, 128)
    kv_rows = mla_kv_quantize(kv[:, 0, :128], kv[:, 0, 128:])  # FP8 656-byte-style rows
    whole8 = kernels.sparse_mla_fwd_fp8(q, kv_rows, idx, 0.1, 128)
    for r in (0, 3, 6):
        one = kernels.flash_mla_sparse_fwd(q[r:r + 1], kv, idx[r:r + 1], 0.1, 128)
        one8 = kernels.sparse_mla_fwd_fp8(q[r:r + 1], kv_rows, idx[r:r + 1], 0.1, 128)
        for a, b in zip((*one, *one8), (*whole, *whole8)):
            assert torch.equal(a[0], b[r]), r


# ---------------------------------------------------------------- the engine, CPU interpreter
def test_triton_requests_keep_their_bits_across_chunks_neighbours_budgets_and_prefix_hits(
        shuffled_atomics):
    """One full layer of ``tiny`` (the interpreter is slow): two requests in one one-shot step,
    against the same two in reverse order at one-page chunks with one-row budgets, the first
    then a prefix-cache hit that leaves it a one-row tail. The indexer's candidate buffers fill
    in a shuffled order on the CPU (``shuffled_atomics``), another in each run, as on a GPU."""
    model = _model(keep_layers(TINY, "2:3"))
    prefix = _ids(64, 9, TINY.vocab_size)
    first, second = torch.cat([prefix, _ids(1, 10, TINY.vocab_size)]), _ids(70, 11, TINY.vocab_size)
    once = _prefill(model, [first, second], 1 << 14, "fp32", 1 << 24)
    (h2, lg2, _), (h1, lg1, cached) = _prefill(model, [second, first], 64, "fp32", 1, warm=prefix)
    assert cached == 64
    assert torch.equal(h1, once[0][0][64:]) and torch.equal(lg1, once[0][1]), "prefix hit, 1-row tail"
    assert torch.equal(h2, once[1][0]) and torch.equal(lg2, once[1][1]), "chunk 64, one-row budget"


# ----------------------------------------------------------------------- the engine, on CUDA
def _glm_layers(device):
    # GLM-5.3's widths for layers 6 (full indexer, MoE) and 7 (shared top-k), 16 experts of the
    # real width and a 4,096-token vocabulary.
    cfg = keep_layers(PRESETS["glm-5.3"], "6:8").replace(
        n_routed_experts=16, num_experts_per_tok=4, moe_intermediate_size=2048, vocab_size=4096)
    return _model(cfg, device=device, dtype=torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8"])
def test_cuda_triton_glm_layers_are_bitwise_invariant(kv_dtype):
    """One-page chunks and 32K, odd lengths sharing steps, a one-row tail after a prefix hit,
    budgets of one row and of all rows, graphs against eager: all the same bits as alone."""
    model = _glm_layers("cuda")
    vocab = model.config.vocab_size
    prompts = [_ids(n, 70 + n, vocab) for n in (2500, 1337, 4097)]
    alone = [_prefill(model, [p], 32768, kv_dtype, None, cuda_graphs=False)[0] for p in prompts]
    for chunk in (64, 4096, 32768):
        _assert_equal(_prefill(model, prompts, chunk, kv_dtype, None, cuda_graphs=False), alone,
                      f"chunk {chunk} eager")
    _assert_equal(_prefill(model, prompts, 4096, kv_dtype, None, cuda_graphs=True), alone,
                  "chunk 4096 graphs")
    _assert_equal(_prefill(model, prompts, 32768, kv_dtype, 1, cuda_graphs=False), alone,
                  "budget of one row")
    prefix = prompts[0][:2496]
    tails = [torch.cat([prefix, _ids(n, 5 + n, vocab)]) for n in (1, 64, 65)]
    want = [_prefill(model, [p], 32768, kv_dtype, None, cuda_graphs=False)[0] for p in tails]
    hit = _prefill(model, tails, 64, kv_dtype, None, warm=prefix, cuda_graphs=False)
    for (h, lg, cached), (h1, lg1, _) in zip(hit, want):
        assert cached == 2496
        assert torch.equal(h, h1[cached:]) and torch.equal(lg, lg1)
