"""Layer-major prefill from an FP8 checkpoint on local disk against the same run with random
weights (issue 41's checkpoint-streaming target: the reads hidden behind compute).

Writes a sharded FP8 checkpoint of ``--layers`` of ``--config`` (random weights drawn on
``--device`` as ``init_weights`` draws them, block-quantized there; one shard per layer and one
for the embedding, final norm and head; ``config.json`` of the whole model), drops its pages from
the page cache (``fsync`` + ``POSIX_FADV_DONTNEED``: the reads then come from the disk, as a
744 GB checkpoint's would), times one plain sequential read of a shard (the disk's rate), then
runs ``glm-dsa prefill --order layer --layers A:B`` twice in processes of their own, random
weights and ``--weights DIR`` (its pages dropped again first), and prints the per-layer table:

    python scripts/bench_checkpoint_stream.py --dir /tmp/ckpt --layers 6:9 --tokens 1048576 --warm-up

``--device cpu --config tiny`` runs the same steps on the CPU in seconds. Logs: each prefill's
stdout and stderr under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time

import torch
from safetensors.torch import save_file

from glm_dsa.config import PRESETS, keep_layers, parse_layers
from glm_dsa.weights import (INDEX_FILE, _scale_name, block_quantize_weight, build_outer_model, init_layer_weights,
                             init_outer_weights, is_quantizable, write_config)


def _stored(name: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
    """``name``'s tensors as an FP8 checkpoint stores them, in host memory."""
    if is_quantizable(name, t):
        q, s = block_quantize_weight(t)
        return {name: q.cpu(), _scale_name(name): s.cpu()}
    return {name: t.detach().cpu().contiguous()}


def write_checkpoint(directory: str, config_name: str, layers: range, seed: int, device: torch.device) -> list[str]:
    """The FP8 checkpoint of ``layers`` (and the outer tensors) of ``config_name`` under ``seed``;
    returns the shard paths."""
    full = PRESETS[config_name]
    os.makedirs(directory, exist_ok=True)
    write_config(full, directory, fp8=True)
    model = init_outer_weights(build_outer_model(keep_layers(full, layers), torch.bfloat16, device), seed)
    weight_map: dict[str, str] = {}
    files = []
    total = 0

    def flush(label: str, tensors: dict[str, torch.Tensor]) -> None:
        nonlocal total
        file = f"model-{label}.safetensors"
        save_file(tensors, os.path.join(directory, file))
        weight_map.update({k: file for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        files.append(os.path.join(directory, file))

    outer: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if ".layers." not in name:
            outer.update(_stored(name, t))
    flush("outer", outer)
    del outer
    for i, layer in enumerate(model.model.layers):
        t0 = time.perf_counter()
        layer.to_empty(device=device)
        init_layer_weights(layer, seed, layers.start + i)
        tensors: dict[str, torch.Tensor] = {}
        for name, t in layer.state_dict().items():
            tensors.update(_stored(f"model.layers.{layers.start + i}.{name}", t))
        layer.to_empty(device="meta")
        flush(f"layer{layers.start + i:02d}", tensors)
        print(f"wrote layer {layers.start + i}: {sum(t.nbytes for t in tensors.values()) / 1e9:.2f} GB "
              f"in {time.perf_counter() - t0:.1f} s", flush=True)
        del tensors
    with open(os.path.join(directory, INDEX_FILE), "w", encoding="utf-8") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
    return files


def drop_pages(paths: list[str]) -> None:
    """Write back, then drop each file's pages from the page cache."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_rate(path: str, block: int = 16 << 20) -> tuple[float, float]:
    """(GB read, GB/s) of one plain sequential read of ``path``."""
    buf = bytearray(block)
    view = memoryview(buf)
    n = 0
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while (got := f.readinto(view)) > 0:
            n += got
    return n / 1e9, n / 1e9 / (time.perf_counter() - t0)


_LAYER_ROW = re.compile(r"^(\d+)\s+(full|shared)\s+([\d.]+)\s+([\d.]+)$", re.M)


def prefill(label: str, argv: list[str], out: str) -> tuple[float, list[tuple[int, str, float, float]]]:
    """Process seconds and per-layer (layer, kind, weights s, steps s) of one prefill run."""
    t0 = time.perf_counter()
    with open(os.path.join(out, f"{label}.out"), "w") as so, open(os.path.join(out, f"{label}.err"), "w") as se:
        rc = subprocess.run([sys.executable, "-m", "glm_dsa", "prefill", *argv], stdout=so, stderr=se).returncode
    seconds = time.perf_counter() - t0
    if rc != 0:
        with open(os.path.join(out, f"{label}.err")) as f:
            sys.exit(f"{label}: glm-dsa prefill exited {rc}: {f.read()[-2000:]}")
    with open(os.path.join(out, f"{label}.out")) as f:
        rows = [(int(a), b, float(c), float(d)) for a, b, c, d in _LAYER_ROW.findall(f.read())]
    return seconds, rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", required=True, help="where the checkpoint is written (kept if it has config.json)")
    p.add_argument("--config", default="glm-5.3", choices=sorted(PRESETS))
    p.add_argument("--layers", default="6:9")
    p.add_argument("--tokens", type=int, default=1 << 20)
    p.add_argument("--chunk", type=int, default=32768)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out", default=".", help="folder for the prefill logs")
    p.add_argument("--warm-up", action="store_true",
                   help="run the random-weight prefill once, untimed, first: both timed runs then find Triton's "
                        "compiled kernels and autotune choices in its cache")
    args = p.parse_args()
    device = torch.device(args.device)
    layers = parse_layers(args.layers, PRESETS[args.config].num_hidden_layers)
    os.makedirs(args.out, exist_ok=True)
    t0 = time.perf_counter()
    if not os.path.exists(os.path.join(args.dir, "config.json")):
        write_checkpoint(args.dir, args.config, layers, args.seed, device)
    files = sorted(os.path.join(args.dir, f) for f in os.listdir(args.dir) if f.endswith(".safetensors"))
    size = sum(os.path.getsize(f) for f in files) / 1e9
    print(f"checkpoint {args.dir}: {len(files)} shards, {size:.2f} GB ({time.perf_counter() - t0:.0f} s)")
    drop_pages(files)
    gb, rate = read_rate(files[-1])
    print(f"disk: one sequential read of {os.path.basename(files[-1])} after its pages were dropped: "
          f"{gb:.2f} GB at {rate:.2f} GB/s")
    common = ["--config", args.config, "--layers", args.layers, "--tokens", str(args.tokens), "--chunk",
              str(args.chunk), "--device", args.device, "--order", "layer", "--seed", str(args.seed)]
    if device.type == "cuda":
        common += ["--dtype", "bfloat16", "--kv-dtype", "fp8", "--backend", "triton"]
    if args.warm_up:
        prefill("warm_up", common, args.out)
    random_s, random_rows = prefill("random", common, args.out)
    drop_pages(files)
    ckpt_s, ckpt_rows = prefill("checkpoint", [*common, "--weights", args.dir], args.out)
    print(f"\n{'layer':>5} {'kind':>6} | {'random: weights s':>17} {'steps s':>8} | "
          f"{'checkpoint: weights s':>21} {'steps s':>8} | {'ratio':>5}")
    for (i, kind, rw, rs), (_, _, cw, cs) in zip(random_rows, ckpt_rows):
        print(f"{i:>5} {kind:>6} | {rw:>17.3f} {rs:>8.3f} | {cw:>21.3f} {cs:>8.3f} | {(cw + cs) / (rw + rs):>5.2f}")
    r_all = sum(w + s for _, _, w, s in random_rows)
    c_all = sum(w + s for _, _, w, s in ckpt_rows)
    r_rest = sum(w + s for _, _, w, s in random_rows[1:])
    c_rest = sum(w + s for _, _, w, s in ckpt_rows[1:])
    print(f"layers: random {r_all:.2f} s, checkpoint {c_all:.2f} s, ratio {c_all / r_all:.3f}; "
          f"after the first layer (reads ahead): {r_rest:.2f} s vs {c_rest:.2f} s, ratio {c_rest / max(r_rest, 1e-9):.3f}")
    print(f"process: random {random_s:.1f} s, checkpoint {ckpt_s:.1f} s, ratio {ckpt_s / random_s:.3f}")


if __name__ == "__main__":
    main()
