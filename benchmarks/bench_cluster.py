"""A local two-node Ray cluster (target / draft labels) and a probe of the bare channel round trip.

``local_cluster()`` starts ``ray.cluster_utils.Cluster`` with one node labelled
``specserve.io/role=target`` (the head; the driver runs here) and one labelled ``draft``,
and always tears both down, also on Ctrl-C. ``measure_rtt()`` places an ``RttProbe`` actor
on the target node and an ``Echo`` actor on the draft node and times what ``RayChannel``
does per step with an empty draft: sleep the one-way delay, call the remote actor, sleep
again. It knows nothing of models or speculation.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import statistics
import threading
import time

ROLE = "specserve.io/role"


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@contextlib.contextmanager
def local_cluster(num_cpus_per_node: float = 2, torch_threads: int = 1):
    """Yield a connected two-node cluster; every actor of this job gets ``torch_threads`` threads."""
    import ray
    from ray.cluster_utils import Cluster

    cluster = previous = None
    try:
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": num_cpus_per_node, "labels": {ROLE: "target"}})
        cluster.add_node(num_cpus=num_cpus_per_node, labels={ROLE: "draft"})
        env = {"OMP_NUM_THREADS": str(torch_threads), "MKL_NUM_THREADS": str(torch_threads), "TOKENIZERS_PARALLELISM": "false"}
        ray.init(address=cluster.address, log_to_driver=False, runtime_env={"env_vars": env})
        # Ray's own SIGTERM handlers (installed above) do not stop a driver blocked in ray.get: make
        # SIGTERM behave like Ctrl-C so the finally below tears the cluster down.
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
    async def round_trips(self, echo, num_samples: int, delay_ms: float, payload_bytes: int) -> list[float]:
        """Round-trip times in ms, each including the emulated delay in both directions."""
        payload, delay_s = b"x" * payload_bytes, delay_ms / 1000.0
        await echo.ping.remote(payload)  # warm: connection to the echo's worker
        samples = []
        for _ in range(num_samples):
            start = time.perf_counter()
            if delay_s:
                await asyncio.sleep(delay_s)
            await echo.ping.remote(payload)
            if delay_s:
                await asyncio.sleep(delay_s)
            samples.append((time.perf_counter() - start) * 1000.0)
        return samples

    def torch_threads(self) -> int:
        import torch

        return torch.get_num_threads()


def start_probes(num_cpus: float = 0.05):
    """(probe on the target node, echo on the draft node)."""
    import ray

    probe = ray.remote(RttProbe).options(num_cpus=num_cpus, label_selector={ROLE: "target"}).remote()
    echo = ray.remote(Echo).options(num_cpus=num_cpus, label_selector={ROLE: "draft"}).remote()
    return probe, echo


def measure_rtt(probe, echo, delay_ms: float, num_samples: int = 50, payload_bytes: int = 256) -> dict:
    """Median / p90 / min of the target -> draft -> target round trip at one emulated one-way delay."""
    import ray

    samples = sorted(ray.get(probe.round_trips.remote(echo, num_samples, delay_ms, payload_bytes)))
    return {
        "delay_ms": delay_ms,
        "rtt_ms_median": statistics.median(samples),
        "rtt_ms_p90": samples[min(len(samples) - 1, int(0.9 * len(samples)))],
        "rtt_ms_min": samples[0],
        "rtt_ms_samples": samples,
    }
