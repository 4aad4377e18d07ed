"""Where a benchmark run's CPU went: each process's CPU time over the run, summed by role, on the
target's cores and on the draft's (psutil).

In the two-device harness one core stands for a device, so everything else that runs on the
target's box (Ray's and Serve's own processes, the HTTP layer, the benchmark client) takes time
the target's forwards could have had. A real device does not share its compute with them; this
table says how much of the emulated one they took, per server and load.

Roles, by process title or command line:

- ``model``: the processes that run the models (vLLM's engine core and worker, specserve's
  Target and Draft replicas, which also hold specserve's step loop and streams);
- ``http``: the OpenAI layer (vLLM's API server process, specserve's Router replica);
- ``client``: the benchmark client (by its pid);
- ``ray/serve``: Ray's and Serve's own processes (GCS, raylets, dashboard, log monitor, Serve's
  controller and proxy, idle workers) and specserve's Registry replica;
- ``other``: everything else on those cores.
"""

from __future__ import annotations

import psutil

ROLES = ("model", "http", "client", "ray/serve", "other")
_MODEL = ("VLLM::Worker", "VLLM::EngineCore", ":Target", ":Draft", "TargetWorker", "DraftWorker")
_HTTP = ("vllm.entrypoints.openai.api_server", "vllm serve", ":Router")
# Every Ray worker's title starts "ray::" (Serve's controller and proxy, the Registry replica, the agents, idle
# workers); Ray's own executables and scripts are named by path.
_RAY = ("ray::", "gcs_server", "raylet", "dashboard", "ray/_private")


def role(title: str) -> str:
    """The role of a process whose title (or command line) is ``title``; the client is told apart by pid."""
    for name, marks in (("model", _MODEL), ("http", _HTTP), ("ray/serve", _RAY)):
        if any(m in title for m in marks):
            return name
    return "other"


def snapshot() -> dict[tuple[int, float], tuple[str, float, frozenset[int]]]:
    """(pid, start time) -> (title, CPU seconds so far (user + system), the cores it may run on).
    (A Ray worker's title changes with the task it runs, so a process is known by pid and start time.)"""
    out = {}
    for p in psutil.process_iter(["cmdline", "name", "create_time"]):
        try:
            with p.oneshot():
                times = p.cpu_times()
                cores = frozenset(p.cpu_affinity())
            title = " ".join(p.info["cmdline"] or []) or (p.info["name"] or "")
        except (psutil.Error, OSError):  # gone, or not ours to read
            continue
        out[(p.pid, p.info["create_time"])] = (title[:200], times.user + times.system, cores)
    return out


def shares(before: dict, after: dict, wall_s: float, cores: set[int], client_pid: int | None = None) -> dict[str, float]:
    """Per role, the share of one core its processes used over ``wall_s`` on ``cores`` (processes
    pinned within them; 1.0 = one core busy the whole run). Processes born during the run count from zero."""
    out = dict.fromkeys(ROLES, 0.0)
    for key, (title, cpu, allowed) in after.items():
        if not allowed or not allowed <= cores:
            continue
        used = cpu - (before[key][1] if key in before else 0.0)
        out["client" if key[0] == client_pid else role(title)] += max(0.0, used) / wall_s
    return out


def describe(share: dict[str, float]) -> str:
    """``model 51 / http 14 / client 18 / ray/serve 9 / other 2`` (% of one core)."""
    return " / ".join(f"{r} {100 * share.get(r, 0.0):.0f}" for r in ROLES)
