"""What every benchmark script shares, as DeepGEMM's ``testing/bench.py`` and ``numeric.py``
serve its tests and benchmarks: the synchronisation, the timer and the one error metric.

The scripts import it as ``benchlib`` (a script's own folder is first on ``sys.path``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["sync", "median_seconds", "calc_diff", "covered", "profile_call"]


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


def covered(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` spans (a GPU's busy time from its kernels'
    spans, which overlap where streams or launches do)."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


# Host calls that wait for the device (a read of a device value is a DtoH copy and a wait).
_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync",
          "cudaMemcpy")


def profile_call(fn: Callable[[], object], top: int = 10) -> dict:
    """One ``fn()`` on CUDA under ``torch.profiler``, after one untimed call: where its wall time
    goes. ``wall_ms`` (host clock, profiler on), ``gpu_busy_ms`` (the union of its kernels' and
    copies' spans), ``gpu_span_ms`` (first device start to last device end), ``gpu_idle_ms``
    (span − busy: the device waiting on the host inside the call), ``launches`` (device
    activities), ``host_waits`` (calls of ``_WAITS`` by name), ``kernels``: the ``top`` device
    activities by total time, ``[name, count, total ms]``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    device = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in device]
    by_name: dict[str, list] = {}
    for e in device:
        entry = by_name.setdefault(e.name, [e.name, 0, 0.0])
        entry[1] += 1
        entry[2] += e.time_range.elapsed_us() / 1e3
    waits: dict[str, int] = {}
    for e in prof.events():
        if e.device_type == DeviceType.CPU and e.name in _WAITS:
            waits[e.name] = waits.get(e.name, 0) + 1
    busy = covered(spans) / 1e3
    span = (max(e for _, e in spans) - min(s for s, _ in spans)) / 1e3 if spans else 0.0
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy, "gpu_span_ms": span, "gpu_idle_ms": span - busy,
            "launches": len(device), "host_waits": waits,
            "kernels": sorted(by_name.values(), key=lambda k: -k[2])[:top]}  # fmt: skip
