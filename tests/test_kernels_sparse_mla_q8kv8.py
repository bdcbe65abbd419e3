"""The FP8-query sparse MLA prefill (``kernels.sparse_mla_q8kv8_prefill_fwd``, SGLang's Q8KV8)
against its oracle contract (``glm_dsa.oracle.sparse_mla_q8kv8_prefill_fwd``, tolerance
``Q8KV8_OUT_TOL``), and the per-tensor quantizers that feed it.

On the CPU the Triton kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET); the ``cuda`` tests run the public entry at GLM-5.3's shapes on a GPU (the
Gluon kernel on sm_90 with a tested Triton) and the Triton kernel there too.
"""

import logging

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa import oracle, testing  # noqa: E402
from glm_dsa.fp8 import per_tensor_quant  # noqa: E402
from glm_dsa.kernels import sparse_mla_q8kv8  # noqa: E402
from glm_dsa.kernels import sparse_mla_q8kv8_prefill_fwd  # noqa: E402
from glm_dsa.kv_format import mla_kv_dequantize, mla_kv_per_tensor_fp8, mla_kv_quantize  # noqa: E402
from glm_dsa.testing.cases import per_tensor_fp8  # noqa: E402
from glm_dsa.testing.metrics import Q8KV8_OUT_TOL, SPARSE_STAT_TOL  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
CONTRACT = "sparse_mla_q8kv8_prefill_fwd"


def test_q8kv8_passes_the_harness():
    cases = len(testing.edge_case_names(CONTRACT)) + 1  # every named edge, one random
    report = testing.check_kernel(CONTRACT, sparse_mla_q8kv8_prefill_fwd, cases=cases, device=DEVICE)
    assert report.cases_run == cases


def test_small_config_with_ragged_topk_matches_the_oracle():
    """The small config's 144 = 128 + 16 dims (the RoPE tail padded to an 8-bit MMA's 32), a
    top-k that is no multiple of the key tile, and the per-tensor quantizer of the library."""
    g = torch.Generator().manual_seed(4)
    q8, q_scale = per_tensor_quant(torch.randn(5, 4, 144, generator=g) * 0.1)
    kv8, kv_scale = per_tensor_quant(torch.randn(70, 1, 144, generator=g) * 0.1)
    idx = torch.randint(-3, 75, (5, 1, 41), generator=g, dtype=torch.int32)
    want = oracle.sparse_mla_q8kv8_prefill_fwd(q8, kv8, idx, 0.3, q_scale, kv_scale, 128)
    got = sparse_mla_q8kv8_prefill_fwd(q8, kv8, idx, 0.3, q_scale, kv_scale, 128)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32
    for name, a, w, tol in zip(("out", "max_logits", "lse"), got, want,
                               (Q8KV8_OUT_TOL, SPARSE_STAT_TOL, SPARSE_STAT_TOL)):
        res = oracle.check_allclose(a.float(), w.float(), **tol)
        assert res.passed, f"{name}: {res}"


def test_bad_inputs_raise_one_line_errors_before_any_compute():
    q = torch.zeros(2, 4, 576, dtype=torch.float8_e4m3fn)
    kv = torch.zeros(10, 1, 576, dtype=torch.float8_e4m3fn)
    idx = torch.zeros(2, 1, 128, dtype=torch.int32)
    one = torch.ones(1)
    cases = [
        ((q.to(torch.bfloat16), kv, idx, 0.1, one, one), {}, "q must be float8_e4m3fn"),
        ((q, kv.to(torch.bfloat16), idx, 0.1, one, one), {}, "kv must be float8_e4m3fn"),
        ((q, kv, idx.long(), 0.1, one, one), {}, "indices must be int32"),
        ((q, kv, idx, 0.1, torch.ones(2), one), {}, "q_scale must be a one-element float32"),
        ((q, kv, idx, 0.1, one, one.double()), {}, "kv_scale must be a one-element float32"),
        ((q, kv, idx, 0.1, one, one), {"attn_sink": torch.zeros(4)}, "go together"),
        ((q, kv, idx, float("nan"), one, one), {}, "sm_scale"),
        ((q, kv[:, :, :512], idx, 0.1, one, one), {}, "kv must be"),
    ]
    for args, kwargs, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            sparse_mla_q8kv8_prefill_fwd(*args, **kwargs)
        assert "\n" not in str(e.value)


def test_gluon_dispatch_refuses_with_its_reason():
    assert sparse_mla_q8kv8.q8kv8_shape_refusal(64, 576, 512) is None
    assert sparse_mla_q8kv8.q8kv8_shape_refusal(128, 576, 512) is None
    assert "h_q 16" in sparse_mla_q8kv8.q8kv8_shape_refusal(16, 576, 512)
    assert "d_qk 512" in sparse_mla_q8kv8.q8kv8_shape_refusal(64, 512, 512)


def test_the_interpreter_takes_the_triton_kernel_and_says_so_once(caplog):
    if DEVICE == "cuda":
        pytest.skip("the CPU interpreter's dispatch")
    case = testing.make_case(CONTRACT, "unit_scales")
    sparse_mla_q8kv8._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="glm_dsa.kernels"):
        sparse_mla_q8kv8_prefill_fwd(*case.args, **case.kwargs)
        sparse_mla_q8kv8_prefill_fwd(*case.args, **case.kwargs)
    said = [r.getMessage() for r in caplog.records if "Q8KV8" in r.getMessage()]
    assert said == ["Q8KV8 sparse MLA: Triton kernel (the CPU interpreter)"]


@pytest.mark.parametrize("edge", ["unit_scales", "lonely_row", "attn_sink_and_topk_length", "no_rope_512"])
def test_the_pre_sm89_byte_path_gives_the_same_bits(monkeypatch, edge):
    """Before sm_89 Triton has no e4m3: the kernel decodes the bytes to fp16 and rounds the
    softmax weights to e4m3 by hand. Both are exact, so the results are the e4m3 path's, bit for
    bit (run here in the interpreter, which takes both)."""
    case = testing.make_case(CONTRACT, edge)
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case.args]
    kwargs = {k: v.to(DEVICE) for k, v in case.kwargs.items()}
    want = sparse_mla_q8kv8_prefill_fwd(*args, **kwargs)
    monkeypatch.setattr(sparse_mla_q8kv8, "_fp8_native", lambda device: False)
    monkeypatch.setattr(sparse_mla_q8kv8, "_gluon_unsuitable", lambda *a: "the byte path")
    got = sparse_mla_q8kv8_prefill_fwd(*args, **kwargs)
    for a, w in zip(got, want):
        assert torch.equal(a, w)


# ------------------------------------------------------------------ the per-tensor quantizers
def test_per_tensor_quant_matches_the_harness_quantizer():
    """The library's amax × fl(1/448) against the harness's amax / 448 (independent): the scales
    within one float32 ulp, the payloads then equal or one e4m3 step apart."""
    x = torch.randn(7, 3, 40, generator=torch.Generator().manual_seed(1)) * 3
    got, scale = per_tensor_quant(x)
    want, want_scale = per_tensor_fp8(x)
    assert got.shape == x.shape and got.dtype == torch.float8_e4m3fn and scale.shape == (1,)
    assert abs(float(scale / want_scale) - 1) <= 2 ** -23
    assert float(got.float().abs().max()) <= 448
    assert float((got.float() - want.float()).abs().max()) <= 32  # one step at the top binade
    assert float((got.float() * scale - x).abs().max()) <= float(scale) * 16
    assert per_tensor_quant(torch.zeros(0, 4))[0].shape == (0, 4)


def test_fp8_rows_requantized_per_tensor_move_exactly_above_e4m3s_normal_range():
    """``mla_kv_per_tensor_fp8`` against the dequantized rows: a power-of-two scale at or above
    every tile scale, and every value whose requantized payload stays e4m3-normal (>= 2^-6)
    carried exactly; the rest (smaller tiles' tiny values) within half a subnormal step."""
    g = torch.Generator().manual_seed(2)
    latent = torch.randn(33, 512, generator=g) * 0.1
    latent[3] *= 40  # one token's tiles far above the rest
    rows = mla_kv_quantize(latent, torch.randn(33, 64, generator=g) * 0.5)
    kv8, scale = mla_kv_per_tensor_fp8(rows, 512, 64)
    values = mla_kv_dequantize(rows, 512, 64)
    tile_scales = rows[:, 512:528].contiguous().view(torch.float32)
    s = float(scale)
    assert kv8.shape == (33, 576) and kv8.dtype == torch.float8_e4m3fn
    assert s >= float(tile_scales.max()) and s == 2.0 ** round(torch.log2(scale).item())
    ratio = values / s
    normal = ratio.abs() >= 2 ** -6
    latent_part = torch.zeros_like(normal)
    latent_part[:, :512] = True
    assert torch.equal(kv8.float()[normal & latent_part], ratio[normal & latent_part])
    assert float((kv8.float() - ratio).abs()[~normal].max()) <= 2 ** -10
    assert float((kv8.float() - ratio).abs()[:, 512:].max() / ratio[:, 512:].abs().max()) <= 2 ** -4


# ------------------------------------------------------------------ GLM-5.3 shapes on a GPU
@pytest.mark.cuda
def test_q8kv8_passes_the_harness_at_glm_shapes():
    testing.check_kernel(CONTRACT, sparse_mla_q8kv8_prefill_fwd, cases=12, device=DEVICE,
                         shapes="glm-5.3")


@pytest.mark.cuda
def test_the_triton_kernel_passes_the_harness_on_the_gpu_too(monkeypatch):
    """The fallback every GPU but sm_90 takes (and sm_90 with an untested Triton)."""
    monkeypatch.setattr(sparse_mla_q8kv8, "_gluon_unsuitable", lambda *a: "forced for the test")
    testing.check_kernel(CONTRACT, sparse_mla_q8kv8_prefill_fwd, cases=8, device=DEVICE,
                         shapes="glm-5.3")


@pytest.mark.cuda
def test_sm90_takes_the_gluon_kernel_when_it_is_there(caplog):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("sm_90 only")
    pytest.importorskip("glm_dsa.kernels.sparse_mla_q8kv8_gluon")
    case = testing.make_case(CONTRACT, "invalid_indices", shapes="glm-5.3")
    args = [t.to(DEVICE) if isinstance(t, torch.Tensor) else t for t in case.args]
    sparse_mla_q8kv8._LOGGED.clear()
    with caplog.at_level(logging.INFO, logger="glm_dsa.kernels"):
        sparse_mla_q8kv8_prefill_fwd(*args, **case.kwargs)
    said = [r.getMessage() for r in caplog.records if "Q8KV8" in r.getMessage()]
    assert len(said) == 1 and "Gluon sm_90" in said[0], said
