"""Batch jobs against a running app: the handle API, ``specserve.connect`` and Ray Data's own processor.

A specserve app on a two-node local cluster serves HTTP while a Ray Data pipeline of a few
hundred rows runs through ``build_processor(ServeDeploymentProcessorConfig(...))`` against its
router's handle API: every row comes back, every greedy output equals the target-only
reference, a poisoned row fails alone, and an HTTP request is answered meanwhile.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import SamplingParams
from specserve.reference import reference_generate

from .conftest import free_port

APP = "batchapp"
PROMPTS = [[3 + i % 17, 4 + i % 5, 5 + i % 11, 6] for i in range(240)]
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_pair):
    from ray import serve

    from specserve.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    config = {"target": {"model": tiny_pair["target"], "dtype": "float64", "num_cpus": 0.25},
              "draft": {"model": tiny_pair["perturbed"], "dtype": "float64", "num_cpus": 0.25},
              "speculation": {"num_speculative_tokens": 3, "adaptive": False, "draft_min_timeout_s": 5.0},
              "server": {"max_pending_requests": 64}}
    serve.run(build_app(config), name=APP, route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=10).json().get("status") == "ok":
                break
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.2)
    yield base
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference(tiny_pair):
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    cache = {}
    for p in PROMPTS:
        key = tuple(p)
        if key not in cache:
            cache[key] = reference_generate(target, p, GREEDY)
    return [cache[tuple(p)] for p in PROMPTS]


def test_connect_generate_equals_the_target_only_greedy_output(app, reference):
    import specserve

    client = specserve.connect(APP)
    outs = client.generate(PROMPTS[:40], GREEDY, use_tqdm=False, max_in_flight=16)
    assert [o.token_ids for o in outs] == reference[:40]
    assert all(o.finish_reason == "length" and o.prompt_token_ids == p for o, p in zip(outs, PROMPTS[:40]))
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0  # the app's drafts were used


def test_a_bad_request_through_the_handle_raises_value_error_naming_the_field(app):
    from ray import serve

    import specserve

    handle = serve.get_app_handle(APP).options(stream=True)
    model = specserve.connect(APP).model
    with pytest.raises(ValueError, match="temperature"):
        next(iter(handle.completions.remote({"model": model, "prompt": [1, 2], "temperature": 9})))
    with pytest.raises(ValueError, match="unsupported field: bogus"):
        next(iter(handle.completions.remote({"model": model, "prompt": [1, 2], "bogus": 1})))
    with pytest.raises(ValueError, match="model"):
        next(iter(handle.chat.remote({"model": "other", "messages": [{"role": "user", "content": "hi"}]})))


def test_ray_data_processor_runs_a_pipeline_against_the_app_while_it_serves_http(app, reference):
    import ray
    from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

    import specserve

    model = specserve.connect(APP).model
    poisoned = 17  # one row asks for an impossible temperature: it fails alone

    def preprocess(row: dict) -> dict:
        return dict(method="completions", dtype=None, request_kwargs=dict(
            model=model, prompt=[int(t) for t in row["prompt"]], max_tokens=MAX_TOKENS, ignore_eos=True, return_token_ids=True,
            temperature=9.0 if row["i"] == poisoned else 0.0))

    def postprocess(row: dict) -> dict:  # (Ray Data hands error rows past it, with __inference_error__ set)
        return dict(i=row["i"], token_ids=list(row["choices"][0]["token_ids"]))

    config = ServeDeploymentProcessorConfig(deployment_name="Router", app_name=APP, dtype_mapping={}, batch_size=16,
                                            concurrency=1, should_continue_on_error=True)
    processor = build_processor(config, preprocess=preprocess, postprocess=postprocess,
                                preprocess_map_kwargs={"num_cpus": 0.1}, postprocess_map_kwargs={"num_cpus": 0.1})
    ds = ray.data.from_items([{"i": i, "prompt": p} for i, p in enumerate(PROMPTS)])
    answered = []

    def http_meanwhile():
        answered.append(httpx.post(f"{app}/v1/completions", timeout=120,
                                   json={"model": model, "prompt": [5, 6, 7], "max_tokens": 4}).status_code)

    t = threading.Thread(target=http_meanwhile)
    t.start()
    rows = sorted(processor(ds).take_all(), key=lambda r: r["i"])
    t.join()
    assert answered == [200]
    assert [r["i"] for r in rows] == list(range(len(PROMPTS)))  # every row is there, once
    assert "temperature" in rows[poisoned]["__inference_error__"] and rows[poisoned].get("token_ids") is None
    good = [r for r in rows if r["i"] != poisoned]
    assert [r["__inference_error__"] for r in good if r.get("__inference_error__")] == []
    assert [list(r["token_ids"]) for r in good] == [ref for i, ref in enumerate(reference) if i != poisoned]


def test_the_readme_ray_data_example_runs_against_the_app(ray_cluster, app, tmp_path):
    """examples/ray_data_batch.py as the README runs it (another driver on the cluster), token-id prompts."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    inp = tmp_path / "prompts.jsonl"
    inp.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS[:12]))
    run = subprocess.run([sys.executable, str(root / "examples" / "ray_data_batch.py"), "--app", APP, "--address",
                          ray_cluster.address, "--input", str(inp), "--output", str(tmp_path / "out"), "--max-tokens", "4"],
                         capture_output=True, text=True, timeout=600, cwd=root, env={**os.environ, "RAY_ADDRESS": ""})
    assert run.returncode == 0, run.stdout[-1500:] + run.stderr[-3000:]
    assert "wrote 12 rows" in run.stdout and "(0 failed)" in run.stdout
