"""Every range check and rule of glm_dsa.budget, one step inside and one step outside each edge.

Expected row counts are worked by hand from the docstrings' formulas (shown beside each case),
never read back from the code.
"""

import pytest
import torch

from glm_dsa import budget
from glm_dsa.budget import (
    CPU_BUDGET_BYTES,
    MOE_BUDGET_BYTES,
    NO_CHUNK_LOGITS,
    Budgets,
    attention_rows,
    check_fractions,
    logits_budget_of,
    max_logit_rows,
    moe_rows,
    rows_within,
)

GB = 10**9


@pytest.mark.parametrize("msf, ff, ok", [
    (0.0, 0.2, True), (-1e-9, 0.2, False), (0.999, 0.2, True), (1.0, 0.2, False),
    (0.8, 1e-9, True), (0.8, 0.0, False), (0.8, 1.0, True), (0.8, 1.0 + 1e-9, False),
])
def test_fraction_edges(msf, ff, ok):
    if ok:
        check_fractions(msf, ff)
    else:
        with pytest.raises(ValueError, match="mem_fraction_static" if not 0 <= msf < 1 else "free_fraction"):
            check_fractions(msf, ff)


def test_logits_budget_rule_on_an_h200():
    # 0.2 · 0.2 · 141 GB = 5.64 GB (the static term) under 0.2 · 100 GB free and 0.3 · 141 GB
    # (within float rounding: 0.2 is not a binary fraction).
    assert abs(logits_budget_of(100 * GB, 141 * GB, 0.8, 0.2) - 5_640_000_000) <= 1
    # Binary fractions, exact: 0.25 · 0.25 · 128 GB = 8 GB under 0.25 · 64 GB = 16 GB free.
    assert logits_budget_of(64 * GB, 128 * GB, 0.75, 0.25) == 8 * GB
    # Little free memory: 0.25 · 16 GB = 4 GB binds.
    assert logits_budget_of(16 * GB, 128 * GB, 0.75, 0.25) == 4 * GB
    assert logits_budget_of(32 * GB + 4, 128 * GB, 0.75, 0.25) == 8 * GB
    assert logits_budget_of(32 * GB - 4, 128 * GB, 0.75, 0.25) == 8 * GB - 1
    # mem_fraction_static 0 and free_fraction 1: the 0.3 · total cap binds (30 GB of 100).
    assert logits_budget_of(100 * GB, 100 * GB, 0.0, 1.0) == 30 * GB
    assert logits_budget_of(80 * GB, 100 * GB, 0.0, 1.0) == 30 * GB  # the cap is of the total, not the free
    assert logits_budget_of(100 * GB, 100 * GB, 0.5, 0.5) == 25 * GB  # 0.5 · 0.5 under 0.3
    # Defaults are SGLang's: 0.8 and 0.2.
    assert logits_budget_of(100 * GB, 141 * GB) == logits_budget_of(100 * GB, 141 * GB, 0.8, 0.2)
    assert logits_budget_of(100 * GB, 141 * GB) != logits_budget_of(100 * GB, 141 * GB, 0.75, 0.25)


def test_logits_budget_refuses_the_cpu_and_bad_fractions_first():
    with pytest.raises(ValueError, match="explicit budget"):
        budget.logits_budget_bytes("cpu")
    with pytest.raises(ValueError, match="explicit budget"):
        budget.logits_budget_bytes(torch.device("cpu"), mem_fraction_static=2.0)


@pytest.mark.parametrize("field", ["logits_bytes", "attention_bytes", "moe_bytes"])
@pytest.mark.parametrize("value, ok", [(1, True), (0, False), (-1, False), (True, False),
                                       (1.0, False), (None, False), (2**40, True)])
def test_budgets_fields_must_be_positive_ints(field, value, ok):
    kw = {"logits_bytes": 10, "attention_bytes": 10, "moe_bytes": 10, field: value}
    if ok:
        assert getattr(Budgets(**kw), field) == value
    else:
        with pytest.raises(ValueError, match=f"{field}="):
            Budgets(**kw)


def test_budgets_given_in_part_keep_the_moe_default():
    b = Budgets(5, 7)
    assert (b.logits_bytes, b.attention_bytes, b.moe_bytes) == (5, 7, MOE_BUDGET_BYTES)
    assert MOE_BUDGET_BYTES == 3 * 2**30


def test_budgets_default_on_the_cpu_and_from_one_number():
    assert Budgets.default("cpu") == Budgets(CPU_BUDGET_BYTES, CPU_BUDGET_BYTES,
                                             min(CPU_BUDGET_BYTES, MOE_BUDGET_BYTES))
    assert CPU_BUDGET_BYTES == 256 * 2**20
    assert Budgets.default("cpu", 1) == Budgets(1, 1, 1)
    assert Budgets.default(torch.device("cpu"), 12345) == Budgets(12345, 12345, 12345)
    with pytest.raises(ValueError, match="logits_bytes=0"):
        Budgets.default("cpu", 0)
    assert budget.default_moe_bytes("cpu") == CPU_BUDGET_BYTES
    assert budget.default_attention_bytes("cpu") == CPU_BUDGET_BYTES


@pytest.mark.parametrize("budget_bytes, row_bytes, num_rows, rows", [
    (30, 10, None, 3), (29, 10, None, 2), (31, 10, None, 3), (9, 10, None, 1), (0, 10, None, 1),
    (30, 10, 3, 3), (30, 10, 2, 2), (30, 10, 4, 3), (30, 10, 0, 1), (10, 10, 1, 1),
])
def test_rows_within_edges(budget_bytes, row_bytes, num_rows, rows):
    assert rows_within(budget_bytes, row_bytes, num_rows) == rows


@pytest.mark.parametrize("num_q, num_k, budget_bytes, rows", [
    # Below NO_CHUNK_LOGITS elements: every row, whatever the budget.
    (1000, NO_CHUNK_LOGITS // 1000 - 1, 0, 1000),
    # At NO_CHUNK_LOGITS: chunked by the budget, 4 · num_k bytes a row.
    (1000, NO_CHUNK_LOGITS // 1000, 4 * 8000 * 10, 10),
    (1000, NO_CHUNK_LOGITS // 1000, 4 * 8000 * 10 - 1, 9),
    # All rows' bytes fit the budget exactly / one byte short.
    (1000, 8000, 4 * 1000 * 8000, 1000),
    (1000, 8000, 4 * 1000 * 8000 - 1, 999),
    # A budget under one row: still one row.
    (1000, 8000, 3, 1),
    (1, 10**7, 0, 1),
])
def test_max_logit_rows_edges(num_q, num_k, budget_bytes, rows):
    assert max_logit_rows(num_q, num_k, budget_bytes) == rows


@pytest.mark.parametrize("args, match", [
    ((0, 10, 10), "num_q=0"), ((1.0, 10, 10), "num_q"), ((1, -1, 10), "num_k=-1"),
    ((1, 10, -1), "budget_bytes=-1"), ((1, 10, 1.5), "budget_bytes"),
])
def test_max_logit_rows_refusals(args, match):
    with pytest.raises(ValueError, match=match):
        max_logit_rows(*args)
    max_logit_rows(1, 0, 0)  # the one-step-inside values of each


def test_attention_rows_by_hand():
    # heads 2, d_qk 8, d_v 4, bf16 (2 bytes): 2·(16 + 4)·2 + 2·8·10 = 80 + 160 = 240 bytes a row,
    # in place (no gathered keys). Whole tiles of 16 rows, at least one tile.
    args = (100, 4, 8, 4, 2, None, torch.bfloat16)
    assert attention_rows(*args, 240 * 32) == 32
    assert attention_rows(*args, 240 * 32 - 1) == 16
    assert attention_rows(*args, 240 * 16 - 1) == 16
    assert attention_rows(*args, 1) == 16
    assert attention_rows(*args, None) == 100
    assert attention_rows(0, *args[1:], None) == 1
    # Gathered bf16 keys add topk·d_qk·(2 + 2) + 3·heads·topk·2 + heads·topk·10 + 3·topk·8
    # = 128 + 48 + 80 + 96 = 352: 592 bytes a row.
    gathered = (100, 4, 8, 4, 2, torch.bfloat16, torch.bfloat16)
    assert attention_rows(*gathered, 592 * 48) == 48
    assert attention_rows(*gathered, 592 * 48 - 1) == 32
    # fp8 keys (1 byte) in float32 compute: per row 2·20·4 + 160 = 320, plus 4·8·(1 + 4) +
    # 3·2·4·4 + 80 + 96 = 160 + 96 + 176 = 432: 752.
    fp8 = (100, 4, 8, 4, 2, torch.float8_e4m3fn, torch.float32)
    assert attention_rows(*fp8, 752 * 16) == 16
    assert attention_rows(*fp8, 752 * 32 - 1) == 16
    assert attention_rows(*fp8, 752 * 32) == 32


# moe_rows by hand: hidden 4, top_k 1, intermediate 2, no shared expert, 1 expert, float32
# (b = c = 4). Phases: router 4·4 + 1·(12 + 8) = 36; GEMM 1: (4 + 4)·4 = 32; SwiGLU
# 2·(12 + 16) = 56 (fused: 24); GEMM 2: (2 + 4)·4 = 24; combine 4·(12 + 4) = 64 (fused: 0).
# Per row 4·4 + (40 + 8) + max: 128 unfused, 100 fused.
MOE = (1, 4, 2, 0, 1, torch.float32)


@pytest.mark.parametrize("num_rows, fused, budget_bytes, rows", [
    (6, False, 128 * 3, 3), (6, False, 128 * 3 - 1, 2), (6, True, 100 * 3, 3),
    (6, True, 100 * 3 - 1, 2), (2, False, 128 * 3, 2), (3, False, 128 * 3, 3),
    (4, False, 128 * 3, 2),   # 2 blocks of 2, not 3 + 1 (evened out)
    (10, False, 128 * 4, 4),  # ⌈10 / ⌈10 / 4⌉⌉ = 4
    (9, False, 128 * 4, 3),   # ⌈9 / 3⌉ = 3
    (6, False, 1, 1), (0, False, 128, 1), (0, False, None, 1), (7, False, None, 7),
])
def test_moe_rows_edges(num_rows, fused, budget_bytes, rows):
    assert moe_rows(num_rows, *MOE, fused, budget_bytes) == rows


def test_moe_rows_shared_expert_phase():
    # A shared expert of width 16: 16·(12 + 16) = 448 unfused (16·12 = 192 fused) is the largest
    # phase; its output 4·4 is already in the per-row base: 16 + 48 + 448 = 512 (fused 256).
    assert moe_rows(8, 1, 4, 2, 16, 1, torch.float32, False, 512 * 2) == 2
    assert moe_rows(8, 1, 4, 2, 16, 1, torch.float32, False, 512 * 2 - 1) == 1
    assert moe_rows(8, 1, 4, 2, 16, 1, torch.float32, True, 256 * 2) == 2
    assert moe_rows(8, 1, 4, 2, 16, 1, torch.float32, True, 256 * 2 - 1) == 1


def test_moe_rows_bf16_sizes():
    # bf16 (b = 2, c = 4): router 4·4 + 20 = 36; GEMM 1 (4 + 4)·2 = 16; SwiGLU 2·(6 + 16) = 44;
    # GEMM 2 12; combine 4·(12 + 2) = 56. Per row 4·2 + (40 + 8) + 56 = 112.
    assert moe_rows(4, 1, 4, 2, 0, 1, torch.bfloat16, False, 112 * 2) == 2
    assert moe_rows(4, 1, 4, 2, 0, 1, torch.bfloat16, False, 112 * 2 - 1) == 1


@pytest.mark.parametrize("index", range(6))
@pytest.mark.parametrize("value, ok", [(0, True), (-1, False), (1.5, False)])
def test_moe_rows_refuses_negative_sizes(index, value, ok):
    args = [6, 1, 4, 2, 0, 1]
    args[index] = value
    names = ["num_rows", "top_k", "hidden", "intermediate", "shared_intermediate", "num_experts"]
    if ok:
        moe_rows(*args, torch.float32, False, None)
    else:
        with pytest.raises(ValueError, match=f"{names[index]}="):
            moe_rows(*args, torch.float32, False, 128)


@pytest.mark.parametrize("budget_bytes, ok", [(1, True), (0, False), (-5, False), (2.0, False)])
def test_moe_rows_budget_must_be_positive(budget_bytes, ok):
    if ok:
        assert moe_rows(6, *MOE, False, budget_bytes) == 1
    else:
        with pytest.raises(ValueError, match="budget_bytes="):
            moe_rows(6, *MOE, False, budget_bytes)
