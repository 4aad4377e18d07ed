"""Drafting with an EAGLE head (``eagle.py``) fed the target's hidden states, one head KV row per sequence.

The head's KV holds, per sequence, one entry per committed position t it has read together
with the target's row for t (and token t + 1). The rows come with the messages
(``OpenSeq.hidden_states`` at open, ``VerifyResult.hidden_states`` per verdict: committed
positions only) and wait in ``DraftSeq.hidden``. A block: cut the KV back to the positions
read with target rows (a block's later steps read the head's own rows and are scratch),
read the new target rows in one forward (its last logits give draft 1), then one forward
per further draft on the head's own row. Positions whose rows never came (a sequence
re-opened on another draft) read zeros: worse drafts, never different output. No
speculation cache yet: a head drafts on the critical path. Knows nothing of the wire.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from .backends.hf import HFBackend, model_max_len, resolve_dtype
from .draft import DraftSeq, Proposal
from .eagle import check_target, head_spec, load_head, target_info, target_layers
from .model_drafter import ModelDrafter


class HeadBackend(HFBackend):
    """``HFBackend``'s batching and slot KV around a draft head instead of a causal LM."""

    def __init__(self, head, max_model_len: int | None = None):
        self._adopt(head, head.spec.vocab_size, model_max_len(head.config), max_model_len)


class HeadDrafter(ModelDrafter):
    def __init__(self, backend: HeadBackend, spec, hidden_layers: tuple[int, ...], target_model: str, send_probs: bool = True):
        super().__init__(backend, send_probs, fanout=0)
        self.spec = spec
        self.hidden_layers = hidden_layers  # the target rows it reads (told to the target at connect)
        self.target_model = target_model  # whose tokenizer names its ids
        self.head = backend.model
        self._read: dict[str, int] = {}  # sequence key -> positions read with the target's rows
        self._last: dict[str, torch.Tensor] = {}  # sequence key -> the last of those rows, combined ([hidden])

    def check_target(self, info: dict) -> None:
        """``ValueError`` naming the field when this head cannot read the target (its hello)."""
        check_target(self.spec, info)
        if target_layers(self.spec, info["num_hidden_layers"]) != self.hidden_layers:
            raise ValueError(f"num_hidden_layers: the head was set up for a target of other depth than {info['num_hidden_layers']}")

    def open(self, seq: DraftSeq) -> None:
        super().open(seq)
        self._read[seq.key] = 0

    def close(self, seq: DraftSeq) -> None:
        super().close(seq)
        self._read.pop(seq.key, None)
        self._last.pop(seq.key, None)

    def rollback(self, seq: DraftSeq, num_tokens: int) -> None:
        pass  # each block cuts the KV back to the positions read with target rows itself

    def catch_up(self, seqs: list[DraftSeq], should_stop: Callable[[], bool]) -> None:
        """Read rows that came while the target asked for no drafts (off the critical path)."""
        seqs = [s for s in seqs if s.hidden and len(s.token_ids) >= 2]
        if seqs and not should_stop():
            feeds = [self._feed(s) for s in seqs]
            self._forward(seqs, [t for t, _ in feeds], [h for _, h in feeds])

    def prepare(self, seqs, should_stop, budget_s: float = 0.0) -> None:
        pass  # (no speculation cache for heads yet)

    # -- critical path ------------------------------------------------------------------------
    def propose(self, seqs: list[DraftSeq], ks: list[int], draft_misses: bool = True) -> list[Proposal]:
        self.num_forwards, self.forward_s = 0, 0.0
        room = self.backend.max_model_len
        work = []
        for i, (s, k) in enumerate(zip(seqs, ks)):
            k = max(0, min(k, room - len(s.token_ids)))
            s.block, s.block_base, s.num_asked, s.block_probs, s.block_cands = [], len(s.token_ids), k, [], []
            if k and draft_misses and len(s.token_ids) >= 2:  # (one token: no target row to read yet)
                work.append((i, k))
        if work:
            group = [seqs[i] for i, _ in work]
            feeds = [self._feed(s) for s in group]
            # Long feeds (a new sequence's prompt) go in a forward of their own, so the common
            # one- or two-token rows are not padded to a prompt's width.
            first: list = [None] * len(group)
            for part in ([j for j, f in enumerate(feeds) if len(f[0]) > 2], [j for j, f in enumerate(feeds) if len(f[0]) <= 2]):
                if part:
                    out = self._forward([group[j] for j in part], [feeds[j][0] for j in part], [feeds[j][1] for j in part])
                    for n, j in enumerate(part):
                        first[j] = (out[0][n], out[1][n])
            logits, rows = torch.stack([f[0] for f in first]), torch.stack([f[1] for f in first])
            ks = [k for _, k in work]
            while True:
                positions = [s.block_base + len(s.block) for s in group]
                tokens, probs, _ = self._choose(group, logits, positions, want_cands=False)
                for row, s in enumerate(group):
                    s.block.append(tokens[row])
                    if probs[row] is not None:
                        s.block_probs.append(probs[row])
                live = [j for j, s in enumerate(group) if len(s.block) < ks[j]]
                if not live:
                    break
                group, ks, rows = [group[j] for j in live], [ks[j] for j in live], rows[live]
                # The next draft reads the head's own row (scratch: cut back at the next block).
                logits, rows = self._forward(group, [[s.block[-1]] for s in group], [r[None] for r in rows])
        return [self._proposal(s, cache_hit=False) for s in seqs]

    def _feed(self, s: DraftSeq) -> tuple[list[int], torch.Tensor]:
        """Tokens and combined target rows the head has not read (positions read .. len - 2); when it
        has read them all, the last one again (its logits start the block)."""
        n = len(s.token_ids)
        read = min(self._read[s.key], n - 1)
        if read == n - 1:
            read -= 1
            rows = self._last[s.key][None]
        else:
            raw = torch.zeros(n - 1 - read, self.head.fc.in_features if self.spec.kind == "eagle3" else self.head.config.hidden_size,
                              dtype=self.backend.dtype, device=self.backend.device)
            for first, t in s.hidden:  # later rows overwrite earlier ones for the same positions
                lo, hi = max(first, read), min(first + t.shape[0], n - 1)
                if lo < hi:
                    raw[lo - read: hi - read] = t[lo - first: hi - first].to(raw.device, raw.dtype)
            rows = self.head.combine(raw)
        s.hidden.clear()
        self.backend.truncate(s.key, read)
        self._read[s.key] = n - 1
        self._last[s.key] = rows[-1]
        return s.token_ids[read + 1:], rows

    @torch.no_grad()
    def _forward(self, seqs: list[DraftSeq], tokens: list[list[int]], rows: list[torch.Tensor]):
        """One head forward: ([batch, vocab] logits of each last position, [batch, hidden] its own rows)."""
        start = time.perf_counter()
        logits = self.backend.forward([s.key for s in seqs], tokens, [1] * len(seqs), hidden=rows)
        self.num_forwards += 1
        self.forward_s += time.perf_counter() - start
        if max(len(t) for t in tokens) <= 2:
            self._time(start, len(seqs))
        return logits[:, -1], self.backend.last_hidden[:, -1]


def build_head_drafter(cfg) -> HeadDrafter:
    """The head in ``cfg.draft.model`` for the target ``cfg.target.model`` (its config and shared tensors only)."""
    from .models import load_config

    d, t = cfg.draft, cfg.target
    spec = head_spec(d.model)
    target = target_info(load_config(t.model, t.trust_remote_code))
    check_target(spec, target)
    layers = target_layers(spec, target["num_hidden_layers"])
    head = load_head(d.model, t.model, target["num_hidden_layers"], resolve_dtype(d.dtype) if d.dtype != "auto" else torch.float32,
                     d.device)
    return HeadDrafter(HeadBackend(head), spec, layers, t.model, cfg.speculation.draft_probs)
