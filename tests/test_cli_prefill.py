"""`glm-dsa prefill`: the main job's report, JSON, and the save/replay of outputs."""

import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file

from glm_dsa.cli import main
from glm_dsa.config import PRESETS

from dense_reference import rel_err

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_prefill_prints_the_timeline_and_cache_usage(capsys):
    assert main(["prefill", "--config", "tiny", "--tokens", "300", "--chunk", "128", "--requests", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "timeline" in out and "cache usage" in out
    # 2 requests × 300 tokens in 128-token steps: 0:0-127, 0:128-255, then 0:256-299 shares a
    # step with 1:0-63 (44 tokens take one 64-token page of the budget), ...
    assert "0:256-299 1:0-63" in out


def test_prefill_json_counts_the_bytes_the_ledger_predicts(capsys):
    from glm_dsa.ledger import cache_bytes_written

    assert main(["prefill", "--config", "tiny", "--tokens", "200", "--chunk", "64", "--kv-dtype", "bf16",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "glm-dsa.prefill/1"
    expected = cache_bytes_written(PRESETS["tiny"], 200, "bf16")
    assert report["cache"]["bytes_written_main_kv"] == expected["main_kv"]
    assert report["cache"]["bytes_written_index_k"] == expected["index_k"]
    assert [(c["chunks"][0]["start"], c["chunks"][0]["end"]) for c in report["steps"]] == [
        (0, 64), (64, 128), (128, 192), (192, 200)]


def test_saved_outputs_replay_through_input_ids_and_cover_prefix_hits(tmp_path, capsys):
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["prefill", "--config", "tiny", "--tokens", "300", "--chunk", "128", "--prefix", "130",
                 "--kv-dtype", "fp32", "--save-outputs", str(a), "--no-progress"]) == 0
    assert main(["prefill", "--config", "tiny", "--input-ids", str(a), "--chunk", "64", "--kv-dtype", "fp32",
                 "--save-outputs", str(b), "--no-progress"]) == 0
    capsys.readouterr()
    ta, tb = load_file(a), load_file(b)
    assert torch.equal(ta["request.0.input_ids"], tb["request.0.input_ids"])
    assert ta["request.0.hidden"].shape == (300, PRESETS["tiny"].hidden_size)  # every token
    assert rel_err(ta["request.0.hidden"], tb["request.0.hidden"]) <= 1e-5
    assert rel_err(ta["request.0.logits"], tb["request.0.logits"]) <= 1e-5


def test_prefill_rejects_a_prefix_longer_than_the_prompt(capsys):

    # one error style (issue 20): exit 2 and one line naming the flag, not a SystemExit
    assert main(["prefill", "--config", "tiny", "--tokens", "100", "--prefix", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm-dsa prefill: error: --prefix") and err.count("\n") == 1


def test_version_and_python_dash_m():
    import glm_dsa

    for argv in ([sys.executable, "-m", "glm_dsa", "--version"],):
        out = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, check=True).stdout
        assert out.strip() == f"glm-dsa {glm_dsa.__version__}"


def test_layers_with_weights_renumbers_checkpoint_layers(tmp_path):
    """--layers 2:4 of weights_stub/small: the model's layer i holds checkpoint layer 2 + i."""
    from safetensors.torch import load_file

    from glm_dsa.weights import load_checkpoint

    stub = os.path.join(REPO_ROOT, "weights_stub", "small")
    model = load_checkpoint(stub, layers="2:4")
    stored = load_file(os.path.join(stub, "model.safetensors"))
    assert model.config.name.endswith("[2:4]") and model.config.num_hidden_layers == 2
    assert model.config.indexer_types == ("full", "shared") and model.config.first_k_dense_replace == 0
    state = model.state_dict()
    for i in range(2):
        for key in ("self_attn.q_a_proj.weight", "mlp.experts.3.down_proj.weight", "input_layernorm.weight"):
            assert torch.equal(state[f"model.layers.{i}.{key}"], stored[f"model.layers.{2 + i}.{key}"])
    assert torch.equal(state["model.embed_tokens.weight"], stored["model.embed_tokens.weight"])


def test_prefill_and_ledger_take_the_same_chunks(capsys):
    for command in (["prefill", "--config", "tiny", "--tokens", "300"], ["ledger", "--config", "tiny", "--tokens", "300"]):
        assert main([*command, "--chunk", "100"]) == 2
        err = capsys.readouterr().err
        assert "--chunk 100 must be a positive multiple of page_size=64, e.g. --chunk 64" in err
        assert main([*command, "--chunk", "128", *(["--json"] if command[0] == "ledger" else ["--no-progress"])]) == 0
        capsys.readouterr()


def test_the_memory_hint_names_the_weights_when_they_alone_do_not_fit(capsys):
    # All 78 GLM-5.3 layers in float32 are ~3 TB of weights: no machine's host memory holds them.
    assert main(["prefill", "--config", "glm-5.3", "--tokens", "1000"]) == 2
    err = capsys.readouterr().err
    assert "the weights alone take 2973.5 GB at 4 bytes per parameter: keep fewer layers (--layers 6:7)" in err
    assert "lower --tokens" not in err


def test_the_fewer_layers_hint_names_a_full_moe_layer_of_the_config_at_hand(capsys, monkeypatch):
    """The slice suggested is one layer of the config's heaviest kind: tiny's layer 1 (full,
    MoE), not GLM-5.3's 6:7, which tiny has no layer 6 for."""
    monkeypatch.setattr("glm_dsa.preflight.available_bytes", lambda device: 1)
    assert main(["prefill", "--config", "tiny", "--tokens", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "keep fewer layers (--layers 1:2), use a smaller --config" in err, err
