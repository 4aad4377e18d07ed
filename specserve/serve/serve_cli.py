"""``specserve serve``: check everything, join (or start) Ray, deploy the app, serve until Ctrl-C.

Order matters for a newcomer: the configuration, the models' paths, the vocabularies, the
devices and the port are checked before Ray starts (seconds, one line on failure); the API
key is resolved here, from ``--api-key``, ``--api-key-file`` or this process's
``SPECSERVE_API_KEY``, and travels in the app's configuration, so it holds whichever
cluster the app lands on. Model loading progress comes from the nodes' own logs; a failed
replica constructor is reported by its root cause; a ``ready:`` line says when to connect.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time

logger = logging.getLogger("specserve")


class _DropMessages(logging.Filter):
    """Silence Serve lines that mislead here (our http options are applied by ``serve.start``)."""

    NOISE = ("New http_options/controller_options will not be applied",
             "is ready at http")  # Serve's proxy URL; ours follows as "ready:" (under direct ingress the router's port)

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(n in record.getMessage() for n in self.NOISE)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def with_api_key(cfg):
    """Resolve the key in this process (flag, file, or env) and put it in the app's configuration."""
    server = cfg.server
    key = server.api_key
    if key is None and server.api_key_file:
        try:
            with open(server.api_key_file) as f:
                key = f.read().strip()
        except OSError as exc:
            raise ValueError(f"api_key_file {server.api_key_file!r}: {exc.strerror}") from None
    key = key or os.environ.get("SPECSERVE_API_KEY") or None
    if key is not None and not key.strip():
        raise ValueError("the API key is empty")
    return cfg.model_copy(update={"server": server.model_copy(update={"api_key": key, "api_key_file": None})})


def deployment_errors(app_name: str) -> list[str]:
    """The root cause of each failed deployment (the last line of its replica's traceback)."""
    from ray import serve

    try:
        app = serve.status().applications.get(app_name)
    except Exception:  # Serve itself is down: nothing more to say
        return []
    if app is None:
        return []
    out = []
    for name, dep in app.deployments.items():
        message = (dep.message or "").strip()
        if dep.status in ("DEPLOY_FAILED", "UNHEALTHY") and message:
            lines = [line.strip() for line in message.splitlines() if line.strip()]
            cause = next((line for line in reversed(lines) if "Error" in line.split(":")[0] or "Exception" in line), lines[-1])
            out.append(f"{name}: {cause}")
    if not out and app.message:
        out.append(app.message.strip().splitlines()[-1])
    return out


def run_server(cfg, app_name: str = "specserve") -> int:
    from ray import serve

    from ..distributed.placement import connect, will_start_ray
    from ..preflight import check_port, preflight
    from . import ingress
    from .app import build_app

    cfg = with_api_key(cfg)
    preflight(cfg, distributed=True, http=True)
    host, port, routers = cfg.server.host, cfg.server.port, cfg.server.router_num_replicas
    if will_start_ray(cfg.cluster):  # Serve reads its ingress switch from the environment its head starts with
        # Several routers: Serve's proxy balances them on the one port (direct ingress would give each its own port).
        if cfg.server.ingress == "direct" and routers == 1:
            check_port(host, port + 1, what="(Serve's proxy under direct ingress; server.ingress: proxy uses the port alone)")
            os.environ.update(ingress.direct_ingress_env(port))
        else:
            os.environ.pop(ingress.SWITCH, None)
    started = connect(cfg.cluster)
    # Ray replaced the SIGTERM handler (a C++ stack dump): stop as cleanly as on Ctrl-C instead.
    signal.signal(signal.SIGTERM, _interrupt)
    logging.getLogger("ray.serve").addFilter(_DropMessages())
    try:
        # Serve's own actors at WARNING: the nodes' model-loading progress stays readable.
        if not ingress.start_serve(host, port, routers, logging_config={"log_level": "WARNING"}) and not started and routers == 1:
            print("note: this Ray cluster's Serve has no direct ingress, so requests go through Serve's proxy (slower "
                  f"under load); start its head with `{ingress.shell_exports(port, routers)} ray start --head ...` "
                  "(cluster/README.md)", flush=True)
        draft = cfg.draft.model or cfg.draft.drafter if cfg.draft is not None else "none (target-only)"
        print(f"deploying: target {cfg.target.model} x{cfg.target.num_replicas}, draft {draft}"
              f"{' x' + str(cfg.draft.num_replicas) if cfg.draft is not None else ''} "
              "(model loading progress from the nodes follows)", flush=True)
        try:
            serve.run(build_app(cfg.model_dump()), name=app_name, route_prefix="/")
        except RuntimeError as exc:
            causes = deployment_errors(app_name) or [str(exc).strip().splitlines()[-1]]
            causes = [f"Router: port {port} on {host} could not be bound (another server holds it, or its connections were "
                      "still closing after 90 s): pass another --port" if "NoAvailablePortError" in c else c for c in causes]
            print("specserve: error: the app failed to start:\n  " + "\n  ".join(causes), file=sys.stderr)
            return 1
        key_note = " (API key required)" if cfg.server.api_key else ""
        print(f"ready: http://{host}:{port}/v1 (model id {cfg.model_name!r}){key_note}; Ctrl-C to stop", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    finally:
        # A Ray we started stops with everything in it. In a cluster we joined, delete only our app
        # (it may serve others). Never serve.shutdown(): Ray logs an alarming "graceful_shutdown
        # failed ... infinite retries" line for it.
        import ray

        if started:
            ray.shutdown()
        else:
            try:
                serve.delete(app_name, _blocking=True)
            except Exception:  # already gone (e.g. the cluster stopped first)
                pass
