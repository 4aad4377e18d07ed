"""The vLLM backends through specserve's entry points: the Serve app over HTTP, and the batch CLI.

Serve: ``build_app`` with a nested configuration (what a ``serve run`` YAML holds) whose
target and draft both say ``backend: vllm``; concurrent completions equal vLLM's own
target-only output, text included, and /metrics and /health report the drafts. CLI:
``specserve generate`` with no backend named (the default, auto, runs vLLM where it is installed), in
its own process (the in-process path, ``LocalEngine``), gives the same tokens.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys

import httpx
import pytest

from specserve.config import TARGET_BACKEND_ENV, resolve_model

from ..conftest import wait_until
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
    # Fixed k: the speculation counts asserted here then follow from the greedy outputs, not from timings.
    config = {"target": {"model": "demo:target", **side}, "draft": {"model": "demo:draft", **side},
              "speculation": {"num_speculative_tokens": 4, "adaptive": False, "draft_min_timeout_s": 5.0}}
    serve.run(build_app(config), name="specserve-vllm", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: health(base).get("status") == "ok", 300, 0.3, "the vLLM app healthy (its draft connected)")
    yield base
    serve.delete("specserve-vllm")


def health(base: str) -> dict:
    try:
        return httpx.get(f"{base}/health", timeout=30).json()
    except (httpx.HTTPError, ValueError):
        return {}


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
    # /metrics and /health read the registry, where replicas push their metrics twice a second:
    # a read right after the requests may predate the target's last push, so poll.
    def accepted():
        metrics = httpx.get(f"{server}/metrics", timeout=30).text
        return next(float(line.split()[-1]) for line in metrics.splitlines()
                    if line.startswith("specserve_spec_decode_num_accepted_tokens{"))

    wait_until(lambda: accepted() > 0, 60, 0.2, "accepted tokens in /metrics")
    wait_until(lambda: health(server).get("drafts") == 1, 60, 0.2, "one draft in /health")


def test_logit_bias_and_min_p_reach_a_vllm_target_that_speculates(server):
    """vLLM refuses both once speculation is configured; behind specserve's proposer they apply (the exactness
    against vLLM target-only is ``test_sampling_features``'s). Here over HTTP: a +100 bias makes every
    generated token the biased one, drafts or not, and min_p is accepted."""
    ids = PROMPTS[0]
    r = httpx.post(f"{server}/v1/completions", json={"model": "demo", "prompt": ids, "max_tokens": 12, "temperature": 0,
                                                     "ignore_eos": True, "logit_bias": {"311": 100}, "min_p": 0.2,
                                                     "return_tokens_as_token_ids": True, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["logprobs"]["tokens"] == ["token_id:311"] * 12


def test_generate_cli_runs_a_vllm_target_by_default(tmp_path, reference):
    """No backend named, vLLM installed: the default (auto) runs the target on vLLM, with vLLM's own engine
    defaults and specserve's bounded CPU KV cache (vLLM's CPU default would reserve most of the machine's memory)."""
    rows = [{"prompt_token_ids": p, "max_tokens": MAX_TOKENS, "ignore_eos": True} for p in PROMPTS]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cmd = [sys.executable, "-m", "specserve.cli", "generate", "--target", "demo:target", "--draft", "demo:draft",
           "--num-speculative-tokens", "4",
           "--no-adaptive",  # fixed k: the speculation counts asserted below follow from the outputs, not from timings
           "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in (TARGET_BACKEND_ENV, "VLLM_CPU_KVCACHE_SPACE")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**env, "RAY_ADDRESS": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "backend auto: vllm" in done.stderr
    kv = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", done.stdout)  # vLLM's engine says what it took
    assert kv and float(kv.group(1)) <= 4.0, done.stdout[-3000:]
    outs = sorted((json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()), key=lambda r: r["index"])
    assert [o["token_ids"] for o in outs] == [ids for ids, _ in reference]
    assert sum(o["metrics"]["num_accepted_tokens"] for o in outs) > 0


def test_vllms_own_benchmark_client_runs_unchanged(server, tmp_path):
    # `vllm bench serve --backend openai` as its users run it: it sends repetition_penalty, logprobs
    # null, stream_options, and counts every non-200 as a failed request.
    # `vllm bench serve` is vllm.benchmarks.serve's add_cli_args + main; entered directly, because the
    # `vllm` CLI asks for the distribution "vllm" and the CPU build's is "vllm-cpu".
    entry = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
    cmd = [sys.executable, "-c", entry, "--backend", "openai", "--base-url", server,
           "--endpoint", "/v1/completions", "--model", "demo", "--tokenizer", resolve_model("demo:target"),
           "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", "16", "--num-prompts", "8",
           "--max-concurrency", "4", "--ignore-eos", "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
           "--result-filename", "result.json", "--ready-check-timeout-sec", "0"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["completed"] == 8 and result.get("failed", 0) == 0, {k: result.get(k) for k in ("completed", "failed", "errors")}
    assert result["total_output_tokens"] == 8 * 16


def test_structured_outputs_and_tool_calls_through_the_openai_client(server):
    """response_format json_schema, vLLM's structured_outputs, and chat tool calls (required and named)
    against a vLLM target with a remote draft: every output follows its grammar."""
    import openai

    client = openai.OpenAI(base_url=f"{server}/v1", api_key="none", timeout=120)
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8}, "size": {"type": "integer"}},
              "required": ["name", "size"]}
    out = client.completions.create(model="demo", prompt="def f(x):\n", max_tokens=48, temperature=0,
                                    extra_body={"response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}})
    value = json.loads(out.choices[0].text)
    assert isinstance(value["name"], str) and isinstance(value["size"], int)
    choice = client.completions.create(model="demo", prompt="import ", max_tokens=8, temperature=0,
                                       extra_body={"structured_outputs": {"choice": ["os", "sys", "re"]}})
    assert choice.choices[0].text in ("os", "sys", "re")
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    messages = [{"role": "user", "content": "add 2 and 3"}]
    required = client.chat.completions.create(model="demo", messages=messages, tools=tools, tool_choice="required", max_tokens=64,
                                              temperature=0)
    calls = required.choices[0].message.tool_calls
    if required.choices[0].finish_reason == "tool_calls":  # (a length cut leaves the text as content)
        assert calls and all(c.function.name == "add" and set(json.loads(c.function.arguments)) == {"a", "b"} for c in calls)
    named = client.chat.completions.create(model="demo", messages=messages, tools=tools, max_tokens=64, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "add"}})
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "add" and named.choices[0].message.content == ""
    if named.choices[0].finish_reason == "stop":
        assert set(json.loads(call.function.arguments)) == {"a", "b"}
    for bad, field in (({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs"),
                       ({"response_format": {"type": "json_schema"}}, "response_format")):
        with pytest.raises(openai.BadRequestError, match=field):
            client.completions.create(model="demo", prompt="x", max_tokens=4, extra_body=bad)
    with pytest.raises(openai.BadRequestError, match="tool_choice"):
        client.chat.completions.create(model="demo", messages=messages, tools=tools, tool_choice="auto", max_tokens=4)


LM_EVAL_TASKS = {
    # multiple choice: lm-eval asks for the loglikelihood of each choice (echo, logprobs=1, max_tokens=1)
    "specserve_mc": ("multiple_choice", [
        {"question": "def add(a, b):\n    return", "choices": [" a + b", " a - b", " None"], "answer": 0},
        {"question": "import os\nimport", "choices": [" sys", " os", " 42"], "answer": 0},
        {"question": "for i in range(10):\n   ", "choices": [" print(i)", " return", " pass"], "answer": 0},
        {"question": "class Point:\n    def __init__(self, x, y):\n        self.x =", "choices": [" x", " y", " self"], "answer": 0},
    ]),
    # generate until a newline (stop strings, greedy)
    "specserve_gen": ("generate_until", [
        {"question": "def add(a, b):\n", "answer": "    return a + b"},
        {"question": "import numpy as np\n", "answer": "import os"},
        {"question": "if __name__ == \"__main__\":\n", "answer": "    main()"},
        {"question": "# print the numbers from 1 to 10\nfor", "answer": " i in range(1, 11):"},
    ]),
}


def lm_eval_tasks(folder) -> list[str]:
    """Local lm-eval tasks (JSONL data and YAML configs in ``folder``; nothing from the hub)."""
    import yaml

    for name, (kind, rows) in LM_EVAL_TASKS.items():
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        task = {"task": name, "dataset_path": "json", "dataset_kwargs": {"data_files": {"test": str(data)}},
                "test_split": "test", "output_type": kind, "doc_to_text": "{{question}}", "doc_to_target": "{{answer}}"}
        if kind == "multiple_choice":
            task |= {"doc_to_choice": "{{choices}}", "metric_list": [{"metric": "acc"}]}
        else:
            task |= {"generation_kwargs": {"until": ["\n"], "max_gen_toks": 16, "do_sample": False},
                     "metric_list": [{"metric": "exact_match"}]}
        (folder / f"{name}.yaml").write_text(yaml.safe_dump(task))
    return list(LM_EVAL_TASKS)


def lm_eval_run(base: str, folder) -> tuple[dict, dict]:
    """lm-eval-harness's ``local-completions`` against ``base``: (metrics per task, responses per task and document)."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={"base_url": f"{base}/v1/completions", "model": "demo", "tokenizer": resolve_model("demo:target"),
                    "tokenizer_backend": "huggingface", "num_concurrent": 1, "max_retries": 1, "timeout": 300},
        tasks=lm_eval_tasks(folder), task_manager=TaskManager(include_path=str(folder)), log_samples=True)
    metrics = {task: {k: v for k, v in values.items() if not k.endswith("_stderr,none") and k != "alias"}
               for task, values in out["results"].items()}
    responses = {task: {s["doc_id"]: s["filtered_resps"] for s in samples} for task, samples in out["samples"].items()}
    return metrics, responses


@pytest.fixture(scope="module")
def vllm_server(ray_cluster):
    """vLLM's own OpenAI server (target only) on the demo target, in its own process, as its users start it."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", resolve_model("demo:target"),
           "--served-model-name", "demo", "--host", "127.0.0.1", "--port", str(port), "--enforce-eager",
           "--kv-cache-memory-bytes", str(VLLM_OPTIONS["kv_cache_memory_bytes"])]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "RAY_ADDRESS": ""}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, f"vLLM's server exited: {proc.stderr.read()[-3000:]}"
        try:
            return httpx.get(f"{base}/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(up, 600, 0.5, "vLLM's OpenAI server healthy")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_lm_eval_harness_gives_vllms_numbers(server, vllm_server, tmp_path, monkeypatch):
    """lm-eval-harness (``local-completions``) on a local task with a loglikelihood part and a
    generate-until part: against specserve (vLLM target, remote draft) the same metrics and the same
    per-document responses as against vLLM's own server on the same target."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")  # the tasks' data are local files
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "ours").mkdir()
    (tmp_path / "theirs").mkdir()
    ours, our_responses = lm_eval_run(server, tmp_path / "ours")
    theirs, their_responses = lm_eval_run(vllm_server, tmp_path / "theirs")
    assert set(ours) == set(LM_EVAL_TASKS) and set(ours) == set(theirs)
    assert ours["specserve_gen"] == theirs["specserve_gen"]
    assert our_responses["specserve_gen"] == their_responses["specserve_gen"]
    assert any(r[0].strip() for r in our_responses["specserve_gen"].values()), our_responses  # something was generated
    assert ours["specserve_mc"]["acc,none"] == theirs["specserve_mc"]["acc,none"]
    pairs = [(doc, ours_, theirs_) for doc, choices in their_responses["specserve_mc"].items()
             for ours_, theirs_ in zip(our_responses["specserve_mc"][doc], choices, strict=True)]
    # Each choice's loglikelihood (a sum over its tokens) and whether it is the greedy continuation.
    # vLLM computes both, in two engines configured differently, in the model's half precision: equal
    # to a few thousandths, one request at a time (two in flight batch differently and differ more).
    assert all(o[1] == t[1] for _, o, t in pairs), pairs
    worst = max(abs(o[0] - t[0]) for _, o, t in pairs)
    assert worst < 0.01, pairs
