"""glm_dsa.config's ranges and cross-field rules, one step inside and one step outside each edge;
``--layers`` at its ends; a config.json given by name, through a symlink and a hard link."""

from __future__ import annotations

import json
import math
import os

import pytest

from glm_dsa.config import (
    FULL,
    SHARED,
    Rule,
    YarnScaling,
    get_config,
    indexer_types_from_rule,
    keep_layers,
    parse_layers,
    to_hf_config,
)

TINY = get_config("tiny")


@pytest.mark.parametrize("rule, value, ok", [
    (Rule("int", low=1), 1, True), (Rule("int", low=1), 0, False), (Rule("int", low=1), True, False),
    (Rule("int", low=1), 1.0, False), (Rule("int", low=0), 0, True), (Rule("int", low=0), -1, False),
    (Rule("number", above=0, below=1), 1e-300, True), (Rule("number", above=0, below=1), 0, False),
    (Rule("number", above=0, below=1), 0.999999, True), (Rule("number", above=0, below=1), 1, False),
    (Rule("number", above=1), 1, False), (Rule("number", above=1), 1.0000001, True),
    (Rule("number", low=1), 1, True), (Rule("number", low=1), 0.9999, False),
    (Rule("number"), math.inf, False), (Rule("number"), math.nan, False), (Rule("number"), False, False),
    (Rule("number"), "1", False), (Rule("bool"), True, True), (Rule("bool"), 1, False),
    (Rule("str", choices=("a",)), "a", True), (Rule("str", choices=("a",)), "b", False),
    (Rule("str", nullable=True), None, True), (Rule("str"), None, False),
    (Rule("list"), (1,), True), (Rule("list"), "ab", False), (Rule("object"), {}, True),
    (Rule("object"), [], False),
])
def test_rule_admits_edges(rule, value, ok):
    assert rule.admits(value) is ok


def test_rule_says_what_it_allows():
    assert Rule("int", low=1).allowed() == "an integer ≥ 1"
    assert Rule("number", above=0, below=1).allowed() == "a finite number > 0 and < 1"
    assert Rule("str", choices=("ue8m0",), nullable=True).allowed() == 'one of "ue8m0" or null'
    assert Rule("bool").allowed() == "a boolean (true or false)"


# Each cross-field rule of DSAConfig: a value one step inside, one step outside.
@pytest.mark.parametrize("changes, match", [
    ({"index_topk": 64}, None), ({"index_topk": 65}, "multiple of 64"), ({"index_topk": 63}, "use 64"),
    ({"index_topk": 130}, "use 128"), ({"index_topk": 128}, None),
    ({"page_size": 32}, None), ({"page_size": 48}, "power of two"), ({"page_size": 1}, None),
    ({"index_head_dim": 64, "qk_rope_head_dim": 16}, None), ({"index_head_dim": 96}, "Hadamard"),
    ({"qk_rope_head_dim": 15}, "must be even"), ({"qk_rope_head_dim": 128}, None),
    ({"qk_rope_head_dim": 130}, "≤ index_head_dim=128"),
    ({"n_group": 2, "topk_group": 2}, None), ({"n_group": 3}, "divisible by n_group=3"),
    ({"n_group": 2, "topk_group": 3}, "topk_group=3 must be ≤ n_group=2"),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 2}, None),
    ({"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "exceeds the experts in the kept groups"),
    ({"n_group": 8, "topk_group": 8}, "each group needs ≥ 2 experts"),
    ({"first_k_dense_replace": 4}, None), ({"first_k_dense_replace": 5}, r"lie in \[0, num_hidden_layers=4\]"),
    ({"first_k_dense_replace": 0}, None),
    ({"indexer_types": (FULL, SHARED, SHARED, FULL)}, None),
    ({"indexer_types": (SHARED, FULL, FULL, FULL)}, "indexer_types\\[0\\] must be 'full'"),
    ({"indexer_types": (FULL, SHARED, FULL)}, "has 3 entries"),
    ({"indexer_types": (FULL, "dense", FULL, FULL)}, "only 'full' or 'shared'"),
    ({"num_experts_per_tok": 8}, None), ({"num_experts_per_tok": 9}, "exceeds"),
])
def test_cross_field_rule_edges(changes, match):
    if match is None:
        TINY.replace(**changes)
    else:
        with pytest.raises(ValueError, match=match):
            TINY.replace(**changes)


def test_every_broken_rule_is_reported_at_once():
    with pytest.raises(ValueError) as e:
        TINY.replace(index_topk=65, page_size=48)
    assert len(str(e.value).splitlines()) == 2


@pytest.mark.parametrize("field, low", [("hidden_size", 1), ("vocab_size", 1), ("page_size", 1),
                                        ("n_shared_experts", 0), ("first_k_dense_replace", 0)])
def test_schema_lows(field, low):
    with pytest.raises(ValueError, match=f"{field}={low - 1}"):
        TINY.replace(**{field: low - 1})


@pytest.mark.parametrize("eps, ok", [(1e-12, True), (0.0, False), (0.5, True), (1.0, False)])
def test_norm_eps_open_interval(eps, ok):
    if ok:
        TINY.replace(rms_norm_eps=eps, index_k_norm_eps=eps)
    else:
        with pytest.raises(ValueError, match="rms_norm_eps"):
            TINY.replace(rms_norm_eps=eps)


@pytest.mark.parametrize("fast, slow, ok", [(2.0, 1.0, True), (1.0, 1.0, False), (1.0, 2.0, False),
                                            (1.0000001, 1.0, True)])
def test_yarn_beta_order(fast, slow, ok):
    if ok:
        YarnScaling(beta_fast=fast, beta_slow=slow)
    else:
        with pytest.raises(ValueError, match="beta_fast"):
            YarnScaling(beta_fast=fast, beta_slow=slow)


@pytest.mark.parametrize("factor, value", [(1.0, 1.0), (0.5, 1.0), (math.e, 1.1), (math.e**2, 1.2)])
def test_yarn_mscale_value(factor, value):
    assert YarnScaling(factor=max(factor, 1.0)).mscale_value(1.0) == pytest.approx(value)


@pytest.mark.parametrize("freq, offset, types", [
    (1, 0, "FFFF"), (4, 3, "FFFS"), (2, 1, "FSFS"), (2, 0, "SFSF"), (3, 5, "FFFF"), (2, 2, "FFSF"),
])
def test_indexer_types_rule(freq, offset, types):
    # Layer i full iff max(i − offset + 1, 0) is a multiple of freq.
    want = tuple(FULL if c == "F" else SHARED for c in types)
    got = indexer_types_from_rule(4, freq, offset)
    assert got == want
    assert all((g == FULL) == (max(i - offset + 1, 0) % freq == 0) for i, g in enumerate(got))


def test_indexer_types_rule_refuses_freq_0():
    with pytest.raises(ValueError, match="index_topk_freq=0 must be ≥ 1"):
        indexer_types_from_rule(4, 0, 0)
    assert indexer_types_from_rule(0, 1, 0) == ()


@pytest.mark.parametrize("spec, kept", [
    ("4", range(4)), ("1", range(1)), (" 2 ", range(2)), ("0:4", range(4)), ("3:4", range(3, 4)),
    ("0:1", range(1)), (4, range(4)), (range(1, 3), range(1, 3)),
])
def test_parse_layers_inside(spec, kept):
    assert parse_layers(spec, 4) == kept


@pytest.mark.parametrize("spec", ["5", "0", "-1:2", "4:4", "3:2", "0:5", "a", "1:2:3", "", 0,
                                  range(0, 4, 2), range(2, 2)])
def test_parse_layers_outside(spec):
    with pytest.raises(ValueError, match="layers"):
        parse_layers(spec, 4)


def test_keep_layers_edges():
    cfg = get_config("tiny").replace(indexer_types=(FULL, SHARED, FULL, SHARED))
    assert keep_layers(cfg, "4") is cfg
    sub = keep_layers(cfg, "2:4")
    assert sub.num_hidden_layers == 2 and sub.indexer_types == (FULL, SHARED)
    assert sub.name == "tiny[2:4]" and sub.first_k_dense_replace == 0
    assert keep_layers(cfg, "0:2").first_k_dense_replace == 1
    with pytest.raises(ValueError, match="start at shared layer 1, which reuses the top-k of full layer 0"):
        keep_layers(cfg, "1:3")
    with pytest.raises(ValueError, match=r"e\.g\. 2:4"):
        keep_layers(cfg, "3:4")


@pytest.mark.parametrize("via", ["file", "dir", "symlink", "hard_link", "symlinked_dir"])
def test_a_config_json_by_name_symlink_and_hard_link(tmp_path, via):
    real = tmp_path / "real"
    real.mkdir()
    (real / "config.json").write_text(json.dumps(to_hf_config(TINY)))
    given = {"file": real / "config.json", "dir": real}.get(via)
    if via == "symlink":
        given = tmp_path / "link.json"
        os.symlink(real / "config.json", given)
    elif via == "hard_link":
        given = tmp_path / "hard.json"
        os.link(real / "config.json", given)
    elif via == "symlinked_dir":
        given = tmp_path / "dirlink"
        os.symlink(real, given)
    got = get_config(str(given))
    assert got.hidden_size == TINY.hidden_size and got.indexer_types == TINY.indexer_types


@pytest.mark.parametrize("content, match", [
    (None, "is a directory without a config.json"), (b"\xff\xfe", "is not UTF-8"),
    (b"{", "is not valid JSON"), (b"[1]", "holds a JSON list, not an object"),
    (b'"x"', "holds a JSON str"),
])
@pytest.mark.parametrize("via", ["name", "symlink"])
def test_a_bad_config_json_is_named_whichever_way_it_is_given(tmp_path, content, match, via):
    d = tmp_path / "c"
    d.mkdir()
    if content is not None:
        (d / "config.json").write_bytes(content)
    given = d
    if via == "symlink":
        given = tmp_path / "link"
        os.symlink(d, given)
    with pytest.raises(ValueError, match=match):
        get_config(str(given))


def test_an_unknown_name_is_refused():
    with pytest.raises(ValueError, match="unknown config 'tinyy'"):
        get_config("tinyy")
