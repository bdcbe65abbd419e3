"""The output buffers of a sparse MLA launch, shared by the Triton kernel
(``kernels.sparse_mla``) and the Gluon one (``kernels.sparse_mla_gluon``), below both."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["launch_buffers"]


def launch_buffers(q: Tensor, d_v: int, indices: Tensor, attn_sink: Tensor | None,
                   topk_length: Tensor | None):
    """What both kernels' launches take: empty ``out [s_q, h_q, d_v]`` (q's dtype),
    ``max_logits`` and ``lse [s_q, h_q]`` float32, the float32 sink (or None), contiguous
    lengths (or None) and the indices as ``[s_q, topk]``."""
    s_q, h_q, _ = q.shape
    out = torch.empty((s_q, h_q, d_v), dtype=q.dtype, device=q.device)
    max_logits = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    lse = torch.empty((s_q, h_q), dtype=torch.float32, device=q.device)
    sink = None if attn_sink is None else attn_sink.to(torch.float32).contiguous()
    lengths = None if topk_length is None else topk_length.contiguous()
    return out, max_logits, lse, sink, lengths, indices[:, 0, :]
