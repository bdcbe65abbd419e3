"""glm_dsa.outputs' refusals called directly, each input refusal tried by name, through a
symlink (either way round) and through a hard link, and each accepted neighbour one step away
(a sibling file, an absent path, a writable directory)."""

from __future__ import annotations

import os
import stat

import pytest

from glm_dsa import outputs
from glm_dsa.outputs import (
    PARTIAL_SUFFIX,
    check_output_dir,
    check_output_file,
    check_output_paths,
    replace_dir,
    sweep_partials,
    write_file,
)


@pytest.fixture
def tree(tmp_path):
    """An input file, an input directory holding a file and a symlinked subdirectory."""
    (tmp_path / "input.bin").write_bytes(b"in")
    ckpt = tmp_path / "ckpt"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model.safetensors").write_bytes(b"w")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "shard.bin").write_bytes(b"s")
    os.symlink(elsewhere, ckpt / "linked")
    (tmp_path / "out").mkdir()
    return tmp_path


def _refused(match, flag, path, inputs=None):
    with pytest.raises(ValueError, match=match):
        check_output_file(flag, str(path), inputs)


@pytest.mark.parametrize("via", ["name", "symlink_to_input", "input_is_symlink", "hard_link"])
def test_an_output_onto_an_input_file_is_refused_whichever_way_it_is_reached(tree, via):
    inp = tree / "input.bin"
    out = tree / "out" / "o.bin"
    given = str(inp)
    if via == "name":
        out = inp
    elif via == "symlink_to_input":
        os.symlink(inp, out)
    elif via == "input_is_symlink":
        out.write_bytes(b"old")
        given = str(tree / "alias.bin")
        os.symlink(out, given)
    else:
        os.link(inp, out)
    _refused("is the input --ids", "--out", out, {"--ids": given})
    # One step away: a sibling file of the input is fine.
    (tree / "out" / "sibling.bin").write_bytes(b"x")
    check_output_file("--out", str(tree / "out" / "sibling.bin"), {"--ids": given})


@pytest.mark.parametrize("via", ["file_in_dir", "hard_link_to_file_in_dir", "symlink_to_file_in_dir",
                                 "through_symlinked_subdir", "hard_link_into_symlinked_subdir"])
def test_an_output_onto_a_file_under_an_input_directory_is_refused(tree, via):
    ckpt = tree / "ckpt"
    out = tree / "out" / "o.bin"
    if via == "file_in_dir":
        out = ckpt / "model.safetensors"
    elif via == "hard_link_to_file_in_dir":
        os.link(ckpt / "model.safetensors", out)
    elif via == "symlink_to_file_in_dir":
        os.symlink(ckpt / "model.safetensors", out)
    elif via == "through_symlinked_subdir":
        out = tree / "elsewhere" / "shard.bin"
    else:
        os.link(tree / "elsewhere" / "shard.bin", out)
    _refused("is the input --checkpoint .*its file", "--out", out, {"--checkpoint": str(ckpt)})
    # A new name inside the input directory is not an input file.
    check_output_file("--out", str(ckpt / "new.bin"), {"--checkpoint": str(ckpt)})


def test_inputs_given_as_lists_none_or_missing(tree):
    inp = tree / "input.bin"
    _refused("is the input --ids", "--out", inp, {"--x": None, "--ids": [str(tree / "nope"), str(inp)]})
    check_output_file("--out", str(inp), {"--x": None, "--ids": [str(tree / "nope")]})
    check_output_file("--out", str(inp))


def test_a_directory_input_with_a_link_back_up_the_tree_is_walked_once(tree):
    os.symlink(tree / "ckpt", tree / "ckpt" / "sub" / "loop")
    found = outputs._input_files({"--c": str(tree / "ckpt")})
    assert sorted(v.split("its file ")[1] for v in found.values()) == ["linked/shard.bin)", "model.safetensors)"]


@pytest.mark.parametrize("kind, match", [
    ("directory", "is a directory; give a file name"),
    ("symlink_to_directory", "is a directory; give a file name"),
    ("fifo", "is a FIFO, not a regular file"),
    ("symlink_to_fifo", "is a FIFO, not a regular file"),
    ("chardev", "is a character device, not a regular file"),
    ("missing_parent", "does not exist; create it first"),
    ("symlink_into_missing_parent", "does not exist; create it first"),
])
def test_outputs_that_cannot_be_a_regular_file(tmp_path, kind, match):
    path = tmp_path / "o"
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink_to_directory":
        (tmp_path / "d").mkdir()
        os.symlink(tmp_path / "d", path)
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "symlink_to_fifo":
        os.mkfifo(tmp_path / "f")
        os.symlink(tmp_path / "f", path)
    elif kind == "chardev":
        path = "/dev/null"
    elif kind == "missing_parent":
        path = tmp_path / "no" / "o"
    else:
        os.symlink(tmp_path / "no" / "o", path)
    _refused(match, "--out", path)


def test_regular_and_absent_outputs_are_accepted(tmp_path):
    check_output_file("--out", str(tmp_path / "absent"))
    (tmp_path / "there").write_text("x")
    check_output_file("--out", str(tmp_path / "there"))
    os.symlink(tmp_path / "there", tmp_path / "link")
    check_output_file("--out", str(tmp_path / "link"))
    os.symlink(tmp_path / "absent2", tmp_path / "dangling")  # written through to its target
    check_output_file("--out", str(tmp_path / "dangling"))


@pytest.mark.parametrize("via", ["name", "symlink", "hard_link"])
def test_two_outputs_onto_one_file_are_refused(tmp_path, via):
    a = tmp_path / "a.bin"
    a.write_bytes(b"1")
    b = a
    if via == "symlink":
        b = tmp_path / "b.bin"
        os.symlink(a, b)
    elif via == "hard_link":
        b = tmp_path / "b.bin"
        os.link(a, b)
    with pytest.raises(ValueError, match="--second .* is also --first"):
        check_output_paths({"--first": str(a), "--second": str(b)})
    # Distinct files, and outputs not given, are fine.
    check_output_paths({"--first": str(a), "--second": str(tmp_path / "c.bin"), "--none": None, "--empty": ""})


def test_two_outputs_onto_one_absent_path_are_refused(tmp_path):
    with pytest.raises(ValueError, match="is also"):
        check_output_paths({"--a": str(tmp_path / "x"), "--b": str(tmp_path / "." / "x")})


@pytest.mark.parametrize("kind, ok", [
    ("absent", True), ("writable", True), ("symlink_to_writable", True), ("file", False),
    ("symlink_to_file", False), ("missing_parent", False), ("read_only", False),
    ("symlink_to_read_only", False), ("user_writable_only", True),
])
def test_output_dir_edges(tmp_path, kind, ok):
    path = tmp_path / "d"
    mode = None
    if kind == "writable":
        path.mkdir()
    elif kind == "symlink_to_writable":
        (tmp_path / "real").mkdir()
        os.symlink(tmp_path / "real", path)
    elif kind == "file":
        path.write_text("x")
    elif kind == "symlink_to_file":
        (tmp_path / "f").write_text("x")
        os.symlink(tmp_path / "f", path)
    elif kind == "missing_parent":
        path = tmp_path / "no" / "d"
    elif kind in ("read_only", "symlink_to_read_only"):
        real = tmp_path / "ro"
        real.mkdir()
        mode = real
        if kind == "symlink_to_read_only":
            os.symlink(real, path)
        else:
            path = real
    elif kind == "user_writable_only":
        path.mkdir()
        mode = path
    if mode is not None:
        os.chmod(mode, 0o200 | 0o500 if kind == "user_writable_only" else 0o555)
    try:
        if ok:
            check_output_dir("--golden-out", str(path))
        else:
            with pytest.raises(ValueError, match="--golden-out"):
                check_output_dir("--golden-out", str(path))
    finally:
        if mode is not None:
            os.chmod(mode, 0o755)


def test_a_read_only_directory_message_names_its_mode(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    os.chmod(d, 0o555)
    try:
        with pytest.raises(ValueError, match=r"read-only \(mode 0555\)"):
            check_output_dir("--x", str(d))
    finally:
        os.chmod(d, 0o755)


# ----------------------------------------------------------------------------- partials
def test_sweep_removes_only_dead_writers_partials_of_this_path(tmp_path):
    target = tmp_path / "out.json"
    dead = 2**22 + 12345  # above the default pid_max: no such process
    names = {
        f".out.json.{dead}.abc{PARTIAL_SUFFIX}": "dead file",
        f".out.json.{dead}.dir{PARTIAL_SUFFIX}": "dead dir",
        f".out.json.{os.getpid()}.live{PARTIAL_SUFFIX}": "live",
        f".out.json.{dead}.abc.other": "wrong suffix",
        f".out.json.x12.abc{PARTIAL_SUFFIX}": "not a pid",
        f".other.json.{dead}.abc{PARTIAL_SUFFIX}": "another path",
        f".out.json.{dead}.lnk{PARTIAL_SUFFIX}": "dead symlink",
    }
    for name, what in names.items():
        if what == "dead dir":
            (tmp_path / name).mkdir()
            (tmp_path / name / "inside").write_text("x")
        elif what == "dead symlink":
            (tmp_path / "kept_dir").mkdir()
            (tmp_path / "kept_dir" / "keep").write_text("x")
            os.symlink(tmp_path / "kept_dir", tmp_path / name)
        else:
            (tmp_path / name).write_text("x")
    removed = sweep_partials(str(target))
    gone = {os.path.basename(p) for p in removed}
    assert gone == {n for n, w in names.items() if w in ("dead file", "dead dir", "dead symlink")}
    left = set(os.listdir(tmp_path))
    assert not gone & left
    assert (tmp_path / "kept_dir" / "keep").exists()  # a symlink's target is never removed
    assert sweep_partials(str(tmp_path / "nodir" / "x")) == []


def test_write_file_goes_through_a_symlink_with_open_s_mode(tmp_path):
    real = tmp_path / "real.txt"
    real.write_text("old")
    os.chmod(real, 0o600)
    link = tmp_path / "link.txt"
    os.symlink(real, link)
    write_file(str(link), lambda tmp: open(tmp, "w").write("new"))
    assert os.path.islink(link) and real.read_text() == "new"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(real).st_mode) == 0o666 & ~umask
    assert [n for n in os.listdir(tmp_path) if n.endswith(PARTIAL_SUFFIX)] == []


def test_write_file_failure_keeps_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "t.txt"
    target.write_text("old")

    def fail(tmp):
        open(tmp, "w").write("half")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        write_file(str(target), fail)
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["t.txt"]


def test_write_file_refuses_a_directory_target(tmp_path):
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match="is a directory, not a regular file"):
        write_file(str(tmp_path / "d"), lambda tmp: None)


def test_replace_dir_through_a_symlink_replaces_its_target(tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (real / "a").write_text("old")
    os.symlink(real, tmp_path / "link")

    def write(tmp):
        open(os.path.join(tmp, "a"), "w").write("new")
        return 7

    assert replace_dir(str(tmp_path / "link"), write) == 7
    assert os.path.islink(tmp_path / "link") and (real / "a").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_replace_dir_names_at_most_five_strangers(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    for i in range(6):
        (d / f"s{i}").write_text("x")
    with pytest.raises(ValueError, match=r"holds s0, s1, s2, s3, s4 …, which"):
        replace_dir(str(d), lambda tmp: None)
    (d / "s5").unlink()
    with pytest.raises(ValueError, match=r"holds s0, s1, s2, s3, s4, which"):
        replace_dir(str(d), lambda tmp: None)
    assert sorted(os.listdir(d)) == [f"s{i}" for i in range(5)]
