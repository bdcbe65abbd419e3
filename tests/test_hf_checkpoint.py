"""A checkpoint written by transformers' ``save_pretrained`` loads and computes HF's function.

``tests/data/hf_tiny`` was written by ``scripts/make_hf_tiny_checkpoint.py`` with the dims of
transformers' glm_moe_dsa model tests (kv_lora_rank 32, q_lora_rank 16, qk 64 + 64, v 128, a
64-wide index head): dims the FP8 paths cannot tile, so it runs with an fp32 KV cache. Its
48 tokens are fewer than index_topk, so both indexers keep every key and the two models compute
one function. Expected: HF's forward, run live where transformers is installed, else the
``last_hidden_state`` the same script saved from it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from glm_dsa import KVCache, PrefillEngine, get_config, load_checkpoint

HF_TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_tiny")


def _ours(input_ids: torch.Tensor) -> torch.Tensor:
    model = load_checkpoint(HF_TINY, dtype=torch.float32).eval()
    engine = PrefillEngine(model, num_pages=1, kv_dtype="fp32", chunked_prefill_size=64)
    rid = engine.add_request(input_ids)
    engine.run()
    with torch.no_grad():
        return model.model.norm(engine.output_hidden(rid))  # HF's last_hidden_state is normed


def _hf(input_ids: torch.Tensor) -> torch.Tensor:
    transformers = pytest.importorskip("transformers", minversion="5.17")
    # The config without its layer_types, which the installed transformers fills in: 5.24 wrote
    # "indexed_attention", a name 5.17's validator does not know.
    with open(os.path.join(HF_TINY, "config.json")) as f:
        fields = {k: v for k, v in json.load(f).items()
                  if k not in ("layer_types", "architectures", "model_type", "transformers_version")}
    model = transformers.GlmMoeDsaForCausalLM.from_pretrained(
        HF_TINY, config=transformers.GlmMoeDsaConfig(**fields), dtype=torch.float32).eval()
    with torch.no_grad():
        return model.model(input_ids=input_ids[None]).last_hidden_state[0]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def test_hf_test_dims_config_loads_and_its_fp8_kv_cache_is_refused_with_the_fix():
    config = get_config(HF_TINY)
    assert (config.kv_lora_rank, config.q_lora_rank, config.qk_nope_head_dim, config.qk_rope_head_dim,
            config.v_head_dim, config.index_head_dim) == (32, 16, 64, 64, 128, 64)
    with pytest.raises(ValueError, match="kv_lora_rank=32 must be a multiple of 128"):
        KVCache(config, num_pages=1, kv_dtype="fp8")
    for kv_dtype in ("bf16", "fp32"):
        KVCache(config, num_pages=1, kv_dtype=kv_dtype)


def test_hf_written_checkpoint_matches_the_saved_hf_hidden_states():
    expected = load_file(os.path.join(HF_TINY, "expected.safetensors"))
    ours = _ours(expected["input_ids"])
    assert _rel(ours, expected["last_hidden_state"]) < 1e-3


def test_hf_written_checkpoint_matches_transformers_live():
    input_ids = load_file(os.path.join(HF_TINY, "expected.safetensors"))["input_ids"]
    hf = _hf(input_ids)
    assert _rel(_ours(input_ids), hf) < 1e-3
