"""The three memory budgets of a DSA layer step, their defaults and the row counts they give.

* **Logits bytes** bound the indexer's float32 ``[rows, S_kv]`` logits at once (SGLang's
  ``mqa_logits_budget`` rule, docs/conventions.md §12): ``max_logit_rows``.
* **Attention bytes** bound the per-row-chunk temporaries of absorbed sparse attention — the
  queries, their absorbed and output forms and, where the context is gathered, the gathered
  keys, scores and index masks: ``attention_rows``. One rule for every attention path.
* **MoE bytes** bound the MoE's temporaries — the pairs' gathered rows, their GEMM outputs
  and SwiGLU, the router's and the shared expert's: ``moe_rows``, the rows of one MoE block.

The indexer's logits are freed before attention runs, so the two never coexist and both
default to the same reservation: SGLang's rule on CUDA, ``CPU_BUDGET_BYTES`` elsewhere.
The MoE runs after both are freed; its default is the same reservation capped at
``MOE_BUDGET_BYTES`` (3 GiB: blocks of ~18K tokens at GLM-5.3's shapes, whose grouped GEMMs are
already compute-bound). ``Budgets.default`` is the one place a run resolves them (the CLI and
``PrefillEngine``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from glm_dsa.invariant import BATCH_TILE
from glm_dsa.validate import need

__all__ = [
    "CPU_BUDGET_BYTES",
    "NO_CHUNK_LOGITS",
    "LOGITS_TOTAL_MEM_CAP",
    "MOE_BUDGET_BYTES",
    "Budgets",
    "logits_budget_bytes",
    "logits_budget_of",
    "check_fractions",
    "default_logits_bytes",
    "default_attention_bytes",
    "max_logit_rows",
    "attention_rows",
    "attention_row_bytes",
    "default_moe_bytes",
    "moe_rows",
    "moe_row_bytes",
    "rows_within",
]

# The host has no allocator whose free memory the CUDA rule could follow; 256 MiB keeps a CPU
# run's peak modest while leaving the row chunks large.
CPU_BUDGET_BYTES = 256 << 20
# The MoE's cap: rows past ~16K per block no longer speed up its grouped GEMMs at GLM-5.3's
# shapes (512 pairs per expert at 8 of 256 experts), while its temporaries keep growing.
MOE_BUDGET_BYTES = 3 << 30
# SGLang never row-chunks the indexer logits below this many elements (num_q * num_k).
NO_CHUNK_LOGITS = 8_000_000
# SGLang caps the static logits budget at this fraction of the device's total memory.
LOGITS_TOTAL_MEM_CAP = 0.3


def logits_budget_bytes(
    device: torch.device | str, mem_fraction_static: float = 0.8, free_fraction: float = 0.2
) -> int:
    """Bytes the indexer logits may take on a CUDA device (SGLang ``mqa_logits_budget``).

    ``min(free_fraction * free_now, min(free_fraction * (1 − mem_fraction_static) * total,
    0.3 * total))``. About 5.6 GB on a 141 GB H200 at ``mem_fraction_static = 0.8``.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("on CPU pass an explicit budget in bytes")
    check_fractions(mem_fraction_static, free_fraction)
    free, total = torch.cuda.mem_get_info(device)
    return logits_budget_of(free, total, mem_fraction_static, free_fraction)


def check_fractions(mem_fraction_static: float, free_fraction: float) -> None:
    """``mem_fraction_static`` in ``[0, 1)`` and ``free_fraction`` in ``(0, 1]``."""
    need(
        0.0 <= mem_fraction_static < 1.0,
        f"mem_fraction_static={mem_fraction_static} must lie in [0, 1)",
    )
    need(0.0 < free_fraction <= 1.0, f"free_fraction={free_fraction} must lie in (0, 1]")


def logits_budget_of(free: int, total: int, mem_fraction_static: float = 0.8,
                     free_fraction: float = 0.2) -> int:
    """``logits_budget_bytes``' rule on a device with ``free`` of ``total`` bytes free (checked
    fractions)."""
    static = min(free_fraction * (1.0 - mem_fraction_static) * total, LOGITS_TOTAL_MEM_CAP * total)
    return int(min(free_fraction * free, static))


def default_logits_bytes(device: torch.device | str, mem_fraction_static: float = 0.8) -> int:
    """The indexer-logits budget a run uses unless told otherwise: ``logits_budget_bytes`` at
    ``mem_fraction_static`` on CUDA, ``CPU_BUDGET_BYTES`` elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return logits_budget_bytes(device, mem_fraction_static)
    return CPU_BUDGET_BYTES


def default_attention_bytes(device: torch.device | str, mem_fraction_static: float = 0.8) -> int:
    """The attention row-chunk budget a run uses unless told otherwise: the logits' reservation
    (``default_logits_bytes``), which attention reuses once the indexer has freed it."""
    return default_logits_bytes(device, mem_fraction_static)


def default_moe_bytes(device: torch.device | str, mem_fraction_static: float = 0.8) -> int:
    """The MoE budget a run uses unless told otherwise: the logits' reservation
    (``default_logits_bytes``), free again when the MoE runs, capped at ``MOE_BUDGET_BYTES``."""
    return min(default_logits_bytes(device, mem_fraction_static), MOE_BUDGET_BYTES)


@dataclass(frozen=True)
class Budgets:
    """The byte budgets of one step.

    Attributes:
        logits_bytes: float32 indexer logits at once (``max_logit_rows``).
        attention_bytes: temporaries of one attention row chunk (``attention_rows``).
        moe_bytes: temporaries of one MoE row block (``moe_rows``); ``MOE_BUDGET_BYTES``
            unless given (``Budgets.default`` resolves it per device).
    """

    logits_bytes: int
    attention_bytes: int
    moe_bytes: int = MOE_BUDGET_BYTES

    def __post_init__(self) -> None:
        for name in ("logits_bytes", "attention_bytes", "moe_bytes"):
            value = getattr(self, name)
            need(isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                 f"{name}={value!r} must be a positive int (bytes)")

    @classmethod
    def default(cls, device: torch.device | str, budget_bytes: int | None = None,
                mem_fraction_static: float = 0.8) -> Budgets:
        """``budget_bytes`` for all three, or each budget's default on ``device``."""
        if budget_bytes is not None:
            return cls(budget_bytes, budget_bytes, budget_bytes)
        return cls(default_logits_bytes(device, mem_fraction_static),
                   default_attention_bytes(device, mem_fraction_static),
                   default_moe_bytes(device, mem_fraction_static))


def rows_within(budget_bytes: int, row_bytes: int, num_rows: int | None = None) -> int:
    """Rows of ``row_bytes`` each whose temporaries fit ``budget_bytes``, at most ``num_rows``
    when given, and at least one (a row is never split). The rule every row-chunk loop without
    a rule of its own here (``max_logit_rows``, ``attention_rows``, ``moe_rows``) sizes its
    chunks by."""
    rows = budget_bytes // row_bytes
    return max(1, rows if num_rows is None else min(num_rows, rows))


def max_logit_rows(num_q: int, num_k: int, budget_bytes: int) -> int:
    """Query rows whose float32 logits over ``num_k`` keys may exist at once.

    SGLang's rule: all ``num_q`` rows when ``num_q * num_k < 8e6`` or the ``4 * num_q * num_k``
    bytes fit ``budget_bytes``; else ``max(1, budget_bytes // (4 * num_k))``.
    """
    need(isinstance(num_q, int) and num_q >= 1, f"num_q={num_q!r} must be a positive int")
    need(isinstance(num_k, int) and num_k >= 0, f"num_k={num_k!r} must be a non-negative int")
    need(
        isinstance(budget_bytes, int) and budget_bytes >= 0,
        f"budget_bytes={budget_bytes!r} must be a non-negative int (bytes)",
    )
    logits_bytes = 4 * num_q * num_k
    if num_q * num_k < NO_CHUNK_LOGITS or logits_bytes <= budget_bytes:
        return num_q
    return max(1, budget_bytes // (4 * num_k))


def attention_rows(num_rows: int, topk: int, d_qk: int, d_v: int, heads: int,
                   gathered_dtype: torch.dtype | None, dtype: torch.dtype,
                   budget_bytes: int | None) -> int:
    """Query rows of sparse attention whose temporaries fit ``budget_bytes`` (all for None).

    Per row: the row's query (and its bf16 split, 3 × 2 bytes plus a float32 remainder),
    full-width output and output in the compute ``dtype``; and where the keys are gathered
    (``gathered_dtype``, the cache's dtype; None when a kernel reads the pool in place) the
    ``[topk, d_qk]`` keys in that dtype and, at most, again in ``dtype`` (``_bmm_f32`` off the
    tensor-core path), the ``[heads, topk]`` scores with the two temporaries ``logsumexp`` makes
    of them, the probabilities' bf16 split and three ``[topk]`` index tensors (int64).
    """
    if budget_bytes is None:
        return max(1, num_rows)
    per_row = attention_row_bytes(topk, d_qk, d_v, heads, gathered_dtype, dtype)
    # Whole batch tiles (``mla._sparse_mla`` pads a chunk to them), at least one.
    return max(BATCH_TILE, budget_bytes // per_row // BATCH_TILE * BATCH_TILE)


def attention_row_bytes(topk: int, d_qk: int, d_v: int, heads: int, gathered_dtype: torch.dtype | None,
                        dtype: torch.dtype) -> int:
    """Bytes of one query row's sparse-attention temporaries, the per-row model of
    ``attention_rows`` (its docstring says what they are)."""
    item = dtype.itemsize
    per_row = heads * (2 * d_qk + d_v) * item + heads * d_qk * (3 * 2 + 4)
    if gathered_dtype is not None:
        per_row += (
            topk * d_qk * (gathered_dtype.itemsize + item)
            + 3 * heads * topk * item
            + heads * topk * (3 * 2 + 4)
            + 3 * topk * 8
        )
    return per_row


def moe_rows(num_rows: int, top_k: int, hidden: int, intermediate: int, shared_intermediate: int,
             num_experts: int, dtype: torch.dtype, fused: bool, budget_bytes: int | None) -> int:
    """Rows of one MoE block whose temporaries fit ``budget_bytes`` (all, at least 1, for None).

    Per row, with ``b`` the activations' and ``c`` the compute dtype's item size and ``k =
    top_k``: the shared expert's output ``hidden · b`` and the pairs' indices and routing
    (``k · (40 + 2c)``, int64 keys, order, rows and positions) held through the block, plus the
    largest of its phases: the shared expert (``3 · shared_intermediate · b``, and four
    compute-dtype temporaries of that width unless ``fused``), the router (the row in the compute
    dtype, its ``num_experts`` scores, selection scores and sort in ``3c + 8`` bytes each), the
    first grouped GEMM (``k · (hidden + 2 · intermediate) · b``, gathered rows and their
    gate/up), SwiGLU (``k · 3 · intermediate · b``, and ``k · 4 · intermediate · c`` unless
    ``fused``), the second GEMM (``k · (intermediate + hidden) · b``) and the combine (nothing
    more when ``fused``, else ``hidden · (3c + b)``). ``fused``: SwiGLU and the combine run as
    the single-pass Triton kernels (CUDA). The blocks are then evened out: ``ceil(num_rows /
    ceil(num_rows / rows))``.
    """
    for name, v in (("num_rows", num_rows), ("top_k", top_k), ("hidden", hidden),
                    ("intermediate", intermediate), ("shared_intermediate", shared_intermediate),
                    ("num_experts", num_experts)):
        need(isinstance(v, int) and v >= 0, f"{name}={v!r} must be a non-negative int")
    if budget_bytes is None:
        return max(1, num_rows)
    need(isinstance(budget_bytes, int) and budget_bytes >= 1,
         f"budget_bytes={budget_bytes!r} must be a positive int (bytes) or None")
    per_row = moe_row_bytes(top_k, hidden, intermediate, shared_intermediate, num_experts, dtype, fused)
    rows = max(1, budget_bytes // per_row)
    if num_rows <= rows:
        return max(1, num_rows)
    blocks = -(-num_rows // rows)
    return -(-num_rows // blocks)


def moe_row_bytes(top_k: int, hidden: int, intermediate: int, shared_intermediate: int, num_experts: int,
                  dtype: torch.dtype, fused: bool) -> int:
    """Bytes of one row's MoE temporaries, the per-row model of ``moe_rows`` (its docstring
    says what they are)."""
    b = dtype.itemsize
    c = torch.promote_types(dtype, torch.float32).itemsize
    k = top_k
    unfused = 0 if fused else 1
    phases = (
        shared_intermediate * (3 * b + 4 * c * unfused),
        hidden * c + num_experts * (3 * c + 8),
        k * (hidden + 2 * intermediate) * b,
        k * intermediate * (3 * b + 4 * c * unfused),
        k * (intermediate + hidden) * b,
        hidden * (3 * c + b) * unfused,
    )
    return hidden * b + k * (40 + 2 * c) + max(phases)
