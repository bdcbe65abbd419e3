"""Child processes that never outlive the process that started them.

``die_with_parent`` is called first thing in a child (a context-parallel rank of
``glm_dsa.cp.launch``, the kernel process of ``glm_dsa.testing.isolation``): when its parent
ends, however it ends (SIGKILL included), the child is killed too, so no rank or kernel keeps
running, holding a GPU, after the command is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int) -> None:
    """End this process when ``parent_pid`` (its parent) ends: Linux's parent-death signal,
    else a thread watching the parent's pid."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent_pid:  # the parent died before the signal was armed
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="glm-dsa-parent-watch").start()
