"""A Triton helper whose module sees the language only as ``triton.language.core`` (for
tests/test_interpreter_patches.py: a kernel module that imports ``tl`` has not patched it)."""

import triton
from triton.language import core


@triton.jit
def clamp_low(x):
    return core.where(x > 0.5, x, 0.5)
