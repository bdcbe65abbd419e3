"""The pre-flight memory estimate of ``glm-dsa prefill`` against what a run really takes.

The peak is the kernel's: the command runs in a child process, which prints its ``VmHWM`` (the
high-water mark of its resident set, ``/proc/self/status``) as it exits. Not the child's
``ru_maxrss``: Linux carries the parent's resident set into it through fork and exec, so a child
of a pytest process that once held 2 GB reports 2 GB whatever it did. The estimate is the
one the memory check compares with free memory, read where the check receives it (a wrapper
around ``preflight.check_fits`` in the same child), so the test holds whatever the check is
given, today's and any earlier version's. The per-layer sizes are checked against modules built
on the meta device, an independent count of the same parameters.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest
import torch

from glm_dsa.config import FULL, PRESETS, keep_layers, to_hf_config
from glm_dsa.layer import DecoderLayer
from glm_dsa.ledger import (
    LAYER_KINDS,
    largest_tensor_elements,
    layer_kind_counts,
    layer_weight_bytes,
    layer_weight_elements,
    outer_weight_elements,
)
from glm_dsa.weights import build_model, largest_tensor_numel

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Runs the CLI with the memory check's input printed on stderr, then the check itself.
_SPY = """
import atexit
import sys
def peak():
    with open("/proc/self/status") as f:
        hwm = [line.split()[1] for line in f if line.startswith("VmHWM:")]
    print(f"PEAK {int(hwm[0]) * 1024}", file=sys.stderr, flush=True)
atexit.register(peak)
import glm_dsa.preflight as preflight
check = preflight.check_fits
def spy(need, *args, **kwargs):
    print(f"ESTIMATE {need}", file=sys.stderr, flush=True)
    return check(need, *args, **kwargs)
preflight.check_fits = spy
from glm_dsa.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _run(argv: list[str], tmp_path: pathlib.Path, timeout: float = 120) -> tuple[int, str, int, float]:
    """``(exit status, stderr, peak RSS bytes, wall seconds)`` of ``python -c _SPY argv``."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    start = time.monotonic()
    with open(out, "w") as fo, open(err, "w") as fe:
        p = subprocess.Popen([sys.executable, "-c", _SPY, *argv], stdout=fo, stderr=fe, env=env)
        try:
            while True:  # poll for the limit
                pid, status, _ = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    break
                if time.monotonic() - start > timeout:
                    p.kill()
                    pid, status, _ = os.wait4(p.pid, 0)
                    break
                time.sleep(0.05)
        finally:
            p.returncode = 0  # reaped here, not by Popen
    wall = time.monotonic() - start
    text = err.read_text()
    peaks = re.findall(r"^PEAK (\d+)$", text, re.M)
    assert len(peaks) == 1, text[-2000:]
    return os.waitstatus_to_exitcode(status), text, int(peaks[0]), wall


def _estimate(stderr: str) -> int:
    found = re.findall(r"^ESTIMATE (\d+)$", stderr, re.M)
    assert len(found) == 1, stderr
    return int(found[0])


@pytest.mark.parametrize("flags", [
    # one step whose indexer scores a 4096 x 4096 tile set (the scoring tile at TILE_BYTES)
    ["--config", "tiny", "--tokens", "4096", "--chunk", "4096"],
    # two steps in bf16 over a bf16 cache: the first step's freed blocks stay resident
    ["--config", "tiny", "--tokens", "2048", "--chunk", "1024", "--dtype", "bfloat16", "--kv-dtype", "bf16"],
    # two requests, four steps, with their outputs written
    ["--config", "small", "--tokens", "512", "--chunk", "256", "--requests", "2", "--save-outputs", "{out}"],
], ids=["tiny-4096x1", "tiny-bf16-2048x2", "small-2x512-saved"])
def test_peak_rss_of_a_prefill_stays_under_its_preflight_estimate(flags, tmp_path):
    argv = ["prefill", "--device", "cpu", "--no-progress", "--backend", "reference",
            *[f.format(out=tmp_path / "o.safetensors") for f in flags]]
    status, err, peak, _ = _run(argv, tmp_path)
    assert status == 0, err
    estimate = _estimate(err)
    assert peak <= estimate, f"peak RSS {peak / 1e6:.1f} MB above the estimate {estimate / 1e6:.1f} MB"
    # an honest bound, not a loose one: within 1.5x of the peak
    assert estimate <= 1.5 * peak, f"estimate {estimate / 1e6:.1f} MB for a peak of {peak / 1e6:.1f} MB"


def test_a_million_layers_are_refused_fast_and_in_bounded_memory(tmp_path):
    """10⁶ tiny layers (1.3 TB of float32 weights): refused by the memory check in one line,
    sized by layer kind, never built layer by layer (which took minutes and gigabytes)."""
    config = PRESETS["tiny"].replace(num_hidden_layers=10**6)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_hf_config(config)))
    argv = ["prefill", "--config", str(path), "--tokens", "64", "--chunk", "64", "--no-progress"]
    status, err, peak, wall = _run(argv, tmp_path, timeout=60)
    lines = [line for line in err.splitlines() if not line.startswith(("ESTIMATE ", "PEAK "))]
    assert status == 2 and len(lines) == 1, err[-2000:]
    assert lines[0].startswith("glm-dsa prefill: error: needs ") and "the weights alone take" in lines[0], lines
    assert wall < 10, f"{wall:.1f} s"
    assert peak < 1e9, f"peak RSS {peak / 1e6:.0f} MB"


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_layer_kinds_match_the_layers_built(name):
    config = PRESETS[name]
    seen = {kind: 0 for kind in LAYER_KINDS}
    for i in range(config.num_hidden_layers):
        seen[(config.indexer_types[i] == FULL, i >= config.first_k_dense_replace)] += 1
    assert layer_kind_counts(config) == seen
    model = build_model(config, device="meta")
    for i, layer in enumerate(model.model.layers):
        kind = (config.is_full(i), config.is_moe(i))
        assert layer_weight_elements(config, *kind) == sum(p.numel() for p in layer.parameters()), (i, kind)
        assert layer_weight_bytes(config, *kind, 2) == sum(p.numel() * 2 for p in layer.parameters())
    layers = sum(p.numel() for p in model.model.layers.parameters())
    assert outer_weight_elements(config) == sum(p.numel() for p in model.parameters()) - layers


def test_every_layer_kind_of_glm53_is_sized_as_built():
    """GLM-5.3's kinds (its three dense layers are full; full and shared MoE layers), each one
    layer built on the meta device."""
    config = PRESETS["glm-5.3"]
    present = [(full, moe) for full, moe in LAYER_KINDS if layer_kind_counts(config)[(full, moe)]]
    assert len(present) == 3
    for full, moe in present:
        i = next(i for i in range(config.num_hidden_layers)
                 if config.is_full(i) == full and config.is_moe(i) == moe)
        with torch.device("meta"):
            layer = DecoderLayer(config, i)
        assert layer_weight_elements(config, full, moe) == sum(p.numel() for p in layer.parameters())


@pytest.mark.parametrize("name,layers", [("tiny", None), ("small", None), ("glm-5.3", "0:4"),
                                         ("deepseek-v3.2", "2:4")])
def test_the_largest_tensor_is_found_from_the_shapes(name, layers):
    config = PRESETS[name] if layers is None else keep_layers(PRESETS[name], layers)
    assert largest_tensor_elements(config) == largest_tensor_numel(config)
