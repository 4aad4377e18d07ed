"""A target replica's failure while a mixed batch streams costs no request and changes no output
(real Ray Serve on logical nodes, real HTTP, the openai client, the demo pair).

The batch: ten requests, greedy and seeded sampling, streamed and not, chat and completions, n = 2,
a JSON schema, penalties, a stop string, logprobs, echo, logit_bias, min_p and min_tokens, and one
more through the handle API (``specserve.connect``). It runs
once undisturbed; then, while every stream is mid-flight, one of two target replicas is SIGKILLed,
SIGSTOPped, made to raise inside a step, or scaled away; last, the only replica left is SIGKILLed
and Serve restarts it. Each time every request succeeds with exactly the undisturbed output (the
streams' text, token ids and logprobs, without gap or repeat, under one id), and the router counts
the resumes by cause. Cases reuse one app and run in order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from ..conftest import wait_until
from .conftest import free_port, serve_actors, start_cluster, stop_cluster
from .faults import FAIL_MARK

APP, MODEL = "resume", "demo"
# The app's server.stall_timeout_s: above the longest step a loaded 2-core machine takes here, below the
# 10 s after which Serve's health check would replace a stopped replica itself.
STALL_S = 5.0
FAULTS_SITE = str(Path(__file__).resolve().parent / "faults_site")  # the target replicas' fault injection (faults.py)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16}, "size": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
          "required": ["name", "size", "tags"]}
CHAT = [{"role": "user", "content": "Write a parser for a small config language."}]
STOPPED = {"prompt": "class Parser:\n", "max_tokens": 120, "ignore_eos": True, "temperature": 0.8, "seed": 13}  # with a stop string


def config(replicas: int) -> dict:
    return {"target": {"model": "demo:target", "dtype": "float64", "num_cpus": 0.25, "num_replicas": replicas},
            "draft": {"model": "demo:draft", "dtype": "float64", "num_cpus": 0.25},
            # Fixed k, and a draft that a loaded machine never makes late enough to drop: a seeded request's
            # tokens follow its drafts, so both runs must speculate alike.
            "speculation": {"num_speculative_tokens": 3, "adaptive": False, "draft_min_timeout_s": 10.0, "draft_timeout_s": 60.0},
            # Fixed secrets: a redeploy that changes only the replica count then restarts nothing else.
            "channel": {"draft_token": "resume-test-draft-secret"},
            "server": {"stream_token": "resume-test-stream-secret", "stall_timeout_s": STALL_S, "target_restart_wait_s": 120.0},
            "cluster": {"use_role_labels": True,
                        "runtime_env": {"env_vars": {"PYTHONPATH": FAULTS_SITE}}}}


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(targets=2, drafts=1)
    yield c
    stop_cluster(c)


def dashboard_url() -> str:
    import ray

    return "http://" + ray._private.worker.global_worker.node.address_info["webui_url"]


def deploy(tmp_path: Path, port: int, replicas: int) -> None:
    """`serve deploy` the app: changing only the replica count is Serve's lightweight update."""
    app = {"name": APP, "route_prefix": "/", "import_path": "specserve.serve:build_app", "args": config(2),
           "deployments": [{"name": "Target", "num_replicas": replicas}]}
    path = tmp_path / f"resume-{replicas}.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]}))
    proc = subprocess.run([str(Path(sys.executable).parent / "serve"), "deploy", str(path), "--address", dashboard_url()],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def wait_for(base: str, targets: int, timeout: float = 300) -> None:
    """``targets`` live target replicas, each announcing itself (a replacement that is still loading, or a
    dead replica still listed, does not count), and the app healthy."""
    from ray import serve

    def up():
        try:
            h = httpx.get(f"{base}/health", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return False
        listed = set(serve.get_deployment_handle("Registry", app_name=APP).snapshot.remote().result()["target"])
        live = {f"target-{handle._actor_id.hex()[:12]}" for handle, pid, _ in serve_actors(APP, "Target") if alive(pid)}
        return h.get("status") == "ok" and len(live) == targets and listed == live
    wait_until(up, timeout, 0.25, f"{targets} target replica(s) up and announcing")


@pytest.fixture(scope="module")
def app(cluster, tmp_path_factory):
    from ray import serve

    port, tmp = free_port(), tmp_path_factory.mktemp("resume")
    deploy(tmp, port, 2)
    base = f"http://127.0.0.1:{port}"
    wait_for(base, 2)
    yield base, port, tmp
    serve.delete(APP)


# -- the batch ---------------------------------------------------------------------------------
def requests(stop: str) -> list[dict]:
    """(endpoint, body) of the mixed batch; every body asks for token ids."""
    greedy, ids = {"temperature": 0}, {"return_token_ids": True}
    return [
        ("completions", {"prompt": "def parse(text):\n", "max_tokens": 90, "ignore_eos": True, "stream": True, **greedy, **ids}),
        ("completions", {"prompt": "import os\n", "max_tokens": 80, "ignore_eos": True, "logprobs": 2, "echo": True, **greedy, **ids}),
        ("completions", {"prompt": "class Stack:\n", "max_tokens": 90, "ignore_eos": True, "temperature": 0.8, "seed": 5, "stream": True, **ids}),
        ("chat", {"messages": CHAT, "max_tokens": 80, "ignore_eos": True, **greedy, **ids}),
        ("chat", {"messages": CHAT, "max_tokens": 70, "ignore_eos": True, "temperature": 0.9, "seed": 7, "n": 2, "stream": True, **ids}),
        ("chat", {"messages": CHAT, "max_tokens": 90, "response_format": {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}},
                  **greedy, **ids}),
        ("completions", {"prompt": "for i in range(10):\n", "max_tokens": 90, "ignore_eos": True, "temperature": 0.7, "seed": 3,
                         "presence_penalty": 0.6, "frequency_penalty": 0.4, "repetition_penalty": 1.2, "stream": True, **ids}),
        ("completions", {**STOPPED, "stop": [stop], "stream": True, **ids}),
        ("chat", {"messages": CHAT, "max_tokens": 70, "ignore_eos": True, "temperature": 0.6, "seed": 9, "logprobs": True, "top_logprobs": 2,
                  "stream": True, **ids}),
        ("completions", {"prompt": "while True:\n", "max_tokens": 70, "n": 2, "temperature": 1.0, "seed": 11, "min_tokens": 30, "min_p": 0.05,
                         "logit_bias": {"32": 2.0, "101": -4.0}, **ids}),
        ("handle", {"prompt": "def main():\n", "max_tokens": 80, "ignore_eos": True, "temperature": 0.7, "seed": 17, "stream": True}),
    ]


def _lp(lp) -> list | None:
    """Logprobs as comparable lists: (token, logprob, [top tokens]) per position."""
    if lp is None:
        return None
    if getattr(lp, "content", None) is not None:  # chat
        return [(e.token, e.logprob, [t.token for t in e.top_logprobs]) for e in lp.content]
    return [(t, v, sorted((d or {}).keys())) for t, v, d in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs)]


async def one(client: openai.AsyncOpenAI, endpoint: str, body: dict, progress: dict, key: int, request_id: str | None) -> dict:
    """One request's result: per choice its text, token ids, finish reason and logprobs; for a stream also
    the ids its chunks carried, and the resumes its choices report."""
    if endpoint == "handle":
        return await via_handle(body, progress, key)
    body = dict(body)
    known = {"messages", "prompt", "max_tokens", "temperature", "seed", "n", "stream", "logprobs", "top_logprobs", "stop",
             "presence_penalty", "frequency_penalty", "response_format", "logit_bias", "echo"}
    extra = {k: body.pop(k) for k in list(body) if k not in known}
    if request_id is not None:
        extra["request_id"] = request_id
    call = client.chat.completions.create if endpoint == "chat" else client.completions.create
    args = {"model": MODEL, **body, "extra_body": extra}
    choices: dict[int, dict] = {}
    if not body.get("stream"):
        r = await call(**args)
        for c in r.choices:
            text = c.message.content if endpoint == "chat" else c.text
            choices[c.index] = {"text": text, "token_ids": getattr(c, "token_ids", None), "finish": c.finish_reason, "logprobs": _lp(c.logprobs)}
        return {"choices": choices, "resumes": r.specserve["num_resumes"]}
    ids, resumes = set(), 0
    async for chunk in await call(**args):
        ids.add(chunk.id)
        for c in chunk.choices:
            d = choices.setdefault(c.index, {"text": "", "token_ids": [], "finish": None, "logprobs": None})
            d["text"] += (c.delta.content or "") if endpoint == "chat" else c.text
            d["token_ids"] += getattr(c, "token_ids", None) or []
            if c.logprobs is not None:
                d["logprobs"] = (d["logprobs"] or []) + _lp(c.logprobs)
            if c.finish_reason is not None:
                d["finish"] = c.finish_reason
                resumes += chunk.specserve["num_resumes"]
        progress[key] = progress.get(key, 0) + 1
    return {"choices": choices, "resumes": resumes, "ids": ids}


async def via_handle(body: dict, progress: dict, key: int) -> dict:
    """One streamed request through the app's handle API (``specserve.connect``: the router's deployment handle)."""
    import specserve
    from specserve import SamplingParams

    client = await asyncio.to_thread(specserve.connect, APP)
    params = SamplingParams(**{k: v for k, v in body.items() if k not in ("prompt", "stream")})
    choice = {"text": "", "token_ids": [], "finish": None, "logprobs": None}
    async for d in client.stream(body["prompt"], params):
        choice["text"] += d.text
        choice["token_ids"] += d.token_ids
        choice["finish"] = d.finish_reason or choice["finish"]
        progress[key] = progress.get(key, 0) + 1
    return {"choices": {0: choice}, "resumes": 0}


def run_batch(base: str, batch: list, disturb=None, request_id: str | None = None) -> list:
    """Every request at once; ``disturb()`` (in a thread) once every stream has had two chunks. Returns the
    results, or the exception each request ended with."""
    progress: dict[int, int] = {}
    streams = [i for i, (_, b) in enumerate(batch) if b.get("stream")]

    async def main():
        async with openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=300) as client:
            tasks = [asyncio.ensure_future(one(client, e, b, progress, i, request_id)) for i, (e, b) in enumerate(batch)]
            worker = None
            if disturb is not None:
                while not all(progress.get(i, 0) >= 2 for i in streams):
                    ended = [(i, progress.get(i), t.exception() or "finished") for i in streams if (t := tasks[i]).done()]
                    assert not ended, f"streams ended before every stream was under way: {ended}, chunks so far {progress}"
                    await asyncio.sleep(0.02)
                worker = threading.Thread(target=disturbing)
                worker.start()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            if worker is not None:
                await asyncio.to_thread(worker.join)
            return results

    def disturbing():
        try:
            disturb()
        except BaseException as exc:
            errors.append(exc)

    errors: list[BaseException] = []
    results = asyncio.run(main())
    if errors:
        raise errors[0]
    return results


def resumed(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return {line.split('cause="')[1].split('"')[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("specserve_requests_resumed_total{")}


def assert_same(results: list, expected: list) -> None:
    failed = [(i, r) for i, r in enumerate(results) if isinstance(r, BaseException)]
    assert not failed, failed
    for i, (r, e) in enumerate(zip(results, expected)):
        assert r["choices"].keys() == e["choices"].keys(), i
        for index, choice in r["choices"].items():
            want = e["choices"][index]
            assert (choice["text"], choice["token_ids"], choice["finish"]) == (want["text"], want["token_ids"], want["finish"]), (i, index)
            if want["logprobs"] is not None:
                assert [(t, tops) for t, _, tops in choice["logprobs"]] == [(t, tops) for t, _, tops in want["logprobs"]], (i, index)
                assert all(v == w or abs(v - w) < 1e-6 for (_, v, _), (_, w, _) in zip(choice["logprobs"], want["logprobs"])
                           if v is not None and w is not None), (i, index)
        if "ids" in r:
            assert len(r["ids"]) == 1, (i, r["ids"])  # one response id, whichever replica sent the chunks


@pytest.fixture(scope="module")
def batch(app):
    base = app[0]
    free = run_batch(base, [("completions", STOPPED)])
    text = free[0]["choices"][0]["text"]
    # A string that first occurs two thirds in: the stream stops there, well after the disturbance.
    start = next(i for i in range(len(text) * 2 // 3, len(text) - 6) if text.find(text[i:i + 6]) == i)
    return requests(text[start:start + 6])


@pytest.fixture(scope="module")
def undisturbed(app, batch):
    run_batch(app[0], batch)  # once to warm both replicas (grammar compiles, first forwards)
    results = run_batch(app[0], batch)
    assert_same(results, results)
    assert results[7]["choices"][0]["finish"] == "stop"
    json.loads(results[5]["choices"][0]["text"])  # the schema's output is JSON
    return results


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def target_pids() -> list[int]:
    """The live target replicas' pids (Ray's state API lists a killed actor as alive for a while)."""
    return [pid for _, pid, _ in serve_actors(APP, "Target") if alive(pid)]


def replicas() -> list[tuple[str, int]]:
    """(name, pid) of each live target replica. Read before a batch: Ray's state API can take seconds
    on a loaded machine, long enough for a short batch to end before the disturbance."""
    return [(f"target-{handle._actor_id.hex()[:12]}", pid) for handle, pid, _ in serve_actors(APP, "Target") if alive(pid)]


def victim(live: list[tuple[str, int]], timeout: float = 30) -> int:
    """The pid of the replica among ``live`` running the most requests, as it announces them (the router
    balances streams, but a replica just replaced may have been passed over meanwhile). Announcements
    come twice a second, later on a loaded machine, so the first snapshots read under a new batch can
    still show none running."""
    from ray import serve

    registry = serve.get_deployment_handle("Registry", app_name=APP)

    def busiest():
        snapshot = registry.snapshot.remote().result()["target"]
        count, pid = max(((snapshot.get(name) or {}).get("num_running") or 0, pid) for name, pid in live if alive(pid))
        return pid if count > 0 else None
    return wait_until(busiest, timeout, 0.1, "a replica announcing a running request")


def test_sigkill_of_one_of_two_replicas_mid_stream(app, batch, undisturbed):
    base = app[0]
    before, live = resumed(base), replicas()
    results = run_batch(base, batch, lambda: os.kill(victim(live), signal.SIGKILL))
    after = resumed(base)
    wait_for(base, 2)  # Serve replaced it (first: a later test must not start while it does)
    assert_same(results, undisturbed)
    assert after["death"] > before["death"] and sum(r["resumes"] for r in results) > 0


def test_sigstop_of_one_of_two_replicas_mid_stream(app, batch, undisturbed):
    base = app[0]
    before, stopped, at, live = resumed(base), [], {}, replicas()

    def stop():
        pid = victim(live)
        os.kill(pid, signal.SIGSTOP)
        stopped.append(pid)
        at["stopped"] = time.monotonic()

    try:
        results = run_batch(base, batch, stop)
    finally:
        for pid in stopped:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:  # Serve's health check replaced it meanwhile
                pass
    after = resumed(base)
    wait_for(base, 2)  # (first: a later test must not start while Serve replaces the stopped replica)
    assert_same(results, undisturbed)
    # The router's stall bound cuts the stopped replica off; on a loaded machine Serve's health check can
    # kill it first, and its requests resume as after a death. Either way none fails (the stall bound
    # itself: tests/unit/test_resume_streams.py).
    assert after["stall"] + after["death"] > before["stall"] + before["death"], (before, after)
    print(f"\nSIGSTOP: batch done {time.monotonic() - at['stopped']:.1f}s after the stop (stall_timeout_s {STALL_S:g}); "
          f"resumed after a stall {after['stall'] - before['stall']:.0f}, after a death {after['death'] - before['death']:.0f}")


def test_a_replica_that_raises_inside_a_step(app, batch, undisturbed):
    """Every request fails inside a step on the first replica that serves it (tests/cluster/faults.py)."""
    base = app[0]
    before = resumed(base)
    results = run_batch(base, batch, request_id=FAIL_MARK)
    assert_same(results, undisturbed)
    choices = sum(len(r["choices"]) for (endpoint, _), r in zip(batch, undisturbed) if endpoint != "handle")  # (HTTP: marked)
    assert resumed(base)["error"] - before["error"] == choices


def test_scale_down_under_load_hands_requests_over(app, batch, undisturbed):
    base, port, tmp = app
    before = resumed(base)
    results = run_batch(base, batch, lambda: deploy(tmp, port, 1))
    assert_same(results, undisturbed)
    wait_for(base, 1)
    print(f"\nscale-down: {resumed(base)['scale_down'] - before['scale_down']:.0f} choice(s) handed over")


def test_the_only_replica_killed_and_restarted(app, batch, undisturbed):
    """One replica: its requests wait for Serve's restart and resume there; a new request meanwhile gets
    the fast 503, unless it asks to wait (``wait_for_target``)."""
    base = app[0]
    before, answers, live = resumed(base), {}, replicas()

    def kill_then_ask():
        os.kill(victim(live), signal.SIGKILL)
        time.sleep(0.5)
        start = time.perf_counter()
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4}, timeout=60)
        answers["plain"] = (r.status_code, time.perf_counter() - start)
        r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "x = ", "max_tokens": 4, "wait_for_target": True}, timeout=300)
        answers["waiting"] = r.status_code

    results = run_batch(base, batch, kill_then_ask)
    assert_same(results, undisturbed)
    assert resumed(base)["death"] > before["death"]
    assert answers["plain"][0] == 503 and answers["waiting"] == 200, answers
    print(f"\none replica killed: the new request's 503 came in {answers['plain'][1] * 1e3:.0f} ms")
