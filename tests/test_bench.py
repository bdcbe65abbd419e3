"""The arithmetic behind scripts/bench.py's reported figures (the GPU timings themselves run on
the H200 only): the top-k overlap against HF and the per-component FLOP split."""

import importlib.util
import pathlib

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from glm_dsa.config import PRESETS
from glm_dsa.ledger import layer_flops_per_token, op_flops

_PATH = pathlib.Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
_SPEC = importlib.util.spec_from_file_location("glm_dsa_bench", _PATH)
bench = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(bench)


@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 60), topk=st.integers(1, 12))
@settings(max_examples=30)
def test_overlap_is_the_mean_shared_fraction_over_rows_with_more_keys_than_topk(seed, n, topk):
    gen = torch.Generator().manual_seed(seed)
    n_keys = torch.arange(1, n + 1)  # row i may choose among keys 0 … i
    a = torch.full((n, topk), -1, dtype=torch.int64)
    b = torch.full((n, topk), -1, dtype=torch.int64)
    for i in range(n):
        if i + 1 > topk:
            a[i] = torch.randperm(i + 1, generator=gen)[:topk]
            b[i] = torch.randperm(i + 1, generator=gen)[:topk]
    shared, rows = 0, 0
    for i in range(n):
        if i + 1 > topk:
            shared += len(set(a[i].tolist()) & set(b[i].tolist()))
            rows += 1
    got, got_rows = bench._overlap(a, b, n_keys, topk, block=7)
    assert got_rows == rows
    assert got == (shared / (rows * topk) if rows else 1.0)


def test_component_flops_partition_the_ledgers_layer_flops():
    """Projections + indexer projections + attention + MoE = the ledger's per-token FLOPs of a
    full MoE layer with sparse MLA over the keys each position has; the indexer's fp8 part is
    its causal (query, key) pairs."""
    cfg = PRESETS["glm-5.3"]
    for tokens in (1000, 32768, 131072):
        flops = bench.component_flops(cfg, tokens)
        per_token = {op.op: op.flops_per_token for op in op_flops(cfg)}
        full = layer_flops_per_token(cfg, full=True, moe=True, with_router=True)
        keys = sum(min(cfg.index_topk, i + 1) for i in range(tokens))
        mla = per_token["sparse_mla"] // cfg.index_topk * keys
        assert sum(b for b, _ in flops.values()) == tokens * (full - per_token["sparse_mla"]) + mla
        pairs = tokens * (tokens + 1) // 2
        assert flops["indexer"][1] == pairs * 2 * cfg.index_n_heads * cfg.index_head_dim
        assert all(f8 == 0 for name, (_, f8) in flops.items() if name != "indexer")
