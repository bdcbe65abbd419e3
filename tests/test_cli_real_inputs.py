"""Real inputs for ``glm-dsa prefill``: a sharded checkpoint with an MTP layer, per-layer outputs
and top-k, hidden states as the input of a later layer, text through a tokenizer.json built here,
and the memory figures of the report."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_dsa.cli import main
from glm_dsa.config import PRESETS
from glm_dsa.ledger import param_counts
from glm_dsa.layer import DSAForCausalLM
from glm_dsa.weights import init_weights, state_dict_for_save, write_config, write_safetensors

TINY = PRESETS["tiny"]  # layers 0-2 full, 3 shared; index_topk 64


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny model in float32, sharded, with an MTP layer (num_nextn_predict_layers 1)."""
    d = tmp_path_factory.mktemp("ckpt")
    model = init_weights(DSAForCausalLM(TINY), 3)
    write_config(TINY, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    stored = state_dict_for_save(model)
    mtp = {k.replace("model.layers.3.", "model.layers.4."): v.clone() for k, v in stored.items()
           if k.startswith("model.layers.3.")}
    write_safetensors({**stored, **mtp}, d, max_shard_bytes=96 << 10)
    return d


def _prefill(capsys, *argv):
    rc = main(["prefill", "--no-progress", "--kv-dtype", "fp32", "--chunk", "128", *map(str, argv)])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out, err


def test_layer_outputs_and_topk_are_saved_request_relative(tmp_path, capsys, checkpoint):
    out = tmp_path / "o.safetensors"
    _, err = _prefill(capsys, "--config", checkpoint, "--weights", checkpoint, "--tokens", 200, "--requests", 2,
                      "--save-outputs", out, "--save-layer-outputs")
    assert "skipped" in err and "tensors of the MTP layer(s) 4 (num_nextn_predict_layers=1" in err
    saved = load_file(out)
    for i in range(2):
        for layer in range(4):
            h = saved[f"request.{i}.layer.{layer}.hidden"]
            assert h.dtype == torch.float32 and h.shape == (200, TINY.hidden_size)
        assert torch.equal(saved[f"request.{i}.layer.3.hidden"], saved[f"request.{i}.hidden"])
        assert f"request.{i}.layer.3.topk" not in saved  # layer 3 is shared: it has no top-k of its own
        for layer in range(3):
            topk = saved[f"request.{i}.layer.{layer}.topk"]
            assert topk.dtype == torch.int32 and topk.shape == (200, TINY.index_topk)
            pos = torch.arange(200)[:, None]
            valid = topk >= 0
            # request-relative causal positions, each row's keys distinct, -1 only as padding
            assert bool(((topk <= pos) | ~valid).all()) and bool((topk >= -1).all())
            assert torch.equal(valid.sum(1), torch.clamp(pos[:, 0] + 1, max=TINY.index_topk))
            for row in (0, 63, 150, 199):
                keys = topk[row][valid[row]]
                assert keys.unique().numel() == keys.numel()


def test_hidden_input_of_layer_a_equals_the_run_of_layers_before_it(tmp_path, capsys, checkpoint):
    full = tmp_path / "full.safetensors"
    _prefill(capsys, "--config", checkpoint, "--weights", checkpoint, "--tokens", 300, "--seed", 5,
             "--save-outputs", full, "--save-layer-outputs")
    saved = load_file(full)
    inputs = tmp_path / "h.safetensors"
    save_file({"request.0.hidden": saved["request.0.layer.1.hidden"]}, inputs)
    part = tmp_path / "part.safetensors"
    _, err = _prefill(capsys, "--config", checkpoint, "--weights", checkpoint, "--layers", "2:4",
                      "--input-hidden", inputs, "--save-outputs", part, "--save-layer-outputs")
    assert "read" in err and "layers 2:4" in err
    resumed = load_file(part)
    assert "request.0.input_ids" not in resumed
    assert sorted(k for k in resumed if ".layer." in k) == [
        "request.0.layer.2.hidden", "request.0.layer.2.topk", "request.0.layer.3.hidden"]
    for name in ("request.0.hidden", "request.0.logits", "request.0.layer.2.hidden", "request.0.layer.2.topk",
                 "request.0.layer.3.hidden"):
        assert torch.equal(resumed[name], saved[name]), name


def _word_tokenizer(directory, words):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.save(str(directory / "tokenizer.json"))


def test_text_is_tokenized_with_the_checkpoint_tokenizer(tmp_path, capsys, checkpoint):
    pytest.importorskip("tokenizers")
    d = tmp_path / "ckpt"
    d.mkdir()
    for f in checkpoint.iterdir():
        (d / f.name).write_bytes(f.read_bytes())
    words = ["[UNK]", "the", "sparse", "indexer", "picks", "keys", "."]
    _word_tokenizer(d, words)
    prompt = "the indexer picks the sparse keys . " * 20 + "unknown"
    (tmp_path / "prompt.txt").write_text(prompt, encoding="utf-8")
    out = tmp_path / "o.safetensors"
    _prefill(capsys, "--config", d, "--weights", d, "--text", tmp_path / "prompt.txt", "--save-outputs", out)
    expected = [words.index(w) if w in words else 0 for w in prompt.split()]
    assert load_file(out)["request.0.input_ids"].tolist() == expected


@pytest.mark.parametrize(
    "argv, text",
    [
        (["--text", "{d}/prompt.txt"], "--text needs a tokenizer.json in the checkpoint directory"),
        (["--tokens", "64", "--save-layer-outputs"], "--save-layer-outputs adds to the --save-outputs file"),
        (["--input-hidden", "{d}/wide.safetensors"], "has shape [64, 129]; expected [L, 128]"),
        (["--input-hidden", "{d}/ints.safetensors"], "has dtype I64; hidden states must be"),
        (["--input-hidden", "{d}/nan.safetensors"], "request.0.hidden holds NaN or inf"),
        (["--input-hidden", "{d}/ok.safetensors", "--text", "{d}/prompt.txt"], "are alternatives; give one"),
        (["--input-hidden", "{d}/ok.safetensors", "--tokens", "65"], "--tokens 65 disagrees with --input-hidden"),
    ],
    ids=["text-no-tokenizer", "layers-without-outputs", "hidden-width", "hidden-dtype", "hidden-nan",
         "two-inputs", "tokens-disagree"],
)
def test_bad_real_inputs_give_one_line(tmp_path, capsys, argv, text):
    (tmp_path / "prompt.txt").write_text("hello", encoding="utf-8")
    save_file({"request.0.hidden": torch.zeros(64, 129)}, str(tmp_path / "wide.safetensors"))
    save_file({"request.0.hidden": torch.zeros(64, 128, dtype=torch.int64)}, str(tmp_path / "ints.safetensors"))
    save_file({"request.0.hidden": torch.full((64, 128), float("nan"))}, str(tmp_path / "nan.safetensors"))
    save_file({"request.0.hidden": torch.zeros(64, 128)}, str(tmp_path / "ok.safetensors"))
    rc = main(["prefill", "--config", "tiny", "--no-progress", *[a.replace("{d}", str(tmp_path)) for a in argv]])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and text in err, err


def test_the_report_gives_the_weight_bytes_of_the_kept_layers(capsys):
    out, _ = _prefill(capsys, "--config", "small", "--layers", "2:5", "--tokens", 64, "--json")
    report = json.loads(out)
    small = PRESETS["small"]
    from glm_dsa.config import keep_layers

    # float32 on the CPU: 4 bytes per parameter of the three kept layers, embedding and head
    assert report["memory"]["weight_bytes"] == 4 * param_counts(keep_layers(small, "2:5"))["total"]
    assert report["memory"]["weights_peak_bytes"] is None and report["memory"]["prefill_peak_bytes"] is None


_WORDS = ["[UNK]", "the", "sparse", "indexer", "picks", "keys", "."]
_PROMPT = "the indexer picks the sparse keys . " * 10


@pytest.fixture
def text_model(tmp_path):
    """A config directory (tiny, random weights) with a word-level tokenizer.json."""
    pytest.importorskip("tokenizers")
    d = tmp_path / "model"
    write_config(TINY, d)
    _word_tokenizer(d, _WORDS)
    return d


def _prefill_text(model_dir, text_path, out, **popen):
    """``python -m glm_dsa prefill --text TEXT_PATH`` in a child, as a shell runs it."""
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return subprocess.Popen(
        [sys.executable, "-m", "glm_dsa", "prefill", "--config", str(model_dir), "--text", str(text_path),
         "--chunk", "64", "--no-progress", "--save-outputs", str(out)],
        cwd=repo, env={**os.environ, "PYTHONPATH": repo}, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        text=True, **popen)


def _ids_written(out) -> list[int]:
    return load_file(out)["request.0.input_ids"].tolist()


def test_text_from_a_fifo_fed_once_is_read_once(tmp_path, text_model):
    """A FIFO gives its text to one reader only: a second read waits for a writer that never
    comes (the run hung when --text was read twice)."""
    import os
    import threading

    fifo = tmp_path / "prompt.fifo"
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "w", encoding="utf-8") as f:  # blocks until the run opens it
            f.write(_PROMPT)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    out = tmp_path / "o.safetensors"
    proc = _prefill_text(text_model, fifo, out)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
        if writer.is_alive():  # the run never opened the FIFO: release the writer
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    assert proc.returncode == 0, err
    assert _ids_written(out) == [_WORDS.index(w) for w in _PROMPT.split()]


def test_text_from_a_process_substitution_is_read_once(tmp_path, text_model):
    """``--text <(cat prompt.txt)``: the shell hands the run ``/dev/fd/N``, a pipe already fed
    (a second read found it empty: 'tokenizes to no tokens')."""
    import os

    r, w = os.pipe()
    os.write(w, _PROMPT.encode())
    os.close(w)
    out = tmp_path / "o.safetensors"
    proc = _prefill_text(text_model, f"/dev/fd/{r}", out, pass_fds=(r,))
    os.close(r)
    try:
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert _ids_written(out) == [_WORDS.index(w) for w in _PROMPT.split()]
