"""glm_dsa.validate's checks, each range tried one step inside and one step outside its edge
(an index equal to a row's length, a negative start, a width one short), eagerly and, for the
device checks, inside ``syncfree.sync_free()`` where the verdict is deferred, not dropped."""

from __future__ import annotations

import pytest
import torch

from glm_dsa import syncfree
from glm_dsa.validate import (
    MAX_EXACT_DIM,
    check_block_exponents,
    check_compressed_width,
    check_index_vector,
    check_logits_inputs,
    check_mqa_logits_mode,
    check_paged_kv_cache,
    check_paged_rows,
    check_pair,
    check_ranges,
    check_slots_read,
    check_sparse_conventions,
    check_sparse_inputs,
    paged_row_ends,
    shape_of,
)

I32 = torch.int32


def _t(*v, dtype=I32):
    return torch.tensor(v, dtype=dtype)


@pytest.mark.parametrize("ks, ke, bad_row", [
    ((0, 3), (10, 10), None), ((10, 0), (10, 0), None), ((-1, 0), (5, 5), 0), ((0, 6), (10, 5), 1),
    ((0, 0), (10, 11), 1), ((4, 0), (4, 0), None), ((5, 0), (4, 0), 0), ((0, 0), (0, 10), None),
])
def test_ranges_edges(ks, ke, bad_row):
    ks, ke = _t(*ks), _t(*ke)
    if bad_row is None:
        check_ranges(ks, ke, 10, "N")
        with syncfree.sync_free() as checks:
            check_ranges(ks, ke, 10, "N")
        checks.raise_first()
        return
    with pytest.raises(ValueError, match=rf"^row {bad_row}: \[ks, ke\) = \[{int(ks[bad_row])}, {int(ke[bad_row])}\) "
                                         r"must satisfy 0 ≤ ks ≤ ke ≤ N=10$"):
        check_ranges(ks, ke, 10, "N")
    with syncfree.sync_free() as checks:
        check_ranges(ks, ke, 10, "N")  # recorded, not raised
    with pytest.raises(ValueError, match=r"a row's \[ks, ke\) breaks 0 ≤ ks ≤ ke ≤ N=10"):
        checks.raise_first()


@pytest.mark.parametrize("t, ok", [
    (_t(1, 2, 3), True), (_t(1, 2, 3, dtype=torch.int64), True), (_t(1, 2), False), (_t(1, 2, 3, 4), False),
    (_t(1, 2, 3, dtype=torch.int16), False), (_t(1, 2, 3, dtype=torch.float32), False),
    (torch.zeros(1, 3, dtype=I32), False), ([1, 2, 3], False),
])
def test_index_vector_edges(t, ok):
    if ok:
        check_index_vector("ks", t, 3, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="^ks "):
            check_index_vector("ks", t, 3, torch.device("cpu"))


def test_index_vector_device():
    with pytest.raises(ValueError, match="ks is on cpu, the other inputs on meta"):
        check_index_vector("ks", _t(1), 1, torch.device("meta"))


def _logits_args(S=2, H=3, D=16, S_kv=5):
    return (torch.zeros(S, H, D, dtype=torch.float8_e4m3fn), torch.zeros(S_kv, D, dtype=torch.float8_e4m3fn),
            torch.zeros(S_kv), torch.zeros(S, H))


def test_logits_inputs_accept_and_return_sizes():
    assert check_logits_inputs(*_logits_args()) == (2, 3, 16, 5)
    q, k, _, w = _logits_args()
    assert check_logits_inputs(q, k, None, w.double()) == (2, 3, 16, 5)


def test_logits_head_dim_at_the_exact_dot_limit():
    q = torch.zeros(1, 1, MAX_EXACT_DIM, dtype=torch.float8_e4m3fn)
    k = torch.zeros(1, MAX_EXACT_DIM, dtype=torch.float8_e4m3fn)
    check_logits_inputs(q, k, None, torch.zeros(1, 1))
    q1 = torch.zeros(1, 1, MAX_EXACT_DIM + 1, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=f"head dim D={MAX_EXACT_DIM + 1} exceeds {MAX_EXACT_DIM}"):
        check_logits_inputs(q1, k, None, torch.zeros(1, 1))


@pytest.mark.parametrize("slot, change, match", [
    (0, lambda q: q.float(), "q_fp8 must be float8_e4m3fn"),
    (0, lambda q: q[0], "q_fp8 must be"),
    (1, lambda k: k[:, :8].contiguous(), r"k_fp8 must be float8_e4m3fn \[S_kv, D=16\]"),
    (1, lambda k: k.float(), "k_fp8 must be"),
    (2, lambda s: s[:4], r"k_scale must be float32 \[S_kv=5\]"),
    (2, lambda s: s.double(), "k_scale must be"),
    (3, lambda w: w.half(), "weights must be float32"),
    (3, lambda w: w[:, :2], r"weights must be float32 \(or float64\) \[S=2, H=3\]"),
    (3, lambda w: w.to("meta"), "weights is on meta, q_fp8 on cpu"),
])
def test_logits_inputs_refusals(slot, change, match):
    args = list(_logits_args())
    args[slot] = change(args[slot])
    with pytest.raises(ValueError, match=match):
        check_logits_inputs(*args)


@pytest.mark.parametrize("D, shape, ok", [(32, (2, 1), True), (64, (2, 2), True), (48, (2, 1), False),
                                          (32, (2, 2), False), (32, (3, 1), False)])
def test_block_exponents_edges(D, shape, ok):
    e = torch.zeros(shape, dtype=torch.uint8)
    if ok:
        check_block_exponents("q_e", e, (2,), D, torch.device("cpu"))
    else:
        with pytest.raises(ValueError, match="multiple of 32|q_e must be uint8"):
            check_block_exponents("q_e", e, (2,), D, torch.device("cpu"))
    with pytest.raises(ValueError, match="uint8"):
        check_block_exponents("q_e", torch.zeros(2, 1, dtype=torch.int8), (2,), 32, torch.device("cpu"))


def test_paged_row_ends_of_context_lengths():
    # Request b's last next_n tokens are the queries: row j sees ctx − next_n + j + 1 (≥ 0).
    ends = paged_row_ends(_t(5, 1, 0), 2)
    assert ends.tolist() == [[4, 5], [0, 1], [0, 0]] and ends.dtype == torch.int64
    per_row = _t(3, 7, 0, 2).view(2, 2)
    assert paged_row_ends(per_row, 2).tolist() == [[3, 7], [0, 2]]


def _paged(context_lens, cols, max_len, page=4, B=None, next_n=1):
    B = context_lens.shape[0] if B is None else B
    return check_paged_rows(B, next_n, 2, torch.zeros(B * next_n, 2), context_lens,
                            torch.zeros(B, cols, dtype=I32), max_len, page, torch.device("cpu"))


@pytest.mark.parametrize("ctx, cols, max_len, match", [
    ((8,), 2, 8, None), ((9,), 2, 9, "request 0 needs 3 pages for 9 tokens; block_table has 2 columns"),
    ((8,), 2, 7, r"row \(b=0, j=0\) sees 8 tokens, outside \[0, max_context_len=7\]"),
    ((0,), 0, 0, None), ((1,), 0, 1, "needs 1 pages"), ((4, 5), 2, 5, None),
    ((4, 9), 2, 9, "request 1 needs 3 pages"),
])
def test_paged_rows_edges(ctx, cols, max_len, match):
    lens = _t(*ctx)
    if match is None:
        assert _paged(lens, cols, max_len).tolist() == [[c] for c in ctx]
    else:
        with pytest.raises(ValueError, match=match):
            _paged(lens, cols, max_len)


def test_paged_rows_negative_and_shape_refusals():
    with pytest.raises(ValueError, match=r"row \(b=0, j=1\) sees -1 tokens"):
        _paged(_t(2, -1).view(1, 2), 1, 4, next_n=2)
    with pytest.raises(ValueError, match="max_context_len=-1 must be a non-negative int"):
        _paged(_t(0), 1, -1)
    with pytest.raises(ValueError, match="max_context_len=2.0"):
        _paged(_t(0), 1, 2.0)
    with pytest.raises(ValueError, match="context_lens must be int32"):
        _paged(_t(1, 2, 3).view(1, 3), 1, 4, next_n=2)
    with pytest.raises(ValueError, match=r"weights must be float32 \[B \* next_n=2"):
        check_paged_rows(1, 2, 2, torch.zeros(1, 2), _t(2), torch.zeros(1, 1, dtype=I32), 4, 4, "cpu")
    with pytest.raises(ValueError, match="block_table must be int32"):
        check_paged_rows(1, 1, 2, torch.zeros(1, 2), _t(2), torch.zeros(2, 1, dtype=I32), 4, 4, "cpu")


@pytest.mark.parametrize("kv, clean, width, match", [
    ((1, 2), True, 0, None), ([1, 2], False, 5, None), ((1, 2, 3), True, 0, "kv must be the pair"),
    ((1,), True, 0, "kv must be the pair"), ((1, 2), False, -1, "max_seqlen_k=-1"),
    ((1, 2), False, True, "max_seqlen_k=True"), ((1, 2), True, 1, "requires clean_logits=False"),
    ((1, 2), True, 0.0, "max_seqlen_k=0.0"),
])
def test_mqa_logits_mode_edges(kv, clean, width, match):
    if match is None:
        check_mqa_logits_mode(kv, clean, width)
    else:
        with pytest.raises(ValueError, match=match):
            check_mqa_logits_mode(kv, clean, width)


@pytest.mark.parametrize("width, ok", [(7, True), (6, False), (100, True)])
def test_compressed_width_edges(width, ok):
    ks, ke = _t(0, 3), _t(5, 10)  # longest window 7
    if ok:
        check_compressed_width(ks, ke, width)
    else:
        with pytest.raises(ValueError, match="ke - ks = 7 keys, more than max_seqlen_k=6"):
            check_compressed_width(ks, ke, width)
    check_compressed_width(_t(), _t(), 0)


@pytest.mark.parametrize("shape, ok", [((3, 4, 1, 20), True), ((3, 4, 1, 19), False), ((3, 4, 2, 20), False),
                                       ((3, 4, 20), False)])
def test_paged_kv_cache_edges(shape, ok):
    q = torch.zeros(1, 1, 2, 16, dtype=torch.float8_e4m3fn)
    kv = torch.zeros(shape, dtype=torch.uint8)
    if ok:
        assert check_paged_kv_cache(q, kv) == (3, 4, 16)
    else:
        with pytest.raises(ValueError, match=r"kv_cache must be uint8 \[num_blocks, block_size, 1, D \+ 4 = 20\]"):
            check_paged_kv_cache(q, kv)
    with pytest.raises(ValueError, match="kv_cache must be uint8"):
        check_paged_kv_cache(q, torch.zeros(3, 4, 1, 20, dtype=torch.int8))
    with pytest.raises(ValueError, match="q must be"):
        check_paged_kv_cache(q[0], torch.zeros(3, 4, 1, 20, dtype=torch.uint8))


@pytest.mark.parametrize("index, read, ok", [(9, True, True), (10, True, False), (-1, True, True),
                                             (-2, True, False), (10, False, True), (0, True, True),
                                             (-2, False, True)])
def test_slots_read_edges(index, read, ok):
    indices = _t(0, index).view(1, 2)
    mask = torch.tensor([[True, read]])
    if ok:
        check_slots_read(indices, mask, 10)
    else:
        with pytest.raises(ValueError, match=rf"indices\[0, 1\] = {index} is neither -1 nor a slot of the 10-slot cache"):
            check_slots_read(indices, mask, 10)


def test_pair_edges():
    check_pair(torch.zeros(2), torch.ones(2), "x")
    with pytest.raises(ValueError, match=r"x: shapes differ, \(2,\) vs \(3,\)"):
        check_pair(torch.zeros(2), torch.ones(3), "x")
    with pytest.raises(ValueError, match="x compares two tensors, got Tensor and list"):
        check_pair(torch.zeros(2), [0, 0], "x")
    assert shape_of(torch.zeros(2, 3)) == "(2, 3)" and shape_of(None) == "NoneType"


def _sparse(s_q=2, h=3, d_qk=8, topk=4, s_kv=5):
    return (torch.zeros(s_q, h, d_qk), torch.zeros(s_kv, 1, d_qk), torch.zeros(s_q, 1, topk, dtype=I32))


@pytest.mark.parametrize("d_v, ok", [(8, True), (1, True), (9, False), (0, False), (-1, False)])
def test_sparse_value_width_edges(d_v, ok):
    q, kv, idx = _sparse()
    if ok:
        check_sparse_inputs(q, kv, idx, d_v, None, None)
    else:
        with pytest.raises(ValueError, match=rf"d_v={d_v} must lie in \[1, d_qk=8\]"):
            check_sparse_inputs(q, kv, idx, d_v, None, None)


@pytest.mark.parametrize("change, match", [
    (lambda a: (a[0][0], *a[1:]), "q must be"),
    (lambda a: (a[0], a[1][:, :, :7], a[2]), r"kv must be \[s_kv, 1, d_qk=8\]"),
    (lambda a: (a[0], torch.zeros(5, 2, 8), a[2]), "kv must be"),
    (lambda a: (a[0], a[1].to(torch.uint8), a[2]), "q and kv must be floating"),
    (lambda a: (a[0], a[1], a[2].long()), r"indices must be int32 \[s_q=2, 1, topk\]"),
    (lambda a: (a[0], a[1], a[2][:1]), "indices must be int32"),
    (lambda a: (a[0], a[1], torch.zeros(2, 2, 4, dtype=I32)), "indices must be int32"),
    (lambda a: (a[0], a[1], a[2][:, :, :0]), "topk ≥ 1"),
])
def test_sparse_input_refusals(change, match):
    with pytest.raises(ValueError, match=match):
        check_sparse_inputs(*change(_sparse()), 4, None, None)
    check_sparse_inputs(_sparse()[0], None, _sparse()[2], 4, None, None)  # packed rows: no kv
    check_sparse_inputs(*_sparse(topk=1), 4, None, None)


@pytest.mark.parametrize("sink, lengths, match", [
    (torch.zeros(3), _t(1, 2), None), (torch.zeros(3, dtype=torch.float64), None, None),
    (torch.zeros(2), None, r"attn_sink must be a floating \[h=3\]"),
    (torch.zeros(3, dtype=I32), None, "attn_sink must be a floating"),
    (None, _t(1, 2, 3), r"topk_length must be int32 \[s_q=2\]"),
    (None, _t(1, 2, dtype=torch.int64), "topk_length must be int32"),
])
def test_sparse_sink_and_length_edges(sink, lengths, match):
    if match is None:
        check_sparse_inputs(*_sparse(), 4, sink, lengths)
    else:
        with pytest.raises(ValueError, match=match):
            check_sparse_inputs(*_sparse(), 4, sink, lengths)


@pytest.mark.parametrize("base, lonely, budget, match", [
    ("e", "+inf", None, None), ("2", "-inf", 1, None), ("10", "+inf", None, "lse_base='10'"),
    ("e", "inf", None, "lonely_lse='inf'"), ("e", "+inf", 0, "budget_bytes=0"),
    ("e", "+inf", 1.0, "budget_bytes=1.0"),
])
def test_sparse_conventions_edges(base, lonely, budget, match):
    if match is None:
        check_sparse_conventions(base, lonely, budget)
    else:
        with pytest.raises(ValueError, match=match):
            check_sparse_conventions(base, lonely, budget)
