"""The Ray Serve application: Registry, Draft and Target deployments behind the OpenAI router.

``build_app(args)`` (YAML ``import_path: specserve.serve:build_app``) validates the
configuration, places each side by label or resources (failing at deploy time, naming what no
node offers), and binds Router -> Target -> Draft, all announcing to the Registry. Targets
find drafts through the Registry and talk to them over TCP; Serve places, health-checks,
restarts and scales every deployment (``serve status`` shows all four).
"""

from __future__ import annotations

import logging
import os

from ray import serve

from ..config import SpecserveConfig
from .ingress import HEAD, router_placement
from .router import Router

logger = logging.getLogger("specserve.serve")

# How long a stopping replica first waits for requests still on their way to it, then between checks
# that none is running (Serve's default is 2 s). Every replica sleeps it at least once, and Serve
# stops the four deployments one after another: `serve run` took 12-14 s to stop on Ctrl-C here.
# A request in flight reaches its replica in milliseconds; one still running is waited for up to
# ``graceful_shutdown_timeout_s`` either way.
SHUTDOWN_WAIT_S = 0.5


def _side_options(side, role: str, cfg: SpecserveConfig) -> dict:
    """Serve deployment options of one side: replicas/autoscaling and placement by label/resources."""
    import ray

    from ..distributed.placement import check_feasible, side_resources, side_selector

    nodes = ray.nodes()
    selector = side_selector(side, role, cfg.cluster, nodes)
    check_feasible(role, selector, side_resources(side), nodes)  # fail at deploy time, naming what is missing
    actor = {"num_cpus": side.num_cpus, "num_gpus": side.num_gpus}
    if side.resources:
        actor["resources"] = dict(side.resources)
    if selector:
        actor["label_selector"] = selector
    if cfg.cluster.runtime_env:
        actor["runtime_env"] = dict(cfg.cluster.runtime_env)
    opts = {"name": role.capitalize(), "ray_actor_options": actor, "health_check_period_s": 2, "health_check_timeout_s": 10,
            "graceful_shutdown_timeout_s": 5, "graceful_shutdown_wait_loop_s": SHUTDOWN_WAIT_S,
            "max_constructor_retry_count": 2,  # a model that fails to load fails again
            "logging_config": {"enable_access_log": False, "log_level": "WARNING"}}  # requests are logged once, at the router
    if side.autoscaling:
        opts["autoscaling_config"] = dict(side.autoscaling)
    else:
        opts["num_replicas"] = side.num_replicas
    return opts


def build_app(args: dict) -> serve.Application:
    """Serve builder (YAML ``import_path: specserve.serve:build_app``): ``args`` is the nested
    configuration, or ``{config: path}`` plus nested overrides, as ``SpecserveConfig`` defines it."""
    import ray

    from ..config import read_config_file
    from ..distributed.workers import DraftWorker, Registry, TargetWorker

    args = dict(args or {})
    path = args.pop("config", None)
    data = read_config_file(path) if path else {}
    for key, value in args.items():  # nested overrides on top of the file
        data[key] = {**data[key], **value} if isinstance(value, dict) and isinstance(data.get(key), dict) else value
    cfg = SpecserveConfig.load(data)
    if cfg.server.api_key is None and cfg.server.api_key_file is None and os.environ.get("SPECSERVE_API_KEY"):
        # The key of the process that builds the app (the CLI, or serve run's builder) goes into the
        # app's configuration, so every router replica enforces it whatever its own environment.
        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"api_key": os.environ["SPECSERVE_API_KEY"]})})
    cfg = cfg.with_draft_token()  # one secret per app, in both sides' configuration: the drafts' ports are authenticated
    if cfg.server.direct_streams and not cfg.server.stream_token:  # and one for the targets' stream ports
        from ..secret import new_token

        cfg = cfg.model_copy(update={"server": cfg.server.model_copy(update={"stream_token": new_token()})})
    if cfg.server.api_key is None and cfg.server.api_key_file is None and cfg.server.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning("serving on %s without an API key: anyone who can reach it can use it", cfg.server.host)
    # Replicas get the configuration without the replica counts: scaling one side (a rolling update)
    # then changes only that deployment's options and restarts nothing else.
    scale = {"num_replicas", "autoscaling"}
    dump = cfg.model_dump(exclude={"target": scale, "draft": scale, "server": {"router_num_replicas"}})
    # The Registry is control plane: on the head node, beside Serve's controller (not on a model's box by chance).
    registry = serve.deployment(Registry, name="Registry", ray_actor_options={"num_cpus": 0, "resources": {HEAD: 0.001}}, num_replicas=1,
                                max_ongoing_requests=1000, graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_S,
                                logging_config={"enable_access_log": False}).bind()
    if not ray.is_initialized():
        ray.init(address="auto")
    if sum(1 for n in ray.nodes() if n.get("Alive")) == 1:
        # One node: the files the replicas will load are the builder's, so a wrong path or a
        # mismatched vocabulary fails the build at once (on several nodes each side checks its own).
        from ..preflight import check_models

        check_models(cfg)
    target_opts = _side_options(cfg.target, "target", cfg)
    target_opts["max_ongoing_requests"] = cfg.engine.max_num_seqs * 4
    draft = None
    if cfg.speculative:
        draft = serve.deployment(DraftWorker, **_side_options(cfg.draft, "draft", cfg)).bind(dump, registry)
    target = serve.deployment(TargetWorker, **target_opts).bind(dump, None, registry, draft)
    router = serve.deployment(Router, name="Router", num_replicas=cfg.server.router_num_replicas,
                              ray_actor_options={"num_cpus": cfg.server.router_num_cpus, **router_placement()},
                              max_ongoing_requests=max(1000, 2 * cfg.server.max_pending_requests),
                              graceful_shutdown_wait_loop_s=SHUTDOWN_WAIT_S)
    return router.bind(dump, target, registry)
