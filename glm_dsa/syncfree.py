"""Sync-free mode: a prefill step's device code with no host synchronisation, so that it can be
captured in a CUDA graph (``glm_dsa.graphs``).

Eagerly, a data check reads its verdict on the host (``bool(bad.any())``: the host waits for
the GPU) and a few loops size their work from device values (``.tolist()``). Inside
``sync_free()`` neither happens:

* a data check, written once as ``check(ok, message, detail)`` for both modes, is recorded
  instead of read: ``ok`` is a 0-dim bool tensor left on the device; ``Checks.raise_first`` reads every recorded verdict with one copy after the
  step (after each replay of a captured graph, where the same kernels recompute them) and raises
  the first failed check's ``ValueError``. The condition is the eager check's; the message names
  what failed but not the first offending row (finding it would cost another synchronisation),
  and it comes after the step's compute rather than before it.
* code whose shapes follow device values takes a plan from the tensors' sizes alone
  (``glm_dsa.row_chunks.chunked_topk``: every row chunk over all key columns).

Nothing else changes: the kernels, their arguments and so their results are the eager ones.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

__all__ = ["Checks", "sync_free", "active", "check"]


class Checks:
    """The data checks recorded inside one ``sync_free()`` block: ``(ok, message)`` pairs."""

    def __init__(self) -> None:
        self.flags: list[tuple[Tensor, str]] = []

    def verdicts(self) -> Tensor | None:
        """All verdicts as one bool ``[k]`` device tensor (one kernel; inside a capture it is a
        graph output that every replay refreshes), or None when nothing was checked."""
        if not self.flags:
            return None
        return torch.stack([ok.reshape(()) for ok, _ in self.flags])

    def raise_first(self, verdicts: Tensor | None = None) -> None:
        """ValueError with the message of the first failed check (one device-to-host copy).
        ``verdicts``: what ``verdicts()`` returned (by a captured graph), else computed now."""
        if verdicts is None:
            verdicts = self.verdicts()
        if verdicts is None:
            return
        for ok, (_, message) in zip(verdicts.tolist(), self.flags):
            if not ok:
                raise ValueError(message)


_checks: Checks | None = None


@contextlib.contextmanager
def sync_free() -> Iterator[Checks]:
    """Run the block's device code without host synchronisations; yields the ``Checks`` it
    records (read them with ``raise_first`` once the work is done). Not reentrant."""
    global _checks
    if _checks is not None:
        raise RuntimeError("sync_free() blocks do not nest")
    _checks = Checks()
    try:
        yield _checks
    finally:
        _checks = None


def active() -> bool:
    """True inside ``sync_free()``."""
    return _checks is not None


def check(ok: Tensor, message: str, detail: Callable[[], str] | None = None) -> None:
    """A data check in either mode. Inside ``sync_free()``: record the 0-dim bool device verdict
    ``ok`` with ``message`` (the ValueError ``Checks.raise_first`` raises if it is False).
    Outside: read ``ok`` now (one synchronisation) and, if False, raise ``detail()`` (a message
    naming the offending row, found with more host reads, only on failure) or ``message``."""
    if _checks is None:
        if not bool(ok):
            raise ValueError(message if detail is None else detail())
        return
    _checks.flags.append((ok, message))
