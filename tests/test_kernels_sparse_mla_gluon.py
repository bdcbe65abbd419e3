"""The Gluon sm_90 sparse MLA kernel (``glm_dsa.kernels.sparse_mla_gluon``) and its dispatch.

Gluon kernels do not run in Triton's CPU interpreter: on the CPU only the ahead-of-time sm_90
compile is checked (when the installed Triton is one the kernel was tested with; no ptxas
spills where ptxas is installed); the ``cuda`` tests run it on an sm_90 GPU through the harness
(every contract edge case at GLM-5.3's shapes), and a stress test over random shapes against
the float64 oracle, judged by FlashMLA's error on the same inputs where the peers import; both
over each bf16 schedule (``CONFIG["schedule"]``: "split", "seesaw"). Each ``gather_hint``: its PTX
(offline: the row copies hinted, Q's not, ptxas takes it) and its results on the GPU (bitwise the
unhinted kernel's). The Triton kernel keeps its
own tests (tests/test_kernels_sparse_mla.py, CPU and GPU); here it is also run on the GPU beside
Gluon.
"""

import json
import logging
import math
import os
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from glm_dsa import oracle, peers, testing  # noqa: E402
from glm_dsa.kernels import ptx_hints, sparse_mla, sparse_mla_gluon  # noqa: E402
from glm_dsa.kernels.sparse_mla import (  # noqa: E402
    GLUON_TESTED_TRITON,
    flash_mla_sparse_fwd,
    sparse_mla_fwd_fp8,
)
from glm_dsa.testing.cases import invalid_indices  # noqa: E402
from glm_dsa.testing.metrics import SPARSE_OUT_TOL, SPARSE_STAT_TOL  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TESTED = triton.__version__ in GLUON_TESTED_TRITON
needs_gluon = pytest.mark.skipif(not (SM90 and TESTED),
                                 reason="needs an sm_90 GPU and a Triton in GLUON_TESTED_TRITON")


def _gluon_only(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """``flash_mla_sparse_fwd`` that fails unless the call dispatches to the Gluon kernel."""
    why = sparse_mla._gluon_unsuitable(q, kv, kv.stride(0), indices, d_v, False)
    assert why is None, f"dispatch would take the Triton kernel: {why}"
    return flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


def _triton_only(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """The Triton kernel on the same checked inputs, whatever the dispatch would pick."""
    from glm_dsa.validate import check_sparse_inputs

    check_sparse_inputs(q, kv, indices, d_v, attn_sink, topk_length)
    return sparse_mla._launch_triton(q, kv, kv.stride(0), kv.shape[0], indices, sm_scale, d_v,
                                     attn_sink, topk_length, False)


_AOT = """
import json, re, shutil, subprocess, sys, tempfile
from glm_dsa.kernels.ptx_hints import hinted_copies
from glm_dsa.kernels.ptx_hints import undefined_uniform_reads
from glm_dsa.kernels.sparse_mla_gluon import _sass, compile_sm90
c = compile_sm90(has_sink=sys.argv[1] == "1", has_len=sys.argv[2] == "1", fp8=sys.argv[3] == "1",
                 schedule=sys.argv[4], gather_hint=sys.argv[5], fp8_form=sys.argv[6])
ptx = c.asm["ptx"]
spills = None
if shutil.which("ptxas"):
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        err = subprocess.run(["ptxas", "-arch=sm_90a", "-v", f.name, "-o", "/dev/null"],
                             capture_output=True, text=True, check=True).stderr
    spills = sum(int(n) for n in re.findall(r"(\\d+) bytes spill", err))
sass = _sass(c.asm.get("cubin"))
print(json.dumps({"shared": c.metadata.shared, "wgmma": ptx.count("wgmma.mma_async"),
                  "noinc": ptx.count("cp.async.mbarrier.arrive.noinc"),
                  "setmaxnreg": ptx.count("setmaxnreg"), "spills": spills,
                  "copies": hinted_copies(ptx), "marker": ptx.count("glm_dsa.gather_hint"),
                  "bad_ldgsts": None if sass is None else len(undefined_uniform_reads(sass))}))
"""


def _aot(has_sink, has_len, fp8, schedule, gather_hint="none"):
    """The offline compile's facts (``_AOT``) in a fresh interpreter without TRITON_INTERPRET
    (conftest sets it on the CPU), no GPU needed. ``fp8``: False (bf16 rows) or the FP8 form,
    "ring" or "in_place"."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [*(str(int(bool(x))) for x in (has_sink, has_len, fp8)), schedule, gather_hint,
            fp8 or "ring"]
    done = subprocess.run([sys.executable, "-c", _AOT, *args],
                          env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not TESTED, reason=f"AOT check needs triton in {GLUON_TESTED_TRITON}")
@pytest.mark.parametrize("has_sink,has_len,fp8,schedule", [
    (False, False, False, "split"), (True, True, False, "split"), (True, True, "ring", "split"),
    (False, False, "in_place", "split"), (True, True, "in_place", "split"),
    (False, False, False, "seesaw"), (True, True, False, "seesaw")])
def test_gluon_kernel_compiles_for_sm90_within_shared_memory(has_sink, has_len, fp8, schedule):
    info = _aot(has_sink, has_len, fp8, schedule)
    assert info["shared"] <= 232_448  # sm_90's per-block opt-in maximum (227 KB)
    assert info["wgmma"] > 0 and info["noinc"] > 0  # tensor cores; cp.async completing mbarriers
    assert info["setmaxnreg"] > 0  # the partitions' register budgets took effect
    assert info["spills"] in (None, 0)  # ptxas -v (where ptxas is installed): no local memory
    assert info["marker"] == 0 and list(info["copies"]) == [""]  # gather_hint "none": no hint


# Per thread: Q [64, 576] bf16 is 36 16-byte copies; a bf16 tile the same 36; an FP8 tile's
# e4m3 bytes 16 and RoPE 4, issued twice (first tile, loop), and its 4 scale copies (4 bytes).
@pytest.mark.skipif(not TESTED, reason=f"AOT check needs triton in {GLUON_TESTED_TRITON}")
@pytest.mark.parametrize("hint", ["evict_last_256b", "evict_last", "256b"])
@pytest.mark.parametrize("fp8,schedule,gather", [(False, "split", 36), (False, "seesaw", 36),
                                                 ("ring", "split", 44), ("in_place", "split", 44)],
                         ids=["split", "seesaw", "fp8", "fp8-in-place"])
def test_gather_hint_reaches_the_row_copies_and_not_qs(fp8, schedule, gather, hint):
    info = _aot(True, True, fp8, schedule, hint)
    qualifiers = ptx_hints.HINTS[hint][0]
    assert info["copies"] == {"": 36, qualifiers: gather}  # Q's 36 keep no hint
    assert info["marker"] == 1
    assert info["spills"] in (None, 0)  # ptxas took the hinted form (check=True), no spills
    # Every LDGSTS reads only uniform registers something writes (ptxas's miscompile of the
    # seesaw's and the FP8 form's hinted copies read UR0 / desc[UR1] and trapped on the H200).
    assert info["bad_ldgsts"] in (None, 0)


def test_by_heads_runs_the_split_at_64_heads_and_the_seesaw_from_128():
    cfg = {**sparse_mla_gluon.CONFIG, "schedule": "by_heads"}
    assert sparse_mla_gluon._kernel(cfg, False, 64)[0] is sparse_mla_gluon._sparse_mla_fwd_gluon_kernel
    for h_q in (128, 192):
        assert (sparse_mla_gluon._kernel(cfg, False, h_q)[0]
                is sparse_mla_gluon._sparse_mla_fwd_seesaw_gluon_kernel)
    # FP8 rows have no seesaw form: the split at every head count, in the form CONFIG names.
    assert (sparse_mla_gluon._kernel({**cfg, "fp8_form": "ring"}, True, 128)[0]
            is sparse_mla_gluon._sparse_mla_fwd_fp8_gluon_kernel)
    assert (sparse_mla_gluon._kernel({**cfg, "fp8_form": "in_place"}, True, 128)[0]
            is sparse_mla_gluon._sparse_mla_fwd_fp8_in_place_gluon_kernel)
    assert sparse_mla_gluon.CONFIG["fp8_form"] == "in_place"  # timed faster, runs N and O


def test_gluon_config_errors_name_the_bad_entry_before_any_launch():
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 1, 64, dtype=torch.int32)
    with pytest.raises(ValueError, match="schedule must be 'split', 'seesaw' or 'by_heads', got 'pingpong'"):
        sparse_mla_gluon.flash_mla_sparse_fwd_gluon(q, kv, 576, 4, idx, 0.1, None, None,
                                                    config={"schedule": "pingpong"})
    with pytest.raises(ValueError, match="the seesaw schedule has 2 stages"):
        sparse_mla_gluon.flash_mla_sparse_fwd_gluon(q, kv, 576, 4, idx, 0.1, None, None,
                                                    config={"schedule": "seesaw", "stages": 3})
    with pytest.raises(ValueError, match="gather_hint must be 'none' or one of"):
        sparse_mla_gluon.flash_mla_sparse_fwd_gluon(q, kv, 576, 4, idx, 0.1, None, None,
                                                    config={"gather_hint": "evict_first"})
    rows = torch.zeros(4, 656, dtype=torch.uint8)
    with pytest.raises(ValueError, match="fp8_form must be 'ring' or 'in_place', got 'inline'"):
        sparse_mla_gluon.flash_mla_sparse_fwd_gluon(q, rows, 656, 4, idx, 0.1, None, None,
                                                    config={"fp8_form": "inline"}, fp8=True)
    with pytest.raises(ValueError, match="the in-place FP8 form has 2 stages"):
        sparse_mla_gluon.flash_mla_sparse_fwd_gluon(q, rows, 656, 4, idx, 0.1, None, None,
                                                    config={"fp8_form": "in_place", "stages": 3},
                                                    fp8=True)


@pytest.mark.parametrize("fp8,h_q", [(False, 64), (False, 128), (True, 64)])
def test_each_gather_hint_compiles_as_its_own_kernel(fp8, h_q):
    """The hint is a constexpr of every form (the marker asm, "" for none), so Triton keys a
    hinted and an unhinted compile apart, and a kernel never runs the other's binary."""
    policies = {h: sparse_mla_gluon._kernel({**sparse_mla_gluon.CONFIG, "gather_hint": h}, fp8,
                                            h_q)[1]["GATHER_POLICY"]
                for h in ("none", *ptx_hints.HINTS)}
    assert policies["none"] == "" and len(set(policies.values())) == len(policies)
    assert all(policies[h] == ptx_hints.policy_asm(h) for h in policies)


def test_a_hinted_launch_refuses_a_binary_without_the_hint(monkeypatch):
    """A hinted form whose cached binary lacks the hint (compiled while another hook replaced
    the pass) raises at its first launch instead of running as if it were hinted."""
    from types import SimpleNamespace

    monkeypatch.setattr(sparse_mla_gluon, "_HINT_CHECKED", set())
    copy = "\tcp.async.cg.shared.global{} [ %r117 + 0 ], [ %rd106 + 0 ], 0x10, %r118{};\n"
    plain = SimpleNamespace(hash="a", name="k", asm={"ptx": copy.format("", "")})
    with pytest.raises(ptx_hints.HintError, match="has no hinted cp.async"):
        sparse_mla_gluon._check_hinted(plain, "evict_last_256b")
    hinted = SimpleNamespace(hash="b", name="k", asm={"ptx": copy.format(
        ".L2::cache_hint.L2::256B", ", %rd74")})
    sparse_mla_gluon._check_hinted(hinted, "evict_last_256b")
    with pytest.raises(ptx_hints.HintError):  # the 256B prefetch alone is another form
        sparse_mla_gluon._check_hinted(SimpleNamespace(hash="c", name="k", asm=hinted.asm), "256b")
    sparse_mla_gluon._check_hinted(SimpleNamespace(hash="d", name="k", asm={}), "256b")  # no PTX
    assert sparse_mla_gluon._HINT_CHECKED == {"b"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU interpreter's dispatch")
def test_dispatch_on_the_cpu_runs_the_triton_kernel_and_says_so(caplog):
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 1, 576, dtype=torch.bfloat16)
    idx = torch.tensor([[[0, 3, -1, 9] * 4]], dtype=torch.int32)
    sparse_mla._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="glm_dsa.kernels"):
        out, _, lse = flash_mla_sparse_fwd(q, kv, idx, 0.1)
    assert [r.getMessage() for r in caplog.records if r.name == "glm_dsa.kernels"] == [
        "sparse MLA: Triton kernel (the CPU interpreter)"]
    # All scores 0 over 8 valid entries (rows 0 and 3, four times each): lse = ln 8.
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.allclose(lse, torch.full_like(lse, math.log(8)))


@pytest.mark.cuda
@needs_gluon
def test_dispatch_picks_gluon_for_glm_shapes_and_triton_otherwise(caplog):
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16, device="cuda")
    kv = torch.zeros(100, 1, 576, dtype=torch.bfloat16, device="cuda")
    idx = torch.zeros(2, 1, 64, dtype=torch.int32, device="cuda")
    assert sparse_mla._gluon_unsuitable(q, kv, kv.stride(0), idx, 512, False) is None
    assert "h_q 16" in sparse_mla._gluon_unsuitable(q[:, :16], kv, 576, idx, 512, False)
    rows = torch.zeros(100, 656, dtype=torch.uint8, device="cuda")  # FP8 rows: 656 bytes
    assert sparse_mla._gluon_unsuitable(q, rows, 656, idx, 512, True) is None
    assert "float32" in sparse_mla._gluon_unsuitable(q.float(), kv.float(), 576, idx, 512, False)
    sparse_mla._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="glm_dsa.kernels"):
        flash_mla_sparse_fwd(q, kv, idx, 0.1)
        flash_mla_sparse_fwd(q, kv, idx, 0.1)
    lines = [r.getMessage() for r in caplog.records if r.name == "glm_dsa.kernels"]
    assert lines == [f"sparse MLA: Gluon sm_90 kernel, bf16 rows (triton {triton.__version__})"]


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("schedule,early", [("split", True), ("seesaw", True), ("seesaw", False)],
                         ids=["split", "seesaw", "seesaw-scores-after"])
def test_gluon_passes_the_harness_at_glm_shapes(schedule, early, monkeypatch):
    monkeypatch.setitem(sparse_mla_gluon.CONFIG, "schedule", schedule)
    monkeypatch.setitem(sparse_mla_gluon.CONFIG, "seesaw_early_scores", early)
    cases = len(testing.edge_case_names("flash_mla_sparse_fwd")) + 24
    report = testing.check_kernel("flash_mla_sparse_fwd", _gluon_only, cases=cases,
                                  device="cuda", shapes="glm-5.3")
    assert report.cases_run == cases


@pytest.mark.cuda
def test_triton_kernel_on_gpu_passes_the_harness_at_glm_shapes():
    testing.check_kernel("flash_mla_sparse_fwd", _triton_only, cases=12, device="cuda",
                         shapes="glm-5.3")


def _stress_case(g, case):
    """Random sizes in the issue's ranges: s_q 1..5,000, s_kv 1..300,000, a fraction 0..1 of
    invalid indices, topk_length 0..topk; h_q 64 or 128; topk a multiple of 64 up to 2048."""
    dev = g.device
    r = lambda lo, hi: int(torch.randint(lo, hi + 1, (1,), generator=g, device=dev))  # noqa: E731
    s_q, s_kv, h = r(1, 5000), r(1, 300_000), (64, 128)[case % 2]
    topk = 64 * r(1, 32)
    q = (torch.randn(s_q, h, 576, generator=g, device=dev) / 10).to(torch.bfloat16)
    kv = (torch.randn(s_kv, 1, 576, generator=g, device=dev) / 10).to(torch.bfloat16)
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, device=dev, dtype=torch.int32)
    junk = torch.tensor(invalid_indices(s_kv), dtype=torch.int32, device=dev)
    bad = torch.rand(s_q, 1, topk, generator=g, device=dev) < r(0, 100) / 100
    idx = torch.where(bad, junk[torch.randint(0, len(junk), idx.shape, generator=g, device=dev)],
                      idx)
    kwargs = {}
    if case % 3 == 0:
        kwargs["topk_length"] = torch.randint(0, topk + 1, (s_q,), generator=g, device=dev,
                                              dtype=torch.int32)
    if case % 4 == 1:
        kwargs["attn_sink"] = torch.randn(h, generator=g, device=dev)
    return q, kv, idx, kwargs


def _errors(got, want, rows):
    """Max |error| of out, max_logits and lse over ``rows`` (infinities must match)."""
    errs = []
    for a, w in zip(got, want):
        a, w = a[rows].double(), w.double()
        same_inf = torch.isinf(a) == torch.isinf(w)
        assert bool(same_inf.all()) and bool((a[torch.isinf(a)] == w[torch.isinf(w)]).all())
        fin = torch.isfinite(w)
        errs.append(float((a[fin] - w[fin]).abs().max()) if bool(fin.any()) else 0.0)
    return errs


def _fp8_rows(kv):
    """The FP8 pool rows ``[s_kv, 656]`` of bf16 ``kv [s_kv, 1, 576]`` (pages of 64 rows, the
    last one padded), and the rows they dequantize to, ``[s_kv, 1, 576]`` bf16."""
    s_kv = kv.shape[0]
    pad = torch.zeros((-s_kv) % 64, 1, 576, dtype=kv.dtype, device=kv.device)
    pages = oracle.quantize_k_cache(torch.cat([kv, pad]).view(-1, 64, 1, 576))
    deq = oracle.dequantize_k_cache(pages).view(-1, 1, 576)[:s_kv]
    return pages.view(-1, 656)[:s_kv], deq


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("fp8,schedule", [(False, "split"), ("ring", "split"),
                                          ("in_place", "split"), (False, "seesaw")],
                         ids=["bf16", "fp8", "fp8-in-place", "bf16-seesaw"])
@pytest.mark.parametrize("case", range(12))
def test_gluon_stress_against_float64_oracle_judged_by_flashmla(case, fp8, schedule,
                                                                monkeypatch):
    monkeypatch.setitem(sparse_mla_gluon.CONFIG, "schedule", schedule)
    monkeypatch.setitem(sparse_mla_gluon.CONFIG, "fp8_form", fp8 or "ring")
    g = torch.Generator(device="cuda").manual_seed(1000 + case)
    dq, dkv, didx, dkw = _stress_case(g, case)
    sm_scale = 1 / math.sqrt(192)
    if fp8:
        rows, dkv = _fp8_rows(dkv)
        assert sparse_mla._gluon_unsuitable(dq, rows, rows.stride(0), didx, 512, True) is None
        got = sparse_mla_fwd_fp8(dq, rows, didx, sm_scale, 512, **dkw)
    else:
        got = _gluon_only(dq, dkv, didx, sm_scale, 512, **dkw)
    rows = torch.unique(torch.linspace(0, dq.shape[0] - 1, 48, device="cuda").long())
    want = oracle.flash_mla_sparse_fwd(
        dq[rows].double(), dkv.double(), didx[rows], sm_scale, 512,
        **{k: (v.double() if k == "attn_sink" else v[rows]) for k, v in dkw.items()})
    for name, a, w, tol in zip(("out", "max_logits", "lse"), got, want,
                               (SPARSE_OUT_TOL, SPARSE_STAT_TOL, SPARSE_STAT_TOL)):
        res = oracle.check_allclose(a[rows].float().cpu(), w.float().cpu(), **tol)
        assert res.passed, f"{name}: {res}"
    if not peers.available(peers.FLASH_MLA) or didx.shape[2] % 128:
        return
    theirs = peers.flash_mla_sparse_fwd(dq, dkv, didx, sm_scale, 512, **dkw)
    ours_err, their_err = _errors(got, want, rows), _errors(theirs, want, rows)
    for name, e, t in zip(("out", "max_logits", "lse"), ours_err, their_err):
        assert e <= 2 * t + 1e-6, f"{name}: Gluon error {e:.3g} vs FlashMLA {t:.3g}"


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("fp8,schedule", [(False, "split"), ("ring", "split"),
                                          ("in_place", "split"), (False, "seesaw")],
                         ids=["bf16", "fp8", "fp8-in-place", "bf16-seesaw"])
@pytest.mark.parametrize("hint", sorted(ptx_hints.HINTS))
@pytest.mark.parametrize("case", [0, 1])
def test_a_gather_hint_leaves_every_result_bit_unchanged(case, hint, fp8, schedule, monkeypatch):
    """A cache hint moves no byte: out, max_logits and lse equal the unhinted kernel's bitwise
    (invalid indices, topk_length and the sink included)."""
    monkeypatch.setitem(sparse_mla_gluon.CONFIG, "schedule", schedule)
    monkeypatch.setitem(sparse_mla_gluon.CONFIG, "fp8_form", fp8 or "ring")
    g = torch.Generator(device="cuda").manual_seed(2000 + case)
    dq, dkv, didx, dkw = _stress_case(g, case)
    rows = _fp8_rows(dkv)[0] if fp8 else None

    def run(gather_hint):
        monkeypatch.setitem(sparse_mla_gluon.CONFIG, "gather_hint", gather_hint)
        if fp8:
            return sparse_mla_fwd_fp8(dq, rows, didx, 0.1, 512, **dkw)
        return _gluon_only(dq, dkv, didx, 0.1, 512, **dkw)

    for name, a, b in zip(("out", "max_logits", "lse"), run("none"), run(hint)):
        assert torch.equal(a, b), name


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("case", range(6))
def test_the_fp8_in_place_form_gives_the_ring_forms_bits(case, monkeypatch):
    """The two FP8 forms dequantize to the same bf16 tiles and run the same MMAs and softmax on
    them, in the same order: out, max_logits and lse are bitwise equal (h_q 64 and 128,
    invalid indices, topk_length and the sink included)."""
    g = torch.Generator(device="cuda").manual_seed(3000 + case)
    dq, dkv, didx, dkw = _stress_case(g, case)
    rows = _fp8_rows(dkv)[0]

    def run(form):
        monkeypatch.setitem(sparse_mla_gluon.CONFIG, "fp8_form", form)
        return sparse_mla_fwd_fp8(dq, rows, didx, 1 / math.sqrt(192), 512, **dkw)

    for name, a, b in zip(("out", "max_logits", "lse"), run("ring"), run("in_place")):
        assert torch.equal(a, b), name


@pytest.mark.cuda
@needs_gluon
def test_triton_backend_attends_an_fp8_pool_with_gluon_over_the_dequantized_context(
        caplog, monkeypatch):
    """With an FP8 pool the triton backend dequantizes the layer's context once per step and
    runs the Gluon bf16 kernel over it; the rows are bitwise those the FP8 Triton kernel
    dequantizes in place, so the two paths (same model, same reference top-k) differ only by
    summation order."""
    from glm_dsa.backend import REFERENCE, TritonBackend
    from glm_dsa.config import PRESETS
    from glm_dsa.layer import DSAForCausalLM
    from glm_dsa.oracle import calc_diff
    from glm_dsa.prefill import PrefillEngine
    from glm_dsa.weights import init_weights

    cfg = PRESETS["tiny"].replace(num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64,
                                  dense_attn_kv_len_threshold=0, num_hidden_layers=2,
                                  indexer_types=("full", "shared"), index_topk=64)
    model = init_weights(DSAForCausalLM(cfg), seed=5).to("cuda", torch.bfloat16).eval()
    tokens = torch.randint(0, cfg.vocab_size, (300,), generator=torch.Generator().manual_seed(3))

    def hidden(gluon: bool) -> torch.Tensor:
        backend = TritonBackend()
        backend.indexer_topk = REFERENCE.indexer_topk
        if not gluon:
            monkeypatch.setattr(backend, "_gluon_over_dequantized", lambda attn, proj: False)
        # Eager steps: the reference top-k reads each row chunk's windows on the host, which a
        # captured step cannot.
        eng = PrefillEngine(model, num_pages=8, kv_dtype="fp8", chunked_prefill_size=128,
                            budget_bytes=1 << 26, backend=backend, cuda_graphs=False)
        rid = eng.add_request(tokens)
        eng.run()
        return eng.output_hidden(rid).double()

    with caplog.at_level(logging.INFO, logger="glm_dsa.backend"):
        over_dequantized = hidden(gluon=True)
    assert "FP8 KV attention: context dequantized to bf16 per step, Gluon kernel" in [
        r.getMessage() for r in caplog.records]
    assert calc_diff(over_dequantized, hidden(gluon=False)) <= 1e-4


def test_one_rule_says_which_calls_the_gluon_kernel_can_take(monkeypatch):
    """``gluon_unsuitable``: bf16 queries, heads a multiple of 64, GLM's 576 / 512 dims, on a
    device where the kernel runs (stood in here); the per-call dispatch and the triton
    backend's choice for FP8 pools both read it."""
    monkeypatch.setattr(sparse_mla, "gluon_unavailable", lambda device: None)
    cpu = torch.device("cpu")
    assert sparse_mla.gluon_unsuitable(cpu, torch.bfloat16, 128, 576, 512) is None
    assert "float32 activations" in sparse_mla.gluon_unsuitable(cpu, torch.float32, 128, 576, 512)
    assert "h_q 16" in sparse_mla.gluon_unsuitable(cpu, torch.bfloat16, 16, 576, 512)
    assert "d_qk 192" in sparse_mla.gluon_unsuitable(cpu, torch.bfloat16, 64, 192, 128)
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    rows = torch.zeros(4, 576, dtype=torch.float32)
    assert "float32 rows" in sparse_mla._gluon_unsuitable(q, rows, 576, None, 512, False)


def test_a_hinted_launch_refuses_a_binary_ptxas_miscompiled(monkeypatch):
    """A hinted binary whose LDGSTS read a uniform register nothing writes (ptxas's sm_90
    miscompile; the seesaw's illegal instruction before the pass made addresses opaque) raises
    before its first launch (flash_mla_sparse_fwd_gluon checks a hinted form's binary first)."""
    from types import SimpleNamespace

    import test_kernels_ptx_hints as t

    monkeypatch.setattr(sparse_mla_gluon, "_HINT_CHECKED", set())
    ptx = {"ptx": "\tcp.async.cg.shared.global.L2::cache_hint.L2::256B [ %r117 + 0 ], "
                  "[ %rd106 + 0 ], 0x10, %r118, %rd74;\n", "cubin": b"elf"}
    monkeypatch.setattr(sparse_mla_gluon, "_sass", lambda cubin: t.BAD_SASS)
    with pytest.raises(ptx_hints.HintError, match="2 LDGSTS reading a uniform register"):
        sparse_mla_gluon._check_hinted(SimpleNamespace(hash="a", name="k", asm=ptx),
                                       "evict_last_256b")
    monkeypatch.setattr(sparse_mla_gluon, "_sass", lambda cubin: t.GOOD_SASS)
    sparse_mla_gluon._check_hinted(SimpleNamespace(hash="b", name="k", asm=ptx), "evict_last_256b")
    assert sparse_mla_gluon._HINT_CHECKED == {"b"}
