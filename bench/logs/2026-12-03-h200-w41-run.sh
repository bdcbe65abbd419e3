#!/bin/bash
# Issue 41 on one H200: layer-major prefill of the whole GLM-5.3 (78 layers, random weights drawn
# on the GPU one layer at a time, FP8 KV, triton backend). One part per device call (each fits
# a 600 s call):
#   bash bench/logs/2026-12-03-h200-w41-run.sh test   # CUDA pytest: layer-major == chunk-major bitwise,
#                                                     # GLM-5.3 layers 6:9 at 32,768 tokens
#   bash bench/logs/2026-12-03-h200-w41-run.sh 131k   # whole model at 131,072 tokens (target <= 45 s)
#   bash bench/logs/2026-12-03-h200-w41-run.sh 1m     # whole model at 1,048,576 tokens (target <= 450 s,
#                                                     # peak <= 130 GB); needs most of one call
# Logs under $OUT: pytest.log, prefill_<part>.out (report: per-step timeline, per-layer table,
# "memory: ... peak X GB during the prefill" = torch.cuda.max_memory_allocated), prefill_<part>.err
# (the memory plan, then one line per layer with its seconds and the ETA).
set -u
part=${1:?usage: $0 test|131k|1m}
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S; git log --oneline -1 2>/dev/null
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name(0))"
whole() {  # $1 tokens, $2 label, $3 timeout seconds
  local t0=$(date +%s)
  timeout "$3" python -m glm_dsa prefill --config glm-5.3 --tokens "$1" --chunk 32768 --device cuda \
    --dtype bfloat16 --kv-dtype fp8 --backend triton --order layer \
    > "$OUT/prefill_$2.out" 2> "$OUT/prefill_$2.err"
  echo "prefill $2 rc=$? wall $(( $(date +%s) - t0 )) s (process start, weights drawn and prefill)"
  grep -A12 "^memory plan" "$OUT/prefill_$2.err"
  grep -E "^prefill: layer " "$OUT/prefill_$2.err" | tail -3
  grep -E "^(memory|weights|prefill):" "$OUT/prefill_$2.out"
  python - "$OUT/prefill_$2.out" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
layers = re.findall(r"^(\d+)\s+(full|shared)\s+([\d.]+)\s+([\d.]+)$", text, re.M)
if layers:
    w = sum(float(x[2]) for x in layers); s = sum(float(x[3]) for x in layers)
    for kind in ("full", "shared"):
        k = [float(x[3]) for x in layers if x[1] == kind]
        if k:
            print(f"{kind}: {len(k)} layers, mean {sum(k) / len(k):.3f} s, min {min(k):.3f}, max {max(k):.3f}")
    print(f"layers: {len(layers)}; steps {s:.1f} s + weights {w:.1f} s = {s + w:.1f} s")
PY
  grep -iE "error|Traceback" "$OUT/prefill_$2.err" | tail -3
}
case "$part" in
  test)
    timeout 560 python -m pytest -q -rf -p no:cacheprovider -m cuda --durations=4 \
      tests/test_layer_major.py > "$OUT/pytest.log" 2>&1; echo "pytest rc=$?"
    grep -E "^(FAILED|ERROR)|passed|failed|^E " "$OUT/pytest.log" | cut -c1-300 | tail -15 ;;
  131k) whole 131072 131k 560 ;;
  1m) whole 1048576 1m 585 ;;
  *) echo "unknown part $part: test, 131k or 1m"; exit 2 ;;
esac
date -u +%H:%M:%S
