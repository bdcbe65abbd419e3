"""Output files and directories that never destroy an input and are never left half-written.

One rule for every file a command writes (``prefill --save-outputs`` and ``--plot``, ``fidelity
--plot``, ``check`` / ``compare --junit-xml``, ``golden --out``; ``--json`` goes to stdout):

- **Checked before any compute** (:func:`check_output_paths`, :func:`check_output_dir`): an
  output may not be an input of the same run — the same file by device and inode, so hard links
  and symlinks count; a directory input (a checkpoint, a golden set) stands for every file under
  it, symlinked subdirectories followed, so every file a checkpoint index or golden manifest can
  reach is covered; the kernel's ``.py`` file and the modules its import loaded are inputs of
  ``check`` and ``compare`` — nor anything but a regular file or absent (a directory, FIFO,
  socket or device node is refused: replacing ``/dev/null`` with a regular file is what a rename
  would do), nor two outputs one file. A directory to be replaced must be writable by its mode
  bits (see :func:`check_output_dir`).
- **Written to a temporary and renamed** (:func:`write_file`): the bytes go to a temporary
  beside the target, named ``.<name>.<pid>.<random>.glm-dsa-partial``, which is renamed over the
  target once complete (so a reader sees the old file or the new one, never a mix). The
  temporary is removed when the write fails, on Ctrl-C and on SIGTERM; only SIGKILL (or a power
  cut) can leave one behind, and the next write to the same path removes those whose process is
  gone (:func:`sweep_partials`). A directory is written whole into such a temporary directory
  and swapped in by one ``rename`` (:func:`replace_dir`).

**Symlinks are written through**: the target file is replaced and the link kept, as an editor
saving a linked file does; the temporary lives beside the target.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import signal
import stat
import sys
import tempfile
import threading
import warnings
from typing import Callable, Iterator, Mapping, Sequence, TypeVar

__all__ = [
    "PARTIAL_SUFFIX",
    "check_output_file",
    "check_output_paths",
    "check_output_dir",
    "write_file",
    "replace_dir",
    "Terminated",
    "raise_terminated",
    "sweep_partials",
]

PARTIAL_SUFFIX = ".glm-dsa-partial"

T = TypeVar("T")


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


Inputs = Mapping[str, str | Sequence[str] | None]  # {flag: a path, or several}


def _input_files(inputs: Inputs) -> dict[tuple[int, int], str]:
    """``{(st_dev, st_ino): "FLAG PATH"}`` of every existing input file (``inputs``: a path, or
    several, per flag); a directory input (a checkpoint, a golden set) stands for every file
    under it, symlinked subdirectories followed (each directory once)."""
    found: dict[tuple[int, int], str] = {}

    def add(path: str, what: str) -> None:
        try:
            st = os.stat(path)
        except OSError:
            return
        if stat.S_ISREG(st.st_mode):
            found.setdefault((st.st_dev, st.st_ino), what)

    for flag, given in inputs.items():
        for path in [given] if isinstance(given, str) else given or ():
            if not os.path.isdir(path):
                add(path, f"{flag} {path}")
                continue
            seen: set[tuple[int, int]] = set()
            for root, dirs, names in os.walk(path, followlinks=True):
                st = os.stat(root)
                if (st.st_dev, st.st_ino) in seen:  # a link back up the tree
                    dirs[:] = []
                    continue
                seen.add((st.st_dev, st.st_ino))
                for name in names:
                    full = os.path.join(root, name)
                    add(full, f"{flag} {path} (its file {os.path.relpath(full, path)})")
    return found


def check_output_file(flag: str, path: str, inputs: Inputs | None = None) -> None:
    """``path`` can take an output: absent or a regular file (a symlink counts as its target),
    not one of ``inputs`` (``{flag: path or paths}``; a directory stands for every file under
    it), its directory exists and is writable. Raises ``ValueError`` with one line naming the
    fix."""
    target = os.path.realpath(path)
    if os.path.exists(target):
        st = os.stat(target)
        if stat.S_ISDIR(st.st_mode):
            raise ValueError(f"{flag} {path} is a directory; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{flag} {path} is {_kind(st.st_mode)}, not a regular file; give the path of a "
                             "regular file (it would be replaced by one)")
        same = _input_files(inputs or {}).get((st.st_dev, st.st_ino))
        if same is not None:
            raise ValueError(f"{flag} {path} is the input {same}; writing it would destroy that input: "
                             "choose another path")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK) or (os.path.exists(target) and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path} is not writable; choose another path")


def check_output_paths(outputs: Mapping[str, str | None], inputs: Inputs | None = None) -> None:
    """Every given path of ``outputs`` (``{flag: path}``) as :func:`check_output_file` checks it,
    and no two of them the same file (by name, symlink or hard link)."""
    written: dict[object, str] = {}
    for flag, path in outputs.items():
        if not path:
            continue
        check_output_file(flag, path, inputs)
        target: object = os.path.realpath(path)
        if os.path.exists(path):  # an existing file is one file under every hard link
            st = os.stat(path)
            target = (st.st_dev, st.st_ino)
        if target in written:
            raise ValueError(f"{flag} {path} is also {written[target]}; give each output its own file")
        written[target] = f"{flag} {path}"


def check_output_dir(flag: str, path: str) -> None:
    """``path`` is a directory that can be replaced whole, or can be created as one (a symlink
    counts as its target): its parent is writable, and an existing one is writable too, by its
    mode bits as well as for this user.

    The mode bits are read explicitly because root may write anything, so ``os.access`` says
    yes to root for a directory nobody may write (0555): that is a directory its owner
    protected, and replacing it would undo that, so it is refused for root too (make it
    writable first). This also keeps a replacement from failing half-way for other users, where
    the old set could be swapped out but not removed."""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isdir(target):
        raise ValueError(f"{flag} {path} exists and is not a directory; give a directory")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: directory {parent} does not exist; create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path} cannot be replaced: {parent} is not writable; choose another directory")
    if os.path.isdir(target):
        mode = stat.S_IMODE(os.stat(target).st_mode)
        if not mode & 0o222 or not os.access(target, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path} is read-only (mode {mode:04o}) and would be replaced whole; "
                             f"make it writable (chmod u+w {path}) or choose another directory")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def sweep_partials(path: str) -> list[str]:
    """Remove the temporaries that earlier writes of ``path`` left behind (``.<name>.<pid>.*``
    + ``PARTIAL_SUFFIX``, files or directories) whose process is no longer running; returns
    their paths."""
    target = os.path.realpath(path)
    parent, base = os.path.split(target)
    removed: list[str] = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        if not (name.startswith(f".{base}.") and name.endswith(PARTIAL_SUFFIX)):
            continue
        pid = name[len(base) + 2:].split(".", 1)[0]
        if not pid.isdigit() or _pid_alive(int(pid)):
            continue
        full = os.path.join(parent, name)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.remove(full)
        removed.append(full)
    return removed


class Terminated(SystemExit):
    """SIGTERM, raised where the program is: unwinds like ``sys.exit(143)``, so temporaries are
    removed on the way out (here during a write; ``glm-dsa`` for a whole command)."""


def raise_terminated(signum: int, frame: object) -> None:
    """A SIGTERM handler raising ``Terminated``."""
    raise Terminated(128 + signum)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """Turn SIGTERM into an exception while a temporary exists, unless the program already
    handles SIGTERM (``glm-dsa`` does) or this is not the main thread (only it gets signals)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _umask_mode(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def _partial_name(target: str) -> tuple[str, str]:
    parent, base = os.path.split(target)
    return parent, f".{base}.{os.getpid()}."


def write_file(path: str, write: Callable[[str], None]) -> None:
    """``write(tmp)`` to a temporary beside ``path`` (its target, if a symlink), then rename it
    over the target, with the mode a plain ``open`` gives (0666 less the umask)."""
    target = os.path.realpath(path)
    if os.path.exists(target) and not os.path.isfile(target):
        raise ValueError(f"{path} is {_kind(os.stat(target).st_mode)}, not a regular file; give another path")
    sweep_partials(target)
    parent, prefix = _partial_name(target)
    with _sigterm_unwinds():
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=prefix, suffix=PARTIAL_SUFFIX)
        os.close(fd)
        try:
            write(tmp)
            os.chmod(tmp, _umask_mode(0o666))
            os.replace(tmp, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def _exchange(a: str, b: str) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the filesystem cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), b)


def replace_dir(path: str, write: Callable[[str], T]) -> T:
    """``write(tmp_dir)`` into a new directory beside ``path`` (its target, if a symlink), then
    swap it in: an interrupted write leaves the old directory as it was. Returns what ``write``
    returns.

    An existing directory is replaced whole, so it may hold only names the new one holds: a
    file ``write`` did not produce (a user's notes, a kernel's outputs) is refused with one
    line before anything is replaced; one that is read-only (``check_output_dir``) is refused
    before ``write`` runs.
    """
    check_output_dir("directory", path)  # before anything is computed
    target = os.path.realpath(path)
    sweep_partials(target)
    parent, prefix = _partial_name(target)
    with _sigterm_unwinds():
        tmp = tempfile.mkdtemp(dir=parent, prefix=prefix, suffix=PARTIAL_SUFFIX)
        try:
            result = write(tmp)
            os.chmod(tmp, _umask_mode(0o777))
            if os.path.isdir(target):
                strangers = sorted(set(os.listdir(target)) - set(os.listdir(tmp)))
                if strangers:
                    raise ValueError(f"{path} holds {', '.join(strangers[:5])}"
                                     f"{' …' if len(strangers) > 5 else ''}, which this command does not write; "
                                     "the directory is replaced whole: move those out or choose another directory")
                # The old directory goes under the ``.glm-dsa-previous`` name beside it, which no
                # sweep removes: an interruption, or a removal that fails, never loses it unseen.
                previous = tmp[: -len(PARTIAL_SUFFIX)] + ".glm-dsa-previous"
                if _exchange(tmp, target):
                    os.rename(tmp, previous)
                else:
                    os.rename(target, previous)
                    os.rename(tmp, target)
                try:
                    shutil.rmtree(previous)
                except OSError as e:
                    warnings.warn(f"{path} is written, but its previous contents could not be removed "
                                  f"({e.strerror or e}): they are in {previous}; remove them yourself")
            else:
                os.rename(tmp, target)
        except BaseException:
            if os.path.isdir(tmp) and tmp.endswith(PARTIAL_SUFFIX):
                shutil.rmtree(tmp, ignore_errors=True)
            raise
    return result
