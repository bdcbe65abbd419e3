#!/bin/bash
# 2026-12-03 run J (issue 43), one device call on nvidia-h200, on the merged tree: the CUDA tests of
# the Gluon logits kernel in its final form (TMA loader, two consumers taking turns, 128-key tiles),
# which helper g43's runs had taken only on earlier forms. Logs: $OUT/j-pytest.log.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
date -u +%H:%M:%S; python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 200 python -m pytest -m cuda -q -rf -p no:cacheprovider --durations=5 tests/test_kernels_mqa_logits_gluon.py \
  > $OUT/j-pytest.log 2>&1; echo "pytest rc=$?"
grep -E "^(FAILED|ERROR)|passed|failed|^E  " $OUT/j-pytest.log | cut -c1-300 | tail -12
date -u +%H:%M:%S
