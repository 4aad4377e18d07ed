"""The CLI (help from the schema, generate, config) and the shipped configuration files."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from specserve.cli import flag_default_text
from specserve.config import SHARED_SIDE_FIELDS, SpecserveConfig, flat_fields

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, check=True, cwd=None):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, timeout=300, cwd=cwd)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_help_lists_every_field_with_the_schema_default():
    top = run_cli("--help").stdout
    for cmd in ("demo", "serve", "generate", "config"):
        assert cmd in top
    assert run_cli("--version").stdout.startswith("specserve ")
    text = run_cli("serve", "--help").stdout
    body = re.sub(r"\s+", " ", text[text.index("\n\n"):])  # past the usage block
    for flat, (_, _, info) in flat_fields().items():
        flag = "--" + flat.replace("_", "-")
        match = re.search(re.escape(flag) + r"[ ,]", body)
        assert match, flag
        at = match.start()
        assert flag_default_text(flat, info) in body[at:at + 700], (flag, body[at:at + 300])
    for shared in SHARED_SIDE_FIELDS:
        assert "--" + shared.replace("_", "-") in body
    gen_help = run_cli("generate", "--help").stdout
    assert "--input" in gen_help and "--num-speculative-tokens" in gen_help and "--port" not in gen_help
    assert "--once" in run_cli("demo", "--help").stdout


def test_usage_errors_are_one_line():
    proc = run_cli("serve", "--target", "demo:target", "--dtype", "float8", check=False)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1 and "invalid choice: 'float8'" in proc.stderr


def test_a_draft_head_served_alone_needs_its_target_named():
    proc = run_cli("draft", "--draft", "demo:eagle", "--host", "127.0.0.1", check=False)
    assert proc.returncode == 2 and "is a draft head: pass --target" in proc.stderr


def test_config_command_round_trips(tmp_path):
    out = run_cli("config", "--target", "demo:target", "--draft", "ngram", "--num-speculative-tokens", "6",
                  "--draft-drafter-options", "ngram_max=3", "--target-label-selector", '{"a": "b"}').stdout
    data = yaml.safe_load(out)
    assert data["draft"]["drafter"] == "ngram" and data["draft"]["drafter_options"] == {"ngram_max": 3}
    assert data["speculation"]["num_speculative_tokens"] == 6 and data["target"]["label_selector"] == {"a": "b"}
    path = tmp_path / "c.yaml"
    path.write_text(out)
    again = yaml.safe_load(run_cli("config", "--config", str(path)).stdout)
    assert again == data
    assert yaml.safe_load(run_cli("config", "--config", str(path), "--max-num-seqs", "3").stdout)["engine"]["max_num_seqs"] == 3


def test_python_and_cli_share_defaults():
    cfg = SpecserveConfig.load(target="demo:target", draft="demo:draft")
    cli = yaml.safe_load(run_cli("config", "--target", "demo:target", "--draft", "demo:draft").stdout)
    assert cli == cfg.model_dump()


def test_generate_jsonl_in_order(tmp_path, tiny_pair):
    rows = [{"prompt": "w1 w2"}, {"prompt_token_ids": [5, 6, 7], "max_tokens": 3}, {"prompt": "w9", "temperature": 0.0, "stop": ["w3"]}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    run_cli("generate", "--target", tiny_pair["target"], "--draft", tiny_pair["perturbed"], "--input", str(inp),
            "--output", str(out), "--max-tokens", "6", "--no-progress")
    lines = sorted((json.loads(x) for x in out.read_text().splitlines()), key=lambda r: r["index"])  # (written as they finish)
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert lines[0]["prompt"] == "w1 w2" and len(lines[1]["token_ids"]) <= 3
    assert "num_draft_tokens" in lines[0]["metrics"]

    from specserve import LLM, SamplingParams

    with LLM(tiny_pair["target"]) as llm:
        ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert lines[1]["token_ids"] == ref.token_ids


def test_generate_checks_the_output_path_before_running(tmp_path, tiny_pair):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "w1"}\n')
    proc = run_cli("generate", "--target", tiny_pair["target"], "--input", str(inp), "--output", "/no/such/dir/out.jsonl",
                   check=False)
    assert proc.returncode == 2 and "the folder '/no/such/dir' does not exist" in proc.stderr
    assert "generate:" not in proc.stderr  # failed before any progress bar: nothing ran


def test_generate_bad_input_is_a_clear_error(tmp_path, tiny_pair):
    """A bad line is an error row naming its line and cause, the job goes on, the exit code counts
    them; a bad model or flag fails before anything runs."""
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"prompt": "w1"}\n{"oops": 1}\n{"prompt": "w1", "temperature": -1}\n')
    out = tmp_path / "o.jsonl"
    proc = run_cli("generate", "--target", tiny_pair["target"], "--draft", "none", "--input", str(inp), "--output", str(out),
                   "--no-progress", check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    rows = {r["index"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(rows) == [0, 1, 2] and rows[0]["text"]
    assert rows[1]["error"].startswith("line 2: ") and "exactly one of 'prompt' or 'prompt_token_ids'" in rows[1]["error"]
    assert rows[2]["error"] == "line 3: temperature must be >= 0, got -1"
    inp.write_text('{"prompt": "w1"}\n')
    proc = run_cli("generate", "--target", str(tmp_path / "missing"), "--input", str(inp), "--output", str(out), check=False)
    assert proc.returncode == 2 and "no such directory" in proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "deployments").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    config = yaml.safe_load(path.read_text())
    if "applications" not in config:  # a specserve configuration file
        SpecserveConfig.load(path)
        return
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(config)
    for app in schema.applications:
        assert app.import_path == "specserve.serve:build_app"
        SpecserveConfig.load(app.args)  # resolves demo:target / demo:draft and checks every field
