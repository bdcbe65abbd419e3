"""The engine's and the CLI's boundaries (issue 27 "Positions", issue 32 point 5): prompts past
``max_position_embeddings`` refused with the fix; outputs read before ``run()`` a clear error."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from glm_dsa.cli import main
from glm_dsa.config import get_config
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import build_model, init_weights


@pytest.fixture(scope="module")
def engine_of():
    config = get_config("tiny").replace(max_position_embeddings=200)
    model = init_weights(build_model(config, torch.float32), 0).eval()
    return lambda: PrefillEngine(model, num_pages=8, kv_dtype="bf16", chunked_prefill_size=128)


def test_add_request_refuses_a_prompt_past_max_position_embeddings(engine_of):
    engine = engine_of()
    assert engine.add_request(torch.zeros(200, dtype=torch.int64)) == 0  # exactly the limit runs
    for n, new in ((201, 0), (150, 51)):
        with pytest.raises(ValueError, match=rf"^request of {n} \+ {new} tokens runs past max_position_embeddings="
                                             r"200 of config tiny \(positions the model was not built for\): "
                                             "shorten it, or use a config with a larger max_position_embeddings$"):
            engine.add_request(torch.zeros(n, dtype=torch.int64), max_new_tokens=new)
    assert len(engine.waiting) == 1


def test_outputs_before_run_name_the_request_state(engine_of):
    engine = engine_of()
    with pytest.raises(ValueError, match=r"^no request 0: add_request has returned no request yet$"):
        engine.output_hidden(0)
    rid = engine.add_request(torch.zeros(150, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"^request 0 is waiting \(0 of 150 tokens run\); call run\(\) \(or step\(\) "
                                         r"until it returns None\) before reading its outputs$"):
        engine.output_hidden(rid)
    engine.step()
    with pytest.raises(ValueError, match=r"^request 0 is running \(128 of 150 tokens run\)"):
        engine.outputs([rid])
    with pytest.raises(ValueError, match=r"^no request 5: add_request has returned ids 0 … 0$"):
        engine.report([5])
    engine.run()
    assert engine.output_hidden(rid).shape == (150, 128)


def test_the_cli_refuses_tokens_past_max_position_embeddings(capsys, tmp_path):
    assert main(["prefill", "--config", "tiny", "--tokens", "16385", "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        "glm-dsa prefill: error: --tokens 16385 runs past max_position_embeddings=16384 of config tiny; lower "
        "--tokens or use a config whose config.json has a larger max_position_embeddings\n")
    ids = tmp_path / "ids.safetensors"
    save_file({"request.0.input_ids": torch.zeros(64, dtype=torch.int64),
               "request.1.input_ids": torch.zeros(16385, dtype=torch.int64)}, str(ids))
    assert main(["prefill", "--config", "tiny", "--input-ids", str(ids), "--no-progress"]) == 2
    assert capsys.readouterr().err == (
        f"glm-dsa prefill: error: --input-ids {ids}: request.1.input_ids has 16385 tokens, past "
        "max_position_embeddings=16384 of config tiny; shorten it or use a config whose config.json has a larger "
        "max_position_embeddings\n")
