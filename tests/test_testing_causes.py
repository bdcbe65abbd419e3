"""Failures that lead with their cause: each classic bug, planted in a kernel written here, fails
`check` with the cause the harness recomputes for it (and never with a wrong one); the byte
writers' failures say which region of the format differs; the worst element is named by the
failing criterion. And the small things a stranger trips over: a missing dependency named, a
refused output directory refused before the work, a closed pipe, pytest's traceback."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from glm_dsa import oracle
from glm_dsa.testing import check_kernel, edge_case_names
from glm_dsa.testing.metrics import CALC_DIFF_MAX_BF16
from test_testing import REPO, decode_bf16, mqa_logits_bf16, sparse_fwd_bf16  # noqa: E402

L2E = 1 / math.log(2)


def failure(contract, fn, cases=None):
    with pytest.raises(AssertionError) as info:
        check_kernel(contract, fn, cases=cases or len(edge_case_names(contract)) + 2)
    return str(info.value)


# ------------------------------------------------------------------ sparse MLA
def _drop_last_entry(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    idx = indices.clone()
    for s in range(idx.shape[0]):
        n = idx.shape[2] if topk_length is None else int(topk_length[s])
        if n:
            idx[s, 0, n - 1] = -1
    return sparse_fwd_bf16(q, kv, idx, sm_scale, d_v, attn_sink, topk_length)


def _clamped(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    s_kv = kv.shape[0]
    return sparse_fwd_bf16(q, kv, torch.where(indices >= s_kv, s_kv - 1, indices), sm_scale, d_v,
                           attn_sink, topk_length)


def _dedup(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    idx = indices.clone()
    for s in range(idx.shape[0]):
        row = idx[s, 0].tolist()
        idx[s, 0] = torch.tensor([-1 if v >= 0 and v in row[:j] else v for j, v in enumerate(row)])
    return sparse_fwd_bf16(q, kv, idx, sm_scale, d_v, attn_sink, topk_length)


def _scale_of_d_qk(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    return sparse_fwd_bf16(q, kv, indices, q.shape[-1] ** -0.5, d_v, attn_sink, topk_length)


def _no_sink(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    return sparse_fwd_bf16(q, kv, indices, sm_scale, d_v, None, topk_length)


def _sparse_scaled(f):
    def kernel(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        return sparse_fwd_bf16(q, kv, indices, f(sm_scale), d_v, attn_sink, topk_length)
    return kernel


def _no_lengths(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
    return sparse_fwd_bf16(q, kv, indices, sm_scale, d_v, attn_sink, None)


SPARSE_BUGS = {
    "the last key dropped": (_drop_last_entry, "each row's last index entry is skipped"),
    "-1 read as key 0": (lambda *a, **k: sparse_fwd_bf16(*a, **k, minus_one_is_key_0=True),
                         "-1 is read as key 0"),
    "an index past the end clamped": (_clamped, "an index >= s_kv is clamped to the last key"),
    "repeats de-duplicated": (_dedup, "repeated indices are de-duplicated"),
    "1/sqrt(d_qk) as the softmax scale": (_scale_of_d_qk, "scaled by 1/sqrt(d_qk) = 1/24"),
    "attn_sink ignored": (_no_sink, "attn_sink is ignored"),
    "sm_scale twice": (_sparse_scaled(lambda s: s * s), "sm_scale is applied twice"),
    "sm_scale left out": (_sparse_scaled(lambda s: 1.0), "sm_scale is not applied"),
    "exp2 without log2(e)": (_sparse_scaled(lambda s: s / math.log(2)),
                             "sm_scale is applied with exp2 but without the log2(e) factor"),
    "topk_length ignored": (_no_lengths, "topk_length is ignored"),
}


def _decode_with(indices_fn=lambda i: i, scale_fn=lambda s: s, sink=True, lengths=True):
    def kernel(q, k_cache, indices, sm_scale, d_v=512, topk_length=None, attn_sink=None):
        return decode_bf16(q, k_cache, indices_fn(indices), scale_fn(sm_scale), d_v,
                           topk_length if lengths else None, attn_sink if sink else None)
    return kernel


def _decode_dedup(indices):
    out = indices.clone()
    for row in out.view(-1, out.shape[-1]):
        seen: set[int] = set()
        for j, v in enumerate(row.tolist()):
            if v >= 0 and v in seen:
                row[j] = -1
            seen.add(v)
    return out


DECODE_BUGS = {
    "-1 read as slot 0": (_decode_with(indices_fn=lambda i: torch.where(i == -1, 0, i)),
                          "-1 is read as slot 0"),
    "repeats de-duplicated": (_decode_with(indices_fn=_decode_dedup), "repeated slots are de-duplicated"),
    "1/sqrt(d_qk)": (_decode_with(scale_fn=lambda s: 576**-0.5), "scaled by 1/sqrt(d_qk) = 1/24"),
    "attn_sink ignored": (_decode_with(sink=False), "attn_sink is ignored"),
    "topk_length ignored": (_decode_with(lengths=False), "topk_length is ignored"),
}


def test_a_wrong_softmax_scale_is_named_even_though_out_fails_first():
    """check stops at the first failing output (out); the cause is found over every output."""
    message = failure("flash_mla_sparse_fwd", _scale_of_d_qk)
    assert message.splitlines()[0].split("'")[1] == "out"
    assert "cause: the scores are scaled by 1/sqrt(d_qk) = 1/24" in message


def test_an_edge_case_failure_prints_the_clause_it_holds():
    message = failure("flash_mla_sparse_fwd", lambda *a, **k: sparse_fwd_bf16(
        *a, **k, minus_one_is_key_0=True))
    assert "[case invalid_indices]" in message.splitlines()[0]
    assert ("  clause: INT32_MIN, -123456, -1, s_kv, s_kv + 55, INT32_MAX are skipped"
            in message.splitlines())


# ------------------------------------------------------------------ indexer logits
LOGITS_BUGS = {
    "ReLU left out": (lambda *a, **k: mqa_logits_bf16(*a, **k, relu=False), "the ReLU is left out"),
    "key scale squared": (lambda *a, **k: mqa_logits_bf16(*a, **k, scale_power=2),
                          "the key scales are applied twice"),
    "key scale left out": (lambda *a, **k: mqa_logits_bf16(*a, **k, scale_power=0),
                           "the key scales are not applied"),
    "gates left out": (lambda q, kv, w, ks, ke, **k: mqa_logits_bf16(q, kv, torch.ones_like(w), ks,
                                                                     ke, **k),
                       "the head gates (weights) are not applied"),
}


BUGS = [(contract, bug, *entry) for contract, table in (
    ("flash_mla_sparse_fwd", SPARSE_BUGS), ("flash_mla_sparse_decode", DECODE_BUGS),
    ("fp8_mqa_logits", LOGITS_BUGS)) for bug, entry in table.items()]


@pytest.mark.parametrize("contract, bug, fn, cause", BUGS, ids=[f"{c}: {b}" for c, b, *_ in BUGS])
def test_a_kernel_bug_fails_with_its_cause_and_no_other(contract, bug, fn, cause):
    message = failure(contract, fn)
    causes = [line for line in message.splitlines() if line.startswith("  cause: ")]
    assert len(causes) == 1 and cause in causes[0], message
    assert "uniform scale error" not in message  # none of these is one scale


# ------------------------------------------------------------------ byte writers
def mla_row_writer(kv, scale_fmt="ue8m0", *, exponent="ceil", divide=False, scales_first=False):
    """FlashMLA's V32_FP8Sparse row, token by token from its description: four 128-tiles of e4m3
    (x / s), the four float32 s, then the 64 RoPE values as bf16."""
    nb, bs = kv.shape[:2]
    rows = []
    for token in kv.reshape(-1, 576):
        nope = token[:512].double().view(4, 128)
        amax = nope.abs().amax(1).float()
        if scale_fmt == "ue8m0":
            raw = (amax / 448.0 if divide else amax * torch.tensor(1 / 448.0)).clamp_min(1e-4)
            e = torch.log2(raw.double())
            s = torch.exp2(e.ceil() if exponent == "ceil" else e.round()).float()
        else:
            a = amax.clamp_min(1e-4)
            s = a / 448.0 if divide else a * torch.tensor(1 / 448.0)
        payload = (nope / s.double()[:, None]).clamp(-448, 448).float().to(torch.float8_e4m3fn)
        parts = [payload.view(torch.uint8).reshape(-1), s.view(torch.uint8),
                 token[512:].contiguous().view(torch.uint8)]
        if scales_first:
            parts[0], parts[1] = parts[1], parts[0]
        rows.append(torch.cat(parts))
    return torch.stack(rows).view(nb, bs, 1, 656)


def test_the_independent_row_writer_passes_bitwise():
    assert check_kernel("quantize_k_cache", mla_row_writer).passed


WRITER_BUGS = {
    "scales before the payload": (lambda kv, scale_fmt="ue8m0": mla_row_writer(
        kv, scale_fmt, scales_first=True),
        "the four float32 tile scales are written before the 512 FP8 bytes",
        "payload"),
    "round where ceil is due": (lambda kv, scale_fmt="ue8m0": mla_row_writer(
        kv, scale_fmt, exponent="round"), "the ue8m0 exponent is rounded to nearest", "scales"),
    "ue8m0 where float32 is due": (lambda kv, scale_fmt="ue8m0": mla_row_writer(kv, "ue8m0"),
                                   "your scales are powers of two (ue8m0) where float32", "scales"),
    "amax / 448 divided": (lambda kv, scale_fmt="ue8m0": mla_row_writer(kv, scale_fmt, divide=True),
                           "the scale is amax / 448 (a true division)", "scales"),
}


@pytest.mark.parametrize("bug", list(WRITER_BUGS))
def test_a_cache_writer_bug_fails_with_its_cause_and_the_region(bug):
    fn, cause, region = WRITER_BUGS[bug]
    message = failure("quantize_k_cache", fn, cases=12)
    assert f"cause: {cause}" in message, message
    regions = next(line for line in message.splitlines() if "bytes differing by region" in line)
    counts = dict(part.strip().split(" ", 1) for part in regions.split(": ", 1)[1].split(", "))
    assert not counts[region].startswith("0 of"), regions
    assert counts["rope"].startswith("0 of"), regions  # RoPE bytes are copied, never wrong here


def _act_quant_writer(scale_fmt_of, exponent="ceil", divide=False):
    """act_quant from DeepSeek-V3.2's description (amax × fl32(1/448), x / s), with the scale
    format chosen by ``scale_fmt_of(scale_fmt)``, the ue8m0 exponent rounded by ``exponent``
    and (``divide``) the scale taken as the quotient amax / 448."""
    def kernel(x, block_size=128, scale_fmt=None):
        blocks = x.float().view(*x.shape[:-1], -1, 128)
        amax = blocks.abs().amax(-1).clamp_min(1e-4)
        s = amax / 448.0 if divide else amax * torch.tensor(1 / 448.0)
        if scale_fmt_of(scale_fmt) == "ue8m0":
            e = torch.log2(s.double())
            s = torch.exp2(e.ceil() if exponent == "ceil" else e.round()).float()
        q = (blocks / s[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(x.shape)
        return q, s
    return kernel


def test_the_independent_act_quant_passes_bitwise():
    assert check_kernel("act_quant", _act_quant_writer(lambda f: f), cases=12).passed


ACT_QUANT_BUGS = {
    "always ue8m0": (_act_quant_writer(lambda f: "ue8m0"), "your scales are powers of two (ue8m0) "
                                                           "where float32"),
    "never ue8m0": (_act_quant_writer(lambda f: None), "your scales are float32 amax/448 where "
                                                       "power-of-two (ue8m0)"),
    "round for ceil": (_act_quant_writer(lambda f: f, exponent="round"),
                       "the ue8m0 exponent is rounded to nearest"),
    "amax / 448 divided": (_act_quant_writer(lambda f: f, divide=True),
                           "the scale is amax / 448 (a true division)"),
}


@pytest.mark.parametrize("bug", list(ACT_QUANT_BUGS))
def test_an_act_quant_bug_fails_with_its_cause(bug):
    fn, cause = ACT_QUANT_BUGS[bug]
    message = failure("act_quant", fn, cases=12)
    assert f"cause: {cause}" in message, message


def test_an_mla_writer_with_float32_where_ue8m0_is_due_is_named():
    message = failure("quantize_k_cache", lambda kv, scale_fmt="ue8m0": mla_row_writer(kv, None))
    assert "cause: your scales are float32 amax/448 where power-of-two (ue8m0)" in message


def test_an_index_k_writer_that_divides_is_named():
    def divided(k):
        nb, bs, _, d = k.shape
        x = k.float().reshape(nb, bs, d)
        sf = x.abs().amax(-1).clamp_min(1e-4) / 448.0
        payload = (x / sf[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
        pages = torch.cat([payload.reshape(nb, -1), sf.contiguous().view(torch.uint8).reshape(nb, -1)], 1)
        return pages.view(nb, bs, 1, d + 4)

    message = failure("kv_cache_cast_to_fp8", divided)
    assert "cause: the scale is amax / 448 and the payload x / scale (true divisions)" in message


def test_an_interleaved_index_k_page_is_named():
    def interleaved(k):
        out = oracle.kv_cache_cast_to_fp8(k)
        nb, bs, _, w = out.shape
        flat = out.reshape(nb, -1)
        payload = flat[:, : bs * (w - 4)].reshape(nb, bs, w - 4)
        scales = flat[:, bs * (w - 4):].reshape(nb, bs, 4)
        return torch.cat([payload, scales], dim=2).view(nb, bs, 1, w)

    message = failure("kv_cache_cast_to_fp8", interleaved)
    assert "cause: tokens are written as interleaved 132-byte rows" in message
    assert "bytes differing by region: payload" in message


# ------------------------------------------------------------------ where the error is
def test_largest_error_names_the_non_finite_element_not_two_matching_values():
    planted = []

    def one_minus_inf(q, kv, weights, ks, ke, **kwargs):
        out = oracle.fp8_mqa_logits(q, kv, weights, ks, ke, **kwargs).clone()
        planted.clear()
        if not kwargs:  # a cleaned [S, S_kv] output: one -inf mid-window in every row
            for r in (ke - ks >= 3).nonzero()[:, 0].tolist():
                c = (int(ks[r]) + int(ke[r])) // 2
                out[r, c] = -math.inf
                planted.append((r, c))
        return out

    message = failure("fp8_mqa_logits", one_minus_inf)
    calc_line = next(line for line in message.splitlines() if "largest error at" in line)
    r, c = planted[0]
    assert f"largest error at ({r}, {c}): -inf vs " in calc_line, calc_line
    assert "cause: overflow" not in message  # -inf alone is a mask, not an overflow


def test_an_allclose_failure_names_the_worst_element():
    def one_bad(*args, **kwargs):
        out, mx, lse = sparse_fwd_bf16(*args, **kwargs)
        out = out.clone()
        out[0, 0, 1] += 0.01  # just outside
        out[1, 2, 3] += 1.0  # far outside: the worst
        return out, mx, lse

    message = failure("flash_mla_sparse_fwd", one_bad)
    assert "worst at (1, 2, 3): " in message.splitlines()[0], message.splitlines()[0]


def test_natural_log_where_base_2_is_pinned_is_named():
    def natural_log(q, kv, indices, sm_scale, d_v=512, lse_base="e", lonely_lse="+inf"):
        return sparse_fwd_bf16(q, kv, indices, sm_scale, d_v, lonely_lse=float(lonely_lse))

    with pytest.raises(AssertionError) as info:  # takes lse_base="2" but ignores it
        check_kernel("flash_mla_sparse_fwd", natural_log, cases=8, convention="sep2025")
    assert "hint: every value is ln 2 = 0.6931 times the oracle's" in str(info.value)


def test_an_indexer_that_never_takes_the_last_position_gets_the_hint():
    from test_testing_conventions import paged_indexer

    def never_last(q, kv_cache, weights, context_lens, block_table, topk):
        """One-query rows rank positions [0, len - 1): the last one never taken."""
        if q.shape[1] == 1 and context_lens.dim() == 1 and bool((context_lens > topk + 1).all()):
            context_lens = context_lens - 1
        return paged_indexer(q, kv_cache, weights, context_lens, block_table, topk)

    message = failure("fp8_paged_mqa_topk", never_last, cases=30)
    assert "leave out their last position though it ranks in the top-k" in message, message


def test_the_uniform_scale_hint_needs_a_uniform_ratio():
    from glm_dsa.testing.metrics import check_tensor

    spec = {"metric": "allclose", "abs_tol": 1e-6, "rel_tol": 2.01 / 65536, "cos_diff_tol": 1e-7}
    exp = torch.linspace(1, 2, 50)
    assert "uniform scale" in check_tensor(spec, exp * 1.25, exp, {}.__getitem__).hint
    drifting = exp * (1 - 0.01 * torch.linspace(0, 1, 50))  # 0 to 1 % low: not one ratio
    assert "uniform scale" not in check_tensor(spec, drifting, exp, {}.__getitem__).hint


# ------------------------------------------------------------------ small things
def test_a_kernel_module_missing_a_dependency_names_the_dependency(tmp_path):
    from glm_dsa.testing.isolation import load_kernel

    pkg = tmp_path / "mykernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "fast.py").write_text("import not_installed_dependency_xyz\ndef f(): pass\n")
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(ValueError, match="cannot import 'mykernels.fast': it imports "
                                             "'not_installed_dependency_xyz', which is not installed"):
            load_kernel("mykernels.fast:f")
        with pytest.raises(ValueError, match="cannot import 'mykernels.slow': No module named"):
            load_kernel("mykernels.slow:f")
    finally:
        sys.path.remove(str(tmp_path))


def test_hf_model_without_transformers_names_the_install(monkeypatch):
    from glm_dsa.hf import hf_model

    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match=r"pip install -e '\.\[hf\]'"):
        hf_model(None)  # type: ignore[arg-type]


def test_golden_out_with_foreign_files_is_refused_before_any_case_is_computed(tmp_path, monkeypatch):
    from glm_dsa.testing import golden

    (tmp_path / "notes.txt").write_text("mine")
    monkeypatch.setattr(golden, "_write_golden_into", lambda *a: pytest.fail("computed first"))
    with pytest.raises(ValueError, match="holds notes.txt, which glm-dsa golden does not write"):
        golden.write_golden(tmp_path)


def test_a_closed_pipe_ends_the_command_quietly():
    proc = subprocess.Popen([sys.executable, "-m", "glm_dsa", "ledger", "--config", "tiny",
                             "--tokens", "1024", "--chunk", "256"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": REPO})
    proc.stdout.close()  # the reader is gone before the first line, as `| head -0`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_pytest_shows_the_callers_line_not_the_harness_frames(tmp_path):
    test = tmp_path / "test_kernel.py"
    test.write_text("from glm_dsa import oracle\nfrom glm_dsa.testing import check_kernel\n\n"
                    "def test_mine():\n"
                    "    check_kernel('act_quant', lambda *a, **k: (oracle.act_quant(*a, **k)[0], "
                    "oracle.act_quant(*a, **k)[1] * 2), cases=5)\n")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(test)], capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": REPO})
    assert run.returncode == 1
    assert "test_kernel.py:5" in run.stdout and "testing/check.py" not in run.stdout, run.stdout
    assert "E   " in run.stdout and "fails bitwise" in run.stdout


def test_the_bf16_logits_bound_is_documented():
    text = open(os.path.join(REPO, "docs", "oracle.md")).read()
    assert CALC_DIFF_MAX_BF16 == 3e-5 and "`< 3e-5` for bf16 logits" in text


# ------------------------------------------------------------------ seeds, timeouts, manifests
@pytest.mark.parametrize("argv, error", [
    (["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant", "--seed", "-1"],
     "--seed=-1 must be an int from 0 to 2**63 - 1"),
    (["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant", "--timeout", "inf"],
     "--timeout inf must be a positive number of seconds, finite"),
    (["golden", "--out", "unused_dir", "--seed", str(2**64)],
     f"--seed={2**64} must be an int from 0 to 2**63 - 1"),
])
def test_seeds_and_timeouts_out_of_range_are_one_line_errors(argv, error, capsys, tmp_path,
                                                              monkeypatch):
    from glm_dsa import cli

    monkeypatch.chdir(tmp_path)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert error in err and err.count("\n") == 1, err
    assert not (tmp_path / "unused_dir").exists()
    with pytest.raises(ValueError, match="seed=-1 must be an int"):
        check_kernel("act_quant", oracle.act_quant, seed=-1)
    with pytest.raises(ValueError, match="timeout=inf must be a positive number of seconds, finite"):
        check_kernel("act_quant", oracle.act_quant, timeout=math.inf)


def test_a_manifest_naming_a_file_outside_its_directory_is_refused(tmp_path):
    """The manifest's own sha256 is no guard here (whoever edits it can recompute it): a files
    entry must be a file name beside the manifest."""
    import json

    from glm_dsa.testing import golden

    golden.write_golden(tmp_path / "g")
    (tmp_path / "over").mkdir()
    (tmp_path / "over" / "act_quant.safetensors").write_bytes(
        (tmp_path / "g" / "act_quant.safetensors").read_bytes())
    path = tmp_path / "g" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["files"]["../over/act_quant.safetensors"] = manifest["files"].pop("act_quant.safetensors")
    manifest["manifest_sha256"] = golden._manifest_digest(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"its files entry '\.\./over/act_quant\.safetensors' is "
                                         r"not a file name in"):
        golden.load_golden(tmp_path / "g")
