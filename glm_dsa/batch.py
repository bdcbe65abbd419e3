"""Ragged-batch metadata shared by the indexer, MLA, the layer and the prefill driver.

One prefill step runs the new tokens ("extend" tokens) of several requests as one ragged
batch. Each query token attends to its own request's whole context: the cached prefix plus the
request's extend tokens up to itself. The context of every request is gathered from the paged
caches through ``kv_slots`` (requests concatenated, in position order), and query row ``m`` may
look at rows ``[ks[m], ke[m])`` of that gathered buffer — SGLang's ``_get_topk_ragged`` and
DeepGEMM's ``fp8_mqa_logits`` use exactly this ``ks``/``ke`` contract.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

__all__ = [
    "CP_SPLITS",
    "INDEX_K_ALLGATHER",
    "LATENT_ALLGATHER",
    "CP_BOUNDARY_GATHER",
    "COMM_OPS",
    "RowGather",
    "ForwardBatch",
]

# How a step's tokens are dealt to context-parallel ranks (``glm_dsa.cp.split_rows``; the
# ledger re-derives the same rule in ``cp_rank_positions``).
CP_SPLITS = ("interleave", "contiguous", "zigzag")
# The gathers of a split step, named as the ledger's communication rows
# (``glm_dsa.ledger.cp_comm_bytes_per_chunk``).
INDEX_K_ALLGATHER = "index_k_allgather"
LATENT_ALLGATHER = "latent_allgather"
CP_BOUNDARY_GATHER = "cp_boundary_gather"
COMM_OPS = (INDEX_K_ALLGATHER, LATENT_ALLGATHER, CP_BOUNDARY_GATHER)


class RowGather(Protocol):
    """What a model layer needs of a context-parallel step: this rank holds some rows of the
    chunk, and every rank must store the whole chunk in its caches.

    ``glm_dsa.cp.CPChunk`` implements it; the model never imports ``glm_dsa.cp``.

    Attributes:
        out_slots: int64 ``[n]``, the whole chunk's cache slots, where gathered rows are stored.
    """

    @property
    def out_slots(self) -> torch.Tensor: ...

    def gather(self, local: torch.Tensor, op: str) -> torch.Tensor:
        """Every rank's ``local [L, ...]`` rows → the chunk's ``[n, ...]`` in chunk order;
        ``op`` (one of ``COMM_OPS``) names the traffic in the counters."""
        ...


@dataclass(frozen=True)
class ForwardBatch:
    """Metadata of one ragged step (n query tokens, R requests, S_kv gathered context rows).

    Attributes:
        positions: int64 ``[n]``, position of each query token within its request.
        out_slots: int64 ``[n]``, physical cache slot (``page * page_size + offset``) each query
            token's KV and index-K are written to.
        kv_slots: int64 ``[S_kv]``, physical slots of every request's context
            ``[0, prefix_len + extend_len)``, requests concatenated.
        ks: int32 ``[n]``, first row of the query's request in the gathered context.
        ke: int32 ``[n]``, ``ks + position + 1``: one past the last row the query may see.
        cu_seqlens_q: int64 ``[R + 1]``, query-row offsets of the requests.
        cu_seqlens_k: int64 ``[R + 1]``, context-row offsets of the requests.
        prefix_lens: the cached prefix length of each request, in tokens.
        extend_lens: the number of new tokens of each request in this step.
    """

    positions: torch.Tensor
    out_slots: torch.Tensor
    kv_slots: torch.Tensor
    ks: torch.Tensor
    ke: torch.Tensor
    cu_seqlens_q: torch.Tensor
    cu_seqlens_k: torch.Tensor
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def num_requests(self) -> int:
        return len(self.extend_lens)

    @property
    def max_kv_len(self) -> int:
        """Longest context (prefix + extend) in the batch, in tokens."""
        return max(p + e for p, e in zip(self.prefix_lens, self.extend_lens))

    @classmethod
    def from_slots(
        cls,
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        context_slots: Sequence[torch.Tensor],
        device: torch.device | str | None = None,
    ) -> "ForwardBatch":
        """Build the metadata from each request's context slots.

        ``context_slots[r]`` is an int64 tensor of ``prefix_lens[r] + extend_lens[r]`` physical
        slots, in position order; its last ``extend_lens[r]`` entries are where this step writes.
        """
        if not (len(prefix_lens) == len(extend_lens) == len(context_slots)):
            raise ValueError(
                "prefix_lens, extend_lens and context_slots need one entry per request, got "
                f"{len(prefix_lens)}, {len(extend_lens)}, {len(context_slots)}"
            )
        if len(extend_lens) == 0:
            raise ValueError("a batch needs at least one request")
        positions, out_slots, ks, ke = [], [], [], []
        cu_q, cu_k = [0], [0]
        for p, e, slots in zip(prefix_lens, extend_lens, context_slots):
            if p < 0 or e < 1:
                raise ValueError(f"prefix_len={p} must be ≥ 0 and extend_len={e} ≥ 1")
            if slots.dtype != torch.int64 or slots.shape != (p + e,):
                raise ValueError(
                    f"context slots must be int64 of shape ({p + e},), got {slots.dtype} "
                    f"{tuple(slots.shape)}"
                )
            pos = torch.arange(p, p + e, dtype=torch.int64)
            positions.append(pos)
            out_slots.append(slots[p:].cpu())
            ks.append(torch.full((e,), cu_k[-1], dtype=torch.int32))
            ke.append((cu_k[-1] + pos + 1).to(torch.int32))
            cu_q.append(cu_q[-1] + e)
            cu_k.append(cu_k[-1] + p + e)
        dev = torch.device(device) if device is not None else context_slots[0].device
        return cls(
            positions=torch.cat(positions).to(dev),
            out_slots=torch.cat(out_slots).to(dev),
            kv_slots=torch.cat([s.cpu() for s in context_slots]).to(dev),
            ks=torch.cat(ks).to(dev),
            ke=torch.cat(ke).to(dev),
            cu_seqlens_q=torch.tensor(cu_q, dtype=torch.int64, device=dev),
            cu_seqlens_k=torch.tensor(cu_k, dtype=torch.int64, device=dev),
            prefix_lens=tuple(int(p) for p in prefix_lens),
            extend_lens=tuple(int(e) for e in extend_lens),
        )

    @classmethod
    def contiguous(
        cls,
        extend_lens: Sequence[int],
        prefix_lens: Sequence[int] | None = None,
        device: torch.device | str | None = None,
    ) -> "ForwardBatch":
        """Metadata for a flat, unpaged buffer: request r's context occupies consecutive slots.

        Slot ``cu_seqlens_k[r] + i`` holds position ``i`` of request ``r``, so ``kv_slots`` is
        ``arange(S_kv)``. Convenient for tests of the indexer and MLA without a paged cache.
        """
        prefix_lens = [0] * len(extend_lens) if prefix_lens is None else list(prefix_lens)
        slots, start = [], 0
        for p, e in zip(prefix_lens, extend_lens):
            slots.append(torch.arange(start, start + p + e, dtype=torch.int64))
            start += p + e
        return cls.from_slots(prefix_lens, extend_lens, slots, device=device or "cpu")

    def to(self, device: torch.device | str) -> "ForwardBatch":
        move = {
            k: getattr(self, k).to(device)
            for k in ("positions", "out_slots", "kv_slots", "ks", "ke", "cu_seqlens_q", "cu_seqlens_k")
        }
        return ForwardBatch(**move, prefix_lens=self.prefix_lens, extend_lens=self.extend_lens)
