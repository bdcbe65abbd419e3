"""`glm-dsa check FILE.py:FUNCTION --definition DEF.json`: flashinfer-bench definitions mapped to
the contracts (input splitting, slot outputs, base-2 lse, -inf lonely rows, -1 the only padding),
cases at the definition's constant axes, outputs judged by name, the definition's own reference
measured against the oracle, and definitions no contract covers refused in one line.

The definition files in tests/definitions/ are this project's own, written in the schema
(name, op_type, axes, inputs, outputs, reference). The kernels below are written here from the
definitions' descriptions (flashinfer-bench's kernel signatures: inputs positionally, outputs
returned), independently of the oracle; the planted bugs are those kernels with one change.
"""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from glm_dsa.cli import main
from glm_dsa.testing import edge_case_names, make_case
from glm_dsa.testing.definitions import (
    check_definition,
    definition_cases,
    definition_map,
    load_definition,
    positions_of_slots,
)

HERE = os.path.dirname(__file__)
DEFS = os.path.join(HERE, "definitions")
INDEXER = os.path.join(DEFS, "dsa_topk_indexer_fp8_h64_d128_topk2048_ps64.json")
ATTENTION_PS64 = os.path.join(DEFS, "dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64.json")
ATTENTION_PS1 = os.path.join(DEFS, "dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps1.json")


# ------------------------------------------------------------------ kernels, flashinfer-shaped
def dsa_topk_indexer(q_index_fp8, k_index_cache_fp8, weights, seq_lens, block_table,
                     *, drop_last=False, positions=False):
    """Per request: dequantized keys of its pages, float32 ReLU scores gated per head, the top
    2048 as physical slots (page * 64 + offset), -1 padded. Keywords plant one bug each."""
    page = k_index_cache_fp8.view(torch.uint8)
    nb, bs, _, width = page.shape
    d = width - 4
    raw = page.reshape(nb, -1)
    keys = (raw[:, : bs * d].contiguous().view(torch.float8_e4m3fn).float().view(nb, bs, d)
            * raw[:, bs * d:].contiguous().view(torch.float32).view(nb, bs, 1)).reshape(nb * bs, d)
    out = torch.full((q_index_fp8.shape[0], 2048), -1, dtype=torch.int32)
    for b in range(q_index_fp8.shape[0]):
        n = int(seq_lens[b]) - drop_last
        slots = (block_table[b].long()[:, None] * bs + torch.arange(bs)).reshape(-1)[:n]
        score = (torch.relu(q_index_fp8[b].float() @ keys[slots].T) * weights[b].float()[:, None]).sum(0)
        best = score.topk(min(2048, n)).indices
        out[b, : best.numel()] = (best if positions else slots[best]).to(torch.int32)
    return (out,)


def dsa_sparse_attention(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, sm_scale,
                         *, natural_log=False, lonely_plus_inf=False, minus_one_is_row_0=False):
    """Gather the listed rows of the paged caches, softmax in base 2 (exp2 of scores times
    log2 e), bf16 output, float32 base-2 lse, -inf where a row lists no valid index."""
    ckv = ckv_cache.reshape(-1, ckv_cache.shape[-1]).float()
    kpe = kpe_cache.reshape(-1, kpe_cache.shape[-1]).float()
    idx = sparse_indices.long()
    if minus_one_is_row_0:
        idx = idx.clamp_min(0)
    valid = idx >= 0
    rows = idx.clamp_min(0)
    s = (torch.einsum("thd,tkd->thk", q_nope.float(), ckv[rows])
         + torch.einsum("thd,tkd->thk", q_pe.float(), kpe[rows])) * (sm_scale / math.log(2))
    s = s.masked_fill(~valid[:, None, :], -math.inf)
    m = s.amax(-1, keepdim=True).clamp_min(-1e30)
    p = torch.exp2(s - m)
    total = p.sum(-1)
    out = torch.einsum("thk,tkd->thd", p, ckv[rows]) / total.clamp_min(1e-30)[..., None]
    lse = m[..., 0] + torch.log2(total)
    if natural_log:
        lse = lse * math.log(2)
    lonely = ~valid.any(-1)
    lse = lse.masked_fill(lonely[:, None], math.inf if lonely_plus_inf else -math.inf)
    return out.masked_fill(lonely[:, None, None], 0.0).to(torch.bfloat16), lse


# ------------------------------------------------------------------ passing
@pytest.mark.parametrize("path", [ATTENTION_PS64, ATTENTION_PS1], ids=["ps64", "ps1"])
def test_a_flashinfer_shaped_sparse_attention_kernel_passes_its_definition(path):
    report, reference = check_definition(load_definition(path), dsa_sparse_attention, cases=7,
                                         against_reference=True)
    assert report.passed, report.failure
    assert report.convention == f"definition {os.path.basename(path)[:-5]}"
    assert set(report.worst) == {"out", "lse"} and report.skipped == ["attn_sink", "topk_length"]
    assert len(reference) == 2 and all(" 5 of 5 cases within" in line for line in reference)


def test_a_flashinfer_shaped_indexer_kernel_passes_its_definition():
    report, reference = check_definition(load_definition(INDEXER), dsa_topk_indexer, cases=6,
                                         against_reference=True)
    assert report.passed, report.failure
    assert report.skipped == ["mtp_rows"]  # two queries per request: the definition has one
    assert reference[0].startswith("REFERENCE  dsa_topk_indexer_fp8_h64_d128_topk2048_ps64"
                                   ".topk_indices  topk_margin: 5 of 5 cases within")


def test_cases_are_built_at_the_definitions_constant_axes_in_its_convention():
    defn = load_definition(ATTENTION_PS64)
    cases, _ = definition_cases(defn, cases=7)
    m = definition_map(defn)
    for case in cases:
        q, kv, indices, _ = case.args
        assert q.shape[1] == 16 and indices.shape[-1] == 2048
        assert bool(((indices == -1) | ((indices >= 0) & (indices < kv.shape[0]))).all())
        assert case.kwargs == {"lse_base": "2", "lonely_lse": "-inf"}
        inputs = m.to_inputs(case, defn.axes)
        assert inputs["ckv_cache"].shape[1:] == (64, 512) and inputs["kpe_cache"].shape[1:] == (64, 64)
    indexer, _ = definition_cases(load_definition(INDEXER), cases=6)
    assert all(c.args[0].shape[1:3] == (1, 64) and c.args[5] == 2048 for c in indexer)


def test_slots_map_back_to_positions_through_the_block_table():
    # Block 0 is used and also fills the table's unused tail: a slot in it is its first entry.
    table = torch.tensor([[5, 2, 0, 0, 0]], dtype=torch.int32)
    slots = torch.tensor([[5 * 64 + 3, 2 * 64 + 63, -1, 7 * 64, 0 * 64 + 9]])
    assert positions_of_slots(slots, table, 64).tolist() == [[3, 127, -1, 2**31 - 1, 2 * 64 + 9]]


# ------------------------------------------------------------------ planted bugs
def _failure(path, fn):
    report, _ = check_definition(load_definition(path), fn, cases=7)
    assert not report.passed
    return report.failure


def test_natural_log_lse_fails_naming_the_definitions_convention():
    message = _failure(ATTENTION_PS64, lambda *a: dsa_sparse_attention(*a, natural_log=True))
    assert message.splitlines()[0].startswith(
        "dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps64 [case invalid_indices]: output 'lse' fails allclose")
    # The case has no lonely row, so a natural-log kernel is FlashMLA's newest convention there.
    assert ("  cause: the kernel follows convention 'newest' (the newest defaults); the "
            "definition's is lse_base='2', lonely_lse='-inf'") in message
    assert "hint: every value is ln 2 = 0.6931 times the oracle's" in message


def test_plus_inf_for_a_lonely_row_fails_with_the_hint():
    message = _failure(ATTENTION_PS64, lambda *a: dsa_sparse_attention(*a, lonely_plus_inf=True))
    assert "[case lonely_row]: output 'lse' fails allclose on inf/NaN positions" in message
    assert "hint: lonely rows: the kernel gives +inf where the pinned convention gives -inf" in message


def test_minus_one_read_as_row_0_fails_with_its_cause():
    message = _failure(ATTENTION_PS1, lambda *a: dsa_sparse_attention(*a, minus_one_is_row_0=True))
    assert "  cause: -1 is read as key 0" in message


def test_an_indexer_that_never_ranks_the_last_position_fails_with_its_cause():
    message = _failure(INDEXER, lambda *a: dsa_topk_indexer(*a, drop_last=True))
    assert "  cause: each row's last key is never ranked" in message


def test_an_indexer_returning_positions_where_slots_are_due_fails():
    message = _failure(INDEXER, lambda *a: dsa_topk_indexer(*a, positions=True))
    assert "fails topk_margin on top-k members" in message.splitlines()[0]


def test_a_kernel_returning_one_output_of_two_fails_its_case():
    message = _failure(ATTENTION_PS64, lambda *a: dsa_sparse_attention(*a)[0])
    assert "the kernel returned (Tensor); the definition returns 2 tensor(s) (output, lse)" in message


# ------------------------------------------------------------------ refusals and the command
def _write(tmp_path, **changes):
    defn = json.load(open(ATTENTION_PS64))
    defn.update(changes)
    path = tmp_path / "def.json"
    path.write_text(json.dumps(defn))
    return str(path)


@pytest.mark.parametrize("changes, error", [
    ({"name": "gemm_n128_k2048", "op_type": "gemm",
      "axes": {"m": {"type": "var"}, "n": {"type": "const", "value": 128},
               "k": {"type": "const", "value": 2048}},
      "inputs": {"A": {"shape": ["m", "k"], "dtype": "bfloat16"},
                 "B": {"shape": ["n", "k"], "dtype": "bfloat16"}},
      "outputs": {"C": {"shape": ["m", "n"], "dtype": "bfloat16"}}},
     "definition 'gemm_n128_k2048' (op_type gemm) maps to no glm-dsa contract; the DSA "
     "definitions glm-dsa checks: dsa_topk_indexer"),
    ({"axes": {**json.load(open(ATTENTION_PS64))["axes"], "head_dim_ckv": {"type": "const", "value": 256}}},
     "axis 'head_dim_ckv' is 256; flash_mla_sparse_fwd needs the constant 512 there"),
    ({"reference": None, "op_type": None, "type": None}, "lacks"),
])
def test_a_definition_no_contract_covers_is_refused_in_one_line(tmp_path, capsys, changes, error):
    path = _write(tmp_path, **changes)
    if changes.get("reference", "") is None:
        raw = json.loads(open(path).read())
        for key in ("reference", "op_type", "type"):
            raw.pop(key)
        open(path, "w").write(json.dumps(raw))
    assert main(["check", "tests/test_testing_2026_definitions.py:dsa_sparse_attention",
                 "--definition", path]) == 2
    err = capsys.readouterr().err.strip()
    assert error in err and len(err.splitlines()) == 1, err


def test_the_command_checks_a_kernel_against_a_definition(capsys):
    assert main(["check", "tests/test_testing_2026_definitions.py:dsa_topk_indexer",
                 "--definition", INDEXER, "--cases", "5", "--against-reference"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("REFERENCE  dsa_topk_indexer_fp8_h64_d128_topk2048_ps64.topk_indices")
    assert out[1].startswith("PASS  fp8_paged_mqa_topk.indices  topk_margin: worst ")
    assert out[-1] == ("PASS: tests/test_testing_2026_definitions.py:dsa_topk_indexer matches "
                       "dsa_topk_indexer_fp8_h64_d128_topk2048_ps64 on 4 cases (3 edge, 1 random), "
                       "convention definition dsa_topk_indexer_fp8_h64_d128_topk2048_ps64")


def test_contract_and_definition_together_are_refused(capsys):
    with pytest.raises(SystemExit):
        main(["check", "tests/test_testing_2026_definitions.py:dsa_sparse_attention",
              "--definition", ATTENTION_PS64, "--contract", "flash_mla_sparse_fwd"])
    assert "not allowed with argument" in capsys.readouterr().err


@pytest.mark.parametrize("argv, error", [
    (["--convention", "sep2025"], "--convention does not go with --definition"),
    (["--shapes", "h16"], "--shapes does not go with --definition"),
])
def test_definition_flags_that_conflict_are_refused(capsys, argv, error):
    assert main(["check", "tests/test_testing_2026_definitions.py:dsa_sparse_attention",
                 "--definition", ATTENTION_PS64, *argv]) == 2
    assert error in capsys.readouterr().err


def test_against_reference_needs_a_definition(capsys):
    assert main(["check", "glm_dsa.oracle:act_quant", "--contract", "act_quant",
                 "--against-reference"]) == 2
    assert "--against-reference goes with --definition" in capsys.readouterr().err


def test_a_definition_check_that_runs_no_case_fails(monkeypatch, capsys):
    """Every case beyond what the definition can state: no case ran, and that is no pass."""
    from glm_dsa.testing import definitions

    names = ["context_shorter_than_k", "random #0"]
    monkeypatch.setattr(definitions, "definition_cases", lambda defn, cases, seed: ([], names))
    report, reference = check_definition(load_definition(INDEXER), dsa_topk_indexer, against_reference=True)
    assert not report.passed and report.cases_run == 0 and reference == []
    assert report.failure == ("dsa_topk_indexer_fp8_h64_d128_topk2048_ps64: no case ran; the definition "
                              "cannot state any of fp8_paged_mqa_topk's cases")
    assert main(["check", "tests/test_testing_2026_definitions.py:dsa_topk_indexer",
                 "--definition", INDEXER]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAIL: dsa_topk_indexer_fp8_h64_d128_topk2048_ps64: no case ran")


@pytest.mark.parametrize("topk", [1, 3, 5])
def test_a_definition_with_a_small_topk_builds_every_edge_case(tmp_path, topk):
    """A definition's top-k below the eight or nine entries an edge case writes (the invalid
    indices at flat 3..8, a row's repeated pairs at odd length) builds its cases: they crashed in
    case generation (a size mismatch) at top-k 1 and 3."""
    axes = {**json.load(open(ATTENTION_PS1))["axes"], "topk": {"type": "const", "value": topk}}
    path = tmp_path / "def.json"
    path.write_text(json.dumps({**json.load(open(ATTENTION_PS1)), "axes": axes,
                                "name": f"dsa_sparse_attention_h16_ckv512_kpe64_topk{topk}_ps1"}))
    report, _ = check_definition(load_definition(str(path)), dsa_sparse_attention, cases=6)
    assert report.passed, report.failure


@pytest.mark.parametrize("contract", ["flash_mla_sparse_fwd", "flash_mla_sparse_decode",
                                      "flash_mla_sparse_decode_bf16"])
@pytest.mark.parametrize("topk", [1, 3])
def test_sparse_edge_cases_at_a_small_topk_hold_what_they_promise(contract, topk):
    """Every edge case builds at top-k 1 and 3; the invalid-indices case still carries all six
    invalid values (across rows when a row is shorter) and the repeated-pairs row repeats."""
    from glm_dsa.testing.cases import SHAPES, invalid_indices

    shapes = {**SHAPES["small"], "mla_topk": (topk,)}
    for name in edge_case_names(contract):
        case = make_case(contract, name, seed=0, shapes=shapes)
        indices = case.args[2]
        assert indices.shape[-1] == topk
        if name == "invalid_indices":
            s_kv = case.args[1].shape[0]
            assert set(invalid_indices(s_kv)) <= set(indices.flatten().tolist())
        if name in ("repeated_index", "repeated_slot") and topk == 3:
            row = indices[1, 0]
            assert row[1] == row[0]
