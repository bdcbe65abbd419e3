"""Measured per-layer prefill times (cited data) and the whole-model time they imply.

A whole-model prefill in layer-major order (``glm_dsa.layer_major``) on one GPU takes the sum of
its layers' times: a full layer runs the indexer, attention, MoE and projections; a shared layer
all but the indexer. ``whole_model_seconds`` scales one measured full layer to another prompt:
the indexer by its exact query-key pairs (quadratic in the prompt), the rest by the tokens run
(sparse attention reads ``index_topk`` keys per token; the MoE and projections are per token).
The figures are measurements, dated and sourced, never fitted constants.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LayerMeasurement", "H200_GLM53_1M", "whole_model_seconds"]


@dataclass(frozen=True)
class LayerMeasurement:
    """One full layer's prefill, measured: ``full_layer_s`` seconds for a prompt of ``tokens``
    in chunks of ``chunk`` (no prefix), ``indexer_s`` of them in the indexer; the ``config``,
    ``gpu``, ``setup`` (backend, KV and activation formats), ``date`` and ``source`` it comes from."""

    config: str
    gpu: str
    tokens: int
    chunk: int
    full_layer_s: float
    indexer_s: float
    setup: str
    date: str
    source: str

    @property
    def shared_layer_s(self) -> float:
        """A shared layer: the full layer without its indexer."""
        return self.full_layer_s - self.indexer_s


H200_GLM53_1M = LayerMeasurement(
    config="glm-5.3", gpu="H200", tokens=1_048_576, chunk=32_768, full_layer_s=10.93, indexer_s=7.15,
    setup="triton backend, FP8 KV, bf16, random weights, one full MoE layer", date="2026-12-02",
    source="issue 41 (the figure it cites); bench/RESULTS.md R3, 2026-12-01: 10.78 s / 7.24 s",
)


def whole_model_seconds(
    full_layers: int,
    shared_layers: int,
    indexer_pairs: int,
    new_tokens: int,
    measured_pairs: int,
    measured: LayerMeasurement = H200_GLM53_1M,
) -> dict[str, float]:
    """The seconds of ``full_layers`` full and ``shared_layers`` shared layers over a prompt
    whose one full layer scores ``indexer_pairs`` query-key pairs and runs ``new_tokens``, from
    ``measured`` (whose prompt scored ``measured_pairs``): ``{"full_layer_s", "shared_layer_s",
    "seconds"}``."""
    indexer = measured.indexer_s * indexer_pairs / measured_pairs
    rest = measured.shared_layer_s * new_tokens / measured.tokens
    return {"full_layer_s": indexer + rest, "shared_layer_s": rest,
            "seconds": full_layers * (indexer + rest) + shared_layers * rest}
