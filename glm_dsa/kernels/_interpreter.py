"""A fix for Triton's CPU interpreter (``TRITON_INTERPRET=1``), which CI runs the kernels in.

Triton ≤ 3.6's interpreter takes ``int()`` of one-element arrays, an error since numpy 2.4, so
every loop with a runtime bound fails (triton-lang/triton#9171). ``patch_for_numpy_2_4`` applies
upstream's fix to the interpreter; it changes nothing on the GPU, where the interpreter is off.
"""

from __future__ import annotations


def patch_for_numpy_2_4() -> None:
    """Make interpreted tensors index as ``int(data.reshape(-1)[0])``; idempotent."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_glm_dsa_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    setattr(patched, "_glm_dsa_patched", True)  # noqa: B010 — a mark on a function object
    interpreter._patch_lang_tensor = patched
