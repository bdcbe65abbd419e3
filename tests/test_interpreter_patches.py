"""``glm_dsa.kernels._interpreter``: the interpreter's language patches, once a launch."""

import os

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton.runtime import interpreter  # noqa: E402

import glm_dsa.kernels  # noqa: E402, F401 — applies the patches under the interpreter
from interpreter_core_helper import clamp_low  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="needs Triton's interpreter (TRITON_INTERPRET=1)")

@triton.jit
def _twice(x):
    return x + x


@triton.jit
def _nested_kernel(x_ptr, out_ptr, N: tl.constexpr, CALLS: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    for _ in tl.static_range(CALLS):
        x = _twice(x) * 0.5
    tl.store(out_ptr + offs, _twice(x))


def test_helpers_compute_as_written_and_the_language_is_restored_after_the_launch():
    x = torch.linspace(-1, 1, 16)
    out = torch.empty_like(x)
    _nested_kernel[(1,)](x, out, N=16, CALLS=3)
    torch.testing.assert_close(out, 2 * x, rtol=0, atol=0)
    assert tl.core.is_builtin(tl.core.add) and tl.core.is_builtin(tl.where)
    assert tl.core.is_builtin(tl.tensor.__add__)


def test_a_launch_patches_the_language_once_whatever_its_helper_calls(monkeypatch):
    calls = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin",
                        lambda *a, **k: (calls.append(1), original(*a, **k))[1])
    x, out = torch.ones(16), torch.empty(16)
    counts = []
    for helper_calls in (1, 12):
        calls.clear()
        _nested_kernel[(1,)](x, out, N=16, CALLS=helper_calls)
        counts.append(len(calls))
    assert counts[0] == counts[1] > 0, counts


@triton.jit
def _core_only_kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, clamp_low(tl.load(x_ptr + offs)))


def test_a_helper_seeing_a_module_the_launch_did_not_patch_still_patches_it():
    """``clamp_low``'s module sees the language as ``triton.language.core`` only."""
    x = torch.linspace(0, 1, 16)
    for _ in range(2):  # the second launch patches that module again
        out = torch.zeros_like(x)
        _core_only_kernel[(2,)](x, out, N=16)
        torch.testing.assert_close(out, x.clamp(min=0.5), rtol=0, atol=0)
        assert tl.core.is_builtin(tl.core.where)


def test_the_cached_numpy_dtypes_are_the_storage_types():
    import numpy as np

    lookup = interpreter._get_np_dtype
    assert getattr(lookup, "_glm_dsa_patched", False)
    want = [(tl.float32, np.float32), (tl.bfloat16, np.uint16), (tl.float8e4nv, np.uint8),
            (tl.int1, np.bool_), (tl.block_type(tl.int64, [4, 8]), np.int64),
            (tl.block_type(tl.float32, [2]), np.float32),
            (tl.block_type(tl.pointer_type(tl.float32), [2]), np.uint64),
            (tl.pointer_type(tl.float32), np.uint64), (tl.pointer_type(tl.int8), np.uint64)]
    for _ in range(2):  # looked up, then from the cache
        for tt, np_type in want:
            assert lookup(tt) == np.dtype(np_type), tt
