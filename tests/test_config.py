import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from glm_dsa.config import PRESETS, DSAConfig, from_hf_config, get_config, keep_layers, to_hf_config


def test_glm53_layer_schedule_matches_article():
    # Article: "第 0 到第 2 层连续三个 full,之后每 4 层一个 full,到第 77 层一共 21 个 full、57 个 shared".
    cfg = PRESETS["glm-5.3"]
    expected_full = [0, 1, 2] + list(range(6, 78, 4))
    assert list(cfg.full_layers) == expected_full
    assert len(cfg.full_layers) == 21 and len(cfg.shared_layers) == 57
    # HF test_indexer_types_respect_skip_topk_offset: 8 layers, freq 4, offset 3 -> FFFSSSFS.
    small = PRESETS["small"]
    assert "".join(t[0].upper() for t in small.indexer_types) == "FFFSSSFS"


def test_shared_layers_take_topk_from_nearest_earlier_full_layer():
    cfg = PRESETS["glm-5.3"]
    for layer in range(cfg.num_hidden_layers):
        src = max(i for i in cfg.full_layers if i <= layer)
        assert cfg.topk_source(layer) == src


def test_glm53_softmax_scale_is_one_sixteenth_and_deepseek_has_yarn_mscale():
    assert PRESETS["glm-5.3"].softmax_scale == 1 / 16
    import math

    m = 0.1 * math.log(40) + 1
    assert PRESETS["deepseek-v3.2"].softmax_scale == pytest.approx(192 ** -0.5 * m * m, rel=1e-15)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_round_trip_through_hf_config(name, tmp_path):
    cfg = PRESETS[name]
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_hf_config(cfg)))
    assert from_hf_config(path) == cfg
    assert from_hf_config(tmp_path) == cfg
    assert get_config(str(path)) == cfg


def test_hf_config_with_rope_theta_and_rope_scaling_reads_yarn():
    d = to_hf_config(PRESETS["deepseek-v3.2"])
    del d["rope_parameters"]
    d["rope_scaling"] = {
        "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
        "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
    }
    assert from_hf_config(d).rope_scaling == PRESETS["deepseek-v3.2"].rope_scaling


def test_hf_config_without_indexer_types_uses_the_rule_and_explicit_list_wins():
    d = to_hf_config(PRESETS["small"])
    del d["indexer_types"]
    d["index_topk_freq"], d["index_skip_topk_offset"] = 2, 1
    # max(i - 1 + 1, 0) % 2 == 0 -> even layers full.
    assert from_hf_config(d).indexer_types == tuple(
        "full" if i % 2 == 0 else "shared" for i in range(8)
    )
    explicit = ["full"] * 2 + ["shared"] * 6
    d["indexer_types"] = explicit
    assert from_hf_config(d).indexer_types == tuple(explicit)
    # HF's GLM defaults (freq 1, offset 2) make every layer full when neither is given.
    del d["indexer_types"], d["index_topk_freq"], d["index_skip_topk_offset"]
    assert set(from_hf_config(d).indexer_types) == {"full"}


@given(freq=st.integers(1, 6), offset=st.integers(1, 6), n=st.integers(1, 40))
def test_layer_rule_matches_explicit_formula(freq, offset, n):
    cfg = PRESETS["tiny"].replace(num_hidden_layers=n, index_topk_freq=freq,
                                  index_skip_topk_offset=offset, first_k_dense_replace=min(1, n))
    for i, t in enumerate(cfg.indexer_types):
        assert (t == "full") == (max(i - offset + 1, 0) % freq == 0)


def test_rule_with_offset_zero_makes_layer_zero_shared_and_is_rejected():
    with pytest.raises(ValueError, match=r"indexer_types\[0\]"):
        PRESETS["tiny"].replace(index_topk_freq=4, index_skip_topk_offset=0)


@pytest.mark.parametrize(
    "changes, field",
    [
        ({"index_topk": 100}, "index_topk"),
        ({"indexer_types": ("full",) * 3}, "indexer_types"),
        ({"indexer_types": ("full", "full", "full", "dense")}, "indexer_types"),
        ({"indexer_types": ("shared", "full", "full", "full")}, "indexer_types[0]"),
        ({"page_size": 48}, "page_size"),
        ({"index_head_dim": 96}, "index_head_dim"),
        ({"qk_rope_head_dim": 15}, "qk_rope_head_dim"),
        ({"n_group": 3}, "n_routed_experts"),
        ({"n_group": 2, "topk_group": 4}, "topk_group"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
        ({"first_k_dense_replace": 5}, "first_k_dense_replace"),
        ({"scale_fmt": "e5m2"}, "scale_fmt"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"rms_norm_eps": 0.0}, "rms_norm_eps"),
    ],
)
def test_each_validation_rule_names_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace("[", r"\[").replace("]", r"\]")):
        PRESETS["tiny"].replace(**changes)


def test_rope_scaling_of_unknown_type_is_rejected():
    d = to_hf_config(PRESETS["tiny"])
    d["rope_parameters"] = {"rope_theta": 1e4, "rope_type": "linear", "factor": 2}
    with pytest.raises(ValueError, match="yarn"):
        from_hf_config(d)


def test_unknown_config_name_lists_presets():
    with pytest.raises(ValueError, match="glm-5.3"):
        get_config("glm-9")


def test_config_is_frozen():
    with pytest.raises(Exception):
        PRESETS["tiny"].hidden_size = 1  # type: ignore[misc]
    assert isinstance(PRESETS["tiny"], DSAConfig)


def test_fp8_tile_rule_applies_only_where_fp8_is_used():
    """kv_lora_rank=100 cannot be cut into FP8 tiles of 128: the FP8 cache refuses it with the
    fix named; the config and the plain-dtype caches accept it (no FP8 tile there)."""
    from glm_dsa.cache import KVCache

    config = PRESETS["tiny"].replace(kv_lora_rank=100, index_head_dim=64)
    with pytest.raises(ValueError, match="kv_lora_rank=100 must be a multiple of 128"):
        KVCache(config, num_pages=1, kv_dtype="fp8")
    for kv_dtype in ("bf16", "fp32", "fp64"):
        assert KVCache(config, num_pages=1, kv_dtype=kv_dtype).mla[0].shape[-1] == 100 + 16


@pytest.mark.parametrize("spec, layers, types, dense", [
    ("6:7", 1, ("full",), 0),
    ("2:9", 7, ("full", "shared", "shared", "shared", "full", "shared", "shared"), 1),
    ("4", 4, ("full", "full", "full", "shared"), 3),
])
def test_keep_layers_keeps_each_layers_kinds_and_renumbers(spec, layers, types, dense):
    glm = PRESETS["glm-5.3"]  # full at 0, 1, 2, then every 4th from 6; dense 0-2
    kept = keep_layers(glm, spec)
    assert (kept.num_hidden_layers, kept.indexer_types, kept.first_k_dense_replace) == (layers, types, dense)
    assert kept.hidden_size == glm.hidden_size and kept.n_routed_experts == glm.n_routed_experts


@pytest.mark.parametrize("spec, message", [
    ("7:8", r"shared layer 7, which reuses the top-k of full layer 6; keep that layer too \(e\.g\. 6:8\)"),
    ("0", "one or more consecutive layers"),
    ("70:80", "0 ≤ a < b ≤ 78"),
    ("6-7", "neither a count N nor a range a:b"),
])
def test_keep_layers_refuses_a_bad_slice_naming_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        keep_layers(PRESETS["glm-5.3"], spec)
