"""A fourth backend, written here without touching glm_dsa: it subclasses ``Backend``, brings
its own fused passes, and the model runs them (on the CPU, where the built-in backends' passes
are the torch forms), so every pass is dispatched through the backend."""

from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from glm_dsa import fused, moe
from glm_dsa.backend import Backend, ReferenceBackend, get_backend
from glm_dsa.config import PRESETS
from glm_dsa.fp8 import act_quant
from glm_dsa.hadamard import hadamard_transform
from glm_dsa.kv_format import index_k_store
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.prefill import PrefillEngine
from glm_dsa.rope import apply_rope
from glm_dsa.weights import init_weights

# MoE layers and full and shared indexer layers; two chunks, so the second scores a prefix.
CFG = PRESETS["tiny"].replace(num_hidden_layers=3, indexer_types=("full", "full", "shared"))
LENGTH, CHUNK = 96, 64


class _CountedPasses(fused.Passes):
    """Every fused pass taken, computed with the torch formula (float32 rows: the model's bits),
    and counted. The passes run inside a step; one may itself call the model's torch form
    under ``fused.TORCH``."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()

    def moe_single_pass(self, device, dtype) -> bool:
        self.calls["moe_single_pass"] += 1
        return False

    def swiglu(self, gate, up, dtype):
        self.calls["swiglu"] += 1
        return (F.silu(gate.float()) * up.float()).to(dtype)

    def combine_experts(self, expert_out, position, weights, shared, row_mask, out):
        self.calls["combine_experts"] += 1
        with fused.using(fused.TORCH):  # the model's own torch form, no pass taking the call
            return moe.combine_experts(expert_out, position, weights, shared, row_mask, out)

    def gather_rows(self, x, rows):
        self.calls["gather_rows"] += 1
        return x[rows]

    def index_quant(self, x, cos_sin, rope_dim, interleaved, scale_fmt):
        self.calls["index_quant"] += 1
        cos, sin = cos_sin()
        x_pe, x_nope = x.split([rope_dim, x.shape[-1] - rope_dim], dim=-1)
        rotated = torch.cat([apply_rope(x_pe, cos, sin, interleaved), x_nope], dim=-1)
        return act_quant(hadamard_transform(rotated, x.shape[-1] ** -0.5), x.shape[-1], scale_fmt)

    def index_quant_store(self, x, cos_sin, rope_dim, interleaved, scale_fmt, pages, slots, page_size):
        self.calls["index_quant_store"] += 1
        k_fp8, k_scale = self.index_quant(x, cos_sin, rope_dim, interleaved, scale_fmt)
        index_k_store(pages, slots, k_fp8, k_scale[:, 0], page_size)
        return True


class _FourthBackend(ReferenceBackend):
    """The reference's operations, with passes of its own and capabilities of its own."""

    name = "fourth"
    batch_invariant = False
    activation_dtypes = (torch.float32,)

    def __init__(self) -> None:
        self.passes = _CountedPasses()


def _run(backend) -> torch.Tensor:
    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()
    eng = PrefillEngine(model, num_pages=4, kv_dtype="fp32", chunked_prefill_size=CHUNK,
                        budget_bytes=1 << 20, backend=backend)
    rid = eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,),
                                        generator=torch.Generator().manual_seed(3)))
    eng.run()
    return eng.output_hidden(rid)


def test_a_fourth_backend_replaces_every_fused_pass_and_the_model_runs_them():
    fourth = _FourthBackend()
    hidden = _run(fourth)
    assert torch.equal(hidden, _run("reference"))  # same formulas, same bits
    calls = fourth.passes.calls
    assert set(calls) == {"moe_single_pass", "swiglu", "combine_experts", "gather_rows",
                          "index_quant", "index_quant_store"}, calls
    # Two steps: each full layer quantizes its keys (stored) and its queries once per step.
    assert calls["index_quant_store"] == 2 * 2
    # Outside a step the built-in passes are active again.
    assert fused.active() is fused.TRITON_ON_CUDA


def test_a_fourth_backend_states_its_capabilities_as_attributes():
    fourth = _FourthBackend()
    assert get_backend(fourth, "cpu", torch.float32, "fp32") is fourth
    with pytest.raises(ValueError, match="^the fourth backend runs float32 activations "):
        get_backend(fourth, "cpu", torch.bfloat16, "fp32")
    with pytest.raises(ValueError, match="^batch-invariant mode .* the fourth kernels are not batch-invariant"):
        get_backend(fourth, "cpu", torch.float32, "fp32", batch_invariant=True)
    assert not Backend.graph_capturable and not fourth.graph_capturable
