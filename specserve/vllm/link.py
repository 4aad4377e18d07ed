"""How a vLLM target's proposer, which vLLM constructs, finds the drafts.

In this process: whoever starts the vLLM engine parks a ``DraftLink`` (``build.py``:
discover, connect, target id) under a key and passes the key in vLLM's
``additional_config``; the proposer picks the link up and puts itself in the same slot, so
the engine can read its pool and per-step counts. From another process (``vllm serve``,
tensor-parallel workers) the environment names the drafts: ``SPECSERVE_DRAFT_ADDRESS=
host:port[,host:port]`` (draft servers, e.g. ``specserve draft``) or
``SPECSERVE_DRAFT_APP=<Serve app>`` (that app's ``Registry`` deployment lists its live
drafts, on the Ray cluster ``RAY_ADDRESS`` names), and ``SPECSERVE_DRAFT_TOKEN`` the secret
the drafts require (``secret.py``). Knows nothing of vLLM.
"""

from __future__ import annotations

import itertools
import os
import socket
from dataclasses import dataclass

from ..build import DraftLink
from ..secret import resolve_token
from ..transport import SocketEndpoint, parse_address

ADDRESS_ENV = "SPECSERVE_DRAFT_ADDRESS"
APP_ENV = "SPECSERVE_DRAFT_APP"
_ids = itertools.count()


@dataclass
class Slot:
    link: DraftLink
    proposer: object | None = None  # set by the proposer vLLM built in this process


_slots: dict[str, Slot] = {}


def park(link: DraftLink) -> str:
    key = f"specserve-link-{os.getpid()}-{next(_ids)}"
    _slots[key] = Slot(link)
    return key


def find(key: str | None) -> Slot | None:
    return _slots.get(key) if key else None


def release(key: str) -> None:
    _slots.pop(key, None)


def default_target_id() -> str:
    return f"vllm-{socket.gethostname()}-{os.getpid()}"


def from_names(addresses: list[str], app: str | None, delay_ms: float = 0.0, target_id: str | None = None) -> DraftLink | None:
    """A link to fixed draft addresses, or to the drafts a Serve app's registry lists; None if neither is given.
    The drafts' secret comes from ``$SPECSERVE_DRAFT_TOKEN``."""
    token = resolve_token()
    connect = lambda name, address: SocketEndpoint(address, delay_ms, token=token)  # noqa: E731
    target_id = target_id or default_target_id()
    if addresses:
        for a in addresses:
            parse_address(a)  # a typo fails at start-up, not as a draft that never answers
        return DraftLink(lambda: {a: a for a in addresses}, connect, target_id)
    if app:
        return DraftLink(ServeRegistryDiscovery(app), connect, target_id)
    return None


def from_env(delay_ms: float = 0.0) -> DraftLink | None:
    """The drafts the environment names, or None when it names none."""
    addresses = [a.strip() for a in os.environ.get(ADDRESS_ENV, "").split(",") if a.strip()]
    return from_names(addresses, os.environ.get(APP_ENV) or None, delay_ms)


def portable(link: DraftLink, wait_s: float = 60.0) -> dict:
    """What a proposer in another process (tensor-parallel workers) needs to find the same drafts:
    this Serve app's name inside a Serve replica, else the draft addresses discovered now."""
    import time

    try:
        from ray import serve

        return {"app": serve.get_replica_context().app_name}
    except Exception:  # not a Serve replica
        pass
    deadline = time.monotonic() + wait_s
    while True:
        found = link.discover()
        if any(not isinstance(a, str) for a in found.values()):
            raise ValueError("a vLLM target whose proposer runs in vLLM's worker processes (tensor_parallel_size > 1) "
                             "cannot reach a draft inside this process: run the sides apart (ray=True, Serve, or "
                             f"`specserve draft` + {ADDRESS_ENV})")
        if found or time.monotonic() > deadline:
            return {"addresses": sorted(found.values())}
        time.sleep(0.5)


class ServeRegistryDiscovery:
    """Draft addresses from the ``Registry`` deployment of a specserve Serve app (joins Ray here)."""

    def __init__(self, app: str):
        import ray
        from ray import serve

        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or "auto", log_to_driver=False)
        self.registry = serve.get_deployment_handle("Registry", app_name=app)

    def __call__(self) -> dict[str, str]:
        return self.registry.drafts.remote().result(timeout_s=5)
