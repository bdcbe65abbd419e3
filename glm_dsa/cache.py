"""Paged caches: a page allocator and the two per-layer cache pools (main MLA KV, index K).

A physical token slot is ``page * page_size + offset``. Every layer has a main KV pool with one
row per slot; only full layers have an index-K pool (shared layers reuse another layer's top-k
and never score). Both pools of a layer are addressed by the same slots, as in SGLang's
``DSATokenToKVPool``, so a request's page table serves both.

Main KV row formats (``kv_dtype``):
    ``"fp8"``  FlashMLA ``V32_FP8Sparse``: 656 bytes/token for GLM-5.3 (see ``kv_format``);
    ``"bf16"`` 1152 bytes/token: the latent ``[c | k_pe]`` in bf16;
    ``"fp32"`` / ``"fp64"``: the latent unrounded, for equivalence tests in full precision.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

import torch

from glm_dsa import syncfree
from glm_dsa.config import DSAConfig
from glm_dsa.kv_format import (
    index_k_page_bytes,
    mla_kv_dequantize,
    mla_kv_load,
    mla_kv_quantize,
    mla_kv_row_bytes,
    mla_kv_store,
)

__all__ = ["PageAllocator", "KVCache", "KV_DTYPES"]

_PLAIN_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
KV_DTYPES = ("fp8", *_PLAIN_DTYPES)


class PageAllocator:
    """Free list of ``num_pages`` pages with reference counts (a prefix-cache hit shares pages).

    Pages are handed out in free-list order (lowest first at start, then in release order), so
    a run is deterministic.
    """

    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be ≥ 1")
        self.num_pages = num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._refs = [0] * num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self, count: int) -> list[int] | None:
        """``count`` fresh pages, or None when fewer are free (never a partial allocation)."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} pages")
        if count > len(self._free):
            return None
        pages = [self._free.popleft() for _ in range(count)]
        for p in pages:
            self._refs[p] = 1
        return pages

    def retain(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} is free; only a page in use can be shared")
            self._refs[p] += 1

    def release(self, pages: Iterable[int]) -> None:
        for p in pages:
            if self._refs[p] < 1:
                raise ValueError(f"page {p} released more often than it was taken")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)


class KVCache:
    """The cache pools of every layer of ``config`` over ``num_pages`` pages of ``page_size`` tokens.

    ``mla[layer]``: main KV rows, uint8 ``[num_pages, page_size, row_bytes]`` for FP8, or a typed
    ``[num_pages, page_size, kv_lora_rank + qk_rope_head_dim]`` tensor otherwise.
    ``index_k[layer]`` (full layers only): uint8 ``[num_pages, page_size * (index_head_dim + 4)]``.

    ``write_mla`` refuses a row holding NaN or inf in every ``kv_dtype`` (the FP8 format cannot
    store one; a bf16 or fp32 row would poison every later query silently). With
    ``track_writes=True`` (a debugging aid: one bool per slot per layer, and a check that
    synchronizes on CUDA) ``read_mla`` refuses slots never written since the cache was built,
    which would otherwise read back as plausible zeros. Kernels reading the pools directly
    (the triton backend) and the index-K pages are outside this check.
    """

    def __init__(
        self,
        config: DSAConfig,
        num_pages: int,
        kv_dtype: str = "fp8",
        device: torch.device | str = "cpu",
        track_writes: bool = False,
    ) -> None:
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"kv_dtype={kv_dtype!r}: choose one of {KV_DTYPES}")
        if num_pages < 1:
            raise ValueError(f"num_pages={num_pages} must be ≥ 1")
        self.config = config
        self.num_pages = num_pages
        self.page_size = config.page_size
        self.kv_dtype = kv_dtype
        self.device = torch.device(device)
        self.layers = tuple(range(config.num_hidden_layers))
        width = config.kv_latent_dim
        self.mla: dict[int, torch.Tensor] = {}
        self.index_k: dict[int, torch.Tensor] = {}
        for layer in self.layers:
            if kv_dtype == "fp8":
                row = mla_kv_row_bytes(config.kv_lora_rank, config.qk_rope_head_dim, "fp8")
                self.mla[layer] = torch.zeros(
                    num_pages, self.page_size, row, dtype=torch.uint8, device=self.device
                )
            else:
                self.mla[layer] = torch.zeros(
                    num_pages, self.page_size, width, dtype=_PLAIN_DTYPES[kv_dtype], device=self.device
                )
            if config.is_full(layer):
                self.index_k[layer] = torch.zeros(
                    num_pages,
                    index_k_page_bytes(self.page_size, config.index_head_dim),
                    dtype=torch.uint8,
                    device=self.device,
                )
        self.written: dict[int, torch.Tensor] | None = None
        if track_writes:
            self.written = {layer: torch.zeros(num_pages * self.page_size, dtype=torch.bool, device=self.device)
                            for layer in self.layers}

    @property
    def mla_row_bytes(self) -> int:
        """Bytes of one token's main-KV row in this cache (656 / 1152 for GLM-5.3 fp8 / bf16)."""
        t = self.mla[self.layers[0]]
        return t.shape[-1] * t.element_size()

    def pool_bytes(self) -> dict[str, int]:
        """Bytes allocated for each pool kind, all layers together."""
        return {
            "mla": sum(t.numel() * t.element_size() for t in self.mla.values()),
            "index_k": sum(t.numel() * t.element_size() for t in self.index_k.values()),
        }

    def _check_slots(self, slots: torch.Tensor) -> None:
        if slots.dtype != torch.int64 or slots.dim() != 1:
            raise ValueError(f"slots must be a 1-D int64 tensor, got {slots.dtype} {tuple(slots.shape)}")
        capacity = self.num_pages * self.page_size
        if slots.numel():
            syncfree.check((slots.min() >= 0) & (slots.max() < capacity),
                           f"slot out of the pool: slots must lie in [0, {capacity}) "
                           f"({self.num_pages} pages × {self.page_size})")

    def write_mla(self, layer: int, slots: torch.Tensor, kv_latent: torch.Tensor) -> None:
        """Store ``kv_latent [n, kv_lora_rank + rope]`` (``[c | k_pe]``) at ``slots [n]``."""
        self._check_slots(slots)
        cfg = self.config
        if kv_latent.shape != (slots.numel(), cfg.kv_latent_dim):
            raise ValueError(
                f"kv_latent must be [{slots.numel()}, {cfg.kv_latent_dim}], got {tuple(kv_latent.shape)}"
            )
        def first_bad_row() -> str:
            bad = int((~torch.isfinite(kv_latent)).any(dim=-1).nonzero()[0])
            return (f"write_mla of layer {layer}: kv_latent row {bad} (slot {int(slots[bad])}) holds NaN "
                    "or inf, which the cache does not store; fix the producer of the latent")

        syncfree.check(torch.isfinite(kv_latent).all(),
                       f"write_mla of layer {layer}: a kv_latent row holds NaN or inf, which the "
                       "cache does not store; fix the producer of the latent", first_bad_row)
        pool = self.mla[layer]
        if self.written is not None:
            self.written[layer][slots.to(pool.device)] = True
        if self.kv_dtype == "fp8":
            c, k_pe = kv_latent.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
            rows = mla_kv_quantize(c, k_pe, cfg.scale_fmt)
            mla_kv_store(pool, slots.to(pool.device), rows)
        else:
            pool.view(-1, pool.shape[-1])[slots.to(pool.device)] = kv_latent.to(pool.dtype)

    def read_mla(self, layer: int, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The latent rows at ``slots [S]`` as ``[S, kv_lora_rank + rope]`` in ``dtype``.

        FP8 rows are dequantized as FlashMLA does (``fp8 * tile_scale``, exact in float32 with
        power-of-two scales); other rows are read back as stored.
        """
        self._check_slots(slots)
        pool = self.mla[layer]
        if self.written is not None:
            unwritten = (~self.written[layer][slots.to(pool.device)]).nonzero()
            if unwritten.numel():
                first = int(unwritten[0])
                raise ValueError(f"read_mla of layer {layer}: {unwritten.numel()} of {slots.numel()} slots were "
                                 f"never written (first: slots[{first}] = {int(slots[first])}); write them with "
                                 "write_mla first, or check the page table")
        if self.kv_dtype == "fp8":
            rows = mla_kv_load(pool, slots.to(pool.device))
            return mla_kv_dequantize(rows, self.config.kv_lora_rank, self.config.qk_rope_head_dim, dtype)
        return pool.view(-1, pool.shape[-1])[slots.to(pool.device)].to(dtype)

    def slots_of(self, pages: Iterable[int], length: int) -> torch.Tensor:
        """The first ``length`` token slots of a page table, int64 ``[length]``."""
        pages = list(pages)
        if length > len(pages) * self.page_size:
            raise ValueError(f"{length} tokens do not fit in {len(pages)} pages")
        table = torch.tensor(pages, dtype=torch.int64)
        pos = torch.arange(length, dtype=torch.int64)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size
