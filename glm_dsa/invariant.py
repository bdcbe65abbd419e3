"""Batch-invariant products: a row's floating-point result depends only on that row.

A BLAS library picks its kernel, its blocking and its thread split by the GEMM's shape, so the
same row of ``x @ W`` rounds differently when the call has another number of rows (MKL's
AVX-512 path: 1–15 rows; its AVX2 path: whenever the rows per thread leave a 1- or 2-row tail
of its 6-row micro-kernel, and for 30–60 % of all row counts) or when a batched product has
another batch count (one item runs multi-threaded, several run one per thread). What we
measured, and on which paths, is in ``docs/determinism.md`` (``scripts/probe_gemm_invariance.py``
reproduces it). Two tools take the shape out of the rounding:

* ``batch_tiled(fn, a, b)``: a batched product whose items are independent (one query row's
  scores over its own keys) runs in calls of exactly ``BATCH_TILE`` items, the last one padded
  with zeros. Always on: the sparse attention uses it, which makes ``sparse_mla_fwd`` bitwise
  independent of its row budget.
* ``row_tiled(fn, x, keys)``: a product over the rows of ``x`` (a projection, an expert, the
  absorbed MLA products) runs on tiles of exactly ``ROW_TILE`` rows, and row ``i`` sits at tile
  row ``keys[i] % ROW_TILE``. With the token's position as its key, a token meets the same call
  shape at the same place in the tile whatever else the step holds, so even a kernel whose
  rounding depends on the row's place in the tile (MKL's AVX2 edge kernels) treats it alike.
  ``linear`` is ``F.linear`` through it. It runs only inside ``batch_invariant()``
  (``PrefillEngine(batch_invariant=True)``); elsewhere ``linear`` is ``F.linear``.

The promise holds for one process: same device, same library, same thread count. In the mode,
row-wise reductions are fixed too: norms and the router's weight sum use ``row_sum`` (a fixed
tree of elementwise adds), and the sparse attention runs one ``BATCH_TILE`` of rows at a time,
so its softmax reductions always see the same shape.

Elementwise ops are not all shape-free either. ATen's CPU kernels run a call (or each thread's
share of it) in SIMD vectors and its last ``numel mod 2·width`` elements through a scalar loop;
for ``sigmoid`` and ``silu`` (and ``gelu`` in float64) the two paths round 1 ulp apart, so a
row's result depends on whether the call's size put it in the tail (float32 and float64, ATen's
AVX-512 and AVX2 kernels; ``exp``, ``log``, ``rsqrt``, ``cos``/``sin`` and the exact ops agree:
``scripts/probe_gemm_invariance.py``, docs/determinism.md). ``row_wise(fn, x, keys)`` therefore runs a whole row-wise
function, its GEMMs and its activations together, on the row tiles: the router's
``sigmoid(x Wᵀ)`` and the MLPs' SwiGLU.

On CUDA the tiles need no placement. cuBLAS and ATen's CUDA kernels choose their kernel by the
call's shape (at GLM-5.3's shapes on the H200 a row rounds differently in calls of up to 128 to
2,048 rows than in a 16,384-row call: split-K and small-M kernels), but a call of one fixed
shape gives a row the same bits whatever its place in the call and whatever the other rows hold
(``scripts/probe_cuda_invariance.py``: shifted windows, zero padding and other neighbours, every
projection, the router, the gates, the absorbed ``bmm`` and the norms' means, tiles of 512 to
2,048 rows). So on CUDA the mode runs each row-wise product on consecutive tiles of exactly
``CUDA_ROW_TILE`` rows (``fixed_tiled``): no keys, no host synchronisation, so a captured step
(``glm_dsa.graphs``) runs it too. ``row_tile(device)`` is the tile of the device.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["BATCH_TILE", "ROW_TILE", "CUDA_ROW_TILE", "batch_invariant", "active", "batch_tiled",
           "row_tiled", "fixed_tiled", "row_tile", "whole_tiles", "row_wise", "linear", "row_sum", "row_mean"]

# Items per batched GEMM call. More than any thread count splits one GEMM over, few enough that
# padding a one-row chunk costs little.
BATCH_TILE = 16
# Rows per GEMM call in row-tiled products: the page size, so a chunk (which starts on a page
# boundary) fills whole tiles, and a multiple of every micro-kernel height we met (6, 8, 16).
ROW_TILE = 64
# Rows per call of a row-wise product on CUDA in the mode: a 2,048-token step is one tile, and at
# 16K–32K-token steps cuBLAS runs 2,048-row tiles of GLM-5.3's projections within a few per cent
# of one call (scripts/probe_cuda_invariance.py). A multiple of ROW_TILE.
CUDA_ROW_TILE = 2048

_ACTIVE: ContextVar[bool] = ContextVar("glm_dsa_batch_invariant", default=False)


@contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within the block (this thread or task), ``linear`` and ``row_tiled`` products give each
    row a result that depends only on that row and its key."""
    token = _ACTIVE.set(enabled)
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> bool:
    """True inside ``batch_invariant()``."""
    return _ACTIVE.get()


def _aligned(t: Tensor) -> Tensor:
    # BLAS may take another code path for operands at another alignment.
    return t if t.data_ptr() % 64 == 0 else t.clone()


def _padded(t: Tensor, rows: int) -> Tensor:
    """``t [r, ...]`` zero-padded to ``[rows, ...]`` in ``t``'s stride order (a transposed
    operand stays transposed: the kernel follows the layout)."""
    strides = t.stride()
    order = sorted(range(t.dim()), key=lambda d: (-strides[d], d))
    shape = (rows, *t.shape[1:])
    out = t.new_zeros([shape[d] for d in order]).permute(*[order.index(d) for d in range(t.dim())])
    out[: t.shape[0]] = t
    return out


def batch_tiled(fn: Callable[[Tensor, Tensor], Tensor], a: Tensor, b: Tensor) -> Tensor:
    """``fn(a, b)`` for a batched product (``torch.bmm``-like: item ``i`` of the result depends on
    item ``i`` of ``a [B, ...]`` and ``b [B, ...]`` only), computed in calls of exactly
    ``BATCH_TILE`` items; a short last tile is zero-padded. Returns ``fn``'s ``[B, ...]``."""
    n = a.shape[0]
    if b.shape[0] != n:
        raise ValueError(f"batch_tiled needs one batch count, got {a.shape[0]} and {b.shape[0]}")
    if n == 0:
        return fn(a, b)
    out = None
    for t0 in range(0, n, BATCH_TILE):
        t1 = min(n, t0 + BATCH_TILE)
        ta, tb = a[t0:t1], b[t0:t1]
        if t1 - t0 < BATCH_TILE:
            ta, tb = _padded(ta, BATCH_TILE), _padded(tb, BATCH_TILE)
        else:
            ta, tb = _aligned(ta), _aligned(tb)
        res = fn(ta, tb)[: t1 - t0]
        if out is None:
            out = res.new_empty((n, *res.shape[1:]))
        out[t0:t1] = res
    assert out is not None  # n > 0: the loop ran at least once
    return out


def _tile_rows(keys: Tensor, tile: int) -> tuple[Tensor, int]:
    """Row of the padded layout for each key (tile ``r`` holds the ``r``-th row of each slot
    ``key % tile``, in row order) and the number of tiles. One host sync."""
    slot = keys.long() % tile
    n = slot.numel()
    order = torch.sort(slot, stable=True).indices
    counts = torch.bincount(slot, minlength=tile)
    starts = counts.cumsum(0) - counts
    rank = torch.empty_like(slot)
    rank[order] = torch.arange(n, device=slot.device) - starts[slot[order]]
    return rank * tile + slot, int(counts.max())


def row_tiled(fn: Callable[[Tensor], Tensor], x: Tensor, keys: Tensor,
              tile: int = ROW_TILE) -> Tensor:
    """``fn`` applied to the rows of ``x [n, ...]`` in tiles of exactly ``tile`` rows.

    ``fn`` maps ``[tile, ...]`` to ``[tile, ...]`` row by row (a GEMM against fixed weights).
    Row ``i`` is placed at row ``keys[i] % tile`` of a zero tile (rows sharing a slot go to
    successive tiles), so its result depends on its values and its key only. ``keys``: int
    ``[n]``, the token positions. Returns ``[n, ...]`` in ``fn``'s dtype.
    """
    n = x.shape[0]
    if keys.shape != (n,) or keys.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"keys must be int32/int64 [n={n}] (the rows' positions), got "
                         f"{keys.dtype} {tuple(keys.shape)}")
    if n == 0:
        return fn(x)
    where, num_tiles = _tile_rows(keys.to(x.device), tile)
    padded = x.new_zeros((num_tiles * tile, *x.shape[1:]))
    padded[where] = x
    out = None
    for t in range(num_tiles):
        res = fn(padded[t * tile : (t + 1) * tile])
        if out is None:
            out = res.new_empty((num_tiles * tile, *res.shape[1:]))
        out[t * tile : (t + 1) * tile] = res
    assert out is not None  # n > 0: at least one tile
    return out[where]


def fixed_tiled(fn: Callable[[Tensor], Tensor], x: Tensor, tile: int = CUDA_ROW_TILE) -> Tensor:
    """``fn`` applied to the rows of ``x [n, ...]`` in consecutive calls of exactly ``tile`` rows,
    each a contiguous tensor (the last zero-padded), so every call has one shape and one layout.
    ``fn`` maps ``[tile, ...]`` to ``[tile, ...]`` row by row. Returns ``[n, ...]`` in ``fn``'s
    dtype. A row's result is then its own wherever the kernels a shape chooses treat every row
    of a call alike (CUDA's; not MKL's AVX2 edge kernels: ``row_tiled`` there)."""
    n = x.shape[0]
    if n == 0:
        return fn(x)
    out = None
    for t0 in range(0, n, tile):
        t1 = min(n, t0 + tile)
        if t1 - t0 < tile:
            part = x.new_zeros((tile, *x.shape[1:]))
            part[: t1 - t0] = x[t0:t1]
        else:
            part = _aligned(x[t0:t1].contiguous())
        res = fn(part)[: t1 - t0]
        if out is None:
            out = res.new_empty((n, *res.shape[1:]))
        out[t0:t1] = res
    assert out is not None  # n > 0: at least one tile
    return out


def row_tile(device: torch.device) -> int:
    """Rows per call of the mode's row-wise products on ``device``: ``CUDA_ROW_TILE`` on CUDA,
    ``ROW_TILE`` elsewhere."""
    return CUDA_ROW_TILE if torch.device(device).type == "cuda" else ROW_TILE


def whole_tiles(rows: int, n: int, device: torch.device) -> int:
    """A row-chunk size for a loop over ``n`` rows that wanted ``rows`` per chunk: in the mode,
    whole tiles of ``row_tile(device)`` (at least one) when it splits, since every product in
    the chunk runs on such tiles and a part tile would only be padded; else ``rows``."""
    tile = row_tile(device)
    if active() and rows < n:
        return max(tile, rows // tile * tile)
    return rows


def row_wise(fn: Callable[[Tensor], Tensor], x: Tensor, keys: Tensor | None,
             cuda_tile: int = CUDA_ROW_TILE) -> Tensor:
    """``fn(x)`` for a function that maps each row of ``x [n, ...]`` on its own (GEMMs against
    fixed weights, elementwise activations); inside ``batch_invariant()`` on tiles, so every op
    in ``fn`` sees one tile's shape: on CUDA consecutive tiles of ``cuda_tile`` rows
    (``fixed_tiled``), elsewhere row-tiled on ``keys`` (int ``[n]``, the rows' positions,
    required there). Returns ``fn``'s ``[n, ...]``."""
    if not active():
        return fn(x)
    if x.is_cuda:
        return fixed_tiled(fn, x, cuda_tile)
    if keys is None:
        raise ValueError("batch-invariant mode needs each row's key (its position) for a projection")
    return row_tiled(fn, x, keys)


def linear(x: Tensor, weight: Tensor, keys: Tensor | None, cuda_tile: int = CUDA_ROW_TILE) -> Tensor:
    """``F.linear(x, weight)`` (``x [n, in]``, ``weight [out, in]``, no bias); inside
    ``batch_invariant()`` tiled as ``row_wise`` (``keys``: int ``[n]``, required off CUDA)."""
    return row_wise(lambda t: F.linear(t, weight), x, keys, cuda_tile)


def row_sum(x: Tensor) -> Tensor:
    """``x.sum(-1)``; inside ``batch_invariant()`` added as a fixed pairwise tree of elementwise
    adds (the last half folded onto the first, a middle element of an odd width waiting), so a
    row's sum depends on its width only, not on how many rows a library reduction kernel was
    given (CUDA's reduction picks its thread split by the number of rows)."""
    if not active():
        return x.sum(dim=-1)
    while x.shape[-1] > 1:
        n = x.shape[-1]
        half = n // 2
        folded = x[..., :half] + x[..., n - half :]
        x = folded if n % 2 == 0 else torch.cat([folded, x[..., half : half + 1]], dim=-1)
    return x[..., 0]


def row_mean(x: Tensor) -> Tensor:
    """``x.mean(-1, keepdim=True)``; inside ``batch_invariant()`` ``row_sum(x) / width``."""
    if not active():
        return x.mean(dim=-1, keepdim=True)
    return (row_sum(x) / x.shape[-1])[..., None]
