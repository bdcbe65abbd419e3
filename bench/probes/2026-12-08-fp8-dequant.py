"""Issue 42 (eighth session, extended in the eleventh): the FP8-row Gluon kernel's in-place
dequantization with fewer partition barriers and without conversion instructions, against
HEAD's, on an H100/H200 (needs ``bench/probes/2026-12-08-fp8-dequant.patch`` applied, and
HEAD's ``sparse_mla_gluon.py`` as a file for the baseline in the same process).

The patch, two changes to the gather warpgroup (offline sm_90 SASS per thread and 64-key tile,
Triton 3.6, ``bench/probes/2026-12-07h-offline-fp8-dequant-sass.py``):

1. **Barriers.** Triton's shared-memory barrier analysis tells allocations apart, not slices
   of one, so HEAD's in-place form waits at a partition barrier between each of its 8 chunk
   copies into the raw stage and between its 4 stores into the left half: 19 a tile against
   the bf16 gather's 2. The patch copies the tile's bytes in one ``[8, 64, 64]`` copy and
   stores two chunks at a time through ``[4, 64, 64]`` views of the halves (the same bytes:
   a rank-3 NVMMA layout stacks the 128-byte-swizzled ``[64, 64]`` blocks as the rank-2
   ``[64, 256]`` one does, checked with Triton 3.9's linear layouts): 19 -> 8 barriers,
   1,081 -> 1,043 instructions, 44 -> 15 scalar scale loads, no spill. Four chunks a store
   (5 barriers) spills at the gather's 72 registers (80 too).
2. **Integer dequantization** (``CONFIG["fp8_dequant"]``: "float", HEAD's arithmetic and the
   default; "pow2"; "auto"). ``e4m3 -> f16x2 -> f32, * scale, -> bf16`` is 256 conversions a
   thread and tile; Hopper converts at 16 results a clock an SM, so 4 gather warps spend
   ~2,048 SM cycles a tile, about half of a bf16 tile's ~3,900 (run C), on the chain that
   the next tile's scores wait for. With power-of-two scales (FlashMLA's ue8m0, the pool's
   default) integers give the same bits: a byte ``s eeee mmm`` placed as bf16
   ``s 0000eeee mmm0000`` is ``e4m3 · 2^-120`` exactly (subnormal codes too), and times
   ``scale · 2^120`` in bf16 it is the float32 product rounded once, for scales in
   [2^-124, 2^7] (checked over every finite code and scale on the CPU, and the asm's byte
   placement on random words, below). Two bytes a ``prmt`` (sign replicated into the upper
   byte), a shift, a mask, and an ``HMUL2.BF16`` a pair: with (1), 799 instructions, 4
   conversions, 8 barriers, no spill. ``auto`` decides per stage from the scales (one
   partition-wide min, the float32 path otherwise): 16 bytes of spill, 14 barriers.

Per shape (16,384 queries, top-2048, h_q 64 and 128, the bench's inputs, ue8m0 pool): HEAD's
in-place kernel, the patched one at float / pow2 / auto, CUDA-event medians of 5, each
checked bitwise against HEAD's (out, max_logits, lse), and the bf16 kernel over the same rows
dequantized, for the ``FP8 / bf16`` ratio issue 42 targets (<= 1.1).

    git show HEAD:glm_dsa/kernels/sparse_mla_gluon.py > /tmp/sparse_mla_gluon_head.py
    git apply bench/probes/2026-12-08-fp8-dequant.patch
    python bench/probes/2026-12-08-fp8-dequant.py /tmp/sparse_mla_gluon_head.py \
        [s_kv local ...]   (default 131072 0 131072 0.5)
"""
import importlib.util
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "scripts"))
from bench_sparse_mla import D_QK, SM_SCALE, _indices  # noqa: E402
from benchlib import median_seconds  # noqa: E402

from glm_dsa import oracle  # noqa: E402
from glm_dsa.kernels.sparse_mla_gluon import flash_mla_sparse_fwd_gluon  # noqa: E402


def exact_on_the_cpu() -> int:
    """Mismatches of the integer path's arithmetic against the float32 product rounded once,
    over every finite e4m3 code and every power-of-two scale in [2^-124, 2^7]."""
    b = torch.arange(256, dtype=torch.int32)
    finite = (b & 0x7F) != 0x7F
    bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)
    placed = bits.to(torch.int16).view(torch.bfloat16)
    e4m3 = b.to(torch.uint8).view(torch.float8_e4m3fn).float()
    bad = 0
    for e in range(-124, 8):
        got = placed * torch.tensor(2.0 ** (e + 120), dtype=torch.bfloat16)
        want = (e4m3 * 2.0 ** e).to(torch.bfloat16)
        bad += int((got.view(torch.int16) != want.view(torch.int16))[finite].sum())
    return bad


def _prmt(a: int, b: int, c: int) -> int:
    """PTX ``prmt.b32 d, a, b, c`` (default mode): byte i of d is byte ``c[4i + 2 : 4i]`` of
    ``{b, a}``, or that byte's sign replicated when ``c[4i + 3]`` is set."""
    src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
    d = 0
    for i in range(4):
        n = (c >> 4 * i) & 0xF
        byte = src[n & 7]
        if n & 8:
            byte = 0xFF if byte & 0x80 else 0
        d |= byte << 8 * i
    return d


def placement_mismatches(words: int = 200_000) -> int:
    """The patch's asm (two ``prmt``, shifts, masks) on random 4-byte words against the
    intended bf16 bits ``((b & 0x80) << 8) | ((b & 0x7F) << 4)`` of each byte, in order."""
    import random

    rng, bad = random.Random(0), 0
    for _ in range(words):
        w = rng.getrandbits(32)
        t0 = (_prmt(w, 0, 0x9180) << 4) & 0x87F087F0
        t1 = (_prmt(w, 0, 0xB3A2) << 4) & 0x87F087F0
        got = [t0 & 0xFFFF, t0 >> 16, t1 & 0xFFFF, t1 >> 16]
        bad += got != [((x & 0x80) << 8) | ((x & 0x7F) << 4) for x in w.to_bytes(4, "little")]
    return bad


def _module(path: str):
    """HEAD's ``sparse_mla_gluon`` from a file, beside the patched one."""
    spec = importlib.util.spec_from_file_location("sparse_mla_gluon_head", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    print(f"CPU checks: the arithmetic {exact_on_the_cpu()} mismatches, the byte placement "
          f"{placement_mismatches()}")
    head = _module(sys.argv[1])
    args = sys.argv[2:] or ["131072", "0", "131072", "0.5"]
    s_q = 16384
    print("| s_kv | h_q | local | bf16 ms | HEAD ms | float ms | pow2 ms | auto ms | "
          "float / HEAD | pow2 / HEAD | pow2 / bf16 | HEAD's bits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s_kv, local in zip(map(int, args[::2]), map(float, args[1::2])):
        gen = torch.Generator(device="cuda").manual_seed(0)
        kv = (torch.randn(s_kv, 1, D_QK, device="cuda", generator=gen) / 10).to(torch.bfloat16)
        rows = oracle.quantize_k_cache(kv.view(-1, 64, 1, D_QK)).view(-1, oracle.MLA_ROW_BYTES)
        deq = oracle.dequantize_k_cache(rows.view(-1, 64, 1, oracle.MLA_ROW_BYTES)).view(-1, 1, D_QK)
        idx = _indices(s_q, s_kv, gen, local)
        for h in (64, 128):
            q = (torch.randn(s_q, h, D_QK, device="cuda", generator=gen) / 10).to(torch.bfloat16)

            def fp8(dequant):
                return flash_mla_sparse_fwd_gluon(q, rows, rows.stride(0), s_kv, idx, SM_SCALE,
                                                  None, None, {"fp8_dequant": dequant}, fp8=True)

            def at_head():
                return head.flash_mla_sparse_fwd_gluon(q, rows, rows.stride(0), s_kv, idx,
                                                       SM_SCALE, None, None, fp8=True)

            def bf16():
                return flash_mla_sparse_fwd_gluon(q, deq, deq.stride(0), s_kv, idx, SM_SCALE,
                                                  None, None)

            base = at_head()
            same = all(torch.equal(a, b) for d in ("float", "pow2", "auto")
                       for a, b in zip(base, fp8(d)))
            ms = {name: median_seconds(fn, reps=5) * 1e3 for name, fn in (
                ("bf16", bf16), ("HEAD", at_head), ("float", lambda: fp8("float")),
                ("pow2", lambda: fp8("pow2")), ("auto", lambda: fp8("auto")))}
            print(f"| {s_kv} | {h} | {local} | {ms['bf16']:.2f} | {ms['HEAD']:.2f} | "
                  f"{ms['float']:.2f} | {ms['pow2']:.2f} | {ms['auto']:.2f} | "
                  f"{ms['float'] / ms['HEAD']:.3f} | {ms['pow2'] / ms['HEAD']:.3f} | "
                  f"{ms['pow2'] / ms['bf16']:.3f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
