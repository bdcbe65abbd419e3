"""config.json values checked by type and value before anything is built (issue 27, "Silently
wrong results"): one line per bad key naming the file, the key, its value and what is allowed;
near-miss keys warned about; every config error names the file."""

from __future__ import annotations

import json
import warnings

import pytest

from glm_dsa.cli import main
from glm_dsa.config import PRESETS, SCHEMA, YarnScaling, from_hf_config, get_config, to_hf_config


def _write(tmp_path, d, name="config.json"):
    path = tmp_path / name
    path.write_text(json.dumps(d) if not isinstance(d, str) else d)
    return path


def _tiny(**changes):
    d = to_hf_config(PRESETS["tiny"])
    for key, value in changes.items():
        if value is _DROP:
            d.pop(key)
        else:
            d[key] = value
    return d


_DROP = object()

# (changes to tiny's config.json, the line the error prints after "config <file>: ")
BAD_VALUES = [
    # a string "false" is truthy: it used to give the outputs of norm_topk_prob = true
    ({"norm_topk_prob": "false"}, 'norm_topk_prob="false" must be a boolean (true or false)'),
    # true == 1 in Python: it used to build one layer
    ({"num_hidden_layers": True}, "num_hidden_layers=true must be an integer ≥ 1"),
    # a string rope_scaling used to be dropped: a YaRN model run without YaRN
    ({"rope_parameters": _DROP, "rope_scaling": "yarn"}, 'rope_scaling="yarn" must be a JSON object or null'),
    ({"rope_parameters": {"rope_type": "yarn", "factor": -4}},
     "rope_parameters.factor=-4 must be a finite number ≥ 1"),
    ({"rope_parameters": _DROP, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 0}},
     "rope_scaling.original_max_position_embeddings=0 must be an integer ≥ 1"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4, "beta_fast": 1, "beta_slow": 32}},
     "rope_parameters.beta_fast=1.0 must be > rope_parameters.beta_slow=32.0 (YaRN ramps from the fast to the "
     "slow rotation count)"),
    ({"rope_parameters": {"rope_type": "linear", "factor": 2}},
     'rope_parameters.rope_type="linear" must be one of "default", "yarn" or null'),
    # the values that used to fail only inside the forward, naming the symptom
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 0}}, "rope_parameters.rope_theta=0 must be a finite "
     "number > 1"),
    ({"index_k_norm_eps": -1e-6}, "index_k_norm_eps=-1e-06 must be a finite number > 0 and < 1"),
    ({"routed_scaling_factor": float("nan")}, "routed_scaling_factor=NaN must be a finite number > 0"),
    ({"routed_scaling_factor": 0}, "routed_scaling_factor=0 must be a finite number > 0"),
    ({"rms_norm_eps": 1.5}, "rms_norm_eps=1.5 must be a finite number > 0 and < 1"),
    # other wrong types that Python's truthiness or int() would have taken
    ({"rope_interleave": 0}, "rope_interleave=0 must be a boolean (true or false)"),
    ({"tie_word_embeddings": "no"}, 'tie_word_embeddings="no" must be a boolean (true or false)'),
    ({"vocab_size": "512"}, 'vocab_size="512" must be an integer ≥ 1'),
    ({"hidden_size": 128.0}, "hidden_size=128.0 must be an integer ≥ 1"),
    ({"dense_attn_kv_len_threshold": -1}, "dense_attn_kv_len_threshold=-1 must be an integer ≥ 0"),
    ({"indexer_types": "full"}, 'indexer_types="full" must be a list or null'),
    ({"scale_fmt": "e4m3"}, 'scale_fmt="e4m3" must be one of "ue8m0" or null'),
    ({"model_type": "llama"}, 'model_type="llama" must be one of "glm_moe_dsa", "deepseek_v32"'),
    # cross-field rules
    ({"topk_group": 2}, "topk_group=2 must be ≤ n_group=1"),
]


@pytest.mark.parametrize("changes, line", BAD_VALUES, ids=[line.split("=")[0] for _, line in BAD_VALUES])
def test_a_bad_value_is_refused_naming_file_key_value_and_what_is_allowed(tmp_path, changes, line):
    path = _write(tmp_path, _tiny(**changes))
    with pytest.raises(ValueError) as info:
        get_config(str(path))
    assert str(info.value) == f"config {path}: {line}"


def test_every_key_read_has_a_rule_and_every_preset_satisfies_the_schema():
    from glm_dsa.config import _KNOWN_KEYS

    assert _KNOWN_KEYS <= SCHEMA.keys()
    for config in PRESETS.values():
        d = to_hf_config(config)
        assert all(rule.admits(d[k]) for k, rule in SCHEMA.items() if k in d and k != "rope_parameters")
        assert from_hf_config(d) == config.replace(name=config.name)


def test_several_bad_keys_give_one_line_each_and_the_cli_prints_each(tmp_path, capsys):
    path = _write(tmp_path, _tiny(norm_topk_prob="false", num_hidden_layers=True, rope_theta="1e4"))
    assert main(["prefill", "--config", str(path), "--tokens", "64", "--no-progress"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "Traceback" not in err
    assert err.splitlines() == [
        f"glm-dsa prefill: error: config {path}: num_hidden_layers=true must be an integer ≥ 1",
        f"glm-dsa prefill: error: config {path}: norm_topk_prob=\"false\" must be a boolean (true or false)",
        f"glm-dsa prefill: error: config {path}: rope_theta=\"1e4\" must be a finite number > 1",
    ]


def test_python_configs_are_held_to_the_same_schema():
    with pytest.raises(ValueError, match=r"^norm_topk_prob='false' must be a boolean \(true or false\)$"):
        PRESETS["tiny"].replace(norm_topk_prob="false")
    with pytest.raises(ValueError, match=r"^num_hidden_layers=True must be an integer ≥ 1$"):
        PRESETS["tiny"].replace(num_hidden_layers=True)
    with pytest.raises(ValueError, match=r"^rope_scaling.factor=-4.0 must be a finite number ≥ 1$"):
        YarnScaling(factor=-4.0)
    with pytest.raises(ValueError, match=r"rope_scaling='yarn' must be a YarnScaling or None"):
        PRESETS["tiny"].replace(rope_scaling="yarn")


def test_a_near_miss_of_a_key_is_warned_about_with_the_default_it_leaves(tmp_path, capsys):
    path = _write(tmp_path, _tiny(routed_scaling_factor=_DROP, routed_scaling_factr=1.0))
    with pytest.warns(UserWarning) as record:
        config = get_config(str(path))
    assert config.routed_scaling_factor == 2.5
    assert [str(w.message) for w in record] == [
        f"config {path}: unknown key routed_scaling_factr (did you mean routed_scaling_factor? it is unset, so it "
        "takes its default 2.5)"]
    assert main(["ledger", "--config", str(path), "--tokens", "64", "--chunk", "64"]) == 0
    err = capsys.readouterr().err
    assert err == (f"glm-dsa ledger: warning: config {path}: unknown key routed_scaling_factr (did you mean "
                   "routed_scaling_factor? it is unset, so it takes its default 2.5)\n")


def test_a_near_miss_inside_rope_parameters_is_warned_about(tmp_path):
    path = _write(tmp_path, _tiny(rope_parameters={"rope_type": "yarn", "factor": 4, "mscal": 0.5}))
    with pytest.warns(UserWarning, match=r"unknown key rope_parameters.mscal \(did you mean rope_parameters.mscale\? "
                                         r"it is unset, so it takes its default 1.0\)"):
        assert get_config(str(path)).rope_scaling == YarnScaling(factor=4.0)


def test_the_keys_of_real_hf_configs_raise_no_warning():
    transformers = pytest.importorskip("transformers")
    tiny = {k: v for k, v in to_hf_config(PRESETS["tiny"]).items() if k != "rope_parameters"}
    d = transformers.GlmMoeDsaConfig(**tiny).to_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert from_hf_config(d).hidden_size == 128
        from_hf_config("tests/data/hf_tiny")


@pytest.mark.parametrize("text, line", [
    ("[1, 2]", "holds a JSON list, not an object; a config.json is one JSON object {...} of named keys"),
    ('"glm"', "holds a JSON str, not an object; a config.json is one JSON object {...} of named keys"),
    ('{"hidden_size": 128,,}', "is not valid JSON: Expecting property name enclosed in double quotes at line 1 "
                               "column 21"),
    ("", "is not valid JSON: Expecting value at line 1 column 1"),
])
def test_a_file_that_is_not_one_json_object_is_named(tmp_path, text, line):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        get_config(str(path))
    assert str(info.value) == f"config {path} {line}"


def test_a_file_that_is_not_utf8_or_a_directory_without_config_json_is_named(tmp_path):
    path = tmp_path / "c.json"
    path.write_bytes(b"\xff\xfe{")
    with pytest.raises(ValueError, match=f"^config {path} is not UTF-8 text"):
        get_config(str(path))
    (tmp_path / "d").mkdir()
    with pytest.raises(ValueError, match=f"^config {tmp_path / 'd'} is a directory without a config.json$"):
        get_config(str(tmp_path / "d"))
