"""Golden data trusted for what it holds (issue 45): every malformed manifest is one line naming
the file and the fix; ``compare --verify`` recomputes each expected output from the stored
inputs, so an output or an input replaced and rehashed fails; a compare that runs no case is a
failure.

The golden set here holds two contracts (act_quant, topk_per_row with its tilelang convention),
written as ``glm-dsa golden`` writes the whole set; editing it and recomputing the hashes is
what a wrong set looks like to the hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_dsa import oracle
from glm_dsa.cli import main
from glm_dsa.testing import golden
from glm_dsa.testing.golden import MANIFEST, CompareReport, compare, load_golden
from small_golden import write_small_set

SMALL = ("act_quant", "topk_per_row")


@pytest.fixture(scope="module")
def small_set(tmp_path_factory):
    return write_small_set(tmp_path_factory, SMALL)


@pytest.fixture
def copy(small_set, tmp_path):
    return shutil.copytree(small_set, tmp_path / "g")


def _manifest(d) -> dict:
    return json.loads((d / MANIFEST).read_text())


def _save_manifest(d, manifest: dict, sign: bool = True) -> None:
    """Write the manifest, its own sha256 recomputed (as whoever edits it can)."""
    if sign:
        manifest["manifest_sha256"] = golden._manifest_digest(manifest)
    (d / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def _rehash(d, manifest: dict, name: str) -> None:
    data = (d / name).read_bytes()
    manifest["files"][name].update(sha256=hashlib.sha256(data).hexdigest(), bytes=len(data))


def _replace_tensor(d, name: str, change) -> None:
    """``change`` one tensor of the set, the file and every hash recomputed."""
    file = f"{name.split('.')[0]}.safetensors"
    tensors = load_file(str(d / file))
    tensors[name] = change(tensors[name])
    save_file(tensors, str(d / file))
    manifest = _manifest(d)
    _rehash(d, manifest, file)
    _save_manifest(d, manifest)


# ----------------------------------------------------------------------------- malformed manifests
MALFORMED = {  # what is wrong → (how to make it, what the line says)
    "not JSON": (lambda d, m: (d / MANIFEST).write_text("{not json"),
                 "is not JSON (Expecting property name enclosed in double quotes at line 1, column 2)"),
    "not an object": (lambda d, m: (d / MANIFEST).write_text("[]"), "is not a JSON object (it holds a list)"),
    "no files": (lambda d, m: m.pop("files"), "'files' is not a non-empty {file name"),
    "files a list": (lambda d, m: m.update(files=list(m["files"])), "'files' is not a non-empty {file name"),
    "a digest of the wrong length": (lambda d, m: m["files"]["act_quant.safetensors"].update(sha256="ab12"),
                                     "files entry 'act_quant.safetensors' has no sha256 of 64 hex digits"),
    "no byte count": (lambda d, m: m["files"]["act_quant.safetensors"].pop("bytes"),
                      "files entry 'act_quant.safetensors' has no 'bytes' count"),
    "the manifest's own digest cut short": (
        lambda d, m: (d / MANIFEST).write_text(json.dumps({**m, "manifest_sha256": m["manifest_sha256"][:9]})),
        "was edited after it was written"),
    "no cases": (lambda d, m: m.pop("cases"), "'cases' is not a non-empty list of cases"),
    "a case without its call": (lambda d, m: m["cases"][0].pop("args"), "has no 'args' list"),
    "a call of the wrong type": (lambda d, m: m["cases"][0].update(args={}), "has no 'args' list"),
    "an argument of no known kind": (lambda d, m: m["cases"][0]["args"].__setitem__(0, {"tensr": "x"}),
                                     "has the argument {'tensr': 'x'}, which is none of"),
    "a case given twice": (lambda d, m: m["cases"].append(m["cases"][0]), "is given twice"),
    "a case in a file not listed": (lambda d, m: m["cases"][0].update(file="other.safetensors"),
                                    "is in 'other.safetensors', which 'files' does not list"),
    "a tensor no file holds": (lambda d, m: m["cases"][0]["args"].__setitem__(0, {"tensor": "act_quant.nope.x"}),
                               "reads the tensor 'act_quant.nope.x', which no listed file holds"),
    "an expected output missing": (lambda d, m: m["cases"][0]["outputs"].popitem(),
                                   "has no expected output"),
    "an unknown contract": (lambda d, m: m["cases"][0].update(contract="nope"),
                            "names contract 'nope', which glm-dsa does not know"),
    "a file listed but absent": (lambda d, m: os.remove(d / "topk_per_row.safetensors"),
                                 "topk_per_row.safetensors is listed in"),
    "a file changed": (lambda d, m: (d / "topk_per_row.safetensors").write_bytes(b"x" * 40),
                       "topk_per_row.safetensors differs from the manifest's sha256"),
    "an extra file": (lambda d, m: (d / "fp8_mqa_logits.safetensors").write_bytes(b"x"),
                      "holds fp8_mqa_logits.safetensors, which"),
    "a corrupt file, rehashed": (
        lambda d, m: ((d / "topk_per_row.safetensors").write_bytes(b"\0" * 64),
                      _rehash(d, m, "topk_per_row.safetensors")),
        "topk_per_row.safetensors is not a readable safetensors file though its sha256 matches"),
}


@pytest.mark.parametrize("what", MALFORMED)
def test_every_manifest_error_is_one_line_naming_the_file_and_the_fix(what, copy, tmp_path, capsys):
    make, says = MALFORMED[what]
    manifest = _manifest(copy)
    before = (copy / MANIFEST).read_text()
    make(copy, manifest)
    if (copy / MANIFEST).read_text() == before:  # the dict was edited: write it, re-signed
        _save_manifest(copy, manifest)
    candidate = tmp_path / "c.safetensors"
    save_file({"act_quant.ue8m0_scales.scale": torch.ones(1)}, str(candidate))
    assert main(["compare", "--golden", str(copy), "--candidate", str(candidate)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert says in err and str(copy) in err, err
    assert "glm-dsa golden --out" in err and "Error" not in err, err


# ----------------------------------------------------------------------------- compare --verify
def test_verify_passes_an_untouched_set_bitwise(small_set, capsys):
    assert main(["compare", "--golden", str(small_set), "--verify"]) == 0
    lines = capsys.readouterr().out.splitlines()
    outputs = sum(len(c["outputs"]) for c in _manifest(small_set)["cases"])
    assert all(line.startswith("PASS  ") and "bitwise the recomputed output" in line for line in lines[:-1])
    assert lines[-1] == (f"{outputs} checked: {outputs} passed, 0 failed; each golden output judged "
                         f"against the installed oracle run on its stored inputs")


def test_verify_fails_an_expected_output_replaced_and_rehashed(copy, tmp_path, capsys):
    name = "act_quant.ue8m0_scales.scale"
    _replace_tensor(copy, name, lambda t: t * 2)
    # The hashes are consistent again: load_golden takes it, and compare passes a kernel as wrong.
    assert compare(copy, {name: load_golden(copy)[1][name]}).passed
    assert main(["compare", "--golden", str(copy), "--verify", "--contract", "act_quant"]) == 1
    lines = capsys.readouterr().out.splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    assert len(failed) == 1 and failed[0].split()[:3] == ["FAIL", name, "bitwise:"], failed
    elements = load_golden(copy)[1][name].numel()
    assert f"{elements} of {elements} elements differ from the recomputed output" in failed[0]
    outputs = sum(len(c["outputs"]) for c in _manifest(copy)["cases"] if c["contract"] == "act_quant")
    assert lines[-1].startswith(f"{outputs} checked: {outputs - 1} passed, 1 failed; ")


def test_verify_fails_an_input_replaced_and_rehashed(copy, capsys):
    name = "topk_per_row.ties_at_kth.logits"
    _replace_tensor(copy, name, lambda t: t.flip(-1))
    report = golden.verify_golden(copy, ("topk_per_row",))
    failed = [c.name for c in report.checks if not c.passed]
    assert not report.passed and failed == ["topk_per_row.ties_at_kth.indices"], failed
    assert golden.verify_golden(copy, ("act_quant",)).passed  # the other contract's cases are untouched


def test_verify_refuses_what_does_not_apply(small_set, capsys):
    for extra, says in ((["--device", "cuda"], "--device does not go with --verify"),
                        (["--convention", "tilelang"], "--convention does not go with --verify"),
                        (["--contract", "nope"], "the golden set has no contract 'nope'")):
        assert main(["compare", "--golden", str(small_set), "--verify", *extra]) == 2
        assert says in capsys.readouterr().err


# ----------------------------------------------------------------------------- no case, no pass
def test_a_compare_that_runs_no_case_fails(copy, tmp_path, capsys):
    """A golden set holding only the tilelang cases of topk_per_row, and a kernel of the newest
    convention without its keywords: every case is left out, and that is no pass."""
    manifest = _manifest(copy)
    manifest["cases"] = [c for c in manifest["cases"] if c["contract"] == "topk_per_row" and c["convention"]]
    _save_manifest(copy, manifest)
    kernel = tmp_path / "k.py"
    kernel.write_text("from glm_dsa import oracle\n"
                      "def topk_per_row(logits, row_starts, row_ends, topk):\n"
                      "    return oracle.topk_per_row(logits, row_starts, row_ends, topk)\n")
    assert main(["compare", "--golden", str(copy), "--kernel", f"{kernel}:topk_per_row"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "0 checked: 0 passed, 0 failed; 0 golden outputs not in the candidate"
    assert lines[1] == "FAIL: no case ran, so nothing passed"
    assert lines[2].startswith("conventions checked: none; tilelang not run (the kernel takes no base, pad")
    assert not CompareReport((), ()).passed

    def newest_topk(logits, row_starts, row_ends, topk):
        return oracle.topk_per_row(logits, row_starts, row_ends, topk)

    assert not golden.compare_kernel(copy, newest_topk, contracts=("topk_per_row",)).passed
