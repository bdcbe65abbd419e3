"""Fixes for Triton's CPU interpreter (``TRITON_INTERPRET=1``), which CI runs the kernels in.

Triton ≤ 3.6's interpreter takes ``int()`` of one-element arrays, an error since numpy 2.4, so
every loop with a runtime bound fails (triton-lang/triton#9171). ``patch_for_numpy_2_4`` applies
upstream's fix to the interpreter.

The interpreter also patches ``triton.language`` again at every call of a ``@triton.jit`` helper
from inside a kernel (``inspect.getmembers`` over the language modules, about 1 ms a call), a
third of the interpreted time of a small prefill. The kernel's own launch has already patched
those modules, and the patches a helper would add are the same objects the launch set (a patched
builtin is no longer a builtin, so it is not wrapped twice): ``skip_nested_lang_patches`` lets a
helper whose language modules the running launch has patched go straight to its body. A helper
that sees a module the launch did not patch (``triton.language.core`` by another name) patches
it, and the launch restores it at its end (upstream leaves a helper's patches in place).

``cache_np_dtypes`` keeps the numpy dtype of each Triton type once looked up: the interpreter
builds its 19-entry table at every lookup (86,000 a small prefill, 5 % of its time).

None changes anything on the GPU, where the interpreter is off.
"""

from __future__ import annotations

import inspect


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


class _Launch:
    """The scope a kernel launch's ``_patch_lang`` returned, with the language modules patched
    so far (ids) and the scopes of the helper calls that patched more: restoring it restores
    theirs first, then its own, and takes it off ``running``."""

    def __init__(self, scope, modules: set[int], running: list[_Launch]) -> None:
        self._scope, self.modules, self._running = scope, set(modules), running
        self.nested: list = []  # the helpers' scopes, restored last-in first-out

    def __getattr__(self, name):
        return getattr(self._scope, name)

    def restore(self) -> None:
        self._running.clear()
        while self.nested:
            self.nested.pop().restore()
        self._scope.restore()


def skip_nested_lang_patches() -> None:
    """Patch the language once a launch, not once a helper call (module docstring); idempotent.
    Left alone on a Triton whose interpreter lacks the functions it wraps."""
    try:
        from triton import language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_patch_lang", None)
    launch_cls = getattr(interpreter, "GridExecutor", None)
    if original is None or launch_cls is None or getattr(original, "_glm_dsa_patched", False):
        return
    langs = (tl, tl.core)
    running: list[_Launch] = []  # the running launch's scope; empty outside a launch
    known: dict[object, set[int]] = {}  # a function's language modules, as ids

    def patch_lang(fn):
        want = known.get(fn)
        if want is None:
            want = known[fn] = {id(v) for v in fn.__globals__.values()
                                if inspect.ismodule(v) and v in langs}
        if running and want <= running[0].modules:
            return _Nothing
        scope = original(fn)
        if inspect.currentframe().f_back.f_code is launch_cls.__call__.__code__:
            running[:] = [_Launch(scope, want, running)]
            return running[0]
        if running:
            # Upstream drops a helper's scope (its patches outlive the launch): the launch's
            # restore takes it instead.
            running[0].modules |= want
            running[0].nested.append(scope)
        return scope

    setattr(patch_lang, "_glm_dsa_patched", True)  # noqa: B010 — a mark on a function object
    interpreter._patch_lang = patch_lang


class _Nothing:
    """The scope of a helper call that patched nothing."""

    @staticmethod
    def restore() -> None:
        pass


def cache_np_dtypes() -> None:
    """Look each Triton type's numpy dtype up once (module docstring); idempotent. Left alone on
    a Triton whose interpreter has no ``_get_np_dtype``."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None or getattr(original, "_glm_dsa_patched", False):
        return
    from triton import language as tl

    seen: dict[object, object] = {}

    def get_np_dtype(tt_dtype):
        # A block's storage type is its element's (block types are not hashable).
        element = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return seen[element]
        except KeyError:
            seen[element] = found = original(element)
            return found
        except TypeError:  # not hashable: as upstream
            return original(element)

    setattr(get_np_dtype, "_glm_dsa_patched", True)  # noqa: B010 — a mark on a function object
    interpreter._get_np_dtype = get_np_dtype
