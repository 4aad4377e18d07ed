"""One real local Ray cluster per test module: two logical nodes labelled target and draft."""

from __future__ import annotations

import pytest

ROLE = "specserve.io/role"


@pytest.fixture(scope="module")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "labels": {ROLE: "target"}})
    cluster.add_node(num_cpus=2, labels={ROLE: "draft"}, resources={"specserve_draft": 1})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def node_labels(node_id: str) -> dict:
    import ray

    return next(n["Labels"] for n in ray.nodes() if n["NodeID"] == node_id)
