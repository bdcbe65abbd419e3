"""Pre-flight checks of the command line: every input is checked before a model is built.

Each check raises ``ValueError`` with one line naming the flag or file and the fix; ``glm-dsa``
prints it as ``glm-dsa <command>: error: …`` with exit status 2. Files are checked by their
safetensors header alone (no tensor is read), outputs by ``glm_dsa.outputs``, and memory by the
ledger's estimate of the run's peak (:func:`glm_dsa.ledger.prefill_peak_bytes`), on the host with
the process's own memory added (:func:`host_baseline_bytes`).
"""

from __future__ import annotations

import importlib.util
import json
import os
import struct

import torch

__all__ = [
    "safetensors_header",
    "check_device",
    "check_optional_module",
    "available_bytes",
    "resident_bytes",
    "host_baseline_bytes",
    "HOST_RUNTIME_BYTES",
    "check_fits",
]

_GB = 1e9

# What a prefill process adds to its resident memory beyond the interpreter and the libraries it
# has imported when the memory check runs, whatever the config: torch's meta-device operator
# registrations (loaded by ``build_model``'s first op on a meta tensor), the BLAS and OpenMP
# thread pools and the allocator's arenas. Measured on the host (torch 2.13.0+cpu, Python 3.11,
# 2 threads): VmRSS 237 MB after ``import glm_dsa.cli``, 384 MB after building the tiny model on
# the meta device, 394 MB after one float32 1000x1000 matmul; and the peak RSS (VmHWM) of
# ``glm-dsa prefill --config tiny --tokens 64 --chunk 64`` (5.6 MB of weights; 19.6 MB for the
# whole run by ``ledger.prefill_peak_bytes``) is 410 MB: 173 MB above the RSS at import, of
# which the run's own allocations are at most 19.6 MB. 192 MiB (201 MB) covers the rest.
HOST_RUNTIME_BYTES = 192 << 20


def safetensors_header(flag: str, path: str) -> dict[str, dict]:
    """``{name: {"dtype", "shape", "data_offsets"}}`` of a safetensors file, checked for truncation.

    Reads the 8-byte header length and the JSON header only; a file shorter than its header's
    last data offset is reported as truncated.
    """
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path} does not exist" if not os.path.exists(path)
                         else f"{flag} {path} is not a file")
    size = os.path.getsize(path)
    bad = f"{flag} {path} is not a safetensors file"
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError(f"{bad} (only {size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise ValueError(f"{bad} (header of {n} bytes in a {size}-byte file)")
            header = json.loads(f.read(n))
    except PermissionError:
        raise ValueError(f"{flag} {path} is not readable; check its permissions") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError(f"{bad} (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise ValueError(f"{bad} (its header is not a JSON object)")
    header.pop("__metadata__", None)
    end = 0
    for name, info in header.items():
        try:
            end = max(end, int(info["data_offsets"][1]))
        except (TypeError, KeyError, IndexError, ValueError):
            raise ValueError(f"{bad} (tensor {name!r} has no data offsets)") from None
    if 8 + n + end > size:
        raise ValueError(f"{flag} {path} is truncated: {size} bytes, its header needs {8 + n + end}")
    return header


def check_device(flag: str, name: str) -> torch.device:
    """``name`` as a torch device this run can use (cpu, or cuda[:N] with that GPU present)."""
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise ValueError(f"{flag} {name} is not a device; use cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{flag} {name}: only cpu and cuda[:N] are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{flag} {name} but torch sees no CUDA device; use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValueError(f"{flag} {name} but only {torch.cuda.device_count()} CUDA device(s) exist")
    return device


def check_optional_module(flag: str, module: str, extra: str) -> None:
    """``module`` imports, or name the extra that installs it."""
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{flag} needs {module}: pip install 'glm-dsa[{extra}]'")


def available_bytes(device: torch.device) -> int | None:
    """Free memory a run on ``device`` can take: CUDA's free bytes, or the host's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    available = _proc_kib("/proc/meminfo", "MemAvailable:")
    if available is not None:
        return available
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS, bytes; 0 where /proc does not say)."""
    return _proc_kib("/proc/self/status", "VmRSS:") or 0


def _proc_kib(path: str, field: str) -> int | None:
    """Bytes of the ``field`` line (in kB) of a /proc file; None where it has none."""
    try:
        with open(path, encoding="ascii") as f:
            for line in f:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


# This module is imported by the command before any config or model is made, once the
# interpreter, torch and glm_dsa's modules are in: what a prefill process holds apart from its run.
_RESIDENT_AT_IMPORT = resident_bytes()


def host_baseline_bytes() -> int:
    """The host memory a prefill process holds apart from what its run allocates (the ledger's
    ``prefill_peak_bytes``): its resident memory when this module was imported (the interpreter
    and the libraries; taken then, so a process that ran prefills before, as a test does, gets
    the same estimate each time) and what starting the run loads (``HOST_RUNTIME_BYTES``)."""
    return _RESIDENT_AT_IMPORT + HOST_RUNTIME_BYTES


def check_fits(need: int, device: torch.device, lower: str, held: int = 0) -> None:
    """Refuse a run whose estimated peak ``need`` bytes exceeds what ``device`` has free plus
    ``held``, the part of ``need`` this process holds already (its own resident memory, when
    the run is this process: free memory does not count it)."""
    have = available_bytes(device)
    if have is not None:
        have += held
    if have is not None and need > have:
        where = "host memory" if device.type == "cpu" else f"free on {device}"
        raise ValueError(f"needs {need / _GB:.1f} GB, {have / _GB:.1f} GB {where}; {lower}")
