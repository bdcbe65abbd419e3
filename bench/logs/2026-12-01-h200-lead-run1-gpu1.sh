#!/usr/bin/env bash
# Lead's H200 run 1 (2026-12-01): GPU tests of the merged tree, the one-layer memory target, fidelity at 32K.
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers-install.log 2>&1 || echo "peer install failed"
export PYTHONPATH=/tmp/peer/pkg:$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee $OUT/gpu.txt
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a $OUT/gpu.txt
echo "== pytest cuda or peers"
timeout 330 python3 -m pytest -q -rA -p no:cacheprovider -m "cuda or peers" > $OUT/pytest-cuda.log 2>&1; echo "rc=$?"
tail -4 $OUT/pytest-cuda.log; grep -E "^(FAILED|ERROR)" $OUT/pytest-cuda.log | head -20
echo "== bench_invariance"
timeout 150 python3 scripts/bench_invariance.py --out $OUT > $OUT/bench_invariance.log 2>&1; echo "rc=$?"; tail -8 $OUT/bench_invariance.log
echo "== prefill glm-5.3 layer 6, 131072 tokens (memory)"
timeout 90 python3 -m glm_dsa prefill --config glm-5.3 --layers 6:7 --tokens 131072 --device cuda --no-progress > $OUT/prefill-131k.log 2>&1; echo "rc=$?"
cat $OUT/prefill-131k.log | tail -12
echo "== fidelity glm-5.3 layer 6:8, 32768 tokens"
( time timeout 150 python3 -m glm_dsa fidelity --config glm-5.3 --layers 6:8 --tokens 32768 --device cuda --rows 256 --json > $OUT/fidelity-32k.json ) 2> $OUT/fidelity-32k.err; echo "rc=$?"
tail -4 $OUT/fidelity-32k.err
python3 - <<'PY'
import json, os
try:
    r = json.load(open(os.environ["OUT"] + "/fidelity-32k.json"))
    print("seconds", r["seconds"])
    for lay in r["layers"]:
        s = lay["summary"][-1]
        print(lay["layer"], lay["kind"], {k: round(v, 4) for k, v in s.items() if isinstance(v, float)})
except Exception as e:
    print("fidelity json unreadable:", e)
PY
