"""Layer-major prefill (``glm_dsa.layer_major``): the same bits as chunk-major order, one layer's
weights at a time, and its memory plan."""

from __future__ import annotations

import os

import pytest
import torch

from glm_dsa.config import PRESETS, keep_layers
from glm_dsa.layer_major import CheckpointLayerWeights, RandomLayerWeights, memory_plan, staged_views
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import build_model, build_outer_model, init_outer_weights, init_weights, load_checkpoint, \
    open_checkpoint

STUB = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "weights_stub")
KV = {torch.float64: "fp64", torch.float32: "fp32"}


def _ids(n: int, seed: int, vocab: int) -> torch.Tensor:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _run(model, order, lengths, prefix=0, chunk=128, kv_dtype=None, layer_outputs=True, **kw):
    """Outputs, logits and timeline chunks of requests of ``lengths`` tokens sharing their first
    ``prefix`` tokens (cached by a warm-up request when ``prefix``), run in ``order``."""
    config = model.config
    dtype = model.lm_head.weight.dtype
    engine = PrefillEngine(model, num_pages=64, kv_dtype=kv_dtype or KV[dtype], chunked_prefill_size=chunk,
                           budget_bytes=1 << 20, order=order, layer_outputs=layer_outputs, **kw)
    shared = _ids(prefix, 99, config.vocab_size)
    if prefix:
        engine.warm_up(shared)
    rids = [engine.add_request(torch.cat([shared, _ids(n - prefix, i, config.vocab_size)]))
            for i, n in enumerate(lengths)]
    engine.run()
    return engine.outputs(rids), [s.chunks for s in engine.timeline], engine


def _assert_same(a, b):
    assert a[1] == b[1], "the two orders ran different steps"
    assert sorted(a[0]) == sorted(b[0])
    for name, t in a[0].items():
        assert torch.equal(t, b[0][name]), name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_layer_major_order_gives_chunk_majors_bits_tiny(dtype):
    """Three requests of 200 / 130 / 150 tokens in chunks of 128 (truncated, shared steps), the
    first 130 tokens a prefix-cache hit of two pages, every layer's output and top-k kept."""
    model = init_weights(build_model(PRESETS["tiny"], dtype), seed=2).eval()
    chunk = _run(model, "chunk", [200, 130, 150], prefix=130)
    layer = _run(model, "layer", [200, 130, 150], prefix=130)
    assert any(len(c) > 1 for c in chunk[1]) and chunk[2].finished[1].cached_len == 128
    _assert_same(chunk, layer)


def test_layer_major_order_gives_chunk_majors_bits_small_fp8():
    """``small`` (dense and MoE layers, shared layers), float32, FP8 KV, two requests."""
    model = init_weights(build_model(PRESETS["small"], torch.float32), seed=3).eval()
    args = dict(lengths=[150, 70], chunk=128, kv_dtype="fp8", layer_outputs=False)
    _assert_same(_run(model, "chunk", **args), _run(model, "layer", **args))


def test_streamed_random_layers_are_the_whole_models():
    """Layers drawn one at a time on their turn (``RandomLayerWeights``) and freed after give the
    bits of the whole model built by ``init_weights``; a slice's stream starts at its first layer."""
    config = keep_layers(PRESETS["tiny"], "1:4")
    whole = init_weights(build_model(config, torch.float32), seed=5, first_layer=1).eval()
    streamed = init_outer_weights(build_outer_model(config, torch.float32), seed=5).eval()
    expected = _run(whole, "chunk", [200, 90], prefix=70)
    got = _run(streamed, "layer", [200, 90], prefix=70, layer_weights=RandomLayerWeights(5, first_layer=1))
    _assert_same(expected, got)
    assert all(p.is_meta for p in streamed.model.layers.parameters()), "a layer's weights were kept"


def test_streamed_checkpoint_layers_are_the_loaded_models():
    checkpoint = open_checkpoint(os.path.join(STUB, "tiny"))
    loaded = load_checkpoint(os.path.join(STUB, "tiny"), torch.float32).eval()
    streamed = checkpoint.load_outer(torch.float32).eval()
    args = dict(lengths=[150], chunk=64, layer_outputs=[0, 3])
    expected = _run(loaded, "chunk", **args)
    got = _run(streamed, "layer", **args, layer_weights=CheckpointLayerWeights(checkpoint))
    _assert_same(expected, got)
    assert sorted(k for k in got[0] if ".layer." in k) == [
        "request.0.layer.0.hidden", "request.0.layer.0.topk", "request.0.layer.3.hidden"]


@pytest.mark.parametrize("read_ahead", [False, True])
def test_an_fp8_checkpoint_streamed_with_or_without_read_ahead_gives_the_loaded_models_bits(tmp_path, read_ahead):
    """An FP8 (block-scaled) sharded tiny checkpoint: layers read on their turn straight to the
    device, or read ahead into host memory by the reader thread, give the bits of the model
    loaded whole."""
    from glm_dsa.weights import state_dict_for_save, write_config, write_safetensors

    model = init_weights(build_model(PRESETS["tiny"], torch.bfloat16), seed=4)
    write_config(model.config, tmp_path, fp8=True)
    write_safetensors(state_dict_for_save(model, fp8=True), tmp_path, 48 << 10)
    checkpoint = open_checkpoint(str(tmp_path))
    loaded = load_checkpoint(str(tmp_path), torch.float32).eval()
    streamed = checkpoint.load_outer(torch.float32).eval()
    args = dict(lengths=[150, 60], chunk=64, layer_outputs=True)
    weights = CheckpointLayerWeights(checkpoint, read_ahead=read_ahead)
    _assert_same(_run(loaded, "chunk", **args), _run(streamed, "layer", **args, layer_weights=weights))
    assert weights._reader is None and weights._ahead == {} and weights._buffers == []  # the run ended the reader


@pytest.mark.cuda
def test_an_fp8_checkpoint_read_ahead_into_pinned_memory_gives_the_loaded_models_bits_on_cuda(tmp_path,
                                                                                                monkeypatch):
    """On CUDA the reader thread pins each layer it reads ahead (the copies to the GPU are then
    DMA from page-locked memory) and the streamed layers give the bits of the model loaded whole
    on the GPU."""
    from glm_dsa.weights import Checkpoint, state_dict_for_save, write_config, write_safetensors

    model = init_weights(build_model(PRESETS["tiny"], torch.bfloat16), seed=4)
    write_config(model.config, tmp_path, fp8=True)
    write_safetensors(state_dict_for_save(model, fp8=True), tmp_path, 48 << 10)
    checkpoint = open_checkpoint(str(tmp_path))
    pinned: dict[int, bool] = {}
    read = Checkpoint.read_layer

    def spy_read(self, i, pin=False, into=None):
        got = read(self, i, pin, into)
        pinned[i] = all(t.is_pinned() for t in got.tensors.values())
        return got

    monkeypatch.setattr(Checkpoint, "read_layer", spy_read)
    loaded = load_checkpoint(str(tmp_path), torch.float32, "cuda").eval()
    streamed = checkpoint.load_outer(torch.float32, "cuda").eval()
    args = dict(lengths=[150, 60], chunk=64, layer_outputs=True, backend="reference")
    _assert_same(_run(loaded, "chunk", **args),
                 _run(streamed, "layer", **args, layer_weights=CheckpointLayerWeights(checkpoint)))
    assert pinned == {0: True, 1: True, 2: True, 3: True}


@pytest.mark.cuda
def test_on_cuda_each_layer_read_ahead_is_staged_on_the_device_before_its_fill(tmp_path, monkeypatch):
    """On CUDA the reader copies each layer's bytes on to the device stage: every layer's fill
    gets device tensors, views of the one stage buffer (allocated once), and the layers give the
    bits of the model loaded whole on the GPU; the run frees the stage."""
    from glm_dsa.weights import Checkpoint, state_dict_for_save, write_config, write_safetensors

    model = init_weights(build_model(PRESETS["tiny"], torch.bfloat16), seed=4)
    write_config(model.config, tmp_path, fp8=True)
    write_safetensors(state_dict_for_save(model, fp8=True), tmp_path, 48 << 10)
    checkpoint = open_checkpoint(str(tmp_path))
    weights = CheckpointLayerWeights(checkpoint)
    staged: dict[int, bool] = {}
    load = Checkpoint.load_layer

    def spy_load(self, layer, r=None):
        stage = weights._stage
        lo, hi = stage.data_ptr(), stage.data_ptr() + stage.numel()
        staged[layer.layer_idx] = all(t.is_cuda and lo <= t.data_ptr() < hi
                                      for t in [*r.tensors.values(), *r.scales.values()])
        return load(self, layer, r)

    monkeypatch.setattr(Checkpoint, "load_layer", spy_load)
    loaded = load_checkpoint(str(tmp_path), torch.float32, "cuda").eval()
    streamed = checkpoint.load_outer(torch.float32, "cuda").eval()
    args = dict(lengths=[150, 60], chunk=64, layer_outputs=True, backend="reference")
    _assert_same(_run(loaded, "chunk", **args), _run(streamed, "layer", **args, layer_weights=weights))
    assert staged == {0: True, 1: True, 2: True, 3: True}
    assert weights._stage is None and weights._reader is None


@pytest.mark.cuda
def test_a_run_that_stops_after_its_first_layer_ends_the_staging_reader_at_once():
    """Closed after one layer, the reader waiting for the stage (layer 1 read, layer 0 filled
    but its event not yet seen) or reading ends without waiting for a layer that never comes."""
    import threading

    from glm_dsa.layer import DecoderLayer

    checkpoint = open_checkpoint(os.path.join(STUB, "tiny"))
    weights = CheckpointLayerWeights(checkpoint)
    layer = DecoderLayer(checkpoint.config, 0).to("cuda", torch.float32)
    weights.fill(layer)
    ended = threading.Event()
    closer = threading.Thread(target=lambda: (weights.close(), ended.set()))
    closer.start()
    assert ended.wait(timeout=30), "close() waited for the reader"
    closer.join()
    assert weights._reader is None and weights._stage is None and weights._ahead == {}


def test_staged_views_are_the_read_tensors_at_their_offsets_in_the_stage(tmp_path):
    """Each tensor of a layer read into a host buffer (FP8 weights, their scales, the rest),
    moved to a copy of that buffer, has its bytes, dtype and shape there, at the same offset; a
    tensor outside the buffer is refused."""
    from glm_dsa.weights import state_dict_for_save, write_config, write_safetensors

    model = init_weights(build_model(PRESETS["tiny"], torch.bfloat16), seed=4)
    write_config(model.config, tmp_path, fp8=True)
    write_safetensors(state_dict_for_save(model, fp8=True), tmp_path, 48 << 10)
    checkpoint = open_checkpoint(str(tmp_path))
    host = torch.zeros(checkpoint.read_bytes(1) + 64, dtype=torch.uint8)
    read = checkpoint.read_layer(1, into=host)
    stage = host.clone()
    host.zero_()  # the views must read the stage, not the host buffer
    moved = staged_views(read, host, stage)
    assert moved.layer == 1 and moved.names == read.names and read.scales
    fresh = checkpoint.read_layer(1)
    for got, before, expect in ((moved.tensors, read.tensors, fresh.tensors), (moved.scales, read.scales, fresh.scales)):
        assert sorted(got) == sorted(expect)
        for name, t in got.items():
            assert t.dtype == expect[name].dtype and t.shape == expect[name].shape, name
            assert torch.equal(t.view(torch.uint8), expect[name].view(torch.uint8)), name
            assert t.data_ptr() - stage.data_ptr() == before[name].data_ptr() - host.data_ptr(), name
    outside = type(read)(1, read.names, {"x": torch.zeros(4)}, {})
    with pytest.raises(ValueError, match="^staged_views: a tensor of 16 bytes at offset -?\\d+ is not a contiguous view"):
        staged_views(outside, host, stage)


def test_read_layer_reads_the_stored_tensors_into_one_reused_buffer(tmp_path):
    """``read_layer``'s plain reads give the tensors safetensors gives (weights, FP8 weights and
    their scales, a layer cut across shards), as views of one buffer; a given buffer is reused,
    one too short is refused in one line before any read, and a file cut short is named."""
    from safetensors import safe_open

    from glm_dsa.weights import CheckpointError, state_dict_for_save, write_config, write_safetensors

    model = init_weights(build_model(PRESETS["tiny"], torch.bfloat16), seed=4)
    write_config(model.config, tmp_path, fp8=True)
    files = write_safetensors(state_dict_for_save(model, fp8=True), tmp_path, 48 << 10)
    checkpoint = open_checkpoint(str(tmp_path))
    spanned = {checkpoint.tensors[n][1] for n in checkpoint.tensors if n.startswith("model.layers.1.")}
    assert len(spanned) > 1  # the layer is cut across shards
    buffer = torch.zeros(checkpoint.read_bytes(1) + 100, dtype=torch.uint8)
    read = checkpoint.read_layer(1, into=buffer)
    lo, hi = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    for name, key in read.names.items():
        path = checkpoint.tensors[f"model.layers.1.{name}"][1]
        with safe_open(path, "pt") as f:
            expected = f.get_tensor(key)
        got = read.tensors[name]
        assert got.dtype == expected.dtype and got.shape == expected.shape, name
        assert torch.equal(got.view(torch.uint8), expected.view(torch.uint8)), name
        assert lo <= got.data_ptr() < hi, name
    assert sorted(read.scales) == sorted(n[len("model.layers.1."):] for n in checkpoint.scales
                                         if n.startswith("model.layers.1."))
    for weight, scale in read.scales.items():
        key, path = checkpoint.scales[f"model.layers.1.{weight}"]
        with safe_open(path, "pt") as f:
            assert torch.equal(scale, f.get_tensor(key)), weight
    with pytest.raises(ValueError, match=r"^read_layer\(1\): into must be a 1-D uint8 host tensor of at least \d+ "
                                         r"bytes \(read_bytes\), got torch.uint8 \(10,\) on cpu$"):
        checkpoint.read_layer(1, into=torch.zeros(10, dtype=torch.uint8))
    last = max(checkpoint.tensors[n][1] for n in checkpoint.tensors if n.startswith("model.layers.3."))
    assert os.path.basename(last) in files
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) - 1)
    with pytest.raises((CheckpointError, ValueError), match="truncated"):
        checkpoint.read_layer(3)


def test_read_ahead_reads_every_layer_into_two_buffers_allocated_once(monkeypatch):
    """The reader fills layer i into buffer i % 2 and never allocates another; layer i + 2's
    read is queued only after layer i was copied out of its buffer."""
    from glm_dsa.weights import Checkpoint

    checkpoint = open_checkpoint(os.path.join(STUB, "tiny"))
    events: list[tuple[str, int]] = []
    where: dict[int, int] = {}
    weights = CheckpointLayerWeights(checkpoint)
    read, load = Checkpoint.read_layer, Checkpoint.load_layer

    def spy_read(self, i, pin=False, into=None):
        events.append(("read", i))
        where[i] = next(b for b, buf in enumerate(weights._buffers) if buf is into)
        return read(self, i, pin, into)

    def spy_load(self, layer, r=None):
        load(self, layer, r)
        events.append(("copied", layer.layer_idx))

    monkeypatch.setattr(Checkpoint, "read_layer", spy_read)
    monkeypatch.setattr(Checkpoint, "load_layer", spy_load)
    allocated = []
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **k: (allocated.append(a), empty(*a, **k))[1]
                        if k.get("dtype") is torch.uint8 else empty(*a, **k))
    streamed = checkpoint.load_outer(torch.float32).eval()
    expected = _run(load_checkpoint(os.path.join(STUB, "tiny"), torch.float32).eval(), "chunk", [100], chunk=64)
    got = _run(streamed, "layer", [100], chunk=64, layer_weights=weights)
    _assert_same(expected, got)
    assert where == {0: 0, 1: 1, 2: 0, 3: 1}
    assert len(allocated) == 2 and all(a == (max(checkpoint.read_bytes(i) for i in range(4)),) for a in allocated)
    for i in (2, 3):
        assert events.index(("copied", i - 2)) < events.index(("read", i))
    assert weights._buffers == [] and weights._reader is None  # freed when the run ended


def test_the_plan_counts_two_layers_of_a_checkpoint_read_ahead(tmp_path):
    """A layer's stored bytes, from the headers, are the bytes written for it (FP8 weights, their
    scales, the bf16 rest); the plan holds two such layers on the host."""
    from glm_dsa.weights import state_dict_for_save, write_config, write_safetensors

    model = init_weights(build_model(PRESETS["tiny"], torch.bfloat16), seed=4)
    write_config(model.config, tmp_path, fp8=True)
    stored = state_dict_for_save(model, fp8=True)
    write_safetensors(stored, tmp_path, 48 << 10)
    checkpoint = open_checkpoint(str(tmp_path))
    for i in range(4):
        mine = [t for k, t in stored.items() if k.startswith(f"model.layers.{i}.")]
        written = sum(t.numel() * t.element_size() for t in mine)
        assert checkpoint.stored_layer_bytes(i) == written
        # the read buffer: each tensor at a 64-byte boundary
        assert checkpoint.read_bytes(i) == sum(-(-t.numel() * t.element_size() // 64) * 64 for t in mine)
    largest = max(checkpoint.read_bytes(i) for i in range(4))
    plan = memory_plan(PRESETS["tiny"], [64], 64, "fp32", torch.float32, 1 << 20, None, largest)
    assert dict(plan.host_items) == {"a checkpoint's layers, two read ahead": 2 * largest}
    assert memory_plan(PRESETS["tiny"], [64], 64, "fp32", torch.float32, 1 << 20, None).host_items == ()
    staged = memory_plan(PRESETS["tiny"], [64], 64, "fp32", torch.float32, 1 << 20, None, largest, staged=True)
    assert dict(staged.items)["a checkpoint's next layer, staged"] == largest
    assert staged.device_bytes == plan.device_bytes + largest and staged.host_items == plan.host_items


def test_read_ahead_reads_the_next_layer_while_this_one_runs(monkeypatch):
    """With read-ahead, layer i + 1's read has begun by the time layer i's first step runs: each
    of layer i's steps waits for it here, which a read on layer i + 1's own turn would leave
    waiting in vain (10 s, then recorded as not overlapped). Each layer is read once; without
    read-ahead none is read ahead."""
    import threading

    from glm_dsa.layer import DecoderLayer
    from glm_dsa.weights import Checkpoint

    checkpoint = open_checkpoint(os.path.join(STUB, "tiny"))
    reading = [threading.Event() for _ in range(4)]
    overlapped: dict[int, bool] = {}
    reads: list[int] = []
    fills: list[int] = []
    read, load, forward = Checkpoint.read_layer, Checkpoint.load_layer, DecoderLayer.forward

    def spy_read(self, i, pin=False, into=None):
        reads.append(i)
        reading[i].set()
        return read(self, i, pin, into)

    def spy_forward(self, *a, **k):
        i = self.layer_idx
        if i + 1 < 4 and i + 1 not in overlapped:
            overlapped[i + 1] = reading[i + 1].wait(timeout=10 if ahead else 0)
        return forward(self, *a, **k)

    monkeypatch.setattr(Checkpoint, "read_layer", spy_read)
    monkeypatch.setattr(Checkpoint, "load_layer", lambda self, layer, r=None: (fills.append(layer.layer_idx),
                                                                              load(self, layer, r))[1])
    monkeypatch.setattr(DecoderLayer, "forward", spy_forward)
    for ahead in (True, False):
        fills.clear(), reads.clear(), overlapped.clear()
        for event in reading:
            event.clear()
        streamed = checkpoint.load_outer(torch.float32).eval()
        _run(streamed, "layer", [100], chunk=64, layer_weights=CheckpointLayerWeights(checkpoint, ahead))
        assert fills == [0, 1, 2, 3]
        assert sorted(reads) == ([0, 1, 2, 3] if ahead else [])  # each layer read once
        assert overlapped == {1: ahead, 2: ahead, 3: ahead}


def test_layer_order_refusals():
    model = init_weights(build_model(PRESETS["tiny"], torch.float32), seed=0).eval()
    with pytest.raises(ValueError, match="order='bogus'|choose one of chunk, layer"):
        PrefillEngine(model, num_pages=4, kv_dtype="fp32", order="bogus")
    with pytest.raises(ValueError, match="need order='layer'"):
        PrefillEngine(model, num_pages=4, kv_dtype="fp32", layer_weights=RandomLayerWeights(0))
    engine = PrefillEngine(model, num_pages=4, kv_dtype="fp32", order="layer")
    engine.add_request(_ids(10, 0, 512))
    with pytest.raises(ValueError, match="call run"):
        engine.step()


def test_memory_plan_of_glm_5_3_at_one_million_tokens():
    """The issue's figures, computed independently: main KV 656 B per token and layer (FP8:
    512 e4m3 + 4 float32 scales + 64 bf16 rope), index K 128 + 4 B per token and full layer,
    bf16 hidden rows, int32 top-k of 2048; a GLM-5.3 MoE full layer's weights in bf16."""
    config = PRESETS["glm-5.3"]
    n = 1 << 20
    plan = memory_plan(config, [n], 32768, "fp8", torch.bfloat16, transient_bytes=0, available=None)
    items = dict(plan.items)
    assert plan.hidden_on_device and plan.host_items == ()
    assert items["main KV, 78 layers (fp8)"] == n * 78 * (512 + 4 * 4 + 64 * 2)
    assert items["index K, 21 full layers"] == n * 21 * (128 + 4)
    assert items[f"hidden rows of {n:,} tokens"] == n * 6144 * 2
    assert items[f"top-k of the last full layer, {n:,} tokens"] == n * 2048 * 4
    h, e, inter = 6144, 256, 2048
    experts = (e + 1) * 3 * h * inter  # routed and one shared expert
    assert items["one layer's weights (+ float32 draw of a tensor)"] > 2 * experts
    assert 100e9 < plan.device_bytes < 130e9  # the issue: inside 139 GB
    tight = memory_plan(config, [n], 32768, "fp8", torch.bfloat16, 0, available=plan.device_bytes - 1)
    assert not tight.hidden_on_device and dict(tight.host_items)[f"hidden rows of {n:,} tokens"] == n * 6144 * 2


# ------------------------------------------------------------------ the command
def _prefill(capsys, *argv):
    from glm_dsa.cli import main

    rc = main(["prefill", "--config", "tiny", "--kv-dtype", "fp32", "--chunk", "128", *map(str, argv)])
    out, err = capsys.readouterr()
    return rc, out, err


def test_prefill_order_layer_writes_chunk_orders_outputs(tmp_path, capsys):
    from safetensors.torch import load_file

    files = {}
    for order in ("chunk", "layer"):
        files[order] = tmp_path / f"{order}.safetensors"
        rc, out, err = _prefill(capsys, "--tokens", 140, "--requests", 2, "--prefix", 70, "--order", order,
                                "--save-outputs", files[order], "--save-layer-outputs", "1,3")
        assert rc == 0, err
    assert "memory plan (layer-major, on cpu):" in err and "total on the device" in err
    assert "prefill: layer 3 (4/4)" in err and "ETA 0 s" in err  # one line per layer off a terminal
    assert "== layers (layer-major order" in out
    chunk, layer = load_file(files["chunk"]), load_file(files["layer"])
    assert sorted(k for k in layer if ".layer." in k) == [
        f"request.{i}.layer.{l}.{t}" for i in range(2) for l, t in ((1, "hidden"), (1, "topk"), (3, "hidden"))]
    assert sorted(chunk) == sorted(layer) and all(torch.equal(chunk[k], layer[k]) for k in chunk)


def test_read_ahead_records_each_layers_bytes_and_times():
    """``read_times`` holds every layer read, with its ``read_bytes``, a read of positive length,
    one pinning per host buffer at most (none off CUDA: plain memory) and no stage off CUDA."""
    checkpoint = open_checkpoint(os.path.join(STUB, "tiny"))
    weights = CheckpointLayerWeights(checkpoint)
    _run(checkpoint.load_outer(torch.float32).eval(), "layer", [100], chunk=64, layer_weights=weights)
    assert sorted(weights.read_times) == [0, 1, 2, 3]
    for i, t in weights.read_times.items():
        assert t.nbytes == checkpoint.read_bytes(i) and t.read > 0 and t.pin >= 0
        assert t.stage_wait == 0 and t.stage == 0
    assert f"{weights.read_times[0].nbytes / 1e9:.2f} GB in" in weights.read_times[0].line()


def test_prefill_from_a_checkpoint_says_what_each_layers_read_ahead_took(capsys):
    """Off a terminal each layer's line of a checkpoint run ends with its read: bytes, seconds,
    rate, pinning, the stage (0 off CUDA); the bytes are the layer's ``read_bytes``."""
    import re

    checkpoint = open_checkpoint(os.path.join(STUB, "tiny"))
    rc, _, err = _prefill(capsys, "--tokens", 100, "--order", "layer", "--weights", os.path.join(STUB, "tiny"))
    assert rc == 0, err
    lines = [line for line in err.splitlines() if line.startswith("prefill: layer")]
    assert len(lines) == 4
    for i, line in enumerate(lines):
        m = re.search(r"; read ahead: ([\d.]+) GB in ([\d.]+) s \(([\d.]+|inf) GB/s\), pinned ([\d.]+) s, "
                      r"stage waited 0.00 s, copied 0.00 s$", line)
        assert m, line
        assert float(m[1]) == round(checkpoint.read_bytes(i) / 1e9, 2)


def test_on_the_host_a_run_only_one_layer_fits_is_refused_naming_layer_order(capsys, monkeypatch):
    """A host whose memory holds one layer at a time but not the whole model: the chunk-major
    refusal names --order layer with its plan's size (on the host layer order is never chosen
    for the user), and --order layer runs."""
    from glm_dsa import preflight
    from glm_dsa.ledger import prefill_peak_bytes

    config = PRESETS["tiny"]
    budget = 1 << 20
    # The command's own estimates (both beside the process itself), to place the memory between them.
    chunk_need = prefill_peak_bytes(config, [300], 128, "fp32", 4, budget)
    plan = memory_plan(config, [300], 128, "fp32", torch.float32, budget, None)
    layer_need = plan.device_bytes + plan.module_bytes
    assert layer_need < chunk_need
    # On the host the check adds what the process holds already to the memory free: fix their sum.
    base = preflight.host_baseline_bytes()

    def free(total):
        return lambda device: total - min(preflight.resident_bytes(), base)

    monkeypatch.setattr(preflight, "available_bytes", free(base + (layer_need + chunk_need) // 2))
    rc, out, err = _prefill(capsys, "--tokens", 300, "--budget-bytes", budget, "--no-progress")
    assert rc == 2 and err.count("\n") == 1 and "running in layer-major order" not in err, err
    assert err.startswith("glm-dsa prefill: error: needs ") and ", or run one layer at a time: --order layer (" in err
    rc, out, err = _prefill(capsys, "--tokens", 300, "--budget-bytes", budget, "--order", "layer", "--no-progress")
    assert rc == 0, err
    assert "== layers (layer-major order" in out
    # Not even with the hidden rows and top-k on the host:
    least = memory_plan(config, [300], 128, "fp32", torch.float32, budget, available=0)
    monkeypatch.setattr(preflight, "available_bytes", free(base + least.device_bytes + least.module_bytes - 1))
    rc, _, err = _prefill(capsys, "--tokens", 300, "--budget-bytes", budget, "--order", "layer", "--no-progress")
    assert rc == 2 and err.count("error:") == 1 and "--order layer needs" in err and "by its memory plan" in err


def test_on_cuda_layer_order_is_chosen_when_only_one_layer_fits(capsys, monkeypatch):
    """The CUDA decision, driven on the CPU with a GPU's free memory faked: between the plan and
    the whole model's estimate, one line says layer-major order was chosen and the plan follows;
    below the plan the chunk-major refusal stands, naming no layer order."""
    import argparse

    from glm_dsa import cli, preflight
    from glm_dsa.ledger import prefill_peak_bytes

    config = PRESETS["tiny"]
    budget = 1 << 20
    gpu = torch.device("cuda", 0)
    run = argparse.Namespace(device=gpu, config=config, dtype=torch.float32, checkpoint=None)
    chunk_need = prefill_peak_bytes(config, [300], 128, "fp32", 4, budget)
    plan = memory_plan(config, [300], 128, "fp32", torch.float32, budget, None)
    assert plan.device_bytes < chunk_need

    def args():
        return argparse.Namespace(order=None, cp=None, chunk=128, kv_dtype="fp32", budget_bytes=budget,
                                  mem_fraction_static=0.8)

    have = (plan.device_bytes + chunk_need) // 2
    monkeypatch.setattr(preflight, "available_bytes", lambda device: have if device.type == "cuda" else 1 << 40)
    chosen = args()
    cli._choose_order(chosen, run, [300], chunk_need, have, "lower --tokens")
    err = capsys.readouterr().err.splitlines()
    assert chosen.order == "layer" and chosen.hidden_on_device
    assert err[0].startswith("prefill: the whole model (") and "does not fit on cuda:0" in err[0]
    assert err[0].endswith("running in layer-major order (--order layer)") and err[1].startswith("memory plan")
    have = memory_plan(config, [300], 128, "fp32", torch.float32, budget, available=0).device_bytes - 1
    with pytest.raises(ValueError, match=r"^needs .* GB free on cuda:0; lower --tokens$"):
        cli._choose_order(args(), run, [300], chunk_need, have, "lower --tokens")


def test_a_stack_too_deep_for_its_layer_modules_is_refused_before_any_is_built(capsys, monkeypatch):
    """Layer-major order builds every layer's modules on the meta device: a stack whose modules
    alone exceed the host memory is refused by its plan, in one line naming them, and without
    --order the chunk-major refusal stands (layer order is not chosen)."""
    from glm_dsa import preflight
    from glm_dsa.layer_major import LAYER_MODULE_BYTES

    base = preflight.host_baseline_bytes()
    layers = 4
    modules = layers * LAYER_MODULE_BYTES
    assert modules == 4 * 65536  # 64 KiB each: 62 KB measured over 3,000 meta layers of tiny
    plan = memory_plan(PRESETS["tiny"], [64], 128, "fp32", torch.float32, 1 << 20, None)
    assert plan.module_bytes == modules
    # room for everything but half the modules
    total = base + plan.device_bytes + modules // 2
    monkeypatch.setattr(preflight, "available_bytes", lambda device: total - preflight.resident_bytes())
    rc, _, err = _prefill(capsys, "--tokens", 64, "--budget-bytes", 1 << 20, "--order", "layer", "--no-progress")
    assert rc == 2 and err.count("error:") == 1, err
    assert "of host memory by its memory plan" in err and "the 4 layers' modules" in err
    rc, _, err = _prefill(capsys, "--tokens", 64, "--budget-bytes", 1 << 20, "--no-progress")
    assert rc == 2 and "running in layer-major order" not in err and "GB host memory;" in err, err


def test_prefill_order_layer_refusals(capsys):
    for argv, message in (
        (["--tokens", 100, "--order", "layer", "--cuda-graphs"], "--order layer runs one layer at a time"),
        (["--tokens", 100, "--save-outputs", "x.safetensors", "--save-layer-outputs", "2:9"],
         "2:9 is outside the kept layers 0:4"),
        (["--tokens", 100, "--save-outputs", "x.safetensors", "--save-layer-outputs", "one"],
         "'one' is neither a layer index nor a range"),
    ):
        rc, _, err = _prefill(capsys, *argv)
        assert rc == 2 and message in err and err.count("\n") == 1, err


@pytest.mark.cuda
@pytest.mark.slow
def test_layer_major_order_gives_chunk_majors_bits_glm_5_3_on_cuda():
    """GLM-5.3 layers 6:9 (a full MoE layer and the two shared layers reusing its top-k) at
    full width, bf16, FP8 KV, triton backend, two requests of 32,768 tokens together in chunks of
    8,192: layer-major order with the layers drawn on the GPU on their turn gives the bits of
    chunk-major order over the resident model (both eager)."""
    config = keep_layers(PRESETS["glm-5.3"], "6:9")
    lengths, chunk = [20_480, 12_288], 8_192
    ids = [_ids(n, i, config.vocab_size) for i, n in enumerate(lengths)]

    def run(model, **kw):
        engine = PrefillEngine.for_prompts(model, lengths, kv_dtype="fp8", chunked_prefill_size=chunk,
                                           backend="triton", cuda_graphs=False, layer_outputs=True, **kw)
        rids = [engine.add_request(t) for t in ids]
        engine.run()
        return {k: v.cpu() for k, v in engine.outputs(rids).items()}, [s.chunks for s in engine.timeline]

    model = init_weights(build_model(config, torch.bfloat16, "cuda"), seed=0, first_layer=6).eval()
    expected = run(model)
    del model
    torch.cuda.empty_cache()
    outer = init_outer_weights(build_outer_model(config, torch.bfloat16, "cuda"), seed=0).eval()
    got = run(outer, order="layer", layer_weights=RandomLayerWeights(0, first_layer=6))
    _assert_same(expected, got)
