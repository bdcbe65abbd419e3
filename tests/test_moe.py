"""noaux_tc MoE against explicit per-token loops written here (docs/conventions.md §8)."""

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from glm_dsa.config import get_config
from glm_dsa.moe import (MLP, Experts, MoE, combine_experts, experts_grouped_mm, experts_loop, route,
                         swiglu)

SCALE = 2.5

# Reduced-width copies that keep each preset's routing settings.
GLM_LIKE = get_config("tiny").replace(hidden_size=32, moe_intermediate_size=16)
GROUPED = GLM_LIKE.replace(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2)
UNNORMALIZED = GROUPED.replace(norm_topk_prob=False, routed_scaling_factor=1.5)
NO_SHARED = GLM_LIKE.replace(n_shared_experts=0)
TWO_SHARED = GROUPED.replace(n_shared_experts=2)
DSV32_ROUTING = get_config("deepseek-v3.2").replace(hidden_size=16, moe_intermediate_size=8)


# ----------------------------------------------------------------- independent reference
def ref_route_row(logits, bias, top_k, n_group, topk_group, norm_topk_prob, scale):
    """One token's routing by explicit loops: (chosen expert ids, their weights)."""
    num_experts = len(logits)
    s = [1.0 / (1.0 + math.exp(-v)) for v in logits]
    sel = [s[e] + bias[e] for e in range(num_experts)]
    size = num_experts // n_group
    if n_group > 1:
        group_score = []
        for g in range(n_group):
            members = sorted((sel[e] for e in range(g * size, (g + 1) * size)), reverse=True)
            group_score.append(members[0] + members[1])
        kept = sorted(range(n_group), key=lambda g: (-group_score[g], g))[:topk_group]
        candidates = [e for g in kept for e in range(g * size, (g + 1) * size)]
    else:
        candidates = list(range(num_experts))
    chosen = sorted(candidates, key=lambda e: (-sel[e], e))[:top_k]
    weights = [s[e] for e in chosen]
    if norm_topk_prob:
        total = sum(weights)
        weights = [w / (total + 1e-20) for w in weights]
    return chosen, [w * scale for w in weights]


def ref_route(x, gate_weight, bias, top_k, n_group, topk_group, norm_topk_prob, scale):
    """Rows of ``x`` routed one by one in float64 numpy."""
    x, gw, b = (torch.as_tensor(t).double().numpy() for t in (x, gate_weight, bias))
    ids, weights = [], []
    for row in x:
        chosen, w = ref_route_row(
            list(gw @ row), list(b), top_k, n_group, topk_group, norm_topk_prob, scale
        )
        ids.append(chosen)
        weights.append(w)
    return ids, weights


def ref_swiglu(row, wg, wu, wd):
    """down(silu(gate row) * up row) in float64 numpy."""
    wg, wu, wd = (p.detach().double().numpy() for p in (wg, wu, wd))
    g = wg @ row
    u = wu @ row
    return wd @ (g / (1.0 + np.exp(-g)) * u)


def ref_mlp(row, mlp):
    return ref_swiglu(row, mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight)


def expert_weights(moe, e):
    """Expert e's (gate [I, H], up [I, H], down [H, I]) read from the stacked parameters by
    transformers' layout: gate_up_proj[e] is the gate rows, then the up rows."""
    i = moe.config.moe_intermediate_size
    gate_up, down = moe.experts.gate_up_proj[e], moe.experts.down_proj[e]
    return gate_up[:i], gate_up[i:], down


def ref_moe(x, moe, row_mask):
    """Per-token loop: route, run each chosen expert, add the shared expert; masked rows 0."""
    c = moe.config
    xs = x.detach().double().numpy()
    ids, weights = ref_route(
        xs, moe.gate.weight.detach(), moe.gate.e_score_correction_bias.detach(),
        c.num_experts_per_tok, c.n_group, c.topk_group, c.norm_topk_prob, c.routed_scaling_factor,
    )
    out = np.zeros_like(xs)
    counts = [0] * c.n_routed_experts
    for t, row in enumerate(xs):
        if not row_mask[t]:
            continue
        for e, w in zip(ids[t], weights[t]):
            out[t] += w * ref_swiglu(row, *expert_weights(moe, e))
            counts[e] += 1
        if moe.shared_experts is not None:
            out[t] += ref_mlp(row, moe.shared_experts)
    return out, counts, ids


def random_moe(config, seed, bias_scale=0.3, dtype=torch.float64):
    """A MoE with spread-out router logits and a bias large enough to change choices."""
    torch.manual_seed(seed)
    moe = MoE(config).to(dtype)
    with torch.no_grad():
        moe.gate.weight.normal_(0.0, 2.0 / config.hidden_size ** 0.5)
        moe.gate.e_score_correction_bias.uniform_(-bias_scale, bias_scale)
    return moe


def rel_err(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-300)


# ----------------------------------------------------------------- routed execution
@given(
    config=st.sampled_from([GLM_LIKE, GROUPED, UNNORMALIZED, NO_SHARED, TWO_SHARED]),
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
    mask_kind=st.sampled_from(["none", "random"]),
)
def test_grouped_moe_equals_per_token_loop(config, n, seed, mask_kind):
    moe = random_moe(config, seed)
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(n, config.hidden_size, generator=g, dtype=torch.float64)
    row_mask = None if mask_kind == "none" else torch.rand(n, generator=g) < 0.7
    mask_list = [True] * n if row_mask is None else row_mask.tolist()

    with torch.no_grad():
        out, counts = moe(x, row_mask)
    ref_out, ref_counts, _ = ref_moe(x, moe, mask_list)

    assert out.dtype == torch.float64 and out.shape == x.shape
    if any(mask_list):
        assert rel_err(out.numpy(), ref_out) <= 1e-12
    else:
        assert not out.any()
    assert counts.dtype == torch.int64
    assert counts.tolist() == ref_counts


@given(n=st.integers(1, 12), seed=st.integers(0, 2**16))
def test_moe_on_deepseek_routing_equals_per_token_loop(n, seed):
    moe = random_moe(DSV32_ROUTING, seed)
    x = torch.randn(n, DSV32_ROUTING.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        out, counts = moe(x)
    ref_out, ref_counts, _ = ref_moe(x, moe, [True] * n)
    assert rel_err(out.numpy(), ref_out) <= 1e-12
    assert counts.tolist() == ref_counts


def test_moe_without_tokens_returns_empty_output_and_zero_counts():
    moe = random_moe(GROUPED, 0)
    out, counts = moe(torch.zeros(0, GROUPED.hidden_size, dtype=torch.float64))
    assert out.shape == (0, GROUPED.hidden_size)
    assert counts.tolist() == [0] * GROUPED.n_routed_experts


# ----------------------------------------------------------------- router
def test_bias_flips_selection_but_weights_stay_unbiased():
    # Router logits [2, 1, 0, -1]: unbiased top-2 is {0, 1}; a +2 bias on expert 2 flips
    # expert 1 out. The weights must stay sigmoid(0) and sigmoid(2), not the biased scores.
    gate_weight = torch.zeros(4, 4, dtype=torch.float64)
    gate_weight[:, 0] = torch.tensor([2.0, 1.0, 0.0, -1.0], dtype=torch.float64)
    x = torch.tensor([[1.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    zero_bias = torch.zeros(4, dtype=torch.float32)
    bias = torch.tensor([0.0, 0.0, 2.0, 0.0], dtype=torch.float32)
    s0, s2 = 1 / (1 + math.exp(-2.0)), 0.5

    ids, _ = route(x, gate_weight, zero_bias, 2, 1, 1, True, SCALE)
    assert ids.tolist() == [[0, 1]]

    ids, weights = route(x, gate_weight, bias, 2, 1, 1, True, SCALE)
    assert ids.tolist() == [[2, 0]]
    expected = [SCALE * s2 / (s2 + s0), SCALE * s0 / (s2 + s0)]
    assert rel_err(weights.numpy(), expected) <= 1e-15

    ids, weights = route(x, gate_weight, bias, 2, 1, 1, False, SCALE)
    assert ids.tolist() == [[2, 0]]
    assert rel_err(weights.numpy(), [SCALE * s2, SCALE * s0]) <= 1e-15
    biased = [SCALE * (s2 + 2.0), SCALE * s0]
    assert rel_err(weights.numpy(), biased) > 0.5


def test_moe_uses_the_loaded_router_bias():
    # The DeepSeek reference only builds the bias at hidden 7168; GLM (6144) needs it too.
    config = GLM_LIKE.replace(n_routed_experts=4, num_experts_per_tok=1, n_shared_experts=0)
    moe = random_moe(config, 0, bias_scale=0.0)
    x = torch.randn(16, config.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        _, counts = moe(x)
        moe.gate.e_score_correction_bias.copy_(torch.tensor([0.0, 0.0, 5.0, 0.0]))
        _, counts_biased = moe(x)
    assert counts.tolist() != [0, 0, 16, 0]
    assert counts_biased.tolist() == [0, 0, 16, 0]


@given(seed=st.integers(0, 2**16))
def test_group_limited_selection_equals_explicit_group_loop(seed):
    c = DSV32_ROUTING
    assert (c.n_routed_experts, c.n_group, c.topk_group, c.num_experts_per_tok) == (256, 8, 4, 8)
    g = torch.Generator().manual_seed(seed)
    n = 32
    x = torch.randn(n, c.hidden_size, generator=g, dtype=torch.float64)
    gate_weight = torch.randn(c.n_routed_experts, c.hidden_size, generator=g, dtype=torch.float64)
    bias = (torch.rand(c.n_routed_experts, generator=g, dtype=torch.float64) - 0.5).float()

    ids, weights = route(x, gate_weight, bias, c.num_experts_per_tok, c.n_group, c.topk_group,
                         c.norm_topk_prob, c.routed_scaling_factor)
    ref_ids, ref_weights = ref_route(x, gate_weight, bias, c.num_experts_per_tok, c.n_group,
                                     c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
    assert ids.tolist() == ref_ids
    assert rel_err(weights.numpy(), ref_weights) <= 1e-12

    # The drawn case must exercise group limiting: some token's global top-8 differs.
    global_ids, _ = ref_route(x, gate_weight, bias, c.num_experts_per_tok, 1, 1,
                              c.norm_topk_prob, c.routed_scaling_factor)
    assert global_ids != ref_ids


def test_experts_of_dropped_groups_are_never_chosen():
    # Every selection score is negative and group 0 is the least negative, so it is the one
    # group kept. Filling dropped experts with 0.0 (HF) would pick them over group 0's -0.1.
    x = torch.ones(1, 4, dtype=torch.float64)
    gate_weight = torch.zeros(8, 4, dtype=torch.float64)
    bias = torch.tensor([-0.6, -0.6] + [-1.0] * 6, dtype=torch.float32)
    ids, weights = route(x, gate_weight, bias, 2, 4, 1, True, SCALE)
    assert ids.tolist() == [[0, 1]]
    assert rel_err(weights.numpy(), [[SCALE / 2, SCALE / 2]]) <= 1e-15


@given(
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
    n=st.integers(1, 40),
    seed=st.integers(0, 2**16),
)
def test_normalized_weights_sum_to_routed_scaling_factor(dtype, n, seed):
    c = DSV32_ROUTING
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, c.hidden_size, generator=g).to(dtype)
    gate_weight = torch.randn(c.n_routed_experts, c.hidden_size, generator=g).to(dtype)
    bias = torch.rand(c.n_routed_experts, generator=g) - 0.5
    _, weights = route(x, gate_weight, bias, c.num_experts_per_tok, c.n_group, c.topk_group,
                       True, c.routed_scaling_factor)
    # Sum of 8 positive terms: a few ulp of the compute dtype.
    tol = 1e-13 if dtype == torch.float64 else 1e-6
    sums = weights.double().sum(dim=-1)
    assert (sums - 2.5).abs().max().item() <= tol


def test_ties_go_to_the_lower_expert_index():
    x = torch.ones(1, 8, dtype=torch.float64)
    bias = torch.zeros(16, dtype=torch.float32)
    # Every score ties: experts 0..k-1, and with groups the lowest-index groups.
    ids, weights = route(x, torch.zeros(16, 8, dtype=torch.float64), bias, 3, 1, 1, True, SCALE)
    assert ids.tolist() == [[0, 1, 2]]
    assert rel_err(weights.numpy(), [[SCALE / 3] * 3]) <= 1e-15
    ids, _ = route(x, torch.zeros(16, 8, dtype=torch.float64), bias, 3, 4, 2, True, SCALE)
    assert ids.tolist() == [[0, 1, 2]]

    # Expert 11 is best; 3, 5 and 13 tie for the next two slots; 3 and 5 win.
    logits = torch.zeros(16, dtype=torch.float64)
    logits[[3, 5, 13]] = 1.0
    logits[11] = 2.0
    gate_weight = torch.zeros(16, 8, dtype=torch.float64)
    gate_weight[:, 0] = logits
    ids, _ = route(x[:, :8], gate_weight, bias, 3, 1, 1, True, SCALE)
    assert ids.tolist() == [[11, 3, 5]]

    # Groups 1 and 3 tie on their top-2 sum; with one group kept, group 1 wins.
    logits = torch.zeros(16, dtype=torch.float64)
    logits[[4, 5, 12, 13]] = 1.0
    gate_weight[:, 0] = logits
    ids, _ = route(x, gate_weight, bias, 2, 4, 1, True, SCALE)
    assert ids.tolist() == [[4, 5]]


@given(seed=st.integers(0, 2**16))
def test_router_runs_in_float32_for_bf16_activations(seed):
    c = DSV32_ROUTING
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, c.hidden_size, generator=g).bfloat16()
    gate_weight = torch.randn(c.n_routed_experts, c.hidden_size, generator=g).bfloat16()
    bias = torch.rand(c.n_routed_experts, generator=g) - 0.5
    args = (bias, 8, c.n_group, c.topk_group, True, SCALE)
    ids, weights = route(x, gate_weight, *args)
    ids_f32, weights_f32 = route(x.float(), gate_weight.float(), *args)
    assert weights.dtype == torch.float32
    assert torch.equal(ids, ids_f32) and torch.equal(weights, weights_f32)


# ----------------------------------------------------------------- row mask
@given(n=st.integers(1, 24), seed=st.integers(0, 2**16), zero_pad=st.booleans())
def test_masked_rows_produce_no_output_and_no_counts(n, seed, zero_pad):
    moe = random_moe(GROUPED, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, GROUPED.hidden_size, generator=g, dtype=torch.float64)
    row_mask = torch.rand(n, generator=g) < 0.5
    if zero_pad:
        x[~row_mask] = 0.0
    with torch.no_grad():
        ids, weights = moe.gate(x, row_mask)
        out, counts = moe(x, row_mask)
        kept_out, kept_counts = moe(x[row_mask])

    assert (ids[~row_mask] == -1).all() and (weights[~row_mask] == 0).all()
    assert (ids[row_mask] >= 0).all()
    assert not out[~row_mask].any()
    explicit = [0] * GROUPED.n_routed_experts
    for t in range(n):
        if row_mask[t]:
            for e in ids[t].tolist():
                explicit[e] += 1
    assert counts.tolist() == explicit == kept_counts.tolist()
    if row_mask.any():
        assert rel_err(out[row_mask].numpy(), kept_out.numpy()) <= 1e-12


# ----------------------------------------------------------------- MLP and precision
@given(n=st.integers(1, 8), seed=st.integers(0, 2**16))
def test_dense_mlp_matches_formula(n, seed):
    torch.manual_seed(seed)
    mlp = MLP(24, 40).double()
    x = torch.randn(n, 24, dtype=torch.float64)
    with torch.no_grad():
        out = mlp(x)
    ref = np.stack([ref_mlp(row, mlp) for row in x.numpy()])
    assert rel_err(out.numpy(), ref) <= 1e-12


def test_bf16_mlp_rounds_once_before_down_proj():
    # DeepSeek's Expert: silu and the product in float32, one rounding to bf16, then down_proj.
    torch.manual_seed(0)
    mlp = MLP(64, 96).bfloat16()
    x = torch.randn(32, 64).bfloat16()
    with torch.no_grad():
        out = mlp(x)
        gate = torch.nn.functional.linear(x, mlp.gate_proj.weight).float()
        up = torch.nn.functional.linear(x, mlp.up_proj.weight).float()
        h = (gate * torch.sigmoid(gate) * up).bfloat16()
        expected = torch.nn.functional.linear(h, mlp.down_proj.weight)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, expected)


def test_bf16_moe_is_close_to_float64_loop():
    moe = random_moe(GROUPED, 3, dtype=torch.bfloat16)
    x = torch.randn(24, GROUPED.hidden_size, generator=torch.Generator().manual_seed(3)).bfloat16()
    with torch.no_grad():
        out, counts = moe(x)
    ref_out, ref_counts, _ = ref_moe(x, moe, [True] * 24)
    assert out.dtype == torch.bfloat16
    assert counts.tolist() == ref_counts
    # bf16 rounds the expert inputs' products and outputs (2^-8 relative each); DeepGEMM's
    # calc_diff bound against an unquantized reference is 1e-3.
    a, b = out.double().numpy(), ref_out
    assert 1 - 2 * (a * b).sum() / (a * a + b * b).sum() < 1e-4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_outputs_are_summed_in_deepseek_loop_order(dtype):
    # DeepSeek's MoE: y = 0 (float32); for each expert in ascending order, y[rows] += out * w;
    # then y + shared. Same float32 additions in the same order give the same bits.
    moe = random_moe(GROUPED, 7, dtype=dtype)
    x = torch.randn(40, GROUPED.hidden_size, generator=torch.Generator().manual_seed(7)).to(dtype)
    with torch.no_grad():
        out, _ = moe(x)
        ids, weights = moe.gate(x)
        y = torch.zeros(40, GROUPED.hidden_size, dtype=torch.float32)
        for e in range(GROUPED.n_routed_experts):
            rows, slots = torch.where(ids == e)
            if len(rows):
                wg, wu, wd = expert_weights(moe, e)
                gate_up = x[rows] @ torch.cat([wg, wu]).T  # one GEMM, as in the module
                gate, up = gate_up[:, :16].float(), gate_up[:, 16:].float()
                h = (torch.nn.functional.silu(gate) * up).to(dtype)
                y[rows] += (h @ wd.T).float() * weights[rows, slots, None]
        expected = (y + moe.shared_experts(x).float()).to(dtype)
    assert torch.equal(out, expected)


def test_router_bias_stays_float32_when_the_model_is_cast():
    moe = MoE(GROUPED)
    fine = torch.linspace(-0.5, 0.5, GROUPED.n_routed_experts) + 1e-4
    with torch.no_grad():
        moe.gate.e_score_correction_bias.copy_(fine)
    moe.to(torch.bfloat16)
    assert moe.gate.weight.dtype == torch.bfloat16
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(moe.gate.e_score_correction_bias, fine)
    moe.half()
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    moe.double()
    assert moe.gate.e_score_correction_bias.dtype == torch.float64
    assert torch.equal(moe.gate.e_score_correction_bias, fine.double())


def test_weight_names_follow_hugging_face():
    names = set(MoE(TWO_SHARED).state_dict())
    expected = {"gate.weight", "gate.e_score_correction_bias"}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        expected |= {f"experts.{e}.{proj}.weight" for e in range(TWO_SHARED.n_routed_experts)}
        expected.add(f"shared_experts.{proj}.weight")
    assert names == expected
    moe = MoE(TWO_SHARED)
    assert moe.shared_experts.gate_proj.weight.shape == (2 * 16, 32)
    assert moe.gate.weight.shape == (16, 32)
    assert set(MLP(32, 64).state_dict()) == {"gate_proj.weight", "up_proj.weight",
                                             "down_proj.weight"}


# ----------------------------------------------------------------- stacked experts
def random_experts(num_experts, hidden, inter, counts, seed, dtype):
    """Rows grouped by expert and stacked weights of O(1)-output scale."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, 2 * inter, hidden, generator=g) * hidden ** -0.5).to(dtype)
    down = (torch.randn(num_experts, hidden, inter, generator=g) * inter ** -0.5).to(dtype)
    return x, gate_up, down


def ref_experts(x, gate_up, down, counts):
    """Row by row in float64 numpy: row r of expert e gets down_e silu(gate_e r) * (up_e r)."""
    inter = down.shape[2]
    out, start = [], 0
    for e, count in enumerate(counts):
        for row in x[start : start + count].double().numpy():
            out.append(ref_swiglu(row, gate_up[e, :inter], gate_up[e, inter:], down[e]))
        start += count
    return np.array(out).reshape(x.shape)


expert_cases = st.integers(1, 8).flatmap(
    lambda num_experts: st.tuples(
        st.just(num_experts),
        st.sampled_from([8, 16, 24, 48]),
        st.sampled_from([8, 16, 40]),
        st.lists(st.integers(0, 9), min_size=num_experts, max_size=num_experts),
    )
)


@given(case=expert_cases, dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_grouped_experts_equal_the_expert_loop_bit_for_bit_on_the_cpu(case, dtype, seed):
    # Exact, not close: on the CPU torch runs grouped_mm as one GEMM per expert over the same
    # rows and weights as the loop's, and both share the SwiGLU. (CUDA's bf16 grouped kernel
    # is a different GEMM: see the cuda test.)
    num_experts, hidden, inter, counts = case
    x, gate_up, down = random_experts(num_experts, hidden, inter, counts, seed, dtype)
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    grouped = experts_grouped_mm(x, gate_up, down, offsets)
    looped = experts_loop(x, gate_up, down, counts)
    assert grouped.dtype == looped.dtype == dtype and grouped.shape == x.shape
    assert torch.equal(grouped, looped)
    if sum(counts):
        # Against float64: one bf16 rounding of the inputs' products and of the output
        # (2^-8 each) or float32's (2^-24) times the GEMM lengths, with margin.
        tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
        assert rel_err(grouped.double().numpy(), ref_experts(x, gate_up, down, counts)) <= tol


@given(case=expert_cases, seed=st.integers(0, 2**16))
def test_float64_expert_loop_matches_the_float64_formula(case, seed):
    num_experts, hidden, inter, counts = case
    x, gate_up, down = random_experts(num_experts, hidden, inter, counts, seed, torch.float64)
    out = experts_loop(x, gate_up, down, counts)
    if sum(counts):
        assert rel_err(out.numpy(), ref_experts(x, gate_up, down, counts)) <= 1e-12


@given(
    config=st.sampled_from([GLM_LIKE, GROUPED, TWO_SHARED]),
    n=st.integers(1, 24),
    seed=st.integers(0, 2**16),
)
def test_float32_moe_through_grouped_mm_is_close_to_float64_loop(config, n, seed):
    moe = random_moe(config, seed, dtype=torch.float32)
    x = torch.randn(n, config.hidden_size, generator=torch.Generator().manual_seed(seed + 1))
    row_mask = torch.arange(n) % 3 != 1
    with torch.no_grad():
        out, counts = moe(x, row_mask)
    ref_out, ref_counts, _ = ref_moe(x, moe, row_mask.tolist())
    assert out.dtype == torch.float32 and counts.tolist() == ref_counts
    # float32 rounding (2^-24) through GEMMs of length ≤ 32 and a sum of ≤ 5 terms stays
    # below ~2e-6 relative; a wrong expert, weight or layout is off by O(1).
    assert rel_err(out.numpy(), ref_out) <= 1e-5
    assert not out[~row_mask].any()


def test_experts_state_dict_lists_each_expert_in_checkpoint_order():
    config = TWO_SHARED.replace(n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                                topk_group=1)
    expected = [
        "gate.weight", "gate.e_score_correction_bias",
        "experts.0.gate_proj.weight", "experts.0.up_proj.weight", "experts.0.down_proj.weight",
        "experts.1.gate_proj.weight", "experts.1.up_proj.weight", "experts.1.down_proj.weight",
        "experts.2.gate_proj.weight", "experts.2.up_proj.weight", "experts.2.down_proj.weight",
        "experts.3.gate_proj.weight", "experts.3.up_proj.weight", "experts.3.down_proj.weight",
        "shared_experts.gate_proj.weight", "shared_experts.up_proj.weight",
        "shared_experts.down_proj.weight",
    ]
    moe = MoE(config)
    assert list(moe.state_dict()) == expected
    assert list(moe.state_dict(keep_vars=True)) == expected
    shapes = {k: tuple(v.shape) for k, v in moe.state_dict().items()}
    assert shapes["experts.3.gate_proj.weight"] == shapes["experts.3.up_proj.weight"] == (16, 32)
    assert shapes["experts.3.down_proj.weight"] == (32, 16)
    assert [name for name, _ in moe.named_parameters()][2:4] == [
        "experts.gate_up_proj", "experts.down_proj"]


def test_per_expert_tensors_load_into_transformers_layout_and_read_back():
    num_experts, hidden, inter = 3, 8, 4
    experts = Experts(num_experts, hidden, inter).double()
    values = {}
    for e in range(num_experts):
        for k, (proj, shape) in enumerate([("gate_proj", (inter, hidden)),
                                           ("up_proj", (inter, hidden)),
                                           ("down_proj", (hidden, inter))]):
            # Distinct per expert, projection and element, so any misplaced block shows.
            values[f"{e}.{proj}.weight"] = (
                100.0 * e + 10.0 * k + np.arange(np.prod(shape)).reshape(shape) / 100.0
            )
    experts.load_state_dict({k: torch.from_numpy(v) for k, v in values.items()})

    gate_up, down = experts.gate_up_proj.detach().numpy(), experts.down_proj.detach().numpy()
    for e in range(num_experts):
        expected_gate_up = np.concatenate([values[f"{e}.gate_proj.weight"],
                                           values[f"{e}.up_proj.weight"]])
        assert np.array_equal(gate_up[e], expected_gate_up)
        assert np.array_equal(down[e], values[f"{e}.down_proj.weight"])
    state = experts.state_dict()
    assert list(state) == list(values)
    for name, t in state.items():
        assert np.array_equal(t.numpy(), values[name]), name
        assert t.untyped_storage().data_ptr() in (
            experts.gate_up_proj.untyped_storage().data_ptr(),
            experts.down_proj.untyped_storage().data_ptr(),
        ), f"{name} is a copy, not a view"
    gate, up, down_e = experts.weights(2)
    assert np.array_equal(up.detach().numpy(), values["2.up_proj.weight"])
    assert np.array_equal(down_e.detach().numpy(), values["2.down_proj.weight"])


def test_missing_or_misshapen_expert_tensors_are_named():
    experts = Experts(2, 8, 4)
    state = {k: v.clone() + 1.0 for k, v in experts.state_dict().items()}
    before = experts.down_proj[1].detach().clone()
    del state["1.down_proj.weight"]
    with pytest.raises(RuntimeError, match=r'Missing key\(s\).*"1\.down_proj\.weight"'):
        experts.load_state_dict(state)
    result = experts.load_state_dict(state, strict=False)
    assert result.missing_keys == ["1.down_proj.weight"] and result.unexpected_keys == []
    assert torch.equal(experts.down_proj[1], before)
    assert torch.equal(experts.gate_up_proj[1, 4:], state["1.up_proj.weight"])

    state["1.down_proj.weight"] = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match=r"size mismatch for 1\.down_proj\.weight"):
        experts.load_state_dict(state)


def test_stacked_names_load_but_not_mixed_with_per_expert_names_or_by_assignment():
    source, target = Experts(2, 8, 4), Experts(2, 8, 4)
    stacked = {name: p.detach() for name, p in source.named_parameters()}
    target.load_state_dict(stacked)
    assert torch.equal(target.gate_up_proj, source.gate_up_proj)
    with pytest.raises(RuntimeError, match="both per-expert and stacked"):
        target.load_state_dict({**stacked, **source.state_dict()})
    with pytest.raises(RuntimeError, match="assign"):
        target.load_state_dict(source.state_dict(), assign=True)


def test_expert_functions_reject_bad_input():
    x, gate_up, down = random_experts(2, 8, 4, [1, 2], 0, torch.float32)
    offsets = torch.tensor([1, 3], dtype=torch.int32)
    with pytest.raises(ValueError, match="experts_loop"):
        experts_grouped_mm(x.double(), gate_up.double(), down.double(), offsets)
    with pytest.raises(ValueError, match="int32"):
        experts_grouped_mm(x, gate_up, down, offsets.long())
    with pytest.raises(ValueError, match="one dtype"):
        experts_grouped_mm(x, gate_up.bfloat16(), down, offsets)
    with pytest.raises(ValueError, match="down_proj"):
        experts_loop(x, gate_up, down.transpose(1, 2), [1, 2])
    with pytest.raises(ValueError, match="counts"):
        experts_loop(x, gate_up, down, [2, 2])


# ----------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "x, row_mask",
    [
        (torch.zeros(4), None),
        (torch.zeros(4, 31), None),
        (torch.zeros(4, 32, dtype=torch.int64), None),
        (torch.zeros(4, 32), torch.ones(4)),
        (torch.zeros(4, 32), torch.ones(3, dtype=torch.bool)),
        (torch.zeros(4, 32, dtype=torch.float64), None),
    ],
    ids=["1d", "wrong-hidden", "integer", "float-mask", "short-mask", "dtype-mismatch"],
)
def test_moe_rejects_bad_input(x, row_mask):
    with pytest.raises(ValueError):
        MoE(GROUPED)(x, row_mask)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(top_k=0),
        dict(top_k=9),
        dict(n_group=3),
        dict(topk_group=5),
        dict(n_group=16, topk_group=2),
        dict(bias=torch.zeros(16, dtype=torch.bfloat16)),
        dict(bias=torch.zeros(15)),
        dict(gate_weight=torch.zeros(16, 7)),
    ],
    ids=["k0", "k-beyond-kept-groups", "groups-not-dividing", "topk-group", "singleton-groups",
         "bf16-bias", "bias-shape", "gate-shape"],
)
def test_route_rejects_bad_settings(kwargs):
    args = dict(x=torch.zeros(2, 8), gate_weight=torch.zeros(16, 8), bias=torch.zeros(16),
                top_k=2, n_group=4, topk_group=2)
    args.update(kwargs)
    with pytest.raises(ValueError):
        route(args["x"], args["gate_weight"], args["bias"], args["top_k"], args["n_group"],
              args["topk_group"], True, SCALE)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_grouped_experts_are_close_to_the_expert_loop(dtype):
    # Not bitwise: CUDA's bf16 grouped GEMM (CUTLASS) sums in another order than cuBLAS.
    # Both accumulate in float32 and round once to the output dtype, so they differ by about
    # one rounding of the output: DeepGEMM's calc_diff of 2^-16 for bf16, 1e-10 for float32.
    counts = [0, 37, 5, 0, 128, 1, 64, 9]
    x, gate_up, down = (t.cuda() for t in random_experts(8, 256, 128, counts, 0, dtype))
    offsets = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    a = experts_grouped_mm(x, gate_up, down, offsets).double()
    b = experts_loop(x, gate_up, down, counts).double()
    diff = 1 - 2 * (a * b).sum() / (a * a + b * b).sum()
    assert diff.item() < (2.0 ** -16 if dtype == torch.bfloat16 else 1e-10)


@pytest.mark.cuda
def test_cuda_moe_matches_cpu_output_and_counts():
    moe = random_moe(GROUPED, 5, dtype=torch.float64)
    x = torch.randn(64, GROUPED.hidden_size, dtype=torch.float64,
                    generator=torch.Generator().manual_seed(5))
    row_mask = torch.arange(64) % 5 != 0
    with torch.no_grad():
        out, counts = moe(x, row_mask)
        out_gpu, counts_gpu = moe.cuda()(x.cuda(), row_mask.cuda())
    assert torch.equal(counts, counts_gpu.cpu())
    assert rel_err(out_gpu.cpu().numpy(), out.numpy()) <= 1e-12


# ----------------------------------------------------------------- row blocks under a budget
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("mask_kind", ["none", "random"])
def test_moe_in_row_blocks_equals_per_token_loop(dtype, mask_kind):
    moe = random_moe(GROUPED, 11, dtype=dtype)
    n = 40
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, GROUPED.hidden_size, generator=g, dtype=dtype)
    row_mask = None if mask_kind == "none" else torch.rand(n, generator=g) < 0.6
    mask_list = [True] * n if row_mask is None else row_mask.tolist()
    ref_out, ref_counts, _ = ref_moe(x, moe, mask_list)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    whole = moe.block_rows(n, dtype, "cpu", None)
    assert whole == n
    for budget in (1, 20_000, 60_000, 1 << 30):
        rows = moe.block_rows(n, dtype, "cpu", budget)
        with torch.no_grad():
            out, counts = moe(x, row_mask, budget_bytes=budget)
        assert counts.tolist() == ref_counts, budget
        assert rel_err(out.numpy(), ref_out) <= tol, (budget, rows)
        if row_mask is not None:
            assert not out[~row_mask].any()
    assert moe.block_rows(n, dtype, "cpu", 1) == 1  # a budget below one row still makes progress
    assert 1 < moe.block_rows(n, dtype, "cpu", 20_000) < n


def test_moe_rows_follow_the_per_row_bytes_and_even_out_the_blocks():
    from glm_dsa.budget import moe_rows

    args = dict(top_k=8, hidden=6144, intermediate=2048, shared_intermediate=2048, num_experts=256)
    # GLM-5.3 in bf16 with the fused passes: per row 6144·2 (shared output) + 8·(40 + 2·4) (pair
    # indices and routing) + 8·(6144 + 2·2048)·2 (gathered rows and gate/up, the largest phase).
    per_row = 6144 * 2 + 8 * 48 + 8 * (6144 + 2 * 2048) * 2
    assert moe_rows(1000, dtype=torch.bfloat16, fused=True, budget_bytes=per_row * 1000, **args) == 1000
    assert moe_rows(1001, dtype=torch.bfloat16, fused=True, budget_bytes=per_row * 1000, **args) == 501
    assert moe_rows(32768, dtype=torch.bfloat16, fused=True, budget_bytes=3 << 30, **args) == 16384
    # Unfused (the CPU's torch SwiGLU and combine) holds float32 temporaries too: fewer rows.
    assert (moe_rows(32768, dtype=torch.bfloat16, fused=False, budget_bytes=3 << 30, **args)
            < moe_rows(32768, dtype=torch.bfloat16, fused=True, budget_bytes=3 << 30, **args))
    assert moe_rows(0, dtype=torch.bfloat16, fused=True, budget_bytes=None, **args) == 1
    assert moe_rows(77, dtype=torch.bfloat16, fused=True, budget_bytes=None, **args) == 77
    with pytest.raises(ValueError, match="budget_bytes=0"):
        moe_rows(8, dtype=torch.bfloat16, fused=True, budget_bytes=0, **args)
    with pytest.raises(ValueError, match="top_k=-1"):
        moe_rows(8, dtype=torch.bfloat16, fused=True, budget_bytes=1, **{**args, "top_k": -1})


def test_moe_rejects_misshapen_row_keys():
    with pytest.raises(ValueError, match="row_keys must be"):
        MoE(GROUPED)(torch.zeros(4, 32), None, torch.zeros(3, dtype=torch.int64))


def test_swiglu_and_combine_are_the_formulas_they_name():
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g)
    want = (gate.double() / (1 + torch.exp(-gate.double())) * up.double())
    assert rel_err(swiglu(gate.double(), up.double(), torch.float64).numpy(), want.numpy()) <= 1e-15
    expert_out = torch.randn(6, 4, generator=g, dtype=torch.float64)
    position = torch.tensor([[0, 3], [1, 2], [4, 5]])
    weights = torch.rand(3, 2, generator=g, dtype=torch.float64)
    shared = torch.randn(3, 4, generator=g, dtype=torch.float64)
    expert_out[4:] = float("nan")  # row 2 is masked: its pairs' rows are never used
    out = combine_experts(expert_out, position, weights, shared, torch.tensor([True, True, False]))
    for t in range(2):
        expected = sum(weights[t, j] * expert_out[position[t, j]] for j in range(2)) + shared[t]
        assert rel_err(out[t].numpy(), expected.numpy()) <= 1e-15
    assert not out[2].any()


# ----------------------------------------------------------------- CUDA: no host sync, graphs
def _glm_like_cuda_moe(dtype=torch.bfloat16):
    """GLM-5.3's expert widths (hidden 6144, experts of 2048, top 8) with 32 experts."""
    cfg = get_config("glm-5.3").replace(n_routed_experts=32)
    torch.manual_seed(0)
    with torch.device("cuda"):  # drawn on the GPU: 4.8 GB of float32 experts
        moe = MoE(cfg)
        with torch.no_grad():
            moe.gate.weight.normal_(0.0, 2.0 / cfg.hidden_size ** 0.5)
            moe.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    return moe.to(dtype), cfg


@pytest.mark.cuda
def test_cuda_bf16_moe_in_blocks_equals_deepseeks_loop_on_the_same_routing():
    # The expected value: per block (the MoE's own split, so the router GEMM sees the same rows),
    # the router's choice, then DeepSeek's loop over the experts with cuBLAS GEMMs, float32 sums.
    moe, cfg = _glm_like_cuda_moe()
    n, budget, i = 300, 20 << 20, cfg.moe_intermediate_size  # ~176 KB a row: 3 blocks
    x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).bfloat16().cuda()
    row_mask = torch.arange(n, device="cuda") % 7 != 3
    rows = moe.block_rows(n, x.dtype, x.device, budget)
    assert rows < n  # several blocks
    with torch.no_grad():
        out, counts = moe(x, row_mask, budget_bytes=budget)
        y = torch.zeros(n, cfg.hidden_size, device="cuda")
        want_counts = torch.zeros_like(counts)
        for start in range(0, n, rows):
            blk = slice(start, start + rows)
            ids, weights = moe.gate(x[blk], row_mask[blk])
            for e in range(cfg.n_routed_experts):
                r, slot = torch.where(ids == e)
                want_counts[e] += len(r)
                if len(r):
                    gate_up = x[blk][r] @ moe.experts.gate_up_proj[e].T
                    h = (torch.nn.functional.silu(gate_up[:, :i].float()) * gate_up[:, i:].float()).bfloat16()
                    y[blk][r] += (h @ moe.experts.down_proj[e].T).float() * weights[r, slot, None]
        y += moe.shared_experts(x).float()
        want = y.masked_fill(~row_mask[:, None], 0.0).bfloat16()
    assert torch.equal(counts, want_counts)
    # CUTLASS's grouped GEMM sums in another order than cuBLAS: about one bf16 rounding apart.
    a, b = out.double(), want.double()
    assert (1 - 2 * (a * b).sum() / (a * a + b * b).sum()).item() < 1e-4
    assert not out[~row_mask].any()


@pytest.mark.cuda
def test_cuda_moe_never_synchronises_and_replays_in_a_cuda_graph():
    moe, cfg = _glm_like_cuda_moe()
    x = torch.randn(512, cfg.hidden_size, device="cuda").bfloat16()
    mask = torch.arange(512, device="cuda") % 9 != 0
    budget = 40 << 20  # ~176 KB a row: 3 blocks
    assert moe.block_rows(512, x.dtype, x.device, budget) < 512
    with torch.no_grad():
        eager = moe(x, mask, budget_bytes=budget)
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe(x, mask, budget_bytes=budget)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = moe(x, mask, budget_bytes=budget)
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1])


@pytest.mark.cuda
def test_cuda_moe_temporaries_stay_within_the_budget():
    moe, cfg = _glm_like_cuda_moe()
    x = torch.randn(4096, cfg.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        moe(x, budget_bytes=256 << 20)  # warm-up (kernels, workspaces)
        for budget in (256 << 20, 1 << 30):
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()
            out, _ = moe(x, budget_bytes=budget)
            torch.cuda.synchronize()
            transient = torch.cuda.max_memory_allocated() - held - out.numel() * out.element_size()
            assert transient <= budget, (budget, transient)


def test_packed_top_equals_the_stable_sort_with_ties_zeros_and_infinities():
    from glm_dsa.moe import _packed_top

    g = torch.Generator().manual_seed(0)
    scores = torch.randn(64, 48, generator=g)
    scores[:, ::5] = scores[:, :1]  # ties inside rows
    scores[3] = 0.0
    scores[4, ::2] = -0.0  # -0.0 ties +0.0, as in a float comparison
    scores[5, :40] = float("-inf")  # dropped groups
    scores[6] = torch.tensor([1e-40, -1e-40, 3e38, -3e38] * 12)  # subnormals and extremes
    for k in (1, 8, 48):
        want = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        assert torch.equal(_packed_top(scores, k), want), k


def test_the_model_runs_where_grouped_mm_cannot_take_the_row_widths():
    """hidden_size 3 (12-byte float32 rows) used to fail inside the forward with "strides should
    be multiple of 16 bytes"; the routed experts then run in the per-expert loop, which equals a
    float64 computation of the same experts."""
    from glm_dsa.weights import build_model, init_weights

    config = get_config("tiny").replace(hidden_size=3, moe_intermediate_size=5)
    experts = init_weights(build_model(config), 0).model.layers[1].mlp.experts
    x = torch.randn(6, 3, generator=torch.Generator().manual_seed(0))
    counts = [1, 0, 2, 0, 0, 3, 0, 0]
    offsets = torch.tensor(counts).cumsum(0).to(torch.int32)
    with torch.no_grad():
        got = experts(x, torch.arange(6), offsets)  # pairs = the rows, in order
        want = experts_loop(x.double(), experts.gate_up_proj.double(), experts.down_proj.double(), counts)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)


def test_the_gathered_pairs_are_freed_before_the_swiglu():
    """The gathered pairs ``[P, H]`` are the MoE's largest temporary, and its budget counts them
    freed once the first GEMM has run: by the SwiGLU nothing may hold them. (A second name for
    the fused pass's copy kept them alive: 62 MB over the budget on the H200, 2026-12-02.)"""
    import weakref

    from glm_dsa import fused

    seen = {}

    class Spy(fused.Passes):
        def gather_rows(self, x, rows):
            pairs = x.index_select(0, rows)
            seen["pairs"] = weakref.ref(pairs)
            return pairs

        def swiglu(self, gate, up, dtype):
            seen["alive at the swiglu"] = seen["pairs"]() is not None
            return None

    g = torch.Generator().manual_seed(0)
    x = torch.randn(6, 16, generator=g)
    gate_up, down = torch.randn(2, 24, 16, generator=g), torch.randn(2, 16, 12, generator=g)
    rows = torch.tensor([0, 3, 5, 1, 1])
    with fused.using(Spy()):
        experts_grouped_mm(x, gate_up, down, torch.tensor([2, 5], dtype=torch.int32), rows)
    assert seen == {"pairs": seen["pairs"], "alive at the swiglu": False}
