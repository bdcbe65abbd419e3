"""The MoE's Triton passes (glm_dsa.kernels.swiglu, moe_combine) against the torch functions
they replace (glm_dsa.moe.swiglu, combine_experts) and a float64 SwiGLU.

On the CPU the kernels run in Triton's interpreter (tests/conftest.py); the ``cuda`` tests run
them at GLM-5.3's widths, where the combine must be bitwise the torch form.
"""

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from glm_dsa import moe  # noqa: E402
from glm_dsa.kernels.moe_combine import combine_experts  # noqa: E402
from glm_dsa.kernels.swiglu import swiglu  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Half an ulp of the output dtype (one rounding) above float32's own error (exp, division and
# product: a few float32 ulps, the whole bound for a float32 output).
ULP = {torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11, torch.float32: 2.0**-20}


def _torch_swiglu(gate, up, dtype):
    return (torch.nn.functional.silu(gate.float()) * up.float()).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, width", [(1, 8), (7, 1000), (33, 2048)])
def test_swiglu_is_silu_times_up_rounded_once(dtype, rows, width):
    g = torch.Generator().manual_seed(rows + width)
    gate_up = (torch.randn(rows, 2 * width, generator=g) * 6).to(dtype).to(DEV)
    gate, up = gate_up.chunk(2, dim=-1)  # column halves: strided views, as the MoE passes them
    out = swiglu(gate, up, dtype)
    assert out.dtype == dtype and out.shape == (rows, width)
    gd, ud = gate.double().cpu().numpy(), up.double().cpu().numpy()
    exact = gd / (1.0 + np.exp(-gd)) * ud
    err = np.abs(out.double().cpu().numpy() - exact)
    # Rounded to nearest: within half an ulp of the exact value plus float32's error, or of the
    # subnormal spacing (fp16's results below 6e-5 are subnormal).
    spacing = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
    assert (err <= ULP[dtype] * np.abs(exact) + spacing).all()
    # And the torch form it replaces agrees but for last-bit differences of the float32 exp
    # (numpy's in the interpreter, libdevice's on CUDA), which a narrow output rarely shows.
    ref = _torch_swiglu(gate, up, dtype)
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=2.0**-20, atol=0.0)
    else:
        assert (out != ref).float().mean() <= 0.01


def test_swiglu_rounds_to_nearest_even_into_bf16():
    # Near 1 bf16 steps by 2^-7. 1 + 2^-8 is a tie: nearest-even gives 1; 1 + 3 * 2^-9 must round
    # up to 1 + 2^-7, where truncation (the interpreter's own cast) would give 1.
    up = torch.tensor([[1 + 2.0**-8, 1 + 3 * 2.0**-9, -(1 + 3 * 2.0**-9)]], device=DEV)
    gate = torch.full_like(up, 64.0)  # silu(64) = 64 / (1 + 1.6e-28): exactly 64 in float32
    out = swiglu(gate, up, torch.bfloat16).float().cpu() / 64
    assert out.tolist() == [[1.0, 1 + 2.0**-7, -(1 + 2.0**-7)]]


def test_swiglu_rejects_bad_input():
    x = torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="one shape"):
        swiglu(x, x[:, :4], torch.float32)
    with pytest.raises(ValueError, match="must be one of"):
        swiglu(x.double(), x.double(), torch.float64)
    with pytest.raises(ValueError, match="unit column strides"):
        swiglu(x.t(), x.t(), torch.float32)


def _combine_case(n, top_k, hidden, dtype, seed, masked, with_shared):
    g = torch.Generator().manual_seed(seed)
    pairs = n * top_k
    expert_out = torch.randn(pairs + 3, hidden, generator=g).to(dtype)
    position = torch.randperm(pairs, generator=g).view(n, top_k).sort(dim=1).values
    weights = torch.rand(n, top_k, generator=g)
    shared = torch.randn(n, hidden, generator=g).to(dtype) if with_shared else None
    row_mask = None
    if masked:
        row_mask = torch.rand(n, generator=g) < 0.6
        # A masked row's pairs were never computed: give them NaN rows the combine must not read.
        position[~row_mask] = torch.arange(pairs, pairs + top_k).clamp_max(pairs + 2)
        expert_out[pairs:] = float("nan")
    to = lambda t: None if t is None else t.to(DEV)  # noqa: E731
    return tuple(map(to, (expert_out, position, weights, shared, row_mask)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked, with_shared", [(False, True), (True, True), (True, False)])
def test_combine_is_bitwise_the_torch_combine(dtype, masked, with_shared):
    for seed, (n, top_k, hidden) in enumerate([(1, 1, 8), (5, 8, 1030), (17, 4, 96)]):
        args = _combine_case(n, top_k, hidden, dtype, seed, masked, with_shared)
        out = torch.empty(n, hidden, dtype=dtype, device=DEV)
        got = combine_experts(*args, out)
        assert got is out
        # The torch form (on the CPU: glm_dsa.moe dispatches CUDA tensors to this kernel).
        want = moe.combine_experts(*(None if t is None else t.cpu() for t in args))
        assert torch.equal(got.cpu(), want), (seed, n, top_k, hidden)
        if masked:
            assert not got[~args[4]].any()


def test_combine_rejects_bad_input():
    expert_out, position, weights, shared, _ = _combine_case(3, 2, 16, torch.float32, 0, False, True)
    out = torch.empty(3, 16, device=DEV)
    with pytest.raises(ValueError, match="float32"):
        combine_experts(expert_out, position, weights.double(), shared, None, out)
    with pytest.raises(ValueError, match="one dtype"):
        combine_experts(expert_out.bfloat16(), position, weights, shared, None, out)
    with pytest.raises(ValueError, match="unit column stride"):
        combine_experts(expert_out, position, weights, shared, None, torch.empty(16, 3, device=DEV).t())


@pytest.mark.cuda
def test_cuda_combine_at_glm_width_is_bitwise_the_torch_combine():
    args = _combine_case(300, 8, 6144, torch.bfloat16, 0, True, True)
    got = combine_experts(*args, torch.empty(300, 6144, dtype=torch.bfloat16, device="cuda"))
    expert_out, position, weights, shared, row_mask = args
    acc = torch.zeros(300, 6144, device="cuda")
    for j in range(8):
        acc += expert_out[position[:, j]].float() * weights[:, j, None]
    acc += shared.float()
    acc.masked_fill_(~row_mask[:, None], 0.0)
    assert torch.equal(got, acc.bfloat16())


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_rows_is_index_select(dtype):
    from glm_dsa.kernels.gather_rows import gather_rows

    g = torch.Generator().manual_seed(0)
    x = torch.randn(11, 2100, generator=g).to(dtype).to(DEV)
    rows = torch.randint(0, 11, (29,), generator=g).to(DEV)
    assert torch.equal(gather_rows(x, rows), x.index_select(0, rows))
    assert torch.equal(gather_rows(x[:, :1000], rows), x[:, :1000].index_select(0, rows))  # strided rows
    assert gather_rows(x, rows[:0]).shape == (0, 2100)
    with pytest.raises(ValueError, match="int64"):
        gather_rows(x, rows.int())
