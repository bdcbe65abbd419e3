"""The real kernels the oracle mirrors, behind the oracle's own signatures.

DeepGEMM (54e2261, v2.6.1) and FlashMLA's SM90 sparse prefill (9241ae3) are imported lazily,
only when a function here is called; neither is a dependency of glm-dsa. Each function takes
exactly the arguments of the ``glm_dsa.oracle`` function of the same name, so a test or the
bench can call the oracle and the peer on the same inputs; where the upstream call differs, the
adapter says how:

* ``fp8_mqa_logits``: none (upstream names the range ``cu_seq_len_k_start/end``).
* ``fp8_paged_mqa_logits``: builds upstream's ``schedule_meta`` with
  ``get_paged_mqa_logits_metadata(context_lens, block_size, num_sms)``; 54e2261 takes only 2-D
  ``context_lens``, so a 1-D ``[B]`` one becomes ``[B, next_n]`` with row ``(b, j)`` seeing
  positions ``< ctx_b − next_n + j + 1`` (the oracle's 1-D meaning).
* ``flash_mla_sparse_fwd``: the kernel's ``out`` is bf16; the others are float32. ``q`` and
  ``kv`` must be bf16, ``d_qk = 576``, ``h_q`` 64 or 128 (the SM90 build).

For the ``peers`` backend (``glm_dsa.backend``) it also has the layer's two operations in the
backend's signatures: ``indexer_topk`` (DeepGEMM logits in ``row_chunks.chunked_topk``'s budgeted
row chunks, each chunk's top-k by the triton backend's radix select) and ``paged_sparse_mla``
(FlashMLA over a bf16 pool read in place through slot numbers).
"""

from __future__ import annotations

import importlib

import torch
from torch import Tensor

__all__ = ["available", "missing", "fp8_mqa_logits", "fp8_paged_mqa_logits", "flash_mla_sparse_fwd",
           "indexer_topk", "paged_sparse_mla"]

TRITON = "triton"  # the package the radix select needs
DEEP_GEMM = "deep_gemm"
FLASH_MLA = "flash_mla_sparse_sm90"


def available(module: str) -> bool:
    """Whether the peer ``module`` (``DEEP_GEMM`` or ``FLASH_MLA``) imports here."""
    try:
        importlib.import_module(module)
    except (ImportError, OSError, RuntimeError):  # absent, or its .so does not load here
        return False
    return True


def missing(device: torch.device | str) -> str:
    """Why the peer kernels cannot run on ``device`` (one line naming the fix), or ``""``."""
    if torch.device(device).type != "cuda":
        return f"DeepGEMM and FlashMLA run on CUDA devices, not {torch.device(device).type}; use --device cuda"
    absent = [m for m in (TRITON, DEEP_GEMM, FLASH_MLA) if not available(m)]
    if absent:
        return (f"{', '.join(absent)} do(es) not import; build the peer kernels (peer/build_peers.py) "
                "and put them on PYTHONPATH, or choose the triton backend")
    return ""


def _module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise ImportError(
            f"{name} is not importable: build or install the peer kernels and put them on "
            f"PYTHONPATH ({e})"
        ) from e


def fp8_mqa_logits(
    q: Tensor,
    kv: tuple[Tensor, Tensor],
    weights: Tensor,
    cu_seqlen_ks: Tensor,
    cu_seqlen_ke: Tensor,
    clean_logits: bool = True,
    max_seqlen_k: int = 0,
) -> Tensor:
    """``deep_gemm.fp8_mqa_logits``: q ``[S, H, D]`` e4m3, kv ``(k_fp8 [S_kv, D], k_scale [S_kv])``,
    weights ``[S, H]`` float32, ks / ke int32 ``[S]``. Returns float32 ``[S, S_kv]``, or
    ``[S, max_seqlen_k]`` (compressed, with ``clean_logits=False``) when ``max_seqlen_k > 0``."""
    return _module(DEEP_GEMM).fp8_mqa_logits(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits,
                                             max_seqlen_k)


def paged_context_lens_2d(context_lens: Tensor, next_n: int) -> Tensor:
    """1-D ``[B]`` context lengths → DeepGEMM 54e2261's 2-D ``[B, next_n]``: row ``(b, j)`` sees
    positions ``< ctx_b − next_n + j + 1``. A 2-D input is returned as int32, contiguous."""
    if context_lens.dim() == 2:
        return context_lens.to(torch.int32).contiguous()
    offsets = torch.arange(next_n, device=context_lens.device) - next_n + 1
    return (context_lens[:, None].to(torch.int64) + offsets[None, :]).to(torch.int32).contiguous()


def fp8_paged_mqa_logits(
    q: Tensor,
    kv_cache: Tensor,
    weights: Tensor,
    context_lens: Tensor,
    block_table: Tensor,
    max_context_len: int,
    clean_logits: bool = False,
) -> Tensor:
    """``deep_gemm.fp8_paged_mqa_logits`` with its ``schedule_meta`` built here.

    q ``[B, next_n, H, D]`` e4m3; kv_cache uint8 ``[num_blocks, 64, 1, D + 4]``; weights
    ``[B · next_n, H]`` float32; context_lens int32 ``[B]`` or ``[B, next_n]``; block_table
    int32 ``[B, max_blocks]``. Returns float32 ``[B · next_n, max_context_len]``; DeepGEMM
    leaves entries outside each row's positions unspecified unless it cleans them.
    """
    dg = _module(DEEP_GEMM)
    lens = paged_context_lens_2d(context_lens, q.shape[1])
    meta = dg.get_paged_mqa_logits_metadata(lens, kv_cache.shape[1], dg.get_num_sms())
    return dg.fp8_paged_mqa_logits(
        q, kv_cache, weights, lens, block_table, meta, max_context_len, clean_logits
    )


def flash_mla_sparse_fwd(
    q: Tensor,
    kv: Tensor,
    indices: Tensor,
    sm_scale: float,
    d_v: int = 512,
    attn_sink: Tensor | None = None,
    topk_length: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """FlashMLA's SM90 sparse prefill (``flash_mla.flash_mla_sparse_fwd``'s kernel).

    q bf16 ``[s_q, h_q, 576]``, kv bf16 ``[s_kv, 1, 576]``, indices int32 ``[s_q, 1, topk]``,
    attn_sink float32 ``[h_q]``, topk_length int32 ``[s_q]``. Returns ``(out [s_q, h_q, d_v]``
    bf16, ``max_logits [s_q, h_q]``, ``lse [s_q, h_q]`` float32): natural log, ``lse = +inf``
    and ``max_logits = −inf`` on a row with no valid index.
    """
    out, max_logits, lse = _module(FLASH_MLA).sparse_prefill_fwd(
        q, kv, indices, sm_scale, d_v, attn_sink, topk_length
    )
    return out, max_logits, lse


def indexer_topk(
    q_fp8: Tensor,
    weights: Tensor,
    k_fp8: Tensor,
    k_scale: Tensor,
    ks: Tensor,
    ke: Tensor,
    topk: int,
    budget_bytes: int,
) -> Tensor:
    """``glm_dsa.indexer.indexer_topk``'s contract (ascending within a row) with DeepGEMM's
    ``fp8_mqa_logits`` scoring each budgeted row chunk and the radix select of
    ``glm_dsa.kernels.topk`` choosing in it.

    Args:
        q_fp8: ``[S, H, D]`` float8_e4m3fn; ``weights``: ``[S, H]`` float32.
        k_fp8: ``[S_kv, D]`` float8_e4m3fn; ``k_scale``: ``[S_kv]`` float32.
        ks, ke: int32 ``[S]``; topk: indices per row; budget_bytes: float32 logits at once.

    Returns:
        int32 ``[S, topk]`` relative to ``ks``, ``-1`` padded.
    """
    from glm_dsa.kernels.indexer import select_in_chunks
    from glm_dsa.validate import check_indexer_topk_inputs

    check_indexer_topk_inputs(q_fp8, weights, k_fp8, k_scale, ks, ke, topk)
    dg = _module(DEEP_GEMM)

    def chunk_logits(chunk) -> Tensor:
        r0, r1, lo, hi = chunk.r0, chunk.r1, chunk.lo, chunk.hi
        # clean_logits=False: the select reads only [start, end) of each row.
        return dg.fp8_mqa_logits(q_fp8[r0:r1], (k_fp8[lo:hi], k_scale[lo:hi]), weights[r0:r1],
                                 chunk.starts.to(torch.int32), chunk.ends.to(torch.int32), False)

    return select_in_chunks(q_fp8, weights, k_fp8, k_scale, ks, ke, topk, budget_bytes, chunk_logits)


def paged_sparse_mla(query: Tensor, pool: Tensor, slots: Tensor, sm_scale: float,
                     d_v: int) -> tuple[Tensor, Tensor, Tensor]:
    """FlashMLA's sparse prefill over a bf16 pool ``[num_pages, page_size, 576]`` read in place:
    ``query`` bf16 ``[n, h_q, 576]``, ``slots`` int32 ``[n, topk]`` global slot numbers (``-1``
    skipped). Returns ``(out [n, h_q, d_v]`` bf16, ``max_logits``, ``lse``)."""
    return flash_mla_sparse_fwd(query, pool.view(-1, 1, pool.shape[-1]), slots[:, None, :],
                                sm_scale, d_v)
