"""Host memory of loading one layer of a sharded FP8 checkpoint, measured by the kernel.

Writes a synthetic FP8 block-quantized checkpoint in Hugging Face's sharded layout (the
project's writer, random weights) for a scaled-down GLM-5.3: the same layer schedule (full
layers 0-2 and 6, first three dense, so layer 6 is the first full MoE layer) and the same
proportions that matter here (the embedding and head are the largest tensors, the shards are
larger than any tensor). Then, in a fresh process, it loads ``--layers 6:7`` on the CPU and
reads the process's peak resident set (``VmHWM``, reset through ``/proc/self/clear_refs``
after the imports): the figure reported is that peak minus the resident set before loading
minus the loaded parameters' own bytes, i.e. what the loader needed beyond the model it
built, against the largest tensor it read (in the model's dtype).

    python scripts/measure_load_memory.py [--size default|ci] [--json] [--dir DIR]

Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

_COMMON = dict(num_hidden_layers=8, first_k_dense_replace=3, qk_nope_head_dim=64, qk_rope_head_dim=64,
               v_head_dim=64, index_n_heads=4, index_head_dim=128, index_topk=256, num_experts_per_tok=4,
               max_position_embeddings=65536)
# (config, shard bytes): "default" about a minute on two cores, "ci" (the test's) about 10 s
SIZES = {
    "default": (dict(name="glm-5.3-scaled", hidden_size=1024, num_attention_heads=8, q_lora_rank=512,
                     kv_lora_rank=512, n_routed_experts=32, moe_intermediate_size=256, intermediate_size=2048,
                     vocab_size=32768, **_COMMON), 16 << 20),
    "ci": (dict(name="glm-5.3-scaled-ci", hidden_size=256, num_attention_heads=4, q_lora_rank=256,
                kv_lora_rank=256, n_routed_experts=8, moe_intermediate_size=128, intermediate_size=512,
                vocab_size=49152, **_COMMON), 2 << 20),
}
LAYERS = "6:7"


def _status(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def _write(directory: str, size: str) -> None:
    import torch

    from glm_dsa.config import DSAConfig
    from glm_dsa.weights import build_model, init_weights, save_checkpoint

    config, shard_bytes = SIZES[size]
    model = init_weights(build_model(DSAConfig(**config), torch.bfloat16), seed=0)
    save_checkpoint(model, directory, fp8=True, max_shard_bytes=shard_bytes)


def _measure(directory: str) -> dict:
    """Runs in a fresh process: load the slice and read the kernel's peak RSS."""
    import torch

    import glm_dsa.weights as weights

    opened: set[str] = set()
    real = weights.safe_open

    def counting(path, *args, **kwargs):
        opened.add(os.fspath(path))
        return real(path, *args, **kwargs)

    weights.safe_open = counting
    checkpoint = weights.open_checkpoint(directory, layers=LAYERS)
    largest = max(p.numel() for p in weights.build_model(checkpoint.config, torch.bfloat16, "meta").state_dict().values())
    # Touch the code paths first (their pages count in RSS once run): one small tensor read,
    # dequantized and checked the way the load does it.
    name = next(n for n in checkpoint.scales if ".layers." in n)
    key, path = checkpoint.tensors[name]
    scale_key, scale_path = checkpoint.scales[name]
    w = weights.block_dequantize_weight(weights._read(path, key, "cpu"), weights._read(scale_path, scale_key, "cpu"),
                                        torch.bfloat16)
    assert weights._all_finite(w)
    del w
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # reset VmHWM to the current resident set
    baseline = _status("VmRSS")
    model = checkpoint.load(torch.bfloat16, "cpu")
    peak = _status("VmHWM")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    shards = {f for f in os.listdir(directory) if f.endswith(".safetensors")}
    return {
        "config": checkpoint.config.name, "layers": LAYERS, "dtype": "bfloat16", "checkpoint": "fp8 e4m3, 128x128 scales",
        "shards": len(shards), "shards_opened": len(opened), "baseline_rss_bytes": baseline,
        "peak_rss_bytes": peak, "parameter_bytes": params,
        "above_baseline_bytes": peak - baseline - params, "largest_tensor_bytes": largest * 2,
        "checkpoint_bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in shards),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--size", choices=SIZES, default="default", help="the config (default: default)")
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(_measure(args.child)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or tmp
        _write(directory, args.size)
        out = subprocess.run([sys.executable, __file__, "--child", directory], capture_output=True, text=True,
                             check=True)
    report = json.loads(out.stdout)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    mb = 1 / (1 << 20)
    print(f"{report['config']} --layers {report['layers']}, {report['checkpoint']}, "
          f"{report['checkpoint_bytes'] * mb:.0f} MiB in {report['shards']} shards, {report['shards_opened']} opened")
    print(f"parameters loaded {report['parameter_bytes'] * mb:.1f} MiB; peak RSS above baseline beyond them "
          f"{report['above_baseline_bytes'] * mb:.1f} MiB; largest tensor {report['largest_tensor_bytes'] * mb:.1f} MiB "
          f"(ratio {report['above_baseline_bytes'] / report['largest_tensor_bytes']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
