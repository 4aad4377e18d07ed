"""Checks that run before Ray, Serve or any weights start, so a mistake costs seconds, not minutes.

Model sources (a directory that exists and holds a model, or a hub id available here),
draft/target vocabulary compatibility (tokenizers and configs only, when both are on this
machine), devices (CUDA asked for where Ray gives the side no GPU, or where torch has none)
and the HTTP port. Each failure is a ``ValueError`` in one line that names the field.
Knows nothing of Ray.
"""

from __future__ import annotations

import logging
import os
import socket

from .config import SpecserveConfig
from .eagle import check_target, head_spec, target_info
from .models import check_model_source, check_vocab_compatible, load_config, load_tokenizer, vocab_fingerprint, vocab_size_of

logger = logging.getLogger(__name__)


def _local(model: str) -> bool:
    return os.path.isdir(os.path.expanduser(model))


def check_models(cfg: SpecserveConfig) -> None:
    t = cfg.target
    if t.backend != "sim":
        check_model_source(t.model, "target")
    d = cfg.draft
    if d is None or d.drafter != "model" or d.backend == "sim":
        return
    check_model_source(d.model, "draft")
    spec = head_spec(d.model) if d.backend == "hf" else None
    if spec is not None:  # an EAGLE head: it reads the target's hidden states and emits the target's ids
        if t.backend not in ("hf", "vllm"):
            raise ValueError(f"draft {d.model!r} is an EAGLE head: it needs a target that sends it its hidden states "
                             f"(target_backend 'hf' or 'vllm'); got {t.backend!r}")
        check_target(spec, target_info(load_config(t.model, t.trust_remote_code)))
        return
    if _local(t.model) and _local(d.model):
        fingerprints = []
        for side in (t, d):
            fingerprints.append(vocab_fingerprint(load_tokenizer(side.model, side.trust_remote_code),
                                                  vocab_size_of(load_config(side.model, side.trust_remote_code))))
        check_vocab_compatible(*fingerprints)


def check_devices(cfg: SpecserveConfig, distributed: bool) -> None:
    for role, side in (("target", cfg.target), ("draft", cfg.draft)):
        if side is None or not side.device.startswith("cuda"):
            continue
        if distributed and not side.num_gpus:
            raise ValueError(f"{role}_device={side.device!r} needs {role}_num_gpus >= 1: Ray gives the {role} no GPU otherwise")
        if not distributed:
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"{role}_device={side.device!r}, but torch {torch.__version__} here sees no CUDA device "
                                 "(a CPU build, or no GPU): use --device cpu or install a CUDA build of torch")


def check_port(host: str, port: int, what: str = "") -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ValueError(f"port {port} on {host} is not free ({exc.strerror}){' ' + what if what else ''}: "
                             "stop what uses it or pass --port") from None


def preflight(cfg: SpecserveConfig, distributed: bool, http: bool = False) -> None:
    check_models(cfg)
    check_devices(cfg, distributed)
    if http:
        check_port(cfg.server.host, cfg.server.port)
