"""The Triton sparse MLA kernels against the oracle (``glm_dsa.oracle.flash_mla_sparse_fwd``).

On the CPU they run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET); the
``cuda`` tests run the compiled kernels at GLM-5.3's shape on a GPU. bf16 results are held to
FlashMLA's own test tolerances (``testing.metrics.SPARSE_OUT_TOL`` / ``SPARSE_STAT_TOL``) at the input scale
they were set for (``BF16_STD``), float32 results to float32 rounding.
"""

import math

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa import oracle, testing  # noqa: E402
from glm_dsa.testing.cases import invalid_indices  # noqa: E402
from glm_dsa.testing.metrics import SPARSE_OUT_TOL, SPARSE_STAT_TOL  # noqa: E402
from glm_dsa.kernels import flash_mla_sparse_fwd, sparse_mla_fwd_fp8  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
F32_TOL = {"abs_tol": 1e-5, "rel_tol": 1e-5, "cos_diff_tol": 1e-10}
# FlashMLA's sparse-prefill test draws q and kv as randn / 10. Rounding P and out to bf16 (as
# FlashMLA does) costs ~2e-4 absolute there, inside its 8e-4; at unit scale it is ~5e-3.
BF16_STD = 0.1


def _indices(g, s_q, s_kv, topk, lonely_rows=()):
    """Random rows of kv with repeats, and the case table's invalid indices in every row."""
    idx = torch.randint(0, s_kv, (s_q, 1, topk), generator=g, dtype=torch.int32)
    junk = torch.tensor(invalid_indices(s_kv), dtype=torch.int32)
    cols = torch.randperm(topk, generator=g)[: min(len(junk), topk)]
    idx[:, 0, cols] = junk[: len(cols)]
    for r in lonely_rows:
        idx[r] = -1
    return idx


def _assert_close(name, ans, ref, tol):
    res = oracle.check_allclose(ans.float().cpu(), ref.float().cpu(), **tol)
    assert res.passed, f"{name}: {res}"


def _check(got, want, out_tol, stat_tol=None):
    stat_tol = stat_tol or out_tol
    for name, a, r, tol in zip(("out", "max_logits", "lse"), got, want,
                               (out_tol, stat_tol, stat_tol)):
        _assert_close(name, a, r, tol)


def _inputs(g, s_q, h, d_qk, s_kv, dtype, std=1.0):
    q = (torch.randn(s_q, h, d_qk, generator=g) * std).to(dtype)
    kv = (torch.randn(s_kv, 1, d_qk, generator=g) * std).to(dtype)
    return q, kv


def _dev(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


@pytest.mark.parametrize("h", [4, 20])
def test_float32_small_config_matches_oracle_tightly(h):
    # Small-config shape: d_qk 144 = 128 latent + 16 RoPE, d_v 128; h=20 spans two head blocks.
    g = torch.Generator().manual_seed(h)
    q, kv = _inputs(g, 3, h, 144, 50, torch.float32)
    idx = _indices(g, 3, 50, 40, lonely_rows=(1,))
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 0.3, 128)
    got = flash_mla_sparse_fwd(*_dev(q, kv, idx), 0.3, 128)
    assert got[0].dtype == torch.float32
    _check(got, want, F32_TOL)


def test_bf16_glm_shape_matches_oracle_within_flashmla_tolerance():
    g = torch.Generator().manual_seed(1)
    q, kv = _inputs(g, 3, 64, 576, 150, torch.bfloat16, BF16_STD)
    idx = _indices(g, 3, 150, 64, lonely_rows=(2,))
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 1 / 16, 512)
    got = flash_mla_sparse_fwd(*_dev(q, kv, idx), 1 / 16, 512)
    assert got[0].dtype == torch.bfloat16 and got[1].dtype == got[2].dtype == torch.float32
    _check(got, want, SPARSE_OUT_TOL, SPARSE_STAT_TOL)


def test_lonely_row_is_exactly_zero_with_infinite_statistics():
    g = torch.Generator().manual_seed(2)
    q, kv = _inputs(g, 2, 4, 144, 30, torch.float32)
    idx = torch.tensor(invalid_indices(30) * 4, dtype=torch.int32).repeat(2, 1, 1)  # [2, 1, 24]
    idx[1, 0, 7] = 29  # row 1 has exactly one valid key: out = that key's values
    out, max_logits, lse = flash_mla_sparse_fwd(*_dev(q, kv, idx), 0.5, 128)
    assert torch.equal(out[0].cpu(), torch.zeros(4, 128))
    assert bool(torch.isneginf(max_logits[0]).all() and torch.isposinf(lse[0]).all())
    torch.testing.assert_close(out[1].cpu(), kv[29, 0, :128].expand(4, 128), rtol=1e-6, atol=1e-6)
    logit = (q[1].double() @ kv[29, 0].double()) * 0.5
    torch.testing.assert_close(lse[1].cpu().double(), logit, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(max_logits[1].cpu().double(), logit, rtol=1e-5, atol=1e-5)


def test_attn_sink_and_topk_length_match_oracle():
    g = torch.Generator().manual_seed(3)
    q, kv = _inputs(g, 4, 4, 144, 60, torch.float32)
    idx = _indices(g, 4, 60, 48)
    sink = torch.randn(4, generator=g)
    lengths = torch.tensor([48, 17, 0, 100], dtype=torch.int32)  # 0: lonely; 100 > topk
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 0.25, 128, sink, lengths)
    got = flash_mla_sparse_fwd(*_dev(q, kv, idx), 0.25, 128, *_dev(sink, lengths))
    _check(got, want, F32_TOL)
    assert torch.equal(got[0][2].cpu(), torch.zeros(4, 128))


def test_reads_rows_in_place_from_a_strided_pool():
    # kv as a view with a row stride wider than d_qk, as a slice of a larger pool would be.
    g = torch.Generator().manual_seed(4)
    q, _ = _inputs(g, 2, 4, 144, 1, torch.float32)
    pool = torch.randn(40, 1, 160, generator=g)
    kv = pool[:, :, :144]
    idx = _indices(g, 2, 40, 32)
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 0.3, 128)
    got = flash_mla_sparse_fwd(*_dev(q, kv, idx), 0.3, 128)
    _check(got, want, F32_TOL)


def _fp8_pool(g, num_pages, std=1.0):
    latent = (torch.randn(num_pages, 64, 1, 576, generator=g) * std).to(torch.bfloat16)
    return oracle.quantize_k_cache(latent)                      # uint8 [pages, 64, 1, 656]


def test_fp8_rows_match_oracle_on_dequantized_rows():
    g = torch.Generator().manual_seed(5)
    pages = _fp8_pool(g, 3, BF16_STD)
    q = (torch.randn(3, 64, 576, generator=g) * BF16_STD).to(torch.bfloat16)
    slots = _indices(g, 3, 3 * 64, 64, lonely_rows=(1,))
    sink = torch.randn(64, generator=g)
    lengths = torch.tensor([64, 64, 40], dtype=torch.int32)
    kv = oracle.dequantize_k_cache(pages).view(-1, 1, 576)
    want = oracle.flash_mla_sparse_fwd(q, kv, slots, 1 / 16, 512, sink, lengths)
    rows = pages.view(-1, 656)
    got = sparse_mla_fwd_fp8(*_dev(q, rows, slots), 1 / 16, 512, *_dev(sink, lengths))
    _check(got, want, SPARSE_OUT_TOL, SPARSE_STAT_TOL)
    # In-kernel dequantization rounds as dequantize_k_cache does: same numbers as bf16 rows.
    plain = flash_mla_sparse_fwd(*_dev(q, kv, slots), 1 / 16, 512, *_dev(sink, lengths))
    for a, b in zip(got, plain):
        assert torch.equal(a, b)


def test_bad_inputs_raise_one_line_errors():
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    with pytest.raises(ValueError, match="share a dtype"):
        flash_mla_sparse_fwd(q, torch.zeros(10, 1, 576), idx, 0.1)
    with pytest.raises(ValueError, match="sparse_mla_fwd_fp8"):
        flash_mla_sparse_fwd(q, torch.zeros(10, 1, 576, dtype=torch.float16), idx, 0.1)
    with pytest.raises(ValueError, match="656 bytes per row"):
        sparse_mla_fwd_fp8(q, torch.zeros(10, 1152, dtype=torch.uint8), idx, 0.1)
    with pytest.raises(ValueError, match="indices must be int32"):
        flash_mla_sparse_fwd(q, q[:, :1], idx.long(), 0.1)
    with pytest.raises(ValueError, match="sm_scale"):
        flash_mla_sparse_fwd(q, q[:, :1], idx, math.nan)


@pytest.mark.parametrize("fwd", ["bf16", "fp8"])
@pytest.mark.parametrize("sm_scale", [0.0, -0.1, -math.inf])
def test_a_scale_that_is_not_positive_is_refused_before_any_launch(fwd, sm_scale):
    # The kernels fold the scale into the exponent and take the max of the unscaled scores.
    q = torch.zeros(2, 4, 576, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, 8, dtype=torch.int32)
    kv = q[:, :1] if fwd == "bf16" else torch.zeros(10, 656, dtype=torch.uint8)
    call = flash_mla_sparse_fwd if fwd == "bf16" else sparse_mla_fwd_fp8
    with pytest.raises(ValueError, match=f"sm_scale={sm_scale} must be finite and positive"):
        call(q, kv, idx, sm_scale)


# ------------------------------------------------------------------ GLM-5.3 shapes on a GPU
def _glm_case(h, s_q=256, s_kv=8192, topk=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(s_q, h, 576, generator=g) * BF16_STD).to(torch.bfloat16)
    latent = (torch.randn(s_kv, 1, 576, generator=g) * BF16_STD).to(torch.bfloat16)
    # Distinct rows per query, causal-ish: query i draws from the first s_kv - s_q + i + 1 rows.
    idx = torch.full((s_q, 1, topk), -1, dtype=torch.int32)
    for i in range(s_q):
        n = s_kv - s_q + i + 1
        idx[i, 0, : min(topk, n)] = torch.randperm(n, generator=g)[:topk].to(torch.int32)
    idx[0, 0, :] = -1
    return q, latent, idx


@pytest.mark.cuda
@pytest.mark.parametrize("h", [64, 128])
def test_glm_shape_on_gpu_matches_oracle(h):
    q, kv, idx = _glm_case(h)
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 1 / 16, 512)
    got = flash_mla_sparse_fwd(*_dev(q, kv, idx), 1 / 16, 512)
    _check(got, want, SPARSE_OUT_TOL, SPARSE_STAT_TOL)


@pytest.mark.cuda
def test_glm_shape_fp8_on_gpu_matches_oracle_on_dequantized_rows():
    q, latent, idx = _glm_case(64)
    pages = oracle.quantize_k_cache(latent.view(-1, 64, 1, 576))
    kv = oracle.dequantize_k_cache(pages).view(-1, 1, 576)
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 1 / 16, 512)
    got = sparse_mla_fwd_fp8(*_dev(q, pages.view(-1, 656), idx), 1 / 16, 512)
    _check(got, want, SPARSE_OUT_TOL, SPARSE_STAT_TOL)


@pytest.mark.cuda
def test_fp8_rows_not_a_multiple_of_16_bytes_over_several_tiles():
    """164-byte FP8 rows (latent 128 + RoPE 16, the ``small`` config) and 512 indices, several key
    tiles: the next tile's L2 prefetch needs 16-byte rows, so it is off here (it faulted)."""
    from glm_dsa.kv_format import mla_kv_dequantize, mla_kv_quantize

    g = torch.Generator().manual_seed(3)
    s_q, h, s_kv, topk = 8, 4, 1024, 512
    latent = torch.randn(s_kv, 144, generator=g) * BF16_STD
    rows = mla_kv_quantize(latent[:, :128], latent[:, 128:])                 # uint8 [s_kv, 164]
    kv = mla_kv_dequantize(rows, 128, 16).to(torch.bfloat16)[:, None, :]
    q = (torch.randn(s_q, h, 144, generator=g) * BF16_STD).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(s_kv, generator=g)[:topk] for _ in range(s_q)])[:, None, :].to(torch.int32)
    want = oracle.flash_mla_sparse_fwd(q, kv, idx, 1 / 16, 128)
    got = sparse_mla_fwd_fp8(*_dev(q, rows, idx), 1 / 16, 128)
    _check(got, want, SPARSE_OUT_TOL, SPARSE_STAT_TOL)


def test_flash_mla_sparse_fwd_passes_the_harness():
    cases = len(testing.edge_case_names("flash_mla_sparse_fwd")) + 1  # every named edge, one random
    report = testing.check_kernel("flash_mla_sparse_fwd", flash_mla_sparse_fwd, cases=cases,
                                  device=DEVICE)
    assert report.cases_run == cases


@pytest.mark.cuda
def test_flash_mla_sparse_fwd_passes_the_harness_at_glm_shapes():
    testing.check_kernel("flash_mla_sparse_fwd", flash_mla_sparse_fwd, cases=20, device=DEVICE,
                         shapes="glm-5.3")
