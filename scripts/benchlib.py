"""What every benchmark script shares, as DeepGEMM's ``testing/bench.py`` and ``numeric.py``
serve its tests and benchmarks: the synchronisation, the timer and the one error metric.

The scripts import it as ``benchlib`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["sync", "median_seconds", "calc_diff"]


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the queued work of ``device`` (a CUDA device; None: the current one when CUDA is
    present); nothing on the CPU, where work is done when the call returns."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], warmup: int = 1, reps: int = 3) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs timed with CUDA events, after ``warmup``
    untimed ones; on the host clock when CUDA is absent (a CPU run of Triton's interpreter,
    whose work is done when each call returns)."""
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def calc_diff(x: Tensor, y: Tensor, rows: int = 4096) -> float:
    """DeepGEMM's ``calc_diff`` ``1 − 2 Σxy / Σ(x² + y²)`` in float64 (``glm_dsa.oracle.calc_diff``'s
    value), summed ``rows`` rows at a time so that a million-token tensor needs no float64 copy
    of itself; 0 for two zero tensors."""
    xy = sq = 0.0
    for r0 in range(0, x.shape[0], rows):
        a, b = x[r0 : r0 + rows].double(), y[r0 : r0 + rows].double()
        xy += float((a * b).sum())
        sq += float((a * a + b * b).sum())
    return 0.0 if sq == 0 else 1.0 - 2.0 * xy / sq
