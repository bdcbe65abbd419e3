"""glm_dsa.weights' rules and refusals at their edges: dtype names, which tensors are quantized,
the 128 block edge (127 / 128 / 129), shard sizes one byte either side of a fit, a weight_map's
names just inside and just outside the directory, checkpoint files reached through a symlink
or a hard link, and the error message's cut at ten problems."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from glm_dsa import weights
from glm_dsa.weights import (
    INDEX_FILE,
    SINGLE_FILE,
    WEIGHT_BLOCK,
    CheckpointError,
    block_dequantize_weight,
    block_quantize_weight,
    checkpoint_files,
    is_quantizable,
    resolve_dtype,
    write_safetensors,
)


@pytest.mark.parametrize("given, want", [
    ("float32", torch.float32), ("FP32", torch.float32), ("bf16", torch.bfloat16),
    ("BFloat16", torch.bfloat16), ("fp16", torch.float16), ("float64", torch.float64),
    (torch.float16, torch.float16), (torch.float64, torch.float64),
])
def test_resolve_dtype_accepts_model_dtypes(given, want):
    assert resolve_dtype(given) is want


@pytest.mark.parametrize("given", ["int8", "bf", "float", "", torch.int32, torch.float8_e4m3fn,
                                   torch.complex64, 32])
def test_resolve_dtype_refuses_the_rest(given):
    with pytest.raises(ValueError, match="is not a model dtype"):
        resolve_dtype(given)


@pytest.mark.parametrize("name, dims, ok", [
    ("model.layers.0.self_attn.q_a_proj.weight", 2, True),
    ("model.layers.0.self_attn.q_a_proj.weight", 1, False),
    ("model.layers.0.self_attn.q_a_proj.weight", 3, False),
    ("model.layers.0.self_attn.q_a_proj.bias", 2, False),
    ("model.layers.0.self_attn.q_a_proj.weights", 2, False),
    ("lm_head.weight", 2, False),
    ("model.embed_tokens.weight", 2, False),
    ("model.layers.3.mlp.gate.weight", 2, False),
    ("model.layers.3.mlp.gate_proj.weight", 2, True),
    ("model.layers.3.mlp.shared_experts.gate_proj.weight", 2, True),
    ("model.layers.0.self_attn.indexer.weights_proj.weight", 2, False),
    ("model.layers.0.self_attn.indexer.wk.weight", 2, True),
    ("model.layers.0.input_layernorm.weight", 2, False),
    ("model.layers.3.mlp.gate.e_score_correction_bias", 2, False),
])
def test_which_tensors_are_quantized(name, dims, ok):
    assert is_quantizable(name, torch.zeros((2,) * dims)) is ok


@pytest.mark.parametrize("shape", [(127, 128), (128, 128), (129, 128), (128, 129), (1, 1), (256, 257)])
def test_block_quantize_scales_each_128_block(shape):
    g = torch.Generator().manual_seed(shape[0] + shape[1])
    w = torch.randn(*shape, generator=g)
    w[: min(shape[0], WEIGHT_BLOCK), 0] *= 100  # one block's amax far above the others'
    q, scale = block_quantize_weight(w)
    bo, bi = -(-shape[0] // 128), -(-shape[1] // 128)
    assert q.shape == shape and q.dtype == torch.float8_e4m3fn and scale.shape == (bo, bi)
    for i in range(bo):
        for j in range(bi):
            block = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128]
            assert scale[i, j].item() == pytest.approx(block.abs().max().item() / 448.0, rel=1e-6)
    back = block_dequantize_weight(q, scale, torch.float64)
    # Independent dequantization: each element times its block's scale.
    rows = torch.arange(shape[0])[:, None] // 128
    cols = torch.arange(shape[1])[None, :] // 128
    assert torch.equal(back, q.double() * scale.double()[rows, cols])
    # e4m3: half an ulp of 3 mantissa bits (2^-4 relative), or half its least subnormal 2^-9.
    bound = w.double().abs() * 2**-4 + scale.double()[rows, cols] * 2**-10
    assert bool(((back - w.double()).abs() <= bound * (1 + 1e-9)).all())


def test_a_zero_block_gets_the_floor_scale():
    q, scale = block_quantize_weight(torch.zeros(130, 5))
    assert torch.equal(scale, torch.full((2, 1), 1e-4 / 448.0))
    assert not q.float().any()


@pytest.mark.cuda
def test_block_quantize_on_cuda_gives_the_cpus_bits():
    """A checkpoint quantized on the GPU (scripts/bench_checkpoint_stream.py writes GLM-5.3 layers
    so) holds the bytes the CPU would write: ragged blocks, a far larger block, a zero block."""
    w = torch.randn(300, 260, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w[:128, :128] *= 1000
    w[128:256, 128:256] = 0
    q, s = block_quantize_weight(w)
    q_gpu, s_gpu = block_quantize_weight(w.cuda())
    assert q_gpu.is_cuda and s_gpu.is_cuda
    assert torch.equal(q_gpu.cpu().view(torch.uint8), q.view(torch.uint8)) and torch.equal(s_gpu.cpu(), s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dequantize_whole_blocks_and_ragged_blocks_agree(dtype):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(256, 256, generator=g)
    q, s = block_quantize_weight(w)
    whole = block_dequantize_weight(q, s, dtype)
    ragged = block_dequantize_weight(q[:255, :255].contiguous(), s, dtype)
    assert whole.dtype == ragged.dtype == dtype
    assert torch.equal(whole[:255, :255], ragged)


# ----------------------------------------------------------------------------- shards
def _tensors(*nbytes):
    return {f"t{i}": torch.zeros(n // 4, dtype=torch.float32) for i, n in enumerate(nbytes)}


@pytest.mark.parametrize("limit, shards", [(16, [["t0", "t1"], ["t2"]]), (15, [["t0"], ["t1"], ["t2"]]),
                                           (24, [["t0", "t1", "t2"]]), (23, [["t0", "t1"], ["t2"]]),
                                           (1, [["t0"], ["t1"], ["t2"]]), (4, [["t0"], ["t1"], ["t2"]])])
def test_shards_fill_to_the_byte(tmp_path, limit, shards):
    files = write_safetensors(_tensors(8, 8, 8), tmp_path, max_shard_bytes=limit)
    assert files == [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    index = json.loads((tmp_path / INDEX_FILE).read_text())
    assert index["metadata"]["total_size"] == 24
    assert index["weight_map"] == {n: files[i] for i, names in enumerate(shards) for n in names}


@pytest.mark.parametrize("limit", [0, -1])
def test_shard_limit_must_be_positive(tmp_path, limit):
    with pytest.raises(ValueError, match=f"max_shard_bytes={limit} must be ≥ 1"):
        write_safetensors(_tensors(8), tmp_path, max_shard_bytes=limit)


def test_no_limit_writes_one_file(tmp_path):
    assert write_safetensors(_tensors(8, 8), tmp_path) == [SINGLE_FILE]
    assert not (tmp_path / INDEX_FILE).exists()


# ----------------------------------------------------------------------------- weight maps
def _index(d, weight_map):
    (d / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))


def _shard(path):
    save_file({"a": torch.zeros(2)}, str(path))


@pytest.mark.parametrize("name, inside", [
    ("s.safetensors", True), ("sub/s.safetensors", True), ("sub/../s.safetensors", True),
    ("./s.safetensors", True), ("../s.safetensors", False), ("sub/../../s.safetensors", False),
    ("/abs/s.safetensors", False), ("..s.safetensors", True),
])
def test_weight_map_names_inside_the_directory(tmp_path, name, inside):
    d = tmp_path / "ckpt"
    (d / "sub").mkdir(parents=True)
    _shard(d / "s.safetensors")
    _shard(d / "sub" / "s.safetensors")
    _shard(d / "..s.safetensors")
    _shard(tmp_path / "s.safetensors")
    _index(d, {"a": name})
    if inside:
        assert checkpoint_files(d) == {"a": os.path.join(str(d), name)}
    else:
        with pytest.raises(CheckpointError, match="outside the checkpoint directory"):
            checkpoint_files(d)


@pytest.mark.parametrize("via", ["symlink", "hard_link"])
def test_shards_and_the_index_through_links(tmp_path, via):
    blobs, d = tmp_path / "blobs", tmp_path / "ckpt"
    blobs.mkdir()
    d.mkdir()
    _shard(blobs / "b1")
    (blobs / "idx").write_text(json.dumps({"weight_map": {"a": "s.safetensors"}}))
    link = os.symlink if via == "symlink" else os.link
    link(blobs / "b1", d / "s.safetensors")
    link(blobs / "idx", d / INDEX_FILE)
    assert checkpoint_files(d) == {"a": str(d / "s.safetensors")}
    os.remove(d / INDEX_FILE)
    link(blobs / "b1", d / SINGLE_FILE)
    assert checkpoint_files(d) == {"a": str(d / SINGLE_FILE)}


def test_a_dangling_shard_symlink_is_absent(tmp_path):
    d = tmp_path / "ckpt"
    d.mkdir()
    os.symlink(tmp_path / "gone", d / "s.safetensors")
    _index(d, {"a": "s.safetensors", "b": "s.safetensors"})
    with pytest.raises(CheckpointError, match=r"named by .* for 2 tensor\(s\) but not in the directory"):
        checkpoint_files(d)


@pytest.mark.parametrize("text, match", [
    ("{", "is not a JSON object with a weight_map"),
    ("[]", "is not a JSON object with a weight_map"),
    ('{"weight_map": {}}', "not a non-empty"),
    ('{"weight_map": []}', "not a non-empty"),
    ('{"weight_map": {"a": 1}}', "not a non-empty"),
    ('{"weight_map": {"a": "s", "a": "s"}}', "named twice"),
    ('{"nothing": 1}', "not a non-empty"),
])
def test_bad_index_files(tmp_path, text, match):
    (tmp_path / INDEX_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=match):
        checkpoint_files(tmp_path)


def test_an_index_that_is_a_directory_is_not_an_index(tmp_path):
    (tmp_path / INDEX_FILE).mkdir()
    with pytest.raises(ValueError, match="has no model.safetensors and no"):
        checkpoint_files(tmp_path)
    _shard(tmp_path / SINGLE_FILE)
    assert checkpoint_files(tmp_path) == {"a": str(tmp_path / SINGLE_FILE)}


@pytest.mark.parametrize("value, ok", [(0, True), (2, True), (-1, False), (True, False), (1.5, False),
                                       ("1", False), (None, False)])
def test_nextn_layers_must_be_a_non_negative_int(tmp_path, value, ok):
    (tmp_path / "config.json").write_text(json.dumps({"num_nextn_predict_layers": value}))
    if ok:
        assert weights._nextn_layers(str(tmp_path)) == value
    else:
        with pytest.raises(ValueError, match="num_nextn_predict_layers="):
            weights._nextn_layers(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    assert weights._nextn_layers(str(tmp_path)) == 0


@pytest.mark.parametrize("values, bad", [([1.0, 2.0], 0), ([1.0, 0.0], 1), ([1.0, -1e-30], 1),
                                         ([float("inf"), 1.0], 1), ([float("nan"), 0.0], 2),
                                         ([1e-45, 3.0], 0)])
def test_block_scales_must_be_finite_and_positive(values, bad):
    why = weights._check_scale(torch.tensor(values)[None])
    if not bad:
        assert why is None
    else:
        assert why.startswith(f"{bad} of 2 block scales are not finite and positive")


@pytest.mark.parametrize("n, shown", [(1, 1), (10, 10), (11, 10)])
def test_checkpoint_error_names_up_to_ten_problems(n, shown):
    e = CheckpointError({f"t{i:02d}": "missing" for i in range(n)}, "/c")
    text = str(e)
    assert sum(f"t{i:02d}: missing" in text for i in range(n)) == shown
    assert ("and 1 more" in text) == (n == 11)
    assert text.startswith("checkpoint /c: ") and len(e.problems) == n
    if n > 1:
        assert text.startswith(f"checkpoint /c: {n} problems: ")
