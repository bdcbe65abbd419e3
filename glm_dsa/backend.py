"""Which implementation runs a DSA layer's two hot operations: the indexer top-k and attention.

A ``Backend`` has a ``name``, ``require(dtype, kv_dtype)`` (a one-line ValueError, before any
compute, for a run it cannot do), ``indexer_topk`` (the contract of
``glm_dsa.indexer.indexer_topk``), ``attend`` (one layer's attention over its cache, choosing
the form itself) and the capability attributes below. ``DecoderLayer`` calls only these, so a
new implementation is a new subclass here (or anywhere: ``PrefillEngine`` takes a ``Backend``
object as well as a name).

* ``reference`` — the oracle: exact FP8 indexer logits in float64, float32-accurate sparse
  attention over the gathered context, and the MHA one-shot form for short contexts.
* ``triton`` — ``glm_dsa.kernels``: Triton FP8 logits (float32 tensor-core accumulation,
  checked with DeepGEMM's ``calc_diff``) in the same budgeted row chunks and a radix select
  writing each row in ascending column order (the same bits every run); absorbed sparse
  attention reading the selected rows straight from the paged pool (FP8 656-byte rows
  dequantized in the kernel, or bf16 / fp32 rows); queries and absorption GEMMs in the
  activation dtype. On sm_90 with a
  tested Triton, bf16 attention runs the Gluon kernel (``kernels.sparse_mla_gluon``, bf16 rows
  only): a bf16 pool is read in place, and an FP8 pool's context is dequantized to bf16 once
  per layer step (bitwise the rows the FP8 kernel dequantizes; 1152 bytes per context token)
  and attended by it, as the peers backend does for FlashMLA. Elsewhere the Triton kernels run.
  With ``attention_precision="fp8"`` (off by default) attention runs SGLang's Q8KV8 form
  (``kernels.sparse_mla_q8kv8``, the Gluon kernel on sm_90): the layer's context as e4m3
  576-byte rows with one scale per step (a bf16 / fp32 pool quantized, an FP8 pool's rows
  requantized straight from the pool: ``kernels.kv_requant``, bitwise
  ``kv_format.mla_kv_per_tensor_fp8``) and each row chunk's query with one scale
  (``fp8.per_tensor_quant``), both products in FP8. A scale shared by the step's rows makes a
  row's result depend on the others: the mode is not batch-invariant and runs eagerly (no CUDA
  graphs, whose padding rows would enter the scales). The top-k is the indexer's, unchanged.
* ``peers`` — the production kernels (``glm_dsa.peers``): DeepGEMM ``fp8_mqa_logits`` in the
  same budgeted row chunks with the triton backend's radix select, and FlashMLA's SM90 sparse
  prefill. FlashMLA reads bf16 rows only: a bf16 pool is read in place through slot numbers;
  for an FP8 pool the layer's context is dequantized to bf16 once per step (exact: e4m3 times a
  power-of-two tile scale fits bf16; 1152 bytes per context token, 151 MB at 131,072 tokens)
  and FlashMLA runs over it. bf16 activations only (FlashMLA's query is bf16).

The triton and peers backends take the absorbed sparse form at every length: where a context
has no more than ``index_topk`` keys the top-k keeps them all and sparse attention is the dense
result, so the reference's MHA one-shot form (float32, expanded per head) is not needed.

What a backend can do is said by its attributes (``graph_capturable``, ``batch_invariant``,
``activation_dtypes``, ``kv_dtypes``), read by ``get_backend``, ``glm_dsa.graphs`` and the CLI;
the model's small fused passes (``glm_dsa.fused``) are its ``passes``. A new built-in backend
is a subclass here (``for_device`` says what it needs) and a name in ``_CLASSES``; no other
module names backends.
"""

from __future__ import annotations

import logging
import os

import torch
from torch import Tensor

from glm_dsa import fused
from glm_dsa.batch import ForwardBatch
from glm_dsa.cache import KVCache
from glm_dsa.fp8 import per_tensor_quant
from glm_dsa.indexer import indexer_topk
from glm_dsa.mla import MLA, MLAProjection

__all__ = ["BACKENDS", "ATTENTION_PRECISIONS", "Backend", "ReferenceBackend", "TritonBackend", "PeersBackend",
           "REFERENCE", "get_backend", "graph_capturable_names"]

_log = logging.getLogger(__name__)
# How attention multiplies: bf16 (or the activation dtype) operands, or e4m3 q and kv (Q8KV8).
ATTENTION_PRECISIONS = ("bf16", "fp8")


class Backend:
    """What ``DecoderLayer`` calls, and what the backend can do; see the module docstring.

    Attributes:
        name: the ``--backend`` name.
        graph_capturable: its indexer top-k and attention read nothing on the host during a
            step, so a step runs from CUDA graphs (``glm_dsa.graphs``).
        batch_invariant: its results for a row do not depend on the other rows of the step
            (``glm_dsa.invariant``); batch-invariant mode runs only such a backend.
        invariant_by_default: an engine on it runs batch-invariant mode unless told not to
            (the mode costs it little: docs/determinism.md).
        activation_dtypes, kv_dtypes: the activation dtypes and cache formats
            (``glm_dsa.cache``'s names) it runs; None for any.
        attention_precisions: the ``ATTENTION_PRECISIONS`` it attends in.
        attention_precision: the one this backend object attends in.
        passes: the model's small fused passes under this backend (``glm_dsa.fused``).
    """

    name: str = "backend"
    graph_capturable: bool = False
    batch_invariant: bool = False
    invariant_by_default: bool = False
    activation_dtypes: tuple[torch.dtype, ...] | None = None
    kv_dtypes: tuple[str, ...] | None = None
    attention_precisions: tuple[str, ...] = ("bf16",)
    attention_precision: str = "bf16"
    passes: fused.Passes = fused.TRITON_ON_CUDA

    @classmethod
    def for_device(cls, device: torch.device, attention_precision: str = "bf16") -> Backend:
        """A backend of this class for models on ``device`` attending in
        ``attention_precision`` (one of the class's ``attention_precisions``, checked by
        ``get_backend``), or the ValueError (one line) saying what it needs there."""
        return cls()

    def require(self, dtype: torch.dtype, kv_dtype: str) -> None:
        """ValueError (one line, naming the fix) unless this backend runs ``dtype``
        activations over a ``kv_dtype`` cache."""
        if self.activation_dtypes is not None and dtype not in self.activation_dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in self.activation_dtypes)
            raise ValueError(f"the {self.name} backend runs {names} activations ({dtype} given): use "
                             f"--dtype {names.split()[0]} or another backend")
        if self.kv_dtypes is not None and kv_dtype not in self.kv_dtypes:
            names = " or ".join(self.kv_dtypes)
            raise ValueError(f"the {self.name} backend reads {names} KV ({kv_dtype} given): use "
                             f"--kv-dtype {names}")

    def indexer_topk(self, q_fp8: Tensor, weights: Tensor, k_fp8: Tensor, k_scale: Tensor,
                     ks: Tensor, ke: Tensor, topk: int, budget_bytes: int) -> Tensor:
        """``glm_dsa.indexer.indexer_topk``'s arguments and output contract (set semantics)."""
        raise NotImplementedError

    def attend(self, attn: MLA, proj: MLAProjection, cache: KVCache, layer_idx: int,
               batch: ForwardBatch, topk_indices: Tensor, budget_bytes: int) -> Tensor:
        """Layer ``layer_idx``'s attention ``[n, hidden]`` of ``proj`` over its cache, with the
        int32 ``[n, index_topk]`` request-relative top-k, temporaries within ``budget_bytes``."""
        raise NotImplementedError


class ReferenceBackend(Backend):
    """The oracle: gathers the context, MHA one-shot for short contexts, else absorbed sparse."""

    name = "reference"
    batch_invariant = True

    @classmethod
    def for_device(cls, device: torch.device, attention_precision: str = "bf16") -> Backend:
        return REFERENCE

    def indexer_topk(self, *args) -> Tensor:
        return indexer_topk(*args)

    def attend(self, attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes) -> Tensor:
        kv_context = cache.read_mla(layer_idx, batch.kv_slots, proj.q_latent.dtype)
        return attn.attend(proj, kv_context, batch, topk_indices, budget_bytes)


REFERENCE = ReferenceBackend()


def _triton_paged_sparse_mla(query, pool, slots, sm_scale, d_v):
    from glm_dsa import kernels

    indices = slots[:, None, :]
    if pool.dtype == torch.uint8:  # FP8 rows
        return kernels.sparse_mla_fwd_fp8(query, pool.view(-1, pool.shape[-1]), indices, sm_scale, d_v)
    return kernels.flash_mla_sparse_fwd(query, pool.view(-1, 1, pool.shape[-1]), indices, sm_scale, d_v)


class TritonBackend(Backend):
    """``glm_dsa.kernels``: Triton indexer top-k, sparse attention read from the paged pool."""

    name = "triton"
    graph_capturable = True
    # Each kernel's result for a row is the row's own: the logits of a (row, key) pair, the exact
    # top-k of a row's own logits, a query token's attention; the mode tiles the rest.
    batch_invariant = True
    # 1.02-1.03x its time outside the mode from 2K to 1M tokens of a GLM-5.3 layer (H200).
    invariant_by_default = True
    attention_precisions = ATTENTION_PRECISIONS

    @classmethod
    def for_device(cls, device: torch.device, attention_precision: str = "bf16") -> Backend:
        if not _triton_importable():
            raise ValueError("the triton backend needs the triton package: pip install triton "
                             "(or choose the reference backend)")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(f"the triton backend runs on CUDA devices, not {device.type}; on the CPU "
                             "set TRITON_INTERPRET=1 before starting Python (Triton's slow interpreter)")
        return cls(attention_precision)

    def __init__(self, attention_precision: str = "bf16") -> None:
        from glm_dsa import kernels

        _check_precision(attention_precision)
        self._kernels = kernels
        self._logged: set[str] = set()
        self.attention_precision = attention_precision
        if attention_precision == "fp8":  # per-step scales: see the module docstring
            self.batch_invariant = self.invariant_by_default = self.graph_capturable = False

    def indexer_topk(self, *args) -> Tensor:
        return self._kernels.indexer_topk(*args)

    def attend(self, attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes) -> Tensor:
        if self.attention_precision == "fp8":
            return _attend_q8kv8(attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes,
                                 self._kernels.sparse_mla_q8kv8_prefill_fwd,
                                 self._kernels.mla_kv_per_tensor_fp8_paged)
        if cache.kv_dtype == "fp8" and self._gluon_over_dequantized(attn, proj):
            return _attend_dequantized(attn, proj, cache, layer_idx, batch, topk_indices,
                                       budget_bytes, self._kernels.flash_mla_sparse_fwd)
        return attn.forward_paged(proj, cache.mla[layer_idx], batch, topk_indices,
                                  _triton_paged_sparse_mla, budget_bytes)

    def _gluon_over_dequantized(self, attn: MLA, proj: MLAProjection) -> bool:
        """Whether an FP8 pool's attention should run the Gluon bf16 kernel over the context
        dequantized once (it is ~2.5x the FP8 Triton kernel's rate), logged once either way."""
        cfg = attn.config
        why = self._kernels.sparse_mla.gluon_unsuitable(
            proj.q_latent.device, proj.q_latent.dtype, cfg.num_attention_heads,
            cfg.kv_lora_rank + cfg.qk_rope_head_dim, cfg.kv_lora_rank)
        message = "FP8 KV attention: " + ("context dequantized to bf16 per step, Gluon kernel"
                                          if why is None else f"FP8 Triton kernel in place ({why})")
        if message not in self._logged:
            self._logged.add(message)
            _log.info(message)
        return why is None


def _attend_dequantized(attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes,
                        sparse_fwd) -> Tensor:
    """Absorbed sparse attention over this layer's context read from the cache as bf16 rows
    (``[S_kv, 1, 576]``, FP8 rows dequantized once) by ``sparse_fwd`` (the FlashMLA contract)."""
    kv = cache.read_mla(layer_idx, batch.kv_slots, torch.bfloat16)[:, None, :]
    scale, d_v = attn.config.softmax_scale, attn.config.kv_lora_rank

    def attend_rows(query: Tensor, rows: Tensor) -> Tensor:
        return sparse_fwd(query, kv, rows[:, None, :], scale, d_v)[0]

    return attn.forward_sparse(proj, batch, topk_indices, attend_rows, torch.bfloat16,
                               budget_bytes)


def _attend_q8kv8(attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes,
                  q8kv8_fwd, kv_requant) -> Tensor:
    """Absorbed sparse attention in FP8 (``q8kv8_fwd``: the Q8KV8 contract): this layer's context
    as e4m3 rows ``[S_kv, 1, 576]`` with one scale, each row chunk's query quantized with one.
    An FP8 pool's rows are requantized by ``kv_requant`` (the contract of
    ``mla_kv_per_tensor_fp8(mla_kv_load(pool, slots))``) straight from the pool."""
    cfg = attn.config
    if cache.kv_dtype == "fp8":
        pool = cache.mla[layer_idx]
        kv_fp8, kv_scale = kv_requant(pool, batch.kv_slots.to(pool.device), cfg.kv_lora_rank,
                                      cfg.qk_rope_head_dim)
    else:
        pool = cache.mla[layer_idx]  # bf16 or fp32 rows, read as stored
        kv_fp8, kv_scale = per_tensor_quant(cache.read_mla(layer_idx, batch.kv_slots, pool.dtype))
    kv_fp8 = kv_fp8[:, None, :]

    def attend_rows(query: Tensor, rows: Tensor) -> Tensor:
        q_fp8, q_scale = per_tensor_quant(query)
        return q8kv8_fwd(q_fp8, kv_fp8, rows[:, None, :], cfg.softmax_scale, q_scale, kv_scale,
                         cfg.kv_lora_rank)[0]

    return attn.forward_sparse(proj, batch, topk_indices, attend_rows, proj.q_latent.dtype,
                               budget_bytes)


class PeersBackend(Backend):
    """DeepGEMM logits + the radix select, FlashMLA sparse prefill (``glm_dsa.peers``)."""

    name = "peers"
    activation_dtypes = (torch.bfloat16,)  # FlashMLA's query
    kv_dtypes = ("fp8", "bf16")  # FlashMLA reads bf16 rows; FP8 ones are dequantized to them

    @classmethod
    def for_device(cls, device: torch.device, attention_precision: str = "bf16") -> Backend:
        from glm_dsa import peers

        missing = peers.missing(device)
        if missing:
            raise ValueError(f"the peers backend cannot run here: {missing}")
        return cls()

    def __init__(self) -> None:
        from glm_dsa import peers

        self._peers = peers

    def indexer_topk(self, *args) -> Tensor:
        return self._peers.indexer_topk(*args)

    def attend(self, attn, proj, cache, layer_idx, batch, topk_indices, budget_bytes) -> Tensor:
        if cache.kv_dtype == "bf16":
            return attn.forward_paged(proj, cache.mla[layer_idx], batch, topk_indices,
                                      self._peers.paged_sparse_mla, budget_bytes)
        return _attend_dequantized(attn, proj, cache, layer_idx, batch, topk_indices,
                                   budget_bytes, self._peers.flash_mla_sparse_fwd)


def _triton_importable() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


_CLASSES: dict[str, type[Backend]] = {
    "reference": ReferenceBackend, "triton": TritonBackend, "peers": PeersBackend}
BACKENDS = ("auto", *_CLASSES)


def graph_capturable_names() -> list[str]:
    """The backends whose steps run from CUDA graphs, by name (for messages)."""
    return [name for name, cls in _CLASSES.items() if cls.graph_capturable]


def _auto(device: torch.device) -> str:
    """The one ``auto`` rule: ``triton`` on a CUDA device when Triton imports, else
    ``reference`` (both run batch-invariant mode)."""
    if device.type == "cuda" and _triton_importable():
        return "triton"
    return "reference"


def get_backend(name: str | Backend, device: torch.device | str, dtype: torch.dtype | None = None,
                kv_dtype: str | None = None, batch_invariant: bool = False,
                attention_precision: str = "bf16") -> Backend:
    """The backend ``name`` (one of ``BACKENDS``, or a ``Backend`` object, returned as it is)
    for models on ``device``, checked to run ``dtype`` activations over a ``kv_dtype`` cache
    (``Backend.require``; skipped when ``dtype`` is None) and, with ``batch_invariant``, to be
    batch-invariant, and to attend in ``attention_precision`` (``ATTENTION_PRECISIONS``; "fp8"
    on the triton backend only, never batch-invariant; a ``Backend`` object must have been
    built with it). Every rule about choosing a backend is here, decided once.

    ``auto`` is ``_auto``'s choice. ``triton`` on the CPU needs ``TRITON_INTERPRET=1`` (Triton's
    interpreter: exact but slow, for tests). ``peers`` needs a CUDA device, Triton, and DeepGEMM
    and FlashMLA's SM90 sparse prefill importable (``glm_dsa.peers``).
    """
    device = torch.device(device)
    _check_precision(attention_precision)
    if attention_precision == "fp8" and batch_invariant:
        raise ValueError("attention_precision='fp8' (--attention-precision fp8) is not batch-invariant "
                         "(one FP8 scale per step's context): drop --batch-invariant or attend in bf16")
    if isinstance(name, str):
        if name not in BACKENDS:
            raise ValueError(f"backend={name!r}: choose one of {', '.join(BACKENDS)}")
        name = _auto(device) if name == "auto" else name
        # Refused by the class's attributes, before anything is imported or built for it.
        _check_invariance(name, _CLASSES[name].batch_invariant, batch_invariant)
        _check_precisions(name, _CLASSES[name].attention_precisions, attention_precision)
        backend = _CLASSES[name].for_device(device, attention_precision)
    else:
        backend = name
        _check_invariance(backend.name, backend.batch_invariant, batch_invariant)
        if backend.attention_precision != attention_precision:
            raise ValueError(f"the {backend.name} backend object attends in {backend.attention_precision}, "
                             f"not attention_precision={attention_precision!r}: build it with "
                             f"attention_precision={attention_precision!r} or pass "
                             f"{backend.attention_precision!r}")
    if dtype is not None:
        backend.require(dtype, kv_dtype if kv_dtype is not None else "fp8")
    return backend


def _check_invariance(name: str, invariant: bool, batch_invariant: bool) -> None:
    if batch_invariant and not invariant:
        kept = " or ".join(n for n, c in _CLASSES.items() if c.batch_invariant)
        raise ValueError(f"batch-invariant mode (--batch-invariant, batch_invariant=True) runs the {kept} "
                         f"backend: the {name} kernels are not batch-invariant")


def _check_precision(attention_precision: str) -> None:
    if attention_precision not in ATTENTION_PRECISIONS:
        raise ValueError(f"attention_precision={attention_precision!r}: choose one of "
                         f"{', '.join(ATTENTION_PRECISIONS)}")


def _check_precisions(name: str, precisions: tuple[str, ...], attention_precision: str) -> None:
    if attention_precision not in precisions:
        kept = " or ".join(n for n, c in _CLASSES.items() if attention_precision in c.attention_precisions)
        raise ValueError(f"attention_precision={attention_precision!r} (--attention-precision) runs on the "
                         f"{kept} backend; the {name} backend attends in {', '.join(precisions)}: choose "
                         f"--backend {kept.split()[0]} or --attention-precision {precisions[0]}")
