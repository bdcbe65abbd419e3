"""The harness as a kernel author meets it first: kernels with the real upstream signatures pass
`check` and `compare` under their own convention and fail under another, with the convention
named; the FP8 cases sit at the indexer's real ranges, so a float16 accumulator fails with the
overflow named; a fused indexer that scores in its own float32 order passes the tie-aware
top-k metric, and one that drops a true member fails.

Every kernel here is written in the test from the upstream description (float64 formulas,
torch's own top-k), never from the oracle.
"""

from __future__ import annotations

import math

import pytest
import torch

from glm_dsa import cli
from glm_dsa.testing import check_kernel, edge_case_names, make_case
from glm_dsa.testing.check import check_case, run_checks
from glm_dsa.testing.golden import compare_kernel, write_golden
from glm_dsa.testing.metrics import TOPK_REL_TOL
from test_testing import paged_logits_bf16, sparse_fwd_bf16  # noqa: E402


def edges(contract):
    return len(edge_case_names(contract))


# ------------------------------------------------------------------ upstream signatures
def flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    """FlashMLA 9241ae3's Python signature (no convention keywords): natural-log lse, +inf for a
    row with no valid index."""
    return sparse_fwd_bf16(q, kv, indices, sm_scale, d_v, attn_sink, topk_length)


def flash_mla_sparse_fwd_sep2025(q, kv, indices, sm_scale, d_v=512):
    """FlashMLA c28eca9 (Sep 2025): no attn_sink or topk_length yet, base-2 lse, -inf lonely."""
    return sparse_fwd_bf16(q, kv, indices, sm_scale, d_v, base2=True, lonely_lse=-math.inf)


def fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len,
                         clean_logits=False):
    """DeepGEMM 54e2261's paged logits, its default included (clean_logits=False leaves what a
    row does not see as garbage); schedule_meta, which only balances SMs, is not taken."""
    out = paged_logits_bf16(q, kv_cache, weights, context_lens, block_table, max_context_len)
    return out if clean_logits else torch.where(torch.isneginf(out), 7.0, out)


def fp8_paged_mqa_logits_never_cleaned(q, kv_cache, weights, context_lens, block_table,
                                       max_context_len):
    """A DeepGEMM-style paged kernel with no clean_logits at all (the newest DeepGEMM cannot
    clean 2-D context_lens): entries past the context are garbage."""
    return fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, max_context_len)


def fast_topk_v2(score, lengths, topk, row_starts=None):
    """SGLang's sgl_kernel.fast_topk_v2: per row the topk best of score[r, start:start + len],
    relative to start, -1 padded; a row no longer than topk lists all its columns."""
    starts = torch.zeros_like(lengths) if row_starts is None else row_starts
    out = torch.full((score.shape[0], topk), -1, dtype=torch.int32)
    for r in range(score.shape[0]):
        s, n = int(starts[r]), int(lengths[r])
        if n <= topk:
            out[r, :n] = torch.arange(n, dtype=torch.int32)
        else:
            out[r] = score[r, s:s + n].double().topk(topk).indices.to(torch.int32)
    return out


def topk_per_row_sglang(logits, row_starts, row_ends, topk):
    """The oracle's signature over SGLang's: lengths = row_ends - row_starts."""
    return fast_topk_v2(logits, row_ends - row_starts, topk, row_starts)


def tl_topk(logits, row_starts, row_ends, topk):
    """TileLang a35008a's selector: absolute column numbers, 0 in unused entries."""
    rel = topk_per_row_sglang(logits, row_starts, row_ends, topk)
    return torch.where(rel >= 0, rel + row_starts[:, None], 0).to(torch.int32)


SIGNATURES = {  # kernel, contract, its convention, another convention
    "FlashMLA 9241ae3": (flash_mla_sparse_fwd, "flash_mla_sparse_fwd", "newest", "sep2025"),
    "FlashMLA c28eca9": (flash_mla_sparse_fwd_sep2025, "flash_mla_sparse_fwd", "sep2025", "newest"),
    "DeepGEMM never cleaned": (fp8_paged_mqa_logits_never_cleaned, "fp8_paged_mqa_logits",
                               "deepgemm", "newest"),
    "SGLang fast_topk_v2": (topk_per_row_sglang, "topk_per_row", "newest", "tilelang"),
    "TileLang tl_topk": (tl_topk, "topk_per_row", "tilelang", "newest"),
}


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_an_upstream_signature_passes_under_its_convention_and_fails_under_another(name):
    fn, contract, own, other = SIGNATURES[name]
    report = check_kernel(contract, fn, cases=edges(contract) + 2, convention=own)
    assert report.passed and report.convention == own
    with pytest.raises(AssertionError) as info:
        check_kernel(contract, fn, cases=edges(contract) + 2, convention=other)
    # The failure says which convention the kernel does follow.
    assert f"cause: the kernel follows convention {own!r}" in str(info.value), str(info.value)


def test_deepgemms_default_clean_logits_false_is_overridden_where_the_call_cleans():
    """The real paged signature defaults to clean_logits=False; the contract's call without the
    keyword means True, so the harness passes True (else a correct kernel fails every case)."""
    seen = []

    def spy(q, kv_cache, weights, context_lens, block_table, max_context_len, clean_logits=False):
        seen.append(clean_logits)
        return fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table,
                                    max_context_len, clean_logits)

    assert check_kernel("fp8_paged_mqa_logits", spy, cases=edges("fp8_paged_mqa_logits")).passed
    assert seen.count(False) == 1 and seen.count(True) == len(seen) - 1  # only the uncleaned case
    assert check_kernel("fp8_paged_mqa_logits", spy, cases=edges("fp8_paged_mqa_logits"),
                        convention="deepgemm").passed


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden")
    write_golden(path)
    return path


@pytest.mark.parametrize("name", list(SIGNATURES))
def test_compare_judges_an_upstream_signature_by_the_convention_asked_for(name, golden_dir):
    fn, contract, own, other = SIGNATURES[name]
    report = compare_kernel(golden_dir, fn, contracts=(contract,), convention=own)
    assert report.passed and report.conventions == (own,) and report.checks
    report = compare_kernel(golden_dir, fn, contracts=(contract,), convention=other)
    assert not report.passed and report.conventions == (other,)
    assert any(f"the kernel follows convention {own!r}" in c.detail for c in report.checks)


def test_compare_runs_every_convention_for_a_kernel_that_takes_the_keywords(golden_dir):
    def honours(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None,
                lse_base="e", lonely_lse="+inf"):
        return sparse_fwd_bf16(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                               base2=lse_base == "2", lonely_lse=float(lonely_lse))

    report = compare_kernel(golden_dir, honours, contracts=("flash_mla_sparse_fwd",))
    assert report.passed and report.conventions == ("newest", "sep2025") and not report.not_run


def test_cli_check_and_compare_take_the_convention(golden_dir, capsys):
    kernel = f"{__file__}:flash_mla_sparse_fwd_sep2025"
    base = ["--contract", "flash_mla_sparse_fwd"]
    assert cli.main(["check", kernel, *base, "--cases", "8", "--convention", "sep2025"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].endswith("convention sep2025")
    assert cli.main(["check", kernel, *base, "--cases", "8", "--lse-base", "2",
                     "--lonely-lse=-inf"]) == 0  # the explicit options name the same convention
    assert capsys.readouterr().out.splitlines()[-1].endswith("convention sep2025")
    assert cli.main(["check", kernel, *base, "--cases", "8"]) == 1
    assert "cause: the kernel follows convention 'sep2025'" in capsys.readouterr().out
    assert cli.main(["compare", "--golden", str(golden_dir), "--kernel", kernel, *base,
                     "--convention", "sep2025"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[-1] == ("conventions checked: sep2025; newest not run (the kernel "
                                    "takes no lonely_lse, lse_base; --convention newest runs "
                                    "these cases)")
    assert cli.main(["compare", "--golden", str(golden_dir), "--kernel", kernel, *base]) == 1
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("conventions checked: newest; sep2025 not run (the kernel takes no "
                           "lonely_lse, lse_base; --convention sep2025 runs these cases)"), last


@pytest.mark.parametrize("argv, error", [
    (["--convention", "tilelang"], "flash_mla_sparse_fwd has no convention 'tilelang'; its "
                                   "conventions: newest, sep2025"),
    (["--topk-base", "absolute"], "--topk-base is an option of topk_per_row, not of "
                                  "flash_mla_sparse_fwd"),
    (["--lse-base", "10"], "argument --lse-base: invalid choice: '10'"),
    (["--cases", "0"], "--cases 0 must be at least 1"),
])
def test_cli_convention_and_case_count_errors_are_one_line(argv, error, capsys):
    try:
        status = cli.main(["check", f"{__file__}:flash_mla_sparse_fwd", "--contract",
                           "flash_mla_sparse_fwd", *argv])
    except SystemExit as e:  # argparse's own usage errors
        status = e.code
    assert status == 2
    err = capsys.readouterr().err
    assert error in err and "Traceback" not in err, err


def test_compare_refuses_a_convention_flag_with_a_candidate_file(golden_dir, tmp_path, capsys):
    from safetensors.torch import save_file

    path = tmp_path / "c.safetensors"
    save_file({"act_quant.zeros.x_fp8": torch.zeros(1)}, str(path))
    assert cli.main(["compare", "--golden", str(golden_dir), "--candidate", str(path),
                     "--convention", "sep2025"]) == 2
    assert "--convention goes with --kernel" in capsys.readouterr().err


# ------------------------------------------------------------------ FP8 at the real ranges
def fp8_mqa_logits_fp16(q, kv, weights, cu_seqlen_ks, cu_seqlen_ke, clean_logits=True,
                        max_seqlen_k=0):
    """DeepGEMM's formula with the q·k products summed in float16 (a tensor-core kernel with a
    half accumulator): exact for |q·k| <= 65504, inf past it."""
    k_fp8, k_scale = kv
    dots = torch.einsum("shd,nd->shn", q.to(torch.float16), k_fp8.to(torch.float16))
    scores = (dots.float().relu() * weights[:, :, None]).sum(1) * k_scale[None, :]
    col = torch.arange(k_fp8.shape[0])
    inside = (col[None, :] >= cu_seqlen_ks[:, None]) & (col[None, :] < cu_seqlen_ke[:, None])
    out = torch.where(inside, scores, -math.inf)
    if max_seqlen_k:
        at = (cu_seqlen_ks[:, None] + torch.arange(max_seqlen_k)).clamp(max=out.shape[1] - 1)
        ok = torch.arange(max_seqlen_k)[None, :] < (cu_seqlen_ke - cu_seqlen_ks)[:, None]
        out = torch.where(ok, out.gather(1, at), -math.inf)
    return out


def test_every_fp8_logits_case_reaches_the_full_e4m3_range():
    for contract in ("fp8_mqa_logits", "fp8_paged_mqa_logits", "fp8_paged_mqa_topk"):
        for which in [*edge_case_names(contract), 0, 1]:
            q = make_case(contract, which).args[0].float().abs()
            assert float(q.max()) == 448.0, (contract, which)


def test_a_float16_accumulating_logits_kernel_fails_with_overflow_named():
    with pytest.raises(AssertionError) as info:
        check_kernel("fp8_mqa_logits", fp8_mqa_logits_fp16)
    message = str(info.value)
    assert "finite inside the valid region" in message.splitlines()[0]
    assert "cause: overflow: q·k of FP8 payloads at full range passes float16's 65504" in message


def test_the_float16_kernel_passes_at_the_small_magnitudes_the_cases_used_to_have():
    """What made it slip through before: q drawn as randn (|q| < 5) keeps q·k below 65504."""
    case = make_case("fp8_mqa_logits", "no_prefix")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(case.args[0].shape, generator=g).to(torch.float8_e4m3fn)
    k_fp8, k_scale = case.args[1]
    small_k = (k_fp8.float().clamp(-4, 4)).to(torch.float8_e4m3fn)
    case.args = (q, (small_k, k_scale), torch.randn(case.args[2].shape, generator=g), *case.args[3:])
    check_case(case, fp8_mqa_logits_fp16)


# ------------------------------------------------------------------ end-to-end indexer top-k
def paged_indexer(q, kv_cache, weights, context_lens, block_table, topk):
    """flashinfer-bench's dsa_topk_indexer_fp8 reference as described: dequantize the pages to
    float32 keys, float32 scores (heads summed by a matmul, another order than ours),
    torch.topk over each row's visible positions."""
    b, next_n, h, d = q.shape
    bs = kv_cache.shape[1]
    flat = kv_cache.reshape(kv_cache.shape[0], -1)
    payload = flat[:, : bs * d].reshape(-1, bs, d).contiguous().view(torch.float8_e4m3fn).float()
    scale = flat[:, bs * d:].contiguous().view(torch.float32).reshape(-1, bs, 1)
    keys = payload * scale  # [num_blocks, bs, d]
    out = torch.full((b * next_n, topk), -1, dtype=torch.int32)
    for bi in range(b):
        for j in range(next_n):
            r = bi * next_n + j
            if context_lens.dim() == 2:
                n = int(context_lens[bi, j])
            else:
                n = int(context_lens[bi]) - next_n + j + 1
            pages = block_table[bi, : -(-n // bs)].long()
            k = keys[pages].reshape(-1, d)[:n]
            s = (q[bi, j].float() @ k.T).relu()  # [h, n]
            score = weights[r].float()[None, :] @ s  # [1, n]
            if n <= topk:
                out[r, :n] = torch.arange(n, dtype=torch.int32)
            else:
                out[r] = score[0].topk(topk).indices.to(torch.int32)
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_indexer_that_scores_in_its_own_float_order_passes(seed):
    report = check_kernel("fp8_paged_mqa_topk", paged_indexer, cases=16, seed=seed)
    assert report.passed and report.worst["indices"].value <= TOPK_REL_TOL


def test_an_indexer_that_drops_a_true_member_fails_with_the_margin():
    def drops_the_best(q, kv_cache, weights, context_lens, block_table, topk):
        out = paged_indexer(q, kv_cache, weights, context_lens, block_table, topk)
        scores = make_scores(q, kv_cache, weights, context_lens, block_table)
        for r in range(out.shape[0]):
            row = scores[r]
            n = int(torch.isfinite(row).sum())
            if n > topk:  # the best member out, the worst position in
                out[r, 0] = int(row[:n].argmin())
        return out

    with pytest.raises(AssertionError) as info:
        check_kernel("fp8_paged_mqa_topk", drops_the_best, cases=6)
    first = str(info.value).splitlines()[0]
    assert "fails topk_margin on top-k members: " in first and "below the k-th best" in first


def make_scores(q, kv_cache, weights, context_lens, block_table):
    """float64 scores of every visible position (the planted bug needs to know the worst)."""
    b, next_n, h, d = q.shape
    rows = []
    bs = kv_cache.shape[1]
    flat = kv_cache.reshape(kv_cache.shape[0], -1)
    payload = flat[:, : bs * d].reshape(-1, bs, d).contiguous().view(torch.float8_e4m3fn).double()
    scale = flat[:, bs * d:].contiguous().view(torch.float32).reshape(-1, bs, 1).double()
    for bi in range(b):
        for j in range(next_n):
            n = int(context_lens[bi]) - next_n + j + 1 if context_lens.dim() == 1 else int(context_lens[bi, j])
            k = (payload * scale)[block_table[bi, : -(-n // bs)].long()].reshape(-1, d)[:n]
            s = (q[bi, j].double() @ k.T).relu()
            row = torch.full((int(context_lens.max()) + bs,), -math.inf, dtype=torch.float64)
            row[:n] = weights[bi * next_n + j].double() @ s
            rows.append(row)
    return rows


def test_an_indexer_that_drops_the_last_position_fails():
    def short(q, kv_cache, weights, context_lens, block_table, topk):
        return paged_indexer(q, kv_cache, weights, context_lens - 1, block_table, topk)

    with pytest.raises(AssertionError, match=r"\[case context_shorter_than_k\]"):
        check_kernel("fp8_paged_mqa_topk", short, cases=edges("fp8_paged_mqa_topk"))


def test_the_exact_metric_stays_for_kernels_handed_the_logits():
    """topk_per_row keeps the exact-set metric: one member swapped for a near-tie fails there."""
    case = make_case("topk_per_row", "row_k_plus_1")
    assert case.checks["indices"]["metric"] == "topk_set"
    assert make_case("fp8_paged_mqa_topk", 0).checks["indices"]["metric"] == "topk_margin"


def test_the_margin_metric_accepts_a_near_tie_swap_and_rejects_a_real_gap():
    """Two rows of one case: swapping the k-th member for a position 1e-7 below it (relative)
    passes; for one 1e-3 below it fails, naming the margin."""
    from glm_dsa.testing.metrics import check_tensor

    topk, n = 4, 10
    base = torch.tensor([9.0, 8.0, 7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0], dtype=torch.float64)
    near, far = base.clone(), base.clone()
    near[4] = 6.0 - 9e-7  # 1e-7 of the row's largest |score|
    far[4] = 6.0 - 9e-3
    scores = torch.stack([near, far])
    aux = {"scores": scores, "row_starts": torch.zeros(2, dtype=torch.int32),
           "row_ends": torch.full((2,), n, dtype=torch.int32)}
    spec = {"metric": "topk_margin", "scores": "scores", "row_starts": "row_starts",
            "row_ends": "row_ends", "rel_tol": TOPK_REL_TOL}
    expected = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]], dtype=torch.int32)
    swapped = torch.tensor([[0, 1, 2, 4], [0, 1, 2, 3]], dtype=torch.int32)
    assert check_tensor(spec, swapped, expected, aux.__getitem__).passed
    wrong = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 4]], dtype=torch.int32)
    v = check_tensor(spec, wrong, expected, aux.__getitem__)
    assert not v.passed and "row 1: position 4 scores 5.991" in v.detail and "0.001 of the row" in v.detail


def test_run_checks_reports_the_worst_margin():
    report = run_checks("fp8_paged_mqa_topk", paged_indexer, cases=6)
    line = report.lines()[0]
    assert report.passed and line.startswith("PASS  fp8_paged_mqa_topk.indices  topk_margin: worst ")
    assert f"(bound {TOPK_REL_TOL:g})" in line


def test_check_help_names_every_shape_table_and_every_convention(capsys):
    """`glm-dsa check --help` lists each size table and convention the harness accepts, so a new
    table or convention cannot be added without saying it there."""
    from glm_dsa.testing.cases import CONVENTIONS, SHAPES

    with pytest.raises(SystemExit):
        cli.main(["check", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    names = set(SHAPES) | {name for table in CONVENTIONS.values() for name in table}
    missing = sorted(n for n in names if n not in text.replace(",", " ").replace(";", " ").split())
    assert not missing, f"check --help does not name {missing}"
