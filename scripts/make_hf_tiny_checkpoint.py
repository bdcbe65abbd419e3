"""Write tests/data/hf_tiny: a checkpoint written by transformers' own ``save_pretrained``.

The dims are those of transformers' glm_moe_dsa model tests (kv_lora_rank 32, q_lora_rank 16,
qk 64 + 64, v 128), with a 64-wide index head (one FP8 scale per key, no 128-wide block) and
2 layers (a dense one, then an MoE one). Weights are drawn here at unit-scale variance (HF's
0.02 init leaves the layers near the identity), then HF's model writes the checkpoint and
runs its forward on seeded token ids; ``expected.safetensors`` keeps ``input_ids`` and HF's
``last_hidden_state`` (after the final norm), the independent result
``tests/test_hf_checkpoint.py`` matches when transformers is not installed.

    pip install 'transformers>=5.17' && python scripts/make_hf_tiny_checkpoint.py

Needs transformers (not a glm-dsa dependency). The context (48 tokens) is shorter than
``index_topk`` (64), so HF's unquantized indexer and glm-dsa's FP8 one select every key.
"""

from __future__ import annotations

import os

import torch
from safetensors.torch import save_file
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "data", "hf_tiny")
TOKENS = 48


def main() -> None:
    config = GlmMoeDsaConfig(
        vocab_size=99, hidden_size=32, intermediate_size=37, moe_intermediate_size=12,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=32, q_lora_rank=16, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=1, topk_group=1,
        index_topk=64, index_head_dim=64, index_n_heads=4, rms_norm_eps=1e-6,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = GlmMoeDsaForCausalLM(config).float().eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("e_score_correction_bias") or name.endswith(".bias"):
                p.copy_(0.1 * noise)
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise * p.shape[-1] ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(OUT)
    input_ids = torch.randint(0, config.vocab_size, (1, TOKENS), generator=gen)
    with torch.no_grad():
        hidden = model.model(input_ids=input_ids).last_hidden_state[0]
    save_file({"input_ids": input_ids[0].contiguous(), "last_hidden_state": hidden.contiguous()},
              os.path.join(OUT, "expected.safetensors"))


if __name__ == "__main__":
    main()
