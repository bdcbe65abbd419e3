"""Checkpoint directories in Hugging Face's layout: sharded and single-file, FP8 and bf16, the MTP
layer, layer slices read from the shards that hold them, and one line per bad file or tensor.

Checkpoints are written here at test time: by the project's writer (``write_safetensors``) always,
and by transformers' ``save_pretrained(max_shard_size=...)`` where transformers imports. Expected
values are the tensors that were written, read back with ``safetensors.torch.load_file``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

import glm_dsa.weights as weights
from glm_dsa.config import PRESETS
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.weights import (
    CheckpointError,
    init_weights,
    load_checkpoint,
    open_checkpoint,
    state_dict_for_save,
    write_config,
    write_safetensors,
)

TINY = PRESETS["tiny"]  # 4 layers: 0 full dense, 1-3 MoE; layers 1-3 full (index_topk_freq 1)
SHARD = 48 << 10


def _mtp_tensors(stored: dict[str, torch.Tensor], layer: int) -> dict[str, torch.Tensor]:
    """A DeepSeek-style MTP layer at index ``layer``: a copy of the last layer's tensors plus its
    own ``eh_proj`` / ``enorm`` / ``hnorm`` / ``shared_head``."""
    last = layer - 1
    out = {k.replace(f"model.layers.{last}.", f"model.layers.{layer}."): v.clone()
           for k, v in stored.items() if k.startswith(f"model.layers.{last}.")}
    h = TINY.hidden_size
    out[f"model.layers.{layer}.eh_proj.weight"] = torch.ones(h, 2 * h, dtype=torch.bfloat16)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        out[f"model.layers.{layer}.{name}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    return out


def _write(directory, fp8=False, shard_bytes: int | None = SHARD, mtp=True, extra=None, seed=0):
    """The tiny model (bf16) written to ``directory`` with an MTP layer; returns what was written."""
    model = init_weights(DSAForCausalLM(TINY).to(torch.bfloat16), seed)
    write_config(model.config, directory, fp8)
    stored = state_dict_for_save(model, fp8)
    if mtp:
        stored.update(_mtp_tensors(stored, TINY.num_hidden_layers))
        cfg = json.loads((directory / "config.json").read_text())
        cfg["num_nextn_predict_layers"] = 1
        (directory / "config.json").write_text(json.dumps(cfg))
    stored.update(extra or {})
    write_safetensors(stored, directory, shard_bytes)
    return stored


def _equal_state(a: DSAForCausalLM, b: DSAForCausalLM) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layers", [None, "1:3"])
def test_sharded_checkpoint_loads_the_tensors_of_the_single_file(tmp_path, fp8, layers):
    single, sharded = tmp_path / "single", tmp_path / "sharded"
    stored = _write(single, fp8, shard_bytes=None)
    _write(sharded, fp8)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 4 and set(index["weight_map"]) == set(stored)
    a = load_checkpoint(single, dtype=torch.bfloat16, layers=layers)
    b = load_checkpoint(sharded, dtype=torch.bfloat16, layers=layers)
    _equal_state(a, b)
    if not fp8:  # bf16 in, bf16 out: the written tensors themselves, renumbered
        start = 0 if layers is None else 1
        for name, t in b.state_dict().items():
            parts = name.split(".")
            if name.startswith("model.layers."):
                parts[2] = str(int(parts[2]) + start)
            assert torch.equal(t, stored[".".join(parts)]), name


def test_a_layer_slice_opens_only_the_shards_that_hold_its_tensors(tmp_path, monkeypatch):
    _write(tmp_path, fp8=True)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    # independent of the loader: the files holding layer 2 or a tensor outside the layers
    want = {str(tmp_path / f) for k, f in weight_map.items()
            if not k.startswith("model.layers.") or k.startswith("model.layers.2.")}
    opened: list[str] = []
    real = weights.safe_open

    def counting(path, *args, **kwargs):
        opened.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(weights, "safe_open", counting)
    model = load_checkpoint(tmp_path, dtype=torch.float32, layers="2:3")
    assert set(opened) == want and len(want) < len(set(weight_map.values()))
    assert model.config.num_hidden_layers == 1 and model.config.name == "tiny[2:3]"
    ref = load_file(tmp_path / weight_map["model.layers.2.self_attn.o_proj.weight"])
    w = weights.block_dequantize_weight(ref["model.layers.2.self_attn.o_proj.weight"],
                                        ref["model.layers.2.self_attn.o_proj.weight_scale_inv"], torch.float32)
    assert torch.equal(model.state_dict()["model.layers.0.self_attn.o_proj.weight"], w)


def test_the_mtp_layer_is_skipped_with_one_line_naming_how_many_and_why(tmp_path):
    stored = _write(tmp_path)
    n_mtp = sum(1 for k in stored if k.startswith("model.layers.4."))
    n_other = sum(1 for k in stored if k.startswith(("model.layers.0.", "model.layers.2.", "model.layers.3.")))
    ckpt = open_checkpoint(tmp_path, layers="1:2")
    assert "\n" not in ckpt.note
    assert f"skipped {n_mtp} tensors of the MTP layer(s) 4 (num_nextn_predict_layers=1" in ckpt.note
    assert f"skipped {n_other} tensors of the other layers" in ckpt.note


def test_every_problem_is_reported_at_once_and_the_mtp_layer_is_ignored(tmp_path):
    _write(tmp_path, shard_bytes=None)
    path = tmp_path / "model.safetensors"
    stored = load_file(path)
    stored.pop("lm_head.weight")
    stored.pop("model.norm.weight")
    save_file(stored, path)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path)
    assert set(err.value.problems) == {"lm_head.weight", "model.norm.weight"}
    assert "\n" not in str(err.value)


def test_a_layer_beyond_the_mtp_layer_is_reported(tmp_path):
    extra = {"model.layers.5.self_attn.q_a_proj.weight": torch.zeros(3, 3, dtype=torch.bfloat16)}
    _write(tmp_path, extra=extra)
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path)
    assert list(err.value.problems) == ["model.layers.5.self_attn.q_a_proj.weight"]
    assert "beyond the model's 4 layers and its 1 MTP layer(s)" in str(err.value)
    note = open_checkpoint(tmp_path, strict=False).note
    assert "skipped 1 unexpected tensors of layers beyond 4 (strict=False)" in note


def _refuse_allocation(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("parameters allocated before the checkpoint was checked")

    monkeypatch.setattr(weights, "build_model", boom)


def test_a_truncated_shard_is_one_line_before_anything_is_allocated(tmp_path, monkeypatch):
    _write(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shard = tmp_path / weight_map["lm_head.weight"]
    shard.write_bytes(shard.read_bytes()[:-10])
    _refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg and shard.name in msg and "is truncated or corrupt" in msg and "download it again" in msg


def test_a_weight_map_naming_a_missing_file_is_one_line(tmp_path, monkeypatch):
    _write(tmp_path)
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    gone = weight_map["model.embed_tokens.weight"]
    n = sum(1 for f in weight_map.values() if f == gone)
    (tmp_path / gone).unlink()
    _refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert str(err.value) == (f"checkpoint {tmp_path}: {gone}: named by model.safetensors.index.json for {n} "
                              "tensor(s) but not in the directory; download it again")


def test_a_shape_mismatch_names_the_key_in_one_line(tmp_path, monkeypatch):
    bad = torch.zeros(TINY.hidden_size + 1, dtype=torch.bfloat16)
    _write(tmp_path, extra={"model.layers.2.post_attention_layernorm.weight": bad})
    _refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, layers="1:3")
    assert str(err.value) == (f"checkpoint {tmp_path}: model.layers.2.post_attention_layernorm.weight: "
                              f"shape ({TINY.hidden_size + 1},), expected ({TINY.hidden_size},)")


def test_a_tensor_the_weight_map_misplaces_is_named(tmp_path):
    _write(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))
    name = "model.norm.weight"
    index["weight_map"][name] = next(f for f in files if f != index["weight_map"][name])
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as err:
        open_checkpoint(tmp_path)
    assert err.value.problems == {name: f"model.safetensors.index.json puts it in {index['weight_map'][name]}, "
                                        "whose header lacks it"}


@pytest.mark.parametrize("value", [0.0, -1.0, float("nan"), float("inf")])
def test_fp8_scales_must_be_finite_and_positive(tmp_path, monkeypatch, value):
    model = init_weights(DSAForCausalLM(TINY).to(torch.bfloat16), 0)
    write_config(model.config, tmp_path, fp8=True)
    stored = state_dict_for_save(model, fp8=True)
    key = "model.layers.1.self_attn.q_b_proj.weight_scale_inv"
    stored[key][0, 0] = value
    write_safetensors(stored, tmp_path)
    _refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert list(err.value.problems) == [key]
    assert f"1 of {stored[key].numel()} block scales are not finite and positive (block (0, 0): {value})" in str(err.value)


def test_a_nan_weight_is_named(tmp_path):
    stored = _write(tmp_path, shard_bytes=None, mtp=False)
    w = stored["model.layers.0.mlp.up_proj.weight"].clone()
    w[3, 5] = float("nan")
    stored["model.layers.0.mlp.up_proj.weight"] = w
    save_file(stored, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.mlp\.up_proj\.weight: holds NaN or inf$"):
        load_checkpoint(tmp_path)


def test_dtype_names_are_accepted_and_others_refused_in_one_line(tmp_path):
    _write(tmp_path, mtp=False)
    for name, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16), ("fp32", torch.float32),
                        ("float64", torch.float64)):
        model = load_checkpoint(tmp_path, dtype=name, layers="0:1")
        assert model.model.layers[0].self_attn.o_proj.weight.dtype == dtype
    with pytest.raises(ValueError, match=r"^dtype 'int8' is not a model dtype; use torch.float32, .*bf16"):
        load_checkpoint(tmp_path, dtype="int8")


def test_no_weights_file_is_one_line(tmp_path):
    write_config(TINY, tmp_path)
    with pytest.raises(ValueError, match="has no model.safetensors and no model.safetensors.index.json: not a Hugging"):
        open_checkpoint(tmp_path)


def test_a_transformers_sharded_checkpoint_loads_like_its_single_file(tmp_path):
    transformers = pytest.importorskip("transformers", minversion="5.17")
    hf_tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "hf_tiny")
    # transformers' own test dims with a third layer: a dense layer, then two MoE layers
    # layer_types left to the installed transformers: its allowed names differ across 5.x
    with open(os.path.join(hf_tiny, "config.json")) as f:
        fields = {k: v for k, v in json.load(f).items()
                  if k not in ("layer_types", "architectures", "model_type", "transformers_version")}
    config = transformers.GlmMoeDsaConfig(**{**fields, "num_hidden_layers": 3, "indexer_types": ["full"] * 3,
                                             "mlp_layer_types": ["dense", "sparse", "sparse"]})
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM(config)  # float32: HF's .to(bf16) would round the router bias
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    hf.save_pretrained(tmp_path / "single", max_shard_size="1GB")
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 3 and os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    assert os.path.isfile(tmp_path / "single" / "model.safetensors")
    for layers in (None, "1:3"):
        a = load_checkpoint(tmp_path / "single", layers=layers)
        b = load_checkpoint(tmp_path / "sharded", layers=layers)
        _equal_state(a, b)
    written = load_file(tmp_path / "single" / "model.safetensors")
    ours = load_checkpoint(tmp_path / "sharded", layers="1:3").state_dict()
    assert torch.equal(ours["model.layers.1.mlp.experts.5.down_proj.weight"],
                       written["model.layers.2.mlp.experts.5.down_proj.weight"])


def test_loading_a_layer_slice_keeps_host_memory_within_twice_the_largest_tensor():
    """The memory figure of scripts/measure_load_memory.py at a small config (a subprocess:
    its own peak RSS)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, os.path.join(root, "scripts", "measure_load_memory.py"), "--size", "ci", "--json"],
                         capture_output=True, text=True, check=True, env=env)
    report = json.loads(out.stdout)
    assert report["shards_opened"] < report["shards"]
    assert 0 < report["above_baseline_bytes"] <= 2 * report["largest_tensor_bytes"], report


# DeepSeek-V3.2-Exp's published config.json (deepseek-ai/DeepSeek-V3.2-Exp, the keys glm-dsa reads
# and the ones it ignores), checked against the preset written from the paper and inference code.
DSV32_CONFIG_JSON = {
    "architectures": ["DeepseekV32ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3, "hidden_act": "silu",
    "hidden_size": 7168, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048,
    "initializer_range": 0.02, "intermediate_size": 18432, "kv_lora_rank": 512,
    "max_position_embeddings": 163840, "model_type": "deepseek_v32", "moe_intermediate_size": 2048,
    "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1, "norm_topk_prob": True,
    "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "tie_word_embeddings": False,
    "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128,
    "vocab_size": 129280,
}


def test_deepseek_v32_published_config_reads_as_the_preset():
    import dataclasses

    from glm_dsa.config import from_hf_config

    config = from_hf_config(DSV32_CONFIG_JSON)
    assert dataclasses.replace(config, name="deepseek-v3.2") == PRESETS["deepseek-v3.2"]
    assert len(config.full_layers) == 61 and not config.indexer_rope_interleave and config.rope_interleave


def test_a_deepseek_v32_checkpoint_with_its_mtp_layer_loads_a_slice(tmp_path):
    small = dict(DSV32_CONFIG_JSON, num_hidden_layers=4, hidden_size=128, num_attention_heads=4, q_lora_rank=64,
                 kv_lora_rank=128, qk_nope_head_dim=32, v_head_dim=32, index_n_heads=4, index_topk=64,
                 n_routed_experts=8, n_group=2, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=32,
                 intermediate_size=256, first_k_dense_replace=1, vocab_size=256)
    (tmp_path / "config.json").write_text(json.dumps(small))
    from glm_dsa.config import from_hf_config

    model = init_weights(DSAForCausalLM(from_hf_config(tmp_path)).to(torch.bfloat16), 1)
    stored = state_dict_for_save(model, fp8=True)
    stored.update({k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in stored.items()
                   if k.startswith("model.layers.3.")})
    stored["model.layers.4.eh_proj.weight"] = torch.zeros(128, 256, dtype=torch.bfloat16)
    write_safetensors(stored, tmp_path, max_shard_bytes=64 << 10)
    ckpt = open_checkpoint(tmp_path, layers="2:4")
    assert ckpt.config.model_type == "deepseek_v32" and ckpt.config.num_hidden_layers == 2
    n_mtp = sum(1 for k in stored if k.startswith("model.layers.4."))
    assert f"skipped {n_mtp} tensors of the MTP layer(s) 4" in ckpt.note
    loaded = ckpt.load(torch.float32)
    w = weights.block_dequantize_weight(stored["model.layers.3.mlp.experts.6.up_proj.weight"],
                                        stored["model.layers.3.mlp.experts.6.up_proj.weight_scale_inv"], torch.float32)
    assert torch.equal(loaded.state_dict()["model.layers.1.mlp.experts.6.up_proj.weight"], w)


@pytest.mark.cuda
def test_a_checkpoint_loads_straight_to_cuda_as_on_the_cpu(tmp_path):
    _write(tmp_path, fp8=True)
    cpu = load_checkpoint(tmp_path, dtype=torch.bfloat16, layers="1:3")
    gpu = load_checkpoint(tmp_path, dtype="bf16", device="cuda", layers="1:3")
    for (k, a), (k2, b) in zip(cpu.state_dict().items(), gpu.state_dict().items()):
        assert k == k2 and b.device.type == "cuda" and torch.equal(a, b.cpu()), k


@pytest.mark.parametrize("name", ["../outside_dir/evil.safetensors", "/etc/hostname",
                                  "sub/../../evil.safetensors"])
def test_a_weight_map_naming_a_file_outside_the_directory_is_refused_before_reading(tmp_path, monkeypatch, name):
    _write(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = name
    index_path.write_text(json.dumps(index))
    (tmp_path.parent / "outside_dir").mkdir(exist_ok=True)
    (tmp_path.parent / "outside_dir" / "evil.safetensors").write_bytes(b"not read")
    _refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert str(err.value) == (f"checkpoint {tmp_path}: {name}: named by model.safetensors.index.json "
                              "but outside the checkpoint directory; a weight_map names files inside it")


def test_a_weight_map_naming_one_tensor_twice_is_refused(tmp_path, monkeypatch):
    _write(tmp_path)
    index_path = tmp_path / "model.safetensors.index.json"
    text = index_path.read_text()
    first = json.loads(text)["weight_map"]["lm_head.weight"]
    # A second "lm_head.weight" entry: json.load alone would keep the later one silently.
    text = text.replace('"weight_map": {', f'"weight_map": {{"lm_head.weight": "{first}", ', 1)
    index_path.write_text(text)
    _refuse_allocation(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert str(err.value) == (f"checkpoint {tmp_path}: lm_head.weight: named twice in "
                              "model.safetensors.index.json's JSON; keep one entry")


@pytest.mark.parametrize("name, shape", [
    ("model.layers.0.input_layernorm.weight", (TINY.hidden_size,)),
    ("model.norm.weight", (TINY.hidden_size,)),
    ("model.layers.1.mlp.gate.weight", (TINY.n_routed_experts, TINY.hidden_size)),
])
def test_an_fp8_tensor_of_a_kind_never_quantized_is_named_with_the_dtype_expected(tmp_path, monkeypatch, capsys,
                                                                                  name, shape):
    """FP8 block-quantized checkpoints (DeepSeek-V3's, GLM's) store only 2-D linear weights in
    e4m3 with a weight_scale_inv; norms stay bf16. An FP8 norm weight raised IndexError (its
    block-scale shape was read from a second dimension it does not have)."""
    _write(tmp_path, fp8=True, mtp=False, extra={name: torch.ones(shape).to(torch.float8_e4m3fn)})
    _refuse_allocation(monkeypatch)
    expected = (f"checkpoint {tmp_path}: {name}: dtype torch.float8_e4m3fn, expected bf16, fp16, fp32 or fp64: "
                "FP8 checkpoints quantize 2-D linear weights only, never the norms, biases, router gate, "
                "indexer.weights_proj, embedding or LM head")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    assert str(err.value) == expected
    from glm_dsa.cli import main

    assert main(["prefill", "--config", str(tmp_path), "--weights", str(tmp_path), "--tokens", "64"]) == 2
    assert capsys.readouterr().err == f"glm-dsa prefill: error: {expected}\n"
