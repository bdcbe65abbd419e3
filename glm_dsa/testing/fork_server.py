"""The fork server of ``glm_dsa.testing.isolation``: imported there, and only there (its
``forkserver`` preload), before the server forks any kernel process.

Importing it arms the server's death with the harness that started it: every kernel process the
server forks holds the server's "alive" pipe, so a harness killed outright (SIGKILL, the OOM
killer) would leave the server waiting for them and them running on. With the server bound to
the harness and each kernel process to the server (``glm_dsa.processes``), the kernel dies with
the harness however it ends. torch is imported here once, not by every kernel process.
"""

import os

import torch  # noqa: F401 — imported once in the server; the kernel processes inherit it

from glm_dsa.processes import die_with_parent

die_with_parent(os.getppid())
