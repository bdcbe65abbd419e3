"""The classic mistakes of each kernel contract, each recomputed, so that a failure names its
cause: a kernel whose failing outputs pass the contract's metric against the oracle with one
mistake made (the same call with an input, an option or a byte layout changed) is told that
mistake, with the fix.

A diagnosis is a recomputation, not a pattern guess: ``-1`` read as key 0 is the oracle on
indices with ``-1`` replaced by 0; ``round`` where ``ceil`` is due is a writer with that
rounding. A mistake is only reported when it changes this case's outputs and the kernel's
outputs match it; the metric's own hints (``glm_dsa.testing.metrics``) cover the patterns
visible in one tensor (an off-by-one window, a uniform ratio).
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass, replace
from typing import Callable, Mapping

import torch
from torch import Tensor

from glm_dsa import oracle
from glm_dsa.kv_format import index_k_page_split
from glm_dsa.testing.cases import (
    CONTRACTS,
    Case,
    conventions,
    expected_outputs,
    positions_of_slots,
    topk_scores,
)
from glm_dsa.testing.metrics import FLOAT16_MAX, check_tensor

__all__ = ["Mistake", "MISTAKES", "diagnose"]

Variant = Callable[[Case], "Case | dict[str, Tensor] | None"]


@dataclass(frozen=True)
class Mistake:
    """One classic mistake of a contract.

    cause: what the kernel does wrong and the fix, one line. variant(case): the case with the
    mistake made (a ``Case`` whose call the oracle recomputes, or the outputs by name), None
    where the mistake cannot show in this case. matches(case, got, expected): instead of a
    variant, a direct test of the outputs.
    """

    cause: str
    variant: Variant | None = None
    matches: Callable[[Case, Mapping[str, Tensor], Mapping[str, Tensor]], bool] | None = None


def _with_args(case: Case, **changes) -> Case:
    """``case`` with positional arguments (by the oracle's parameter names) or keywords changed;
    a keyword set to None is dropped."""
    names = list(inspect.signature(getattr(oracle, case.contract)).parameters)
    args = list(case.args)
    kwargs = dict(case.kwargs)
    for name, value in changes.items():
        if name in names[: len(args)]:
            args[names.index(name)] = value
        elif value is None:
            kwargs.pop(name, None)
        else:
            kwargs[name] = value
    return replace(case, args=tuple(args), kwargs=kwargs, checks=CONTRACTS[case.contract].checks(kwargs))


# ----------------------------------------------------------------------------- sparse MLA
def _rows_per_query(indices: Tensor) -> Tensor:
    return indices.reshape(-1, indices.shape[-1])


def _drop_last_entry(case: Case, lengths_key: str = "topk_length") -> Case | None:
    idx = case.args[2].clone()
    rows = _rows_per_query(idx)
    lengths = case.kwargs.get(lengths_key)
    per = rows.shape[0] // (lengths.numel() if lengths is not None else rows.shape[0])
    for r in range(rows.shape[0]):
        n = int(lengths.reshape(-1)[r // per]) if lengths is not None else rows.shape[1]
        if n > 0:
            rows[r, n - 1] = -1
    return _with_args(case, indices=idx)


def _minus_one_as_zero(case: Case) -> Case | None:
    idx = case.args[2]
    return _with_args(case, indices=torch.where(idx == -1, 0, idx)) if bool((idx == -1).any()) else None


def _past_end_clamped(case: Case) -> Case | None:
    idx, s_kv = case.args[2], case.args[1].shape[0]
    if not bool((idx >= s_kv).any()):
        return None
    return _with_args(case, indices=torch.where(idx >= s_kv, s_kv - 1, idx))


def _deduplicated(case: Case) -> Case | None:
    idx = case.args[2].clone()
    rows = _rows_per_query(idx)
    for r in range(rows.shape[0]):
        seen: set[int] = set()
        for j, v in enumerate(rows[r].tolist()):
            if v >= 0 and v in seen:
                rows[r, j] = -1
            seen.add(v)
    return _with_args(case, indices=idx)


def _scaled(factor: Callable[[float], float]) -> Variant:
    return lambda case: _with_args(case, sm_scale=factor(case.args[3]))


def _without(key: str) -> Variant:
    return lambda case: _with_args(case, **{key: None}) if case.kwargs.get(key) is not None else None


_SPARSE = (
    Mistake("each row's last index entry is skipped (a loop bound of topk - 1, or entries "
            "< topk_length - 1): every entry up to topk (topk_length) is attended",
            _drop_last_entry),
    Mistake("-1 is read as key 0: an index < 0 is invalid and skipped", _minus_one_as_zero),
    Mistake("an index >= s_kv is clamped to the last key: an index past the end is invalid and "
            "skipped", _past_end_clamped),
    Mistake("repeated indices are de-duplicated: a valid index listed twice is attended twice",
            _deduplicated),
    Mistake("the scores are scaled by 1/sqrt(d_qk) = 1/24, not by the sm_scale argument",
            _scaled(lambda s: oracle.MLA_DIM**-0.5)),
    Mistake("sm_scale is applied twice (the scores are scaled by sm_scale^2)", _scaled(lambda s: s * s)),
    Mistake("sm_scale is not applied to the scores", _scaled(lambda s: 1.0)),
    Mistake("sm_scale is applied with exp2 but without the log2(e) factor (scores scaled by "
            "sm_scale / ln 2 in base e)", _scaled(lambda s: s / math.log(2))),
    Mistake("attn_sink is ignored: the output is normalised by logaddexp(lse, attn_sink)",
            _without("attn_sink")),
    Mistake("topk_length is ignored: entries at or past topk_length[i] are skipped",
            _without("topk_length")),
)


def _scale_changed(name: str, f: Callable[[Tensor], Tensor]) -> Variant:
    return lambda case: _with_args(case, **{name: f(case.kwargs.get(name, _arg(case, name)))})


def _arg(case: Case, name: str):
    return case.args[list(inspect.signature(getattr(oracle, case.contract)).parameters).index(name)]


_Q8KV8 = (
    Mistake("q_scale is applied twice (the scores carry q_scale^2): the values are "
            "q.float() * q_scale, once", _scale_changed("q_scale", lambda s: s * s)),
    Mistake("q_scale is not applied: the values are q.float() * q_scale",
            _scale_changed("q_scale", torch.ones_like)),
    Mistake("kv_scale is not applied: keys and values are kv.float() * kv_scale",
            _scale_changed("kv_scale", torch.ones_like)),
    Mistake("kv_scale is applied twice (keys and values carry kv_scale^2)",
            _scale_changed("kv_scale", lambda s: s * s)),
    Mistake("the scores are scaled by 1/sqrt(d_qk), not by the sm_scale argument",
            lambda case: _with_args(case, sm_scale=case.args[0].shape[-1] ** -0.5)),
    Mistake("-1 is read as key 0: an index < 0 is invalid and skipped", _minus_one_as_zero),
)


_DECODE = (
    Mistake("-1 is read as slot 0: a slot < 0 is skipped", _minus_one_as_zero),
    Mistake("repeated slots are de-duplicated: a valid slot listed twice is attended twice",
            _deduplicated),
    Mistake("the scores are scaled by 1/sqrt(d_qk) = 1/24, not by the sm_scale argument",
            _scaled(lambda s: oracle.MLA_DIM**-0.5)),
    Mistake("attn_sink is ignored: the output is normalised by logaddexp(lse, attn_sink)",
            _without("attn_sink")),
    Mistake("topk_length is ignored: slots at or past topk_length[b] are not read",
            _without("topk_length")),
)


# ----------------------------------------------------------------------------- indexer logits
def _max_dot(case: Case) -> float:
    """The largest |q · k| of FP8 payloads the case's kernel must form."""
    q = case.args[0].float()
    if isinstance(case.args[1], tuple):
        k = case.args[1][0].float()
    else:
        cache = case.args[1]
        d = cache.shape[-1] - 4
        k = cache.reshape(cache.shape[0], -1)[:, : cache.shape[1] * d].reshape(-1, d)
        k = k.contiguous().view(torch.float8_e4m3fn).float()
    return float((q.reshape(-1, q.shape[-1]) @ k.T).abs().max())


def _overflowed(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> bool:
    name = next(iter(case.checks))
    if name not in got or _max_dot(case) <= FLOAT16_MAX:
        return False
    mask = case.aux.get(case.checks[name].get("mask", ""), torch.isfinite(expected[name]))
    c = got[name].double()
    lost = mask & ~torch.isfinite(c) & torch.isfinite(expected[name])
    # An overflowed dot gives +inf (or inf - inf = NaN after the gates); a masking bug only -inf.
    return bool((lost & (torch.isposinf(c) | torch.isnan(c))).any())


def _k_scales(case: Case, f: Callable[[Tensor], Tensor]) -> Case:
    if isinstance(case.args[1], tuple):  # ragged: (k_fp8, k_scale)
        k_fp8, k_scale = case.args[1]
        return _with_args(case, kv=(k_fp8, f(k_scale)))
    cache = case.args[1].clone()
    blocks = cache.reshape(cache.shape[0], -1)
    d = cache.shape[-1] - 4
    scales = blocks[:, cache.shape[1] * d :].contiguous().view(torch.float32)
    blocks[:, cache.shape[1] * d :] = f(scales).contiguous().view(torch.uint8)
    return _with_args(case, kv_cache=cache)


def _without_relu(case: Case) -> dict[str, Tensor]:
    """The logits with the ReLU left out: relu(x) - relu(-x) = x, so they are the oracle's on q
    minus the oracle's on -q (a sign flip is exact in e4m3)."""
    (pos,) = expected_outputs(case)
    q = case.args[0]
    (neg,) = expected_outputs(replace(case, args=((-q.float()).to(q.dtype), *case.args[1:])))
    return {"logits": torch.where(torch.isfinite(pos), pos - neg, pos)}


_LOGITS = (
    Mistake("overflow: q·k of FP8 payloads at full range passes float16's 65504 (|q|, |k| up to "
            "448) and the kernel's logits are inf/NaN there: accumulate (and keep every "
            "intermediate) in float32", matches=_overflowed),
    Mistake("the ReLU is left out: each head's score is relu(q · k) before the gate",
            _without_relu),
    Mistake("the key scales are not applied (each key's logit needs its k_scale)",
            lambda case: _k_scales(case, torch.ones_like)),
    Mistake("the key scales are applied twice", lambda case: _k_scales(case, lambda s: s * s)),
    Mistake("the head gates (weights) are not applied: each head's ReLU score is weighted",
            lambda case: _with_args(case, weights=torch.ones_like(case.args[2]))),
)


# ----------------------------------------------------------------------------- MX indexer logits
def _mx_dim(case: Case) -> int | None:
    """The head dim of an MX logits case, None for its FP8 format (no scale words)."""
    q_fp, _ = case.args[0]
    fmt = oracle.index_format(case.args[0])
    return None if fmt == "fp8" else q_fp.shape[-1] * (2 if fmt == "mxfp4" else 1)


def _word_bytes(sf: Tensor) -> Tensor:
    return sf.contiguous().view(torch.uint8).reshape(*sf.shape, 4).clone()


def _as_words(b: Tensor, shape: torch.Size) -> Tensor:
    return b.contiguous().view(torch.int32).reshape(shape)


def _paged_parts(case: Case) -> tuple[Tensor, Tensor, Tensor]:
    """A copy of the case's paged cache and views of its payloads and scale words."""
    cache = case.args[1].clone()
    nb, bkv, _, width = cache.shape
    payload, words = index_k_page_split(cache.view(nb, -1), bkv, width - 4)
    return cache, payload, words


def _mx_scales(f: Callable[[Tensor, int], Tensor], which: str) -> Variant:
    """The case with ``f(bytes [..., 4], d)`` applied to the scale words of ``which`` ("q",
    "kv" or "q+kv"): what a kernel that reads them that way computes."""
    def variant(case: Case) -> Case | None:
        d = _mx_dim(case)
        if d is None:
            return None
        changes: dict = {}
        if "q" in which.split("+"):
            q_fp, q_sf = case.args[0]
            changes["q"] = (q_fp, _as_words(f(_word_bytes(q_sf), d), q_sf.shape))
        if "kv" in which.split("+"):
            if isinstance(case.args[1], tuple):
                kv_fp, kv_sf = case.args[1]
                changes["kv"] = (kv_fp, _as_words(f(_word_bytes(kv_sf), d), kv_sf.shape))
            else:
                cache, _, words = _paged_parts(case)
                words.copy_(f(words.clone(), d))
                changes["kv_cache"] = cache
        return _with_args(case, **changes)
    return variant


def _used(f: Callable[[Tensor], Tensor]) -> Callable[[Tensor, int], Tensor]:
    """``f`` on the ``d / 32`` exponent bytes a row uses, the padding bytes kept."""
    def edit(b: Tensor, d: int) -> Tensor:
        b[..., : d // 32] = f(b[..., : d // 32])
        return b
    return edit


def _unit(b: Tensor) -> Tensor:
    return torch.full_like(b, 127)


def _doubled(b: Tensor) -> Tensor:
    return (2 * b.to(torch.int32) - 127).clamp(1, 254).to(torch.uint8)


def _first_block(b: Tensor) -> Tensor:
    return b[..., :1].expand_as(b).clone()


def _big_endian(b: Tensor, d: int) -> Tensor:
    return b.flip(-1)


def _mx_key_scales_ignored(case: Case) -> Case | dict[str, Tensor] | None:
    if _mx_dim(case) is None:  # FP8: the float32 key scales
        return _k_scales(case, torch.ones_like)
    return _mx_scales(_used(_unit), "kv")(case)


def _swapped_nibbles(case: Case) -> Case | None:
    q_fp, q_sf = case.args[0]
    if q_fp.dtype != torch.int8:
        return None

    def swap(t: Tensor) -> Tensor:
        raw = t.view(torch.uint8)
        return ((raw << 4) | (raw >> 4)).view(t.dtype)

    # Swapped in q and in the keys alike, the dot products would not change: the keys alone.
    if isinstance(case.args[1], tuple):
        return _with_args(case, kv=(swap(case.args[1][0]), case.args[1][1]))
    cache, payload, _ = _paged_parts(case)
    payload.copy_(swap(payload.clone()))
    return _with_args(case, kv_cache=cache)


def _negated(q_fp: Tensor) -> Tensor:
    """-q exactly: the sign bit of every element (e4m3's 0x80, each e2m1 nibble's 0x8)."""
    raw = q_fp.view(torch.uint8)
    return (raw ^ (0x88 if q_fp.dtype == torch.int8 else 0x80)).view(q_fp.dtype)


def _mx_without_relu(case: Case) -> dict[str, Tensor]:
    """relu(x) - relu(-x) = x: the logits on q minus those on -q."""
    (pos,) = expected_outputs(case)
    q_fp, q_sf = case.args[0]
    (neg,) = expected_outputs(replace(case, args=((_negated(q_fp), q_sf), *case.args[1:])))
    return {"logits": torch.where(torch.isfinite(pos), pos - neg, pos)}


_MX_LOGITS = (
    Mistake("the query scales (q_sf) are not applied: a query block's values are its elements "
            "× 2^(byte - 127)", _mx_scales(_used(_unit), "q")),
    Mistake("the key scales are not applied: a key block's values are its elements × "
            "2^(byte - 127) (FP8: each key's logit needs its k_scale)", _mx_key_scales_ignored),
    Mistake("the query scale is applied twice (2^(2 (byte - 127))): once, inside the dot",
            _mx_scales(_used(_doubled), "q")),
    Mistake("one exponent per row (byte 0 for every block, a per-token scale): byte j scales "
            "elements 32j … 32j + 31", _mx_scales(_used(_first_block), "q+kv")),
    Mistake("the scale word is read big-endian (block j from byte 3 - j): block j is byte j of "
            "the little-endian int32", _mx_scales(_big_endian, "q+kv")),
    Mistake("the two e2m1 codes of a key byte are swapped: element 2i is the low nibble, 2i + 1 "
            "the high one", _swapped_nibbles),
    Mistake("the ReLU is left out: each head's score is relu(q · k) before the gate",
            _mx_without_relu),
    Mistake("the head gates (weights) are not applied: each head's ReLU score is weighted",
            lambda case: _with_args(case, weights=torch.ones_like(case.args[2]))),
)


def _unread_nan_reached(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> bool:
    """The kernel's ``out`` is NaN exactly on the queries whose index list names a NaN slot it
    must not read (past topk_length, or slot 0 for a -1), and finite elsewhere."""
    if "out" not in got:
        return False
    q, k_cache, indices = case.args[0], case.args[1], case.args[2]
    rows = k_cache.reshape(-1, k_cache.shape[-1])
    nan_slot = torch.isnan(rows.float()).any(-1)
    named = nan_slot[indices.clamp_min(0).long()].any(-1)  # [b, s_q]
    if not bool(named.any()) or bool(torch.isnan(expected["out"]).any()):
        return False
    want = named[:, :, None, None].expand_as(got["out"])
    if not torch.equal(torch.isnan(got["out"]), want):
        return False
    rest = torch.where(want, expected["out"], got["out"].to(expected["out"].dtype))
    return check_tensor(case.checks["out"], rest, expected["out"], case.aux.__getitem__).passed


_DECODE_BF16 = _DECODE + (
    Mistake("a slot that is not read reaches the output (a masked entry multiplied by 0, and "
            "0 × NaN = NaN): do not load slots past topk_length, or slot 0 for a -1",
            matches=_unread_nan_reached),
)


# ----------------------------------------------------------------------------- fused top-k
def _ranks(made: Callable[[Case], dict[str, Tensor] | None]) -> Callable[..., bool]:
    """A fused top-k mistake as a test of the outputs: the kernel's indices pass the contract's
    ``topk_margin`` against the scores and row ranges of the mistaken computation ``made(case)``
    (the margin metric reads the scores, not one expected selection)."""
    def matches(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> bool:
        aux = made(case) if "indices" in got else None
        if aux is None:
            return False
        spec = case.checks["indices"]
        refs = {spec[k]: aux[k] for k in ("scores", "row_starts", "row_ends")}
        return check_tensor(spec, got["indices"], expected["indices"], refs.__getitem__).passed
    return matches


def _scored(change: Callable[[Case], Case]) -> Callable[[Case], dict[str, Tensor]]:
    return lambda case: topk_scores(case.contract, change(case).args)


def _no_relu_scores(case: Case) -> dict[str, Tensor]:
    """Scores without the ReLU: relu(x) - relu(-x) = x, the scores on q minus those on -q."""
    q = case.args[0]
    pos = topk_scores(case.contract, case.args)
    neg = topk_scores(case.contract, ((-q.float()).to(q.dtype), *case.args[1:]))["scores"]
    return {**pos, "scores": torch.where(torch.isfinite(pos["scores"]), pos["scores"] - neg, -math.inf)}


def _last_left_out(case: Case) -> dict[str, Tensor]:
    aux = topk_scores(case.contract, case.args)
    return {**aux, "row_ends": torch.maximum(aux["row_ends"] - 1, aux["row_starts"])}


def _relative(convert: Callable[[Case, Tensor], Tensor | None]) -> Callable[..., bool]:
    """The kernel's indices pass the contract once ``convert`` maps them back to positions."""
    def matches(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> bool:
        if "indices" not in got:
            return False
        back = convert(case, got["indices"].long())
        if back is None:
            return False
        aux = case.aux.__getitem__
        return check_tensor(case.checks["indices"], back.to(torch.int32), expected["indices"], aux).passed
    return matches


def _from_key_numbers(case: Case, idx: Tensor) -> Tensor | None:
    ks = case.args[3].long()[:, None]
    return torch.where(idx >= 0, idx - ks, idx) if bool((ks > 0).any()) else None


def _from_slots(case: Case, idx: Tensor) -> Tensor:
    """Physical slots (block * block_size + offset) back to positions through the block table."""
    return positions_of_slots(idx, case.args[4], case.args[1].shape[1], case.args[0].shape[1])


_TOPK = (
    Mistake("each row's last key is never ranked (the row's range read as [start, end - 1)): "
            "a row sees keys up to end - 1 inclusive", matches=_ranks(_last_left_out)),
    Mistake("the ReLU is left out: each head's score is relu(q · k) before the gate",
            matches=_ranks(_no_relu_scores)),
    Mistake("the head gates (weights) are not applied: each head's ReLU score is weighted",
            matches=_ranks(_scored(lambda c: _with_args(c, weights=torch.ones_like(c.args[2]))))),
    Mistake("the key scales are not applied (each key's score needs its k_scale)",
            matches=_ranks(_scored(lambda c: _k_scales(c, torch.ones_like)))),
)

_RAGGED_TOPK = _TOPK + (
    Mistake("the indices are key numbers (ks + position): the contract's are relative to the "
            "row's ks, as top_k_per_row_prefill returns them", matches=_relative(_from_key_numbers)),
)

_PAGED_TOPK = _TOPK + (
    Mistake("the indices are physical slots (block * block_size + offset, flashinfer-bench's "
            "output): the contract's are positions in the request (its --definition mapping "
            "converts)", matches=_relative(_from_slots)),
)


# ----------------------------------------------------------------------------- quantizers
_RECIP_448 = torch.tensor(1 / 448.0, dtype=torch.float32)


def _scales(amax: Tensor, fmt: str | None, rule: str, floor_scale: bool = False) -> Tensor:
    """float32 scales of blocks with max |x| = ``amax``: ``mul`` is the contract's
    ``amax × fl32(1/448)``, ``div`` the true quotient; ue8m0 rounds the raw scale up to a power
    of two (``round``: to the nearest one). The 1e-4 floor applies to amax, or with
    ``floor_scale`` (FlashMLA's ue8m0 rows) to the raw scale."""
    amax = amax.float() if floor_scale and fmt == "ue8m0" else amax.float().clamp_min(1e-4)
    raw = amax / 448.0 if rule == "div" else amax * _RECIP_448
    if fmt != "ue8m0":
        return raw
    exponent = torch.log2(raw.clamp_min(1e-4 if floor_scale else 0.0).double())
    return torch.exp2(torch.round(exponent) if rule == "round" else torch.ceil(exponent)).float()


def _payload(x: Tensor, s: Tensor) -> Tensor:
    return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn)


def _act_quant(case: Case, fmt: str | None, rule: str) -> dict[str, Tensor]:
    x = case.args[0].float()
    blocks = x.reshape(*x.shape[:-1], -1, 128)
    s = _scales(blocks.abs().amax(-1), fmt, rule)
    return {"x_fp8": _payload(blocks, s[..., None]).reshape(x.shape), "scale": s}


def _act_fmt(case: Case) -> str | None:
    return case.kwargs.get("scale_fmt")


def _mla_rows(case: Case, fmt: str | None, rule: str, scales_first: bool = False) -> dict[str, Tensor]:
    kv = case.args[0]
    rows = kv.reshape(-1, oracle.MLA_DIM)
    tiles = rows[:, : oracle.MLA_NOPE_DIM].float().reshape(-1, 4, 128)
    s = _scales(tiles.abs().amax(-1), fmt, rule, floor_scale=True)
    payload = _payload(tiles, s[..., None]).reshape(-1, oracle.MLA_NOPE_DIM).view(torch.uint8)
    scale_bytes = s.contiguous().view(torch.uint8)
    rope = rows[:, oracle.MLA_NOPE_DIM :].contiguous().view(torch.uint8)
    parts = [scale_bytes, payload, rope] if scales_first else [payload, scale_bytes, rope]
    return {"k_cache": torch.cat(parts, dim=1).view(*kv.shape[:-1], oracle.MLA_ROW_BYTES)}


def _mla_fmt(case: Case) -> str | None:
    return case.kwargs.get("scale_fmt", "ue8m0")


def _index_k(case: Case, rule: str, interleaved: bool = False) -> dict[str, Tensor]:
    k = case.args[0].float()
    nb, bs, _, d = k.shape
    s = _scales(k.abs().amax(-1), None, rule)  # [nb, bs, 1]
    payload = k / s[..., None] if rule == "div" else k * torch.reciprocal(s)[..., None]
    payload = payload.clamp(-448, 448)
    payload = payload.to(torch.float8_e4m3fn).view(torch.uint8).reshape(nb, bs, d)
    scale_bytes = s.reshape(nb, bs, 1).contiguous().view(torch.uint8)  # [nb, bs, 4]
    if interleaved:
        out = torch.cat([payload, scale_bytes], dim=2)
    else:
        out = torch.cat([payload.reshape(nb, -1), scale_bytes.reshape(nb, -1)], dim=1)
    return {"kv_cache": out.reshape(nb, bs, 1, d + 4)}


def _scale_mistakes(write: Callable[[Case, str | None, str], dict[str, Tensor]],
                    fmt_of: Callable[[Case], str | None], ceil: str) -> tuple[Mistake, ...]:
    """The scale mistakes of a block-scaled writer ``write(case, scale_fmt, rule)``: the other
    scale format, the ue8m0 exponent rounded to nearest, and the true division."""
    return (
        Mistake("your scales are powers of two (ue8m0) where float32 amax/448 scales are due",
                lambda c: write(c, "ue8m0", "mul") if fmt_of(c) is None else None),
        Mistake("your scales are float32 amax/448 where power-of-two (ue8m0) scales are due",
                lambda c: write(c, None, "mul") if fmt_of(c) == "ue8m0" else None),
        Mistake(f"the ue8m0 exponent is rounded to nearest: it is {ceil}",
                lambda c: write(c, "ue8m0", "round") if fmt_of(c) == "ue8m0" else None),
        Mistake("the scale is amax / 448 (a true division): the contract's is amax × fl32(1/448), "
                "as upstream computes it on CUDA", lambda c: write(c, fmt_of(c), "div")),
    )


_ACT_QUANT = _scale_mistakes(_act_quant, _act_fmt, "ceil(log2(amax / 448))")

_MLA_CACHE = (
    Mistake("the four float32 tile scales are written before the 512 FP8 bytes: a row is "
            "[512 e4m3 | 4 float32 scales | 64 bf16 RoPE]",
            lambda c: _mla_rows(c, _mla_fmt(c), "mul", scales_first=True)),
    *_scale_mistakes(_mla_rows, _mla_fmt, "ceil(log2(max(amax / 448, 1e-4)))"),
)

_INDEX_K_CACHE = (
    Mistake("tokens are written as interleaved 132-byte rows: a 64-token page is its 64 × 128 "
            "FP8 bytes, then the 64 float32 scales", lambda c: _index_k(c, "mul", interleaved=True)),
    Mistake("the scale is amax / 448 and the payload x / scale (true divisions): the contract's "
            "are amax × fl32(1/448) and x × fl32(1/scale), DeepGEMM's helper on CUDA",
            lambda c: _index_k(c, "div")),
)


def _fp4_pages(case: Case, *, swap: bool = False, gran: int = 32, ties_even: bool = False,
               nearest: bool = False, interleaved: bool = False) -> dict[str, Tensor]:
    """The MXFP4 index-K pages written with one mistake: nibbles swapped, scales per ``gran``
    elements, midpoints to the even code, the exponent rounded to nearest, or 68-byte rows."""
    k = case.args[0].float()
    nb, bs, _, d = k.shape
    gran = min(gran, d)  # a block wider than the key is the key (the helper pads with zeros)
    x = k.reshape(nb * bs, d // gran, gran)
    raw = x.abs().amax(-1).clamp_min(1e-4) / 6.0
    exponent = torch.round(torch.log2(raw)) if nearest else torch.ceil(torch.log2(raw))
    scaled = x / torch.exp2(exponent)[..., None]
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    distance = (scaled.abs()[..., None] - grid).abs()
    # Ties: the lower code (argmin takes the first), or the code with an even index (cvt.rn).
    magnitude = distance.argmin(-1)
    if ties_even:
        tie = (distance == distance.min(-1, keepdim=True).values).sum(-1) > 1
        magnitude = torch.where(tie & (magnitude % 2 == 1), magnitude + 1, magnitude)
    codes = (magnitude | (((scaled < 0) & (magnitude != 0)).long() << 3)).reshape(nb * bs, d // 2, 2)
    lo, hi = (codes[..., 1], codes[..., 0]) if swap else (codes[..., 0], codes[..., 1])
    packed = (lo | (hi << 4)).to(torch.uint8)
    blocks = (exponent + 127).clamp(1, 254).to(torch.uint8).repeat_interleave(32 // gran if gran < 32 else 1, -1)
    exponents = torch.full((nb * bs, 4), 127, dtype=torch.uint8)
    exponents[:, : min(blocks.shape[1], 4)] = blocks[:, :4]
    return _mx_page_bytes(packed, exponents, nb, bs, interleaved)


def _mx_page_bytes(payload: Tensor, exps: Tensor, nb: int, bs: int, interleaved: bool) -> dict[str, Tensor]:
    """The pages of MX index keys (payloads ``[nb * bs, P]``, exponent words ``[nb * bs, 4]``):
    a block's payloads then its words, or (``interleaved``) each token's payload and word."""
    width = payload.shape[1] + 4
    if interleaved:
        return {"kv_cache": torch.cat([payload, exps], 1).view(nb, bs, 1, width)}
    pages = torch.cat([payload.reshape(nb, -1), exps.reshape(nb, -1)], 1)
    return {"kv_cache": pages.view(nb, bs, 1, width)}


def _mxfp8_pages(case: Case, *, gran: int = 32, nearest: bool = False, interleaved: bool = False,
                 unbiased: bool = False) -> dict[str, Tensor]:
    """The MXFP8 index-K pages written with one mistake: scales per ``gran`` elements, the
    exponent rounded to nearest, 132-byte interleaved rows, or exponent bytes without the bias."""
    k = case.args[0].float()
    nb, bs, _, d = k.shape
    g = min(gran, d)
    x = k.reshape(nb * bs, d // g, g)
    raw = x.abs().amax(-1).clamp_min(1e-4) * _RECIP_448
    mantissa, exp = torch.frexp(raw)
    e = torch.round(torch.log2(raw)).int() if nearest else torch.where(mantissa == 0.5, exp - 1, exp)
    payload = (x * torch.exp2(-e.float())[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn)
    code = (e if unbiased else e + 127).to(torch.int64) & 0xFF
    per_block = code.repeat_interleave(g // 32, dim=1).to(torch.uint8)
    exps = torch.full((nb * bs, 4), 127, dtype=torch.uint8)
    exps[:, : per_block.shape[1]] = per_block
    return _mx_page_bytes(payload.view(torch.uint8).reshape(nb * bs, d), exps, nb, bs, interleaved)


_MXFP8_CACHE = (
    Mistake("the words hold float32 per-token scales (kv_cache_cast_to_fp8's page, the same D + 4 "
            "bytes): an MXFP8 word is D/32 ue8m0 exponent bytes, one per 32 elements",
            lambda c: {"kv_cache": oracle.kv_cache_cast_to_fp8(c.args[0])}),
    Mistake("one ue8m0 scale per 128 elements (per_token_cast_to_fp8's default gran_k): the MXFP8 "
            "index keys take one per 32", lambda c: _mxfp8_pages(c, gran=128)),
    Mistake("the ue8m0 exponent is rounded to nearest: it is ceil(log2(amax × fl32(1/448)))",
            lambda c: _mxfp8_pages(c, nearest=True)),
    Mistake("the exponent bytes are unbiased (2^e written as e): a ue8m0 byte is e + 127",
            lambda c: _mxfp8_pages(c, unbiased=True)),
    Mistake("tokens are written as interleaved D + 4-byte rows: a page is its payloads for every "
            "token, then the exponent words", lambda c: _mxfp8_pages(c, interleaved=True)),
)


_FP4_CACHE = (
    Mistake("the two codes of a byte are swapped: element 2i is the low nibble, 2i + 1 the high one",
            lambda c: _fp4_pages(c, swap=True)),
    Mistake("one ue8m0 scale per 128 elements (per_token_cast_to_fp4's default gran_k): the FP4 "
            "index keys take one per 32", lambda c: _fp4_pages(c, gran=128)),
    Mistake("midpoints round to the even code (a hardware cvt.rn): DeepGEMM's helper takes the "
            "smaller magnitude (0.75 -> 0.5, 5 -> 4)", lambda c: _fp4_pages(c, ties_even=True)),
    Mistake("the ue8m0 exponent is rounded to nearest: it is ceil(log2(amax / 6))",
            lambda c: _fp4_pages(c, nearest=True)),
    Mistake("tokens are written as interleaved 68-byte rows: a page is its codes for every token, "
            "then the exponent words", lambda c: _fp4_pages(c, interleaved=True)),
)


# ----------------------------------------------------------------------------- the table
MISTAKES: dict[str, tuple[Mistake, ...]] = {
    "act_quant": _ACT_QUANT,
    "kv_cache_cast_to_fp8": _INDEX_K_CACHE,
    "kv_cache_cast_to_fp4": _FP4_CACHE,
    "kv_cache_cast_to_mxfp8": _MXFP8_CACHE,
    "fp8_mqa_logits": _LOGITS,
    "fp8_paged_mqa_logits": _LOGITS,
    "fp8_fp4_mqa_logits": _MX_LOGITS,
    "fp8_fp4_paged_mqa_logits": _MX_LOGITS,
    "fp8_mqa_topk": _RAGGED_TOPK,
    "fp8_paged_mqa_topk": _PAGED_TOPK,
    "quantize_k_cache": _MLA_CACHE,
    "flash_mla_sparse_fwd": _SPARSE,
    "sparse_mla_q8kv8_prefill_fwd": _Q8KV8,
    "flash_mla_sparse_decode": _DECODE,
    "flash_mla_sparse_decode_bf16": _DECODE_BF16,
}


def _convention_mistakes(contract: str, pinned: dict) -> list[Mistake]:
    """The contract's other conventions, each as a mistake: a kernel that follows one of them
    without taking its keyword is told to check under it."""
    out = []
    for name, options in conventions(contract).items():
        if options == pinned:
            continue
        keys = sorted(set(options) | set(pinned))
        undo = {k: options.get(k) for k in keys}
        flags = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "the newest defaults"
        out.append(Mistake(
            f"the kernel follows convention {name!r} ({flags}): check it with --convention "
            f"{name} (check_kernel(..., convention={name!r})), or let it take the keyword",
            functools.partial(_undone, undo=undo)))
    return out


def _undone(case: Case, undo: dict) -> Case:
    return _with_args(case, **undo)


def _outputs(case: Case, variant: Case | dict[str, Tensor]) -> tuple[dict[str, Tensor], dict]:
    if isinstance(variant, Case):
        return dict(zip(variant.checks, expected_outputs(variant))), variant.checks
    return dict(variant), case.checks


def diagnose(case: Case, got: Mapping[str, Tensor], expected: Mapping[str, Tensor]) -> list[str]:
    """The causes of a failure: each mistake of the contract that changes this case's outputs
    and whose outputs the kernel's (``got``, CPU tensors by output name, any subset) match by
    the contract's metric."""
    pinned = {k: case.kwargs[k] for k in case.pinned}
    causes = []
    for mistake in [*MISTAKES.get(case.contract, ()), *_convention_mistakes(case.contract, pinned)]:
        try:
            if mistake.matches is not None:
                if mistake.matches(case, got, expected):
                    causes.append(mistake.cause)
                continue
            assert mistake.variant is not None
            made = mistake.variant(case)
            if made is None:
                continue
            outs, checks = _outputs(case, made)
        except (ValueError, RuntimeError):  # the oracle refuses the mistaken call: no diagnosis
            continue
        names = [n for n in got if n in outs]
        if not names or all(_same(outs[n], expected[n]) for n in names):
            continue
        if all(check_tensor(checks[n], got[n], outs[n], case.aux.__getitem__).passed for n in names):
            causes.append(mistake.cause)
    return causes


def _same(a: Tensor, b: Tensor) -> bool:
    """Bitwise equal (NaN equal to NaN): the mistake does not show in this case."""
    if a.shape != b.shape or a.element_size() != b.element_size():
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8),
                       b.contiguous().reshape(-1).view(torch.uint8))
