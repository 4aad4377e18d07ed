"""Place the target and draft sides: one placement group, one bundle per side.

A side is pinned by node label (default ``specserve.io/role`` = ``target`` / ``draft``,
any selector accepted, e.g. ``ray.io/accelerator-type: GeForce-RTX-5090``) and/or by custom
resources. Infeasible placements fail within seconds with an error that names the label or
resource no node offers and lists what the nodes do offer. Starts a local Ray when asked to
and none is running.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field

from ..config import DEFAULT_ROLE_LABEL, EngineConfig, SideConfig

logger = logging.getLogger(__name__)

TARGET_BUNDLE, DRAFT_BUNDLE = 0, 1


class PlacementError(ValueError):
    """The requested placement cannot be satisfied by any node of the cluster."""


@dataclass(frozen=True)
class Placement:
    address: str | None = None  # "auto"/"host:port": join; "local": start a fresh one; None: join a running one, else start one
    strategy: str = "PACK"  # placement-group strategy; labels decide the node of each side
    role_label: str = DEFAULT_ROLE_LABEL  # default selector key when a side sets no label_selector
    # "auto": pin sides by the role label when some node carries it, else colocate (one
    # unlabelled node) with a warning; True: always require it; False: resources only.
    use_role_labels: bool | str = "auto"
    channel: str = "ray"  # "ray" (object store, works everywhere) | "collective" (ray.util.collective tensors)
    collective_backend: str = "gloo"  # "gloo" on CPU, "nccl" between two GPUs
    channel_delay_ms: float = float(os.environ.get("SPECSERVE_CHANNEL_DELAY_MS", "0") or 0)  # emulated one-way link delay
    draft_timeout_s: float = 10.0  # a draft step slower than this falls back to target-only
    draft_probe_interval_s: float = 1.0  # how often a down draft is probed for its return
    ready_timeout_s: float = 30.0  # how long to wait for the placement group
    draft_max_restarts: int = -1  # Ray restarts a dead draft actor (-1: forever)
    runtime_env: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.use_role_labels not in (True, False, "auto"):
            raise ValueError(f"use_role_labels must be true, false or 'auto', got {self.use_role_labels!r}")
        if self.channel not in ("ray", "collective"):
            raise ValueError(f"channel must be 'ray' or 'collective', got {self.channel!r}")
        if self.collective_backend not in ("gloo", "nccl"):
            raise ValueError(f"collective_backend must be 'gloo' or 'nccl', got {self.collective_backend!r}")
        if self.strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError(f"strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got {self.strategy!r}")
        for name in ("channel_delay_ms", "draft_timeout_s", "ready_timeout_s", "draft_probe_interval_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


def connect(placement: Placement) -> bool:
    """Join the cluster at ``placement.address`` (or a running one); start a local one if none.

    Returns True when this call started a fresh local cluster.
    """
    import ray

    if ray.is_initialized():
        return False
    if placement.address == "local":
        ray.init(runtime_env=placement.runtime_env or None, log_to_driver=False)
        return True
    if placement.address:
        ray.init(address=placement.address, runtime_env=placement.runtime_env or None, log_to_driver=False)
        return False
    try:
        ray.init(address="auto", runtime_env=placement.runtime_env or None, log_to_driver=False)
        return False
    except ConnectionError:
        logger.info("no running Ray cluster found: starting a local one")
        ray.init(runtime_env=placement.runtime_env or None, log_to_driver=False)
        return True


def side_selector(side: SideConfig, role: str, placement: Placement, local: bool, nodes: list[dict]) -> dict[str, str]:
    if side.label_selector:
        return dict(side.label_selector)
    if placement.use_role_labels is False or local:
        return {}
    if placement.use_role_labels == "auto" and not any(placement.role_label in (n.get("Labels") or {}) for n in nodes if n.get("Alive")):
        logger.warning("no node carries the label %s: placing the %s side on any node (colocated)", placement.role_label, role)
        return {}
    return {placement.role_label: role}


def side_bundle(side: SideConfig) -> dict[str, float]:
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


def check_feasible(role: str, selector: dict[str, str], bundle: dict[str, float], nodes: list[dict]) -> None:
    """Raise ``PlacementError`` naming what no node offers for this side."""
    alive = [n for n in nodes if n.get("Alive")]
    with_labels = [n for n in alive if all(_label_matches(n.get("Labels") or {}, k, v) for k, v in selector.items())]
    if not with_labels:
        missing = ", ".join(f"{k}={v}" for k, v in selector.items())
        raise PlacementError(
            f"cannot place the {role} side: no node has the label {missing}. Nodes offer:\n{describe_nodes(alive)}\n"
            f"Start the {role} node with `ray start ... --labels=\"{', '.join(f'{k}={v}' for k, v in selector.items())}\"` "
            f"or set a different label_selector for the {role}."
        )
    for key, amount in bundle.items():
        if not any(n.get("Resources", {}).get(key, 0) >= amount for n in with_labels):
            raise PlacementError(
                f"cannot place the {role} side: no node{' with ' + str(selector) if selector else ''} offers "
                f"{key}={amount:g}. Nodes offer:\n{describe_nodes(alive)}"
            )


def create_placement_group(config: EngineConfig, placement: Placement, local: bool):
    """One bundle per side (target first, then draft); waits ready or raises ``PlacementError``."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    sides = [("target", config.target)]
    if config.speculative:
        sides.append(("draft", config.draft))
    nodes = ray.nodes()
    bundles, selectors = [], []
    for role, side in sides:
        selector = side_selector(side, role, placement, local, nodes)
        bundle = side_bundle(side)
        check_feasible(role, selector, bundle, nodes)
        bundles.append(bundle)
        selectors.append(selector)
    pg = placement_group(bundles, strategy=placement.strategy, bundle_label_selector=selectors)
    if not pg.wait(placement.ready_timeout_s):
        remove_placement_group(pg)
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU") or not k.startswith(("node:", "memory", "object_store"))}
        raise PlacementError(
            f"placement group {bundles} with label selectors {selectors} (strategy {placement.strategy}) was not "
            f"ready within {placement.ready_timeout_s:g}s: the cluster has {free} free (other actors, e.g. Serve "
            f"replicas, hold the rest; lower num_cpus/num_gpus of a side or add nodes); nodes offer:\n{describe_nodes(ray.nodes())}"
        )
    return pg
