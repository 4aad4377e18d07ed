"""One real local Ray cluster per test module: logical nodes labelled target and draft."""

from __future__ import annotations

import pytest

from ..conftest import free_port, private_ports  # noqa: F401  (free_port: the modules here import it from this file)

ROLE = "specserve.io/role"


def start_cluster(targets: int = 1, drafts: int = 1, cpus: float = 2):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": cpus, "labels": {ROLE: "target"}, **private_ports()})
    for _ in range(targets - 1):
        cluster.add_node(num_cpus=cpus, labels={ROLE: "target"})
    for _ in range(drafts):
        cluster.add_node(num_cpus=cpus, labels={ROLE: "draft"}, resources={"specserve_draft": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    return cluster


@pytest.fixture(scope="module")
def ray_cluster():
    cluster = start_cluster()
    yield cluster
    stop_cluster(cluster)


def stop_cluster(cluster) -> None:
    """Stop the module's cluster and forget Serve's cached controller handle.

    Serve caches its controller client per driver job id, and the first driver of every
    fresh cluster gets the same job id, so without this the next module's `serve.status()`
    would talk to the previous cluster's dead controller.
    """
    import ray
    from ray.serve import context

    ray.shutdown()
    cluster.shutdown()
    getattr(context, "_set_global_client", lambda _: None)(None)


def node_labels(node_id: str) -> dict:
    import ray

    return next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)


def serve_actors(app: str, deployment: str) -> list:
    """(actor handle, pid, node id) of each live replica of one deployment of one app."""
    import ray
    from ray.util.state import list_actors

    out = []
    # This driver's cluster by its address: left to find one, the state API takes the newest local
    # Ray, which may be another one on the same machine.
    address = ray.get_runtime_context().gcs_address
    for a in list_actors(address=address, filters=[("class_name", "=", f"ServeReplica:{app}:{deployment}"), ("state", "=", "ALIVE")],
                         detail=True):
        out.append((ray.get_actor(a.name, namespace="serve"), a.pid, a.node_id))
    return out
