"""How the harness calls the kernel under test, and how far from itself.

A kernel given as a callable runs in a worker thread of the harness's process with a per-call
timeout (``call_kernel``): one that raises, hangs, calls ``sys.exit`` or writes to an input
fails the case, but one that ends the process (``os._exit``, a segfault, ``abort``), forks it,
or holds the GIL in a C call past the timeout takes the harness down with it.

A kernel given by name, ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION`` (``load_kernel``
says how names resolve), runs in a process of its own (``KernelProcess``): ``glm-dsa check``
and ``glm-dsa compare --kernel`` always do this, and ``check_kernel`` / ``compare_kernel`` do it
when given the name as a string (a callable cannot be re-imported elsewhere: a closure, a
lambda, a function defined in a test). One child per kernel, started once and sent every case:
its module is imported there (within the timeout), each call's inputs go to it and its outputs
come back as tensors (``torch.save`` bytes over a pipe; loaded with ``weights_only``), inputs
are moved to the device and outputs back to the CPU in the child, and the harness judges them.
Whatever the kernel does, the harness survives to report it as the case's failure:

- its process ends (``os._exit``, a thread calling it, ``sys.exit`` at import): "the kernel
  process exited with status 0 before returning its outputs";
- a signal kills it (a segfault, ``abort``, SIGKILL): "… was killed by SIGSEGV …";
- it runs past the timeout, even in a C call holding the GIL (the harness waits in another
  process): the child is killed, "the kernel did not return within 30 s …"; its module's import
  likewise: "importing the kernel's module did not finish within 30 s …";
- it forks (``os.fork``, a fork-started pool): "the kernel forked its process …" (a copy that
  returns into the harness's code is ended there, never reporting; running programs through
  ``subprocess`` is not forking the kernel and is fine).

After a child dies or is killed, the next case starts a fresh one (so ``compare --kernel``
judges every golden case); a module that cannot be imported fails every case with that reason,
and one that raises at import (or names nothing callable) is a usage error (``ValueError``), as
in-process. Children are forked from a server process that imported torch and never touched
CUDA (``forkserver``, ``glm_dsa.testing.fork_server``; ``spawn`` where there is none), so CUDA
works in them: the child binds the device's context before each call, as the worker thread
does. Each child is in a process group of its own, which is killed when the harness is done
with it (a forked copy goes with it), and it dies with the harness however the harness ends
(the server dies with the harness, the child with the server: ``glm_dsa.processes``).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import inspect
import io
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import types
from typing import Any, Callable, Iterator, Mapping

import torch
from torch import Tensor

from glm_dsa.processes import die_with_parent

__all__ = ["DEFAULT_TIMEOUT_S", "KernelProcess", "InputsChanged", "call_kernel", "kernel_session",
           "load_kernel", "kernel_file", "to_device", "tensor_leaves", "one_line"]

DEFAULT_TIMEOUT_S = 600.0
# A child told to finish exits at once; one whose kernel left a thread running or an exit
# hook hanging is killed after this long.
_EXIT_WAIT_S = 5.0


# ----------------------------------------------------------------------------- naming a kernel
def _split(spec: str) -> tuple[str, str]:
    target, sep, attr = spec.rpartition(":")
    if not sep or not target or not attr:
        raise ValueError(f"kernel {spec!r} must be MODULE:FUNCTION or path/to/file.py:FUNCTION, "
                         f"e.g. glm_dsa.oracle:act_quant")
    return target, attr


def _is_path(target: str) -> bool:
    return target.endswith(".py") or os.sep in target or "/" in target


def _load_file(path: str, attr: str, spec: str):
    import importlib.util

    if not os.path.isfile(path):
        raise ValueError(f"kernel {spec!r}: {path} does not exist")
    name = os.path.splitext(os.path.basename(path))[0]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"kernel {spec!r}: {path} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules.setdefault(name, module)
    # Its siblings import as they would with the file's directory as the working directory.
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # any import-time failure of user code is a usage error
        raise ValueError(f"cannot import {path}: {type(e).__name__}: {e}") from None
    return _attr(module, attr, spec)


def _attr(obj, attr: str, spec: str):
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{spec.rpartition(':')[0]!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _search_path() -> list[str]:
    """``sys.path`` with the current directory first, as ``python -m`` has it (the ``glm-dsa``
    console script does not)."""
    cwd = os.getcwd()
    return sys.path if cwd in sys.path or "" in sys.path else [cwd, *sys.path]


def load_kernel(spec: str):
    """The callable ``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``, imported in this process.

    The module is imported by name (a missing dependency of it is named as such), with the
    current directory first on the search path (``python -m`` puts it there; the ``glm-dsa``
    console script does not).
    """
    target, attr = _split(spec)
    if _is_path(target):
        obj = _load_file(target, attr, spec)
    else:
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())
        # import_module, not pkgutil.resolve_name: that one turns a failed import of the module
        # (a dependency missing) into "module 'pkg' has no attribute 'mod'".
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError as e:
            missing = e.name or ""
            if missing and not (target == missing or target.startswith(missing + ".")):
                raise ValueError(f"cannot import {target!r}: it imports {missing!r}, which is not "
                                 f"installed ({e})") from None
            raise ValueError(
                f"cannot import {target!r}: {e} (searched the current directory {os.getcwd()} and "
                f"sys.path; name a file as path/to/{target.split('.')[-1]}.py:{attr})") from None
        except Exception as e:  # any import-time failure of user code is a usage error
            raise ValueError(f"cannot import {target!r}: {type(e).__name__}: {e}") from None
        obj = _attr(module, attr, spec)
    if not callable(obj):
        raise ValueError(f"{spec} is a {type(obj).__name__}, not a function")
    return obj


def kernel_file(spec: str) -> str | None:
    """The file ``spec``'s module would be read from, found without running any code (a
    package's ``__init__`` included); None when it is not a plain file on the search path. An
    output must not overwrite it: ``glm-dsa check`` refuses that before starting the kernel."""
    target, _ = _split(spec)
    if _is_path(target):
        return target
    path: list[str] | None = _search_path()
    found = None
    for part in target.split("."):
        name = part if found is None else f"{found.name}.{part}"
        found = importlib.machinery.PathFinder.find_spec(name, path) if path is not None else None
        if found is None:
            return None
        path = list(found.submodule_search_locations or []) or None
    return found.origin if found is not None and found.has_location else None


# ----------------------------------------------------------------------------- inputs
def to_device(x, device):
    """``x``'s tensors moved to ``device``, through tuples, lists and dicts."""
    if isinstance(x, Tensor):
        return x.to(device)
    if isinstance(x, (tuple, list)):
        return type(x)(to_device(v, device) for v in x)
    if isinstance(x, dict):
        return {k: to_device(v, device) for k, v in x.items()}
    return x


def tensor_leaves(x, path: str = "") -> list[tuple[str, Tensor]]:
    """``(path, tensor)`` of every tensor in ``x``, through tuples, lists (``path[i]``) and
    dicts (by key), in order."""
    if isinstance(x, Tensor):
        return [(path, x)]
    if isinstance(x, (tuple, list)):
        return [t for i, v in enumerate(x) for t in tensor_leaves(v, f"{path}[{i}]")]
    if isinstance(x, dict):
        return [t for k, v in x.items() for t in tensor_leaves(v, k)]
    return []


def _same_bytes(a: Tensor, b: Tensor) -> bool:
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.numel() == 0:
        return True
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))


def one_line(e: BaseException) -> str:
    """``Type: first line of the message``."""
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}".rstrip(": ")


class InputsChanged(RuntimeError):
    """The kernel changed input tensors in place; ``leaves``: their positions among the call's
    input tensors (positional arguments first, then keywords, each in order)."""

    def __init__(self, leaves: list[int], paths: list[str]):
        super().__init__(f"the kernel changed its input {paths[0]} in place (no contract allows it)")
        self.leaves = leaves


def _input_leaves(args: tuple, kwargs: dict) -> list[tuple[str, Tensor]]:
    """Every input tensor of a call, positional ones first (``args[i]…``), then keywords."""
    return [(f"args{p}", t) for p, t in tensor_leaves(list(args))] + tensor_leaves(kwargs)


def _watched(args: tuple, kwargs: dict, device) -> tuple[list[str], list[Tensor], list[Tensor]]:
    """Paths, tensors and copies of every input tensor (none on ``meta``: no bytes to compare)."""
    if torch.device(device).type == "meta":
        return [], [], []
    leaves = _input_leaves(args, kwargs)
    return [p for p, _ in leaves], [t for _, t in leaves], [t.clone() for _, t in leaves]


def _changed(paths: list[str], now: list[Tensor], before: list[Tensor]) -> None:
    changed = [i for i, (t, old) in enumerate(zip(now, before)) if not _same_bytes(t, old)]
    if changed:
        raise InputsChanged(changed, [paths[i] for i in changed])


def _bound_call(fn: Callable, args: tuple, kwargs: dict, device, grad: bool) -> Any:
    """``fn(*args, **kwargs)`` with autograd as the harness has it and, on CUDA, the device's
    context bound to this thread."""
    with torch.set_grad_enabled(grad):
        dev = torch.device(device)
        if dev.type != "cuda":
            return fn(*args, **kwargs)
        # A new thread (or process) has no current CUDA context, and torch makes none for a
        # device index it takes as current already; a kernel that launches through the driver
        # API (DeepGEMM's JIT runtime, FlashMLA's TMA descriptors) then fails with
        # CUDA_ERROR_INVALID_CONTEXT. A runtime call binds the device's primary context.
        with torch.cuda.device(dev):
            torch.cuda.synchronize(dev)
            return fn(*args, **kwargs)


def call_kernel(fn: Callable, args: tuple, kwargs: dict, timeout: float | None, device) -> Any:
    """``fn(*args, **kwargs)`` on ``device`` (the inputs moved there; ``fn`` a callable or a
    ``KernelProcess``) within ``timeout`` seconds (None: no limit; a callable then runs on the
    calling thread, for debuggers). RuntimeError with one line for a hang, an exit, an exception
    or a death of the kernel's process; InputsChanged when it wrote to an input."""
    if isinstance(fn, KernelProcess):
        return fn.call(args, kwargs, device, timeout)
    args, kwargs = to_device(args, device), to_device(kwargs, device)
    paths, now, before = _watched(args, kwargs, device)
    box: dict[str, Any] = {}
    grad = torch.is_grad_enabled()

    def target() -> None:
        try:
            box["out"] = _bound_call(fn, args, kwargs, device, grad)
        except SystemExit as e:
            box["error"] = f"the kernel called sys.exit({e.code!r})"
        except BaseException as e:  # noqa: BLE001 — any way out of the kernel is its verdict
            box["error"] = f"the kernel raised {one_line(e)}"

    if timeout is None:
        target()
    else:
        worker = threading.Thread(target=target, name="glm-dsa-kernel", daemon=True)
        worker.start()
        worker.join(timeout)
        if worker.is_alive():
            box["error"] = _timed_out(timeout)
    if "error" in box:
        raise RuntimeError(box["error"])
    _changed(paths, now, before)
    return box["out"]


def _timed_out(timeout: float) -> str:
    return (f"the kernel did not return within {timeout:g} s (a hang, or a slow first call: "
            f"raise the limit with --timeout / timeout=)")


# ----------------------------------------------------------------------------- the wire
def _dumps(message: Any) -> bytes:
    buffer = io.BytesIO()
    torch.save(message, buffer)
    return buffer.getvalue()


def _loads(data: bytes) -> Any:
    return torch.load(io.BytesIO(data), weights_only=True)


def _portable(x: Any) -> tuple:
    """A kernel's result as plain data for the wire: tensors on the CPU (copies, so a view
    sends its elements, not its whole storage), tuples, lists, dicts, JSON values, and the type
    name of anything else (the harness's verdict names it)."""
    if isinstance(x, Tensor):
        return ("tensor", x.detach().to("cpu", copy=True))
    if isinstance(x, (tuple, list)):
        return ("list" if isinstance(x, list) else "tuple", [_portable(v) for v in x])
    if isinstance(x, Mapping):
        return ("dict", [(k if isinstance(k, str) else repr(k), _portable(v)) for k, v in x.items()])
    if x is None or isinstance(x, (bool, int, float, str)):
        return ("value", x)
    return ("other", type(x).__name__)


class _Returned:
    """Stands for an object of a type that does not cross the wire; subclasses carry its name."""


def _rebuilt(node: tuple) -> Any:
    kind, value = node
    if kind == "tensor" or kind == "value":
        return value
    if kind == "tuple":
        return tuple(_rebuilt(v) for v in value)
    if kind == "list":
        return [_rebuilt(v) for v in value]
    if kind == "dict":
        return {k: _rebuilt(v) for k, v in value}
    return type(value, (_Returned,), {})()


def _described(fn: Callable) -> list[tuple] | None:
    """``fn``'s parameters as plain data (name, kind, has a default, the default when it is a
    JSON value), or None when it has no signature (a builtin)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return None
    return [(p.name, int(p.kind), p.default is not p.empty,
             _portable(p.default) if p.default is not p.empty else ("value", None)) for p in params]


def _signature_of(described: list[tuple]) -> inspect.Signature:
    return inspect.Signature([
        inspect.Parameter(name, inspect._ParameterKind(kind),
                          default=_rebuilt(default) if has_default else inspect.Parameter.empty)
        for name, kind, has_default, default in described])


# ----------------------------------------------------------------------------- the child
def _serve(conn, spec: str, env: dict[str, str]) -> None:
    """The kernel process: import ``spec``, then call it on each case the harness sends."""
    me = os.getpid()
    die_with_parent(os.getppid())
    os.setpgid(0, 0)  # a group of its own: the harness ends it with whatever the kernel forked
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the harness's to handle
    os.environ.clear()
    os.environ.update(env)  # the harness's environment now, not the fork server's at its start
    forks = [0]
    os.register_at_fork(after_in_parent=lambda: forks.__setitem__(0, forks[0] + 1))

    def reply(message: tuple) -> None:
        if os.getpid() != me:  # a copy the kernel forked, back in the harness's code
            os._exit(0)
        try:
            data = _dumps(message)
        except Exception as e:  # a tensor type torch.save cannot write
            data = _dumps(("raised", f"the kernel's outputs cannot be sent back: {one_line(e)}"))
        conn.send_bytes(data)

    reply(("started",))
    before = set(sys.modules)
    try:
        fn = load_kernel(spec)
    except ValueError as e:
        return reply(("usage", str(e)))
    except SystemExit as e:
        return reply(("broken", f"the kernel's module called sys.exit({e.code!r}) while it was imported"))
    except BaseException as e:  # noqa: BLE001 — KeyboardInterrupt and the like, raised by the module
        return reply(("broken", f"importing the kernel's module raised {one_line(e)}"))
    if forks[0]:
        return reply(("broken", "the kernel's module forked its process (os.fork) while it was imported"))
    loaded = (set(sys.modules) - before) | {getattr(fn, "__module__", None) or ""}
    files = sorted({os.path.abspath(f) for name in loaded
                    if isinstance(f := getattr(sys.modules.get(name), "__file__", None), str)})
    reply(("ready", getattr(fn, "__name__", ""), _described(fn), files))
    while True:
        try:
            message = _loads(conn.recv_bytes())
        except EOFError:
            return
        if message[0] == "close":
            return
        _, args, kwargs, device, grad = message
        forked = forks[0]
        outcome = _run(fn, args, kwargs, device, grad)
        if forks[0] != forked:
            outcome = ("raised", "the kernel forked its process (os.fork) during the call; a kernel "
                                 "returns its outputs from the process it was called in")
        reply(outcome)


def _run(fn: Callable, args: tuple, kwargs: dict, device: str, grad: bool) -> tuple:
    try:
        args, kwargs = to_device(args, device), to_device(kwargs, device)
    except Exception as e:
        return ("raised", f"moving the inputs to {device} raised {one_line(e)}")
    paths, now, before = _watched(args, kwargs, device)
    try:
        out = _bound_call(fn, args, kwargs, device, grad)
    except SystemExit as e:
        return ("raised", f"the kernel called sys.exit({e.code!r})")
    except BaseException as e:  # noqa: BLE001 — any way out of the kernel is its verdict
        return ("raised", f"the kernel raised {one_line(e)}")
    try:
        _changed(paths, now, before)
    except InputsChanged as e:
        return ("changed", e.leaves)
    return ("returned", _portable(out))


# ----------------------------------------------------------------------------- the harness's side
class _Ended(Exception):
    """The child is gone (``reason``: how, one line)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@contextlib.contextmanager
def _main_script_hidden() -> Iterator[None]:
    """While a child starts, ``__main__`` is a blank module: multiprocessing would run the
    harness's main script again in the child (for objects the target needs from it), and the
    kernel process needs none; a script without ``if __name__ == "__main__":`` (a console
    script written by hand, a user's) would start over there."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _context():
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(["glm_dsa.testing.fork_server", __name__])
    return context


class KernelProcess:
    """The kernel named ``spec`` (``MODULE:FUNCTION`` or ``path/to/file.py:FUNCTION``), imported
    and called in a child process (see the module's docstring).

    To the harness it is the kernel: ``__name__`` and ``inspect.signature`` are the kernel's,
    and ``call_kernel`` runs it in the child. ``start()`` (or ``with``) starts the child and
    imports the module within ``timeout`` seconds (None: no limit); a module that fails to
    import as ``load_kernel`` reports it is a ValueError, one that hangs, exits, forks or
    crashes there makes ``broken`` the reason and every call fail with it. ``files``: the files
    of the modules its import loaded (an output must not overwrite them).
    """

    def __init__(self, spec: str, timeout: float | None = DEFAULT_TIMEOUT_S):
        _, attr = _split(spec)
        self.spec, self.timeout = spec, timeout
        self.__name__ = attr.rpartition(".")[2]
        self.broken: str | None = None
        self.files: tuple[str, ...] = ()
        self._signature: inspect.Signature | None = None
        self._process: Any = None
        self._conn: Any = None

    @property
    def __signature__(self) -> inspect.Signature:
        if self._signature is None:  # as for a builtin: every keyword is passed
            raise ValueError(f"{self.spec} has no signature")
        return self._signature

    def __repr__(self) -> str:
        return f"KernelProcess({self.spec!r})"

    def __enter__(self) -> KernelProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call(args, kwargs, "cpu", self.timeout)

    def start(self) -> None:
        """Start the child and import the kernel in it; see the class."""
        context = _context()
        mine, theirs = context.Pipe()
        self._process = context.Process(target=_serve, args=(theirs, self.spec, dict(os.environ)),
                                        name=f"glm-dsa kernel {self.spec}")
        with _main_script_hidden():
            self._process.start()
        theirs.close()
        self._conn = mine
        slow = None if self.timeout is None else (
            f"importing the kernel's module did not finish within {self.timeout:g} s (a hang at "
            f"import, or a slow one: raise the limit with --timeout / timeout=)")
        try:
            self._receive(None, "while it started", None)
            reply = self._receive(self.timeout, "while its module was imported", slow)
        except _Ended as e:
            self.broken = e.reason
            return
        except BaseException:  # Ctrl-C, SIGTERM under glm-dsa: the child goes too
            self._end()
            raise
        if reply[0] in ("usage", "broken"):
            self._end()
            if reply[0] == "usage":
                raise ValueError(reply[1])
            self.broken = reply[1]
            return
        _, name, described, files = reply
        self.__name__ = name or self.__name__
        self._signature = None if described is None else _signature_of(described)
        self.files = tuple(files)

    def call(self, args: tuple, kwargs: dict, device, timeout: float | None) -> Any:
        """The kernel's result on ``args``, ``kwargs`` (CPU tensors; moved to ``device`` in the
        child); raises as ``call_kernel`` does. A child that died before is replaced first."""
        if self.broken is None and self._process is None:
            try:
                self.start()
            except ValueError as e:  # it imported before: whatever changed, this case fails
                self.broken = str(e)
        if self.broken is not None:
            raise RuntimeError(self.broken)
        message = ("call", to_device(args, "cpu"), to_device(kwargs, "cpu"), str(device),
                   torch.is_grad_enabled())
        try:
            try:
                self._conn.send_bytes(_dumps(message))
            except OSError:
                raise _Ended(f"the kernel process {self._how()} before it was called") from None
            reply = self._receive(timeout, "before returning its outputs",
                                  None if timeout is None else _timed_out(timeout))
        except _Ended as e:
            raise RuntimeError(e.reason) from None
        except BaseException:  # interrupted mid-call: the child is still in the kernel
            self._end()
            raise
        if reply[0] == "raised":
            raise RuntimeError(reply[1])
        if reply[0] == "changed":
            paths = [p for p, _ in _input_leaves(args, kwargs)]
            raise InputsChanged(reply[1], [paths[i] for i in reply[1]])
        return _rebuilt(reply[1])

    def close(self) -> None:
        """End the child (and anything it forked)."""
        if self._process is None:
            return
        with contextlib.suppress(OSError):
            self._conn.send_bytes(_dumps(("close",)))
        self._process.join(_EXIT_WAIT_S)
        self._end()

    def _receive(self, timeout: float | None, when: str, late: str | None) -> tuple:
        """The child's next message within ``timeout``; _Ended saying ``late`` (the child killed)
        past it, or how the child ended ``when`` it ends first."""
        ready = multiprocessing.connection.wait([self._conn, self._process.sentinel], timeout)
        if self._conn in ready:
            with contextlib.suppress(EOFError, OSError):
                return _loads(self._conn.recv_bytes())
        elif not ready:
            self._end()
            raise _Ended(late or "")
        raise _Ended(f"the kernel process {self._how()} {when}")

    def _how(self) -> str:
        """How the child ended (it has, or its end of the pipe is closed), once it is reaped."""
        self._process.join(_EXIT_WAIT_S)
        code = self._process.exitcode
        self._end()
        if code is None:
            return "stopped answering (it closed its end of the pipe)"
        if code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with status {code}"

    def _end(self) -> None:
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        if process.is_alive():
            process.kill()
        process.join()
        self._conn.close()
        process.close()


@contextlib.contextmanager
def kernel_session(fn: Callable | str, timeout: float | None) -> Iterator[Callable]:
    """``fn`` as the harness calls it: a name (``str``) as a started ``KernelProcess``, closed
    afterwards; a callable (a ``KernelProcess`` already started among them) as it is."""
    if not isinstance(fn, str):
        yield fn
        return
    with KernelProcess(fn, timeout) as process:
        yield process
