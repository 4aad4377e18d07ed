"""Decide where a sequence stops: max_tokens, the context limit, EOS, stop token ids, stop strings
(none of the last three before ``min_tokens``; a stop string stays in the text with
``include_stop_str_in_output``).

Called on each verified block before it is committed, so a stop inside an accepted block
cuts the block there. Also produces the streamed text deltas, holding back text that may
be the start of a stop string or an incomplete UTF-8 character. Text is detokenized
incrementally (``tokenizers``' ``DecodeStream``: O(new tokens) per step, not O(output)),
falling back to decoding the whole output for tokenizers it cannot serve. Knows nothing of models.
"""

from __future__ import annotations

from .sampling_params import SamplingParams


class _Detokenizer:
    """Output text, grown token by token; the same text ``tokenizer.decode(ids)`` gives."""

    def __init__(self, tokenizer, skip_special_tokens: bool):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.stream = None
        fast = getattr(tokenizer, "_tokenizer", None)
        if fast is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
            try:
                from tokenizers.decoders import DecodeStream

                self.stream, self.fast = DecodeStream(skip_special_tokens=skip_special_tokens), fast
            except ImportError:  # tokenizers < 0.21: decode the whole output instead
                pass
        self.text = ""

    def add(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self.stream is not None:
            self.text += self.stream.step(self.fast, token_id) or ""
        else:
            self.text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip)
        return self.text


class StopChecker:
    def __init__(self, params: SamplingParams, eos_token_ids: set[int], tokenizer, prompt_len: int, max_model_len: int):
        self.params = params
        self.eos_token_ids = set() if params.ignore_eos else set(eos_token_ids)
        self.stop_token_ids = set(params.stop_token_ids)
        self.tokenizer = tokenizer
        self.prompt_len = prompt_len
        self.max_model_len = max_model_len
        self.output_token_ids: list[int] = []
        self.text = ""  # text of the output so far (cut at a stop string when one matched)
        self.sent_chars = 0
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer; the target model has none (use stop_token_ids)")
        self._detok = _Detokenizer(tokenizer, params.skip_special_tokens) if tokenizer is not None else None

    def append(self, token_ids: list[int]) -> list[int]:
        """Append verified tokens up to the first stop; returns the tokens kept."""
        kept = []
        for tok in token_ids:
            self.output_token_ids.append(tok)
            kept.append(tok)
            text = self._detok.add(tok) if self._detok is not None else None
            n = len(self.output_token_ids)
            if n >= self.params.min_tokens and (tok in self.eos_token_ids or tok in self.stop_token_ids):
                self.finish_reason, self.stop_reason = "stop", (None if tok in self.eos_token_ids else tok)
            elif self.params.stop and n > self.params.min_tokens and self._match_stop_string(text):  # (vLLM: >)
                self.finish_reason = "stop"
            elif n >= self.params.max_tokens or self.prompt_len + n >= self.max_model_len:
                self.finish_reason = "length"
            if text is not None and self.finish_reason is None and n <= self.params.min_tokens:
                self.text = text  # (unchecked: a later match must end in text after this)
            if self.finish_reason is not None:
                break
        if self._detok is not None and not isinstance(self.stop_reason, str):
            self.text = self._detok.text  # a stop-string match already cut the text itself
        return kept

    def _match_stop_string(self, text: str) -> bool:
        # Only the tail can hold a new match: the last token added at most len(token text) chars.
        window = max(len(s) for s in self.params.stop) + 16
        start = max(0, len(self.text) - window)
        best = None
        for s in self.params.stop:
            idx = text.find(s, max(start, len(self.text) - len(s) + 1))  # a match ending in the new text
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            self.text = text
            return False
        end = best[0] + len(best[1]) if self.params.include_stop_str_in_output else best[0]
        self.text, self.stop_reason = text[:end], best[1]
        return True

    def text_delta(self) -> str:
        """New text since the last call, holding back a possible stop-string prefix while running."""
        if self.tokenizer is None:
            return ""
        end = len(self.text)
        if self.finish_reason is None:
            if self.params.stop:
                end -= max(len(s) for s in self.params.stop) - 1
            while end > self.sent_chars and self.text[end - 1] == "\ufffd":
                end -= 1  # an incomplete multi-byte character: wait for its next token
        if end <= self.sent_chars:
            return ""
        delta = self.text[self.sent_chars : end]
        self.sent_chars = end
        return delta
