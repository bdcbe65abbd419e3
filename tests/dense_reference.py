"""An independent float64 dense implementation of the GLM-5.3 stack, written for the tests.

It reads weights from a state dict by their HF names and follows docs/conventions.md directly with
explicit formulas (complex-multiply RoPE, expanded K/V, a full causal softmax, a per-token MoE
loop). It shares no code with glm_dsa, so agreeing with it means something. Attention may be
restricted to a given key set per (layer, row) to check sparse attention against a masked
dense softmax.
"""

from __future__ import annotations

import torch

F64 = torch.float64


def rms_norm(x, w, eps):
    x = x.to(F64)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.to(F64)


def rope_complex(x, positions, theta, interleaved):
    """x [n, ..., d]: rotate by position * theta^(-2i/d) with an explicit complex multiply."""
    d = x.shape[-1]
    inv = torch.tensor([theta ** (-2.0 * i / d) for i in range(d // 2)], dtype=F64)
    ang = positions.to(F64)[:, None] * inv[None, :]
    rot = torch.polar(torch.ones_like(ang), ang)
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (d // 2,)
    rot = rot.view(shape)
    if interleaved:
        z = torch.view_as_complex(x.to(F64).reshape(*x.shape[:-1], d // 2, 2).contiguous())
        return torch.view_as_real(z * rot).reshape(x.shape)
    z = torch.complex(x[..., : d // 2].to(F64), x[..., d // 2 :].to(F64)) * rot
    return torch.cat([z.real, z.imag], dim=-1)


def mla_dense(sd, prefix, cfg, x, positions, allowed=None):
    """Expanded MLA over one request: x [L, hidden] -> [L, hidden]. ``allowed[m]``: key set of row m."""
    probs, v = mla_probs(sd, prefix, cfg, x, positions, allowed)
    o = torch.einsum("hmn,nhv->mhv", probs, v)
    return o.reshape(x.shape[0], -1) @ sd[prefix + "o_proj.weight"].to(F64).T


def mla_probs(sd, prefix, cfg, x, positions, allowed=None):
    """The softmax of expanded MLA over one request, ``[H, L, L]`` (query x key, causal and
    within ``allowed[m]``), and the values ``[L, H, v_head_dim]``."""
    g = lambda k: sd[prefix + k].to(F64)  # noqa: E731
    L, H = x.shape[0], cfg.num_attention_heads
    nope, rope, v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    q_lat = rms_norm(x @ g("q_a_proj.weight").T, g("q_a_layernorm.weight"), cfg.rms_norm_eps)
    q = (q_lat @ g("q_b_proj.weight").T).view(L, H, nope + rope)
    kv = x @ g("kv_a_proj_with_mqa.weight").T
    c = rms_norm(kv[:, : cfg.kv_lora_rank], g("kv_a_layernorm.weight"), cfg.rms_norm_eps)
    k_pe = rope_complex(kv[:, cfg.kv_lora_rank :], positions, cfg.rope_theta, cfg.rope_interleave)
    q_pe = rope_complex(q[..., nope:], positions, cfg.rope_theta, cfg.rope_interleave)
    kvb = (c @ g("kv_b_proj.weight").T).view(L, H, nope + v_dim)
    k = torch.cat([kvb[..., :nope], k_pe[:, None, :].expand(L, H, rope)], dim=-1)
    qf = torch.cat([q[..., :nope], q_pe], dim=-1)
    scores = torch.einsum("mhd,nhd->hmn", qf, k) * cfg.softmax_scale
    mask = torch.ones(L, L, dtype=torch.bool).tril()
    if allowed is not None:
        sel = torch.zeros(L, L, dtype=torch.bool)
        for m, keys in enumerate(allowed):
            sel[m, list(keys)] = True
        mask &= sel
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1), kvb[..., nope:]


def mlp(sd, prefix, x):
    g = lambda k: sd[prefix + k].to(F64)  # noqa: E731
    a = x @ g("gate_proj.weight").T
    return (a * torch.sigmoid(a) * (x @ g("up_proj.weight").T)) @ g("down_proj.weight").T


def moe_loop(sd, prefix, cfg, x):
    """Per-token loop: sigmoid router, bias for selection only, unbiased normalized weights."""
    w = sd[prefix + "gate.weight"].to(F64)
    bias = sd[prefix + "gate.e_score_correction_bias"].to(F64)
    out = torch.zeros_like(x, dtype=F64)
    for t in range(x.shape[0]):
        s = torch.sigmoid(x[t] @ w.T)
        sel = (s + bias).tolist()
        chosen = sorted(range(len(sel)), key=lambda e: (-sel[e], e))[: cfg.num_experts_per_tok]
        wts = [float(s[e]) for e in chosen]
        total = sum(wts) + 1e-20
        for e, wt in zip(chosen, wts):
            factor = (wt / total if cfg.norm_topk_prob else wt) * cfg.routed_scaling_factor
            out[t] += factor * mlp(sd, f"{prefix}experts.{e}.", x[t : t + 1])[0]
        out[t] += mlp(sd, f"{prefix}shared_experts.", x[t : t + 1])[0]
    return out


def stack_dense(sd, cfg, input_ids, allowed_per_layer=None):
    """Run one request through every layer with dense causal attention; returns [L, hidden]."""
    x = sd["model.embed_tokens.weight"].to(F64)[input_ids]
    positions = torch.arange(input_ids.numel())
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        allowed = None if allowed_per_layer is None else allowed_per_layer[i]
        h = x + mla_dense(sd, p + "self_attn.", cfg, rms_norm(x, sd[p + "input_layernorm.weight"], cfg.rms_norm_eps), positions, allowed)
        y = rms_norm(h, sd[p + "post_attention_layernorm.weight"], cfg.rms_norm_eps)
        ffn = moe_loop(sd, p + "mlp.", cfg, y) if i >= cfg.first_k_dense_replace else mlp(sd, p + "mlp.", y)
        x = h + ffn
    return x


def rel_err(a, b):
    a, b = a.to(F64), b.to(F64)
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def assert_close_rel(a, b, tol):
    err = rel_err(a, b)
    assert err <= tol, f"relative error {err:.3e} > {tol:.1e}"
    return err

