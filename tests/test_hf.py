"""HF transformers interop: the fused-expert mapping, and HF's model on our weights.

transformers is not a dependency of glm-dsa: the model comparison is skipped where it is not
installed (CI); the mapping itself needs nothing but torch.
"""

import pytest
import torch

from glm_dsa.config import get_config
from glm_dsa.hf import hf_state_dict
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights

TINY = get_config("tiny")


def test_hf_state_dict_fuses_each_moe_layers_experts_and_keeps_the_rest():
    model = init_weights(DSAForCausalLM(TINY), seed=5)
    state = model.state_dict()
    hf = hf_state_dict(state, TINY)
    n_exp = TINY.n_routed_experts
    for i in range(TINY.num_hidden_layers):
        p = f"layers.{i}.mlp."
        if not TINY.is_moe(i):
            assert f"{p}experts.gate_up_proj" not in hf
            continue
        gate_up, down = hf[f"{p}experts.gate_up_proj"], hf[f"{p}experts.down_proj"]
        assert gate_up.shape == (n_exp, 2 * TINY.moe_intermediate_size, TINY.hidden_size)
        assert down.shape == (n_exp, TINY.hidden_size, TINY.moe_intermediate_size)
        inter = TINY.moe_intermediate_size
        for e in range(n_exp):
            ours = f"model.{p}experts.{e}."
            assert torch.equal(gate_up[e, :inter], state[ours + "gate_proj.weight"])
            assert torch.equal(gate_up[e, inter:], state[ours + "up_proj.weight"])
            assert torch.equal(down[e], state[ours + "down_proj.weight"])
            assert not any(k.startswith(f"{p}experts.{e}.") for k in hf)
    unfused = {k[len("model."):] for k in state if k.startswith("model.") and ".experts." not in k}
    assert unfused <= set(hf)
    assert "lm_head.weight" not in hf and not any(k.startswith("model.") for k in hf)


def test_hf_state_dict_names_a_missing_expert():
    state = init_weights(DSAForCausalLM(TINY), seed=5).state_dict()
    del state["model.layers.2.mlp.experts.3.up_proj.weight"]
    with pytest.raises(ValueError, match=r"layers\.2\.mlp\.experts: up_proj present for 7 of 8"):
        hf_state_dict(state, TINY)


@pytest.mark.parametrize("length", [40, 64])
def test_hf_model_on_our_weights_computes_our_function_while_topk_covers_the_context(length):
    """With index_topk ≥ length the top-k keeps every key, so HF (unquantized indexer, dense
    masked attention, expanded K/V) and glm-dsa (FP8 indexer, absorbed/MHA paths over a float64
    cache) compute one function. Both in float64; HF's float32 RoPE tables bound the agreement."""
    pytest.importorskip("transformers", minversion="5.17")
    from glm_dsa.hf import hf_model

    cfg = TINY.replace(rms_norm_eps=1e-6)  # HF's latent norms are fixed at 1e-6
    assert length <= cfg.index_topk
    model = init_weights(DSAForCausalLM(cfg).double(), seed=1).eval()
    hf = hf_model(model, attn_implementation="eager", experts_implementation="eager")
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    engine = PrefillEngine(model, 8, "fp64", 256, 1 << 30, compute_logits=False)
    rid = engine.add_request(ids)
    engine.run()
    with torch.no_grad():
        ours = model.model.norm(engine.output_hidden(rid))
        theirs = hf(input_ids=ids[None]).last_hidden_state[0]
    err = (ours - theirs).abs().max() / theirs.abs().max()
    assert err <= 1e-5, f"relative error {err:.2e}"
