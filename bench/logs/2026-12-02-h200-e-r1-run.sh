#!/bin/bash
# Evening R1 (issue 44 diagnosis; leftovers of stop 47): which GLM-5.3 products round a row by
# its call on the H200; the triton backend at one-page chunks against 4,096 (layers 6-7, FP8
# KV, three 2,500-token requests); the MoE budget test after 41b34da; the 2026 peer tests.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 150 python scripts/probe_cuda_invariance.py --out $OUT > $OUT/probe.log 2>&1; echo "probe rc=$?"; cat $OUT/probe.log | cut -c1-220
for c in 64 4096; do
  timeout 120 python -m glm_dsa prefill --config glm-5.3 --layers 6:8 --device cuda --backend triton \
    --tokens 2500 --requests 3 --chunk $c --kv-dtype fp8 --no-progress --save-layer-outputs \
    --save-outputs /tmp/chunk$c.safetensors > $OUT/prefill_chunk$c.log 2>&1; echo "prefill chunk $c rc=$?"; tail -3 $OUT/prefill_chunk$c.log | cut -c1-200
done
python - <<'PY'
from safetensors.torch import load_file
a, b = load_file("/tmp/chunk64.safetensors"), load_file("/tmp/chunk4096.safetensors")
for k in sorted(a):
    x, y = a[k], b[k]
    if x.dtype.is_floating_point:
        d = 1 - 2 * (x.double() * y.double()).sum() / (x.double().square() + y.double().square()).sum()
        print(f"{k:<32} equal={bool((x == y).all())} calc_diff={float(d):.2e}")
    else:
        rows = (x.sort(-1).values != y.sort(-1).values).any(-1).float().mean()
        print(f"{k:<32} equal={bool((x == y).all())} rows_differing={float(rows):.3f}")
PY
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
timeout 200 python -m pytest -q -rf -p no:cacheprovider -m "cuda or peers" --durations=8 \
  tests/test_moe.py tests/test_peers_2026.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed" $OUT/pytest.log | cut -c1-300 | tail -12
date -u +%H:%M:%S
