"""How HTTP reaches the router: Serve's direct ingress (the default) or Serve's proxy.

With Serve's proxy, every request and every streamed chunk crosses one more process: the proxy
takes the HTTP request, calls the router replica through Ray, the router fetches the body back
from the proxy, and each chunk returns the same way. Under a burst of new requests that hop was
the largest cost left on the path (benchmarks/README.md, "Serve's direct ingress").

Serve's direct ingress (``RAY_SERVE_ENABLE_DIRECT_INGRESS``) runs the router's HTTP server inside
the router replica itself. Serve reads the switch when its controller and replicas start, so it
belongs to the cluster, not to the app: ``specserve serve`` sets it for a local Ray it starts,
and the cluster YAMLs export it before ``ray start --head``. What it needs:

- the router replica listens on a port Serve allocates from ``[MIN, MAX)``: specserve makes that
  the server's port (one port per router replica, ``port .. port + replicas - 1``) and places the
  router on the head node, where the URL points;
- Serve still starts its proxy, on the head only: it listens on ``MAX``, the first port after the
  routers', and serves the same app (same key, same limits), the slower way;
- a released port is handed out again at once (no quarantine: no HAProxy here), and a stopping
  router drains for ``DRAIN_S`` (Serve's default 30 s is for cloud load balancers).

A cluster started without the switch keeps working through the proxy on the server's port;
``specserve serve`` then says so and how to turn it on.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time

logger = logging.getLogger("specserve.serve")

SWITCH = "RAY_SERVE_ENABLE_DIRECT_INGRESS"
MIN_PORT, MAX_PORT = "RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", "RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"
DRAIN_S = 2.0
HEAD = "node:__internal_head__"  # the resource Ray gives its head node (Ray's own state actors pin with it)


def direct_ingress_env(port: int, router_replicas: int = 1) -> dict[str, str]:
    """The environment a Ray head needs for direct ingress on ``port`` (set it before ``ray start``)."""
    if not 1 <= port <= 65535 - router_replicas:
        raise ValueError(f"port {port}: direct ingress needs ports {port}..{port + router_replicas} free")
    return {SWITCH: "1", MIN_PORT: str(port), MAX_PORT: str(port + router_replicas),  # (Serve's MAX is exclusive)
            "RAY_SERVE_PORT_QUARANTINE_S": "0", "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": str(DRAIN_S)}


def shell_exports(port: int, router_replicas: int = 1) -> str:
    """The same as a line of shell, for ``ray start`` commands and the README."""
    return " ".join(f"{k}={v}" for k, v in direct_ingress_env(port, router_replicas).items())


@functools.lru_cache(maxsize=1)
def _head_env(gcs_address: str) -> dict[str, str]:
    import ray

    @ray.remote(num_cpus=0, resources={HEAD: 0.001})
    def read(names):
        return {n: os.environ[n] for n in names if n in os.environ}

    return ray.get(read.remote([SWITCH, MIN_PORT, MAX_PORT]), timeout=120)


def cluster_ports() -> tuple[int, int] | None:
    """The head node's direct-ingress ports ``[low, high)``, or None when its Serve runs the proxy only.

    Read from the head's own environment (a task pinned there), since Serve's controller and the
    router replica, both on the head, read theirs when they start."""
    import ray

    env = _head_env(ray.get_runtime_context().gcs_address)
    if env.get(SWITCH) != "1":
        return None
    return int(env.get(MIN_PORT, 30000)), int(env.get(MAX_PORT, 31000))


def start_serve(host: str, port: int, router_replicas: int = 1, **options) -> bool:
    """``serve.start`` for an app whose URL is ``http://host:port``. True: direct ingress.

    With direct ingress the router replica takes ``port`` and Serve's proxy the first port after
    the router range; without it the proxy takes ``port``."""
    from ray import serve

    ports = cluster_ports()
    if ports is None:
        serve.start(http_options={"host": host, "port": port}, **options)
        return False
    low, high = ports
    if not low <= port < high or port + router_replicas > high:
        raise ValueError(f"port {port}: this Ray cluster's direct ingress serves ports {low}..{high - 1} "
                         f"({MIN_PORT}/{MAX_PORT} on its head); serve on port {low}, or restart the head with "
                         f"`{shell_exports(port, router_replicas)} ray start --head ...`")
    serve.start(http_options={"host": host, "port": high}, **options)
    return True


def router_placement() -> dict:
    """Ray actor options for the router replica: on the head node under direct ingress (the URL's
    host, and where Serve's controller allocates its port), anywhere behind the proxy."""
    return {"resources": {HEAD: 0.001}} if cluster_ports() is not None else {}


def _bindable(host: str, port: int) -> bool:
    """Would Serve's bind succeed? (It binds the router's port without SO_REUSEADDR.)"""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def _listening(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1" if host in ("0.0.0.0", "") else "::1" if host == "::" else host, port)) == 0


def wait_for_ports(host: str, timeout_s: float = 90.0) -> list[int]:
    """In a router replica under direct ingress, before Serve binds its port: wait until each port of
    the router range can be bound, or is already served (a sibling router). Returns the ports still
    unavailable at the deadline.

    Serve binds without SO_REUSEADDR, so a port whose previous server stopped less than a minute ago
    fails while that server's last connections sit in TIME_WAIT; Serve then blocks the port for the
    app's life and every retry of the router fails. Restarting `specserve serve` right after Ctrl-C
    did exactly that."""
    try:
        low, high = int(os.environ[MIN_PORT]), int(os.environ[MAX_PORT])
    except (KeyError, ValueError):
        return []
    deadline, said = time.monotonic() + timeout_s, False
    while True:
        pending = [p for p in range(low, high) if not _bindable(host, p) and not _listening(host, p)]
        if not pending or time.monotonic() > deadline:
            return pending
        if not said:
            said = True
            logger.warning("waiting for port(s) %s on %s: a previous server's connections are still closing (TIME_WAIT, "
                           "up to a minute)", pending, host)
        time.sleep(0.5)


def serving_direct() -> bool:
    """In a replica: does this process serve HTTP itself (Serve's direct ingress)?"""
    try:
        from ray.serve._private import constants
    except ImportError:  # pragma: no cover - Serve moved its constants: report the proxy, the safe answer
        return False
    return bool(getattr(constants, "RAY_SERVE_ENABLE_DIRECT_INGRESS", False))
