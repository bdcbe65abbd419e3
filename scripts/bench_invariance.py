"""The cost of batch invariance (PrefillEngine(batch_invariant=True)).

Reference backend (``--cases small,glm``), two cases, each timed with the switch off and on,
best of ``--repeat`` after a warm-up:

* ``small``: one step of the `small` preset in float32 (fp32 KV): 512 new tokens over a
  512-token prefix;
* ``glm-5.3[6:7]``: one GLM-5.3 layer (layer 6: full indexer, MoE) in bf16, FP8 KV, random
  weights, one 8,192-token step (``--glm-tokens``).

Each case also checks what the switch promises: the step's new rows run alone (as a one-request
step of its own) against the same rows run beside another request, bitwise (``equal``) and the
largest relative difference.

Triton backend (``--cases triton``, CUDA): one GLM-5.3 full layer as ``scripts/bench.py``
builds it (bf16, FP8 KV, chunk 32,768, steps of up to 16K tokens from CUDA graphs) prefilling
one prompt of each ``--triton-tokens`` length with the switch off and on (best of ``--repeat``
on one engine per mode, after a warm-up prefill of the same length on it, which autotunes and
captures the graphs), and at each length up to 16K its rows alone against the same prompt run
beside another request in one-page (64-token) steps (``equal``).

Prints a table; ``--out DIR`` writes ``bench_invariance.json``.

    python scripts/bench_invariance.py --device cuda --out results/
    python scripts/bench_invariance.py --cases triton --triton-tokens 2048,16384,131072,1048576
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from glm_dsa.config import PRESETS, keep_layers
from glm_dsa.prefill import PrefillEngine
from glm_dsa.weights import build_model, init_weights

from benchlib import sync


def _engine(model, kv, invariant, pages):
    return PrefillEngine(model, num_pages=pages, kv_dtype=kv, chunked_prefill_size=1 << 20,
                         compute_logits=False, batch_invariant=invariant)


def _step_seconds(model, prefix, new, kv, invariant, device, repeat):
    """Best wall seconds of the step that runs ``new`` after ``prefix`` (prefix-cache hit)."""
    best, out = float("inf"), None
    pages = 2 * (prefix.numel() + new.numel()) // model.config.page_size + 8
    for _ in range(repeat + 1):  # the first is the warm-up
        eng = _engine(model, kv, invariant, pages)
        if prefix.numel():
            eng.warm_up(prefix)
        rid = eng.add_request(torch.cat([prefix, new]).to(device))
        sync(device)
        t = time.perf_counter()
        eng.run()
        sync(device)
        best = min(best, time.perf_counter() - t)
        out = eng.output_hidden(rid)
    return best, out


def _beside(model, prefix, new, other, kv, invariant, device):
    """The same request's new rows, with ``other`` sharing its step."""
    pages = 2 * (prefix.numel() + new.numel() + other.numel()) // model.config.page_size + 8
    eng = _engine(model, kv, invariant, pages)
    if prefix.numel():
        eng.warm_up(prefix)
    eng.add_request(other.to(device))
    rid = eng.add_request(torch.cat([prefix, new]).to(device))
    eng.run()
    return eng.output_hidden(rid)


def run_case(name, model, prefix_len, new_len, kv, device, repeat):
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, vocab, (prefix_len,), generator=g)
    new = torch.randint(0, vocab, (new_len,), generator=g)
    other = torch.randint(0, vocab, (max(64, new_len // 4) + 17,), generator=g)
    row = {"case": name, "prefix": prefix_len, "tokens": new_len}
    for invariant in (False, True):
        key = "on" if invariant else "off"
        seconds, alone = _step_seconds(model, prefix, new, kv, invariant, device, repeat)
        beside = _beside(model, prefix, new, other, kv, invariant, device)
        diff = ((beside.float() - alone.float()).abs().max() / alone.float().abs().max()).item()
        row[f"seconds_{key}"] = seconds
        row[f"equal_{key}"] = bool(torch.equal(beside, alone))
        row[f"rel_diff_{key}"] = diff
    row["cost"] = row["seconds_on"] / row["seconds_off"]
    return row


def _triton_engine(model, lengths, invariant, chunk=32768):
    return PrefillEngine.for_prompts(model, lengths, kv_dtype="fp8", chunked_prefill_size=chunk,
                                     prefix_caching=False, compute_logits=False, backend="triton",
                                     batch_invariant=invariant)


def _timed(eng, prompts):
    """Wall seconds of ``eng`` prefilling ``prompts`` together, and their hidden states."""
    rids = [eng.add_request(p) for p in prompts]
    sync("cuda")
    t = time.perf_counter()
    eng.run()
    sync("cuda")
    return time.perf_counter() - t, [eng.output_hidden(r) for r in rids]


def run_triton(tokens, repeat):
    """Rows of the triton cost table, one per prompt length. Each mode's engine is built once
    and warmed up by a first prefill of the same length (which autotunes and captures the
    graphs); the timed prefills then replay them, as a server's steps would."""
    from bench import _one_layer_model

    model = _one_layer_model()
    vocab = model.config.vocab_size
    rows = []
    for n in tokens:
        g = torch.Generator().manual_seed(n)
        ids = torch.randint(0, vocab, (n,), generator=g).cuda()
        other = torch.randint(0, vocab, (n // 3 + 17,), generator=g).cuda()
        row = {"case": f"glm-5.3 layer, triton, {n} tokens", "tokens": n}
        for invariant in (False, True):
            key = "on" if invariant else "off"
            eng = _triton_engine(model, [n], invariant)
            times = [_timed(eng, [ids]) for _ in range(repeat + 1)]
            row[f"seconds_{key}"] = min(t for t, _ in times[1:])
            del eng
            if n <= 16384:
                beside = _timed(_triton_engine(model, [n, other.numel()], invariant, chunk=64),
                                [other, ids])[1][1]
                alone = times[-1][1][0]
                row[f"equal_{key}"] = bool(torch.equal(beside, alone))
                row[f"rel_diff_{key}"] = ((beside.float() - alone.float()).abs().max()
                                          / alone.float().abs().max()).item()
            print(json.dumps(row), flush=True)
        row["cost"] = row["seconds_on"] / row["seconds_off"]
        rows.append(row)
    del model
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cases", default="small,glm", help="comma list of small, glm")
    ap.add_argument("--glm-tokens", type=int, default=8192)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--triton-tokens", default="2048,16384,131072",
                    help="prompt lengths of the triton case (comma list)")
    ap.add_argument("--out", help="directory for bench_invariance.json")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    rows = []
    if "small" in args.cases:
        model = init_weights(build_model(PRESETS["small"], torch.float32, device), 0).eval()
        rows.append(run_case("small fp32, 1 step", model, 512, 512, "fp32", device, args.repeat))
        del model
    if "glm" in args.cases:
        cfg = keep_layers(PRESETS["glm-5.3"], "6:7")
        model = init_weights(build_model(cfg, torch.bfloat16, device), 0).eval()
        rows.append(run_case(f"glm-5.3[6:7] bf16 fp8-KV, {args.glm_tokens}", model, 0,
                             args.glm_tokens, "fp8", device, args.repeat))
        del model
    if "triton" in args.cases:
        rows += run_triton([int(t) for t in args.triton_tokens.split(",")], args.repeat)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}"
    print(f"batch invariance cost on {name}, torch {torch.__version__}")
    print(f"{'case':<34} {'off s':>8} {'on s':>8} {'on/off':>7} {'equal off':>10} {'equal on':>9} {'diff off':>9} {'diff on':>8}")
    for r in rows:
        eq = [str(r.get(k, "-")) for k in ("equal_off", "equal_on")]
        diff = [f"{r[k]:.1e}" if k in r else "-" for k in ("rel_diff_off", "rel_diff_on")]
        print(f"{r['case']:<34} {r['seconds_off']:8.3f} {r['seconds_on']:8.3f} {r['cost']:7.2f} "
              f"{eq[0]:>10} {eq[1]:>9} {diff[0]:>9} {diff[1]:>8}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_invariance.json"), "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
