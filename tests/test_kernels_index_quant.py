"""The fused indexer quantization (glm_dsa.kernels.index_quant) against the reference functions
it replaces: ``act_quant(Indexer._rope_then_rotate(x))`` and ``index_k_store``, bitwise.

On the CPU the kernel runs in Triton's interpreter (tests/conftest.py); the ``cuda`` test runs it
at GLM-5.3's indexer shapes (32 heads × 128, 2,048 tokens).
"""

import pytest
import torch

pytest.importorskip("triton")

from glm_dsa.config import get_config  # noqa: E402
from glm_dsa.fp8 import act_quant  # noqa: E402
from glm_dsa.indexer import Indexer  # noqa: E402
from glm_dsa.kernels.index_quant import rope_hadamard_quant, rope_hadamard_quant_store  # noqa: E402
from glm_dsa.kv_format import index_k_store  # noqa: E402
from glm_dsa.rope import rope_cos_sin  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
GLM = get_config("glm-5.3")


def _case(cfg, shape, dtype, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(*shape, generator=g) * 3).to(dtype)
    x[0, ..., 5] = 0.0  # a zero, a tiny and a huge element in the first row
    x.view(-1, shape[-1])[1, :] = 1e-7
    x.view(-1, shape[-1])[2, 7] = 3e4
    positions = torch.randint(0, 1 << 20, (shape[0],), generator=g)
    cos, sin = rope_cos_sin(positions, cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling,
                            dtype=torch.float32)
    return x.to(device), positions.to(device), cos.to(device), sin.to(device)


def _reference(cfg, x, positions):
    idx = Indexer(cfg).to(x.device)
    return act_quant(idx._rope_then_rotate(x, positions), cfg.index_head_dim, cfg.scale_fmt)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(37, 128), (9, 4, 128)], ids=["keys", "queries"])
def test_fused_quant_is_bitwise_the_reference(interleaved, scale_fmt, dtype, shape):
    cfg = GLM.replace(indexer_rope_interleave=interleaved, scale_fmt=scale_fmt)
    x, positions, cos, sin = _case(cfg, shape, dtype, seed=len(shape) + interleaved)
    want_fp8, want_scale = _reference(cfg, x, positions)
    got_fp8, got_scale = rope_hadamard_quant(x, cos, sin, cfg.qk_rope_head_dim, interleaved, scale_fmt)
    assert got_fp8.dtype == torch.float8_e4m3fn and got_fp8.shape == x.shape
    assert got_scale.shape == want_scale.shape
    assert torch.equal(got_fp8.view(torch.uint8), want_fp8.view(torch.uint8))
    assert torch.equal(got_scale, want_scale)


def test_fused_quant_writes_the_pages_index_k_store_writes():
    cfg, page_size, num_pages = GLM, 64, 5
    x, positions, cos, sin = _case(cfg, (70, 128), torch.bfloat16, seed=3)
    slots = torch.randperm(num_pages * page_size, generator=torch.Generator().manual_seed(3))[:70]
    slots = slots.to(DEV)
    background = torch.randint(0, 256, (num_pages, page_size * 132), dtype=torch.uint8,
                               generator=torch.Generator().manual_seed(4)).to(DEV)
    want = background.clone()
    k_fp8, k_scale = _reference(cfg, x, positions)
    index_k_store(want, slots, k_fp8, k_scale[:, 0], page_size)
    got = background.clone()
    rope_hadamard_quant_store(x, cos, sin, 64, True, cfg.scale_fmt, got, slots, page_size)
    assert torch.equal(got, want)  # the rows' bytes and scales, and nothing else


@pytest.mark.filterwarnings("ignore:All-NaN slice")  # numpy's, inside Triton's interpreter
def test_fused_quant_refuses_non_finite_input_like_act_quant():
    x, _, cos, sin = _case(GLM, (4, 128), torch.float32, seed=0)
    x[2, 100] = float("nan")
    with pytest.raises(ValueError, match="NaN or inf"):
        rope_hadamard_quant(x, cos, sin, 64, True, "ue8m0")


def test_fused_quant_rejects_bad_input():
    x, _, cos, sin = _case(GLM, (4, 128), torch.float32, seed=0)
    with pytest.raises(ValueError, match="power of two"):
        rope_hadamard_quant(x[:, :96].contiguous(), cos, sin, 64, True, None)
    with pytest.raises(ValueError, match="cos and sin"):
        rope_hadamard_quant(x, cos[:, :16], sin, 64, True, None)
    with pytest.raises(ValueError, match="contiguous"):
        rope_hadamard_quant(x.t().contiguous().t(), cos, sin, 64, True, None)
    pages = torch.zeros(2, 64 * 132, dtype=torch.uint8, device=DEV)
    with pytest.raises(ValueError, match="distinct"):
        rope_hadamard_quant_store(x, cos, sin, 64, True, None, pages, torch.tensor([1, 2, 1, 3], device=DEV))
    with pytest.raises(ValueError):  # a slot past the pages
        rope_hadamard_quant_store(x, cos, sin, 64, True, None, pages, torch.tensor([1, 2, 3, 128], device=DEV))
    with pytest.raises(ValueError, match="must be \\[n, D\\]"):
        rope_hadamard_quant_store(x.view(4, 1, 128), cos, sin, 64, True, None, pages, torch.arange(4, device=DEV))


@pytest.mark.cuda
def test_cuda_fused_quant_at_glm_shapes_is_bitwise_the_reference():
    for shape in [(2048, 128), (2048, 32, 128)]:
        x, positions, cos, sin = _case(GLM, shape, torch.bfloat16, seed=5, device="cuda")
        want_fp8, want_scale = _reference(GLM, x, positions)
        got_fp8, got_scale = rope_hadamard_quant(x, cos, sin, 64, True, GLM.scale_fmt)
        assert torch.equal(got_fp8.view(torch.uint8), want_fp8.view(torch.uint8)), shape
        assert torch.equal(got_scale, want_scale), shape
