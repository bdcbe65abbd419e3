"""Golden vectors and `glm-dsa compare`: reproducible files holding exactly the case table's
cases, and a comparison that passes the golden outputs and kernel-style variants of them (bf16
rounding, reordered or tie-swapped top-k, garbage where logits are uncleaned) but fails one
corrupted element in any output, an off-by-one mask, base-2 lse where base e is due, the old
lonely-row lse convention, and a manifest whose tolerances were loosened by hand.

Candidates that should pass are computed here independently of the oracle where that is the
point (float32 einsum logits on dequantized inputs, as DeepGEMM's reference does); candidates
that should fail are the golden outputs with one defect planted.
"""

from __future__ import annotations

import json
import math
import os
import re
import xml.etree.ElementTree as ET

import pytest
import torch
from safetensors.torch import save_file

from glm_dsa import oracle
from glm_dsa.cli import main
from glm_dsa.testing import make_case
from glm_dsa.testing.cases import CONVENTIONS, clauses, edge_case_names
from glm_dsa.testing.check import expected_outputs
from glm_dsa.testing.golden import (
    GOLDEN_SHAPES,
    MANIFEST,
    RANDOM_CASES,
    check_outputs,
    compare,
    format_report,
    load_cases,
    load_golden,
    write_golden,
)

LOG2E = 1 / math.log(2)


@pytest.fixture(scope="module")
def golden_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("golden")
    write_golden(path, seed=0)
    return path


@pytest.fixture(scope="module")
def loaded(golden_dir):
    return load_golden(golden_dir)


def outputs_of(manifest) -> dict[str, dict]:
    return {name: spec for case in manifest["cases"] for name, spec in case["outputs"].items()}


def case_of(manifest, contract: str, case: str) -> dict:
    return next(c for c in manifest["cases"] if c["contract"] == contract and c["case"] == case)


def verdicts(loaded, candidate) -> dict[str, bool]:
    manifest, golden = loaded
    return {c.name: c.passed for c in check_outputs(manifest, golden, candidate).checks}


# ----------------------------------------------------------------------------- files
def test_golden_files_are_byte_identical_when_regenerated_with_the_same_seed(golden_dir, tmp_path):
    write_golden(tmp_path / "again", seed=0)
    write_golden(tmp_path / "other", seed=1)
    names = sorted(os.listdir(golden_dir))
    assert names == sorted(os.listdir(tmp_path / "again"))
    for name in names:
        assert (golden_dir / name).read_bytes() == (tmp_path / "again" / name).read_bytes(), name
    assert (golden_dir / "fp8_mqa_logits.safetensors").read_bytes() != (
        tmp_path / "other" / "fp8_mqa_logits.safetensors").read_bytes()


def test_golden_set_covers_the_contracts_head_counts_and_edge_cases(loaded, golden_dir):
    manifest, golden = loaded
    contracts = {c["contract"] for c in manifest["cases"]}
    assert contracts == set(CONTRACTS_ALL)

    def heads(contract, dim):
        return {golden[f"{c['contract']}.{c['case']}.q"].shape[dim]
                for c in manifest["cases"] if c["contract"] == contract}

    assert heads("fp8_mqa_logits", 1) == {32, 64}
    assert heads("fp8_paged_mqa_logits", 2) == {32, 64}
    assert heads("fp8_paged_mqa_topk", 2) == {32, 64}
    assert heads("fp8_mqa_topk", 1) == {32, 64}
    # The indexer's real ranges: act_quant payloads reach e4m3's 448 in queries and keys.
    for contract in ("fp8_mqa_logits", "fp8_paged_mqa_logits", "fp8_mqa_topk", "fp8_paged_mqa_topk"):
        q_max = max(float(golden[f"{c['contract']}.{c['case']}.q"].float().abs().max())
                    for c in manifest["cases"] if c["contract"] == contract)
        assert q_max == 448.0, contract
    assert heads("flash_mla_sparse_fwd", 1) == {64, 128}
    assert heads("sparse_mla_q8kv8_prefill_fwd", 1) == {64, 128}
    assert heads("flash_mla_sparse_decode", 2) == {64, 128}
    # The MX indexer logits: both formats at the index heads; the bf16 decode at h16.
    mx = [c for c in manifest["cases"] if c["contract"] == "fp8_fp4_mqa_logits"]
    assert {golden[f"fp8_fp4_mqa_logits.{c['case']}.q[0]"].dtype for c in mx} == {torch.int8, torch.float8_e4m3fn}
    assert {golden[f"fp8_fp4_mqa_logits.{c['case']}.q[0]"].shape[1] for c in mx} == {32, 64}
    assert heads("flash_mla_sparse_decode_bf16", 2) == {16}
    # A prefix: some row sees more keys than the request has query rows.
    assert any(int((golden[f"fp8_mqa_logits.{c}.cu_seqlen_ke"] - golden[f"fp8_mqa_logits.{c}.cu_seqlen_ks"]).max())
               > golden[f"fp8_mqa_logits.{c}.q"].shape[0] for c in ("random_0", "uncleaned", "compressed"))
    assert any(golden[f"fp8_mqa_logits.{c['case']}.kv[0]"].shape[0] % 64
               for c in manifest["cases"] if c["contract"] == "fp8_mqa_logits")
    assert any(int(n) % 64 for n in golden["fp8_paged_mqa_logits.context_63_64_65.context_lens"])
    # Invalid indices of every kind, and lonely rows (lse +inf) in prefill and decode.
    idx = golden["flash_mla_sparse_fwd.invalid_indices.indices"]
    s_kv = golden["flash_mla_sparse_fwd.invalid_indices.kv"].shape[0]
    for bad in (-(2**31), -123456, -1, s_kv, s_kv + 55, 2**31 - 1):
        assert bool((idx == bad).any())
    assert bool(torch.isposinf(golden["flash_mla_sparse_fwd.lonely_row.lse"]).any())
    assert bool(torch.isposinf(golden["flash_mla_sparse_decode.lonely_entry.lse"]).any())
    # A valid index listed more than once, in prefill, decode and both index transforms.
    for name in ("flash_mla_sparse_fwd.repeated_index.indices", "flash_mla_sparse_decode.repeated_slot.indices",
                 "topk_transform_ragged.repeated_index.indices", "topk_transform_paged.repeated_index.indices"):
        row = golden[name].reshape(-1, golden[name].shape[-1])[0]
        valid = row[row >= 0]
        assert valid.unique().numel() < valid.numel(), name
    # Short rows in the top-k input (fewer keys than topk) and rows with none at all.
    lens = golden["topk_per_row.row_shorter_than_k.row_ends"] - golden["topk_per_row.row_shorter_than_k.row_starts"]
    assert bool((lens < 64).any())
    lens = golden["topk_per_row.empty_row.row_ends"] - golden["topk_per_row.empty_row.row_starts"]
    assert bool((lens == 0).any())
    total = sum(info["bytes"] for info in manifest["files"].values())
    # /2 holds every edge case at GLM-5.3 / DeepSeek-V3.2 head counts (128 MLA heads): ~21 MB.
    assert total < 32_000_000
    on_disk = json.loads((golden_dir / MANIFEST).read_text())
    assert on_disk == manifest


def test_golden_cases_are_the_case_tables_edge_and_random_cases(loaded):
    """One case table: every edge case of every contract (and each convention's), plus the random
    cases, are on disk with the inputs make_case builds — the two cannot drift apart."""
    manifest, golden = loaded
    want = set()
    for contract in CONTRACTS_ALL:
        want |= {(contract, e) for e in edge_case_names(contract)}
        want |= {(contract, f"random_{i}") for i in range(RANDOM_CASES)}
        for conv in CONVENTIONS.get(contract, {}):
            want |= {(contract, f"{conv}_{e}") for e in edge_case_names(contract)
                     if e not in NOT_IN_CONVENTION.get(conv, ())}
    assert {(c["contract"], c["case"]) for c in manifest["cases"]} == want
    for case, _ in load_cases(manifest, golden):
        entry = case_of(manifest, case.contract, case.name)
        which = case.name.removeprefix(f"{entry['convention']}_") if entry["convention"] else case.name
        which = int(which[len("random_"):]) if which.startswith("random_") else which
        options = CONVENTIONS[case.contract][entry["convention"]] if entry["convention"] else {}
        built = make_case(case.contract, which, seed=manifest["seed"], shapes=GOLDEN_SHAPES, **options)
        flat = lambda xs: [t for x in xs for t in (x if isinstance(x, tuple) else (x,))]  # noqa: E731
        assert sorted(case.kwargs) == sorted(built.kwargs), case.name
        kwargs = sorted(case.kwargs)
        for a, b in zip(flat(case.args) + flat([case.kwargs[k] for k in kwargs]),
                        flat(built.args) + flat([built.kwargs[k] for k in kwargs])):
            same = (a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))
                    if isinstance(a, torch.Tensor) else a == b)  # bytes: NaN garbage is data here
            assert same, case.name
        assert entry["clause"] == clauses(case.contract).get(which, "")


# FlashMLA's Sep-2025 kernel (c28eca9) has no attn_sink and no topk_length argument.
NOT_IN_CONVENTION = {"sep2025": ("attn_sink", "topk_length"),
                     "flashinfer": ("attn_sink", "topk_length", "unread_nan")}

CONTRACTS_ALL = (
    "hadamard_transform", "act_quant", "kv_cache_cast_to_fp8", "kv_cache_cast_to_fp4", "fp8_mqa_logits",
    "fp8_paged_mqa_logits", "fp8_mqa_topk", "fp8_paged_mqa_topk", "topk_per_row", "topk_transform_ragged",
    "topk_transform_paged",
    "quantize_k_cache", "dequantize_k_cache", "flash_mla_sparse_fwd", "sparse_mla_q8kv8_prefill_fwd",
    "flash_mla_sparse_decode", "kv_cache_cast_to_mxfp8", "fp8_fp4_mqa_logits", "fp8_fp4_paged_mqa_logits",
    "flash_mla_sparse_decode_bf16",
)


def test_golden_outputs_are_the_oracle_on_the_golden_inputs(loaded):
    """The stored expected outputs are the oracle's outputs for the stored call, every case."""
    manifest, golden = loaded
    for case, expected in load_cases(manifest, golden):
        for (name, want), got in zip(expected.items(), expected_outputs(case)):
            assert torch.equal(got, want), name
    c = case_of(manifest, "fp8_paged_mqa_logits", "context_lens_2d")
    p = "fp8_paged_mqa_logits.context_lens_2d."
    assert c["call"] == ("fp8_paged_mqa_logits(q, kv_cache, weights, context_lens, block_table, "
                         f"{c['args'][5]['value']})")
    got = oracle.fp8_paged_mqa_logits(golden[p + "q"], golden[p + "kv_cache"], golden[p + "weights"],
                                      golden[p + "context_lens"], golden[p + "block_table"],
                                      c["args"][5]["value"])
    assert torch.equal(got, golden[p + "logits"])


def test_load_golden_rejects_a_modified_file(golden_dir, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in os.listdir(golden_dir):
        (copy / name).write_bytes((golden_dir / name).read_bytes())
    data = bytearray((copy / "topk_per_row.safetensors").read_bytes())
    data[-1] ^= 1
    (copy / "topk_per_row.safetensors").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="sha256"):
        load_golden(copy)


def _copy(golden_dir, dest):
    dest.mkdir()
    for name in os.listdir(golden_dir):
        (dest / name).write_bytes((golden_dir / name).read_bytes())
    return dest


def test_a_loosened_manifest_is_refused_not_obeyed(golden_dir, tmp_path, loaded):
    """Garbage must not pass by an edited tolerance: a hand edit breaks the manifest's own
    sha256, and a re-signed edit differs from the case table's tolerance."""
    from glm_dsa.testing.golden import _manifest_digest

    name = "flash_mla_sparse_fwd.invalid_indices.out"
    copy = _copy(golden_dir, tmp_path / "loose")
    manifest = json.loads((copy / MANIFEST).read_text())
    entry = case_of(manifest, "flash_mla_sparse_fwd", "invalid_indices")
    entry["outputs"][name]["cos_diff_tol"] = 10.0
    entry["outputs"][name]["abs_tol"] = 1e9
    (copy / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    garbage = {name: torch.zeros_like(loaded[1][name])}
    with pytest.raises(ValueError, match="edited after it was written"):
        compare(copy, garbage)
    manifest["manifest_sha256"] = _manifest_digest(manifest)
    (copy / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True))
    with pytest.raises(ValueError, match="differs from glm-dsa's case table"):
        compare(copy, garbage)
    assert not compare(golden_dir, garbage).passed


# ----------------------------------------------------------------------------- compare
def test_compare_passes_the_golden_outputs_themselves(loaded):
    manifest, golden = loaded
    names = outputs_of(manifest)
    report = check_outputs(manifest, golden, {n: golden[n] for n in names})
    assert report.passed and len(report.checks) == len(names) and report.not_in_candidate == ()


def _corrupt_one(name: str, spec: dict, golden) -> torch.Tensor:
    """The golden output with one element spoiled."""
    t = golden[name].clone()
    metric = spec["metric"]
    if metric == "bitwise":
        t.reshape(-1).view(torch.uint8)[0] ^= 1
    elif metric in ("calc_diff", "allclose"):
        usable = torch.isfinite(t)
        if metric == "calc_diff":
            usable &= golden[spec["mask"]]
        at = torch.where(usable, t.abs(), -1.0).reshape(-1).argmax()
        value = t.reshape(-1)[at]
        t.reshape(-1)[at] = -value if value != 0 else 1.0  # an all-zero output gets a 1
    elif metric == "topk_set":
        pad = spec["pad"]
        r = next(r for r in range(t.shape[0]) if int((t[r] != pad).sum()) >= 2)
        cols = (t[r] != pad).nonzero()[:, 0]
        t[r, cols[0]] = t[r, cols[1]]  # a row with two selections: now one index is repeated
    else:
        t[0, 0] += 1
    return t


def test_compare_fails_one_corrupted_element_in_every_output(loaded):
    manifest, golden = loaded
    specs = outputs_of(manifest)
    for name, spec in specs.items():
        bad = _corrupt_one(name, spec, golden)
        assert not torch.equal(bad, golden[name]), name
        assert verdicts(loaded, {name: bad}) == {name: False}, name


@pytest.mark.parametrize("name", ["fp8_mqa_logits.no_prefix.logits",
                                  "fp8_paged_mqa_logits.context_63_64_65.logits"])
def test_compare_fails_an_off_by_one_mask(loaded, name):
    _, golden = loaded
    expected, mask = golden[name], golden[name.removesuffix("logits") + "mask"]
    row = int((mask.any(dim=1) & ~mask[:, -1]).nonzero()[-1])  # valid columns end before the last
    end = int(mask[row].nonzero()[-1]) + 1  # one past its last valid column
    short = expected.clone()
    short[row, end - 1] = float("-inf")
    long = expected.clone()
    long[row, end] = 1.0
    assert verdicts(loaded, {name: short}) == {name: False}
    assert verdicts(loaded, {name: long}) == {name: False}


def test_compare_ignores_uncleaned_entries_outside_the_mask_but_not_inside(loaded):
    name = "fp8_mqa_logits.uncleaned.logits"
    _, golden = loaded
    mask = golden[name.removesuffix("logits") + "mask"]
    garbage = torch.where(mask, golden[name], torch.full_like(golden[name], 3e38))
    garbage[~mask.roll(1, dims=1) & ~mask] = float("nan")
    assert verdicts(loaded, {name: garbage}) == {name: True}
    hole = golden[name].clone()
    hole[mask.nonzero()[0].tolist()] = float("-inf")
    assert verdicts(loaded, {name: hole}) == {name: False}


def test_compare_fails_base_2_lse_and_the_old_lonely_row_convention(loaded):
    manifest, golden = loaded
    p = "flash_mla_sparse_fwd.lonely_row."
    case = next(c for c, _ in load_cases(manifest, golden) if c.name == "lonely_row"
                and c.contract == "flash_mla_sparse_fwd")
    assert "lse_base" not in case.kwargs and "lonely_lse" not in case.kwargs
    names = [p + "out", p + "max_logits", p + "lse"]
    base2 = oracle.flash_mla_sparse_fwd(*case.args, **case.kwargs, lse_base="2", lonely_lse="+inf")
    assert verdicts(loaded, dict(zip(names, base2))) == {
        p + "out": True, p + "max_logits": False, p + "lse": False}
    old_lonely = oracle.flash_mla_sparse_fwd(*case.args, **case.kwargs, lse_base="e", lonely_lse="-inf")
    assert verdicts(loaded, dict(zip(names, old_lonely))) == {
        p + "out": True, p + "max_logits": True, p + "lse": False}
    # And the September-2025 cases want base 2: the newest convention fails them.
    p = "flash_mla_sparse_fwd.sep2025_lonely_row."
    lse_e = golden[p + "lse"].clone()
    finite = torch.isfinite(lse_e)
    lse_e[finite] = lse_e[finite] / LOG2E
    assert verdicts(loaded, {p + "lse": lse_e}) == {p + "lse": False}


def test_compare_passes_kernel_style_outputs(loaded):
    manifest, golden = loaded
    # Sparse attention and Hadamard outputs rounded to bf16, as the kernels return them.
    rounded = {n: golden[n].to(torch.bfloat16) for n in outputs_of(manifest)
               if n.endswith(".out") and (n.startswith("flash_mla") or n.startswith("hadamard"))}
    assert len(rounded) > 20 and all(verdicts(loaded, rounded).values())
    # DeepGEMM's reference formula on the dequantized inputs, in float32 einsum.
    p = "fp8_mqa_logits.no_prefix."
    assert golden[p + "q"].shape[1] in (32, 64)
    q, k = golden[p + "q"].float(), golden[p + "kv[0]"].float() * golden[p + "kv[1]"][:, None]
    score = torch.einsum("mhd,nd->hmn", q, k).relu() * golden[p + "weights"].t()[:, :, None]
    logits = score.sum(dim=0)
    col = torch.arange(k.shape[0])
    visible = (col >= golden[p + "cu_seqlen_ks"][:, None]) & (col < golden[p + "cu_seqlen_ke"][:, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    assert verdicts(loaded, {p + "logits": logits}) == {p + "logits": True}


def test_compare_treats_top_k_as_sets_with_equal_scores_interchangeable(loaded):
    _, golden = loaded
    name = "topk_per_row.ties_at_kth.indices"
    expected, scores = golden[name], golden["topk_per_row.ties_at_kth.logits"]
    start = golden["topk_per_row.ties_at_kth.row_starts"]
    shuffled = expected[:, torch.randperm(expected.shape[1], generator=torch.Generator().manual_seed(0))]
    assert verdicts(loaded, {name: shuffled}) == {name: True}
    # Every row has eight score levels: swap a selected column for an unselected one of equal score.
    row = expected[1].tolist()
    vals = scores[1].tolist()
    kth = min(vals[i + int(start[1])] for i in row)
    unselected = [j for j in range(len(vals)) if vals[j] == kth and j not in row]
    swapped = expected.clone()
    swapped[1, next(i for i, v in enumerate(row) if vals[v] == kth)] = unselected[0]
    assert verdicts(loaded, {name: swapped}) == {name: True}
    lower = next(j for j in range(len(vals)) if vals[j] < kth)
    wrong = expected.clone()
    wrong[1, next(i for i, v in enumerate(row) if vals[v] == kth)] = lower
    assert verdicts(loaded, {name: wrong}) == {name: False}


def test_compare_reports_shape_mismatches_and_rejects_unknown_names(loaded, golden_dir):
    _, golden = loaded
    name = "act_quant.ue8m0_scales.scale"
    assert verdicts(loaded, {name: golden[name][:-1]}) == {name: False}
    with pytest.raises(ValueError, match="not golden outputs"):
        compare(golden_dir, {"act_quant.ue8m0_scales.scales": golden[name]})


# ----------------------------------------------------------------------------- CLI
def test_cli_golden_and_compare_exit_with_the_verdict(golden_dir, tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["golden", "--out", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    manifest, golden = load_golden(golden_dir)
    assert "flash_mla_sparse_fwd.safetensors" in printed and f"{len(manifest['cases'])} cases" in printed
    good = tmp_path / "good.safetensors"
    save_file({"fp8_mqa_logits.no_prefix.logits": golden["fp8_mqa_logits.no_prefix.logits"]}, str(good))
    assert main(["compare", "--golden", str(golden_dir), "--candidate", str(good)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("PASS  fp8_mqa_logits.no_prefix.logits  calc_diff: finite inside the valid region: 0 of")
    assert "calc_diff 0 < 5e-06" in printed and "1 checked: 1 passed, 0 failed" in printed
    bad_lse = golden["flash_mla_sparse_fwd.invalid_indices.lse"] * LOG2E
    bad = tmp_path / "bad.safetensors"
    save_file({"flash_mla_sparse_fwd.invalid_indices.lse": bad_lse}, str(bad))
    assert main(["compare", "--golden", str(golden_dir), "--candidate", str(bad)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("FAIL  flash_mla_sparse_fwd.invalid_indices.lse  allclose: elements: ")
    assert any("hint: every value is 1/ln 2 = 1.4427 times the oracle's" in line for line in lines)
    assert main(["compare", "--golden", str(tmp_path / "none"), "--candidate", str(good)]) == 2
    assert "manifest.json not found" in capsys.readouterr().err


def test_compare_line_shows_the_deciding_values_beside_their_bounds(loaded):
    """An allclose line leads with the element test (count outside both tolerances, and the
    worst element in units of its bound) and cos_diff against its bound; max abs / rel errors,
    which decide nothing alone, come last as information."""
    manifest, golden = loaded
    name = "flash_mla_sparse_fwd.invalid_indices.out"
    line = format_report(check_outputs(manifest, golden, {name: golden[name].to(torch.bfloat16)})).splitlines()[0]
    m = re.search(r"allclose: elements: 0 of (\d+) outside both abs 0\.0008 and rel 0\.02352 "
                  r"\(worst element ([\d.e+-]+) of its bound, fails at >= 1\); cos_diff ([\d.e+-]+) <= 7e-06 "
                  r"\(info: max abs err", line)
    assert line.startswith("PASS") and m, line
    assert float(m.group(2)) < 1 and float(m.group(3)) <= 7e-6


# ----------------------------------------------------------------------------- compare --kernel
def test_compare_runs_a_kernel_over_the_golden_inputs(golden_dir, capsys, tmp_path):
    from glm_dsa.testing.golden import compare_kernel

    report = compare_kernel(golden_dir, oracle.topk_per_row)  # the contract from the name
    names = {c.name for c in report.checks}
    assert report.passed and "topk_per_row.tilelang_offset_rows.indices" in names
    assert len(names) == len(edge_case_names("topk_per_row")) * 2 + RANDOM_CASES

    def sep2025_builtin(q, kv, indices, sm_scale, d_v=512, attn_sink=None, topk_length=None):
        return oracle.flash_mla_sparse_fwd(q, kv, indices, sm_scale, d_v, attn_sink, topk_length,
                                           lse_base="2", lonely_lse="-inf")

    # A kernel without the convention's keywords is judged by the convention it is run under.
    report = compare_kernel(golden_dir, sep2025_builtin, contracts=("flash_mla_sparse_fwd",),
                            convention="sep2025")
    assert report.passed and report.conventions == ("sep2025",)
    assert {c.name.split(".")[1].split("_")[0] for c in report.checks} == {"sep2025"}
    report = compare_kernel(golden_dir, sep2025_builtin, contracts=("flash_mla_sparse_fwd",))
    verdict = {c.name: c.passed for c in report.checks}
    assert not verdict["flash_mla_sparse_fwd.lonely_row.lse"]
    assert "flash_mla_sparse_fwd.sep2025_lonely_row.lse" not in verdict
    assert report.conventions == ("newest",) and "lse_base" in dict(report.not_run)["sep2025"]
    with pytest.raises(ValueError, match="cannot tell which contract"):
        compare_kernel(golden_dir, sep2025_builtin)

    xml_path = tmp_path / "compare.xml"
    assert main(["compare", "--golden", str(golden_dir), "--kernel", "glm_dsa.oracle:act_quant",
                 "--json", "--junit-xml", str(xml_path)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["schema"] == "glm-dsa.compare/1" and printed["passed"]
    assert len(printed["checks"]) == 2 * (len(edge_case_names("act_quant")) + RANDOM_CASES)
    suite = ET.parse(xml_path).getroot().find("testsuite")
    # One testcase per golden case (its two outputs judged together).
    assert suite.get("tests") == str(len(printed["checks"]) // 2) and suite.get("failures") == "0"
    assert {tc.get("name") for tc in suite.iter("testcase")} == {
        c["name"].rsplit(".", 1)[0] for c in printed["checks"]}
    kernel = tmp_path / "k.py"
    kernel.write_text("from glm_dsa import oracle\n"
                      "def scaled(*a, **k):\n    x, s = oracle.act_quant(*a, **k)\n    return x, s * 2\n")
    assert main(["compare", "--golden", str(golden_dir), "--kernel", f"{kernel}:scaled",
                 "--contract", "act_quant"]) == 1
    out = capsys.readouterr().out
    assert "FAIL  act_quant.ue8m0_scales.scale" in out and "PASS  act_quant.ue8m0_scales.x_fp8" in out
    assert main(["compare", "--golden", str(golden_dir), "--kernel", f"{kernel}:scaled"]) == 2
    assert "name it with --contract" in capsys.readouterr().err
