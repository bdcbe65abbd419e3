"""Issue 42: the gather hint (CONFIG "gather_hint", glm_dsa/kernels/ptx_hints.py) on one H200.

For 16,384 queries x top-2048 at the six rows of issue 42's table (keys 131,072 / h_q 64 and 128
/ local 0 and 0.5; keys 1,048,576 / h_q 64 and 128 / local 0.5), in one process per (keys,
local): CONFIG (gather_hint "none"), each hinted variant and FlashMLA, through
scripts/bench_sparse_mla.py --gluon-variants (its oracle check, and whether each variant's
out / max_logits / lse equal CONFIG's bit for bit, as a cache hint's must). Prints one table;
the bench's output and JSON go under $OUT (or /tmp/hint-probe).

    python3 .peer/build_peers.py --prebuilt .peer/prebuilt
    PYTHONPATH=$PWD:/tmp/peer/pkg python bench/probes/2026-12-04-h200-hint.py
"""
import json
import os
import subprocess
import sys
import time

HINTS = ("evict_last_256b", "evict_last", "256b")
RUNS = ((131_072, 0.0), (131_072, 0.5), (1_048_576, 0.5))  # (keys, local share); h_q 64, 128
out = os.environ.get("OUT") or "/tmp/hint-probe"
os.makedirs(out, exist_ok=True)
variants = [json.dumps({"gather_hint": h}) for h in HINTS]
table = []
t0 = time.time()
BUDGET_S = 230  # the whole probe; each bench process gets what is left (about 40 s each)
for s_kv, local in RUNS:
    name = f"{out}/hint-{s_kv}-local{local}"
    cmd = [sys.executable, "-u", "scripts/bench_sparse_mla.py", "--queries", "16384",
           "--heads", "64", "128", "--s-kv", str(s_kv), "--local", str(local),
           "--forms", "gluon", "flashmla", "--reps", "10", "--out", f"{name}.json",
           "--gluon-variants", *variants]
    try:
        with open(f"{name}.log", "w") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT,
                                timeout=max(30, BUDGET_S - (time.time() - t0))).returncode
    except subprocess.TimeoutExpired:
        rc = "timed out"
    print(f"keys {s_kv} local {local}: rc {rc}, {time.time() - t0:.0f} s so far "
          f"(log {name}.log)", flush=True)
    if rc != 0 or not os.path.exists(f"{name}.json"):
        print(open(f"{name}.log").read()[-3000:], flush=True)
        continue
    for row in json.load(open(f"{name}.json"))["rows"]:
        table.append((s_kv, local, row))


def rate(row, ms):
    return f"{row['gflop'] / ms:.1f}" if isinstance(ms, float) else "err"


def passed(check):
    return isinstance(check, dict) and "error" not in check and all(
        isinstance(r, dict) and r.get("passed") for r in check.values())


# "best vs FlashMLA": FlashMLA's time over the fastest Gluon form's (issue 42 wants >= 1.0);
# "bitwise": every hinted variant's results equal CONFIG's; "oracle": every Gluon form passed.
lines = [["keys", "h_q", "local", "CONFIG", *HINTS, "FlashMLA", "best vs FlashMLA", "bitwise",
          "oracle"]]
notes = []
for s_kv, local, row in table:
    ms = {h: row.get("gluon_variants", {}).get(v) for h, v in zip(HINTS, variants)}
    base = row["gluon_s"] * 1e3 if isinstance(row.get("gluon_s"), float) else None
    flash = row["flashmla_s"] * 1e3 if isinstance(row.get("flashmla_s"), float) else None
    fastest = min([t for t in (base, *ms.values()) if isinstance(t, float)], default=None)
    bitwise = all(row.get("gluon_variants_bitwise", {}).get(v) is True for v in variants)
    oracle = all(passed(c) for c in (row.get("gluon_check"),
                                     *row.get("gluon_variants_check", {}).values()))
    lines.append([str(s_kv), str(row["h_q"]), str(local), rate(row, base),
                  *(rate(row, ms[h]) for h in HINTS), rate(row, flash),
                  f"{flash / fastest:.3f}" if flash and fastest else "n/a",
                  "yes" if bitwise else "NO", "passed" if oracle else "FAILED"])
    for key, val in row.items():  # what failed, from the bench's guarded parts
        if isinstance(val, dict) and "error" in val:
            notes.append(f"  {s_kv}/{row['h_q']}/{local} {key}: {val['error']}")
        elif key.startswith("gluon_variants") and isinstance(val, dict):
            notes += [f"  {s_kv}/{row['h_q']}/{local} {key} {cfg}: {v['error']}"
                      for cfg, v in val.items() if isinstance(v, dict) and "error" in v]
widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
print("\nTFLOP/s, 16,384 queries x top-2048 (FLOPs 2 * s_q * topk * h_q * 1088; median of 10)")
for line in lines:
    print(" | ".join(cell.rjust(w) for cell, w in zip(line, widths)))
print("\n".join(notes))
print(f"\n{time.time() - t0:.0f} s; logs and JSON under {out}")
