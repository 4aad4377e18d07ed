"""Join a Ray cluster and place each side's replicas by node label or custom resource.

Joining is predictable: ``cluster.address`` (``host:port`` or ``auto``) or ``RAY_ADDRESS``
names the cluster to join; otherwise a fresh local cluster starts, never someone else's.
A side is pinned by label (default ``specserve.io/role=target`` / ``draft``; any selector,
e.g. ``ray.io/accelerator-type: GeForce-RTX-5090``) and/or custom resources. The batch API
places its actors in one placement group (one bundle per replica, ``bundle_label_selector``);
Serve places replicas itself from the same selector (``ray_actor_options``). A placement no
node can satisfy fails within seconds, naming the label or resource and what nodes offer.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading

from ..config import ClusterConfig, SideConfig

logger = logging.getLogger(__name__)


class PlacementError(ValueError):
    """The requested placement cannot be satisfied by any node of the cluster."""


@contextlib.contextmanager
def sigint_shielded():
    """Processes started inside inherit an ignored SIGINT: a terminal's Ctrl-C then reaches only
    this driver, whose shutdown stops Ray in order, instead of killing the raylet under its workers
    (orphaned workers, e.g. Serve's proxy holding the HTTP port, linger for a minute)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def will_start_ray(cluster: ClusterConfig) -> bool:
    """Will ``connect`` start a fresh local Ray (rather than join one)?"""
    import ray

    return not ray.is_initialized() and (cluster.address or os.environ.get("RAY_ADDRESS") or "local") == "local"


def connect(cluster: ClusterConfig, log_to_driver: bool = True) -> bool:
    """Join the named cluster, or start a fresh local one. True when this call started Ray."""
    import ray

    if ray.is_initialized():
        return False
    address = cluster.address or os.environ.get("RAY_ADDRESS") or "local"
    env = cluster.runtime_env or None
    if address == "local":
        logger.info("starting a local Ray cluster (set cluster address or RAY_ADDRESS to join a running one)")
        with sigint_shielded():
            ray.init(address="local", runtime_env=env, log_to_driver=log_to_driver, include_dashboard=False)
        return True
    try:
        ray.init(address=address, runtime_env=env, log_to_driver=log_to_driver)
    except ConnectionError as exc:
        raise PlacementError(
            f"cannot join the Ray cluster at {address!r}: {exc}. Start one with `ray start --head`, fix the address, "
            "or leave the address unset (and RAY_ADDRESS empty) to start a local cluster"
        ) from None
    return False


def side_selector(side: SideConfig, role: str, cluster: ClusterConfig, nodes: list[dict]) -> dict[str, str]:
    if side.label_selector:
        return dict(side.label_selector)
    if cluster.use_role_labels is False:
        return {}
    labelled = any(cluster.role_label in (n.get("Labels") or {}) for n in nodes if n.get("Alive"))
    if cluster.use_role_labels == "auto" and not labelled:
        logger.info("no node carries the label %s: the %s side may run on any node", cluster.role_label, role)
        return {}
    return {cluster.role_label: role}


def side_resources(side: SideConfig) -> dict[str, float]:
    bundle = {"CPU": float(side.num_cpus)}
    if side.num_gpus:
        bundle["GPU"] = float(side.num_gpus)
    bundle.update({k: float(v) for k, v in side.resources.items()})
    return {k: v for k, v in bundle.items() if v > 0} or {"CPU": 0.01}


def _label_matches(labels: dict, key: str, expr: str) -> bool:
    value = labels.get(key)
    expr = str(expr)
    if expr.startswith("!in(") and expr.endswith(")"):
        return value not in [v.strip() for v in expr[4:-1].split(",")]
    if expr.startswith("in(") and expr.endswith(")"):
        return value in [v.strip() for v in expr[3:-1].split(",")]
    if expr.startswith("!"):
        return value != expr[1:]
    return value == expr


def describe_nodes(nodes: list[dict]) -> str:
    lines = []
    for n in nodes:
        labels = {k: v for k, v in (n.get("Labels") or {}).items() if k != "ray.io/node-id"}
        resources = {k: v for k, v in n.get("Resources", {}).items() if not k.startswith("node:") and k not in ("memory", "object_store_memory")}
        lines.append(f"  node {n['NodeID'][:8]} ({n.get('NodeManagerAddress')}): labels {labels}, resources {resources}")
    return "\n".join(lines) or "  (no alive nodes)"


def _label_hint(role: str, selector: dict[str, str]) -> str:
    own = {k: v for k, v in selector.items() if not k.startswith("ray.io/")}
    ray_set = [k for k in selector if k.startswith("ray.io/")]
    hints = []
    if own:
        hints.append(f"start the {role} node with `ray start ... --labels=\"{','.join(f'{k}={v}' for k, v in own.items())}\"`")
    if ray_set:
        hints.append(f"{', '.join(ray_set)} is set by Ray itself (ray.io/accelerator-type comes from the node's GPU), so it "
                     "cannot be given to `ray start`: add a node that has it or select on a label of your own")
    return "; ".join(hints) + f", or set a different label_selector for the {role}"


def check_feasible(role: str, selector: dict[str, str], bundle: dict[str, float], nodes: list[dict]) -> None:
    """Raise ``PlacementError`` naming what no node offers for this side."""
    alive = [n for n in nodes if n.get("Alive")]
    with_labels = [n for n in alive if all(_label_matches(n.get("Labels") or {}, k, v) for k, v in selector.items())]
    if not with_labels:
        missing = ", ".join(f"{k}={v}" for k, v in selector.items())
        raise PlacementError(
            f"cannot place the {role} side: no node has the label {missing}. Nodes offer:\n{describe_nodes(alive)}\n"
            f"To fix: {_label_hint(role, selector)}."
        )
    for key, amount in bundle.items():
        if not any(n.get("Resources", {}).get(key, 0) >= amount for n in with_labels):
            where = f" with labels {selector}" if selector else ""
            raise PlacementError(
                f"cannot place the {role} side: no node{where} offers {key}={amount:g}. Nodes offer:\n{describe_nodes(alive)}"
            )


def create_placement_group(bundles: list[tuple[str, SideConfig]], cluster: ClusterConfig):
    """One bundle per (role, side) replica; waits until placed or raises ``PlacementError``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    nodes = ray.nodes()
    resources, selectors = [], []
    for role, side in bundles:
        selector = side_selector(side, role, cluster, nodes)
        bundle = side_resources(side)
        check_feasible(role, selector, bundle, nodes)
        resources.append(bundle)
        selectors.append(selector)
    pg = placement_group(resources, strategy="PACK", bundle_label_selector=selectors)
    if not pg.wait(cluster.placement_timeout_s):
        remove_placement_group(pg)
        free = {k: round(v, 2) for k, v in ray.available_resources().items()
                if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store", "bundle_group"))}
        wanted = "; ".join(f"{role}: {r} on {s or 'any node'}" for (role, _), r, s in zip(bundles, resources, selectors))
        raise PlacementError(
            f"the sides could not be placed within {cluster.placement_timeout_s:g}s ({wanted}). The cluster has {free} "
            f"free; other actors (e.g. Serve replicas) hold the rest. Lower num_cpus/num_gpus of a side, add nodes, or raise "
            f"placement_timeout_s. Nodes offer:\n{describe_nodes(ray.nodes())}"
        )
    return pg
