"""A misbehaving kernel never reads as a pass (issue 45): under ``glm-dsa check`` and ``compare
--kernel`` the kernel runs in a process of its own, so one that ends, forks or crashes that
process, hangs at import or holds the GIL past ``--timeout`` is a FAIL line naming the reason,
and the command ends with its summary line.

The commands run in one driver process (a subprocess of the test, so that a kernel that takes
its harness down — as each of these did before — fails a test instead of ending pytest); each
test reads its own command's exit status, output and time from the driver's record.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from glm_dsa import oracle
from glm_dsa.testing import check_kernel, edge_case_names
from glm_dsa.testing.golden import RANDOM_CASES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each a kernel of the act_quant contract (four edge cases, cheap), misbehaving as named.
KERNELS = {
    "good": "from glm_dsa import oracle\ndef act_quant(*a, **k):\n    return oracle.act_quant(*a, **k)\n",
    "os_exit": "import os\ndef act_quant(*a, **k):\n    os._exit(0)\n",
    "sys_exit_at_import": "import sys\nsys.exit()\ndef act_quant(*a, **k):\n    pass\n",
    "forks": textwrap.dedent("""
        import os
        from glm_dsa import oracle
        def act_quant(*a, **k):
            os.fork()  # parent and child both return
            return oracle.act_quant(*a, **k)
        """),
    "thread_exits": textwrap.dedent("""
        import os, threading, time
        from glm_dsa import oracle
        calls = []
        def act_quant(*a, **k):
            calls.append(1)
            if len(calls) == 1:  # a helper thread ends the process during the next case
                threading.Timer(0.2, os._exit, (0,)).start()
                return oracle.act_quant(*a, **k)
            time.sleep(30)
        """),
    "segfault": "import ctypes\ndef act_quant(*a, **k):\n    ctypes.string_at(0)\n",
    "sigkill": "import os, signal\ndef act_quant(*a, **k):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    "abort": "import os\ndef act_quant(*a, **k):\n    os.abort()\n",
    "hangs_at_import": "import time\ntime.sleep(60)\ndef act_quant(*a, **k):\n    pass\n",
    "holds_the_gil": textwrap.dedent("""
        import ctypes
        def act_quant(*a, **k):
            ctypes.PyDLL(None).sleep(60)  # libc sleep(3) through PyDLL: the GIL stays held
        """),
    "segfaults_once": textwrap.dedent("""
        import ctypes, os
        from glm_dsa import oracle
        MARK = os.path.join(os.path.dirname(__file__), "crashed_once")
        def act_quant(*a, **k):
            if not os.path.exists(MARK):
                open(MARK, "w").close()
                ctypes.string_at(0)
            return oracle.act_quant(*a, **k)
        """),
}

COMMANDS = {  # name → the command's arguments after the kernel's name
    name: ["--contract", "act_quant", "--cases", "1"] for name in KERNELS if name != "segfaults_once"
}
COMMANDS["hangs_at_import"] += ["--timeout", "2"]
COMMANDS["holds_the_gil"] += ["--timeout", "2"]

DRIVER = """
import contextlib, io, json, sys, time
from glm_dsa.cli import main
from glm_dsa.testing import golden
from glm_dsa.testing.cases import CONTRACTS

def record(name, argv):
    out, err = io.StringIO(), io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except BaseException as e:
            status = f"raised {type(e).__name__}: {e}"
    with open(sys.argv[2], "a") as f:
        f.write(json.dumps({"name": name, "status": status, "out": out.getvalue(),
                            "err": err.getvalue(), "seconds": time.monotonic() - t0}) + "\\n")

if __name__ == "__main__":
    where, commands = sys.argv[1], json.loads(sys.argv[3])
    for name, args in commands.items():
        record(name, ["check", f"{where}/{name}.py:act_quant", *args])
    golden.CONTRACTS = {"act_quant": CONTRACTS["act_quant"]}  # a golden set of act_quant only
    golden.write_golden(f"{where}/golden")
    record("segfaults_once", ["compare", "--golden", f"{where}/golden", "--kernel",
                              f"{where}/segfaults_once.py:act_quant"])
"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    where = tmp_path_factory.mktemp("kernels")
    for name, source in KERNELS.items():
        (where / f"{name}.py").write_text(source)
    (where / "driver.py").write_text(DRIVER)
    results = where / "results.jsonl"
    try:
        subprocess.run([sys.executable, str(where / "driver.py"), str(where), str(results),
                        json.dumps(COMMANDS)], cwd=REPO, timeout=240,
                       env={**os.environ, "PYTHONPATH": REPO}, capture_output=True)
    except subprocess.TimeoutExpired:
        pass  # the records so far tell
    out: dict[str, list[dict]] = {}
    for line in results.read_text().splitlines() if results.exists() else []:
        entry = json.loads(line)
        out.setdefault(entry["name"], []).append(entry)
    return out


def _failed_with(runs, name: str, reason: str) -> dict:
    """The command ran once, exited 1, and ended with its summary line after a FAIL line
    giving ``reason``."""
    assert name in runs, f"{name}: no verdict (the harness did not survive)"
    (entry,) = runs[name]  # one report, not one per process
    lines = entry["out"].splitlines()
    assert entry["status"] == 1 and lines, entry
    assert lines[0].startswith("FAIL  act_quant.") and reason in lines[0], lines
    assert lines[-1].startswith("FAIL: act_quant [case ") and reason in lines[-1], lines
    return entry


def test_a_good_kernel_passes_in_its_own_process(runs):
    (entry,) = runs["good"]
    assert entry["status"] == 0
    assert entry["out"].splitlines()[-1].startswith("PASS: ")


@pytest.mark.parametrize("name, reason", [
    ("os_exit", "the kernel process exited with status 0 before returning its outputs"),
    ("thread_exits", "the kernel process exited with status 0 before returning its outputs"),
    ("segfault", "the kernel process was killed by SIGSEGV before returning its outputs"),
    ("sigkill", "the kernel process was killed by SIGKILL before returning its outputs"),
    ("abort", "the kernel process was killed by SIGABRT before returning its outputs"),
    ("forks", "the kernel forked its process (os.fork) during the call"),
    ("sys_exit_at_import", "the kernel's module called sys.exit(None) while it was imported"),
])
def test_a_kernel_that_ends_forks_or_crashes_its_process_fails_with_the_reason(runs, name, reason):
    _failed_with(runs, name, reason)


def test_a_helper_thread_ending_the_process_fails_the_case_it_interrupts(runs):
    entry = _failed_with(runs, "thread_exits", "exited with status 0")
    second = edge_case_names("act_quant")[1]  # the first case passed; the thread struck in the next
    assert entry["out"].splitlines()[-1].startswith(f"FAIL: act_quant [case {second}]: ")


def test_an_output_that_passed_before_the_crash_counts_only_the_cases_that_completed(runs):
    """The case the thread struck is no case any output passed: act_quant's other output reads
    PASS over the one case that completed (it read 'over 2 cases', the failed one counted)."""
    (entry,) = runs["thread_exits"]
    passed = [line for line in entry["out"].splitlines() if line.startswith("PASS  act_quant.")]
    assert len(passed) == 1 and passed[0].endswith(f"over 1 cases, at case {edge_case_names('act_quant')[0]}"), passed


def test_a_module_that_hangs_at_import_fails_at_the_timeout(runs):
    entry = _failed_with(runs, "hangs_at_import",
                         "importing the kernel's module did not finish within 2 s")
    assert entry["seconds"] < 30


def test_a_c_call_holding_the_gil_fails_at_the_timeout(runs):
    entry = _failed_with(runs, "holds_the_gil", "the kernel did not return within 2 s")
    assert entry["seconds"] < 30  # the call sleeps 60 s with the GIL held


def test_compare_runs_the_cases_after_a_crash_in_a_fresh_process(runs):
    """One case's segfault is that case's FAIL; the other golden cases still run and pass."""
    assert "segfaults_once" in runs, "no verdict (the harness did not survive)"
    (entry,) = runs["segfaults_once"]
    lines = entry["out"].splitlines()
    failed = [line for line in lines if line.startswith("FAIL")]
    passed = [line for line in lines if line.startswith("PASS")]
    cases = len(edge_case_names("act_quant")) + RANDOM_CASES
    assert entry["status"] == 1 and len(failed) == 2 and len(passed) == 2 * (cases - 1), lines
    assert all("killed by SIGSEGV before returning its outputs" in line for line in failed)
    assert lines[-2].startswith(f"{len(failed) + len(passed)} checked: {len(passed)} passed, 2 failed")


# ----------------------------------------------------------------------------- the Python API
def test_check_kernel_with_an_option_no_case_takes_fails_instead_of_passing_with_no_case():
    """``scale_fmt="bogus"``: the oracle refuses every case, so none ran, and that is no pass
    (it passed with 0 cases run)."""
    with pytest.raises(AssertionError, match=r"act_quant: no case ran; the oracle refused every case under "
                                             r"custom \(scale_fmt='bogus'\)"):
        check_kernel("act_quant", oracle.act_quant, cases=3, scale_fmt="bogus")


def test_check_kernel_isolates_a_kernel_given_by_name(tmp_path):
    (tmp_path / "k.py").write_text(KERNELS["good"] + "def dies(*a, **k):\n    import os; os._exit(3)\n")
    report = check_kernel("act_quant", f"{tmp_path}/k.py:act_quant", cases=5)
    assert report.passed and report.cases_run == 5
    with pytest.raises(AssertionError, match="the kernel process exited with status 3 before returning"):
        check_kernel("act_quant", f"{tmp_path}/k.py:dies", cases=1)
    with pytest.raises(ValueError, match="has no attribute 'nope'"):
        check_kernel("act_quant", f"{tmp_path}/k.py:nope", cases=1)


def test_a_kernel_in_its_own_process_is_judged_as_one_in_this_one(tmp_path):
    """Its signature (a convention keyword it lacks), a written input and a wrong return reach
    the harness as they do in-process."""
    (tmp_path / "k.py").write_text(textwrap.dedent("""
        from glm_dsa import oracle
        def clobbers(q, kv, weights, ks, ke, **kwargs):
            out = oracle.fp8_mqa_logits(q, kv, weights, ks, ke, **kwargs)
            kv[1].mul_(2)
            return out
        def no_sink(q, kv, indices, sm_scale, d_v=512, topk_length=None):
            return oracle.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, None, topk_length)
        def returns_a_set(*a, **k):
            return {1}
        """))
    with pytest.raises(AssertionError, match=r"the kernel changed its input 'kv\[1\]' in place"):
        check_kernel("fp8_mqa_logits", f"{tmp_path}/k.py:clobbers", cases=1)
    with pytest.raises(AssertionError, match="the kernel takes no argument 'attn_sink'"):
        check_kernel("flash_mla_sparse_fwd", f"{tmp_path}/k.py:no_sink", cases=8)
    with pytest.raises(AssertionError, match=r"the kernel returned \(set\)"):
        check_kernel("act_quant", f"{tmp_path}/k.py:returns_a_set", cases=1)
    assert check_kernel("act_quant", oracle.act_quant, cases=1).passed  # a callable: in-process


@pytest.mark.parametrize("sig, status", [(signal.SIGTERM, 143), (signal.SIGKILL, -signal.SIGKILL)])
def test_the_kernel_process_ends_with_the_command(tmp_path, sig, status):
    """However the command ends (SIGTERM unwinds it; SIGKILL cannot be caught), a kernel busy
    in a call does not outlive it."""
    (tmp_path / "busy.py").write_text(
        "import os, time\ndef act_quant(*a, **k):\n"
        f"    open({str(tmp_path / 'pid')!r}, 'w').write(str(os.getpid()))\n    time.sleep(120)\n")
    proc = subprocess.Popen([sys.executable, "-m", "glm_dsa", "check", f"{tmp_path}/busy.py:act_quant",
                             "--contract", "act_quant"], cwd=REPO, env={**os.environ, "PYTHONPATH": REPO},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    kernel = int((tmp_path / "pid").read_text())
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == status
    deadline = time.monotonic() + 30
    while _alive(kernel):
        assert time.monotonic() < deadline, f"the kernel process {kernel} outlived the command"
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"  # a zombie has ended
    except FileNotFoundError:
        return False


@pytest.mark.cuda
def test_a_kernel_in_its_own_process_runs_on_cuda(tmp_path, capsys):
    """The child binds the device's context and gets its inputs there, as the worker thread
    does (a Triton kernel launched there, and the oracle called on CUDA tensors)."""
    from glm_dsa.cli import main

    (tmp_path / "k.py").write_text("from glm_dsa import oracle\ndef act_quant(x, *a, **k):\n"
                                   "    assert x.is_cuda\n    return oracle.act_quant(x, *a, **k)\n")
    assert check_kernel("act_quant", f"{tmp_path}/k.py:act_quant", cases=5, device="cuda").passed
    assert main(["check", "glm_dsa.kernels:fp8_mqa_logits", "--contract", "fp8_mqa_logits",
                 "--device", "cuda", "--cases", "8"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: glm_dsa.kernels:fp8_mqa_logits")
