"""How the vLLM target resumes a request from the output another replica committed (``Committed``).

vLLM's API takes a prompt, not an output, so one of two ways is chosen per request:

- **continue**: the committed output is appended to the prompt, and ``max_tokens`` / ``min_tokens``
  are reduced by its length. Exact for a greedy request (and a valid sample for an unseeded one)
  as long as nothing it asks for treats output differently from prompt: presence and frequency
  penalties, structured outputs, stop strings and bad words read the output only (the
  repetition penalty, ``logit_bias``, ``min_p``, stop tokens and logprobs do not care), and the
  caller's text is exactly the committed tokens' text.
- **replay**: otherwise the request starts again from its prompt; what it regenerates of the
  committed output is checked token by token and dropped (tokens, text and logprobs), and the
  rest is streamed. Exact for greedy and seeded requests (vLLM's draws follow the seed); costs a
  regeneration of the committed part. An unseeded sampled request that needs it cannot be
  resumed: ``CannotResume`` says so (a seed makes it resumable).

Knows nothing of Ray or HTTP.
"""

from __future__ import annotations

import dataclasses

from ..outputs import CannotResume, Committed
from ..sampling_params import SamplingParams


def continues(params: SamplingParams, committed: Committed, tokenizer) -> bool:
    """Whether appending the committed output to the prompt resumes this request (see the module docstring)."""
    if params.presence_penalty or params.frequency_penalty or params.structured_outputs or params.stop or params.bad_words:
        return False
    if not (params.greedy or params.seed is None):
        return False  # a seeded request's draws follow its generator from the first token: replayed
    text = tokenizer.decode(list(committed.token_ids), skip_special_tokens=params.skip_special_tokens) if tokenizer is not None else ""
    return len(text) == committed.num_text_chars


def check(params: SamplingParams, committed: Committed, tokenizer) -> None:
    """``CannotResume`` for a request neither way resumes: unseeded sampling that needs a replay."""
    if not continues(params, committed, tokenizer) and not params.greedy and params.seed is None:
        raise CannotResume("the vLLM target cannot resume an unseeded sampled request that uses presence or frequency "
                           "penalties, structured outputs, stop strings or bad words once it has output (vLLM applies them "
                           "to its output only, and a replay draws anew); give the request a seed to make it resumable")


def continued(prompt: list[int], params: SamplingParams, committed: Committed) -> tuple[list[int], SamplingParams]:
    """The prompt and parameters that continue the request after its committed output."""
    n = len(committed.token_ids)
    return prompt + list(committed.token_ids), dataclasses.replace(params, max_tokens=params.max_tokens - n,
                                                                    min_tokens=max(0, params.min_tokens - n))


@dataclasses.dataclass
class Replay:
    """A request regenerated from its prompt: the committed part of its output, checked and dropped."""

    committed: Committed
    num_tokens_seen: int = 0
    num_chars_seen: int = 0

    @property
    def done(self) -> bool:
        return self.num_tokens_seen == len(self.committed.token_ids) and self.num_chars_seen == self.committed.num_text_chars

    def take(self, token_ids: list[int], text: str, logprobs: list | None) -> tuple[list[int], str, list | None]:
        """What of this delta is new to the caller; ``CannotResume`` if it does not regenerate the committed output."""
        want = self.committed.token_ids[self.num_tokens_seen:]
        n = min(len(token_ids), len(want))
        if list(token_ids[:n]) != list(want[:n]):
            at = self.num_tokens_seen + next(i for i in range(n) if token_ids[i] != want[i])
            raise CannotResume(f"the vLLM target regenerated a different token at output position {at} than the replica that "
                               "failed had sent; the request cannot be resumed exactly")
        self.num_tokens_seen += n
        chars = min(len(text), self.committed.num_text_chars - self.num_chars_seen)
        self.num_chars_seen += chars
        return list(token_ids[n:]), text[chars:], (logprobs[n:] if logprobs is not None else None)
