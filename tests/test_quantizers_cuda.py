"""The quantizers write the same bytes on CPU and CUDA, and kv_cache_cast_to_fp8 equals
DeepGEMM's own helper arithmetic as PyTorch runs it on CUDA (issue 22: ``amax / 448.0`` is a
true division on the CPU and a multiply by the float32 reciprocal on CUDA).
"""

import pytest
import torch

from glm_dsa import oracle
from glm_dsa.fp8 import act_quant
from glm_dsa.kv_format import mla_kv_quantize

pytestmark = pytest.mark.cuda

NUM_KEYS = 204_800  # 3,200 pages of 64


def keys(n: int, d: int, seed: int, dtype=torch.bfloat16) -> torch.Tensor:
    """[n, d] on the CPU: normal rows, each scaled by 10**u, u uniform in [-4, 4)."""
    g = torch.Generator().manual_seed(seed)
    mag = 10.0 ** (8 * torch.rand(n, 1, generator=g, dtype=torch.float64) - 4)
    return (torch.randn(n, d, generator=g, dtype=torch.float64) * mag).to(dtype)


def same_bytes(cpu: torch.Tensor, cuda: torch.Tensor) -> int:
    """Number of differing bytes (0 when equal)."""
    a = cpu.contiguous().view(torch.uint8)
    b = cuda.cpu().contiguous().view(torch.uint8)
    assert a.shape == b.shape
    return int((a != b).sum())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_act_quant_bytes_are_the_same_on_cpu_and_cuda(scale_fmt, dtype):
    k = keys(NUM_KEYS, 128, seed=1, dtype=dtype)
    for reciprocal in (False, True):
        cpu = act_quant(k, 128, scale_fmt, reciprocal=reciprocal)
        gpu = act_quant(k.cuda(), 128, scale_fmt, reciprocal=reciprocal)
        assert same_bytes(cpu[1], gpu[1]) == 0, "scales differ"
        assert same_bytes(cpu[0], gpu[0]) == 0, "payload differs"


def test_kv_cache_cast_to_fp8_is_the_same_on_cpu_and_cuda_and_equals_deepgemms_helper():
    k = keys(NUM_KEYS, 128, seed=2).view(-1, 64, 1, 128)
    cpu = oracle.kv_cache_cast_to_fp8(k)
    gpu = oracle.kv_cache_cast_to_fp8(k.cuda())
    assert same_bytes(cpu, gpu) == 0
    # DeepGEMM tests/test_attention.py kv_cache_cast_to_fp8, its arithmetic on CUDA.
    x = k.cuda()
    sf = x.abs().float().amax(dim=3, keepdim=True).clamp(1e-4) / 448.0
    payload = (x * (1.0 / sf)).to(torch.float8_e4m3fn)
    nb = x.shape[0]
    helper = torch.cat(
        (payload.view(nb, -1).view(torch.uint8), sf.view(nb, -1).view(torch.uint8)), dim=1
    )
    assert same_bytes(cpu.view(nb, -1), helper) == 0


@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_quantize_k_cache_and_mla_rows_are_the_same_on_cpu_and_cuda(scale_fmt):
    kv = keys(NUM_KEYS // 2, 576, seed=3).view(-1, 64, 1, 576)
    assert same_bytes(oracle.quantize_k_cache(kv, scale_fmt),
                      oracle.quantize_k_cache(kv.cuda(), scale_fmt)) == 0
    c, k_pe = keys(NUM_KEYS // 4, 512, seed=4, dtype=torch.float32), keys(NUM_KEYS // 4, 64, seed=5)
    assert same_bytes(mla_kv_quantize(c, k_pe, scale_fmt),
                      mla_kv_quantize(c.cuda(), k_pe.cuda(), scale_fmt)) == 0
