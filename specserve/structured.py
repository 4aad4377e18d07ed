"""Structured outputs: a grammar (JSON schema, any JSON object, regex, a choice of strings, EBNF or Lark) that
masks the target's distribution at every verified position, through xgrammar (what vLLM uses).

Per target a ``Grammars`` compiles each constraint once (cached); per sequence a ``SeqGrammar``
holds a matcher at the committed tokens. For a verify of k drafts it fills k + 1 mask rows, row j
after accepting drafts[:j] into the matcher, then rolls them back; a draft the grammar forbids
stops the rows there (the verifier rejects it at that position, its row masks it out). Commit
advances the matcher by the tokens kept. Greedy output thus equals target-only constrained
decoding, and sampling follows the masked target distribution. Knows nothing of engines.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict

import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
INSTALL_HINT = "structured outputs need xgrammar: pip install xgrammar (it comes with vLLM)"


def _xgr():
    try:
        import xgrammar
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return xgrammar


def check_spec(kind: str, spec: str) -> None:
    """``ValueError`` for a constraint that cannot be one, before any grammar is compiled."""
    if kind not in KINDS:
        raise ValueError(f"structured_outputs kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if not isinstance(spec, str):
        raise ValueError(f"structured_outputs {kind}: the constraint must be a string, got {type(spec).__name__}")
    if kind in ("json", "choice"):
        try:
            value = json.loads(spec)
        except ValueError:
            raise ValueError(f"structured_outputs {kind}: not valid JSON") from None
        if kind == "choice" and (not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value)):
            raise ValueError("structured_outputs choice: a non-empty list of non-empty strings")
        if kind == "json" and not isinstance(value, (dict, bool)):
            raise ValueError("structured_outputs json: a JSON schema (an object)")
    elif kind in ("regex", "grammar") and not spec:
        raise ValueError(f"structured_outputs {kind}: must not be empty")


class Grammars:
    """One target's grammar compiler (its tokenizer's vocabulary) and a cache of compiled constraints."""

    CACHE = 128

    def __init__(self, tokenizer, vocab_size: int):
        if tokenizer is None:
            raise ValueError("structured outputs need the target's tokenizer; this model has none")
        xgr = _xgr()
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._cache: OrderedDict = OrderedDict()

    def compile(self, kind: str, spec: str):
        """The compiled constraint (``ValueError`` naming what is wrong with it)."""
        key = (kind, spec)
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        check_spec(kind, spec)
        try:
            # As vLLM's xgrammar backend compiles each kind, so constrained outputs match vLLM's.
            if kind == "json":
                compiled = self.compiler.compile_json_schema(spec, any_whitespace=True)
            elif kind == "json_object":  # an object, as OpenAI means it
                compiled = self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=True)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(spec)
            elif kind == "choice":
                choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(spec))
                compiled = self.compiler.compile_grammar(f"root ::= {choices}")
            elif "::=" not in spec:  # Lark's syntax (rule: ...), as vLLM tells them apart
                compiled = self.compiler.compile_lark(spec)
            else:
                compiled = self.compiler.compile_grammar(spec)
        except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
            detail = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
            detail = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", detail)[:300]  # (xgrammar's time and source location)
            raise ValueError(f"structured_outputs {kind}: cannot be compiled: {detail}") from None
        self._cache[key] = compiled
        if len(self._cache) > self.CACHE:
            self._cache.popitem(last=False)
        return compiled

    def matcher(self, kind: str, spec: str) -> "SeqGrammar":
        return SeqGrammar(_xgr().GrammarMatcher(self.compile(kind, spec)), self.vocab_size,
                          list(self.info.stop_token_ids))


class SeqGrammar:
    """One sequence's matcher, at its committed tokens."""

    def __init__(self, matcher, vocab_size: int, stop_token_ids: list[int]):
        self.matcher, self.vocab_size = matcher, vocab_size
        self._bitmask = _xgr().allocate_token_bitmask(1, vocab_size)
        self._bits = torch.arange(32, dtype=torch.int32)
        self._done = torch.zeros(vocab_size, dtype=torch.bool)  # once the grammar is complete: its stop tokens only
        self._done[torch.tensor([t for t in stop_token_ids if t < vocab_size], dtype=torch.long)] = True

    def _row(self) -> torch.Tensor:  # [vocab] bool: the tokens the grammar allows next
        if self.matcher.is_terminated():
            return self._done
        self.matcher.fill_next_token_bitmask(self._bitmask, 0)
        return ((self._bitmask[0, :, None] >> self._bits) & 1).reshape(-1)[: self.vocab_size].bool()

    def allowed(self, drafts: list[int], width: int) -> torch.Tensor:
        """[width, vocab] bool: row j allows what may follow the committed tokens and drafts[:j]. Rows
        past a draft the grammar forbids repeat the last row (the verifier stops before them)."""
        rows, fed = [self._row()], 0
        for d in drafts[: width - 1]:
            if self.matcher.is_terminated() or not self.matcher.accept_token(d):
                break
            fed += 1
            rows.append(self._row())
        if fed:
            self.matcher.rollback(fed)
        rows += [rows[-1]] * (width - len(rows))
        allowed = torch.stack(rows)
        if not bool(allowed[0].any()):
            raise RuntimeError("the grammar allows no token of this model's vocabulary here")
        return allowed

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many of the drafts the grammar allows in a row (the rest cannot be accepted: vLLM too
        cuts them before verifying)."""
        fed = 0
        for d in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(d):
                break
            fed += 1
        if fed:
            self.matcher.rollback(fed)
        return fed

    def commit(self, token_ids: list[int]) -> int:
        """Advance by the tokens the sequence kept (each was allowed by its row's mask); how many the
        grammar took (fewer only for a resumed request's committed output that it does not allow)."""
        for i, t in enumerate(token_ids):
            if self.matcher.is_terminated() or not self.matcher.accept_token(t):
                return i
        return len(token_ids)
