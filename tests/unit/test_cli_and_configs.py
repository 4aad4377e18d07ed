"""The CLI (help, generate) and the shipped Serve YAMLs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", *args], capture_output=True, text=True, timeout=300)
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_help_is_complete():
    top = run_cli("--help").stdout
    for cmd in ("demo", "serve", "generate"):
        assert cmd in top
    serve_help = run_cli("serve", "--help").stdout
    for flag in ("--target", "--draft", "--num-speculative-tokens", "--host", "--port", "--api-key", "--draft-label", "--target-label", "--address"):
        assert flag in serve_help
    assert "--input" in run_cli("generate", "--help").stdout
    assert "--once" in run_cli("demo", "--help").stdout


def test_generate_jsonl_in_order(tmp_path, tiny_pair):
    rows = [{"prompt": "w1 w2"}, {"prompt_token_ids": [5, 6, 7], "max_tokens": 3}, {"prompt": "w9", "temperature": 0.0, "stop": ["w3"]}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out.jsonl"
    run_cli("generate", "--target", tiny_pair["target"], "--draft", tiny_pair["perturbed"], "--input", str(inp),
            "--output", str(out), "--max-tokens", "6", "--no-progress")
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["index"] for x in lines] == [0, 1, 2]
    assert lines[0]["prompt"] == "w1 w2" and len(lines[1]["token_ids"]) <= 3
    assert "num_draft_tokens" in lines[0]["metrics"]

    from specserve import LLM, SamplingParams

    llm = LLM(tiny_pair["target"])
    ref = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert lines[1]["token_ids"] == ref.token_ids


def test_generate_bad_input_is_a_clear_error(tmp_path, tiny_pair):
    inp = tmp_path / "bad.jsonl"
    inp.write_text('{"prompt": "w1"}\n{"oops": 1}\n')
    proc = run_cli("generate", "--target", tiny_pair["target"], "--draft", "none", "--input", str(inp), "--output",
                   str(tmp_path / "o.jsonl"), check=False)
    assert proc.returncode == 2 and "bad.jsonl:2" in proc.stderr and "Traceback" not in proc.stderr
    inp.write_text('{"prompt": "w1", "temperature": -1}\n')
    proc = run_cli("generate", "--target", tiny_pair["target"], "--input", str(inp), "--output", str(tmp_path / "o.jsonl"), check=False)
    assert proc.returncode == 2 and "temperature must be >= 0" in proc.stderr


@pytest.mark.parametrize("path", sorted((ROOT / "deployments").glob("*.yaml")), ids=lambda p: p.name)
def test_serve_configs_validate(path):
    from ray.serve.schema import ServeDeploySchema

    from specserve.serve import ServeArgs, build_app

    config = yaml.safe_load(path.read_text())
    schema = ServeDeploySchema.model_validate(config) if hasattr(ServeDeploySchema, "model_validate") else ServeDeploySchema.parse_obj(config)
    for app in schema.applications:
        assert app.import_path == "specserve.serve:build_app"
        args = ServeArgs(**app.args)
        args.engine_config()  # resolves demo:target / demo:draft and checks every field
        assert build_app(app.args) is not None
