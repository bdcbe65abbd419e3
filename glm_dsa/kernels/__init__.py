"""Triton kernels of the fast backend, one module per kernel, each with its oracle's signature.

Imported only on request (``import glm_dsa`` never imports Triton); on the CPU they run under
Triton's interpreter when ``TRITON_INTERPRET=1`` is set before Triton is imported.
"""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    from glm_dsa.kernels._interpreter import (
        cache_np_dtypes,
        patch_for_numpy_2_4,
        skip_nested_lang_patches,
    )

    patch_for_numpy_2_4()
    skip_nested_lang_patches()
    cache_np_dtypes()

from glm_dsa.kernels.indexer import indexer_topk  # noqa: E402, F401
from glm_dsa.kernels.mqa_logits import fp8_mqa_logits, fp8_paged_mqa_logits  # noqa: E402, F401
from glm_dsa.kernels.topk import topk_per_row  # noqa: E402, F401
from glm_dsa.kernels.sparse_mla import flash_mla_sparse_fwd, sparse_mla_fwd_fp8  # noqa: E402, F401
from glm_dsa.kernels.sparse_mla_q8kv8 import sparse_mla_q8kv8_prefill_fwd  # noqa: E402, F401
from glm_dsa.kernels.kv_requant import mla_kv_per_tensor_fp8_paged  # noqa: E402, F401
