"""``prefill`` and ``fidelity`` read their common flags the same way (one parent parser, one
resolver): a checkpoint named by its config.json or its directory, layers numbered as the
config numbers them, the same step budgets."""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors import safe_open

from glm_dsa import budget
from glm_dsa.budget import MOE_BUDGET_BYTES, Budgets
from glm_dsa.cli import build_parser, main
from glm_dsa.prefill import PrefillEngine

STUB = "weights_stub/tiny"  # layers 0-2 full, 3 shared


@pytest.fixture
def unnamed_checkpoint(tmp_path):
    """The tiny stub in a directory of its own, its config.json without ``_name_or_path`` (a
    config is then named after the path it is read from)."""
    d = tmp_path / "ckpt"
    shutil.copytree(STUB, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["_name_or_path"]
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_a_checkpoint_is_named_by_its_config_json_or_its_directory(unnamed_checkpoint, capsys):
    d = unnamed_checkpoint
    for config in (d / "config.json", d):
        assert main(["prefill", "--config", str(config), "--weights", str(d), "--tokens", "64", "--chunk", "64",
                     "--no-progress", "--json"]) == 0, capsys.readouterr().err
        capsys.readouterr()
    # Another model is still refused, naming what differs.
    assert main(["prefill", "--config", "small", "--weights", str(d), "--tokens", "64", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"glm-dsa prefill: error: --config small differs from {d}/config.json in ")
    assert "hidden_size" in err and " name," not in err


def test_fidelity_numbers_layers_as_prefill_saves_them(tmp_path, capsys):
    """``--layers 2:4``: fidelity's layers are 2 and 3 (3 reusing 2's top-k), the names
    ``--save-layer-outputs`` gives the same layers."""
    common = ["--config", "tiny", "--layers", "2:4", "--tokens", "128", "--chunk", "64"]
    assert main(["fidelity", *common, "--rows", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [(lay["layer"], lay["kind"], lay["topk_from"]) for lay in report["layers"]] == [
        (2, "full", 2), (3, "shared", 2)]
    saved = tmp_path / "out.safetensors"
    assert main(["prefill", *common, "--no-progress", "--json", "--save-outputs", str(saved),
                 "--save-layer-outputs"]) == 0
    capsys.readouterr()
    with safe_open(str(saved), "pt") as f:
        named = sorted({int(k.split(".")[3]) for k in f.keys() if ".layer." in k})
    assert named == [lay["layer"] for lay in report["layers"]]


def test_fidelity_and_prefill_run_the_same_budgets_the_moe_capped(monkeypatch, capsys):
    """With a default logits budget above the MoE cap (3 GiB), both commands give the engine the
    capped MoE budget."""
    monkeypatch.setattr(budget, "CPU_BUDGET_BYTES", MOE_BUDGET_BYTES + (1 << 30))
    seen: list[Budgets] = []
    init = PrefillEngine.__init__

    def recording(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(self.budgets)

    monkeypatch.setattr(PrefillEngine, "__init__", recording)
    common = ["--config", "tiny", "--layers", "1", "--tokens", "64", "--chunk", "64", "--json"]
    assert main(["prefill", *common, "--no-progress"]) == 0
    assert main(["fidelity", *common, "--rows", "2"]) == 0
    capsys.readouterr()
    big = MOE_BUDGET_BYTES + (1 << 30)
    assert seen == [Budgets(big, big, MOE_BUDGET_BYTES)] * 2


def test_the_common_flags_are_defined_once_for_both_commands():
    sub = build_parser()._subparsers._group_actions[0].choices  # type: ignore[union-attr]
    flags = {name: {s for a in sub[name]._actions for s in a.option_strings} for name in ("prefill", "fidelity")}
    shared = flags["prefill"] & flags["fidelity"]
    assert {"--config", "--weights", "--layers", "--backend", "--budget-bytes", "--device", "--dtype"} <= shared
    helps = {name: {a.dest: a.help for a in sub[name]._actions} for name in ("prefill", "fidelity")}
    assert all(helps["prefill"][d] == helps["fidelity"][d] for d in ("config", "weights", "backend", "budget_bytes"))
