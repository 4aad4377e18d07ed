"""Load what sits beside a model's weights: tokenizer, EOS ids, vocabulary compatibility.

Everything goes through transformers' ``from_pretrained`` (a local directory or a hub id),
so the shipped demo pair and real hub models load the same way.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """The model's tokenizer, or ``None`` when the directory has no tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.info("no tokenizer for %s (%s): prompts must be token ids", model, type(exc).__name__)
        return None


def load_config(model: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    except OSError as exc:
        raise ValueError(f"cannot load a model config from {model!r}: {exc}") from None


def eos_token_ids(model: str, config, tokenizer) -> set[int]:
    ids: set[int] = set()
    try:
        from transformers import GenerationConfig

        value = GenerationConfig.from_pretrained(model).eos_token_id
    except (OSError, ValueError):
        value = None
    for v in (value, getattr(config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(v, int):
            ids.add(v)
        elif isinstance(v, (list, tuple)):
            ids.update(int(x) for x in v)
    return ids


def vocab_size_of(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text_config.vocab_size)


def check_vocab_compatible(target_config, draft_config, target_tokenizer, draft_tokenizer) -> None:
    """Raise ``ValueError`` unless draft token ids mean the same tokens as the target's."""
    if target_tokenizer is not None and draft_tokenizer is not None:
        t_vocab, d_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
        if t_vocab != d_vocab:
            differing = sum(1 for tok, i in d_vocab.items() if t_vocab.get(tok) != i) + max(0, len(t_vocab) - len(d_vocab))
            raise ValueError(
                f"draft and target vocabularies cannot be matched: their tokenizers differ "
                f"({len(d_vocab)} vs {len(t_vocab)} tokens, {differing} ids map differently)"
            )
        return
    t_size, d_size = vocab_size_of(target_config), vocab_size_of(draft_config)
    if t_size != d_size:
        raise ValueError(
            f"draft and target vocabularies cannot be matched: vocab_size {d_size} (draft) != {t_size} (target), "
            "and without tokenizers on both sides specserve cannot check that the ids mean the same tokens"
        )
