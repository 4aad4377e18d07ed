"""Build a target side and a draft side from an ``EngineConfig`` (in-process or inside an actor)."""

from __future__ import annotations

import logging

from .backends import create_backend
from .config import EngineConfig
from .draft import DraftSide, ModelDrafter, NgramDrafter
from .models import check_vocab_compatible, eos_token_ids, load_config, load_tokenizer, vocab_fingerprint, vocab_size_of
from .target import TargetSide

logger = logging.getLogger(__name__)


def build_target(cfg: EngineConfig) -> TargetSide:
    t = cfg.target
    config = load_config(t.model, t.trust_remote_code)
    tokenizer = load_tokenizer(t.model, t.trust_remote_code)
    backend = create_backend(
        t.backend, model=t.model, dtype=t.dtype, device=t.device, device_map=t.device_map,
        trust_remote_code=t.trust_remote_code, max_model_len=cfg.max_model_len,
    )
    return TargetSide(backend, tokenizer, eos_token_ids(t.model, config, tokenizer))


def check_draft_compatible(cfg: EngineConfig) -> None:
    """Raise ``ValueError`` before any weights load if the draft cannot serve this target."""
    if cfg.draft is None or cfg.draft.is_ngram:
        return
    t, d = cfg.target, cfg.draft
    check_vocab_compatible(
        vocab_fingerprint(load_tokenizer(t.model, t.trust_remote_code), vocab_size_of(load_config(t.model, t.trust_remote_code))),
        vocab_fingerprint(load_tokenizer(d.model, d.trust_remote_code), vocab_size_of(load_config(d.model, d.trust_remote_code))),
    )


def build_draft(cfg: EngineConfig) -> DraftSide:
    d = cfg.draft
    assert d is not None
    if d.is_ngram:
        return DraftSide(NgramDrafter(cfg.ngram_min, cfg.ngram_max))
    target_vocab = vocab_size_of(load_config(cfg.target.model, cfg.target.trust_remote_code))
    backend = create_backend(
        d.backend, model=d.model, dtype=d.dtype, device=d.device, device_map=d.device_map,
        trust_remote_code=d.trust_remote_code,
    )
    return DraftSide(ModelDrafter(backend, target_vocab, cfg.draft_probs), backend.device)
