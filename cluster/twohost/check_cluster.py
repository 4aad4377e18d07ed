"""Checks, run ON the head node, that a two-node specserve cluster put each role where it belongs.

Phase 1 (always): two alive nodes, each with its role label and resource; an actor
selected by label (and one by the custom resource) runs on each, asserted by node id
and node IP; SPECSERVE_* knobs from ~/specserve-node.env reached the workers.
Phase 2 (--serve CONFIG): `serve deploy`, one HTTP completion, then the Serve
actors whose name mentions draft/target are found with Ray's state API and must
sit on the draft/target node. Prints one line `TWOHOST_RESULT {json}`; exits 1 on
any failed check.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import time
import urllib.request

import ray

ROLE_KEY = "specserve.io/role"
ROLES = ("target", "draft")


def wait_for_nodes(num_nodes: int, timeout_s: float) -> list:
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n for n in ray.nodes() if n["Alive"]]
        if len(alive) >= num_nodes or time.monotonic() > deadline:
            return alive
        time.sleep(1)


@ray.remote(num_cpus=0)
class Probe:
    """Reports where it runs and what environment the node gave it."""

    def where(self) -> dict:
        ctx = ray.get_runtime_context()
        return {
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "labels": dict(ctx.get_node_labels()),
            "env": {k: v for k, v in os.environ.items() if k.startswith("SPECSERVE_")},
            "pid": os.getpid(),
        }


def check_nodes(alive: list, expected_ips: dict, errors: list) -> dict:
    """Maps role -> {node_id, ip} from the cluster's own node table."""
    by_role = {}
    for node in alive:
        labels = node.get("Labels") or {}
        role = labels.get(ROLE_KEY)
        if role in ROLES:
            by_role[role] = {
                "node_id": node["NodeID"],
                "ip": node["NodeManagerAddress"],
                "resource": node["Resources"].get(f"specserve_{role}", 0),
            }
    for role in ROLES:
        info = by_role.get(role)
        if info is None:
            errors.append(f"no alive node labelled {ROLE_KEY}={role}")
            continue
        if info["ip"] != expected_ips[role]:
            errors.append(f"{role} node has IP {info['ip']}, expected {expected_ips[role]}")
        if info["resource"] != 1:
            errors.append(f"{role} node lacks resource specserve_{role}=1: {info}")
    return by_role


def check_probes(by_role: dict, expect_env: dict, errors: list) -> dict:
    """One probe per role by label, one by the custom-resource fallback."""
    from ray.util.state import list_actors

    placed = {}
    for role in ROLES:
        if role not in by_role:
            continue
        for how, opts in (
            ("label", {"label_selector": {ROLE_KEY: role}}),
            ("resource", {"resources": {f"specserve_{role}": 0.01}}),
        ):
            probe = Probe.options(**opts).remote()
            where = ray.get(probe.where.remote(), timeout=120)
            # The same question asked of Ray's state API (what phase 2 relies on).
            actor_id = probe._actor_id.hex()
            (state,) = list_actors(filters=[("actor_id", "=", actor_id)], detail=True)
            ray.kill(probe)
            where["state_api_node_id"] = state.node_id
            placed[f"{role}/{how}"] = where
            if where["node_id"] != by_role[role]["node_id"]:
                errors.append(f"{role} probe ({how}) ran on {where['node_ip']}, not the {role} node")
            if state.node_id != where["node_id"]:
                errors.append(f"state API puts {role} probe on {state.node_id}, it reported {where['node_id']}")
            for key, value in expect_env.items():
                if where["env"].get(key) != value:
                    errors.append(f"{role} probe ({how}): {key}={where['env'].get(key)!r}, expected {value!r}")
    return placed


def post_json(url: str, body: dict, timeout_s: float) -> dict:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def serve_phase(config: str, url: str, by_role: dict, timeout_s: float, errors: list) -> dict:
    """Deploys the app, sends one completion, asserts where the draft/target actors live."""
    from ray.util.state import list_actors

    import yaml

    with open(os.path.expanduser(config)) as f:
        app_args = yaml.safe_load(f)["applications"][0].get("args") or {}
    body = {"prompt": "def main():", "max_tokens": 16, "temperature": 0}  # a sequence's first two steps go without drafts
    name = (app_args.get("server") or {}).get("model_name")
    if name:
        body["model"] = name
    subprocess.run(["serve", "deploy", os.path.expanduser(config)], check=True)
    deadline = time.monotonic() + timeout_s
    health = url.replace("/v1/completions", "/health")
    while time.monotonic() < deadline:  # "ok": every target has its draft connected
        try:
            with urllib.request.urlopen(health, timeout=5) as resp:
                if json.loads(resp.read()).get("status") == "ok":
                    break
        except Exception:  # not up yet (404 while deploying, 503 while loading)
            pass
        time.sleep(1)
    completion, last_err = None, None
    while completion is None and time.monotonic() < deadline:
        try:
            completion = post_json(url, body, 60)
        except Exception as e:  # the app is still starting: 404/503/connection refused
            last_err = e
            time.sleep(3)
    if completion is None:
        subprocess.run(["serve", "status"])
        errors.append(f"no completion from {url} within {timeout_s}s: {last_err!r}")
        return {}
    if not completion.get("choices"):
        errors.append(f"completion without choices: {completion}")

    actors = [a for a in list_actors(detail=True, limit=10000) if a.state == "ALIVE"]
    node_role = {info["node_id"]: role for role, info in by_role.items()}
    patterns = {
        "draft": os.environ.get("SPECSERVE_DRAFT_ACTOR_PATTERN", r"draft"),
        "target": os.environ.get("SPECSERVE_TARGET_ACTOR_PATTERN", r"target|verifier"),
    }
    found = {role: [] for role in ROLES}
    for actor in actors:
        text = f"{actor.class_name} {actor.name or ''}"
        for role, pattern in patterns.items():
            if re.search(pattern, text, re.IGNORECASE):
                found[role].append(
                    {"class_name": actor.class_name, "name": actor.name,
                     "node_id": actor.node_id, "on": node_role.get(actor.node_id)}
                )
    for role in ROLES:
        if not found[role]:
            errors.append(f"no alive actor matching /{patterns[role]}/i")
        for actor in found[role]:
            if actor["on"] != role:
                errors.append(f"{role} actor {actor['class_name']} runs on the {actor['on']} node")
    return {"completion": completion, "actors": found}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target-ip", required=True)
    parser.add_argument("--draft-ip", required=True)
    parser.add_argument("--expect-env", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--serve", metavar="CONFIG", help="phase 2: serve config to deploy")
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1/completions")
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()

    ray.init(address="auto", logging_level="warning")
    errors = []
    alive = wait_for_nodes(2, args.timeout)
    expected_ips = {"target": args.target_ip, "draft": args.draft_ip}
    by_role = check_nodes(alive, expected_ips, errors)
    expect_env = dict(kv.split("=", 1) for kv in args.expect_env)
    placed = check_probes(by_role, expect_env, errors) if not errors else {}
    result = {"nodes": by_role, "probes": placed, "phase": 1}
    if args.serve and not errors:
        result["serve"] = serve_phase(args.serve, args.url, by_role, args.timeout, errors)
        result["phase"] = 2
    result["errors"] = errors
    print("TWOHOST_RESULT " + json.dumps(result, sort_keys=True), flush=True)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
