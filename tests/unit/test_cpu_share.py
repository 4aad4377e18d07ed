"""benchmarks/cpu_share.py: processes sorted into roles, and a run's CPU time counted per role on a core set."""

from __future__ import annotations

import os
import subprocess
import sys

from benchmarks import cpu_share

SPIN = "import time\nwhile time.process_time() < 0.3: pass\nprint('done', flush=True)\ninput()"  # 0.3 s of CPU, then idle


def test_roles_by_process_title():
    assert cpu_share.role("VLLM::EngineCore") == "model"
    assert cpu_share.role("ray::ServeReplica:bench-serve:Target") == "model"
    assert cpu_share.role("ray::ServeReplica:bench-serve:Draft") == "model"
    assert cpu_share.role("/usr/bin/python -m vllm.entrypoints.openai.api_server --model m") == "http"
    assert cpu_share.role("ray::ServeReplica:bench-serve:Router") == "http"
    assert cpu_share.role("ray::ServeReplica:bench-serve:Registry") == "ray/serve"
    assert cpu_share.role(".../ray/core/src/ray/gcs/gcs_server --log_dir=/tmp/ray") == "ray/serve"
    assert cpu_share.role("ray::ServeController.listen_for_change") == "ray/serve"
    assert cpu_share.role("/usr/bin/python my_script.py") == "other"


def test_a_run_counts_each_process_once_in_its_role_and_only_on_its_cores():
    cores = os.sched_getaffinity(0)
    before = cpu_share.snapshot()
    procs = [subprocess.Popen([sys.executable, "-c", SPIN], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "done"  # each has used its 0.3 s and now waits
        after = cpu_share.snapshot()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    client, other = procs
    pids = {pid for pid, _ in after}
    assert {client.pid, other.pid} <= pids and client.pid not in {pid for pid, _ in before}  # born during the run: from zero
    seconds = cpu_share.shares(before, after, 1.0, cores, client_pid=client.pid)  # wall 1 s: shares are seconds
    assert set(seconds) == set(cpu_share.ROLES)
    assert 0.25 <= seconds["client"] < 1.0  # its own 0.3 s (read in clock ticks), plus its start-up, and nobody else's
    assert seconds["other"] >= 0.25  # the second one, a plain python process
    elsewhere = cpu_share.shares(before, after, 1.0, {max(cores) + 1})  # a core set none of them may use
    assert sum(elsewhere.values()) == 0.0
    assert cpu_share.describe({"client": 0.3, "model": 0.514}) == "model 51 / http 0 / client 30 / ray/serve 0 / other 0"


def test_a_worker_whose_title_changes_counts_only_its_time_in_the_run():
    # A Ray worker is "ray::IDLE" until it hosts an actor, then "ray::Class.method" while one runs: the
    # same process, counted from its earlier reading, under the role of its title at the end.
    before = {(10, 1.0): ("ray::IDLE", 5.0, frozenset({0})), (11, 1.0): ("ray::ServeController", 9.0, frozenset({0}))}
    after = {(10, 1.0): ("ray::ServeReplica:app:Target", 5.5, frozenset({0})),
             (11, 1.0): ("ray::ServeController.listen_for_change", 9.25, frozenset({0})),
             (11, 2.0): ("ray::IDLE", 0.5, frozenset({0}))}  # pid 11 reused by a new process: counted from zero
    seconds = cpu_share.shares(before, after, 1.0, {0})
    assert seconds["model"] == 0.5 and seconds["ray/serve"] == 0.75 and seconds["other"] == 0.0
