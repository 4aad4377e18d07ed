"""The vLLM backends through specserve's entry points: the Serve app over HTTP, and the batch CLI.

Serve: ``build_app`` with a nested configuration (what a ``serve run`` YAML holds) whose
target and draft both say ``backend: vllm``; concurrent completions equal vLLM's own
target-only output, text included, and /metrics and /health report the drafts. CLI:
``specserve generate`` with ``--target-backend vllm`` and JSON backend options, in its own
process (the in-process path, ``LocalEngine``), gives the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from specserve.config import resolve_model

from .conftest import VLLM_OPTIONS, random_prompts, vllm_greedy
from .test_vllm_serve_path import free_port

PROMPTS = random_prompts(8, seed=3)
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def reference(ray_cluster):
    return vllm_greedy(resolve_model("demo:target"), PROMPTS, MAX_TOKENS, text=True)


@pytest.fixture(scope="module")
def server(ray_cluster, reference):
    from ray import serve

    from specserve.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    side = {"backend": "vllm", "backend_options": VLLM_OPTIONS, "num_cpus": 0.5}
    config = {"target": {"model": "demo:target", **side}, "draft": {"model": "demo:draft", **side},
              "speculation": {"num_speculative_tokens": 4, "draft_min_timeout_s": 5.0}}
    serve.run(build_app(config), name="specserve-vllm", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        try:
            health = httpx.get(f"{base}/health", timeout=2)
            if health.status_code == 200 and health.json()["status"] == "ok":
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    yield base
    serve.delete("specserve-vllm")


def test_serve_app_with_vllm_sides_is_exact_over_http(server, reference):
    async def one(client, prompt):
        r = await client.post(f"{server}/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                                "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    async def main():
        async with httpx.AsyncClient() as client:
            return await asyncio.gather(*[one(client, p) for p in PROMPTS])

    bodies = asyncio.run(main())
    assert [b["choices"][0]["text"] for b in bodies] == [text for _, text in reference]
    assert sum(b["specserve"]["num_accepted_tokens"] for b in bodies) > 0
    metrics = httpx.get(f"{server}/metrics", timeout=5).text
    accepted = next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("specserve_spec_decode_num_accepted_tokens{"))
    assert accepted > 0
    assert httpx.get(f"{server}/health", timeout=5).json()["drafts"] == 1


def test_generate_cli_with_a_vllm_target(tmp_path, reference):
    rows = [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in PROMPTS]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "specserve.cli", "generate", "--target", "demo:target", "--draft", "demo:draft",
           "--target-backend", "vllm", "--target-backend-options", json.dumps(VLLM_OPTIONS), "--num-speculative-tokens", "4",
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]
    env = {**os.environ, "RAY_ADDRESS": ""}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    outs = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [o["token_ids"] for o in outs] == [ids for ids, _ in reference]
    assert sum(o["metrics"]["num_accepted_tokens"] for o in outs) > 0
