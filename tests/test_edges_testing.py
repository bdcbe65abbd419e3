"""glm_dsa.testing's input refusals at their edges: a golden set read by name, through a
symlinked directory, with its files as symlinks and hard links (accepted: they are the files),
a dangling link (absent), a files entry one step outside a file name; and the metric table's
unknown names."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from glm_dsa.testing import golden, metrics
from glm_dsa.testing.golden import MANIFEST, load_golden
from small_golden import write_small_set

SMALL = ("act_quant",)


@pytest.fixture(scope="module")
def one_set(tmp_path_factory):
    return write_small_set(tmp_path_factory, SMALL)


@pytest.fixture
def copy(one_set, tmp_path):
    return shutil.copytree(one_set, tmp_path / "g")


def _data(d):
    return [n for n in os.listdir(d) if n.endswith(".safetensors")][0]


@pytest.mark.parametrize("via", ["name", "symlinked_dir", "symlinked_manifest", "symlinked_file",
                                 "hard_linked_file", "hard_linked_manifest"])
def test_a_golden_set_reached_through_links_is_read(copy, tmp_path, via):
    store = tmp_path / "store"
    store.mkdir()
    given = copy
    name = _data(copy)
    if via == "symlinked_dir":
        given = tmp_path / "link"
        os.symlink(copy, given)
    elif via in ("symlinked_manifest", "hard_linked_manifest", "symlinked_file", "hard_linked_file"):
        moved = MANIFEST if "manifest" in via else name
        shutil.move(copy / moved, store / moved)
        (os.symlink if via.startswith("symlinked") else os.link)(store / moved, copy / moved)
    manifest, tensors = load_golden(given)
    assert manifest["files"] and tensors


def test_a_dangling_data_link_is_absent(copy, tmp_path):
    name = _data(copy)
    os.remove(copy / name)
    os.symlink(tmp_path / "gone.safetensors", copy / name)
    with pytest.raises(ValueError, match=f"{name} is listed in .* but absent"):
        load_golden(copy)


def test_a_dangling_manifest_link_is_not_found(copy, tmp_path):
    os.remove(copy / MANIFEST)
    os.symlink(tmp_path / "gone.json", copy / MANIFEST)
    with pytest.raises(ValueError, match="manifest.json not found; write golden vectors with"):
        load_golden(copy)


@pytest.mark.parametrize("entry", ["", ".", "..", "sub/act_quant.safetensors", "../act_quant.safetensors",
                                   "/abs.safetensors"])
def test_a_files_entry_must_be_a_plain_name(copy, entry):
    m = json.loads((copy / MANIFEST).read_text())
    name = _data(copy)
    m["files"][entry] = m["files"].pop(name)
    for case in m["cases"]:
        case["file"] = entry
    m["manifest_sha256"] = golden._manifest_digest(m)
    (copy / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ValueError, match=f"its files entry {entry!r} is not a file name"):
        load_golden(copy)


def test_a_files_entry_one_step_inside_is_a_name(copy):
    m = json.loads((copy / MANIFEST).read_text())
    name = _data(copy)
    renamed = "..act_quant.safetensors"  # starts with dots, still a name in the directory
    os.rename(copy / name, copy / renamed)
    m["files"][renamed] = m["files"].pop(name)
    for case in m["cases"]:
        case["file"] = renamed
    m["manifest_sha256"] = golden._manifest_digest(m)
    (copy / MANIFEST).write_text(json.dumps(m))
    manifest, _ = load_golden(copy)
    assert renamed in manifest["files"]


@pytest.mark.parametrize("bytes_, ok", [(0, True), (True, False), (1.0, False), ("1", False)])
def test_a_files_entry_byte_count(copy, bytes_, ok):
    m = json.loads((copy / MANIFEST).read_text())
    m["files"][_data(copy)]["bytes"] = bytes_
    m["manifest_sha256"] = golden._manifest_digest(m)
    (copy / MANIFEST).write_text(json.dumps(m))
    if ok:
        load_golden(copy)
    else:
        with pytest.raises(ValueError, match="has no 'bytes' count"):
            load_golden(copy)


@pytest.mark.parametrize("digest, ok", [("a" * 64, True), ("a" * 63, False), ("a" * 65, False),
                                        ("A" * 64, False), ("g" * 64, False)])
def test_sha256_shape(digest, ok):
    assert golden._is_sha256(digest) is ok


def test_unknown_metric_is_named_and_shapes_one_step_apart_fail():
    import torch

    with pytest.raises(ValueError, match="unknown metric 'nope'; one of bitwise"):
        metrics.check_tensor({"metric": "nope"}, torch.zeros(2), torch.zeros(2), lambda n: None)
    same = metrics.check_tensor({"metric": "bitwise"}, torch.zeros(2), torch.zeros(2), lambda n: None)
    short = metrics.check_tensor({"metric": "bitwise"}, torch.zeros(2), torch.zeros(3), lambda n: None)
    assert same.passed and not short.passed
