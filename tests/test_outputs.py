"""Outputs never destroy an input and are never left half-written (issue 27, "Data loss"):
outputs that are inputs, FIFOs or devices refused in one line before any compute; symlinks
written through; temporaries removed on SIGTERM, swept after SIGKILL; ``golden --out`` swapped
in whole."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import load_file, save_file

from glm_dsa.cli import main
from glm_dsa.outputs import PARTIAL_SUFFIX, replace_dir, sweep_partials, write_file

TINY = ["prefill", "--config", "tiny", "--no-progress", "--chunk", "64"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _one_error_line(capsys) -> str:
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.fixture
def ids(tmp_path):
    path = tmp_path / "ids.safetensors"
    save_file({"request.0.input_ids": torch.arange(64, dtype=torch.int32), "note": torch.ones(3)}, str(path))
    return path


def _refused(capsys, argv, text):
    t0 = time.perf_counter()
    assert main([str(a) for a in argv]) == 2
    assert time.perf_counter() - t0 < 5  # before a model is built
    err = _one_error_line(capsys)
    assert text in err, err
    return err


def test_save_outputs_refuses_its_own_input_ids_by_name_link_and_hard_link(tmp_path, ids, capsys):
    before = ids.read_bytes()
    (tmp_path / "sym.safetensors").symlink_to(ids)
    os.link(ids, tmp_path / "hard.safetensors")
    for out in (ids, tmp_path / "sym.safetensors", tmp_path / "hard.safetensors", tmp_path / ".." / tmp_path.name
                / "ids.safetensors"):
        err = _refused(capsys, [*TINY, "--input-ids", ids, "--save-outputs", out], "is the input --input-ids")
        assert "choose another path" in err
    assert ids.read_bytes() == before  # int32 ids and the other tensor intact


def test_save_outputs_refuses_a_file_of_the_checkpoint_it_loads(tmp_path, capsys):
    from glm_dsa.config import get_config
    from glm_dsa.weights import init_weights, build_model, save_checkpoint

    save_checkpoint(init_weights(build_model(get_config("tiny")), 0), tmp_path)
    before = (tmp_path / "model.safetensors").read_bytes()
    for name in ("model.safetensors", "config.json"):
        _refused(capsys, [*TINY, "--config", tmp_path, "--weights", tmp_path, "--tokens", "64",
                          "--save-outputs", tmp_path / name], f"(its file {name})")
    assert (tmp_path / "model.safetensors").read_bytes() == before


def test_outputs_refuse_fifos_devices_directories_and_each_other(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")
    _refused(capsys, [*TINY, "--tokens", "64", "--save-outputs", tmp_path / "fifo"], "is a FIFO, not a regular file")
    _refused(capsys, [*TINY, "--tokens", "64", "--save-outputs", "/dev/null"], "is a character device")
    _refused(capsys, [*TINY, "--tokens", "64", "--plot", tmp_path], "is a directory")
    _refused(capsys, [*TINY, "--tokens", "64", "--save-outputs", tmp_path / "o", "--plot", tmp_path / "o"],
             "--plot {0} is also --save-outputs {0}".format(tmp_path / "o"))
    assert os.path.exists("/dev/null") and not os.path.isfile("/dev/null")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo"]


def test_a_symlinked_output_is_written_through_to_its_target(tmp_path, capsys):
    target = tmp_path / "real" / "out.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"stale")
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert main([*TINY, "--tokens", "64", "--save-outputs", str(link)]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert load_file(str(target))["request.0.hidden"].shape == (64, 128)
    assert sorted(p.name for p in target.parent.iterdir()) == ["out.safetensors"]


_SLOW_WRITER = """
import sys, time
from glm_dsa.outputs import write_file

def write(tmp):
    with open(tmp, "wb") as f:
        f.write(b"half")
        f.flush()
        print("writing", flush=True)
        time.sleep(60)

write_file(sys.argv[1], write)
"""


def _start_slow_writer(tmp_path):
    script = tmp_path / "slow_writer.py"
    script.write_text(_SLOW_WRITER)
    out = tmp_path / "out.bin"
    out.write_bytes(b"old")
    proc = subprocess.Popen([sys.executable, str(script), str(out)], stdout=subprocess.PIPE, text=True,
                            cwd=REPO, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.stdout.readline() == "writing\n"
    partial = [p for p in tmp_path.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]
    assert len(partial) == 1 and partial[0].name.startswith(f".out.bin.{proc.pid}.")
    return proc, out, partial[0]


def test_sigterm_during_a_write_removes_the_temporary_and_keeps_the_old_file(tmp_path):
    proc, out, partial = _start_slow_writer(tmp_path)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    assert not partial.exists() and out.read_bytes() == b"old"


def test_a_temporary_left_by_sigkill_is_swept_by_the_next_write(tmp_path):
    proc, out, partial = _start_slow_writer(tmp_path)
    proc.kill()
    proc.wait(timeout=30)
    assert partial.exists() and out.read_bytes() == b"old"  # SIGKILL cannot be caught
    live = tmp_path / f".out.bin.{os.getpid()}.x{PARTIAL_SUFFIX}"  # a write still running here
    live.write_bytes(b"")
    write_file(str(out), lambda tmp: open(tmp, "wb").write(b"new"))
    assert out.read_bytes() == b"new" and not partial.exists() and live.exists()
    assert sweep_partials(str(out)) == []


def test_prefill_sigint_and_sigterm_exit_130_and_143_in_one_line(tmp_path):
    """A long prefill interrupted while it computes: one line, the signal's exit status, and no
    output file or temporary left."""
    out = tmp_path / "o.safetensors"
    script = textwrap.dedent(f"""
        import sys
        import glm_dsa.cli as cli
        from glm_dsa.prefill import PrefillEngine

        run = PrefillEngine.run

        def announced(self, *args):
            print("running", flush=True)  # the signal must land in the prefill itself
            return run(self, *args)

        PrefillEngine.run = announced
        sys.exit(cli.main(["prefill", "--config", "small", "--tokens", "60000", "--chunk", "512",
                           "--no-progress", "--save-outputs", {str(out)!r}]))
        """)
    for sig, status, word in ((signal.SIGINT, 130, "interrupted"), (signal.SIGTERM, 143, "terminated")):
        proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, cwd=REPO)
        assert proc.stdout.readline() == "running\n"
        time.sleep(0.5)
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == status, err
        assert err == f"glm-dsa prefill: {word}\n"
        assert list(tmp_path.iterdir()) == []


def test_debug_keeps_the_traceback_of_ctrl_c(monkeypatch):
    import glm_dsa.cli as cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_ledger", interrupted)
    assert cli.main(["ledger", "--config", "tiny", "--tokens", "64", "--chunk", "64"]) == 130
    with pytest.raises(KeyboardInterrupt):
        cli.main(["ledger", "--config", "tiny", "--tokens", "64", "--chunk", "64", "--debug"])


def _write_tree(names):
    def write(d):
        for name in names:
            with open(os.path.join(d, name), "w") as f:
                f.write(name)
        return len(names)
    return write


def test_replace_dir_swaps_a_directory_in_whole_and_an_interrupted_write_keeps_the_old(tmp_path):
    d = tmp_path / "g"
    assert replace_dir(str(d), _write_tree(["a", "b"])) == 2
    assert sorted(os.listdir(d)) == ["a", "b"] and oct(d.stat().st_mode & 0o777) != oct(0o700)

    def fails(tmp):
        _write_tree(["a"])(tmp)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        replace_dir(str(d), fails)
    assert sorted(os.listdir(d)) == ["a", "b"] and (d / "a").read_text() == "a"
    replace_dir(str(d), _write_tree(["a", "b", "c"]))
    assert sorted(os.listdir(d)) == ["a", "b", "c"]
    assert sorted(os.listdir(tmp_path)) == ["g"]  # no temporary and no old copy left


def test_replace_dir_refuses_a_directory_holding_files_it_would_not_write(tmp_path):
    d = tmp_path / "g"
    d.mkdir()
    (d / "my_notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match=r"holds my_notes.txt, which this command does not write"):
        replace_dir(str(d), _write_tree(["a"]))
    assert os.listdir(d) == ["my_notes.txt"] and sorted(os.listdir(tmp_path)) == ["g"]


def test_golden_over_an_existing_golden_directory_is_swapped_in(tmp_path, capsys):
    from glm_dsa.testing.golden import MANIFEST, write_golden

    g = tmp_path / "golden"
    write_golden(g, seed=1)
    old = json.loads((g / MANIFEST).read_text())
    g_link = tmp_path / "link"
    g_link.symlink_to(g)
    assert main(["golden", "--out", str(g_link)]) == 0
    capsys.readouterr()
    assert g_link.is_symlink() and json.loads((g / MANIFEST).read_text())["seed"] == 0 != old["seed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["golden", "link"]


def test_outputs_refuse_their_own_input_hidden(tmp_path, capsys):
    hidden = tmp_path / "hidden.safetensors"
    save_file({"request.0.hidden": torch.zeros(64, 128)}, str(hidden))
    before = hidden.read_bytes()
    for flag in ("--save-outputs", "--plot"):
        _refused(capsys, [*TINY, "--input-hidden", hidden, flag, hidden], f"{flag} {hidden} is the input --input-hidden")
    assert hidden.read_bytes() == before


def test_save_outputs_refuses_a_shard_reached_through_a_symlinked_directory(tmp_path, capsys):
    """A checkpoint index may name ``shards/…`` where ``shards`` links elsewhere (a hub cache):
    the shard is still an input of the run."""
    from glm_dsa.config import get_config
    from glm_dsa.weights import build_model, init_weights, save_checkpoint

    ckpt, blobs = tmp_path / "ckpt", tmp_path / "blobs"
    save_checkpoint(init_weights(build_model(get_config("tiny")), 0), ckpt, max_shard_bytes=1 << 20)
    blobs.mkdir()
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    for file in set(index["weight_map"].values()):
        os.rename(ckpt / file, blobs / file)
    (ckpt / "shards").symlink_to(blobs, target_is_directory=True)
    index["weight_map"] = {k: f"shards/{v}" for k, v in index["weight_map"].items()}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(index))
    shard = sorted(blobs.iterdir())[0]
    before = shard.read_bytes()
    _refused(capsys, [*TINY, "--config", ckpt, "--weights", ckpt, "--tokens", "64", "--save-outputs", shard],
             f"is the input --weights {ckpt} (its file shards/{shard.name})")
    assert shard.read_bytes() == before


# ------------------------------------------------------------------ check / compare --junit-xml
_KERNEL = """
import os
import k_helper
from glm_dsa import oracle
open(os.path.join(os.path.dirname(__file__), "imported"), "a").close()
def act_quant(*a, **k):
    open(os.path.join(os.path.dirname(__file__), "called"), "a").close()
    return oracle.act_quant(*a, **k)
"""


@pytest.fixture
def inputs(tmp_path, monkeypatch):
    """A kernel (and the helper module it imports), a definition, and a golden directory with a
    candidate beside it; each file's bytes, to see none was written."""
    (tmp_path / "k.py").write_text(_KERNEL)
    (tmp_path / "k_helper.py").write_text("HELP = 1\n")
    definition = tmp_path / "def.json"
    definition.write_text(open(os.path.join(REPO, "tests", "definitions",
                                            "dsa_topk_indexer_fp8_h64_d128_topk2048_ps64.json")).read())
    from glm_dsa.testing import golden
    from glm_dsa.testing.cases import CONTRACTS

    monkeypatch.setattr(golden, "CONTRACTS", {"act_quant": CONTRACTS["act_quant"]})  # a small set
    golden.write_golden(tmp_path / "golden")
    save_file({"act_quant.ue8m0_scales.scale": torch.ones(3)}, str(tmp_path / "cand.safetensors"))
    monkeypatch.chdir(tmp_path)  # the kernel's module importable by name, as python -m has it
    return {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}


def _not_written(inputs, tmp_path):
    assert {p: p.read_bytes() for p in inputs} == inputs
    assert not (tmp_path / "called").exists()  # no case ran


@pytest.mark.parametrize("argv, junit, text", [
    (["check", "k.py:act_quant", "--contract", "act_quant"], "k.py", "is the input kernel k.py"),
    (["check", "k:act_quant", "--contract", "act_quant"], "k.py", "is the input kernel {tmp}/k.py"),
    (["check", "k.py:act_quant", "--contract", "act_quant"], "k_helper.py",
     "is the input kernel module {tmp}/k_helper.py"),
    (["check", "k.py:act_quant", "--definition", "def.json"], "def.json", "is the input --definition def.json"),
    (["compare", "--golden", "golden", "--candidate", "cand.safetensors"], "cand.safetensors",
     "is the input --candidate cand.safetensors"),
    (["compare", "--golden", "golden", "--candidate", "cand.safetensors"], "golden/manifest.json",
     "is the input --golden golden (its file manifest.json)"),
    (["compare", "--golden", "golden", "--kernel", "k.py:act_quant"], "k.py", "is the input kernel k.py"),
])
def test_junit_xml_onto_an_input_is_refused_before_any_case(argv, junit, text, inputs, tmp_path, capsys):
    """The candidate, the golden set's files, the definition, the kernel's file and the modules
    its import loaded are inputs of the run: --junit-xml over any of them, by name, symlink or
    hard link, is one line and exit status 2, before a case runs."""
    (tmp_path / "sym.xml").symlink_to(tmp_path / junit)
    os.link(tmp_path / junit, tmp_path / "hard.xml")
    for out in (junit, "sym.xml", "hard.xml"):
        assert main([*argv, "--junit-xml", out]) == 2
        err = _one_error_line(capsys)
        assert f"--junit-xml {out} {text.format(tmp=tmp_path)}; writing it would destroy that input" in err, err
    _not_written(inputs, tmp_path)


def test_junit_xml_is_written_to_a_temporary_and_renamed(inputs, tmp_path, capsys):
    """Renamed over its path, the old file's other hard link keeps the old bytes (a file opened
    for writing in place would change under both names)."""
    (tmp_path / "old.xml").write_text("old")
    os.link(tmp_path / "old.xml", tmp_path / "kept.xml")
    os.mkfifo(tmp_path / "fifo")
    assert main(["check", "k.py:act_quant", "--contract", "act_quant", "--cases", "4", "--junit-xml",
                 "fifo"]) == 2
    assert "--junit-xml fifo is a FIFO, not a regular file" in _one_error_line(capsys)
    assert main(["check", "k.py:act_quant", "--contract", "act_quant", "--cases", "4", "--junit-xml",
                 "old.xml"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: k.py:act_quant matches act_quant")
    assert (tmp_path / "old.xml").read_text().startswith("<?xml")
    assert (tmp_path / "kept.xml").read_text() == "old"
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(PARTIAL_SUFFIX)]


# ------------------------------------------------------------------ golden --out, read-only
def test_golden_out_onto_a_read_only_directory_is_refused_and_the_old_set_kept(tmp_path, capsys, monkeypatch):
    """Root may write a 0555 directory (os.access says yes), so the mode bits decide: the old
    set stays whole and nothing is left beside it, for root and everyone else."""
    from glm_dsa.testing import golden

    g = tmp_path / "golden"
    g.mkdir()
    (g / "manifest.json").write_text("old set")
    (g / "act_quant.safetensors").write_bytes(b"old bytes")
    g.chmod(0o555)
    try:
        _refused(capsys, ["golden", "--out", g],
                 f"--out {g} is read-only (mode 0555) and would be replaced whole; make it writable")
        monkeypatch.setattr(golden, "_write_golden_into", lambda *a: pytest.fail("computed first"))
        with pytest.raises(ValueError, match="is read-only"):
            golden.write_golden(g)
        assert (g / "manifest.json").read_text() == "old set"
        assert (g / "act_quant.safetensors").read_bytes() == b"old bytes"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["golden"]
    finally:
        g.chmod(0o755)
