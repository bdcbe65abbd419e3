"""Golden vectors and `glm-dsa compare`: reproducible files, and a comparison that passes the
golden outputs and kernel-style variants of them (bf16 rounding, reordered or tie-swapped top-k,
garbage where logits are uncleaned) but fails one corrupted element in any output, an
off-by-one mask, base-2 lse where base e is due, and the old lonely-row lse convention.

Candidates that should pass are computed here independently of the oracle where that is the
point (float32 einsum logits on dequantized inputs, as DeepGEMM's reference does); candidates
that should fail are the golden outputs with one defect planted.
"""

from __future__ import annotations

import json
import math
import os
import re

import pytest
import torch
from safetensors.torch import save_file

from glm_dsa import oracle
from glm_dsa.cli import main
from glm_dsa.golden import MANIFEST, check_outputs, compare, format_report, load_golden, write_golden

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
    assert contracts == {
        "hadamard_transform", "act_quant", "kv_cache_cast_to_fp8", "fp8_mqa_logits",
        "fp8_paged_mqa_logits", "topk_per_row", "topk_transform_ragged", "topk_transform_paged",
        "quantize_k_cache", "dequantize_k_cache", "flash_mla_sparse_fwd", "flash_mla_sparse_decode",
    }

    def heads(contract, dim):
        return {golden[f"{c['contract']}.{c['case']}.q"].shape[dim]
                for c in manifest["cases"] if c["contract"] == contract}

    assert heads("fp8_mqa_logits", 1) == {32, 64}
    assert heads("fp8_paged_mqa_logits", 2) == {32, 64}
    assert heads("flash_mla_sparse_fwd", 1) == {64, 128}
    assert heads("flash_mla_sparse_decode", 2) == {64, 128}
    # A prefix: some row sees more keys than the request has query rows.
    ks, ke = golden["fp8_mqa_logits.glm.cu_seqlen_ks"], golden["fp8_mqa_logits.glm.cu_seqlen_ke"]
    assert int((ke - ks).max()) > ks.shape[0]
    assert golden["fp8_mqa_logits.glm.kv_fp8"].shape[0] % 64 != 0
    assert any(int(n) % 64 for n in golden["fp8_paged_mqa_logits.glm_1d.context_lens"])
    # Invalid indices of every kind, and lonely rows (lse +inf) in prefill and decode.
    idx = golden["flash_mla_sparse_fwd.glm.indices"]
    s_kv = golden["flash_mla_sparse_fwd.glm.kv"].shape[0]
    for bad in (-(2**31), -123456, -1, s_kv, 2**31 - 1):
        assert bool((idx == bad).any())
    assert bool(torch.isposinf(golden["flash_mla_sparse_fwd.glm.lse"]).any())
    assert bool(torch.isposinf(golden["flash_mla_sparse_decode.glm.lse"]).any())
    # Short rows in the top-k input (fewer keys than topk) and rows with none at all.
    lens = golden["topk_per_row.sglang.row_ends"] - golden["topk_per_row.sglang.row_starts"]
    assert bool((lens < 64).any()) and bool((lens == 0).any())
    total = sum(info["bytes"] for info in manifest["files"].values())
    assert total < 8_000_000
    on_disk = json.loads((golden_dir / MANIFEST).read_text())
    assert on_disk == manifest


def test_golden_outputs_are_the_oracle_on_the_golden_inputs(loaded):
    """Spot check: the stored expected output is the oracle's output for the stored call."""
    manifest, golden = loaded
    c = case_of(manifest, "fp8_paged_mqa_logits", "dsv32_2d")
    p = "fp8_paged_mqa_logits.dsv32_2d."
    got = oracle.fp8_paged_mqa_logits(golden[p + "q"], golden[p + "kv_cache"], golden[p + "weights"],
                                      golden[p + "context_lens"], golden[p + "block_table"],
                                      **c["args"])
    assert torch.equal(got, golden[p + "logits"])
    c = case_of(manifest, "flash_mla_sparse_fwd", "glm_sink_topk_length")
    p = "flash_mla_sparse_fwd.glm_sink_topk_length."
    out = oracle.flash_mla_sparse_fwd(golden[p + "q"], golden[p + "kv"], golden[p + "indices"],
                                      attn_sink=golden[p + "attn_sink"],
                                      topk_length=golden[p + "topk_length"], **c["args"])
    for name, t in zip(("out", "max_logits", "lse"), out):
        assert torch.equal(t, golden[p + name])


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
        t.reshape(-1)[at] = -t.reshape(-1)[at]
    elif metric == "topk_set":
        t[0, 0] = t[0, 1]  # row 0 is a long row: now one index is repeated
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


@pytest.mark.parametrize("name", ["fp8_mqa_logits.glm.logits", "fp8_paged_mqa_logits.glm_1d.logits"])
def test_compare_fails_an_off_by_one_mask(loaded, name):
    _, golden = loaded
    expected, mask = golden[name], golden[name + "_mask"]
    row = int((mask.any(dim=1) & ~mask[:, -1]).nonzero()[-1])  # valid columns end before the last
    end = int(mask[row].nonzero()[-1]) + 1  # one past its last valid column
    short = expected.clone()
    short[row, end - 1] = float("-inf")
    long = expected.clone()
    long[row, end] = 1.0
    assert verdicts(loaded, {name: short}) == {name: False}
    assert verdicts(loaded, {name: long}) == {name: False}


def test_compare_ignores_uncleaned_entries_outside_the_mask_but_not_inside(loaded):
    name = "fp8_mqa_logits.glm_uncleaned.logits"
    _, golden = loaded
    mask = golden[name + "_mask"]
    garbage = torch.where(mask, golden[name], torch.full_like(golden[name], 3e38))
    garbage[~mask.roll(1, dims=1) & ~mask] = float("nan")
    assert verdicts(loaded, {name: garbage}) == {name: True}
    hole = golden[name].clone()
    hole[mask.nonzero()[0].tolist()] = float("-inf")
    assert verdicts(loaded, {name: hole}) == {name: False}


def test_compare_fails_base_2_lse_and_the_old_lonely_row_convention(loaded):
    manifest, golden = loaded
    p = "flash_mla_sparse_fwd.glm."
    args = {k: v for k, v in case_of(manifest, "flash_mla_sparse_fwd", "glm")["args"].items()
            if k not in ("lse_base", "lonely_lse")}
    inputs = (golden[p + "q"], golden[p + "kv"], golden[p + "indices"])
    names = [p + "out", p + "max_logits", p + "lse"]
    base2 = oracle.flash_mla_sparse_fwd(*inputs, **args, lse_base="2", lonely_lse="+inf")
    assert verdicts(loaded, dict(zip(names, base2))) == {
        p + "out": True, p + "max_logits": False, p + "lse": False}
    old_lonely = oracle.flash_mla_sparse_fwd(*inputs, **args, lse_base="e", lonely_lse="-inf")
    assert verdicts(loaded, dict(zip(names, old_lonely))) == {
        p + "out": True, p + "max_logits": True, p + "lse": False}
    # And the September-2025 case wants base 2: the newest convention fails it.
    p = "flash_mla_sparse_fwd.glm_sep2025."
    lse_e = golden[p + "lse"].clone()
    finite = torch.isfinite(lse_e)
    lse_e[finite] = lse_e[finite] / LOG2E
    assert verdicts(loaded, {p + "lse": lse_e}) == {p + "lse": False}


def test_compare_passes_kernel_style_outputs(loaded):
    manifest, golden = loaded
    # Sparse attention and Hadamard outputs rounded to bf16, as the kernels return them.
    rounded = {n: golden[n].to(torch.bfloat16) for n in outputs_of(manifest)
               if n.endswith(".out") and (n.startswith("flash_mla") or n.startswith("hadamard"))}
    assert len(rounded) == 9 and all(verdicts(loaded, rounded).values())
    # DeepGEMM's reference formula on the dequantized inputs, in float32 einsum.
    p = "fp8_mqa_logits.dsv32."
    q, k = golden[p + "q"].float(), golden[p + "kv_fp8"].float() * golden[p + "kv_scale"][:, None]
    score = torch.einsum("mhd,nd->hmn", q, k).relu() * golden[p + "weights"].t()[:, :, None]
    logits = score.sum(dim=0)
    col = torch.arange(k.shape[0])
    visible = (col >= golden[p + "cu_seqlen_ks"][:, None]) & (col < golden[p + "cu_seqlen_ke"][:, None])
    logits = logits.masked_fill(~visible, float("-inf"))
    assert verdicts(loaded, {p + "logits": logits}) == {p + "logits": True}


def test_compare_treats_top_k_as_sets_with_equal_scores_interchangeable(loaded):
    _, golden = loaded
    name = "topk_per_row.sglang.indices"
    expected, scores = golden[name], golden["topk_per_row.sglang.logits"]
    start = golden["topk_per_row.sglang.row_starts"]
    shuffled = expected[:, torch.randperm(expected.shape[1], generator=torch.Generator().manual_seed(0))]
    assert verdicts(loaded, {name: shuffled}) == {name: True}
    # Row 1 has eight score levels: swap a selected column for an unselected one of equal score.
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
    name = "act_quant.glm_q_ue8m0.scale"
    assert verdicts(loaded, {name: golden[name][:-1]}) == {name: False}
    with pytest.raises(ValueError, match="not golden outputs"):
        compare(golden_dir, {"act_quant.glm_q_ue8m0.scales": golden[name]})


# ----------------------------------------------------------------------------- CLI
def test_cli_golden_and_compare_exit_with_the_verdict(golden_dir, tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["golden", "--out", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert "flash_mla_sparse_fwd.safetensors" in printed and "27 cases" in printed
    _, golden = load_golden(golden_dir)
    good = tmp_path / "good.safetensors"
    save_file({"fp8_mqa_logits.glm.logits": golden["fp8_mqa_logits.glm.logits"]}, str(good))
    assert main(["compare", "--golden", str(golden_dir), "--candidate", str(good)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("PASS  fp8_mqa_logits.glm.logits  calc_diff: calc_diff 0 < 5e-06")
    assert "1 checked: 1 passed, 0 failed" in printed
    bad_lse = golden["flash_mla_sparse_fwd.dsv32.lse"] * LOG2E
    bad = tmp_path / "bad.safetensors"
    save_file({"flash_mla_sparse_fwd.dsv32.lse": bad_lse}, str(bad))
    assert main(["compare", "--golden", str(golden_dir), "--candidate", str(bad)]) == 1
    assert capsys.readouterr().out.startswith("FAIL  flash_mla_sparse_fwd.dsv32.lse  allclose:")
    assert main(["compare", "--golden", str(tmp_path / "none"), "--candidate", str(good)]) == 2
    assert "manifest.json not found" in capsys.readouterr().err


def test_compare_line_shows_the_deciding_values_beside_their_bounds(loaded):
    """An allclose line leads with the element test (count outside both tolerances, and the
    worst element in units of its bound) and cos_diff against its bound; max abs / rel errors,
    which decide nothing alone, come last as information."""
    manifest, golden = loaded
    name = "flash_mla_sparse_fwd.glm.out"
    line = format_report(check_outputs(manifest, golden, {name: golden[name].to(torch.bfloat16)})).splitlines()[0]
    m = re.search(r"allclose: 0 of (\d+) elements outside both abs 0\.0008 and rel 0\.02352 "
                  r"\(worst element ([\d.e+-]+) of its bound, fails at ≥ 1\); cos_diff ([\d.e+-]+) ≤ 7e-06; "
                  r"info: max abs err", line)
    assert line.startswith("PASS") and m, line
    assert float(m.group(2)) < 1 and float(m.group(3)) <= 7e-6
