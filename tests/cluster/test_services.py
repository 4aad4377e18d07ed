"""Targets and drafts as independently scaled Serve deployments (M:N), on four logical nodes.

Two target replicas share one draft replica; a rolling update scales the drafts to two
without restarting the targets; a draft dies and then a target dies. Greedy output stays
exact throughout, and only a dead target's own in-flight requests may fail.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from specserve import SamplingParams
from specserve.reference import reference_generate

from ..conftest import wait_until
from .conftest import free_port, node_labels, serve_actors, start_cluster, stop_cluster

MODEL = "target"
PROMPTS = [[5 + i % 11, 6 + i % 7, 7, 8 + i % 5] for i in range(16)]
N_TOKENS = 24


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(targets=2, drafts=2)
    yield c
    stop_cluster(c)


def config(tiny_pair, drafts: int) -> dict:
    return {"target": {"model": tiny_pair["target"], "dtype": "float64", "num_cpus": 0.25, "num_replicas": 2},
            "draft": {"model": tiny_pair["perturbed"], "dtype": "float64", "num_cpus": 0.25, "num_replicas": drafts},
            # fixed k; a slow draft on a loaded machine is not dropped (a killed one is noticed at once)
            "speculation": {"num_speculative_tokens": 3, "adaptive": False, "draft_min_timeout_s": 10.0, "draft_timeout_s": 60.0},
            "cluster": {"use_role_labels": True}}


def dashboard_url() -> str:
    import ray

    return "http://" + ray._private.worker.global_worker.node.address_info["webui_url"]


def serve_deploy(tmp_path, port: int, args: dict, overrides: list | None = None) -> None:
    """`serve deploy` a Serve YAML, the declarative way operators update a running app."""
    app = {"name": "mn", "route_prefix": "/", "import_path": "specserve.serve:build_app", "args": args}
    if overrides:
        app["deployments"] = overrides
    path = tmp_path / f"mn-{len(overrides or [])}.yaml"
    path.write_text(yaml.safe_dump({"http_options": {"host": "127.0.0.1", "port": port}, "applications": [app]}))
    proc = subprocess.run([str(Path(sys.executable).parent / "serve"), "deploy", str(path), "--address", dashboard_url()],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def app(cluster, tiny_pair, tmp_path_factory):
    from ray import serve

    port = free_port()
    serve_deploy(tmp_path_factory.mktemp("mn"), port, config(tiny_pair, drafts=1))
    base = f"http://127.0.0.1:{port}"
    wait_for(base, targets=2, drafts=1)
    yield base
    serve.delete("mn")


@pytest.fixture(scope="module")
def expected(tiny_pair):
    model = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).eval()
    tok = AutoTokenizer.from_pretrained(tiny_pair["target"])
    params = SamplingParams(temperature=0, max_tokens=N_TOKENS, ignore_eos=True)
    return [tok.decode(reference_generate(model, p, params), skip_special_tokens=True) for p in PROMPTS]


def wait_for(base: str, targets: int, drafts: int, timeout: float = 300) -> dict:
    deadline, h = time.time() + timeout, None
    while time.time() < deadline:
        try:
            h = httpx.get(f"{base}/health", timeout=10).json()
            if h.get("targets") == targets and h.get("drafts") == drafts and h.get("status") == "ok":
                return h
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.25)
    raise AssertionError(f"expected {targets} targets and {drafts} drafts up: {h}")


async def _one(c, base, prompt, stream=False):
    r = await c.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": N_TOKENS,
                                                    "temperature": 0, "ignore_eos": True, "stream": stream})
    if r.status_code != 200:
        return r.status_code, r.text, None
    if stream:
        events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
        if any("error" in e for e in events):
            return 500, r.text, None
        return 200, "".join(e["choices"][0]["text"] for e in events), None
    body = r.json()
    return 200, body["choices"][0]["text"], body["specserve"]["target"]


def registry_snapshot() -> dict:
    from ray import serve

    return serve.get_deployment_handle("Registry", app_name="mn").snapshot.remote().result()


def wait_for_snapshot(check, message: str, timeout: float = 60) -> dict:
    """The registry's snapshot once ``check(snapshot)`` holds. Replicas push their metrics to the
    registry twice a second, so a read right after the requests may predate their last push."""
    def holds():
        snap = registry_snapshot()
        return snap if check(snap) else None

    return wait_until(holds, timeout, 0.2, message)


def wait_connected_to_every_draft(timeout: float = 120) -> None:
    """Every target has connected to every draft the registry lists (targets discover new drafts in
    the background, about once a second): only then do new sequences spread over all drafts."""
    def check(snap):
        names = set(snap["draft"])
        return names and all(set(t.get("drafts", {}).get("drafts", {})) == names for t in snap["target"].values())
    wait_for_snapshot(check, "every target connected to every draft", timeout)


def run_all(base, prompts, stream=False):
    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            return await asyncio.gather(*[_one(c, base, p, stream) for p in prompts])
    return asyncio.run(main())


def test_two_targets_share_one_draft(app, expected):
    results = run_all(app, PROMPTS)
    assert [r[:2] for r in results] == [(200, e) for e in expected]
    targets = {r[2] for r in results}
    assert len(targets) == 2, targets  # least-loaded routing used both target replicas

    def one_draft_served_both(snap):
        drafts = list(snap["draft"].values())
        return (len(drafts) == 1 and set(drafts[0]["by_target"]) == targets
                and all(t["num_requests"] > 0 for t in drafts[0]["by_target"].values()))

    wait_for_snapshot(one_draft_served_both, "one draft answered both targets")
    nodes = {n: node_labels(n)["specserve.io/role"] for _, _, n in serve_actors("mn", "Target") + serve_actors("mn", "Draft")}
    assert set(nodes.values()) == {"target", "draft"}


def test_serve_deploy_scales_the_drafts_without_restarting_targets(app, tiny_pair, expected, tmp_path):
    """Serve's own lightweight update: a `deployments:` override of the Draft deployment."""
    from ray import serve

    before = {pid for _, pid, _ in serve_actors("mn", "Target")}
    port = int(app.rsplit(":", 1)[1])
    serve_deploy(tmp_path, port, config(tiny_pair, drafts=1), overrides=[{"name": "Draft", "num_replicas": 2}])
    wait_for(app, targets=2, drafts=2)
    assert {pid for _, pid, _ in serve_actors("mn", "Target")} == before  # only the draft deployment changed
    status = serve.status().applications["mn"].deployments
    assert {"Registry", "Draft", "Target", "Router"} <= set(status)
    wait_connected_to_every_draft()  # /health counts the new draft before the targets have connected to it
    results = run_all(app, PROMPTS * 2)
    assert [r[:2] for r in results] == [(200, e) for e in expected * 2]
    wait_for_snapshot(lambda snap: len(snap["draft"]) == 2 and all(
        sum(t["num_requests"] for t in d["by_target"].values()) > 0 for d in snap["draft"].values()), "both drafts answered")


def test_every_deployment_stops_without_serves_two_second_wait(app):
    """The app as Serve's REST API reports it (what `serve deploy` talks to): all four deployments
    wait ``SHUTDOWN_WAIT_S`` for requests on their way before stopping, not Serve's 2 s each, one
    deployment after another."""
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    from specserve.serve.app import SHUTDOWN_WAIT_S

    deployments = ServeSubmissionClient(dashboard_url()).get_serve_details()["applications"]["mn"]["deployments"]
    assert set(deployments) == {"Registry", "Draft", "Target", "Router"}
    waits = {name: d["deployment_config"]["graceful_shutdown_wait_loop_s"] for name, d in deployments.items()}
    assert waits == dict.fromkeys(deployments, SHUTDOWN_WAIT_S) and SHUTDOWN_WAIT_S < 2


def test_scaling_the_targets_down_under_load_fails_no_request(app, tiny_pair, expected, tmp_path):
    """A rolling update that stops one of the two targets while requests keep arriving: the stopping
    replica finishes what it holds (Serve's graceful stop, after ``SHUTDOWN_WAIT_S``), new requests go
    to the other, and every answer is exact. The targets are scaled back to two afterwards."""
    port = int(app.rsplit(":", 1)[1])
    stopped = threading.Event()

    async def load():
        results = []
        async with httpx.AsyncClient(timeout=120) as c:
            while not stopped.is_set():
                results += await asyncio.gather(*[_one(c, app, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS[:4])])
        return results

    def scale_down():
        try:
            serve_deploy(tmp_path, port, config(tiny_pair, drafts=1),
                         overrides=[{"name": "Draft", "num_replicas": 2}, {"name": "Target", "num_replicas": 1}])
            wait_until(lambda: len(serve_actors("mn", "Target")) == 1, 120, 0.2, "one target replica left")
            time.sleep(1.0)  # requests keep arriving after the replica is gone, too
        finally:
            stopped.set()

    worker = threading.Thread(target=scale_down)
    worker.start()
    results = asyncio.run(load())
    worker.join()
    assert len(results) >= 8 and [r[:2] for r in results] == [(200, e) for e in expected[:4]] * (len(results) // 4)
    serve_deploy(tmp_path, port, config(tiny_pair, drafts=1), overrides=[{"name": "Draft", "num_replicas": 2}])
    wait_for(app, targets=2, drafts=2)


def test_a_draft_dies_and_no_request_fails(app, expected):
    import ray

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.ensure_future(_one(c, app, p, stream=i % 2 == 1)) for i, p in enumerate(PROMPTS)]
            await asyncio.sleep(0.3)
            ray.kill(serve_actors("mn", "Draft")[0][0], no_restart=True)  # Serve replaces it
            return await asyncio.gather(*tasks)

    results = asyncio.run(main())
    assert [r[:2] for r in results] == [(200, e) for e in expected]
    wait_for(app, targets=2, drafts=2)  # Serve started a new draft replica; targets connect to it


def test_a_target_dies_and_only_its_requests_can_fail(app, expected):
    import ray

    victim, _, _ = serve_actors("mn", "Target")[0]

    async def main():
        async with httpx.AsyncClient(timeout=120) as c:
            tasks = [asyncio.ensure_future(_one(c, app, p, stream=True)) for p in PROMPTS]
            await asyncio.sleep(0.3)
            ray.kill(victim, no_restart=True)
            killed = await asyncio.gather(*tasks)
            after = await asyncio.gather(*[_one(c, app, p) for p in PROMPTS])  # new requests: the surviving target
            return killed, after

    killed, after = asyncio.run(main())
    ok = [r for r in killed if r[0] == 200]
    assert all(r[1] == e for r, e in zip(killed, expected) if r[0] == 200)  # whatever finished is exact
    # Only the victim's own requests may fail, and they say so. How many it held when it died follows
    # from routing and timing (a request without output yet is retried on the survivor), so the count
    # is not asserted; that the survivor's share finished is.
    assert ok, killed
    for status, text, _ in killed:
        if status != 200:
            assert "target replica" in text, text[-2000:]
    assert [r[:2] for r in after] == [(200, e) for e in expected]
