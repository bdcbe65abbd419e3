"""The Gluon sm_90 FP8-query x FP8-KV sparse MLA kernel (``kernels.sparse_mla_q8kv8_gluon``).

Gluon kernels do not run in Triton's CPU interpreter: on the CPU only the ahead-of-time sm_90
compile is checked (with a Triton the Gluon kernels were tested with); the ``cuda`` tests call
the bare launch on an sm_90 GPU against the float64 oracle (``sparse_mla_q8kv8_prefill_fwd`` on
the same e4m3 payloads, float64 scales), with the contract's tolerances.
"""

import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from glm_dsa import oracle  # noqa: E402
from glm_dsa.kernels.sparse_mla import GLUON_TESTED_TRITON  # noqa: E402
from glm_dsa.testing.cases import invalid_indices, per_tensor_fp8  # noqa: E402
from glm_dsa.testing.metrics import Q8KV8_OUT_TOL, Q8KV8_STAT_TOL  # noqa: E402

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
TESTED = triton.__version__ in GLUON_TESTED_TRITON
needs_gluon = pytest.mark.skipif(not (SM90 and TESTED),
                                 reason="needs an sm_90 GPU and a Triton in GLUON_TESTED_TRITON")

# The kernel's schedule forms, each spelled out over CONFIG (whose default is BOTH): neither
# form, FlashAttention-3's look-ahead scores, the value warpgroup transposing V_r itself, both,
# both over a deeper Vᵀ ring, and a deeper K ring over one Vᵀ stage. Both at once take 8
# registers from the gather warpgroup for the value one (at 72 / 168 ptxas spills a few bytes).
NEITHER = {"lookahead": False, "split_transpose": False, "gather_regs": 72, "value_regs": 168}
BOTH = {"lookahead": True, "split_transpose": True, "gather_regs": 64, "value_regs": 176}
FORMS = [{}, NEITHER, {**NEITHER, "lookahead": True}, {**NEITHER, "split_transpose": True}, BOTH,
         {**BOTH, "stages": 2, "v_stages": 3}, {**NEITHER, "stages": 4, "v_stages": 1}]
FORM_IDS = ["config", "neither", "lookahead", "split", "both", "both-s2v3", "s4v1"]


@pytest.fixture(params=FORMS, ids=FORM_IDS)
def form(request, monkeypatch):
    """Runs the test with the kernel's CONFIG overridden by one of ``FORMS``."""
    from glm_dsa.kernels import sparse_mla_q8kv8_gluon as kernel

    for key, value in request.param.items():
        monkeypatch.setitem(kernel.CONFIG, key, value)
    return request.param

_AOT = """
import json, re, sys
from glm_dsa.kernels.sparse_mla_q8kv8_gluon import compile_sm90
c = compile_sm90(has_sink=sys.argv[1] == "1", has_len=sys.argv[2] == "1",
                 config=json.loads(sys.argv[4]))
ptx = c.asm["ptx"]
with open(sys.argv[3], "w") as f:
    f.write(ptx)
mma = re.findall(r"wgmma\\.mma_async\\S*", ptx)
print(json.dumps({"shared": c.metadata.shared, "mma": sorted(set(mma)),
                  "noinc": ptx.count("cp.async.mbarrier.arrive.noinc"),
                  "setmaxnreg": ptx.count("setmaxnreg")}))
"""


@pytest.mark.skipif(not TESTED, reason=f"AOT check needs triton in {GLUON_TESTED_TRITON}")
@pytest.mark.parametrize("config", FORMS, ids=FORM_IDS)
@pytest.mark.parametrize("has_sink,has_len", [(False, False), (True, True)])
def test_q8kv8_kernel_compiles_for_sm90_on_fp8_tensor_cores_within_shared_memory(
        has_sink, has_len, config, tmp_path):
    # A fresh interpreter without TRITON_INTERPRET (conftest sets it on the CPU), no GPU needed.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    ptx = tmp_path / "kernel.ptx"
    done = subprocess.run([sys.executable, "-c", _AOT, str(int(has_sink)), str(int(has_len)),
                           str(ptx), json.dumps(config)], env=env, capture_output=True,
                          text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr[-3000:]
    info = json.loads(done.stdout.strip().splitlines()[-1])
    assert info["shared"] <= 232_448  # sm_90's per-block opt-in maximum (227 KB)
    # Both products on FP8 tensor cores: every wgmma takes e4m3 x e4m3 (scores m64n64,
    # P · V m64n256).
    assert info["mma"] and all(m.endswith(".f32.e4m3.e4m3") for m in info["mma"]), info["mma"]
    assert any("m64n256k32" in m for m in info["mma"]) and any("m64n64k32" in m
                                                              for m in info["mma"])
    assert info["noinc"] > 0  # cp.async completing mbarriers
    assert info["setmaxnreg"] > 0  # the partitions' register budgets took effect
    if shutil.which("ptxas"):
        out = subprocess.run(["ptxas", "-arch=sm_90a", "-v", str(ptx), "-o",
                              str(tmp_path / "kernel.cubin")], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-3000:]
        assert "0 bytes spill stores, 0 bytes spill loads" in out.stderr, out.stderr
        assert "serialized" not in out.stderr, out.stderr  # wgmma pipelines kept


def _inputs(s_q, h_q, topk, s_kv, seed, row_stride=576):
    """Random q / kv (std 0.1) quantized per tensor, distinct valid indices per row; kv as rows
    of ``row_stride`` bytes (the payload in the first 576)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(s_q, h_q, 576, generator=g, device="cuda") / 10
    kv = torch.randn(s_kv, 1, 576, generator=g, device="cuda") / 10
    (q8, q_scale), (kv8, kv_scale) = per_tensor_fp8(q), per_tensor_fp8(kv)
    rows = torch.zeros(s_kv, row_stride, dtype=torch.uint8, device="cuda")
    rows[:, :576] = kv8.view(torch.uint8).view(s_kv, 576)
    idx = torch.stack([torch.randperm(s_kv, generator=g, device="cuda")[:topk]
                       for _ in range(s_q)]).to(torch.int32).view(s_q, 1, topk)
    return q8, kv8, rows, idx, q_scale, kv_scale


def _check(q8, kv8, rows, idx, q_scale, kv_scale, sm_scale, attn_sink=None, topk_length=None):
    from glm_dsa.kernels.sparse_mla_q8kv8_gluon import sparse_mla_q8kv8_fwd_gluon

    got = sparse_mla_q8kv8_fwd_gluon(q8, rows, rows.stride(0), kv8.shape[0], idx, sm_scale,
                                     q_scale, kv_scale, attn_sink, topk_length)
    assert got[0].dtype == torch.bfloat16 and got[0].shape == (*q8.shape[:2], 512)
    kwargs = {} if attn_sink is None else {"attn_sink": attn_sink.double(),
                                           "topk_length": topk_length}
    want = oracle.sparse_mla_q8kv8_prefill_fwd(q8, kv8, idx, sm_scale, q_scale.double(),
                                               kv_scale.double(), 512, **kwargs)
    for name, a, w, tol in zip(("out", "max_logits", "lse"), got, want,
                               (Q8KV8_OUT_TOL, Q8KV8_STAT_TOL, Q8KV8_STAT_TOL)):
        res = oracle.check_allclose(a.float().cpu(), w.float().cpu(), **tol)
        assert res.passed, f"{name}: {res}"
    return got


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("topk", [2048, 640])
@pytest.mark.parametrize("h_q", [64, 128])
def test_q8kv8_gluon_matches_the_oracle_with_invalid_indices_and_a_lonely_row(h_q, topk, form):
    s_kv = 5000
    q8, kv8, rows, idx, q_scale, kv_scale = _inputs(12, h_q, topk, s_kv, seed=h_q + topk)
    junk = torch.tensor(invalid_indices(s_kv), dtype=torch.int32, device="cuda")
    idx[3, 0, 5:5 + len(junk)] = junk
    idx[4, 0, ::3] = junk[torch.arange(len(idx[4, 0, ::3]), device="cuda") % len(junk)]
    idx[1] = -1  # a lonely row
    out, max_logits, lse = _check(q8, kv8, rows, idx, q_scale, kv_scale, 1 / math.sqrt(576))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert bool(torch.isneginf(max_logits[1]).all()) and bool(torch.isposinf(lse[1]).all())


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("h_q", [64, 128])
def test_q8kv8_gluon_takes_attn_sink_and_topk_length(h_q, form):
    q8, kv8, rows, idx, q_scale, kv_scale = _inputs(10, h_q, 2048, 3000, seed=7 + h_q)
    g = torch.Generator(device="cuda").manual_seed(11)
    sink = torch.randn(h_q, generator=g, device="cuda")
    lengths = torch.randint(0, 2048 + 1, (10,), generator=g, device="cuda", dtype=torch.int32)
    lengths[:3] = torch.tensor([0, 2048 // 2 + 1, 5], dtype=torch.int32, device="cuda")
    out, _, lse = _check(q8, kv8, rows, idx, q_scale, kv_scale, 1 / math.sqrt(192), sink,
                         lengths)
    assert bool(torch.isposinf(lse[0]).all()) and torch.equal(out[0], torch.zeros_like(out[0]))


@pytest.mark.cuda
@needs_gluon
def test_q8kv8_gluon_over_a_wide_index_range_at_a_padded_row_stride(form):
    # s_kv ~200k: row offsets past 2**27 bytes; rows 656 bytes apart (a pool-like stride).
    q8, kv8, rows, idx, q_scale, kv_scale = _inputs(6, 64, 2048, 200_000, seed=3,
                                                    row_stride=656)
    idx[0, 0, :4] = torch.tensor([0, 199_999, 131_071, 131_072], dtype=torch.int32,
                                 device="cuda")
    _check(q8, kv8, rows, idx, q_scale, kv_scale, 1 / math.sqrt(576))


@pytest.mark.cuda
@needs_gluon
def test_q8kv8_gluon_with_unit_scales_and_an_e4m3_kv_view(form):
    # SGLang's serving cast: scale 1, the payload is the value; kv passed as e4m3 rows.
    g = torch.Generator(device="cuda").manual_seed(5)
    q8 = (torch.randn(4, 128, 576, generator=g, device="cuda") / 10).to(torch.float8_e4m3fn)
    kv8 = (torch.randn(700, 1, 576, generator=g, device="cuda") / 10).to(torch.float8_e4m3fn)
    idx = torch.randint(0, 700, (4, 1, 256), generator=g, device="cuda", dtype=torch.int32)
    one = torch.ones(1, device="cuda")
    _check(q8, kv8, kv8.view(700, 576), idx, one, one, 1 / math.sqrt(576))


def test_q8kv8_split_transpose_refuses_a_single_vt_stage():
    # The value warpgroup writes tile i + 1's Vᵀ while its P · V of tile i reads the other slot.
    from glm_dsa.kernels.sparse_mla_q8kv8_gluon import compile_sm90

    with pytest.raises(ValueError, match="split_transpose needs v_stages >= 2"):
        compile_sm90(False, False, {"split_transpose": True, "v_stages": 1})
