"""The FP8-query attention mode (``PrefillEngine(attention_precision="fp8")``,
``--attention-precision fp8``): SGLang's Q8KV8 form on the triton backend, against the bf16 mode
on the same layer (Triton's interpreter on the CPU)."""

import pytest
import torch

from glm_dsa.backend import TritonBackend, get_backend
from glm_dsa.cli import main
from glm_dsa.config import PRESETS
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.oracle import calc_diff
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import init_weights

pytest.importorskip("triton")

# As tests/test_backend.py: absorbed path everywhere, one full and one shared layer, one
# 96-token request in two chunks (64, then 32 over a 64-token prefix).
CFG = PRESETS["tiny"].replace(dense_attn_kv_len_threshold=0, num_hidden_layers=2,
                              indexer_types=("full", "shared"), index_topk=64)
LENGTH, CHUNK = 96, 64


def _outputs(model, kv_dtype, attention_precision):
    eng = PrefillEngine(model, num_pages=8, kv_dtype=kv_dtype, chunked_prefill_size=CHUNK,
                        budget_bytes=1 << 20, backend="triton", layer_outputs=True,
                        attention_precision=attention_precision)
    rid = eng.add_request(torch.randint(0, CFG.vocab_size, (LENGTH,),
                                        generator=torch.Generator().manual_seed(3)))
    eng.run()
    return eng, eng.outputs([rid])


@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_fp8_attention_stays_close_to_bf16_and_leaves_the_top_k_alone(kv_dtype):
    """The first layer's inputs are the same in both modes, so its top-k is identical and its
    output differs by the FP8 attention alone: e4m3 q and context (3.6 % rms rounding each, the
    FP8 pool's latent moved exactly) and e4m3 softmax weights give calc_diff 1.6e-4 (FP8 pool)
    and 2.4e-4 (bf16 pool) on this model; a wrong scale or index is > 1e-1. The last layer's
    output (2 layers; the shared layer reuses the top-k over changed inputs) measured 3.6e-3
    and 7.6e-3."""
    model = init_weights(DSAForCausalLM(CFG), seed=5).eval()
    _, bf16 = _outputs(model, kv_dtype, "bf16")
    eng, fp8 = _outputs(model, kv_dtype, "fp8")
    assert eng.backend.attention_precision == "fp8" and not eng.batch_invariant
    assert eng.graphs is None
    assert torch.equal(fp8["request.0.layer.0.topk"], bf16["request.0.layer.0.topk"])
    first = calc_diff(fp8["request.0.layer.0.hidden"].double(), bf16["request.0.layer.0.hidden"].double())
    assert 0 < first <= 1e-3
    assert calc_diff(fp8["request.0.hidden"].double(), bf16["request.0.hidden"].double()) <= 2e-2


def test_bad_precisions_are_refused_with_one_line_before_any_compute():
    cases = [
        (dict(name="triton", attention_precision="fp16"), "choose one of bf16, fp8"),
        (dict(name="reference", attention_precision="fp8"), "runs on the triton backend"),
        (dict(name="triton", attention_precision="fp8", batch_invariant=True), "not batch-invariant"),
        (dict(name=TritonBackend(), attention_precision="fp8"), "build it with"),
        (dict(name=TritonBackend("fp8")), "attends in fp8"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            get_backend(device="cpu", **kwargs)
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match="choose one of bf16, fp8"):
        TritonBackend("e5m2")
    assert get_backend("triton", "cpu", attention_precision="fp8").attention_precision == "fp8"


def test_the_cli_refuses_fp8_attention_on_another_backend(capsys):
    argv = ["prefill", "--config", "tiny", "--no-progress", "--tokens", "64", "--backend", "reference",
            "--attention-precision", "fp8"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--attention-precision" in err[0] and "triton" in err[0], err


@pytest.mark.cuda
@pytest.mark.parametrize("kv_dtype", ["fp8", "bf16"])
def test_cuda_glm_width_layer_in_fp8_attention(kv_dtype, caplog):
    """GLM-5.3's layer 6 widths in bf16 on the GPU (64 heads, latent 512 + 64: the Gluon Q8KV8
    kernel on sm_90), 3,000 tokens in two steps over a top-2048: the top-k identical to the bf16
    mode's, the layer's output within calc_diff 1e-3 of it (printed: the figure issue #42 asks
    for). Both modes run the engine's fast (not batch-invariant) path, the only one fp8 takes:
    the invariant path's indexer may break near-ties of the logits differently."""
    import logging

    from glm_dsa.config import keep_layers
    from glm_dsa.kernels import sparse_mla_q8kv8

    # Few, narrow experts and a small vocabulary: attention is what differs between the modes.
    cfg = keep_layers(PRESETS["glm-5.3"], "6:7").replace(
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=256, vocab_size=1024)
    model = init_weights(DSAForCausalLM(cfg), seed=0).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (3000,), generator=torch.Generator().manual_seed(1))
    out = {}
    sparse_mla_q8kv8._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="glm_dsa.kernels"):
        for precision in ("bf16", "fp8"):
            eng = PrefillEngine(model, num_pages=64, kv_dtype=kv_dtype, chunked_prefill_size=2048,
                                backend="triton", layer_outputs=True,
                                attention_precision=precision, batch_invariant=False)
            rid = eng.add_request(ids)
            eng.run()
            out[precision] = eng.outputs([rid])
    said = [r.getMessage() for r in caplog.records if "Q8KV8" in r.getMessage()]
    assert torch.equal(out["fp8"]["request.0.layer.0.topk"], out["bf16"]["request.0.layer.0.topk"])
    diff = calc_diff(out["fp8"]["request.0.layer.0.hidden"].double(),
                     out["bf16"]["request.0.layer.0.hidden"].double())
    print(f"GLM-width layer, {kv_dtype} KV: fp8 attention calc_diff vs bf16 {diff:.3e}; {said}")
    assert 0 < diff <= 1e-3
