"""`glm-dsa prefill`: the main job's report, JSON, and the save/replay of outputs."""

import json

import torch
from safetensors.torch import load_file

from glm_dsa.cli import main
from glm_dsa.config import PRESETS

from dense_reference import rel_err


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
    import pytest

    # one error style (issue 20): exit 2 and one line naming the flag, not a SystemExit
    assert main(["prefill", "--config", "tiny", "--tokens", "100", "--prefix", "100"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("glm-dsa prefill: error: --prefix") and err.count("\n") == 1
