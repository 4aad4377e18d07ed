"""What shapes the target's distribution beyond temperature, top-k, top-p and min-p: penalties,
``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``, as vLLM applies them, and a
grammar's mask (structured outputs, ``structured.py``), applied first, as vLLM's runner does.

Lossless under speculation: a verification's logits row j (after the committed prefix and the
first j draft tokens) is processed with the output that row would follow in plain decoding:
the committed output plus ``drafts[:j]``. Plain decoding is the ``k = 0`` case. vLLM's order
(``vllm.v1.sample.sampler.Sampler.apply_logits_processors``): allowed tokens, bad words,
``min_tokens`` and ``logit_bias``, then the penalties (repetition over prompt and output;
frequency and presence over the output). Greedy decoding takes the argmax of the result;
sampling then applies temperature, min-p, top-k and top-p (``sampling.processed_probs``).

Pure torch; knows nothing of models, caches or Ray.
"""

from __future__ import annotations

import torch

from .messages import DraftProcessing
from .sampling_params import SamplingParams


def bad_word_token_ids(words, tokenizer) -> list[list[int]]:
    """Each bad word as token ids, as vLLM derives them (``SamplingParams.update_from_tokenizer``):
    the word as it stands, and with a leading space where that is a different first token of the
    same length (so the word is banned at the start and in the middle of the text)."""
    if not words:
        return []
    if tokenizer is None:
        raise ValueError("bad_words need a tokenizer; the target model has none")
    out: list[list[int]] = []
    for word in dict.fromkeys(words):
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise ValueError(f"bad_words: {word!r} is no token at all")
        out.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out


def logprob_entries(logits: torch.Tensor, tokens: list[int], top_n: int, ranks: bool = False) -> list[list[list]]:
    """Per token: [[token, logprob], [top-1 id, logprob], ..., [top-N id, logprob]] from ``logits``
    [len(tokens), vocab], the raw logits each token was chosen from (vLLM's default: raw model
    logprobs, before any processing). ``ranks``: the token's own entry is [token, logprob, rank]
    (1: the most likely), as vLLM reports prompt tokens."""
    if not tokens:
        return []
    lp = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    own_t = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])
    # .tolist(): the entries travel as plain lists.
    own = own_t[:, 0].tolist()
    rank = (lp > own_t).sum(dim=-1).add(1).tolist() if ranks else None
    tops = lp.topk(top_n, dim=-1) if top_n else None
    out = []
    for j, tok in enumerate(tokens):
        entry = [[tok, own[j], rank[j]]] if ranks else [[tok, own[j]]]
        if tops is not None:
            entry += [[int(i), float(v)] for v, i in zip(tops.values[j].tolist(), tops.indices[j].tolist())]
        out.append(entry)
    return out


def check_token_ids(params: SamplingParams, vocab_size: int, tokenizer) -> None:
    """Raise ``ValueError`` for what only the target can check: token ids beyond its vocabulary,
    bad words its tokenizer cannot express."""
    for name, ids in (("allowed_token_ids", params.allowed_token_ids or ()), ("logit_bias", [t for t, _ in params.logit_bias])):
        bad = [t for t in ids if t >= vocab_size]
        if bad:
            raise ValueError(f"{name}: token ids must be below the target's vocabulary size {vocab_size}, got {bad[:5]}")
    bad_word_token_ids(params.bad_words, tokenizer)


class SeqProcessor:
    """One sequence's processing, built once when it opens: on the target from its ``SamplingParams``,
    on a draft from the ``DraftProcessing`` the target sent (``for_draft``; the same fields)."""

    def __init__(self, params: SamplingParams | DraftProcessing, prompt_token_ids: list[int], vocab_size: int,
                 stop_ids: set[int], bad_words: list[list[int]], grammar=None):
        self.params, self.prompt_len, self.vocab = params, len(prompt_token_ids), vocab_size
        self.grammar = grammar  # structured.SeqGrammar (structured outputs), or None
        self.banned = None  # [vocab] bool: tokens never allowed
        if params.allowed_token_ids is not None:
            self.banned = torch.ones(vocab_size, dtype=torch.bool)
            self.banned[torch.tensor([t for t in params.allowed_token_ids if t < vocab_size], dtype=torch.long)] = False
        self.stop_ids = torch.tensor(sorted(t for t in stop_ids if t < vocab_size), dtype=torch.long)
        self.bias_ids = torch.tensor([t for t, _ in params.logit_bias if t < vocab_size], dtype=torch.long)
        self.bias = torch.tensor([b for t, b in params.logit_bias if t < vocab_size], dtype=torch.float32)
        self.bad_words = bad_words
        self.penalties = params.presence_penalty != 0 or params.frequency_penalty != 0 or params.repetition_penalty != 1.0
        self.in_prompt = torch.zeros(vocab_size, dtype=torch.bool)
        if params.repetition_penalty != 1.0:
            self.in_prompt[torch.tensor([t for t in prompt_token_ids if t < vocab_size], dtype=torch.long)] = True
        self._device = torch.device("cpu")  # where the tensors above live: moved to the logits' device on first use

    def _on(self, device: torch.device) -> None:
        """Move this sequence's masks, ids and biases to ``device`` (a target or draft on a GPU), once."""
        if device == self._device:
            return
        if self.banned is not None:
            self.banned = self.banned.to(device)
        self.stop_ids, self.bias_ids = self.stop_ids.to(device), self.bias_ids.to(device)
        self.bias, self.in_prompt = self.bias.to(device), self.in_prompt.to(device)
        self._device = device

    def for_draft(self) -> DraftProcessing | None:
        """What of this processing a draft can apply to its proposals (all but a grammar); None: nothing."""
        p = self.params
        if not (p.logit_bias or p.allowed_token_ids is not None or self.bad_words or p.min_tokens or self.penalties):
            return None
        return DraftProcessing(self.prompt_len, [t for t, _ in p.logit_bias], [float(b) for _, b in p.logit_bias],
                               list(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
                               [list(w) for w in self.bad_words], p.min_tokens, self.stop_ids.tolist(), float(p.presence_penalty),
                               float(p.frequency_penalty), float(p.repetition_penalty))

    def apply(self, logits: torch.Tensor, token_ids: list[int], drafts: list[int]) -> torch.Tensor:
        """``logits``: [width, vocab] rows after ``token_ids`` (prompt + committed output) and
        ``drafts[:j]``; returns them processed (half precision as float32, as vLLM does)."""
        x = (logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits).clone()
        p = self.params
        self._on(x.device)
        if self.grammar is not None:  # each row's mask after the drafts before it (structured outputs)
            x.masked_fill_(~self.grammar.allowed(drafts, x.shape[0]).to(x.device), float("-inf"))
        output = list(token_ids[self.prompt_len:])
        counts = None
        if self.penalties:
            counts = torch.bincount(torch.tensor([t for t in output if t < self.vocab], dtype=torch.long),
                                    minlength=self.vocab).to(device=x.device, dtype=x.dtype)
        for j in range(x.shape[0]):
            if j:
                output.append(drafts[j - 1])
                if counts is not None and drafts[j - 1] < self.vocab:
                    counts[drafts[j - 1]] += 1
            row = x[j]
            if self.banned is not None:
                row.masked_fill_(self.banned, float("-inf"))
            for ids in self.bad_words:
                if len(ids) <= len(output) + 1 and (len(ids) == 1 or output[len(output) - len(ids) + 1:] == ids[:-1]):
                    if ids[-1] < self.vocab:
                        row[ids[-1]] = float("-inf")
            if len(output) < p.min_tokens and self.stop_ids.numel():
                row[self.stop_ids] = float("-inf")
            if self.bias_ids.numel():
                row[self.bias_ids] += self.bias
            if counts is not None:
                if p.repetition_penalty != 1.0:
                    seen = self.in_prompt | (counts > 0)
                    row.copy_(torch.where(seen, torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty), row))
                row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(x.dtype)
        return x
