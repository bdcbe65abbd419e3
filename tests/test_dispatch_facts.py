"""The host-side decisions of the GPU path, driven on the CPU with fake device facts.

The Gluon sparse MLA dispatch (``kernels.sparse_mla``: ``device_refusal``, ``shape_refusal``,
``call_refusal`` of a frozen ``DeviceFacts`` / ``GluonCall``), the Triton kernel's compile-time
flags (``launch_flags``), the fused passes' predicates (``fused.TritonOnCuda``) and the
grouped-GEMM rule (``moe.fused_grouped_mm_on``): each rule tried one step inside and one step
outside every edge, with the facts an H200 (sm_90, triton 3.6.0) and other GPUs would report.
"""

import dataclasses

import pytest
import torch

triton = pytest.importorskip("triton")

from glm_dsa import fused, moe  # noqa: E402
from glm_dsa.kernels import sparse_mla  # noqa: E402
from glm_dsa.kernels.sparse_mla import (  # noqa: E402
    GLUON_TESTED_TRITON,
    DeviceFacts,
    GluonCall,
    call_refusal,
    device_refusal,
    launch_flags,
    rows_refusal,
    shape_refusal,
)

TESTED = GLUON_TESTED_TRITON[0]
H200 = DeviceFacts(interpret=False, device_type="cuda", capability=(9, 0), triton_version=TESTED)
# GLM-5.3's call: bf16 queries [s_q, 64, 576] and bf16 rows of 576, 16-aligned.
GLM_CALL = GluonCall(q_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, fp8=False, h_q=64, d_qk=576,
                     d_v=512, strides=(64 * 576, 576, 576), data_ptrs=(1 << 20, 1 << 21))


def test_the_h200_takes_the_gluon_kernel_at_glm_shapes():
    assert device_refusal(H200) is None
    assert shape_refusal(torch.bfloat16, 64, 576, 512) is None
    assert call_refusal(H200, GLM_CALL) is None
    fp8_rows = dataclasses.replace(GLM_CALL, kv_dtype=torch.uint8, fp8=True, strides=(64 * 576, 576, 656))
    assert call_refusal(H200, fp8_rows) is None


@pytest.mark.parametrize("change, reason", [
    ({"interpret": True}, "the CPU interpreter"),
    ({"device_type": "cpu", "capability": (0, 0)}, "device cpu"),
    ({"capability": (8, 9)}, "sm_89"),
    ({"capability": (9, 1)}, "sm_91"),
    ({"capability": (10, 0)}, "sm_100"),
    ({"triton_version": "3.5.1"}, "triton 3.5.1"),
    ({"triton_version": TESTED + ".post1"}, f"triton {TESTED}.post1"),
])
def test_device_refusals_name_what_is_missing(change, reason):
    facts = dataclasses.replace(H200, **change)
    why = device_refusal(facts)
    assert why is not None and why.startswith(reason), why
    # The call's rule reports the device's reason first.
    assert call_refusal(facts, GLM_CALL) == why
    assert call_refusal(facts, dataclasses.replace(GLM_CALL, h_q=16, kv_dtype=torch.float32)) == why


def test_the_interpreter_is_refused_even_on_an_sm90_device():
    assert device_refusal(dataclasses.replace(H200, interpret=True)) == "the CPU interpreter"


@pytest.mark.parametrize("dtype, h_q, d_qk, d_v, ok", [
    (torch.bfloat16, 64, 576, 512, True),
    (torch.bfloat16, 128, 576, 512, True),
    (torch.bfloat16, 192, 576, 512, True),
    (torch.bfloat16, 63, 576, 512, False),
    (torch.bfloat16, 65, 576, 512, False),
    (torch.bfloat16, 32, 576, 512, False),
    (torch.bfloat16, 16, 576, 512, False),
    (torch.bfloat16, 64, 575, 512, False),
    (torch.bfloat16, 64, 577, 512, False),
    (torch.bfloat16, 64, 576, 511, False),
    (torch.bfloat16, 64, 576, 513, False),
    (torch.float16, 64, 576, 512, False),
    (torch.float32, 64, 576, 512, False),
])
def test_shape_refusal_edges(dtype, h_q, d_qk, d_v, ok):
    why = shape_refusal(dtype, h_q, d_qk, d_v)
    call = dataclasses.replace(GLM_CALL, q_dtype=dtype, h_q=h_q, d_qk=d_qk, d_v=d_v)
    assert call_refusal(H200, call) == why
    assert (why is None) == ok, why
    if not ok and dtype == torch.bfloat16:
        assert why == f"h_q {h_q}, d_qk {d_qk}, d_v {d_v} (the Gluon kernel: h_q % 64 == 0, 576 / 512)"
    if dtype != torch.bfloat16:
        assert why == f"{dtype} activations (the Gluon kernel is bf16)"


@pytest.mark.parametrize("change, ok", [
    ({"kv_dtype": torch.float32}, False),
    ({"kv_dtype": torch.float16}, False),
    ({"kv_dtype": torch.uint8, "fp8": True}, True),
    ({"kv_dtype": torch.uint8, "fp8": False}, False),
    ({"strides": (64 * 576 + 8, 576, 576)}, False),
    ({"strides": (64 * 576, 584, 576)}, False),
    ({"strides": (64 * 576, 576, 568)}, False),
    ({"strides": (64 * 576, 576, 584)}, False),
    ({"strides": (64 * 576 + 16, 592, 592)}, True),
    ({"strides": (64 * 576, 576, 1)}, False),
    ({"data_ptrs": (16, 32)}, True),
    ({"data_ptrs": (8, 32)}, False),
    ({"data_ptrs": (16, 24)}, False),
    ({"data_ptrs": (2, 16)}, False),
    ({"h_q": 16}, False),
    ({"h_q": 16, "kv_dtype": torch.float32}, False),
])
def test_call_refusal_edges(change, ok):
    call = dataclasses.replace(GLM_CALL, **change)
    why = call_refusal(H200, call)
    assert (why is None) == ok, why
    if "h_q" in change:  # the shape's reason comes before the rows'
        assert why.startswith("h_q 16"), why
    else:
        assert rows_refusal(call) == why
    if "strides" in change or "data_ptrs" in change:
        assert ok or why.endswith("or base pointers not 16-aligned"), why
    if change.get("kv_dtype") in (torch.float32, torch.float16) and "h_q" not in change:
        assert why == f"{change['kv_dtype']} rows (the Gluon kernel is bf16)"


def test_call_facts_come_from_the_tensors():
    q = torch.zeros(3, 64, 576, dtype=torch.bfloat16)[:, :, :]
    rows = torch.zeros(10, 656, dtype=torch.uint8)
    call = GluonCall.of(q.transpose(0, 1).contiguous().transpose(0, 1), rows, 656, 512, True)
    assert call.strides == (576, 3 * 576, 656) and call.h_q == 64 and call.d_qk == 576
    assert call.q_dtype == torch.bfloat16 and call.kv_dtype == torch.uint8 and call.fp8
    assert call.d_v == 512 and call.data_ptrs[1] == rows.data_ptr()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's facts")
def test_the_cpus_facts_and_every_public_rule_on_them():
    facts = DeviceFacts.of(torch.device("cpu"))
    assert facts == DeviceFacts(True, "cpu", (0, 0), triton.__version__)
    assert sparse_mla.gluon_unavailable(torch.device("cpu")) == "the CPU interpreter"
    assert sparse_mla.gluon_unsuitable(torch.device("cpu"), torch.bfloat16, 64, 576, 512) == \
        "the CPU interpreter"
    q = torch.zeros(1, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(4, 576, dtype=torch.bfloat16)
    assert sparse_mla._gluon_unsuitable(q, kv, 576, None, 512, False) == "the CPU interpreter"
    assert sparse_mla._gluon_unsuitable(q.float(), kv, 576, None, 512, False) == "the CPU interpreter"
    with pytest.raises(dataclasses.FrozenInstanceError):
        facts.interpret = False  # type: ignore[misc]


@pytest.mark.parametrize("row_bytes, prefetch", [(656, True), (1152, True), (16, True),
                                                 (164, False), (8, False), (648, False), (24, False)])
def test_launch_flags_prefetch_only_16_byte_rows_on_the_gpu(row_bytes, prefetch):
    gpu = launch_flags(False, torch.bfloat16, 2048, 64, row_bytes)
    assert gpu["PREFETCH"] is prefetch and gpu["ROW_BYTES"] == row_bytes
    assert launch_flags(True, torch.bfloat16, 2048, 64, row_bytes)["PREFETCH"] is False
    # cp.async.bulk.prefetch is sm_90's: never on an sm_80 or sm_89 GPU.
    for capability in ((8, 0), (8, 9)):
        assert launch_flags(False, torch.bfloat16, 2048, 64, row_bytes, capability)["PREFETCH"] is False


def test_launch_flags_by_place_and_dtype():
    tl = triton.language
    gpu_bf16 = launch_flags(False, torch.bfloat16, 2048, 64, 1152)
    assert gpu_bf16["DOT_DTYPE"] == tl.bfloat16 and gpu_bf16["PRECISION"] == "tf32"
    assert gpu_bf16["STATIC_TOPK"] == 0
    gpu_f32 = launch_flags(False, torch.float32, 2048, 64, 2304)
    assert gpu_f32["DOT_DTYPE"] == tl.float32 and gpu_f32["PRECISION"] == "ieee"
    cpu_bf16 = launch_flags(True, torch.bfloat16, 37, 64, 1152)
    assert cpu_bf16["DOT_DTYPE"] == tl.float32 and cpu_bf16["PRECISION"] == "tf32"
    assert cpu_bf16["STATIC_TOPK"] == 37


@pytest.mark.parametrize("d_tail, block", [(64, 64), (65, 128), (63, 64), (16, 16), (17, 32),
                                           (15, 16), (1, 16), (0, 16)])
def test_launch_flags_tail_block_is_a_power_of_two_of_at_least_16(d_tail, block):
    assert launch_flags(False, torch.bfloat16, 8, d_tail, 16)["BLOCK_DT"] == block


@pytest.mark.parametrize("h_q, block_h", [(1, 16), (16, 16), (17, 64), (64, 64), (128, 64)])
def test_sparse_mla_configs_pruned_by_head_count(h_q, block_h):
    kept = sparse_mla._prune_configs(sparse_mla._GPU_CONFIGS, {"h_q": h_q})
    assert kept and all(c.kwargs["BLOCK_H"] == block_h for c in kept)
    assert len(kept) == sum(c.kwargs["BLOCK_H"] == block_h for c in sparse_mla._GPU_CONFIGS)
    # A table without the wanted head block keeps what it has.
    only = [c for c in sparse_mla._GPU_CONFIGS if c.kwargs["BLOCK_H"] != block_h]
    assert sparse_mla._prune_configs(only, {"h_q": h_q}) == only


@pytest.mark.parametrize("cap, dtype, ok", [
    ((9, 0), torch.bfloat16, True), ((10, 0), torch.bfloat16, True), ((10, 3), torch.bfloat16, True),
    ((8, 9), torch.bfloat16, False), ((11, 0), torch.bfloat16, False), ((12, 0), torch.bfloat16, False),
    ((9, 0), torch.float16, False), ((9, 0), torch.float32, False),
])
def test_fused_grouped_mm_rule(cap, dtype, ok):
    assert moe.fused_grouped_mm_on(cap, dtype) is ok


def test_fused_grouped_mm_is_off_the_gpu():
    assert moe.fused_grouped_mm(torch.device("cpu"), torch.bfloat16) is False


# ----------------------------------------------------------------------- the fused passes' rules
CPU_PASSES = fused.TritonOnCuda("cpu")


def _t(shape, dtype=torch.bfloat16, device="cpu"):
    return torch.zeros(shape, dtype=dtype, device=device)


def test_the_default_passes_take_cuda_tensors_only():
    assert fused.TRITON_ON_CUDA.device_type == "cuda"
    x = _t((4, 8))
    assert not fused.TRITON_ON_CUDA.on_device(x)
    assert not fused.TRITON_ON_CUDA.takes_swiglu(x, x, torch.bfloat16)
    assert not fused.TRITON_ON_CUDA.takes_combine(x, _t((4, 2), torch.float32))
    assert not fused.TRITON_ON_CUDA.takes_index_rows(x)
    assert fused.TRITON_ON_CUDA.swiglu(x, x, torch.bfloat16) is None
    assert fused.TRITON_ON_CUDA.gather_rows(x, torch.zeros(2, dtype=torch.int64)) is None
    assert fused.TRITON_ON_CUDA.index_quant(x, lambda: (x, x), 64, True, None) is None
    assert fused.TRITON_ON_CUDA.index_quant_store(x, lambda: (x, x), 64, True, None, x, x, 64) is False
    assert fused.TRITON_ON_CUDA.moe_single_pass(torch.device("cpu"), torch.bfloat16) is False
    assert fused.TRITON_ON_CUDA.moe_single_pass(torch.device("cuda"), torch.bfloat16) is True


@pytest.mark.parametrize("dtype, ok", [(torch.bfloat16, True), (torch.float16, True),
                                       (torch.float32, True), (torch.float64, False)])
def test_moe_single_pass_by_dtype(dtype, ok):
    assert CPU_PASSES.moe_single_pass(torch.device("cpu"), dtype) is ok
    assert fused.TRITON_ON_CUDA.moe_single_pass(torch.device("cuda"), dtype) is ok
    assert fused.TORCH.moe_single_pass(torch.device("cuda"), dtype) is False


def test_swiglu_rule_edges():
    gu = _t((4, 16))
    gate, up = gu[:, :8], gu[:, 8:]  # column halves of one GEMM output: unit column strides
    assert CPU_PASSES.takes_swiglu(gate, up, torch.bfloat16)
    assert CPU_PASSES.takes_swiglu(gate, up, torch.float32)
    assert not CPU_PASSES.takes_swiglu(gate, up, torch.float64)
    g64 = gate.double()
    assert not CPU_PASSES.takes_swiglu(g64, g64, torch.bfloat16)
    t = _t((8, 4)).T  # column stride 4
    assert not CPU_PASSES.takes_swiglu(t, gate, torch.bfloat16)
    assert not CPU_PASSES.takes_swiglu(gate, t, torch.bfloat16)


def test_combine_rule_edges():
    out = _t((4, 8))
    assert CPU_PASSES.takes_combine(out, _t((4, 2), torch.float32))
    assert not CPU_PASSES.takes_combine(out, _t((4, 2), torch.float64))
    assert not CPU_PASSES.takes_combine(out, _t((4, 2), torch.bfloat16))
    assert not CPU_PASSES.takes_combine(out.double(), _t((4, 2), torch.float32))
    assert CPU_PASSES.takes_combine(out.half(), _t((4, 2), torch.float32))


def test_index_rows_rule_edges():
    x = _t((4, 128))
    assert CPU_PASSES.takes_index_rows(x)
    assert CPU_PASSES.takes_index_rows(x.half()) and CPU_PASSES.takes_index_rows(x.float())
    assert not CPU_PASSES.takes_index_rows(x.double())
    assert not CPU_PASSES.takes_index_rows(_t((128, 4)).T)
    assert not CPU_PASSES.takes_index_rows(_t((4, 256))[:, :128])
    assert not CPU_PASSES.takes_index_rows(_t((4, 128), torch.float8_e4m3fn))


# ----------------------------------------------------------------------- on the H200 (cuda)
@pytest.mark.cuda
def test_the_gpus_facts_feed_the_same_rules():
    """On a CUDA device: ``DeviceFacts.of`` reads the capability and Triton's version, and the
    tensor-level dispatch is the pure rules on those facts (Gluon at GLM-5.3's shape on an
    sm_90 GPU with a tested Triton, the Triton kernel otherwise)."""
    dev = torch.device("cuda")
    facts = DeviceFacts.of(dev)
    assert facts == DeviceFacts(False, "cuda", tuple(torch.cuda.get_device_capability(dev)),
                                triton.__version__)
    q = torch.zeros(2, 64, 576, dtype=torch.bfloat16, device=dev)
    kv = torch.zeros(100, 576, dtype=torch.bfloat16, device=dev)
    rows = torch.zeros(100, 656, dtype=torch.uint8, device=dev)
    for query, pool, stride, fp8 in ((q, kv, 576, False), (q, rows, 656, True), (q[:, :16], kv, 576, False),
                                     (q.float(), kv.float(), 576, False), (q, kv[:, 1:], 576, False)):
        want = call_refusal(facts, GluonCall.of(query, pool, stride, 512, fp8))
        assert sparse_mla._gluon_unsuitable(query, pool, stride, None, 512, fp8) == want
    on_h200 = facts.capability == (9, 0) and facts.triton_version in GLUON_TESTED_TRITON
    assert (sparse_mla.gluon_unsuitable(dev, torch.bfloat16, 64, 576, 512) is None) == on_h200
    assert moe.fused_grouped_mm(dev, torch.bfloat16) == moe.fused_grouped_mm_on(facts.capability, torch.bfloat16)
