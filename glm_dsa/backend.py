"""Which implementation runs a DSA layer's two hot operations: the reference or Triton kernels.

The reference (``glm_dsa.indexer``, ``glm_dsa.mla``) is the oracle: exact FP8 indexer logits in
float64 and float32-accurate sparse attention over the gathered context. The ``triton`` backend
(``glm_dsa.kernels``) swaps in, with the same contracts,

* the indexer's top-k: Triton FP8 logits (float32 tensor-core accumulation, checked with
  DeepGEMM's ``calc_diff``) in the same budgeted row chunks, and a per-row selection whose order
  inside a row is free (set semantics);
* absorbed sparse attention that reads the selected rows straight from the paged KV pool (FP8
  656-byte rows dequantized in the kernel, or bf16 / fp32 rows), so no layer gathers its whole
  context; queries and the absorption GEMMs run in the activation dtype (bf16 on the GPU).

The triton backend takes the absorbed sparse form at every length: where a context has no
more than ``index_topk`` keys, the top-k keeps them all and sparse attention is the dense result,
so the reference's MHA one-shot form (float32, expanded per head) is not needed. Projections and
the MoE are shared.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from glm_dsa.indexer import indexer_topk

__all__ = ["BACKENDS", "Backend", "REFERENCE", "get_backend"]

BACKENDS = ("auto", "reference", "triton")

# (query [n, H, d_qk], pool [num_pages, page_size, row], slots int32 [n, topk], sm_scale, d_v)
# -> (out [n, H, d_v], max_logits [n, H], lse [n, H]), FlashMLA's sparse prefill outputs.
PagedSparseMLA = Callable[[Tensor, Tensor, Tensor, float, int], tuple[Tensor, Tensor, Tensor]]


@dataclass(frozen=True)
class Backend:
    """The implementations a ``DecoderLayer`` calls.

    Attributes:
        name: ``"reference"`` or ``"triton"``.
        indexer_topk: ``glm_dsa.indexer.indexer_topk``'s signature and output contract.
        paged_sparse_mla: sparse attention reading the pool through global slot numbers, or None
            to gather the context and run the reference ``sparse_mla_fwd``.
    """

    name: str
    indexer_topk: Callable[..., Tensor]
    paged_sparse_mla: PagedSparseMLA | None = None


REFERENCE = Backend("reference", indexer_topk)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_paged_sparse_mla(query, pool, slots, sm_scale, d_v):
    from glm_dsa import kernels

    indices = slots[:, None, :]
    if pool.dtype == torch.uint8:  # FP8 rows
        return kernels.sparse_mla_fwd_fp8(query, pool.view(-1, pool.shape[-1]), indices, sm_scale, d_v)
    return kernels.flash_mla_sparse_fwd(query, pool.view(-1, 1, pool.shape[-1]), indices, sm_scale, d_v)


def get_backend(name: str, device: torch.device | str) -> Backend:
    """The backend ``name`` (one of ``BACKENDS``) for models on ``device``.

    ``auto`` is ``triton`` on a CUDA device when Triton imports, else ``reference``. ``triton``
    on the CPU needs ``TRITON_INTERPRET=1`` (Triton's interpreter: exact but slow, for tests).
    """
    if name not in BACKENDS:
        raise ValueError(f"backend={name!r}: choose one of {', '.join(BACKENDS)}")
    device = torch.device(device)
    if name == "auto":
        name = "triton" if device.type == "cuda" and _triton_importable() else "reference"
    if name == "reference":
        return REFERENCE
    if not _triton_importable():
        raise ValueError("the triton backend needs the triton package: pip install triton "
                         "(or choose the reference backend)")
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"the triton backend runs on CUDA devices, not {device.type}; on the CPU "
                         "set TRITON_INTERPRET=1 before starting Python (Triton's slow interpreter)")
    from glm_dsa import kernels

    return Backend("triton", kernels.indexer_topk, _triton_paged_sparse_mla)
