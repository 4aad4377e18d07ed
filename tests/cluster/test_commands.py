"""The README's commands, run as a user would: `specserve demo --once`, `specserve serve`, `serve run`.

Each starts (and tears down) its own Ray cluster in a subprocess, so this module must not
share a cluster fixture with others.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "specserve" / "demo_models" / "target" / "README.md"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env():
    e = dict(os.environ)
    e.pop("RAY_ADDRESS", None)
    e["TOKENIZERS_PARALLELISM"] = "false"
    return e


def demo_range() -> tuple[float, float]:
    """The demo acceptance-rate range the model card states ("demo acceptance range: a-b")."""
    m = re.search(r"demo acceptance range[^0-9]*([0-9.]+)\s*[-–]\s*([0-9.]+)", CARD.read_text(), re.I)
    assert m, f"{CARD} must state the demo acceptance range"
    return float(m.group(1)), float(m.group(2))


def test_demo_once(tmp_path):
    out = tmp_path / "demo.json"
    proc = subprocess.run([sys.executable, "-m", "specserve.cli", "demo", "--once", "--port", str(free_port()),
                           "--json", str(out)], capture_output=True, text=True, timeout=600, env=env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "acceptance rate" in proc.stdout and "tok/s" in proc.stdout
    report = json.loads(out.read_text())
    low, high = demo_range()
    assert low <= report["acceptance_rate"] <= high, report["acceptance_rate"]
    assert all(r["identical_to_target_only"] for r in report["rows"])
    assert report["speculative_tok_s"] > 0 and report["target_only_tok_s"] > 0


def _serve_and_query(cmd, port, tmp_path, model):
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env(), cwd=tmp_path,
                            start_new_session=True)
    try:
        deadline, last = time.time() + 240, None
        while time.time() < deadline:
            assert proc.poll() is None, proc.stdout.read()[-3000:]
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                if r.status_code == 200:
                    break
            except httpx.HTTPError as exc:
                last = exc
            time.sleep(1)
        else:
            pytest.fail(f"server never came up: {last}")
        assert r.json()["data"][0]["id"] == model
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                       json={"model": model, "prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] >= 1
        return r.json()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


def test_specserve_serve(tmp_path):
    port = free_port()
    body = _serve_and_query([sys.executable, "-m", "specserve.cli", "serve", "--target", "demo:target", "--draft", "demo:draft",
                             "--port", str(port), "--address", "local", "--model-name", "demo"], port, tmp_path, "demo")
    assert body["specserve"]["num_draft_tokens"] > 0


def test_serve_run_single_node_yaml(tmp_path):
    import yaml

    port = free_port()
    config = yaml.safe_load((ROOT / "deployments" / "single_node.yaml").read_text())
    config["http_options"]["port"] = port
    path = tmp_path / "single_node.yaml"
    path.write_text(yaml.safe_dump(config))
    serve_bin = Path(sys.executable).parent / "serve"
    body = _serve_and_query([str(serve_bin), "run", str(path)], port, tmp_path, "demo")
    assert body["specserve"]["num_draft_tokens"] > 0
