"""A local two-node Ray cluster (target / draft labels) and a probe of the bare round trip between them.

``local_cluster()`` starts ``ray.cluster_utils.Cluster`` with one node labelled
``specserve.io/role=target`` (the head; the driver runs here) and one labelled ``draft``,
gives every actor one torch/OpenMP thread, and always tears both nodes down, also on Ctrl-C
or SIGTERM. ``measure_rtt()`` times an actor on the target node calling one on the draft
node, with an emulated one-way delay slept in each direction. Knows nothing of models.

    python -m benchmarks.bench_cluster --delays-ms 0,1,5     # bare round trips, two local nodes
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import statistics
import threading
import time

ROLE = "specserve.io/role"
THREAD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def local_cluster(num_cpus_per_node: float = 8):
    """Yield a connected two-node cluster (logical CPUs: fractional sides fit many systems at once)."""
    import ray
    from ray.cluster_utils import Cluster

    from specserve.distributed.placement import sigint_shielded

    cluster = previous = None
    try:
        # A terminal's Ctrl-C must reach only this driver (which then stops Ray in order), not the raylets.
        with sigint_shielded():
            cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus_per_node, "labels": {ROLE: "target"}})
            cluster.add_node(num_cpus=num_cpus_per_node, labels={ROLE: "draft"})
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


if __name__ == "__main__":
    p = argparse.ArgumentParser(description="bare round trip between two local Ray nodes")
    p.add_argument("--delays-ms", default="0,1,5")
    p.add_argument("--samples", type=int, default=50)
    a = p.parse_args()
    with local_cluster():
        for row in measure_rtt([float(x) for x in a.delays_ms.split(",")], a.samples):
            print(f"one-way delay {row['delay_ms']:g} ms: RTT median {row['rtt_ms_median']:.2f} ms "
                  f"(min {row['rtt_ms_min']:.2f}, p90 {row['rtt_ms_p90']:.2f})")
