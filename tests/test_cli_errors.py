"""Bad input on the command line: one line ``glm-dsa <command>: error: …`` naming the flag or
file, exit status 2, no traceback, and before any model is built (issue 20)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file

from glm_dsa.cli import main
from glm_dsa.config import get_config, to_hf_config

TINY = ["prefill", "--config", "tiny", "--no-progress"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    cfg = to_hf_config(get_config("tiny"))
    typo = dict(cfg)
    typo["hiden_size"] = typo.pop("hidden_size")
    (d / "typo.json").write_text(json.dumps(typo))
    missing = {k: v for k, v in cfg.items() if k not in ("vocab_size", "kv_lora_rank")}
    (d / "missing.json").write_text(json.dumps(missing))
    (d / "garbage.safetensors").write_bytes(b"this is not a safetensors file at all")
    save_file({"request.0.input_ids": torch.arange(64)}, str(d / "ids.safetensors"))
    full = (d / "ids.safetensors").read_bytes()
    (d / "truncated.safetensors").write_bytes(full[:-100])
    save_file({"request.0.input_ids": torch.arange(64), "request.2.input_ids": torch.arange(64)},
              str(d / "gap.safetensors"))
    save_file({"request.0.input_ids": torch.rand(64) * 10}, str(d / "float.safetensors"))
    save_file({"something": torch.arange(4)}, str(d / "none.safetensors"))
    save_file({"request.0.input_ids": torch.full((64,), 10**9)}, str(d / "range.safetensors"))
    (d / "empty").mkdir()
    (d / "nofile").mkdir()
    (d / "nofile" / "config.json").write_text(json.dumps(cfg))
    (d / "garbw").mkdir()
    (d / "garbw" / "config.json").write_text(json.dumps(cfg))
    (d / "garbw" / "model.safetensors").write_bytes(b"\x00" * 3)
    (d / "golden").mkdir()
    (d / "golden" / "manifest.json").write_text("{}")
    (d / "afile").write_text("x")
    (d / "list.json").write_text("[1, 2]")
    (d / "broken.json").write_text('{"hidden_size": 128,')
    (d / "stringbool.json").write_text(json.dumps({**cfg, "norm_topk_prob": "false"}))
    os.mkfifo(d / "fifo")
    return d


def _cases():
    f = "{d}"
    return [
        # (argv, exit, text that must appear in the one line)
        (["ledger", "--config", "glm-5.3", "--tokens", "0", "--chunk", "64"], 2, "--tokens 0"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "0"], 2, "--chunk 0"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "64", "--prefix", "-1"], 2, "--prefix -1"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "64", "--prefix", "1000"], 2, "--prefix 1000"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "64", "--gpus", "0"], 2, "--gpus 0"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "64", "--hbm-tbps", "0"], 2, "--hbm-tbps"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "64", "--mem-fraction-static", "2"], 2,
         "--mem-fraction-static"),
        (["ledger", "--config", f + "/typo.json", "--tokens", "1000", "--chunk", "64"], 2,
         "did you mean: 'hiden_size'"),
        (["ledger", "--config", f + "/missing.json", "--tokens", "1000", "--chunk", "64"], 2, "vocab_size"),
        (["ledger", "--config", "nope", "--tokens", "1000", "--chunk", "64"], 2, "unknown config"),
        ([*TINY, "--tokens", "64", "--requests", "0"], 2, "--requests 0"),
        ([*TINY, "--tokens", "64", "--batch-invariant", "--backend", "peers"], 2, "--batch-invariant"),
        ([*TINY, "--tokens", "64", "--cuda-graphs"], 2, "--cuda-graphs: CUDA graphs need a CUDA device, not cpu"),
        ([*TINY, "--tokens", "0"], 2, "--tokens"),
        ([*TINY], 2, "--tokens"),
        ([*TINY, "--tokens", "100", "--prefix", "100"], 2, "--prefix 100"),
        ([*TINY, "--tokens", "64", "--chunk", "32"], 2, "--chunk 32"),
        ([*TINY, "--tokens", "64", "--cp", "0"], 2, "--cp 0"),
        ([*TINY, "--tokens", "64", "--device", "tpu"], 2, "--device tpu"),
        ([*TINY, "--tokens", "64", "--device", "nonsense"], 2, "--device"),
        ([*TINY, "--tokens", "64", "--budget-bytes", "0"], 2, "--budget-bytes 0"),
        ([*TINY, "--tokens", "64", "--save-outputs", f + "/missing_dir/out.safetensors"], 2, "--save-outputs"),
        ([*TINY, "--tokens", "64", "--save-outputs", f], 2, "is a directory"),
        ([*TINY, "--tokens", "64", "--plot", f + "/no/such/dir/p.png"], 2, "--plot"),
        ([*TINY, "--tokens", "64", "--weights", f + "/nowhere"], 2, "--weights"),
        ([*TINY, "--tokens", "64", "--weights", f + "/empty"], 2, "has no config.json"),
        ([*TINY, "--tokens", "64", "--weights", f + "/nofile"], 2, "has no model.safetensors"),
        ([*TINY, "--tokens", "64", "--weights", f + "/garbw"], 2, "not a safetensors file"),
        ([*TINY, "--input-ids", f + "/absent.safetensors"], 2, "does not exist"),
        ([*TINY, "--input-ids", f + "/garbage.safetensors"], 2, "not a safetensors file"),
        ([*TINY, "--input-ids", f + "/truncated.safetensors"], 2, "truncated"),
        ([*TINY, "--input-ids", f + "/gap.safetensors"], 2, "numbered request.0"),
        ([*TINY, "--input-ids", f + "/float.safetensors"], 2, "must be integers"),
        ([*TINY, "--input-ids", f + "/none.safetensors"], 2, "holds no request"),
        ([*TINY, "--input-ids", f + "/range.safetensors"], 2, "outside [0, vocab_size"),
        ([*TINY, "--input-ids", f + "/ids.safetensors", "--tokens", "100"], 2, "--tokens 100 disagrees"),
        ([*TINY, "--input-ids", f + "/ids.safetensors", "--requests", "3"], 2, "--requests 3 disagrees"),
        ([*TINY, "--input-ids", f + "/ids.safetensors", "--prefix", "64"], 2, "--prefix"),
        ([*TINY, "--config", f + "/typo.json", "--tokens", "64"], 2, "did you mean"),
        (["prefill", "--config", "glm-5.3", "--tokens", "64", "--no-progress"], 2, "GB host memory"),
        ([*TINY, "--tokens", str(10**12)], 2, "lower --tokens"),
        ([*TINY, "--config", f + "/list.json", "--tokens", "64"], 2, "list.json holds a JSON list, not an object"),
        ([*TINY, "--config", f + "/broken.json", "--tokens", "64"], 2, "broken.json is not valid JSON"),
        ([*TINY, "--config", f + "/stringbool.json", "--tokens", "64"], 2,
         'stringbool.json: norm_topk_prob="false" must be a boolean (true or false)'),
        ([*TINY, "--tokens", "16385"], 2, "--tokens 16385 runs past max_position_embeddings=16384"),
        ([*TINY, "--tokens", "64", "--cp", "4096"], 2, "--cp 4096: 4096 ranks on"),
        ([*TINY, "--input-ids", f + "/ids.safetensors", "--save-outputs", f + "/ids.safetensors"], 2,
         "is the input --input-ids"),
        ([*TINY, "--tokens", "64", "--save-outputs", f + "/fifo"], 2, "is a FIFO, not a regular file"),
        ([*TINY, "--tokens", "64", "--save-outputs", "/dev/null"], 2, "is a character device"),
        (["golden", "--out", f + "/afile"], 2, "--out"),
        (["golden", "--out", f + "/no/such/parent"], 2, "--out"),
        (["compare", "--golden", f + "/nowhere", "--candidate", f + "/ids.safetensors"], 2, "manifest.json"),
        (["compare", "--golden", f + "/golden", "--candidate", f + "/absent.safetensors"], 2, "--candidate"),
        (["compare", "--golden", f + "/golden", "--candidate", f + "/garbage.safetensors"], 2, "--candidate"),
        (["check", "glm_dsa.oracle:act_quant", "--contract", "nope"], 2, "unknown contract"),
        (["check", "no_such_module:f", "--contract", "act_quant"], 2, "cannot import"),
        (["check", "glm_dsa.oracle", "--contract", "act_quant"], 2, "MODULE:FUNCTION"),
    ]


CASES = _cases()


def test_the_table_covers_every_command_with_at_least_30_cases():
    assert len(CASES) >= 30
    assert {argv[0] for argv, _, _ in CASES} == {"ledger", "prefill", "golden", "compare", "check"}


@pytest.mark.parametrize("argv, status, text", CASES, ids=[" ".join(c[0][:1] + [c[2]]) for c in CASES])
def test_bad_input_gives_one_line_naming_the_fix_before_any_compute(capsys, files, argv, status, text):
    argv = [a.replace("{d}", str(files)) for a in argv]
    t0 = time.perf_counter()
    rc = main(argv)
    elapsed = time.perf_counter() - t0
    out, err = capsys.readouterr()
    assert rc == status
    assert err.startswith(f"glm-dsa {argv[0]}: error: ") and err.count("\n") == 1, err
    assert text in err and "Traceback" not in err
    assert elapsed < 5  # refused before a model is built or a token computed
    assert out == ""


@pytest.mark.parametrize("argv, text", [
    (["prefill", "--config", "tiny", "--tokens", "64", "--device", "tpu"], "--device tpu"),
    (["ledger", "--config", "glm-5.3", "--tokens", "0", "--chunk", "64"], "--tokens 0"),
    (["prefill", "--config", "tiny", "--tokens", "64", "--requests", "0"], "--requests 0"),
])
def test_the_installed_command_prints_the_same_one_line(argv, text):
    proc = subprocess.run([sys.executable, "-m", "glm_dsa.cli", *argv], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and text in proc.stderr


def test_debug_shows_the_traceback(capsys):
    with pytest.raises(ValueError, match="--requests 0"):
        main(["prefill", "--config", "tiny", "--tokens", "64", "--requests", "0", "--debug"])


def test_a_failure_during_the_run_exits_1_with_one_line(capsys, monkeypatch):
    import glm_dsa.cli as cli

    def boom(*args, **kwargs):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cli, "build_ledger", boom)
    assert cli.main(["ledger", "--config", "tiny", "--tokens", "64", "--chunk", "64"]) == 1
    err = capsys.readouterr().err
    assert err == "glm-dsa ledger: error: RuntimeError: disk full (rerun with --debug for the traceback)\n"


def test_nonfinite_weight_is_named(tmp_path, capsys):
    from glm_dsa.layer import DSAForCausalLM
    from glm_dsa.weights import init_weights, save_checkpoint

    model = init_weights(DSAForCausalLM(get_config("tiny")), 0)
    with torch.no_grad():
        model.model.layers[0].self_attn.q_a_proj.weight[0, 0] = float("nan")
    save_checkpoint(model, tmp_path)
    assert main([*TINY, "--config", str(tmp_path), "--weights", str(tmp_path), "--tokens", "64"]) == 2
    err = capsys.readouterr().err
    assert "model.layers.0.self_attn.q_a_proj.weight: holds NaN or inf" in err


def test_outputs_are_written_with_the_umask(tmp_path, capsys):
    out = tmp_path / "o.safetensors"
    old = os.umask(0o022)
    try:
        assert main([*TINY, "--tokens", "64", "--chunk", "64", "--save-outputs", str(out)]) == 0
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o644
    assert [p.name for p in tmp_path.iterdir()] == ["o.safetensors"]  # no temporary left behind


def test_memory_check_counts_only_the_kept_layers(capsys, monkeypatch):
    """--layers 6:7 of GLM-5.3 at 131,072 tokens: the estimate is one layer's (its weights alone
    are 9.8e9 parameters = 19.6 GB in bf16 on CUDA, 39 GB in float32 here), not the whole
    model's 1.5 TB; with 1 GB available it is refused before any model is built."""
    monkeypatch.setattr("glm_dsa.preflight.available_bytes", lambda device: 10**9)
    assert main(["prefill", "--config", "glm-5.3", "--layers", "6:7", "--tokens", "131072"]) == 2
    err = capsys.readouterr().err
    need = float(err.split("needs ")[1].split(" GB")[0])
    assert 39 < need < 100, err


def _model_never_built(monkeypatch):
    """The run's one way to a model (random or from --weights) fails the test when reached."""
    import glm_dsa.cli as cli

    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model was built before the refusal"))


def _values_case(tmp_path, kind):
    """(flag, file, the one line's text after 'FLAG FILE: ') for a file whose header is sound and
    whose values are not (issue 45: refused only after the model was built)."""
    v = get_config("tiny").vocab_size
    path = tmp_path / f"{kind}.safetensors"
    if kind in ("nan", "inf"):
        bad = torch.zeros(64, 128)
        bad[5, 7] = float(kind)
        save_file({"request.0.hidden": torch.zeros(64, 128), "request.1.hidden": bad}, str(path))
        return "--input-hidden", path, "request.1.hidden holds NaN or inf"
    ids = torch.arange(64)
    ids[9] = v if kind == "vocab" else -3
    save_file({"request.0.input_ids": ids}, str(path))
    return "--input-ids", path, (f"request.0.input_ids holds token id {ids[9].item()} (position 9), outside "
                                 f"[0, vocab_size={v}); use ids of this model's tokenizer")


@pytest.mark.parametrize("command", ["prefill", "fidelity"])
@pytest.mark.parametrize("kind", ["nan", "inf", "vocab", "negative"])
def test_bad_input_values_are_refused_before_the_model_is_built(tmp_path, capsys, monkeypatch, command, kind):
    flag, path, text = _values_case(tmp_path, kind)
    _model_never_built(monkeypatch)
    extra = ["--request", "1"] if command == "fidelity" and flag == "--input-hidden" else []
    assert main([command, "--config", "tiny", flag, str(path), *extra]) == 2
    assert capsys.readouterr().err == f"glm-dsa {command}: error: {flag} {path}: {text}\n"


@pytest.mark.parametrize("foreign", ["notes.txt", "{contract}.safetensors/notes.txt", "manifest.json/notes.txt"],
                         ids=["a-file", "a-directory-named-as-a-golden-file", "a-directory-named-manifest"])
def test_golden_out_holding_what_golden_does_not_write_is_refused_before_any_case(tmp_path, capsys, monkeypatch,
                                                                                  foreign):
    """The directory is replaced whole, so whatever golden would not write there is the user's:
    a file, or a directory under one of golden's own file names (it was swapped out and deleted
    with what it held)."""
    from glm_dsa.testing import golden

    monkeypatch.setattr(golden, "golden_cases", lambda *a, **k: pytest.fail("a case was computed first"))
    out = tmp_path / "golden"
    path = out / foreign.format(contract=sorted(golden.CONTRACTS)[0])
    path.parent.mkdir(parents=True)
    path.write_text("mine")
    entry = path.relative_to(out).parts[0] + ("/" if path.parent != out else "")
    assert main(["golden", "--out", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"glm-dsa golden: error: {out} holds {entry}, which glm-dsa golden does not write; the directory is "
        "replaced whole: move those out or choose another directory\n")
    assert path.read_text() == "mine"
