"""Ahead-of-time sm_90 compiles of the Gluon kernels, for offline checks without a GPU.

Each Gluon module's ``compile_sm90`` names its kernel's argument types and constexprs and hands
them here; the result's ``.asm["ptx"]`` feeds ``ptxas -v`` (registers, spills) and its
``.metadata.shared`` the shared-memory budget. Must run without ``TRITON_INTERPRET`` (the
interpreter replaces ``gl`` builtins).
"""

from __future__ import annotations

__all__ = ["compile_gluon_sm90"]


def compile_gluon_sm90(kernel, sig: dict[str, str], consts: dict, aligned: list[str],
                       num_warps: int):
    """Triton's compiled ``kernel`` for sm_90: ``sig`` the runtime arguments' types in the
    kernel's order (``"*bf16"``, ``"i32"``, tensor descriptors…), ``consts`` the constexprs
    after them, ``aligned`` the arguments marked 16-divisible (as the JIT marks GLM-5.3's on the
    GPU). A ``sig`` + ``consts`` order that is not the kernel's is a RuntimeError."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = {**sig, **{n: "constexpr" for n in consts}}
    order = list(sig)
    if order != list(kernel.arg_names):
        raise RuntimeError(f"compile_sm90's signature {order} is not the kernel's "
                           f"{list(kernel.arg_names)}")
    src = GluonASTSource(kernel, sig, {(order.index(n),): v for n, v in consts.items()},
                         attrs={(order.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
