"""The model's small fused passes, behind one dispatch point: the indexer's RoPE + Hadamard +
FP8 quantization (and its index-K page write), and the MoE's SwiGLU, weighted combine and
row gather.

The model calls these functions unconditionally, as DeepSeek-V3.2's model calls ``kernel.py``.
Each returns the fast form's result, or None (False for the page write) where the active
``Passes`` do not take the call; the model then runs its torch form, the definition, kept in
``indexer.py`` and ``moe.py``. A fast form is bitwise that torch form or within its rounding
(each kernel's docstring says which).

The active passes are a backend's choice (``glm_dsa.backend.Backend.passes``): ``DecoderLayer``
runs each half of a layer ``using`` its step backend's passes. Outside a step (a module called
directly) they are ``TRITON_ON_CUDA``, what every built-in backend chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

__all__ = ["Passes", "TritonOnCuda", "TORCH", "TRITON_ON_CUDA", "using", "active", "moe_single_pass",
           "swiglu", "combine_experts", "gather_rows", "index_quant", "index_quant_store"]

# The dtypes the MoE's fused passes take (those of F.grouped_mm).
_MOE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_INDEX_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Passes:
    """No fast pass: every call runs the model's torch form. A backend with fast passes
    subclasses this and overrides the passes it has; the argument contracts are those of the
    module functions below."""

    def moe_single_pass(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether the MoE's SwiGLU and combine of ``dtype`` rows on ``device`` run as single
        passes (their temporaries are smaller: ``glm_dsa.budget.moe_rows(fused=)``)."""
        return False

    def swiglu(self, gate: Tensor, up: Tensor, dtype: torch.dtype) -> Tensor | None:
        return None

    def combine_experts(self, expert_out: Tensor, position: Tensor, weights: Tensor,
                        shared: Tensor | None, row_mask: Tensor | None, out: Tensor) -> Tensor | None:
        return None

    def gather_rows(self, x: Tensor, rows: Tensor) -> Tensor | None:
        return None

    def index_quant(self, x: Tensor, cos_sin: Callable[[], tuple[Tensor, Tensor]], rope_dim: int,
                    interleaved: bool, scale_fmt: str | None) -> tuple[Tensor, Tensor] | None:
        return None

    def index_quant_store(self, x: Tensor, cos_sin: Callable[[], tuple[Tensor, Tensor]],
                          rope_dim: int, interleaved: bool, scale_fmt: str | None, pages: Tensor,
                          slots: Tensor, page_size: int) -> bool:
        return False


class TritonOnCuda(Passes):
    """The Triton kernels of ``glm_dsa.kernels`` (``swiglu``, ``moe_combine``, ``gather_rows``,
    ``index_quant``) for CUDA tensors of the dtypes and layouts they take; the torch forms
    elsewhere (the CPU, float64).

    ``device_type``: the device whose tensors the kernels take (``"cuda"``; a test passes
    ``"cpu"`` to run the same decisions and kernels in Triton's interpreter). Every choice is a
    pure predicate below (``takes_swiglu`` …) on tensors' devices, dtypes and strides.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type

    def on_device(self, t: Tensor) -> bool:
        """``t`` lives on the kernels' device type."""
        return t.device.type == self.device_type

    def moe_single_pass(self, device: torch.device, dtype: torch.dtype) -> bool:
        return torch.device(device).type == self.device_type and dtype in _MOE_DTYPES

    def takes_swiglu(self, gate: Tensor, up: Tensor, dtype: torch.dtype) -> bool:
        """The SwiGLU kernel takes ``gate`` / ``up`` rows of a MoE dtype with unit column
        strides, to a MoE dtype."""
        return (self.on_device(gate) and gate.dtype in _MOE_DTYPES and dtype in _MOE_DTYPES
                and gate.stride(-1) == up.stride(-1) == 1)

    def takes_combine(self, expert_out: Tensor, weights: Tensor) -> bool:
        """The combine kernel takes MoE-dtype expert rows with float32 weights."""
        return (self.on_device(expert_out) and expert_out.dtype in _MOE_DTYPES
                and weights.dtype == torch.float32)

    def takes_index_rows(self, x: Tensor) -> bool:
        """The index-quant kernel takes contiguous bf16 / fp16 / fp32 rows."""
        return self.on_device(x) and x.dtype in _INDEX_DTYPES and x.is_contiguous()

    def swiglu(self, gate: Tensor, up: Tensor, dtype: torch.dtype) -> Tensor | None:
        if not self.takes_swiglu(gate, up, dtype):
            return None
        from glm_dsa.kernels.swiglu import swiglu

        return swiglu(gate, up, dtype)

    def combine_experts(self, expert_out: Tensor, position: Tensor, weights: Tensor,
                        shared: Tensor | None, row_mask: Tensor | None, out: Tensor) -> Tensor | None:
        if not self.takes_combine(expert_out, weights):
            return None
        from glm_dsa.kernels.moe_combine import combine_experts

        return combine_experts(expert_out, position, weights, shared, row_mask, out)

    def gather_rows(self, x: Tensor, rows: Tensor) -> Tensor | None:
        if not self.on_device(x):
            return None
        from glm_dsa.kernels.gather_rows import gather_rows

        return gather_rows(x, rows)

    def index_quant(self, x: Tensor, cos_sin: Callable[[], tuple[Tensor, Tensor]], rope_dim: int,
                    interleaved: bool, scale_fmt: str | None) -> tuple[Tensor, Tensor] | None:
        if not self.takes_index_rows(x):
            return None
        from glm_dsa.kernels.index_quant import rope_hadamard_quant

        return rope_hadamard_quant(x, *cos_sin(), rope_dim, interleaved, scale_fmt)

    def index_quant_store(self, x: Tensor, cos_sin: Callable[[], tuple[Tensor, Tensor]],
                          rope_dim: int, interleaved: bool, scale_fmt: str | None, pages: Tensor,
                          slots: Tensor, page_size: int) -> bool:
        if not self.takes_index_rows(x):
            return False
        from glm_dsa.kernels.index_quant import rope_hadamard_quant_store

        rope_hadamard_quant_store(x, *cos_sin(), rope_dim, interleaved, scale_fmt, pages, slots,
                                  page_size)
        return True


TORCH = Passes()
TRITON_ON_CUDA = TritonOnCuda()
_ACTIVE: ContextVar[Passes] = ContextVar("glm_dsa.fused", default=TRITON_ON_CUDA)


@contextmanager
def using(passes: Passes) -> Iterator[None]:
    """Within the block, the model's fused passes are ``passes``'."""
    token = _ACTIVE.set(passes)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> Passes:
    """The passes the model calls now."""
    return _ACTIVE.get()


def moe_single_pass(device: torch.device, dtype: torch.dtype) -> bool:
    """``Passes.moe_single_pass`` of the active passes."""
    return _ACTIVE.get().moe_single_pass(device, dtype)


def swiglu(gate: Tensor, up: Tensor, dtype: torch.dtype) -> Tensor | None:
    """``glm_dsa.moe.swiglu`` (``gate, up: [m, I]`` → ``[m, I]`` in ``dtype``), or None."""
    return _ACTIVE.get().swiglu(gate, up, dtype)


def combine_experts(expert_out: Tensor, position: Tensor, weights: Tensor, shared: Tensor | None,
                    row_mask: Tensor | None, out: Tensor) -> Tensor | None:
    """``glm_dsa.moe.combine_experts`` written to ``out [n, H]``, or None."""
    return _ACTIVE.get().combine_experts(expert_out, position, weights, shared, row_mask, out)


def gather_rows(x: Tensor, rows: Tensor) -> Tensor | None:
    """``x.index_select(0, rows)`` (``x: [m, H]``, ``rows: [P]`` int64 → ``[P, H]``), or None."""
    return _ACTIVE.get().gather_rows(x, rows)


def index_quant(x: Tensor, cos_sin: Callable[[], tuple[Tensor, Tensor]], rope_dim: int,
                interleaved: bool, scale_fmt: str | None) -> tuple[Tensor, Tensor] | None:
    """The indexer's rows ``x: [n, D]`` or ``[n, H, D]`` RoPE'd, rotated and quantized
    (``(fp8 like x, float32 scale [..., 1])``), or None. ``cos_sin()``: the float32 RoPE tables
    ``[n, rope_dim / 2]``, computed only when a fast pass runs."""
    return _ACTIVE.get().index_quant(x, cos_sin, rope_dim, interleaved, scale_fmt)


def index_quant_store(x: Tensor, cos_sin: Callable[[], tuple[Tensor, Tensor]], rope_dim: int,
                      interleaved: bool, scale_fmt: str | None, pages: Tensor, slots: Tensor,
                      page_size: int) -> bool:
    """``index_quant`` of keys ``x: [n, D]`` written into index-K ``pages`` at ``slots``;
    False (nothing written) where no fast pass takes the call."""
    return _ACTIVE.get().index_quant_store(x, cos_sin, rope_dim, interleaved, scale_fmt, pages,
                                           slots, page_size)
