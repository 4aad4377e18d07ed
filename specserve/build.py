"""Build each side from the configuration; backends and drafters come from registries.

A backend is one class with ``from_side(side, max_model_len)`` and one line in ``BACKENDS``;
a drafter is one line in ``DRAFTERS``. A backend that is a whole engine rather than a
batched forward (vLLM) instead offers ``build_engine_loop`` (a target: the loop the workers
drive) and/or ``build_drafter`` (a draft model side). Each builder loads only its own side's
files (the draft never reads the target's, and vice versa); the sides compare vocabulary
fingerprints when they connect. Used in-process and inside the Ray actors alike.
"""

from __future__ import annotations

import gc
import importlib
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

from .config import DraftConfig, SideConfig, SpecserveConfig
from .devices import placement
from .eagle import head_spec, target_fc
from .draft import NgramDrafter
from .model_drafter import ModelDrafter
from .draft_service import DraftService
from .models import check_model_source, eos_token_ids, load_config, load_tokenizer, vocab_fingerprint
from .target import TargetSide

logger = logging.getLogger(__name__)

BACKENDS = {
    "hf": "specserve.backends.hf:HFBackend",
    "sim": "specserve.backends.sim:SimBackend",
    "vllm": "specserve.backends.vllm:VLLMBackend",
}


def backend_class(side: SideConfig) -> type:
    """The class registered for ``side.backend``; imported lazily so optional dependencies stay optional."""
    if side.backend not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {side.backend!r}")
    module, cls = BACKENDS[side.backend].split(":")
    return getattr(importlib.import_module(module), cls)


def create_backend(side: SideConfig, max_model_len: int | None = None):
    """Instantiate ``side.backend``."""
    return backend_class(side).from_side(side, max_model_len)


def _model_drafter(cfg: SpecserveConfig, own_process: bool):
    d = cfg.draft
    spec = cfg.speculation
    own = getattr(backend_class(d), "build_drafter", None)
    if own is not None:  # a backend that drafts with its own engine
        return own(cfg)
    fanout = spec.fanout if _ahead_policy(cfg, own_process) is not False else 0
    if d.backend == "hf" and head_spec(d.model) is not None:  # an EAGLE head: reads the target's hidden states
        from .head_drafter import build_head_drafter

        drafter = build_head_drafter(cfg, fanout)
    else:
        drafter = ModelDrafter(create_backend(d), spec.draft_probs, fanout, spec.max_branches, spec.draft_ahead_preempt,
                               **d.drafter_options)
    if _compile_policy(d, own_process):
        drafter.backend.compile()
    return drafter


def _ngram_drafter(cfg: SpecserveConfig, own_process: bool):
    o = cfg.draft.drafter_options
    return NgramDrafter(o.get("ngram_min", 1), o.get("ngram_max", 4))


DRAFTERS = {"model": _model_drafter, "ngram": _ngram_drafter}


def _compile_policy(d: DraftConfig, own_process: bool) -> bool:
    """Compile an hf draft's forward: as configured; "auto" for a CPU draft in a process of its own,
    where the draft's speed is the speculation cache's depth (an in-process draft starts at once)."""
    if d.backend != "hf" or d.compile is False:
        return False
    return d.compile is True or (own_process and d.device == "cpu" and d.device_map is None)


def _ahead_policy(cfg: SpecserveConfig, own_process: bool) -> bool | str:
    """Drafting ahead: as configured; "auto" is decided per target from where each side computes
    (``devices.shares_compute``), except that a CPU draft in its target's own process is known
    to share its cores (no speculation cache is kept for it)."""
    ahead, d = cfg.speculation.draft_ahead, cfg.draft
    if ahead == "auto" and not own_process and not d.device.startswith("cuda") and d.backend != "sim":
        return False
    return ahead


def set_cpu_threads(cfg: SpecserveConfig, in_process: bool) -> None:
    """Torch threads for CPU sides: the configured count, or a default that avoids oversubscription."""
    import torch

    if cfg.engine.cpu_threads is not None:
        torch.set_num_threads(cfg.engine.cpu_threads)
    elif in_process and cfg.target.device == "cpu":
        # Target and draft share this process and overlap: half the cores each.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))


def build_target(cfg: SpecserveConfig) -> TargetSide:
    t = cfg.target
    if t.backend != "sim":
        check_model_source(t.model, "target")
    tokenizer = load_tokenizer(t.model, t.trust_remote_code) if t.backend != "sim" else None
    backend = create_backend(t, cfg.engine.max_model_len)
    config = load_config(t.model, t.trust_remote_code) if t.backend != "sim" else None
    eos = eos_token_ids(t.model, config, tokenizer) if config is not None else backend.eos_token_ids
    return TargetSide(backend, tokenizer, eos)


@dataclass
class DraftLink:
    """How a target reaches its drafts: ``discover() -> {name: address}``, ``connect(name, address) -> endpoint``."""

    discover: Callable[[], dict[str, object]]
    connect: Callable[[str, object], object]
    target_id: str
    background: bool = True  # discover and reconnect on a background thread (else once, now)
    hello_info: dict = field(default_factory=dict)  # what the target tells its drafts about itself


def build_engine_loop(cfg: SpecserveConfig, link: DraftLink | None, name: str = "specserve-engine"):
    """The target's engine loop (``submit`` / ``abort`` / ``core.metrics``): specserve's own
    (``TargetSide`` + ``EngineCore`` + ``DraftPool``), or the one a backend brings (vLLM)."""
    from .adaptive import SpeculationController
    from .engine import EngineCore, EngineLoop
    from .messages import Hello
    from .pool import DraftPool

    own = getattr(backend_class(cfg.target), "build_engine_loop", None)
    if own is not None:
        loop = own(cfg, link, name)
        freeze_heap()
        return loop
    target = build_target(cfg)
    fc = target_fc(cfg, cfg.target.device)
    if fc is not None:
        target.hidden_fc = (fc[0].to(device=target.backend.device, dtype=target.backend.dtype), fc[1])
    spec = cfg.speculation
    controller = SpeculationController(spec.num_speculative_tokens if cfg.speculative else 0, spec.adaptive, cache_only=spec.cache_only)
    core = EngineCore(target, None, controller, cfg.engine.max_num_seqs)
    core.first_step_drafts = spec.first_step_drafts
    if link is not None:
        core.pool = DraftPool(
            discover=link.discover, connect=link.connect,
            hello=Hello(link.target_id, target.vocab_fingerprint(), {**link.hello_info, **target.hidden_info()}),
            reopen=core.reopen, min_timeout_s=spec.draft_min_timeout_s, max_timeout_s=spec.draft_timeout_s,
            background=link.background, keep_hidden=target.keep_hidden, trees=spec.draft_trees,
        )
    loop = EngineLoop(core, name=name)
    freeze_heap()
    return loop


def freeze_heap() -> None:
    """Take every object alive now (models, modules, tokenizers: what a side keeps for its whole life)
    out of the garbage collector's sight, as vLLM does once its engine is up. Otherwise every full
    collection walks them all: a draft process with ~230k objects paused ~120 ms each time, a few
    times a minute at batch 32 while its tree work allocates, and the target waited each time
    (9 of the 11 ms the simulated Spark + 5090 pair's link took per step). ``LocalEngine.shutdown``
    gives them back (``gc.unfreeze``)."""
    gc.collect()
    gc.freeze()


def draft_fingerprint(d: DraftConfig, drafter) -> dict | None:
    """What the draft tells a connecting target (None: ids come from the context, e.g. ngram)."""
    backend = getattr(drafter, "backend", None)
    if backend is None:
        return None
    fp = getattr(backend, "vocab_fingerprint", None)
    if fp is not None:
        return fp()
    # A draft head emits the target's ids with the target's tokenizer (it ships none of its own).
    source = d.model if getattr(drafter, "hidden_layers", None) is None else drafter.target_model
    return vocab_fingerprint(load_tokenizer(source, d.trust_remote_code), backend.vocab_size)


def build_draft_service(cfg: SpecserveConfig, draft_id: str = "draft", info: dict | None = None,
                        own_process: bool = True) -> DraftService:
    """``own_process``: the draft runs in a process of its own (a Ray actor or Serve replica),
    which is when drafting ahead ``auto`` is on."""
    d = cfg.draft
    if d is None:
        raise ValueError("this configuration has no draft")
    if d.drafter == "model" and d.backend != "sim":
        check_model_source(d.model, "draft")
    drafter = DRAFTERS[d.drafter](cfg, own_process)
    info = {"drafter": d.drafter, "backend": d.backend, "model": d.model, "device": d.device, **(info or {}),
            "placement": placement(d.device, simulated=d.backend == "sim")}
    service = DraftService(drafter, draft_fingerprint(d, drafter), draft_id, info, _ahead_policy(cfg, own_process),
                           cfg.channel.max_draft_seqs)
    freeze_heap()
    return service
