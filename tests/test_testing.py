"""glm_dsa.testing: the oracle and independent re-implementations pass every contract; planted
mutants fail with a one-line message; tie-swapped top-k passes; the CLI's exit statuses."""

import json
import math
import os
import re
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET

import pytest
import torch

from glm_dsa import cli, oracle
from glm_dsa.testing import CONTRACTS, check_case, check_kernel, clauses, edge_case_names, make_case
from glm_dsa.testing import cases as cases_module
from glm_dsa.testing.check import run_checks

LN2 = math.log(2.0)


def edges_only(contract):
    return len(edge_case_names(contract))


# ------------------------------------------------------------------ independent implementations
def hadamard_bf16(x, scale=1.0):
    """Dense float64 Sylvester matrix, H[i, j] = (-1)**popcount(i & j); output rounded to bf16."""
    d = x.shape[-1]
    n = 1 << (d - 1).bit_length()
    i = torch.arange(n)
    h = torch.tensor([[(-1.0) ** bin(int(a) & int(b)).count("1") for b in i] for a in i],
                     dtype=torch.float64)
    xp = torch.nn.functional.pad(x.double(), (0, n - d))
    return ((xp @ h.T) * scale)[..., :d].to(torch.bfloat16)


def mqa_logits_bf16(q, kv, weights, ks, ke, clean_logits=True, max_seqlen_k=0, *, relu=True,
                    ke_shift=0, scale_power=1):
    """Dense float64 formula over dequantized inputs, -inf outside [ks, ke); output bf16."""
    k_fp8, k_scale = kv
    scores = torch.einsum("shd,nd->shn", q.double(), k_fp8.double())
    if relu:
        scores = scores.clamp(min=0)
    logits = (scores * weights.double()[:, :, None]).sum(1) * k_scale.double()[None, :] ** scale_power
    col = torch.arange(logits.shape[1])
    inside = (col[None, :] >= ks[:, None].long()) & (col[None, :] < ke[:, None].long() + ke_shift)
    full = torch.where(inside, logits, -math.inf)
    if max_seqlen_k:
        out = torch.full((full.shape[0], max_seqlen_k), -math.inf, dtype=torch.float64)
        for r in range(full.shape[0]):
            n = int(ke[r] - ks[r])
            out[r, :n] = full[r, int(ks[r]) : int(ks[r]) + n]
        full = out
    return full.to(torch.bfloat16)


def paged_logits_bf16(q, kv_cache, weights, context_lens, block_table, max_context_len,
                      clean_logits=True, *, floor_pages=False):
    """Per row, gather each visible position's key from its block's bytes (fp8 payload at
    t * D, float32 scale at block_size * D + 4 t); float64 formula; bf16 output."""
    batch, next_n, heads, d = q.shape
    bs = kv_cache.shape[1]
    blocks = kv_cache.reshape(kv_cache.shape[0], -1)
    out = torch.full((batch * next_n, max_context_len), -math.inf, dtype=torch.float64)
    for b in range(batch):
        for j in range(next_n):
            if context_lens.dim() == 2:
                visible = int(context_lens[b, j])
            else:
                visible = int(context_lens[b]) - next_n + j + 1
            if floor_pages:
                visible = min(visible, int(context_lens.max()) // bs * bs)
            for p in range(visible):
                blk, t = int(block_table[b, p // bs]), p % bs
                key = blocks[blk, t * d : (t + 1) * d].view(torch.float8_e4m3fn).double()
                scale = blocks[blk, bs * d + 4 * t : bs * d + 4 * t + 4].view(torch.float32).double()
                s = (q[b, j].double() @ key).clamp(min=0)
                out[b * next_n + j, p] = float((s * weights[b * next_n + j].double()).sum() * scale)
    return out.to(torch.bfloat16)


def _attend(q, kv, idx_rows, sm_scale, attn_sink, d_v):
    """float64 per row: (out, max_logits, lse) over the row's valid key rows; lonely rows give
    out 0, max -inf, lse +inf."""
    s_q, h, _ = q.shape
    out = torch.zeros(s_q, h, d_v, dtype=torch.float64)
    mx = torch.full((s_q, h), -math.inf, dtype=torch.float64)
    lse = torch.full((s_q, h), math.inf, dtype=torch.float64)
    for s, rows in enumerate(idx_rows):
        if not rows:
            continue
        keys = kv[rows].double()
        p = (q[s].double() @ keys.T) * sm_scale
        mx[s] = p.max(-1).values
        lse[s] = torch.logsumexp(p, -1)
        norm = lse[s] if attn_sink is None else torch.logaddexp(lse[s], attn_sink.double())
        out[s] = torch.exp(p - norm[:, None]) @ keys[:, :d_v]
    return out, mx, lse


def sparse_fwd_bf16(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, *,
                    minus_one_is_key_0=False, base2=False, lonely_lse=math.inf):
    s_kv = kv.shape[0]
    rows = []
    for s in range(q.shape[0]):
        idx = indices[s, 0].tolist()
        n = len(idx) if topk_length is None else int(topk_length[s])
        if minus_one_is_key_0:
            idx = [0 if i == -1 else i for i in idx]
        rows.append([i for i in idx[:n] if 0 <= i < s_kv])
    out, mx, lse = _attend(q, kv[:, 0], rows, sm_scale, attn_sink, d_v)
    if base2:
        mx, lse = mx / LN2, lse / LN2
    lse = torch.where(torch.isinf(lse) & (lse > 0), lonely_lse, lse)
    return out.to(torch.bfloat16), mx.float(), lse.float()


def decode_bf16(q, k_cache, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None):
    """Decode each 656-byte row by hand (e4m3 × tile scale → bf16; bf16 RoPE), then attend."""
    rows = k_cache.reshape(-1, 656)
    nope = rows[:, :512].view(torch.float8_e4m3fn).float().view(-1, 4, 128)
    scales = rows[:, 512:528].contiguous().view(torch.float32).view(-1, 4, 1)
    rope = rows[:, 528:].contiguous().view(torch.bfloat16).float()
    kv = torch.cat([(nope * scales).reshape(-1, 512).to(torch.bfloat16).float(), rope], dim=1)
    b, s_q, h, _ = q.shape
    outs, lses = [], []
    for bi in range(b):
        n = indices.shape[2] if topk_length is None else int(topk_length[bi])
        rows_b = [[i for i in indices[bi, s, :n].tolist() if i != -1] for s in range(s_q)]
        out, _, lse = _attend(q[bi], kv, rows_b, sm_scale, attn_sink, d_v)
        outs.append(out)
        lses.append(lse.T)
    return torch.stack(outs).to(torch.bfloat16), torch.stack(lses).float()


def topk_tie_swapped(logits, row_starts, row_ends, topk):
    """Top-k by score descending, ties broken toward the HIGHER column (the oracle: lower)."""
    out = torch.full((logits.shape[0], topk), -1, dtype=torch.int32)
    for r in range(logits.shape[0]):
        s, e = int(row_starts[r]), int(row_ends[r])
        cols = list(range(s, e))
        if e - s > topk:
            cols = sorted(cols, key=lambda c: (-float(logits[r, c]), -c))[:topk]
        out[r, : len(cols)] = torch.tensor(cols, dtype=torch.int32) - s
    return out


def flip_byte(writer, at):
    def flipped(*args, **kwargs):
        out = writer(*args, **kwargs).clone()
        flat = out.view(torch.uint8).reshape(-1)
        flat[at] ^= 0x10
        return out
    return flipped


INDEPENDENT = {
    "hadamard_transform": hadamard_bf16,
    "fp8_mqa_logits": mqa_logits_bf16,
    "fp8_paged_mqa_logits": paged_logits_bf16,
    "flash_mla_sparse_fwd": sparse_fwd_bf16,
    "flash_mla_sparse_decode": decode_bf16,
}


# ------------------------------------------------------------------ passes
@pytest.mark.parametrize("contract", list(CONTRACTS))
def test_the_oracle_passes_its_own_contract(contract):
    report = check_kernel(contract, getattr(oracle, contract), cases=edges_only(contract) + 2)
    assert report.cases_run == edges_only(contract) + 2
    assert report.passed and set(report.worst) == set(make_case(contract, 0).checks)


@pytest.mark.parametrize("contract", list(INDEPENDENT))
def test_an_independent_bf16_rounded_kernel_passes(contract):
    report = check_kernel(contract, INDEPENDENT[contract], cases=edges_only(contract) + 1)
    assert report.passed


def test_tie_swapped_topk_passes_and_really_differs():
    case = make_case("topk_per_row", "ties_at_kth")
    assert not torch.equal(topk_tie_swapped(*case.args), oracle.topk_per_row(*case.args))
    assert check_kernel("topk_per_row", topk_tie_swapped, cases=10).passed


def test_inputs_move_to_the_device_and_outputs_come_back():
    case = make_case("act_quant", "ue8m0_scales")
    expected = oracle.act_quant(*case.args, **case.kwargs)
    seen = []

    def on_meta(*args, **kwargs):
        seen.extend(a.device.type for a in args if isinstance(a, torch.Tensor))
        return expected  # meta tensors carry no data: answer with the known result

    assert check_case(case, on_meta, device="meta")["x_fp8"].passed
    assert seen == ["meta"]


def test_keyword_tensors_move_to_the_device_too():
    """attn_sink and topk_length travel as keywords: they must reach the device with the rest."""
    case = make_case("flash_mla_sparse_fwd", "attn_sink")
    expected = oracle.flash_mla_sparse_fwd(*case.args, **case.kwargs)
    seen = []

    def on_meta(*args, **kwargs):
        seen.extend(v.device.type for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor))
        return tuple(t.to(torch.bfloat16) if i == 0 else t for i, t in enumerate(expected))

    check_case(case, on_meta, device="meta")
    assert "attn_sink" in case.kwargs and set(seen) == {"meta"}


# ------------------------------------------------------------------ mutants fail
MUTANTS = {
    "missing ReLU": ("fp8_mqa_logits", lambda *a, **k: mqa_logits_bf16(*a, **k, relu=False),
                     "calc_diff"),
    "off-by-one ke": ("fp8_mqa_logits", lambda *a, **k: mqa_logits_bf16(*a, **k, ke_shift=-1),
                      "calc_diff"),
    "double-applied scale": ("fp8_mqa_logits",
                             lambda *a, **k: mqa_logits_bf16(*a, **k, scale_power=2), "calc_diff"),
    "page-boundary off-by-one": ("fp8_paged_mqa_logits",
                                 lambda *a, **k: paged_logits_bf16(*a, **k, floor_pages=True),
                                 "calc_diff"),
    "base-2 lse": ("flash_mla_sparse_fwd", lambda *a, **k: sparse_fwd_bf16(*a, **k, base2=True),
                   "allclose"),
    "-1 as key 0": ("flash_mla_sparse_fwd",
                    lambda *a, **k: sparse_fwd_bf16(*a, **k, minus_one_is_key_0=True), "allclose"),
    "lonely lse swapped": ("flash_mla_sparse_fwd",
                           lambda *a, **k: sparse_fwd_bf16(*a, **k, lonely_lse=-math.inf),
                           "allclose"),
    "absolute top-k": ("topk_per_row",
                       lambda *a, **k: oracle.topk_per_row(*a, **k, base="absolute"), "topk_set"),
    "flipped MLA cache byte": ("quantize_k_cache", flip_byte(oracle.quantize_k_cache, 600),
                               "bitwise"),
    "flipped index-K cache byte": ("kv_cache_cast_to_fp8",
                                   flip_byte(oracle.kv_cache_cast_to_fp8, 8200), "bitwise"),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_planted_mutant_fails(mutant):
    contract, fn, metric = MUTANTS[mutant]
    with pytest.raises(AssertionError) as info:
        check_kernel(contract, fn, cases=edges_only(contract))
    first, *criteria, rebuild = str(info.value).splitlines()
    assert first.startswith(f"{contract} [case ") and f"fails {metric} on " in first
    assert criteria or metric in ("bitwise", "topk_set")  # one-criterion metrics have no others
    assert all(line.startswith(("  cause: ", "  clause: ", "  PASS ", "  FAIL ", "  hint: "))
               for line in criteria), criteria
    case = first.split("[case ", 1)[1].split("]", 1)[0]
    assert f"  clause: {clauses(contract)[case]}" in criteria  # an edge case says what it holds
    assert rebuild.startswith("  rebuild with glm_dsa.testing.make_case(")


def test_the_failure_names_case_metric_value_bound_and_element():
    contract, fn, _ = MUTANTS["missing ReLU"]
    with pytest.raises(AssertionError) as info:
        check_kernel(contract, fn, cases=edges_only(contract))
    message = str(info.value)
    assert "[case empty_window]" in message and re.search(r"calc_diff 0\.\d+ >= 3e-05", message)  # bf16 logits
    assert "largest error at (" in message
    rebuilt = eval(message.split("rebuild with ")[1], {"glm_dsa": __import__("glm_dsa")})
    with pytest.raises(AssertionError, match="calc_diff"):
        check_case(rebuilt, fn)


# ------------------------------------------------------------------ bad kernels, bad arguments
def raises(*args, **kwargs):
    raise RuntimeError("CUDA error: an illegal memory access\nsecond line")


@pytest.mark.parametrize("fn, problem", [
    (raises, "the kernel raised RuntimeError: CUDA error: an illegal memory access"),
    (lambda *a, **k: oracle.act_quant(*a, **k)[0], "the kernel returned (Tensor)"),
    (lambda *a, **k: (oracle.act_quant(*a, **k)[0][:1], oracle.act_quant(*a, **k)[1]),
     "output 'x_fp8' has shape"),
    (lambda *a, **k: (oracle.act_quant(*a, **k)[0].float(), oracle.act_quant(*a, **k)[1]),
     "output 'x_fp8' has dtype torch.float32"),
])
def test_a_broken_kernel_is_a_one_line_failure(fn, problem):
    with pytest.raises(AssertionError) as info:
        check_kernel("act_quant", fn, cases=1)
    assert problem in str(info.value) and "\n" not in str(info.value)


def test_unknown_contract_edge_case_or_shapes_is_a_value_error():
    with pytest.raises(ValueError, match="unknown contract 'mqa'"):
        check_kernel("mqa", oracle.act_quant)
    with pytest.raises(ValueError, match="no edge case 'nope'"):
        make_case("act_quant", "nope")
    with pytest.raises(ValueError, match="unknown shapes"):
        check_kernel("act_quant", oracle.act_quant, shapes="huge")


def test_pinned_options_reach_the_kernel_and_the_oracle():
    calls = []

    def sep2025(*args, **kwargs):
        calls.append((kwargs["lse_base"], kwargs["lonely_lse"]))
        return oracle.flash_mla_sparse_fwd(*args, **kwargs)

    check_kernel("flash_mla_sparse_fwd", sep2025, cases=5, lse_base="2", lonely_lse="-inf")
    assert set(calls) == {("2", "-inf")}

    def newest_only(*args, lse_base="e", lonely_lse="+inf", **kwargs):
        return oracle.flash_mla_sparse_fwd(*args, **kwargs)

    with pytest.raises(AssertionError, match="'max_logits' fails allclose"):
        check_kernel("flash_mla_sparse_fwd", newest_only, cases=5, lse_base="2")


# ------------------------------------------------------------------ CLI
missing_relu = MUTANTS["missing ReLU"][1]


def test_cli_check_passes_with_status_0(capsys):
    assert cli.main(["check", "glm_dsa.oracle:fp8_mqa_logits", "--contract", "fp8_mqa_logits",
                     "--cases", "8"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS  fp8_mqa_logits.logits  calc_diff: worst ")
    assert "(bound 5e-06) over 8 cases" in out[0]


def test_cli_check_fails_with_status_1(capsys):
    assert cli.main(["check", f"{__file__}:missing_relu", "--contract", "fp8_mqa_logits",
                     "--cases", "5", "--seed", "3"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("FAIL  fp8_mqa_logits.logits  calc_diff: calc_diff ")
    assert out[1].startswith("FAIL: fp8_mqa_logits [case ") and out[-1].startswith("  rebuild with")


@pytest.mark.parametrize("argv, error", [
    (["glm_dsa.oracle:act_quant", "--contract", "nope"], "unknown contract 'nope'"),
    (["no_such_module:f", "--contract", "act_quant"], "cannot import 'no_such_module'"),
    (["glm_dsa.oracle:nope", "--contract", "act_quant"], "has no attribute 'nope'"),
    (["glm_dsa.oracle", "--contract", "act_quant"], "must be MODULE:FUNCTION"),
])
def test_cli_usage_errors_are_one_line_with_status_2(capsys, argv, error):
    assert cli.main(["check", *argv]) == 2
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1


def test_cli_runs_as_a_command_without_traceback():
    run = subprocess.run([sys.executable, "-m", "glm_dsa.cli", "check", "glm_dsa.oracle:nope",
                          "--contract", "act_quant"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr


# ------------------------------------------------------------------ a kernel that misbehaves
def test_a_hanging_kernel_fails_at_the_timeout():
    never = threading.Event()

    def hangs(*args, **kwargs):
        never.wait(60)  # the worker is a daemon thread: it does not keep the run alive

    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"did not return within 0\.5 s .*--timeout"):
        check_kernel("act_quant", hangs, cases=1, timeout=0.5)
    assert time.monotonic() - start < 10
    never.set()


@pytest.mark.parametrize("code", [0, 3, None])
def test_a_kernel_calling_sys_exit_fails_with_the_reason(code):
    def exits(*args, **kwargs):
        sys.exit(code)

    with pytest.raises(AssertionError, match=rf"the kernel called sys\.exit\({code!r}\)"):
        check_kernel("act_quant", exits, cases=1)
    with pytest.raises(AssertionError, match=r"sys\.exit"):  # and on the calling thread too
        check_kernel("act_quant", exits, cases=1, timeout=None)


def test_a_kernel_writing_its_inputs_fails_even_with_right_outputs():
    def clobbers_q(q, kv, weights, ks, ke, **kwargs):
        out = oracle.fp8_mqa_logits(q, kv, weights, ks, ke, **kwargs)
        kv[1].mul_(2)  # the key scales, used as scratch after the result is computed
        return out

    with pytest.raises(AssertionError) as info:
        check_kernel("fp8_mqa_logits", clobbers_q, cases=1)
    assert "the kernel changed its input 'kv[1]' in place" in str(info.value)
    assert "\n" not in str(info.value)

    def nan_scratch(logits, row_starts, row_ends, topk, **kwargs):  # NaN bytes must compare too
        out = oracle.topk_per_row(logits, row_starts, row_ends, topk, **kwargs)
        logits[torch.isnan(logits)] = float("inf")
        return out

    with pytest.raises(AssertionError, match="changed its input 'logits'"):
        check_kernel("topk_per_row", nan_scratch, cases=1)


def test_a_pinned_convention_is_not_passed_to_a_kernel_without_that_parameter():
    def sep2025_builtin(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        return oracle.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                           lse_base="2", lonely_lse="-inf")

    report = check_kernel("flash_mla_sparse_fwd", sep2025_builtin, cases=8, lse_base="2",
                          lonely_lse="-inf")
    # The Sep-2025 kernel had no attn_sink / topk_length: those edge cases do not exist there.
    assert report.passed and report.cases_run == 6 and report.skipped == ["attn_sink", "topk_length"]
    with pytest.raises(AssertionError, match="'max_logits' fails allclose"):  # unpinned: base e due
        check_kernel("flash_mla_sparse_fwd", sep2025_builtin, cases=8)

    def no_sink(q, kv, indices, sm_scale, d_v=512, topk_length=None):
        return oracle.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, None, topk_length)

    with pytest.raises(AssertionError, match="the kernel takes no argument 'attn_sink', which this case sets"):
        check_kernel("flash_mla_sparse_fwd", no_sink, cases=8)


def test_a_timeout_that_is_not_positive_is_a_value_error():
    with pytest.raises(ValueError, match="timeout=0 must be a positive number"):
        check_kernel("act_quant", oracle.act_quant, timeout=0)


# ------------------------------------------------------------------ failure lines and hints
@pytest.mark.parametrize("fn, contract, lead, hint", [
    (lambda *a, **k: sparse_fwd_bf16(*a, **k, base2=True), "flash_mla_sparse_fwd",
     "elements: ", "base-2 lse"),
    (lambda *a, **k: sparse_fwd_bf16(*a, **k, lonely_lse=-math.inf), "flash_mla_sparse_fwd",
     "inf/NaN positions: +inf at 0 positions in the kernel", "lonely_lse='-inf'"),
    (lambda *a, **k: mqa_logits_bf16(*a, **k, ke_shift=-1), "fp8_mqa_logits",
     "finite inside the valid region: ", "off-by-one window: in"),
    (lambda *a, **k: mqa_logits_bf16(*a, **k, ke_shift=1), "fp8_mqa_logits",
     "-inf outside the valid region: ", "ends one column late"),
    (lambda q, kv, w, ks, ke, **k: (oracle.fp8_mqa_logits(q, kv, w, ks, ke, **k).double() * 1.25).float(),
     "fp8_mqa_logits", "calc_diff ", "a uniform scale error"),
    (lambda lg, s, e, k, **kw: torch.where(oracle.topk_per_row(lg, s, e, k, **kw) == 0, -1,
                                           oracle.topk_per_row(lg, s, e, k, **kw)),
     "topk_per_row", "rows as sets: ", None),
])
def test_a_failure_leads_with_its_criterion_and_names_the_pattern(fn, contract, lead, hint):
    with pytest.raises(AssertionError) as info:
        check_kernel(contract, fn, cases=edges_only(contract))
    first, *rest = str(info.value).splitlines()
    assert first.split(" on ", 1)[1].startswith(lead), first
    if hint is not None:
        assert any(line.startswith("  hint: ") and hint in line for line in rest), rest


def test_dropped_last_column_and_absolute_indices_are_named():
    def drops_last(logits, row_starts, row_ends, topk, **kwargs):
        return oracle.topk_per_row(logits, row_starts, (row_ends - 1).clamp(min=row_starts), topk, **kwargs)

    with pytest.raises(AssertionError, match=r"never select their last column \(row_end - 1\)"):
        check_kernel("topk_per_row", drops_last, cases=edges_only("topk_per_row"))
    with pytest.raises(AssertionError, match="the indices look like column numbers"):
        check_kernel("topk_per_row", MUTANTS["absolute top-k"][1], cases=edges_only("topk_per_row"))


def test_the_report_line_of_a_failure_shows_the_failing_criterion():
    report = run_checks("flash_mla_sparse_fwd", lambda *a, **k: sparse_fwd_bf16(*a, **k, lonely_lse=-math.inf),
                        cases=edges_only("flash_mla_sparse_fwd"))
    line = next(line for line in report.lines() if line.startswith("FAIL"))
    assert line.startswith("FAIL  flash_mla_sparse_fwd.lse  allclose: inf/NaN positions: +inf at 0 "
                           "positions in the kernel, ")
    assert line.endswith("at case lonely_row")


# ------------------------------------------------------------------ the case table holds its clauses
def test_every_edge_case_names_the_clause_it_holds():
    for contract in CONTRACTS:
        table = clauses(contract)
        assert set(table) == set(edge_case_names(contract)) and all(len(c) > 10 for c in table.values())
        assert make_case(contract, edge_case_names(contract)[0]).clause == table[edge_case_names(contract)[0]]


def _dedup_indices(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None, **kw):
    """A kernel that attends each distinct valid index once."""
    idx = indices.clone()
    for r in range(idx.shape[0]):
        seen = set()
        for j, v in enumerate(idx[r, 0].tolist()):
            if v in seen:
                idx[r, 0, j] = -1
            seen.add(v)
    return oracle.flash_mla_sparse_fwd(q, kv, idx, sm_scale, d_v, attn_sink, topk_length, **kw)


def test_a_kernel_that_deduplicates_repeated_indices_fails():
    with pytest.raises(AssertionError, match=r"\[case repeated_index\]"):
        check_kernel("flash_mla_sparse_fwd", _dedup_indices, cases=edges_only("flash_mla_sparse_fwd"))

    def dedup_transform(indices, offsets):
        out = oracle.topk_transform_ragged(indices, offsets)
        for r in range(out.shape[0]):
            row, seen = out[r].tolist(), set()
            out[r] = torch.tensor([-1 if v in seen or seen.add(v) else v for v in row])
        return out

    with pytest.raises(AssertionError, match=r"\[case repeated_index\](.|\n)*\n  hint: .*de-duplicated\?"):
        check_kernel("topk_transform_ragged", dedup_transform, cases=edges_only("topk_transform_ragged"))


# ------------------------------------------------------------------ CLI: loading, JSON, JUnit, device
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNEL_FILE = '''
from glm_dsa import oracle
def good(*args, **kwargs):
    return oracle.act_quant(*args, **kwargs)
def bad(*args, **kwargs):
    x, s = oracle.act_quant(*args, **kwargs)
    return x, s * 2
'''


def _console(argv, cwd, tmp_path):
    """glm-dsa as its console script runs: sys.path[0] is the script's own directory, not cwd."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "glm-dsa"
    script.write_text("import sys\nfrom glm_dsa.cli import main\nsys.exit(main())\n")
    env = {**os.environ, "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, str(script), *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_cli_check_loads_a_module_from_the_current_directory_and_a_file_path(tmp_path):
    work = tmp_path / "work"
    (work / "sub").mkdir(parents=True)
    (work / "mykernel.py").write_text(KERNEL_FILE)
    (work / "sub" / "other_kernel.py").write_text(KERNEL_FILE)
    run = _console(["check", "mykernel:good", "--contract", "act_quant", "--cases", "5"], work, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines()[-1] == ("PASS: mykernel:good matches act_quant on 5 cases "
                                           "(4 edge, 1 random), convention newest")
    run = _console(["check", "sub/other_kernel.py:bad", "--contract", "act_quant", "--cases", "5"],
                   work, tmp_path)
    assert run.returncode == 1 and "FAIL  act_quant.scale  bitwise: bitwise: " in run.stdout
    run = _console(["check", "nowhere:good", "--contract", "act_quant"], work, tmp_path)
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert "searched the current directory" in run.stderr and "path/to/nowhere.py:good" in run.stderr
    run = _console(["check", "./missing.py:good", "--contract", "act_quant"], work, tmp_path)
    assert run.returncode == 2 and "missing.py does not exist" in run.stderr


def test_cli_check_json_and_junit_xml(tmp_path, capsys):
    xml_path = tmp_path / "check.xml"
    argv = ["check", f"{REPO}/tests/test_testing.py:missing_relu", "--contract", "fp8_mqa_logits",
            "--cases", "6", "--json", "--junit-xml", str(xml_path)]
    assert cli.main(argv) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "glm-dsa.check/1" and report["passed"] is False
    assert report["outputs"]["logits"]["passed"] is False and report["cases_run"] == 1
    assert report["failure"].startswith("fp8_mqa_logits [case empty_window]")
    suite = ET.parse(xml_path).getroot().find("testsuite")
    assert suite.get("tests") == "1" and suite.get("failures") == "1"
    failure = suite.find("testcase").find("failure")
    assert failure.get("message").startswith("fp8_mqa_logits [case empty_window]: output 'logits'")
    assert cli.main(["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant", "--cases", "5",
                     "--json", "--junit-xml", str(xml_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and set(report["outputs"]) == {"x_fp8", "scale"}
    suite = ET.parse(xml_path).getroot().find("testsuite")
    # One testcase per case run (both outputs of a case judged together).
    assert suite.get("tests") == "5" and suite.get("failures") == "0"
    assert [tc.get("name") for tc in suite.iter("testcase")] == [
        f"act_quant.{c}" for c in (*edge_case_names("act_quant"), "random #0")]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
def test_cli_check_on_a_device_this_machine_lacks_is_a_usage_error(capsys):
    assert cli.main(["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant",
                     "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device cuda but torch sees no CUDA device; use --device cpu" in err and err.count("\n") == 1


def test_cli_check_timeout_flag(tmp_path, capsys):
    (tmp_path / "slow_kernel.py").write_text(
        "import time\ndef act_quant(*a, **k):\n    time.sleep(30)\n")
    assert cli.main(["check", f"{tmp_path}/slow_kernel.py:act_quant", "--contract", "act_quant",
                     "--cases", "1", "--timeout", "0.3"]) == 1
    assert "did not return within 0.3 s" in capsys.readouterr().out
    assert cli.main(["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant",
                     "--timeout", "-1"]) == 2


# ------------------------------------------------------------------ the harness checks itself
# FlashMLA's tests (9241ae3: tests/test_flash_mla_sparse_{prefill,decoding}.py) and DeepGEMM's
# (test_attention.py: calc_diff < 5e-6 on dequantized inputs), as published.
UPSTREAM = {
    "flash_mla_sparse_fwd": {"out": (8e-4, 3.01 / 128, 7e-6), "max_logits": (1e-6, 2.01 / 65536, 1e-7),
                             "lse": (1e-6, 2.01 / 65536, 1e-7)},
    "flash_mla_sparse_decode": {"out": (1e-3, 2.01 / 128, 5e-6), "lse": (1e-6, 8.01 / 65536, 1e-7)},
}


@pytest.mark.parametrize("contract, output", [(c, o) for c in UPSTREAM for o in UPSTREAM[c]])
def test_a_kernel_just_outside_a_relative_tolerance_fails_and_just_inside_passes(contract, output):
    abs_tol, rel_tol, cos_tol = UPSTREAM[contract][output]
    case = make_case(contract, "attn_sink")
    assert case.checks[output] == {"metric": "allclose", "abs_tol": abs_tol, "rel_tol": rel_tol,
                                   "cos_diff_tol": cos_tol}
    names = list(case.checks)
    expected = oracle.__dict__[contract](*case.args, **case.kwargs)

    i = names.index(output)
    ref = expected[i].double()
    big = ref.abs() > 2 * abs_tol / rel_tol  # where the relative tolerance decides
    if output != "out":  # lse / max_logits of order 1: every entry, the relative bound
        assert bool(big.any())
        bend = lambda t, f: torch.where(big, t * (1 + f * rel_tol), t)  # noqa: E731
    else:  # outputs of order 0.01: one small entry, the absolute bound
        at = int(ref.abs().reshape(-1).argmin())

        def bend(t, f):
            t = t.clone()
            t.reshape(-1)[at] += f * abs_tol
            return t

    def off_by(factor):
        def kernel(*args, **kwargs):
            out = list(oracle.__dict__[contract](*args, **kwargs))
            out[i] = bend(out[i].double(), factor).to(out[i].dtype)
            return tuple(out)
        return kernel

    assert check_case(case, off_by(0.5))[output].passed
    with pytest.raises(AssertionError, match=f"output '{output}' fails allclose on elements: "):
        check_case(case, off_by(1.5))


@pytest.mark.parametrize("contract", ["fp8_mqa_logits", "fp8_paged_mqa_logits"])
def test_a_kernel_just_outside_calc_diff_fails_and_just_inside_passes(contract):
    case = make_case(contract, edge_case_names(contract)[0])
    assert case.checks["logits"]["max"] == 5e-6 and case.checks["logits"]["max_bf16"] == 3e-5
    mask = case.aux["mask"]
    exp = oracle.__dict__[contract](*case.args, **case.kwargs).double()
    # calc_diff of x(1 + e·s) against x, s = ±1 alternating with zero mean, is e²/2 to first order.
    sign = torch.where(torch.arange(exp.numel()).view(exp.shape) % 2 == 0, 1.0, -1.0).double()
    for ratio, passes in ((0.8, True), (1.25, False)):
        eps = math.sqrt(2 * 5e-6 * ratio)
        bent = torch.where(mask, exp * (1 + eps * sign), exp).float()
        if passes:
            assert check_case(case, lambda *a, **k: bent)["logits"].passed
        else:
            with pytest.raises(AssertionError, match="fails calc_diff on calc_diff "):
                check_case(case, lambda *a, **k: bent)


def test_plus_inf_outside_the_cleaned_logits_mask_fails():
    case = make_case("fp8_mqa_logits", "empty_window")
    out = oracle.fp8_mqa_logits(*case.args, **case.kwargs)
    outside = (~case.aux["mask"]).nonzero()[0].tolist()
    for value in (float("inf"), float("nan"), 0.0):
        bad = out.clone()
        bad[tuple(outside)] = value
        with pytest.raises(AssertionError, match="-inf outside the valid region: 1 of"):
            check_case(case, lambda *a, **k: bad)


def test_a_top_k_index_at_the_row_end_fails():
    case = make_case("topk_per_row", "row_k_plus_1")
    logits, starts, ends, topk = case.args
    out = oracle.topk_per_row(*case.args)
    assert int(ends[0] - starts[0]) == topk + 1
    bad = out.clone()
    bad[0, 0] = int(ends[0] - starts[0])  # one past the row's last column
    with pytest.raises(AssertionError, match="an index outside the row's"):
        check_case(case, lambda *a, **k: bad)


def test_the_report_keeps_the_worst_case_per_output():
    """The report's worst value is the largest over the cases (each case checked on its own)."""
    fn = INDEPENDENT["flash_mla_sparse_fwd"]
    report = check_kernel("flash_mla_sparse_fwd", fn, cases=8)
    for name in ("out", "lse"):
        values = {}
        for which in list(edge_case_names("flash_mla_sparse_fwd")) + [0, 1]:
            case = make_case("flash_mla_sparse_fwd", which)
            values[case.name] = abs(check_case(case, fn)[name].value)
        worst = max(values, key=values.get)
        assert report.worst[name].value == values[worst] and report.worst[name].case == worst


# ------------------------------------------------------------------ case builders vs the contract
def test_edge_cases_hold_their_contract_clauses():
    """Each builder checked against the contract's own definition, computed here."""
    c = make_case("flash_mla_sparse_fwd", "lonely_row")
    s_kv = c.args[1].shape[0]
    idx = c.args[2][:, 0].long()
    valid = (idx >= 0) & (idx < s_kv)
    assert not bool(valid[1].any())  # row 1: no valid index at all
    assert 0 < int(valid[2].sum()) <= idx.shape[1] // 2  # row 2: half invalid
    c = make_case("flash_mla_sparse_fwd", "invalid_indices")
    row, s_kv = c.args[2][0, 0].tolist(), c.args[1].shape[0]
    assert all(v in row for v in (-(2**31), -123456, -1, s_kv, s_kv + 55, 2**31 - 1))
    c = make_case("flash_mla_sparse_decode", "lonely_entry")
    assert bool((c.args[2][1] == -1).all())
    for contract, edge in (("flash_mla_sparse_fwd", "repeated_index"), ("flash_mla_sparse_decode", "repeated_slot")):
        idx = make_case(contract, edge).args[2].reshape(-1, make_case(contract, edge).args[2].shape[-1])
        row = idx[0][idx[0] >= 0].tolist()
        assert max(row.count(v) for v in row) >= 6, contract
    # Ragged windows: extend row i of a request with prefix p sees keys [offset, offset + p + i + 1).
    requests = [(5, 3), (0, 4), (2, 2)]
    ks, ke, s_kv = cases_module.ragged_rows(requests)
    want_ks, want_ke, offset = [], [], 0
    for p, e in requests:
        for i in range(e):
            want_ks.append(offset)
            want_ke.append(offset + p + i + 1)
        offset += p + e
    assert ks.tolist() == want_ks and ke.tolist() == want_ke and s_kv == offset
    c = make_case("fp8_mqa_logits", "no_prefix")
    ks, ke = c.args[3], c.args[4]
    assert (ke - ks).tolist() == list(range(1, ks.numel() + 1))
    c = make_case("fp8_mqa_logits", "empty_window")
    assert int(c.args[4][0]) == int(c.args[3][0]) and int((c.args[4] - c.args[3])[1:].min()) >= 1
    for edge, length in (("row_shorter_than_k", -1), ("row_exactly_k", 0), ("row_k_plus_1", 1)):
        c = make_case("topk_per_row", edge)
        assert int(c.args[2][0] - c.args[1][0]) == c.args[3] + length, edge
    c = make_case("fp8_paged_mqa_logits", "context_63_64_65")
    assert c.args[3].tolist() == [63, 64, 65]


def test_cli_device_and_candidate_file_are_checked_before_any_work(tmp_path, capsys):
    assert cli.main(["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant", "--device", "meta"]) == 2
    assert "--device meta: only cpu and cuda[:N] are supported" in capsys.readouterr().err
    from safetensors.torch import save_file

    good = tmp_path / "c.safetensors"
    save_file({"act_quant.ue8m0_scales.scale": torch.ones(3, 4)}, str(good))
    data = good.read_bytes()
    golden = tmp_path / "golden"
    golden.mkdir()
    (golden / "manifest.json").write_text("{}")
    for cut in (1, 8):  # a file short of its header's last data offset by one byte up to 8
        short = tmp_path / f"short{cut}.safetensors"
        short.write_bytes(data[:-cut])
        assert cli.main(["compare", "--golden", str(golden), "--candidate", str(short)]) == 2
        assert f"is truncated: {len(data) - cut} bytes, its header needs {len(data)}" in capsys.readouterr().err
    n = int.from_bytes(data[:8], "little")
    for claimed in (len(data) - 7, len(data)):  # a header length past the file's end
        bad = tmp_path / f"header{claimed}.safetensors"
        bad.write_bytes(claimed.to_bytes(8, "little") + data[8:])
        assert cli.main(["compare", "--golden", str(golden), "--candidate", str(bad)]) == 2
        assert f"(header of {claimed} bytes in a {len(data)}-byte file)" in capsys.readouterr().err
    assert n < len(data) - 8
