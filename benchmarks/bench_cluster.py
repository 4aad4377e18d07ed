"""A local two-node Ray cluster (target / draft labels) that emulates two devices, and a round-trip probe.

``local_cluster()`` starts ``ray.cluster_utils.Cluster`` with one node labelled
``specserve.io/role=target`` (the head; the driver runs here) and one labelled ``draft``,
gives every actor one torch/OpenMP thread, and always tears both nodes down, also on Ctrl-C
or SIGTERM. With ``two_device`` (the default on machines with >= 2 cores) each node is a
device of its own: its raylet is started while this process is pinned to that node's core
set (``os.sched_setaffinity``), so every worker it spawns inherits the set, and the driver
then stays on the target's cores, so whatever runs in it or starts from it (in-process and
colocated peers, vLLM subprocesses) is confined to the target's box. The nodes still share
memory bandwidth, which two real devices would not. ``measure_rtt()`` times an actor on the
target node calling one on the draft node, with an emulated one-way delay slept in each
direction. Knows nothing of models.

    python -m benchmarks.bench_cluster --delays-ms 0,1,5     # bare round trips, two local nodes
"""

from __future__ import annotations

import contextlib
import os
import signal
import statistics
import threading
import time

ROLE = "specserve.io/role"
# One thread per process; vLLM's CPU build must not re-bind OpenMP threads outside the inherited core set.
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def split_cores(cpus: set[int] | None = None) -> tuple[set[int], set[int]] | None:
    """(target cores, draft cores): this process's cores in two disjoint halves; None with < 2 cores."""
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if len(cpus) < 2:
        return None
    half = (len(cpus) + 1) // 2  # an odd core goes to the target, the bigger box
    return set(cpus[:half]), set(cpus[half:])


@contextlib.contextmanager
def pinned(cpus: set[int] | None):
    """Run the block (and every process it starts) on ``cpus``; the previous set is restored after."""
    if cpus is None:
        yield
        return
    previous = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, previous)


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def local_cluster(num_cpus_per_node: float = 8, two_device: bool | None = None, head: str = "target"):
    """Yield a connected two-node cluster (logical CPUs: fractional sides fit many systems at once).

    ``two_device`` (default: when this process has >= 2 cores): pin each node to its own half of
    the cores and keep this driver on the target's half until the cluster is down. The cluster
    object gets ``target_cpus`` / ``draft_cpus`` (None when not pinned).

    ``head``: which box is Ray's head node, ``target`` (the default, as the cluster YAMLs) or
    ``draft``. The head holds Ray's control plane (GCS, dashboard), Serve's controller and proxy,
    and, under direct ingress, specserve's router and Registry, so it decides which emulated
    device pays for them."""
    import ray
    from ray.cluster_utils import Cluster

    from specserve.distributed.placement import sigint_shielded

    if head not in ("target", "draft"):
        raise ValueError(f"head must be 'target' or 'draft', got {head!r}")
    cores = split_cores() if two_device in (None, True) else None
    if two_device and cores is None:
        raise ValueError("two_device needs at least 2 CPU cores in this process's affinity set")
    target_cpus, draft_cpus = cores or (None, None)
    cluster = previous = None
    driver_cpus = os.sched_getaffinity(0)
    try:
        # A terminal's Ctrl-C must reach only this driver (which then stops Ray in order), not the raylets.
        with sigint_shielded():
            first, second = ("target", "draft") if head == "target" else ("draft", "target")
            cpus = {"target": target_cpus, "draft": draft_cpus}
            with pinned(cpus[first]):
                cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus_per_node, "labels": {ROLE: first}})
            with pinned(cpus[second]):
                cluster.add_node(num_cpus=num_cpus_per_node, labels={ROLE: second})
        cluster.target_cpus, cluster.draft_cpus = target_cpus, draft_cpus
        if target_cpus is not None:
            os.sched_setaffinity(0, target_cpus)  # the driver lives on the target's box
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": THREAD_ENV})
        # Ray's own SIGTERM handler does not stop a driver blocked in ray.get: make SIGTERM behave
        # like Ctrl-C so the finally below tears the cluster down.
        if threading.current_thread() is threading.main_thread():
            previous = signal.signal(signal.SIGTERM, _raise_interrupt)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if ray.is_initialized():
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        os.sched_setaffinity(0, driver_cpus)


class Echo:
    def ping(self, payload: bytes) -> bytes:
        return payload


class RttProbe:
    def round_trips(self, echo, num_samples: int, delay_ms: float, payload_bytes: int) -> list[float]:
        """Round-trip times in ms, each including the emulated delay in both directions."""
        import ray

        payload, delay_s = b"x" * payload_bytes, delay_ms / 1000.0
        ray.get(echo.ping.remote(payload))  # warm: connection to the echo's worker
        samples = []
        for _ in range(num_samples):
            start = time.perf_counter()
            if delay_s:
                time.sleep(delay_s)
            ray.get(echo.ping.remote(payload))
            if delay_s:
                time.sleep(delay_s)
            samples.append((time.perf_counter() - start) * 1000.0)
        return samples


def measure_rtt(delays_ms: list[float], num_samples: int = 30, payload_bytes: int = 256) -> list[dict]:
    """Median / p90 / min target-node -> draft-node -> back, per one-way delay (actors killed after)."""
    import ray

    probe = ray.remote(RttProbe).options(num_cpus=0.01, label_selector={ROLE: "target"}).remote()
    echo = ray.remote(Echo).options(num_cpus=0.01, label_selector={ROLE: "draft"}).remote()
    try:
        out = []
        for d in delays_ms:
            samples = sorted(ray.get(probe.round_trips.remote(echo, num_samples, d, payload_bytes)))
            out.append({"delay_ms": d, "rtt_ms_median": statistics.median(samples), "rtt_ms_min": samples[0],
                        "rtt_ms_p90": samples[min(len(samples) - 1, int(0.9 * len(samples)))]})
        return out
    finally:
        ray.kill(probe)
        ray.kill(echo)


def main(argv=None) -> int:
    from .cli import parser

    p = parser("benchmarks.bench_cluster", "What does a bare round trip between the two local Ray nodes of the harness cost, "
               "with and without an emulated delay?\n\nAn actor on the target node calls one on the draft node; the delay "
               "is slept once each way.")
    p.add_argument("--delays-ms", default="0,1,5", help="emulated one-way delays, comma-separated")
    p.add_argument("--samples", type=int, default=50, help="round trips per delay")
    a = p.parse_args(argv)
    with local_cluster():
        for row in measure_rtt([float(x) for x in a.delays_ms.split(",")], a.samples):
            print(f"one-way delay {row['delay_ms']:g} ms: RTT median {row['rtt_ms_median']:.2f} ms "
                  f"(min {row['rtt_ms_min']:.2f}, p90 {row['rtt_ms_p90']:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
