"""Absorbed sparse MLA and the MHA one-shot path, proved against dense attention.

Every expected value is computed here, in float64, from the explicit formulas: the projections
(RMSNorm, interleaved or half-split RoPE written pair by pair), per-head expanded keys and
values from ``kv_b_proj``, a dense score matrix with ``-inf`` outside the visible (or selected)
keys, softmax, ``@ V``, ``o_proj``; and, for ``sparse_mla_fwd``, a scalar loop over each
(row, head, index) that follows FlashMLA's ``tests/ref.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import glm_dsa.mla as mla_module
from glm_dsa.batch import ForwardBatch
from glm_dsa.config import DSAConfig, get_config
from glm_dsa.kv_format import (
    mla_kv_dequantize,
    mla_kv_pack_bf16,
    mla_kv_quantize,
    mla_kv_unpack_bf16,
)
from glm_dsa.mla import MLA, dense_causal_mha, sparse_mla_fwd, split_bf16x3

INT_MIN, INT_MAX = -(2**31), 2**31 - 1
TINY = get_config("tiny")
# Two FP8 tiles per latent row, so a per-tile scale mix-up would show.
TINY_2TILES = TINY.replace(kv_lora_rank=256)

requests_st = st.lists(
    st.tuples(st.integers(0, 10), st.integers(1, 9)), min_size=1, max_size=3
)  # (prefix_len, extend_len) per request
seed_st = st.integers(0, 2**16)


# ----------------------------------------------------------------------------- fixtures


def make_mla(config: DSAConfig, seed: int, dtype: torch.dtype = torch.float64) -> MLA:
    """An MLA with random weights scaled so that scores spread over a few units (peaky but not
    one-hot softmax) and non-trivial norm weights."""
    gen = torch.Generator().manual_seed(seed)
    mla = MLA(config)
    with torch.no_grad():
        for p in mla.parameters():
            if p.dim() == 1:
                p.copy_(1 + 0.25 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(1.5 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))
    return mla.requires_grad_(False).to(dtype)


@dataclass
class Case:
    mla: MLA
    batch: ForwardBatch
    x_ctx: torch.Tensor          # [S_kv, hidden]: every context token (prefix and extend)
    ctx_positions: torch.Tensor  # int64 [S_kv]
    q_rows: torch.Tensor         # int64 [n]: rows of x_ctx that are this step's query tokens

    def context_projection(self):
        return self.mla.project(self.x_ctx, self.ctx_positions)

    def query_projection(self):
        return self.mla.project(self.x_ctx[self.q_rows], self.batch.positions)


def make_case(config, requests, seed, dtype=torch.float64) -> Case:
    prefix_lens = [p for p, _ in requests]
    extend_lens = [e for _, e in requests]
    batch = ForwardBatch.contiguous(extend_lens, prefix_lens)
    gen = torch.Generator().manual_seed(seed + 1)
    s_kv = batch.kv_slots.numel()
    x_ctx = torch.randn(s_kv, config.hidden_size, generator=gen, dtype=torch.float64).to(dtype)
    ctx_positions = torch.cat([torch.arange(p + e) for p, e in requests])
    starts = torch.cumsum(torch.tensor([0] + [p + e for p, e in requests[:-1]]), 0)
    q_rows = torch.cat([s + p + torch.arange(e) for s, (p, e) in zip(starts.tolist(), requests)])
    assert torch.equal(ctx_positions[q_rows], batch.positions)
    return Case(make_mla(config, seed, dtype), batch, x_ctx, ctx_positions, q_rows)


def full_topk(batch: ForwardBatch, width: int) -> torch.Tensor:
    """The indexer's answer when the top-k covers every key: ``0..len-1`` then -1."""
    visible = (batch.ke - batch.ks).to(torch.int64)[:, None]
    col = torch.arange(width)[None, :]
    return torch.where(col < visible, col, -1).to(torch.int32)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| relative to the output's scale max |expected|."""
    return float((actual.double() - expected.double()).abs().max() / expected.double().abs().max())


# ---------------------------------------------------------------- independent float64 reference


def ref_rope(t: torch.Tensor, positions: torch.Tensor, theta: float, interleaved: bool) -> torch.Tensor:
    """t [n, heads, d]: pair i turns by ``position * theta**(-2i/d)``, written pair by pair."""
    d = t.shape[-1]
    out = t.clone()
    for i in range(d // 2):
        a_i, b_i = (2 * i, 2 * i + 1) if interleaved else (i, i + d // 2)
        angle = positions.double() * theta ** (-2.0 * i / d)
        cos, sin = angle.cos()[:, None], angle.sin()[:, None]
        a, b = t[..., a_i], t[..., b_i]
        out[..., a_i] = a * cos - b * sin
        out[..., b_i] = a * sin + b * cos
    return out


def ref_projection(mla: MLA, x: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every MLA projection in float64 from the module's weights (HF dataflow)."""
    cfg = mla.config
    assert cfg.rope_scaling is None, "the reference RoPE has no YaRN"
    w = {k: v.double() for k, v in mla.state_dict().items()}
    x = x.double()
    n, heads = x.shape[0], cfg.num_attention_heads
    nope, rope, r = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank

    def rms(t, weight):
        return t / torch.sqrt(t.square().mean(-1, keepdim=True) + cfg.rms_norm_eps) * weight

    q_latent = rms(x @ w["q_a_proj.weight"].T, w["q_a_layernorm.weight"])
    q = (q_latent @ w["q_b_proj.weight"].T).view(n, heads, nope + rope)
    q_pe = ref_rope(q[..., nope:], positions, cfg.rope_theta, cfg.rope_interleave)
    q = torch.cat([q[..., :nope], q_pe], -1)
    kv_a = x @ w["kv_a_proj_with_mqa.weight"].T
    c = rms(kv_a[:, :r], w["kv_a_layernorm.weight"])
    k_pe = ref_rope(kv_a[:, None, r:], positions, cfg.rope_theta, cfg.rope_interleave)[:, 0]
    kv_b = (c @ w["kv_b_proj.weight"].T).view(n, heads, nope + cfg.v_head_dim)
    k = torch.cat([kv_b[..., :nope], k_pe[:, None, :].expand(n, heads, rope)], -1)
    return dict(q_latent=q_latent, q=q, c=c, k_pe=k_pe, k=k, v=kv_b[..., nope:])


def ref_attention(case: Case, allowed: torch.Tensor | None = None) -> torch.Tensor:
    """Dense causal MHA in float64 over the full expanded K/V, then o_proj -> [n, hidden].

    Query m scores every context row, then gets -inf outside ``[ks[m], ke[m])`` and, when
    ``allowed [n, S_kv]`` is given, outside the allowed rows; softmax; @ V.
    """
    cfg = case.mla.config
    ref = ref_projection(case.mla, case.x_ctx, case.ctx_positions)
    q, k, v = ref["q"][case.q_rows], ref["k"], ref["v"]
    s_kv = k.shape[0]
    outs = []
    for m in range(q.shape[0]):
        col = torch.arange(s_kv)
        mask = (col >= int(case.batch.ks[m])) & (col < int(case.batch.ke[m]))
        if allowed is not None:
            mask &= allowed[m]
        if not bool(mask.any()):
            outs.append(torch.zeros(cfg.num_attention_heads * cfg.v_head_dim, dtype=torch.float64))
            continue
        scores = torch.einsum("hd,shd->hs", q[m], k) * cfg.softmax_scale       # [H, S_kv]
        scores = scores.masked_fill(~mask[None, :], -math.inf)
        probs = torch.softmax(scores, dim=-1)
        outs.append(torch.einsum("hs,shv->hv", probs, v).reshape(-1))
    o_proj = case.mla.o_proj.weight.double()
    return torch.stack(outs) @ o_proj.T


# ------------------------------------------------------------------------------- tests: MLA


def test_parameter_names_and_shapes_follow_hugging_face():
    with torch.device("meta"):
        mla = MLA(get_config("glm-5.3"))
    shapes = {k: tuple(v.shape) for k, v in mla.state_dict().items()}
    assert shapes == {
        "q_a_proj.weight": (2048, 6144),
        "q_a_layernorm.weight": (2048,),
        "q_b_proj.weight": (64 * 256, 2048),
        "kv_a_proj_with_mqa.weight": (576, 6144),
        "kv_a_layernorm.weight": (512,),
        "kv_b_proj.weight": (64 * (192 + 256), 512),
        "o_proj.weight": (6144, 64 * 256),
    }


@pytest.mark.parametrize("interleaved", [True, False])
@given(requests=requests_st, seed=seed_st)
@settings(max_examples=5)
def test_projection_matches_explicit_formula(interleaved, requests, seed):
    case = make_case(TINY.replace(rope_interleave=interleaved), requests, seed)
    ref = ref_projection(case.mla, case.x_ctx, case.ctx_positions)
    proj = case.context_projection()
    nope = TINY.qk_nope_head_dim
    assert rel_err(proj.q_latent, ref["q_latent"]) <= 1e-12
    assert rel_err(proj.q_nope, ref["q"][..., :nope]) <= 1e-12
    assert rel_err(proj.q_pe, ref["q"][..., nope:]) <= 1e-12
    assert rel_err(proj.kv_latent, torch.cat([ref["c"], ref["k_pe"]], -1)) <= 1e-12


@given(requests=requests_st, seed=seed_st, padded_to=st.sampled_from(["visible", "topk"]))
def test_absorbed_with_full_topk_equals_dense_causal_attention(requests, seed, padded_to):
    """float64: the absorbed sparse form over a top-k that covers every key is dense attention.

    ``visible``: the indexer's form (0..len-1 then -1); ``topk``: 0..topk-1 on every row, so the
    tail points past the causal limit and must be ignored.
    """
    case = make_case(TINY, requests, seed)
    width = TINY.index_topk
    indices = full_topk(case.batch, width)
    if padded_to == "topk":
        indices = torch.arange(width, dtype=torch.int32).expand(case.batch.num_tokens, width).contiguous()
    out = case.mla.forward_absorbed(
        case.query_projection(), case.context_projection().kv_latent, case.batch, indices
    )
    assert rel_err(out, ref_attention(case)) <= 1e-10


@given(requests=requests_st, seed=seed_st)
@settings(max_examples=6)
def test_absorbed_float32_is_within_1e_5_of_float64_dense_attention(requests, seed):
    case = make_case(TINY, requests, seed, dtype=torch.float32)
    out = case.mla.forward_absorbed(
        case.query_projection(), case.context_projection().kv_latent, case.batch,
        full_topk(case.batch, TINY.index_topk),
    )
    assert out.dtype == torch.float32
    assert rel_err(out, ref_attention(case)) <= 1e-5


@given(requests=requests_st, seed=seed_st)
def test_mha_path_equals_absorbed_path_and_dense_attention(requests, seed):
    case = make_case(TINY, requests, seed)
    proj, kv_context = case.query_projection(), case.context_projection().kv_latent
    mha = case.mla.forward_mha(proj, kv_context, case.batch)
    absorbed = case.mla.forward_absorbed(proj, kv_context, case.batch, full_topk(case.batch, 64))
    assert rel_err(mha, absorbed) <= 1e-10
    assert rel_err(mha, ref_attention(case)) <= 1e-10


def test_attend_picks_mha_up_to_the_threshold_and_absorbed_beyond():
    config = TINY.replace(dense_attn_kv_len_threshold=12)  # below index_topk=64: the threshold binds
    case = make_case(config, [(4, 8), (0, 3)], seed=3)      # longest context 12
    proj, kv_context = case.query_projection(), case.context_projection().kv_latent
    topk = full_topk(case.batch, 64)
    assert case.mla.use_mha(case.batch)
    assert torch.equal(
        case.mla.attend(proj, kv_context, case.batch, topk),
        case.mla.forward_mha(proj, kv_context, case.batch),
    )
    longer = make_case(config, [(5, 8), (0, 3)], seed=3)    # longest context 13
    proj, kv_context = longer.query_projection(), longer.context_projection().kv_latent
    topk = full_topk(longer.batch, 64)
    assert not longer.mla.use_mha(longer.batch)
    assert torch.equal(
        longer.mla.attend(proj, kv_context, longer.batch, topk),
        longer.mla.forward_absorbed(proj, kv_context, longer.batch, topk),
    )
    # index_topk binds when it is below the threshold: beyond it the top-k no longer covers all keys.
    small_topk = make_mla(TINY.replace(index_topk=64, dense_attn_kv_len_threshold=2048), 0)
    assert small_topk.use_mha(ForwardBatch.contiguous([64]))
    assert not small_topk.use_mha(ForwardBatch.contiguous([1], [64]))


@given(requests=requests_st, seed=seed_st, data=st.data())
def test_absorbed_with_topk_subset_equals_dense_attention_masked_outside_the_set(requests, seed, data):
    case = make_case(TINY, requests, seed)
    batch = case.batch
    n, s_kv, width = batch.num_tokens, batch.kv_slots.numel(), 16
    gen = torch.Generator().manual_seed(seed + 2)
    indices = torch.full((n, width), -1, dtype=torch.int32)
    allowed = torch.zeros(n, s_kv, dtype=torch.bool)
    for m in range(n):
        visible = int(batch.ke[m] - batch.ks[m])
        count = data.draw(st.integers(1, min(width, visible)), label=f"keys of row {m}")
        chosen = torch.randperm(visible, generator=gen)[:count]              # any order
        slots = torch.randperm(width, generator=gen)[:count]                 # -1 holes anywhere
        indices[m, slots] = chosen.to(torch.int32)
        allowed[m, int(batch.ks[m]) + chosen] = True
        junk = torch.tensor([INT_MIN, -7, visible, visible + 3, INT_MAX], dtype=torch.int32)
        free = indices[m] == -1
        fill = junk[torch.randint(len(junk), (int(free.sum()),), generator=gen)]
        indices[m, free] = torch.where(torch.rand(int(free.sum()), generator=gen) < 0.5, fill, -1)
    kv_context = case.context_projection().kv_latent
    out = case.mla.forward_absorbed(case.query_projection(), kv_context, batch, indices)
    assert rel_err(out, ref_attention(case, allowed)) <= 1e-10


def test_indices_past_the_causal_limit_are_ignored():
    case = make_case(TINY, [(3, 5), (2, 4)], seed=11)
    batch, n = case.batch, case.batch.num_tokens
    proj, kv_context = case.query_projection(), case.context_projection().kv_latent
    visible = (batch.ke - batch.ks).to(torch.int64)
    clean = full_topk(batch, 16)
    # Column 12 points one past the causal end (the query's successor, a real row of the buffer
    # for every query but the last of its request); column 13 points into the next request's
    # rows (or past the whole buffer for the last request).
    poisoned = clean.clone()
    poisoned[:, 12] = visible.to(torch.int32)
    poisoned[:, 13] = (batch.cu_seqlens_k[-1] - batch.ks).to(torch.int32)
    out_clean = case.mla.forward_absorbed(proj, kv_context, batch, clean)
    out_poisoned = case.mla.forward_absorbed(proj, kv_context, batch, poisoned)
    assert torch.equal(out_poisoned, out_clean)
    assert rel_err(out_clean, ref_attention(case)) <= 1e-10
    # The poison would matter if it were read: attending to the successor changes the output.
    allowed = torch.zeros(n, kv_context.shape[0], dtype=torch.bool)
    for m in range(n):
        allowed[m, int(batch.ks[m]): int(batch.ke[m]) + 1] = True
    leaky = ref_attention(
        Case(case.mla, _widened(batch), case.x_ctx, case.ctx_positions, case.q_rows), allowed
    )
    assert rel_err(leaky, out_clean) > 1e-3


def _widened(batch: ForwardBatch) -> ForwardBatch:
    """The batch with ke one larger (clamped to the buffer): a non-causal view for the control."""
    s_kv = batch.kv_slots.numel()
    return ForwardBatch(
        batch.positions, batch.out_slots, batch.kv_slots, batch.ks,
        torch.clamp(batch.ke + 1, max=s_kv), batch.cu_seqlens_q, batch.cu_seqlens_k,
        batch.prefix_lens, batch.extend_lens,
    )


@given(requests=requests_st, seed=seed_st, budget=st.integers(1, 200_000))
@settings(max_examples=8)
def test_absorbed_output_is_independent_of_the_gather_budget(requests, seed, budget):
    """Row chunks change only the row blocking of the q_abs / W_UV / o_proj GEMMs, i.e. the
    last bits (measured ≤ 1.4e-15 in float64); a lost or misplaced row would be O(1)."""
    case = make_case(TINY, requests, seed)
    proj, kv_context = case.query_projection(), case.context_projection().kv_latent
    topk = full_topk(case.batch, 64)
    whole = case.mla.forward_absorbed(proj, kv_context, case.batch, topk)
    chunked = case.mla.forward_absorbed(proj, kv_context, case.batch, topk, budget_bytes=budget)
    assert rel_err(chunked, whole) <= 1e-13


# ------------------------------------------------------------------ tests: FP8 vs bf16 KV cache


E4M3_HALF_STEP_REL = 2.0**-4       # 3 mantissa bits: half an ulp is ≤ 2^-4 of the value
E4M3_HALF_SUBNORMAL = 2.0**-10     # below 2^-6 the step is 2^-9 (in units of the tile scale)
BF16_HALF_STEP_REL = 2.0**-8       # 8 significant bits
F32_SLACK_REL = 2.0**-22           # a float32 (non power-of-two) scale's rounding on the way


def assert_latent_error_within_half_step(c, k_pe, cached, fmt, tile_scale=None):
    """The cache's per-element error is at most half a step of its format; returns (δc, δk_pe).

    FP8: round-to-nearest e4m3 of ``c / s`` errs by at most half a step: ``2^-4 |c / s|`` for a
    normal value, ``2^-10`` below the smallest normal ``2^-6`` (the clamp at 448 never cuts,
    since ``s ≥ amax / 448``); times the tile scale ``s``: ``max(2^-4 |c|, 2^-10 s)``. k_pe is
    kept in bf16: ``2^-8 |k_pe|``. bf16 cache: ``2^-8 |x|`` for both parts.
    """
    rank = c.shape[1]
    d_c, d_pe = cached[:, :rank].double() - c, cached[:, rank:].double() - k_pe
    if fmt == "bf16":
        bound_c = BF16_HALF_STEP_REL * c.abs()
    else:
        floor = (E4M3_HALF_SUBNORMAL * tile_scale.double()).repeat_interleave(128, dim=1)
        bound_c = torch.maximum(E4M3_HALF_STEP_REL * c.abs(), floor) + F32_SLACK_REL * c.abs()
    assert bool((d_c.abs() <= bound_c).all())
    assert bool((d_pe.abs() <= BF16_HALF_STEP_REL * k_pe.abs()).all())
    return d_c, d_pe


def output_error_bound(case: Case, d_c: torch.Tensor, d_pe: torch.Tensor) -> torch.Tensor:
    """Bound on ``||out_cache[m] - out_exact[m]||_2`` per query token given the cache's latent
    errors ``δc = d_c``, ``δk_pe = d_pe`` (full top-k: query m sees rows [ks, ke)).

    Scores move by exactly ``δs_mhj = scale (q_abs_mh · δc_j + q_pe_mh · δk_pe_j)``. Softmax
    weights are ``p'_j = p_j e^{δs_j} / Σ_k p_k e^{δs_k}``, so with ``w = max_j δs_j - min_j δs_j``
    each ``p'_j / p_j`` lies in ``[e^{-w}, e^{w}]`` and ``|p'_j - p_j| ≤ p_j (e^w - 1)``. The
    latent output ``o = Σ p_j c_j`` then moves by
    ``||Σ p'_j δc_j + Σ (p'_j - p_j) c_j|| ≤ max_j ||δc_j|| + (e^w - 1) max_j ||c_j||``
    (a convex combination, then the triangle inequality); ``W_UV_h`` and ``o_proj`` are linear,
    so their spectral norms carry it to the output. The realized δ is used rather than the
    worst case ``Σ |q| |δ|`` because aligning every rounding error against q would move the
    scores ~30x more than rounding ever does and make the bound vacuous; the per-element size of
    δ is bounded a priori by ``assert_latent_error_within_half_step``.
    """
    cfg = case.mla.config
    ref = ref_projection(case.mla, case.x_ctx, case.ctx_positions)
    w = case.mla.kv_b_proj.weight.double().view(
        cfg.num_attention_heads, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank
    )
    w_uk, w_uv = w[:, : cfg.qk_nope_head_dim], w[:, cfg.qk_nope_head_dim :]
    q = ref["q"][case.q_rows]
    q_abs = torch.einsum("nhd,hdc->nhc", q[..., : cfg.qk_nope_head_dim], w_uk)
    d_scores = cfg.softmax_scale * (q_abs @ d_c.T + q[..., cfg.qk_nope_head_dim :] @ d_pe.T)
    c_norm, d_c_norm = ref["c"].norm(dim=-1), d_c.norm(dim=-1)                 # [S_kv]
    uv_norm = torch.linalg.matrix_norm(w_uv, ord=2)                            # [H]
    o_norm = torch.linalg.matrix_norm(case.mla.o_proj.weight.double(), ord=2)
    bounds = []
    for m in range(q.shape[0]):
        lo, hi = int(case.batch.ks[m]), int(case.batch.ke[m])
        moved = d_scores[m, :, lo:hi]                                          # [H, visible]
        spread = moved.amax(-1) - moved.amin(-1)
        lat = d_c_norm[lo:hi].max() + torch.expm1(spread) * c_norm[lo:hi].max()   # [H]
        bounds.append(o_norm * torch.sqrt(((uv_norm * lat) ** 2).sum()))
    return torch.stack(bounds)


@pytest.mark.parametrize("scale_fmt", ["ue8m0", None])
def test_fp8_cache_error_against_bf16_cache_is_within_derived_bound(scale_fmt):
    """FP8 (656 B/token layout) and bf16 (1152 B/token) caches vs the exact latent, float64 math.

    Measured on the tiny config with 2 FP8 tiles, 3 requests, full top-k (printed with ``-s``):
    output error relative to the output scale, ue8m0 / fp32 scales: FP8 3.9e-2 / 5.4e-2,
    bf16 3.5e-3, FP8 vs bf16 3.9e-2 / 5.5e-2; each is below its bound (ratios printed).
    """
    case = make_case(TINY_2TILES, [(9, 7), (0, 12), (20, 5)], seed=5)
    cfg = TINY_2TILES
    proj, exact = case.query_projection(), case.context_projection().kv_latent
    c, k_pe = exact[:, : cfg.kv_lora_rank], exact[:, cfg.kv_lora_rank :]
    fp8_rows = mla_kv_quantize(c, k_pe, scale_fmt)
    fp8_ctx = mla_kv_dequantize(fp8_rows, cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    bf16_ctx = mla_kv_unpack_bf16(mla_kv_pack_bf16(c, k_pe), cfg.kv_lora_rank, cfg.qk_rope_head_dim)
    scale_end = cfg.kv_lora_rank + 4 * (cfg.kv_lora_rank // 128)   # float32 tile scales follow the payload
    tile_scale = fp8_rows[:, cfg.kv_lora_rank : scale_end].contiguous().view(torch.float32)

    topk = full_topk(case.batch, cfg.index_topk)
    out = {
        name: case.mla.forward_absorbed(proj, ctx, case.batch, topk)
        for name, ctx in (("exact", exact), ("fp8", fp8_ctx), ("bf16", bf16_ctx))
    }
    bound = {
        "fp8": output_error_bound(
            case, *assert_latent_error_within_half_step(c, k_pe, fp8_ctx, "fp8", tile_scale)
        ),
        "bf16": output_error_bound(
            case, *assert_latent_error_within_half_step(c, k_pe, bf16_ctx, "bf16")
        ),
    }
    for name in ("fp8", "bf16"):
        per_token = (out[name] - out["exact"]).norm(dim=-1)
        print(
            f"\n[{scale_fmt}] {name} cache vs exact: max rel err {rel_err(out[name], out['exact']):.3e}, "
            f"worst error/bound {float((per_token / bound[name]).max()):.3f}"
        )
        assert bool((per_token <= bound[name]).all())
    fp8_vs_bf16 = (out["fp8"] - out["bf16"]).norm(dim=-1)
    print(
        f"[{scale_fmt}] fp8 vs bf16 cache: max rel err {rel_err(out['fp8'], out['bf16']):.3e}, "
        f"worst error/bound {float((fp8_vs_bf16 / (bound['fp8'] + bound['bf16'])).max()):.3f}"
    )
    assert bool((fp8_vs_bf16 <= bound["fp8"] + bound["bf16"]).all())
    # The FP8 cache is measurably worse than bf16 (its error is not hidden by the comparison).
    assert rel_err(out["fp8"], out["exact"]) > rel_err(out["bf16"], out["exact"])


# ------------------------------------------------------------------ tests: sparse_mla_fwd


def explicit_sparse_reference(q, kv, indices, sm_scale, d_v, attn_sink, topk_length, lse_base, lonely_lse):
    """FlashMLA tests/ref.py, one (row, head) at a time in Python floats over float64 dot products."""
    s_q, h, _ = q.shape
    s_kv, topk = kv.shape[0], indices.shape[-1]
    q, kv = q.double(), kv.double()[:, 0]
    out = torch.zeros(s_q, h, d_v, dtype=torch.float64)
    max_logits = torch.empty(s_q, h, dtype=torch.float64)
    lse = torch.empty(s_q, h, dtype=torch.float64)
    for r in range(s_q):
        chosen = [
            int(indices[r, 0, j]) for j in range(topk)
            if 0 <= int(indices[r, 0, j]) < s_kv and (topk_length is None or j < int(topk_length[r]))
        ]
        for hh in range(h):
            if not chosen:
                max_logits[r, hh] = -math.inf
                lse[r, hh] = math.inf if lonely_lse == "+inf" else -math.inf
                continue
            p = [float(q[r, hh] @ kv[i]) * sm_scale for i in chosen]
            big = max(p)
            total = sum(math.exp(x - big) for x in p)
            lse_e = big + math.log(total)
            norm = lse_e
            if attn_sink is not None:
                sink = float(attn_sink[hh])
                top = max(lse_e, sink)
                norm = top + math.log(math.exp(lse_e - top) + math.exp(sink - top))
            for x, i in zip(p, chosen):
                out[r, hh] += math.exp(x - norm) * kv[i, :d_v]
            if lse_base == "2":
                p2 = [x * math.log2(math.e) for x in p]
                big2 = max(p2)
                max_logits[r, hh] = big2
                lse[r, hh] = big2 + math.log2(sum(2.0 ** (x - big2) for x in p2))
            else:
                max_logits[r, hh] = big
                lse[r, hh] = lse_e
    return out, max_logits, lse


def assert_matches(actual, expected, tol):
    """±inf at the same places (FlashMLA's rule), finite values within tol of the scale."""
    assert torch.equal(torch.isposinf(actual), torch.isposinf(expected))
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected))
    finite = torch.isfinite(expected)
    assert bool(torch.isfinite(actual[finite]).all())
    if bool(finite.any()):
        diff = (actual[finite].double() - expected[finite]).abs().max()
        assert float(diff) <= tol * max(1.0, float(expected[finite].abs().max()))


@st.composite
def sparse_inputs(draw):
    s_q, h, s_kv = draw(st.integers(1, 6)), draw(st.integers(1, 4)), draw(st.integers(1, 12))
    d_qk = draw(st.integers(2, 24))
    d_v = draw(st.integers(1, d_qk))
    topk = draw(st.integers(1, 10))
    gen = torch.Generator().manual_seed(draw(seed_st))
    q = torch.randn(s_q, h, d_qk, generator=gen, dtype=torch.float64)
    if draw(st.booleans()):  # a non-contiguous q (only the last dim contiguous, as FlashMLA allows)
        q = torch.randn(h, s_q, d_qk, generator=gen, dtype=torch.float64).transpose(0, 1)
    kv = torch.randn(s_kv, 1, d_qk, generator=gen, dtype=torch.float64) + 0.3
    invalid = [INT_MIN, -123456, -1, s_kv, s_kv + 1, INT_MAX]
    pick = st.one_of(st.integers(0, s_kv - 1), st.sampled_from(invalid))
    rows = []
    for _ in range(s_q):
        if draw(st.integers(0, 4)) == 0:  # a row with no valid index at all
            rows.append(draw(st.lists(st.sampled_from(invalid), min_size=topk, max_size=topk)))
        else:
            rows.append(draw(st.lists(pick, min_size=topk, max_size=topk)))  # repeats allowed
    indices = torch.tensor(rows, dtype=torch.int32)[:, None, :]
    attn_sink = torch.randn(h, generator=gen).float() if draw(st.booleans()) else None
    topk_length = (
        torch.tensor(
            draw(st.lists(st.integers(-1, topk + 2), min_size=s_q, max_size=s_q)), dtype=torch.int32
        )
        if draw(st.booleans()) else None
    )
    return dict(
        q=q, kv=kv, indices=indices, sm_scale=draw(st.sampled_from([0.5, 0.125, 1.3])), d_v=d_v,
        attn_sink=attn_sink, topk_length=topk_length,
        lse_base=draw(st.sampled_from(["e", "2"])), lonely_lse=draw(st.sampled_from(["+inf", "-inf"])),
    )


@given(args=sparse_inputs())
@settings(max_examples=40)
def test_sparse_mla_fwd_matches_explicit_masked_scores(args):
    """out, max_logits and lse equal the explicit computation, including all-invalid rows and
    INT_MIN, -1, s_kv, INT_MAX indices, topk_length, attn_sink, both bases and lonely conventions."""
    out, max_logits, lse = sparse_mla_fwd(**args)
    exp_out, exp_max, exp_lse = explicit_sparse_reference(**args)
    assert out.dtype == max_logits.dtype == lse.dtype == torch.float64
    assert_matches(out, exp_out, 1e-12)
    assert_matches(max_logits, exp_max, 1e-12)
    assert_matches(lse, exp_lse, 1e-12)
    lonely_rows = exp_max[:, 0] == -math.inf
    assert bool((out[lonely_rows] == 0).all())


@given(args=sparse_inputs(), budget=st.integers(1, 4000))
@settings(max_examples=20)
def test_sparse_mla_fwd_is_independent_of_row_budget(args, budget):
    whole = sparse_mla_fwd(**args)
    chunked = sparse_mla_fwd(**args, budget_bytes=budget)
    for a, b in zip(chunked, whole):
        assert torch.equal(a, b)


def test_sparse_mla_fwd_on_bf16_inputs_computes_in_float32():
    gen = torch.Generator().manual_seed(0)
    q = (torch.randn(5, 4, 40, generator=gen) / 3).bfloat16()
    kv = (torch.randn(30, 1, 40, generator=gen) / 3 + 0.1).bfloat16()
    indices = torch.randint(-2, 32, (5, 1, 16), generator=gen, dtype=torch.int32)
    out, max_logits, lse = sparse_mla_fwd(q, kv, indices, 0.5, d_v=32)
    assert out.dtype == max_logits.dtype == lse.dtype == torch.float32
    exp = explicit_sparse_reference(q, kv, indices, 0.5, 32, None, None, "e", "+inf")
    for a, b in zip((out, max_logits, lse), exp):
        assert_matches(a, b, 1e-5)
    # A float32 query against the bf16 cache is computed in float32 without copying the cache.
    out32, _, _ = sparse_mla_fwd(q.float(), kv, indices, 0.5, d_v=32)
    assert torch.equal(out32, out)


def test_an_invalid_index_never_reads_row_zero():
    """Row 0 poisoned with NaN: invalid indices (mapped nowhere) must not leak it."""
    kv = torch.randn(6, 1, 8, dtype=torch.float64)
    kv[0] = math.nan
    q = torch.randn(2, 3, 8, dtype=torch.float64)
    indices = torch.tensor([[[1, -1, 6, 2]], [[INT_MIN, INT_MAX, -1, 6]]], dtype=torch.int32)
    out, max_logits, lse = sparse_mla_fwd(q, kv, indices, 0.3, d_v=4)
    assert bool(torch.isfinite(out).all()) and bool(torch.isfinite(max_logits[0]).all())
    assert bool((out[1] == 0).all()) and bool((lse[1] == math.inf).all())


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(kv=torch.zeros(5, 2, 8)), "one latent KV head"),
        (dict(kv=torch.zeros(5, 1, 9)), "d_qk=8"),
        (dict(q=torch.zeros(3, 8)), r"\[s_q, h, d_qk\]"),
        (dict(indices=torch.zeros(3, 1, 4, dtype=torch.int64)), "int32"),
        (dict(indices=torch.zeros(3, 4, dtype=torch.int32)), "int32"),
        (dict(indices=torch.zeros(3, 1, 0, dtype=torch.int32)), "topk ≥ 1"),
        (dict(kv=torch.zeros(5, 1, 8, dtype=torch.int8)), "floating"),
        (dict(d_v=9), "d_v=9"),
        (dict(attn_sink=torch.zeros(3)), "attn_sink"),
        (dict(topk_length=torch.zeros(3, dtype=torch.int64)), "topk_length"),
        (dict(lse_base="10"), "lse_base"),
        (dict(lonely_lse="nan"), "lonely_lse"),
        (dict(budget_bytes=0), "budget_bytes"),
        (dict(sm_scale=math.inf), "sm_scale"),
    ],
)
def test_sparse_mla_fwd_rejects_bad_input(change, message):
    args = dict(
        q=torch.zeros(3, 2, 8), kv=torch.zeros(5, 1, 8), indices=torch.zeros(3, 1, 4, dtype=torch.int32),
        sm_scale=0.5, d_v=8,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        sparse_mla_fwd(**args)


# ---------------------------------------------------------------- tests: dense_causal_mha


@st.composite
def dense_inputs(draw):
    n, h, s_kv = draw(st.integers(1, 8)), draw(st.integers(1, 3)), draw(st.integers(1, 10))
    d_qk, d_v = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    gen = torch.Generator().manual_seed(draw(seed_st))
    ranges = []
    for _ in range(n):
        # Runs of equal ks (requests) and arbitrary per-row ranges, empty ones included.
        lo = ranges[-1][0] if ranges and draw(st.booleans()) else draw(st.integers(0, s_kv))
        ranges.append((lo, draw(st.integers(lo, s_kv))))
    return dict(
        q=torch.randn(n, h, d_qk, generator=gen, dtype=torch.float64),
        k=torch.randn(s_kv, h, d_qk, generator=gen, dtype=torch.float64),
        v=torch.randn(s_kv, h, d_v, generator=gen, dtype=torch.float64),
        ks=torch.tensor([a for a, _ in ranges], dtype=torch.int32),
        ke=torch.tensor([b for _, b in ranges], dtype=torch.int32),
        sm_scale=draw(st.sampled_from([0.25, 0.7])),
    )


@given(args=dense_inputs(), score_bytes=st.sampled_from([1, 64, 1 << 28]))
@settings(max_examples=30)
def test_dense_causal_mha_matches_explicit_softmax_for_any_row_chunking(args, score_bytes):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(mla_module, "_DENSE_SCORE_BYTES", score_bytes)  # from one row per chunk to all
        out = dense_causal_mha(**args)
    q, k, v = args["q"], args["k"], args["v"]
    expected = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    for m in range(q.shape[0]):
        lo, hi = int(args["ks"][m]), int(args["ke"][m])
        for hh in range(q.shape[1]):
            if hi > lo:
                s = [float(q[m, hh] @ k[j, hh]) * args["sm_scale"] for j in range(lo, hi)]
                big = max(s)
                w = [math.exp(x - big) for x in s]
                expected[m, hh] = sum(wj * v[j, hh] for wj, j in zip(w, range(lo, hi))) / sum(w)
    assert float((out - expected).abs().max()) <= 1e-12 * max(1.0, float(expected.abs().max()))


def test_dense_causal_mha_rejects_ranges_outside_the_buffer():
    q, k, v = torch.zeros(2, 1, 4), torch.zeros(3, 1, 4), torch.zeros(3, 1, 4)
    ok = torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="ke ≤ S_kv"):
        dense_causal_mha(q, k, v, ok, torch.tensor([1, 4], dtype=torch.int32), 0.5)
    with pytest.raises(ValueError, match="ks ≤ ke"):
        dense_causal_mha(
            q, k, v, torch.tensor([2, 0], dtype=torch.int32), torch.tensor([1, 1], dtype=torch.int32), 0.5
        )
    with pytest.raises(ValueError, match="int32"):
        dense_causal_mha(q, k, v, ok.long(), ok.long(), 0.5)


def test_forward_rejects_mismatched_context_and_indices():
    case = make_case(TINY, [(2, 3)], seed=0)
    proj, kv_context = case.query_projection(), case.context_projection().kv_latent
    with pytest.raises(ValueError, match="kv_context"):
        case.mla.forward_absorbed(proj, kv_context[:-1], case.batch, full_topk(case.batch, 64))
    with pytest.raises(ValueError, match="topk_indices"):
        case.mla.forward_absorbed(proj, kv_context, case.batch, full_topk(case.batch, 64).long())
    with pytest.raises(ValueError, match="positions"):
        case.mla.project(case.x_ctx, case.ctx_positions.int())


def test_sparse_mla_fwd_over_an_empty_kv_gives_lonely_rows():
    q = torch.randn(3, 2, 8, dtype=torch.float64)
    indices = torch.tensor([[[-1, 0, 5]]] * 3, dtype=torch.int32)
    out, max_logits, lse = sparse_mla_fwd(q, torch.zeros(0, 1, 8, dtype=torch.float64), indices, 0.5, d_v=4)
    assert torch.equal(out, torch.zeros(3, 2, 4, dtype=torch.float64))
    assert bool((max_logits == -math.inf).all()) and bool((lse == math.inf).all())


# ------------------------------------------------------------------------------ tests: bf16x3 split


@given(seed=st.integers(0, 2**31 - 1), spread=st.integers(0, 100))
@settings(max_examples=25)
def test_split_bf16x3_parts_are_bf16_and_sum_exactly_to_the_float32_input(seed, spread):
    gen = torch.Generator().manual_seed(seed)
    exponents = torch.randint(-spread, spread + 1, (4096,), generator=gen).double()
    a = (torch.randn(4096, generator=gen, dtype=torch.float64) * torch.exp2(exponents)).float()
    a[:3] = torch.tensor([0.0, -0.0, 1.0 + 2.0**-23])  # zeros and a full 24-bit significand
    parts = split_bf16x3(a)
    assert all(p.dtype == torch.bfloat16 for p in parts)
    total = sum(p.double() for p in parts)  # float64 sum of three bf16 values: exact
    assert torch.equal(total, a.double())


def test_split_bf16x3_refuses_other_dtypes():
    with pytest.raises(ValueError, match="float32"):
        split_bf16x3(torch.ones(3, dtype=torch.float64))


# ------------------------------------------------------------------------------ tests: CUDA


@pytest.mark.cuda
def test_sparse_mla_fwd_on_cuda_matches_float64_and_stays_within_budget():
    """GLM-5.3 shapes (h 64, d_qk 576, d_v 512, topk 2048): the peak extra memory of a call stays
    within 1.25x the gather budget, not s_q x topk x 576, and the tensor-core path keeps
    float32 accuracy against float64."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    s_q, h, s_kv, topk, budget = 1024, 64, 8192, 2048, 256 << 20
    q = (torch.randn(s_q, h, 576, generator=gen, device=dev) / 10).bfloat16()
    kv = (torch.randn(s_kv, 1, 576, generator=gen, device=dev) / 10).bfloat16()
    indices = torch.randint(-64, s_kv + 64, (s_q, 1, topk), generator=gen, device=dev, dtype=torch.int32)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out, max_logits, lse = sparse_mla_fwd(q, kv, indices, 0.5, budget_bytes=budget)
    torch.cuda.synchronize()
    results = sum(t.numel() * t.element_size() for t in (out, max_logits, lse))
    extra = torch.cuda.max_memory_allocated() - base - results
    assert extra <= 1.25 * budget, f"peak extra {extra / 2**20:.0f} MiB for a {budget >> 20} MiB budget"
    kv64 = kv[:, 0].double().cpu()
    for r in range(0, s_q, 211):  # a sample of rows against the dense float64 formula
        idx = indices[r, 0].long().cpu()
        keys = kv64[idx[(idx >= 0) & (idx < s_kv)]]                        # [valid, 576]
        scores = q[r].double().cpu() @ keys.T * 0.5                         # [h, valid]
        exp_lse = torch.logsumexp(scores, dim=-1)
        exp_out = torch.softmax(scores, dim=-1) @ keys[:, :512]
        assert_matches(out[r].cpu(), exp_out, 1e-5)
        assert_matches(max_logits[r].cpu(), scores.amax(-1), 1e-5)
        assert_matches(lse[r].cpu(), exp_lse, 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_mla_on_cuda_with_glm_attention_shapes_equals_dense_attention(dtype, tol):
    """GLM-5.3's attention shapes (64 heads, nope 192, rope 64, v 256, kv_lora 512; a narrow
    hidden size keeps the CPU reference quick): both paths on the GPU against the float64
    CPU reference, the absorbed one under a gather budget of a few rows."""
    config = get_config("glm-5.3").replace(hidden_size=256, q_lora_rank=128)
    case = make_case(config, [(150, 90), (0, 60)], seed=7)
    expected = ref_attention(case)
    dev = torch.device("cuda")
    mla = case.mla.to(dev, dtype)
    batch = case.batch.to(dev)
    x = case.x_ctx.to(dev, dtype)
    kv_context = mla.project(x, case.ctx_positions.to(dev)).kv_latent
    proj = mla.project(x[case.q_rows.to(dev)], batch.positions)
    topk = full_topk(case.batch, config.index_topk).to(dev)
    absorbed = mla.forward_absorbed(proj, kv_context, batch, topk, budget_bytes=20 * 2048 * 576 * 8)
    mha = mla.forward_mha(proj, kv_context, batch)
    assert rel_err(absorbed.cpu(), expected) <= tol
    assert rel_err(mha.cpu(), expected) <= tol


@pytest.mark.cuda
@pytest.mark.parametrize("a_dtype", [torch.bfloat16, torch.float32])
def test_tensor_core_bmm_has_float32_accuracy(a_dtype):
    """_bmm_f32 on bf16 tensor cores (a float32 left operand split in three) against the float64
    product of the same values: float32 accumulation error only, far below bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    a = torch.randn(8, 64, 2048, generator=gen, device="cuda").to(a_dtype)
    b = torch.randn(8, 2048, 576, generator=gen, device="cuda").bfloat16()
    got = mla_module._bmm_f32(a, b)
    assert got.dtype == torch.float32
    exact = torch.bmm(a.double(), b.double())
    err = float((got.double() - exact).abs().max() / exact.abs().max())
    assert err <= 1e-5, f"relative error {err:.2e}"
