"""The draft side: keeps each sequence's committed tokens and proposes draft blocks.

Data flow per step: ``handle(ProposeRequest)`` opens/closes sequences, applies each
``VerifyResult`` (keep ``base_len`` tokens, append ``token_ids``), then asks its drafter
for up to ``k`` draft tokens per requested sequence and answers a ``ProposeReply``.
Sequences it does not know (e.g. after a restart) are listed in ``missing`` so the target
re-opens them with their full tokens. Knows nothing of verification or Ray.

KV rollback asymmetry (model drafter): after proposing d_1..d_k the draft cache holds the
committed tokens plus d_1..d_{k-1}. If i < k drafts are accepted it rolls back to
``base_len + i`` and feeds the recovered token; if all k are accepted it has not yet seen
d_k nor the bonus token and feeds both. Both cases fall out of "truncate to the common
prefix of what was fed and what is committed, then feed the rest".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from .backends.base import ModelBackend
from .messages import DraftBlock, OpenSeq, ProposeReply, ProposeRequest
from .ngram import ngram_propose
from .sampling import make_generator, processed_probs

logger = logging.getLogger(__name__)


@dataclass
class DraftSeq:
    request_id: str
    token_ids: list[int]  # committed tokens, as the target last reported them
    temperature: float
    top_k: int
    top_p: float
    generator: torch.Generator | None = None
    fed: list[int] = field(default_factory=list)  # tokens whose KV the draft backend holds


@dataclass
class Proposal:
    token_ids: list[int]  # [num_draft]
    probs: np.ndarray | None = None  # [num_draft, vocab] float32, or None for a point mass


class Drafter(Protocol):
    def open(self, seq: DraftSeq) -> None: ...

    def close(self, seq: DraftSeq) -> None: ...

    def propose(self, seqs: list[DraftSeq], k: int) -> list[Proposal]: ...


class NgramDrafter:
    """Prompt lookup; proposals are deterministic, so only token ids cross the wire."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram sizes must satisfy 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.min_n, self.max_n = min_n, max_n

    def open(self, seq: DraftSeq) -> None:
        pass

    def close(self, seq: DraftSeq) -> None:
        pass

    def propose(self, seqs: list[DraftSeq], k: int) -> list[Proposal]:
        return [Proposal(ngram_propose(s.token_ids, k, self.min_n, self.max_n)) for s in seqs]


class ModelDrafter:
    """Autoregressive drafting with a small causal LM behind a ``ModelBackend``."""

    def __init__(self, backend: ModelBackend, target_vocab_size: int, send_probs: bool = True):
        self.backend = backend
        self.target_vocab_size = target_vocab_size
        self.send_probs = send_probs

    def open(self, seq: DraftSeq) -> None:
        self.backend.add(seq.request_id)

    def close(self, seq: DraftSeq) -> None:
        self.backend.free(seq.request_id)

    def _aligned(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits over the target's vocabulary (tokenizers match; embedding padding may not)."""
        width = logits.shape[-1]
        if width == self.target_vocab_size:
            return logits
        if width > self.target_vocab_size:
            return logits[..., : self.target_vocab_size]
        pad = logits.new_full((*logits.shape[:-1], self.target_vocab_size - width), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def _choose(self, seq: DraftSeq, logits: torch.Tensor) -> tuple[int, np.ndarray | None]:
        # logits: [vocab]
        if seq.temperature == 0.0 or not self.send_probs:
            # A point mass must be deterministic to stay lossless: always argmax here.
            return int(logits.argmax().item()), None
        probs = processed_probs(logits[None], seq.temperature, seq.top_k, seq.top_p)[0]
        token = int(torch.multinomial(probs, 1, generator=seq.generator).item())
        return token, probs.float().cpu().numpy()

    def propose(self, seqs: list[DraftSeq], k: int) -> list[Proposal]:
        if k == 0 or not seqs:
            return [Proposal([]) for _ in seqs]
        room = self.backend.max_model_len
        new_tokens = []
        for s in seqs:
            common = 0
            limit = min(len(s.fed), len(s.token_ids))
            while common < limit and s.fed[common] == s.token_ids[common]:
                common += 1
            common = min(common, len(s.token_ids) - 1)  # always feed >= 1 token to get logits
            self.backend.truncate(s.request_id, common)
            s.fed = list(s.token_ids[:common])
            new_tokens.append(s.token_ids[common:])
        # Never draft past the draft model's own context.
        budget = [max(0, min(k, room - len(s.token_ids))) for s in seqs]
        active = [i for i in range(len(seqs)) if budget[i] > 0]
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[np.ndarray]] = [[] for _ in seqs]
        feed = {i: new_tokens[i] for i in active}
        for depth in range(max((budget[i] for i in active), default=0)):
            rows = [i for i in active if budget[i] > depth]
            # Long catch-up feeds (new or resynced sequences) go in their own forward so the
            # common single-token rows are not padded to a prompt's width.
            groups = [[i for i in rows if len(feed[i]) > 2], [i for i in rows if len(feed[i]) <= 2]]
            for group in groups:
                if not group:
                    continue
                logits = self.backend.forward([seqs[i].request_id for i in group], [feed[i] for i in group], [1] * len(group))
                logits = self._aligned(logits[:, -1])
                for row, i in enumerate(group):
                    seqs[i].fed.extend(feed[i])
                    token, p = self._choose(seqs[i], logits[row])
                    drafts[i].append(token)
                    if p is not None:
                        probs[i].append(p)
                    feed[i] = [token]
        return [Proposal(d, np.stack(p) if p else None) for d, p in zip(drafts, probs)]


class DraftSide:
    """Owns draft-side sequence state; speaks ``ProposeRequest`` -> ``ProposeReply``."""

    def __init__(self, drafter: Drafter, device: str | torch.device = "cpu"):
        self.drafter = drafter
        self.device = device
        self.seqs: dict[str, DraftSeq] = {}

    def open(self, msg: OpenSeq) -> None:
        if msg.request_id in self.seqs:  # re-open (resync): start from the target's tokens
            self.close(msg.request_id)
        seed = None if msg.seed is None else msg.seed + 0x5EED  # draft randomness independent of the target's
        generator = make_generator(seed, self.device) if msg.temperature > 0 else None
        seq = DraftSeq(msg.request_id, list(msg.token_ids), msg.temperature, msg.top_k, msg.top_p, generator)
        self.drafter.open(seq)
        self.seqs[msg.request_id] = seq

    def close(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None:
            self.drafter.close(seq)

    def handle(self, req: ProposeRequest) -> ProposeReply:
        for c in req.closes:
            self.close(c.request_id)
        for o in req.opens:
            self.open(o)
        missing = []
        for r in req.results:
            seq = self.seqs.get(r.request_id)
            if seq is None or len(seq.token_ids) < r.base_len:
                missing.append(r.request_id)
                continue
            seq.token_ids = seq.token_ids[: r.base_len] + list(r.token_ids)
        wanted = [rid for rid in req.request_ids if rid in self.seqs]
        missing += [rid for rid in req.request_ids if rid not in self.seqs and rid not in missing]
        seqs = [self.seqs[rid] for rid in wanted]
        proposals = self.drafter.propose(seqs, req.num_speculative_tokens)
        blocks = [
            DraftBlock(s.request_id, req.step, len(s.token_ids), p.token_ids, p.probs)
            for s, p in zip(seqs, proposals)
        ]
        return ProposeReply(req.step, blocks, missing)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)
