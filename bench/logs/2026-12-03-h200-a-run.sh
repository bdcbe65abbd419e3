#!/bin/bash
# 2026-12-03 run A (issues 44, 39, 45): the triton backend's invariance tests and the reference
# mode's, the 2026 peers beside the new contracts, the harness's kernel process on CUDA and the
# real kernels through glm-dsa check / compare (the kernel now runs in a forkserver child), then
# the cost of the invariant mode at 2K and 16K with engines reused after a warm-up.
export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True PYTHONPATH=$PWD:/tmp/peer/pkg PYTHONUNBUFFERED=1
date -u +%H:%M:%S; git log --oneline -1 2>/dev/null; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 60 python3 .peer/build_peers.py --prebuilt .peer/prebuilt > $OUT/peers.log 2>&1; echo "peers rc=$?"
timeout 260 python -m pytest -q -rf -p no:cacheprovider -m "cuda or peers" --durations=10 \
  tests/test_invariance_triton.py tests/test_determinism.py tests/test_peers_2026.py \
  tests/test_isolation.py > $OUT/pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $OUT/pytest.log | cut -c1-300 | tail -15
echo "== real kernels through check / compare $(date -u +%H:%M:%S)"
P="python -m glm_dsa"
timeout 60 $P golden --out $OUT/golden > /dev/null 2>&1; echo "golden rc=$?"
run() { name=$1; shift; timeout 60 $P "$@" > $OUT/$name.log 2>&1; echo "$name rc=$?"; grep -m1 -E "cause:|^conventions|^PASS:|^FAIL:" $OUT/$name.log | cut -c1-260; tail -1 $OUT/$name.log | cut -c1-260; }
run flashmla_check check glm_dsa.peers:flash_mla_sparse_fwd --contract flash_mla_sparse_fwd --device cuda --shapes glm-5.3 --cases 10
run flashmla_compare compare --golden $OUT/golden --kernel glm_dsa.peers:flash_mla_sparse_fwd --device cuda
run deepgemm_check check deep_gemm:fp8_mqa_logits --contract fp8_mqa_logits --device cuda --shapes glm-5.3 --cases 12
run deepgemm_compare compare --golden $OUT/golden --kernel deep_gemm:fp8_mqa_logits --device cuda
run deepgemm_paged_check check glm_dsa.peers:fp8_paged_mqa_logits --contract fp8_paged_mqa_logits --device cuda --shapes glm-5.3 --cases 12 --convention deepgemm
rm -rf $OUT/golden
echo "== invariant-mode cost $(date -u +%H:%M:%S)"
timeout 150 python scripts/bench_invariance.py --device cuda --cases triton --repeat 3 \
  --triton-tokens 2048,16384 --out $OUT > $OUT/bench_invariance.log 2>&1; echo "bench rc=$?"
tail -6 $OUT/bench_invariance.log | cut -c1-250
date -u +%H:%M:%S
