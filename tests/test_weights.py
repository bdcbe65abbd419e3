"""Checkpoint I/O: HF names, FP8 block scales, strict errors, and the committed weights_stub/."""

import json
import math
import pathlib
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from formats import E4M3
from glm_dsa.config import PRESETS, from_hf_config
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import CheckpointError, init_weights, load_checkpoint, load_state_dict, save_checkpoint

STUB = pathlib.Path(__file__).resolve().parent.parent / "weights_stub"


def _tiny(dtype=torch.bfloat16, seed=0):
    return init_weights(DSAForCausalLM(PRESETS["tiny"]).to(dtype), seed)


def test_hf_names_cover_the_layer_and_shared_layers_have_no_indexer():
    keys = set(DSAForCausalLM(PRESETS["small"]).state_dict())
    for name in ["q_a_proj", "q_a_layernorm", "q_b_proj", "kv_a_proj_with_mqa", "kv_a_layernorm",
                 "kv_b_proj", "o_proj"]:
        assert f"model.layers.0.self_attn.{name}.weight" in keys
    for name in ["wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight"]:
        assert f"model.layers.0.self_attn.indexer.{name}" in keys
        assert f"model.layers.3.self_attn.indexer.{name}" not in keys  # layer 3 is shared
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # dense (first_k_dense_replace = 2)
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in keys
    assert "model.layers.2.mlp.experts.15.down_proj.weight" in keys
    assert "model.layers.2.mlp.shared_experts.up_proj.weight" in keys
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= keys


@pytest.mark.parametrize("fp8", [False, True])
def test_save_then_load_round_trips(tmp_path, fp8):
    model = _tiny()
    save_checkpoint(model, tmp_path, fp8=fp8)
    loaded = load_checkpoint(tmp_path, dtype=torch.bfloat16)
    assert loaded.config == model.config
    if not fp8:
        for (k, a), (k2, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
            assert k == k2 and a.dtype == b.dtype and torch.equal(a, b), k
    else:
        cfg = json.loads((tmp_path / "config.json").read_text())
        assert cfg["quantization_config"]["weight_block_size"] == [128, 128]
        stored = load_file(tmp_path / "model.safetensors")
        assert stored["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
        assert stored["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16  # never quantized
        assert stored["model.layers.0.self_attn.indexer.weights_proj.weight"].dtype == torch.bfloat16


def test_committed_stubs_round_trip_bitwise(tmp_path):
    for name in ("tiny", "small"):
        model = load_checkpoint(STUB / name, dtype=torch.bfloat16)
        save_checkpoint(model, tmp_path / name)
        assert (tmp_path / name / "model.safetensors").read_bytes() == (STUB / name / "model.safetensors").read_bytes()


def test_regenerating_the_stubs_gives_identical_bytes(tmp_path):
    import runpy
    import sys

    script = STUB.parent / "scripts" / "make_weights_stub.py"
    argv = sys.argv
    sys.argv = [str(script), "--out", str(tmp_path)]
    try:
        with pytest.raises(SystemExit) as done:
            runpy.run_path(str(script), run_name="__main__")
        assert done.value.code == 0
    finally:
        sys.argv = argv
    for name in ("tiny", "small", "small-fp8"):
        for f in ("config.json", "model.safetensors"):
            assert (tmp_path / name / f).read_bytes() == (STUB / name / f).read_bytes(), f"{name}/{f}"


def test_fp8_stub_dequantizes_block_by_block():
    stored = load_file(STUB / "small-fp8" / "model.safetensors")
    model = load_checkpoint(STUB / "small-fp8", dtype=torch.float64)
    params = model.state_dict()
    table = E4M3
    checked = 0
    for name in ("model.layers.0.self_attn.q_b_proj.weight", "model.layers.2.mlp.experts.3.up_proj.weight",
                 "model.layers.0.self_attn.indexer.wq_b.weight"):
        w8 = stored[name].view(torch.uint8).numpy()
        scale = stored[name[: -len("weight")] + "weight_scale_inv"].numpy().astype(np.float64)
        out_f, in_f = w8.shape
        assert scale.shape == (math.ceil(out_f / 128), math.ceil(in_f / 128))
        expected = np.empty((out_f, in_f))
        for bo in range(scale.shape[0]):
            for bi in range(scale.shape[1]):
                blk = w8[bo * 128 : (bo + 1) * 128, bi * 128 : (bi + 1) * 128]
                expected[bo * 128 : bo * 128 + blk.shape[0], bi * 128 : bi * 128 + blk.shape[1]] = (
                    table[blk] * scale[bo, bi]
                )
        assert np.array_equal(params[name].numpy(), expected), name
        checked += 1
    assert checked == 3
    # the never-quantized router bias is stored and loaded as float32 exactly
    bias = stored["model.layers.2.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32
    raw = struct.unpack(f"<{bias.numel()}f", bias.numpy().tobytes())
    assert params["model.layers.2.mlp.gate.e_score_correction_bias"].tolist() == list(raw)


def _tensors():
    return dict(load_file(STUB / "tiny" / "model.safetensors"))


@pytest.mark.parametrize(
    "corrupt, key, message",
    [
        (lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"), "model.layers.1.self_attn.o_proj.weight", "missing"),
        (lambda t: t.__setitem__("model.layers.0.extra.weight", torch.zeros(2)), "model.layers.0.extra.weight", "unexpected"),
        (lambda t: t.__setitem__("model.norm.weight", torch.zeros(7, dtype=torch.bfloat16)), "model.norm.weight", "shape"),
        (lambda t: t.__setitem__("model.norm.weight", torch.zeros(128, dtype=torch.int32)), "model.norm.weight", "dtype"),
        (lambda t: t.__setitem__("model.layers.1.mlp.gate.e_score_correction_bias", torch.zeros(8, dtype=torch.bfloat16)),
         "model.layers.1.mlp.gate.e_score_correction_bias", "float32"),
        (lambda t: t.__setitem__("model.layers.0.self_attn.q_b_proj.weight",
                                 t["model.layers.0.self_attn.q_b_proj.weight"].float().to(torch.float8_e4m3fn)),
         "model.layers.0.self_attn.q_b_proj.weight", "scale"),
        (lambda t: t.__setitem__("model.layers.3.self_attn.indexer.wk.weight", torch.zeros(128, 128, dtype=torch.bfloat16)),
         "model.layers.3.self_attn.indexer.wk.weight", "unexpected"),
        (lambda t: t.pop("model.layers.1.mlp.experts.3.up_proj.weight"), "model.layers.1.mlp.experts.3.up_proj.weight", "missing"),
        (lambda t: t.__setitem__("model.layers.2.mlp.experts.7.down_proj.weight", torch.zeros(64, 128, dtype=torch.bfloat16)),
         "model.layers.2.mlp.experts.7.down_proj.weight", "shape"),
    ],
    ids=["missing", "extra", "shape", "dtype", "bias-dtype", "fp8-without-scale", "indexer-on-shared-layer",
         "missing-expert", "expert-shape"],
)
def test_each_bad_checkpoint_names_the_key(corrupt, key, message):
    tensors = _tensors()
    corrupt(tensors)
    model = DSAForCausalLM(PRESETS["tiny"]).to(torch.bfloat16)
    with pytest.raises(CheckpointError) as err:
        load_state_dict(model, tensors)
    assert key in err.value.problems and message in err.value.problems[key]
    assert key in str(err.value)


def test_per_expert_checkpoint_tensors_fill_the_stacked_experts():
    stored = _tensors()
    model = DSAForCausalLM(PRESETS["tiny"]).to(torch.bfloat16)
    load_state_dict(model, stored)
    inter = PRESETS["tiny"].moe_intermediate_size
    for layer in (1, 2, 3):
        experts = model.model.layers[layer].mlp.experts
        for e in range(PRESETS["tiny"].n_routed_experts):
            name = f"model.layers.{layer}.mlp.experts.{e}."
            # transformers' layout: gate rows, then up rows; down as stored.
            assert torch.equal(experts.gate_up_proj[e, :inter], stored[name + "gate_proj.weight"])
            assert torch.equal(experts.gate_up_proj[e, inter:], stored[name + "up_proj.weight"])
            assert torch.equal(experts.down_proj[e], stored[name + "down_proj.weight"])


def test_hf_state_dict_fuses_checkpoint_names_into_the_stacked_parameters():
    from glm_dsa.hf import hf_state_dict

    model = _tiny(seed=4)
    config = model.config
    from_checkpoint = hf_state_dict(model.state_dict(), config)
    from_parameters = hf_state_dict(dict(model.named_parameters()), config)
    assert sorted(from_checkpoint) == sorted(from_parameters)
    for name, t in from_checkpoint.items():
        assert torch.equal(t, from_parameters[name]), name
    stored = _tiny(seed=4).state_dict()
    gate_up = from_checkpoint["layers.1.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (8, 2 * 64, 128)
    assert torch.equal(gate_up[5, 64:], stored["model.layers.1.mlp.experts.5.up_proj.weight"])


def test_small_stub_runs_end_to_end_on_the_cpu_deterministically():
    assert from_hf_config(STUB / "small").name == "small"
    model = load_checkpoint(STUB / "small", dtype=torch.float32).eval()
    outs = []
    for _ in range(2):
        eng = PrefillEngine(model, num_pages=16, kv_dtype="fp8", chunked_prefill_size=128, budget_bytes=1 << 22)
        ids = torch.randint(0, model.config.vocab_size, (300,), generator=torch.Generator().manual_seed(0))
        rid = eng.add_request(ids)
        eng.run()
        outs.append((eng.output_hidden(rid), eng.finished[rid].logits))
        assert len(eng.timeline) == 3  # 128 + 128 + 44 tokens
    hidden, logits = outs[0]
    assert hidden.shape == (300, model.config.hidden_size) and torch.isfinite(hidden).all()
    assert logits.shape == (model.config.vocab_size,) and torch.isfinite(logits).all()
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])


def test_random_weights_of_a_slice_are_the_whole_models_layers():
    """--layers a:b with random weights: the slice's layer i is the whole model's layer a + i,
    embedding, final norm and head the same; a slice fed layer a-1's output gives the whole
    run's bits (the README's statement, with random weights; float32, which the saved
    float32 hidden states hold exactly)."""
    from glm_dsa.config import keep_layers
    from glm_dsa.prefill import PrefillEngine
    from glm_dsa.weights import build_model

    config = PRESETS["tiny"]  # layers 0-2 full, 3 shared
    whole = init_weights(build_model(config, torch.float32), seed=4).eval()
    part = init_weights(build_model(keep_layers(config, "2:4"), torch.float32), seed=4, first_layer=2).eval()
    whole_state, part_state = whole.state_dict(), part.state_dict()
    for name, t in part_state.items():
        source = name
        if name.startswith("model.layers."):
            i, rest = name[len("model.layers."):].split(".", 1)
            source = f"model.layers.{int(i) + 2}.{rest}"
        assert torch.equal(t, whole_state[source]), name
    ids = torch.randint(0, config.vocab_size, (200,), generator=torch.Generator().manual_seed(1))
    runs = []
    for model, kwargs in ((whole, {"input_ids": ids}), (part, None)):
        engine = PrefillEngine(model, num_pages=8, kv_dtype="fp32", chunked_prefill_size=128, layer_outputs=True)
        if kwargs is None:
            kwargs = {"input_ids": None, "input_hidden": runs[0]["request.0.layer.1.hidden"]}
        rid = engine.add_request(**kwargs)
        engine.run()
        runs.append(engine.outputs([rid]))
    assert torch.equal(runs[1]["request.0.hidden"], runs[0]["request.0.hidden"])
    assert torch.equal(runs[1]["request.0.logits"], runs[0]["request.0.logits"])
    assert torch.equal(runs[1]["request.0.layer.0.topk"], runs[0]["request.0.layer.2.topk"])


def test_random_weight_streams_differ_by_seed_and_layer():
    """Neighbouring seeds and layers draw unrelated weights (no stream is another's shifted)."""
    from glm_dsa.weights import weight_stream_seed

    seeds = {weight_stream_seed(s, 0, i) for s in range(3) for i in range(4)}
    seeds |= {weight_stream_seed(s, k) for s in range(3) for k in (1, 2, 3)}
    assert len(seeds) == 3 * 4 + 3 * 3
    with pytest.raises(ValueError, match="seed -1 must be ≥ 0"):
        weight_stream_seed(-1, 0)
