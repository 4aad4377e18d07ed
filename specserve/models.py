"""Load what sits beside a model's weights: tokenizer, EOS ids, vocabulary compatibility.

Everything goes through transformers' ``from_pretrained`` (a local directory or a hub id),
so the shipped demo pair and real hub models load the same way.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


def check_model_source(model: str, role: str = "model") -> None:
    """Raise ``ValueError`` in user terms when ``model`` is neither a directory nor a usable hub id."""
    import os

    if os.path.isdir(os.path.expanduser(model)):
        if not os.path.isfile(os.path.join(os.path.expanduser(model), "config.json")):
            raise ValueError(f"{role} {model!r} is a directory without config.json: not a transformers model folder")
        return
    if os.path.exists(os.path.expanduser(model)):
        raise ValueError(f"{role} {model!r} is a file; give the model's directory")
    looks_like_path = model.startswith(("/", ".", "~")) or model.count("/") > 1 or "\\" in model
    if looks_like_path:
        raise ValueError(f"{role} {model!r}: no such directory")
    from huggingface_hub import try_to_load_from_cache

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        if not isinstance(try_to_load_from_cache(model, "config.json"), str):
            raise ValueError(f"{role} {model!r}: no such directory, and not in the Hugging Face cache (HF_HUB_OFFLINE is set, "
                             "so it cannot be downloaded)")


def load_tokenizer(model: str, trust_remote_code: bool = False):
    """The model's tokenizer, or ``None`` when the directory has no tokenizer files."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        logger.debug("no tokenizer for %s (%s): prompts must be token ids", model, type(exc).__name__)
        return None


def load_config(model: str, trust_remote_code: bool = False):
    from transformers import AutoConfig

    check_model_source(model)
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


def vocab_fingerprint(tokenizer, vocab_size: int) -> dict:
    """What two sides compare (possibly across nodes) to know their token ids mean the same tokens."""
    import hashlib
    import json

    if tokenizer is None:
        return {"tokenizer_sha": None, "num_tokens": None, "vocab_size": vocab_size}
    vocab = tokenizer.get_vocab()
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16]
    return {"tokenizer_sha": digest, "num_tokens": len(vocab), "vocab_size": vocab_size}


def check_vocab_compatible(target: dict, draft: dict | None) -> None:
    """Raise ``ValueError`` unless draft token ids mean the same tokens as the target's.

    ``target`` and ``draft`` are ``vocab_fingerprint`` dicts; ``draft=None`` is a drafter
    without a vocabulary of its own (ngram copies ids from the context).
    """
    if draft is None:
        return
    if target["tokenizer_sha"] and draft["tokenizer_sha"]:
        if target["tokenizer_sha"] != draft["tokenizer_sha"]:
            raise ValueError(
                f"draft and target vocabularies cannot be matched: their tokenizers differ "
                f"({draft['num_tokens']} vs {target['num_tokens']} tokens, or the same tokens with other ids)"
            )
        return
    if target["vocab_size"] != draft["vocab_size"]:
        raise ValueError(
            f"draft and target vocabularies cannot be matched: vocab_size {draft['vocab_size']} (draft) != "
            f"{target['vocab_size']} (target), and without tokenizers on both sides specserve cannot check that "
            "the ids mean the same tokens"
        )
