"""`glm-dsa ledger`: the tables and --json carry the same numbers; bad input exits with status 2."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys

import pytest

from glm_dsa.cli import build_parser, main
from glm_dsa.config import get_config, to_hf_config

ARGS_1M = ["ledger", "--config", "glm-5.3", "--tokens", "1048576", "--chunk", "32768"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(capsys, argv):
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def outputs():
    """(text, json) of the article's 1M example, captured once."""
    text, js = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(text):
        assert main(ARGS_1M) == 0
    with contextlib.redirect_stdout(js):
        assert main(ARGS_1M + ["--json"]) == 0
    return text.getvalue(), json.loads(js.getvalue())


def _table(text: str, title_start: str) -> list[str]:
    block = next(b for b in text.split("\n\n") if b.startswith(f"== {title_start}"))
    return block.splitlines()[3:]  # title, header, rule


def _num(cell: str) -> float:
    return float(cell.replace(",", "").rstrip("%"))


def test_every_exact_integer_of_the_main_sections_appears_in_the_tables(outputs):
    text, led = outputs
    ints = []
    for section in ("kv", "logits", "params", "indexer", "activations", "mha_one_shot"):
        stack = [led[section]]
        while stack:
            d = stack.pop()
            for v in d.values():
                if isinstance(v, dict):
                    stack.append(v)
                elif isinstance(v, int) and not isinstance(v, bool):
                    ints.append(v)
    for op in led["flops"]["ops"]:
        ints += [op["flops_per_token"], op["total"]]
    for row in led["comm"]["rows"]:
        ints += [row["bytes_each"], row["total"]]
    ints += [x["amount"] for x in led["ttft"]["components"]]
    assert len(ints) > 60
    for v in ints:
        assert f"{v:,}" in text, v


def test_ttft_table_seconds_equal_the_json_seconds(outputs):
    text, led = outputs
    rows = {line.split()[0]: line.split() for line in _table(text, "TTFT floor")}
    for comp in led["ttft"]["components"]:
        seconds = _num(rows[comp["name"]][-2])
        assert seconds == pytest.approx(comp["seconds"], rel=1e-9)
    assert _num(rows["serial_s"][-1]) == pytest.approx(led["ttft"]["serial_s"], rel=1e-9)
    assert _num(rows["critical_path_s"][-1]) == pytest.approx(led["ttft"]["critical_path_s"], rel=1e-9)


def test_cp_mean_prefix_table_equals_the_json(outputs):
    text, led = outputs
    seq = led["context_parallel"]["sequence"]
    for line in _table(text, "context parallel CP8"):
        r, contig, contig_a, inter, inter_a, zig = line.split()
        r = int(r)
        assert _num(contig) == seq["contiguous"]["mean_prefix_per_rank"][r]
        assert _num(contig_a) == seq["contiguous"]["article_mean_prefix_per_rank"][r]
        assert _num(inter) == seq["interleave"]["mean_prefix_per_rank"][r]
        assert _num(inter_a) == seq["interleave"]["article_mean_prefix_per_rank"][r]
        assert _num(zig) == pytest.approx(seq["zigzag"]["mean_prefix_per_rank"][r], rel=1e-9)


def test_the_article_example_prints_the_headline_numbers(outputs):
    text, led = outputs
    # 21/57 layers, 53,940 B/token, 512 pages per 32K chunk, 1,344 rows at 1M (docs/conventions.md §12)
    assert "21 full + 57 shared" in text
    # each row: quantity, exact value, SI rendering, then the design article's figure where it has one
    assert re.search(r"^bytes_per_token\s+53,940\s+53.94 kB\s+53,940 B$", text, re.M)
    assert re.search(r"^pages_per_chunk\s+512\s+pages\s+512$", text, re.M)
    assert re.search(r"^rows_at_tokens \(budget // 4L\)\s+1,344\s+rows$", text, re.M)
    assert led["kv"]["bytes_per_token"] == 78 * 656 + 21 * 132
    assert led["chunks"]["count"] == 1048576 // 32768


def test_overrides_reach_the_ledger(capsys):
    rc, out, _ = run(capsys, ARGS_1M + ["--json", "--prefix", "4096", "--cp", "4", "--kv-dtype", "bf16",
                                        "--gpus", "4", "--gpu-mem-gb", "150.10988032", "--hbm-tbps", "3.35",
                                        "--mem-fraction-static", "0.85"])
    assert rc == 0
    led = json.loads(out)
    assert led["inputs"]["prefix"] == 4096 and led["inputs"]["new_tokens"] == 1048576 - 4096
    assert led["kv"]["main_row_bytes"] == 2 * (512 + 64)
    assert led["context_parallel"]["cp"] == 4
    assert len(led["context_parallel"]["sequence"]["zigzag"]["pairs_per_rank"]) == 4
    assert led["logits"]["total_mem_bytes"] == 150_109_880_320  # what torch reports on an H200
    assert led["logits"]["budget_bytes"] == pytest.approx(0.2 * 0.15 * 150_109_880_320, abs=2)
    comp = {x["name"]: x for x in led["ttft"]["components"]}
    assert comp["kv_write"]["rate"] == pytest.approx(3.35e12)
    assert comp["indexer_compute"]["rate"] == pytest.approx(4 * 300e12)


def test_config_json_path_is_accepted(capsys, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(to_hf_config(get_config("small"))))
    argv = ["ledger", "--config", str(path), "--tokens", "4096", "--chunk", "1024", "--json"]
    rc, out, _ = run(capsys, argv)
    assert rc == 0
    assert json.loads(out)["model"]["layers"] == get_config("small").num_hidden_layers


@pytest.mark.parametrize(
    "argv, message",
    [
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "32"],
         "--chunk 32 must be a positive multiple of page_size=64"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "100"],
         "--chunk 100 must be a positive multiple of page_size=64, e.g. --chunk 64"),
        (["ledger", "--config", "glm-5.3", "--tokens", "1000", "--chunk", "64", "--prefix", "1000"],
         "prefix"),
        (["ledger", "--config", "nope", "--tokens", "1000", "--chunk", "64"], "unknown config"),
        (["ledger", "--config", "tiny", "--tokens", "1000", "--chunk", "64", "--cp", "0"], "cp=0"),
    ],
)
def test_bad_input_exits_2_with_a_message_saying_what_to_fix(capsys, argv, message):
    rc, out, err = run(capsys, argv)
    assert rc == 2 and out == "" and message in err


def test_parser_has_the_ledger_subcommand_and_requires_a_command():
    assert build_parser().parse_args(ARGS_1M).command == "ledger"
    with pytest.raises(SystemExit):
        build_parser().parse_args([])


def test_module_is_runnable_with_python_dash_m():
    proc = subprocess.run(
        [sys.executable, "-m", "glm_dsa.cli", "ledger", "--config", "tiny", "--tokens", "300",
         "--chunk", "128", "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
        env={**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")},
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["chunks"]["plan"] == [[0, 128], [128, 256], [256, 300]]


@pytest.mark.parametrize("argv", [
    ARGS_1M,
    ["ledger", "--config", "deepseek-v3.2", "--tokens", "163840", "--chunk", "8192", "--prefix", "4096"],
    ["ledger", "--config", "tiny", "--tokens", "1000", "--chunk", "128", "--cp", "3"],
])
def test_report_fits_100_columns_and_every_column_has_a_header(capsys, argv):
    rc, out, _ = run(capsys, argv)
    assert rc == 0
    assert max(len(line) for line in out.splitlines()) <= 100
    for block in out.split("\n\n")[1:]:
        title, header, rule = block.splitlines()[:3]
        assert title.startswith("== ")
        # one dash run per column; every column's header cell is non-blank
        for m in re.finditer(r"-+", rule):
            assert header[m.start():m.end()].strip(), (title, header, m.start())


def test_report_names_the_ttft_floor_and_quotes_the_article_beside_our_figures(outputs):
    text, led = outputs
    assert f"TTFT floor (last table, critical_path_s): {led['ttft']['critical_path_s']:.4g} s" in text
    assert "TTFT floor = critical_path_s" in text
    # the article's a_proj figures (32.2 MFLOP/token; 2.5 PFLOP at 10**6 tokens) beside ours
    assert re.search(r"^a_proj\s+6144->2624\s+78\s+32,243,712\s+32.24 MFLOP\s+32.2 MFLOP$", text, re.M)
    assert re.search(r"^a_proj\s+2,637,178,639,220,736\s+2.637 PFLOP\s+2.5 PFLOP$", text, re.M)
    assert "e+" not in text  # no exponent notation in a report people read


def test_fp8_kv_sizes_are_given_only_where_prefill_accepts_the_fp8_kv(capsys, tmp_path, monkeypatch):
    """kv_lora_rank 64 cannot be cut into FP8 tiles of 128 (one float32 scale per tile): prefill
    refuses --kv-dtype fp8 on it, so the ledger may not print FP8 KV sizes for it either (it
    printed 96-byte rows); both give the same reason in one line, and bf16 works in both."""
    import glm_dsa.cli as cli

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**to_hf_config(get_config("tiny")), "kv_lora_rank": 64}))
    reason = ("--kv-dtype fp8 does not apply to this config: kv_lora_rank=64 must be a multiple of 128 for "
              "the FP8 KV cache (one scale per tile of 128); use --kv-dtype bf16")
    ledger = ["ledger", "--config", str(path), "--tokens", "1024", "--chunk", "256"]
    for argv in (ledger, [*ledger, "--json"], [*ledger, "--kv-dtype", "fp8"]):
        assert run(capsys, argv) == (2, "", f"glm-dsa ledger: error: {reason}\n")
    monkeypatch.setattr(cli, "_load_model", lambda *a, **k: pytest.fail("the model was built before the refusal"))
    prefill = ["prefill", "--config", str(path), "--tokens", "128", "--chunk", "128", "--no-progress"]
    assert run(capsys, [*prefill, "--kv-dtype", "fp8"]) == (2, "", f"glm-dsa prefill: error: {reason}\n")
    rc, out, _ = run(capsys, [*ledger, "--kv-dtype", "bf16", "--json"])
    # bf16 rows: [c | k_pe] in 2 bytes each, 64 + 16 values
    assert rc == 0 and json.loads(out)["kv"]["main_row_bytes"] == 2 * (64 + 16)
