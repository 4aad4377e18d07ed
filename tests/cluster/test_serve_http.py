"""Real Ray Serve on a two-node local cluster, over real HTTP with the official openai client."""

from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve import LLM, SamplingParams
from specserve.reference import reference_generate

from .conftest import node_labels

API_KEY = "test-key"
PROMPT_IDS = [5, 6, 7, 8]
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def chat_pair(tiny_pair, tmp_path_factory):
    """The tiny pair with a chat template on the target's tokenizer."""
    import shutil

    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("chat")
    shutil.copytree(tiny_pair["target"], root / "tiny-target")
    tok = AutoTokenizer.from_pretrained(root / "tiny-target")
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(root / "tiny-target")
    return str(root / "tiny-target"), tiny_pair["perturbed"]


@pytest.fixture(scope="module")
def server(ray_cluster, chat_pair):
    from ray import serve

    from specserve.serve import build_app

    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    target, draft = chat_pair
    args = {"target": target, "draft": draft, "num_speculative_tokens": 3, "dtype": "float64", "draft_dtype": "float64",
            "target_num_cpus": 0.25, "draft_num_cpus": 0.25, "api_key": API_KEY, "max_pending_requests": 6,
            "channel_delay_ms": 2}
    serve.run(build_app(args), name="specserve", route_prefix="/")
    base = f"http://127.0.0.1:{port}"
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    yield base
    serve.delete("specserve")
    serve.shutdown()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def greedy_reference(chat_pair):
    model = AutoModelForCausalLM.from_pretrained(chat_pair[0], dtype=torch.float64).eval()
    return reference_generate(model, PROMPT_IDS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))


def auth():
    return {"Authorization": f"Bearer {API_KEY}"}


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny-target"]


def test_completion_greedy_matches_batch_api_and_target_only(client, server, chat_pair, greedy_reference):
    # Token-id prompts and ignore_eos (vLLM extension) make the comparison exact.
    r = httpx.post(f"{server}/v1/completions", headers=auth(), timeout=60, json={
        "model": "tiny-target", "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    llm = LLM(chat_pair[0], draft=chat_pair[1], num_speculative_tokens=3, dtype="float64")
    batch = llm.generate([PROMPT_IDS], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)[0]
    assert batch.token_ids == greedy_reference
    assert body["choices"][0]["text"] == batch.text
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 12, "total_tokens": 16}
    assert body["specserve"]["num_draft_tokens"] > 0
    assert body["choices"][0]["finish_reason"] == "length"


def test_openai_client_completions(client):
    out = client.completions.create(model="tiny-target", prompt="w1 w2 w3", max_tokens=5, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop") and out.usage.completion_tokens <= 5
    stream = client.completions.create(model="tiny-target", prompt="w1 w2 w3", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == out.usage.completion_tokens
    default = client.completions.create(model="tiny-target", prompt="w1", temperature=0, extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16  # OpenAI's default max_tokens


def test_openai_client_chat(client):
    msgs = [{"role": "user", "content": "w4 w5"}]
    out = client.chat.completions.create(model="tiny-target", messages=msgs, max_tokens=6, temperature=0)
    assert out.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model="tiny-target", messages=msgs, max_tokens=6, temperature=0, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == out.choices[0].message.content


def test_sse_framing(server):
    with httpx.stream("POST", f"{server}/v1/completions", headers=auth(), timeout=60, json={
            "model": "tiny-target", "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = "".join(r.iter_text())
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    last = json.loads(events[-2][6:])
    assert last["choices"][0]["finish_reason"] == "length" and "specserve" in last


@pytest.mark.parametrize("body, status, param_or_code", [
    ({"model": "nope", "prompt": "w1"}, 404, "model_not_found"),
    ({"model": "tiny-target", "prompt": "w1", "n": 2}, 400, None),
    ({"model": "tiny-target", "prompt": "w1", "logprobs": 2}, 400, None),
    ({"model": "tiny-target", "prompt": "w1", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny-target", "prompt": "w1", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "tiny-target", "prompt": "w1", "tools": []}, 400, "tools"),
    ({"model": "tiny-target", "prompt": [1] * 300}, 400, "context_length_exceeded"),
    ({"model": "tiny-target", "prompt": "w1", "max_tokens": 100000}, 400, "context_length_exceeded"),
    ({"model": "tiny-target", "prompt": [1, 999]}, 400, None),
    ({"model": "tiny-target", "prompt": ""}, 400, "prompt"),
    ({"model": "tiny-target"}, 400, "prompt"),
])
def test_errors_use_openai_envelope(server, body, status, param_or_code):
    r = httpx.post(f"{server}/v1/completions", headers=auth(), json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param_or_code:
        assert param_or_code in (err["param"], err["code"]) or param_or_code in err["message"]


def test_malformed_json_and_auth(server):
    r = httpx.post(f"{server}/v1/completions", headers={**auth(), "content-type": "application/json"}, content=b"{not json", timeout=30)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(f"{server}/v1/completions", json={"model": "tiny-target", "prompt": "w1"}, timeout=30)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    r = httpx.get(f"{server}/v1/models", headers={"Authorization": "Bearer wrong"}, timeout=30)
    assert r.status_code == 401


def test_chat_without_template_is_400(server, tiny_pair):
    from ray import serve

    from specserve.serve import build_app

    serve.run(build_app({"target": tiny_pair["target"], "model_name": "plain", "target_num_cpus": 0.25}),
              name="plain", route_prefix="/plain")
    try:
        r = httpx.post(f"{server}/plain/v1/chat/completions", timeout=30,
                       json={"model": "plain", "messages": [{"role": "user", "content": "w1"}]})
        assert r.status_code == 400 and "no chat template" in r.json()["error"]["message"]
    finally:
        serve.delete("plain")


def test_health_and_metrics(server):
    h = httpx.get(f"{server}/health", timeout=30).json()
    assert h["status"] == "ok" and h["draft"] == "up"
    text = httpx.get(f"{server}/metrics", timeout=30).text
    assert 'specserve_spec_decode_num_draft_tokens{model_name="tiny-target"}' in text
    assert "specserve_spec_decode_num_accepted_tokens_per_pos" in text


def _gauge(server, name) -> float:
    for line in httpx.get(f"{server}/metrics", timeout=30).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return -1


def test_disconnect_frees_both_sides_and_spares_others(server, greedy_reference):
    async def full(client):
        r = await client.post(f"{server}/v1/completions", headers=auth(), json={
            "model": "tiny-target", "prompt": PROMPT_IDS, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "stream": True})
        text = ""
        for line in r.text.split("\n\n"):
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
        return text

    async def quitter(client):
        async with client.stream("POST", f"{server}/v1/completions", headers=auth(), json={
                "model": "tiny-target", "prompt": PROMPT_IDS, "max_tokens": 200, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            async for _ in r.aiter_lines():
                break  # disconnect after the first event

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            return await asyncio.gather(full(c), quitter(c), full(c), quitter(c), full(c))

    results = asyncio.run(main())
    texts = [results[0], results[2], results[4]]
    assert len(set(texts)) == 1 and texts[0]
    deadline = time.time() + 20
    while time.time() < deadline:
        if _gauge(server, "specserve_num_requests_running") == 0 and _gauge(server, "specserve_draft_num_sequences") == 0:
            break
        time.sleep(0.2)
    assert _gauge(server, "specserve_num_requests_running") == 0
    assert _gauge(server, "specserve_draft_num_sequences") == 0
    assert _gauge(server, "specserve_num_requests_aborted") >= 2


def test_backpressure_429_with_retry_after(server):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            reqs = [c.post(f"{server}/v1/completions", headers=auth(), json={
                "model": "tiny-target", "prompt": PROMPT_IDS, "max_tokens": 60, "temperature": 0, "ignore_eos": True})
                for _ in range(14)]
            return await asyncio.gather(*reqs)

    responses = asyncio.run(main())
    codes = [r.status_code for r in responses]
    assert 429 in codes and 200 in codes and set(codes) <= {200, 429}
    limited = next(r for r in responses if r.status_code == 429)
    assert limited.headers["retry-after"] == "1" and limited.json()["error"]["type"] == "rate_limit_error"


def test_sides_on_labelled_nodes(server, ray_cluster):
    from ray.util.state import list_actors

    alive = list_actors(address=ray_cluster.address, filters=[("state", "=", "ALIVE")], detail=True)
    actors = {a.class_name: a for a in alive}
    assert node_labels(actors["TargetWorker"].node_id)["specserve.io/role"] == "target"
    assert node_labels(actors["DraftWorker"].node_id)["specserve.io/role"] == "draft"
