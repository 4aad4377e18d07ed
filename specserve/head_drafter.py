"""Drafting with an EAGLE head (``eagle.py``) fed the target's hidden states, one head KV row per sequence.

The head's KV holds, per sequence, one entry per committed position t it has read together
with the target's row for t (and token t + 1). The rows come with the messages
(``OpenSeq.hidden_states`` at open, ``VerifyResult.hidden_states`` per verdict: committed
positions only) and wait in ``DraftSeq.hidden``. A block: cut the KV back to the positions
read with target rows (a block's later steps read the head's own rows and are scratch),
read the new target rows in one forward (its last logits give draft 1), then one forward
per further draft on the head's own row. Positions whose rows never came (a sequence
re-opened on another draft) read zeros: worse drafts, never different output.

Drafting ahead (the speculation cache, ``model_drafter``): while the target verifies, the
head pre-drafts the likeliest verdicts, each branch starting from the head's own row in
place of the target's row it has not sent yet. On a hit the block goes out with no forward;
the target's real rows are read before the next tree. Such a block can differ from the one
drafted on demand, which greedy output never sees; a request with its own seed keeps no
cache (its draws must not depend on hits). Knows nothing of the wire.
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

    def _scratch_rows(self, counts: list[int]) -> list[torch.Tensor]:
        return [torch.zeros(n, self.model.config.hidden_size, dtype=self.dtype, device=self.device) for n in counts]


class HeadDrafter(ModelDrafter):
    """``ModelDrafter``'s block protocol and speculation cache around an EAGLE head.

    KV entry t of a sequence reads token t + 1 with a row for position t (``ENTRY_SHIFT``): the
    target's row for committed positions, the head's own output row past them. Per sequence the
    drafter keeps the head's own output rows of the block just sent (``_own``: entry j is the row
    a verdict accepting j drafts continues from) and what the next glue forward must feed
    (``_glue_in``). A branch drafted ahead keeps its own rows (``Branch.rows``): on a hit the
    block goes out at once and the glue feeds the target's real rows, then the block's tokens
    with those rows (SSD's way: the real rows replace the guessed ones before the next tree).
    """

    ENTRY_SHIFT = 1
    FOLD = False  # a head's glue feeds the target's rows, which its branches' first depth does not read: kept apart

    def __init__(self, backend: HeadBackend, spec, hidden_layers: tuple[int, ...], target_model: str, send_probs: bool = True,
                 fanout: int = 0, max_branches: int | None = None, preempt: bool = True):
        super().__init__(backend, send_probs, fanout, max_branches, preempt)
        self.spec = spec
        self.hidden_layers = hidden_layers  # the target rows it reads (told to the target at connect)
        self.target_model = target_model  # whose tokenizer names its ids
        self.head = backend.model
        self.fc_digest: str | None = None  # the digest of the head's fc as stored (a target may apply it: speculation.head_fc)
        self._read: dict[str, int] = {}  # sequence key -> positions read with the target's rows
        self._last: dict[str, torch.Tensor] = {}  # sequence key -> the last of those rows, combined ([hidden])
        self._own: dict[str, list[torch.Tensor]] = {}  # sequence key -> the head's own rows after the block's entries
        self._glue_in: dict[str, tuple[bool, list[torch.Tensor]]] = {}  # key -> (drafted now, input rows of the block's unfed tokens)

    def check_target(self, info: dict) -> None:
        """``ValueError`` naming the field when this head cannot read the target (its hello)."""
        check_target(self.spec, info)
        if target_layers(self.spec, info["num_hidden_layers"]) != self.hidden_layers:
            raise ValueError(f"num_hidden_layers: the head was set up for a target of other depth than {info['num_hidden_layers']}")
        if info.get("hidden_fc") is not None and info["hidden_fc"] != self.fc_digest:
            raise ValueError(f"hidden_fc: the target applies an fc (digest {info['hidden_fc']}) that is not this head's "
                             f"({self.fc_digest}): its rows would be read wrong")

    def open(self, seq: DraftSeq) -> None:
        super().open(seq)
        self._read[seq.key] = 0

    def close(self, seq: DraftSeq) -> None:
        super().close(seq)
        for state in (self._read, self._last, self._own, self._glue_in):
            state.pop(seq.key, None)

    def rollback(self, seq: DraftSeq, num_tokens: int) -> None:
        pass  # each block cuts the KV back to the positions read with target rows itself

    def catch_up(self, seqs: list[DraftSeq], should_stop: Callable[[], bool]) -> None:
        """Read rows that came while the target asked for no drafts (off the critical path)."""
        seqs = [s for s in seqs if s.hidden and len(s.token_ids) >= 2]
        if seqs and not should_stop():
            feeds = [self._feed(s) for s in seqs]
            self._forward(seqs, [t for t, _ in feeds], [h for _, h in feeds])

    # -- critical path ------------------------------------------------------------------------
    def propose(self, seqs: list[DraftSeq], ks: list[int], draft_misses: bool = True) -> list[Proposal]:
        self.num_forwards, self.forward_s = 0, 0.0
        out: list[Proposal | None] = [None] * len(seqs)
        room = self.backend.max_model_len
        work = []  # (index, k, prefix tokens, their rows) of sequences drafted now
        for i, (s, k) in enumerate(zip(seqs, ks)):
            k = max(0, min(k, room - len(s.token_ids)))
            branch = self._lookup(s) if k else None
            s.new_block(k)
            s.cache = {}
            self._glue_in.pop(s.key, None)
            prefix = branch.token_ids[:k] if branch is not None else []
            if branch is not None:
                s.block_cands, s.block_probs = list(branch.cands[:len(prefix)]), list(branch.probs[:len(prefix)])
            if k and len(s.token_ids) >= 2 and (len(prefix) >= k or not draft_misses):
                s.block = list(prefix)  # from the cache (maybe empty): the glue feeds the real rows later
                self._glue_in[s.key] = (False, list(branch.rows[:len(prefix)]) if branch is not None else [])
                out[i] = self._proposal(s, num_cached=len(prefix))
            elif k and len(s.token_ids) >= 2:  # (one token: no target row to read yet)
                work.append((i, k, prefix, list(branch.rows[:len(prefix)]) if branch is not None else []))
            else:
                out[i] = Proposal([])
        if work:
            self._draft([seqs[i] for i, _, _, _ in work], [k for _, k, _, _ in work], [p for _, _, p, _ in work],
                        [r for _, _, _, r in work])
            for i, _, prefix, _ in work:
                out[i] = self._proposal(seqs[i], num_cached=len(prefix))
        return out  # type: ignore[return-value]

    def _draft(self, group: list[DraftSeq], ks: list[int], prefixes: list[list[int]], prefix_rows: list[list[torch.Tensor]]):
        """Read the target's new rows (then a partial hit's drafts with their own rows) in one forward,
        then one forward per further draft on the head's own row."""
        feeds = [self._feed(s) for s in group]
        feeds = [(t + p, torch.cat([h, torch.stack(r)]) if r else h) for (t, h), p, r in zip(feeds, prefixes, prefix_rows)]
        keep = [len(p) + 1 for p in prefixes]
        for s, p in zip(group, prefixes):
            s.block = list(p)
        # Long feeds (a new sequence's prompt) go in a forward of their own, so the common
        # one- or two-token rows are not padded to a prompt's width.
        first: list = [None] * len(group)
        for part in ([j for j, f in enumerate(feeds) if len(f[0]) > 2], [j for j, f in enumerate(feeds) if len(f[0]) <= 2]):
            if part:
                logits, rows = self._forward([group[j] for j in part], [feeds[j][0] for j in part], [feeds[j][1] for j in part],
                                             [keep[j] for j in part])
                for n, j in enumerate(part):
                    first[j] = (logits[n, -1], rows[n, rows.shape[1] - keep[j]:])
        for s, (_, rows) in zip(group, first):
            self._own[s.key] = list(rows)
        logits, rows = torch.stack([f[0] for f in first]), torch.stack([f[1][-1] for f in first])
        while True:
            positions = [s.block_base + len(s.block) for s in group]
            tokens, probs, cands = self._choose(group, logits, positions, want_cands=True)
            for row, s in enumerate(group):
                s.block.append(tokens[row])
                if probs[row] is not None:
                    s.block_probs.append(probs[row])
                if cands is not None:
                    s.block_cands.append(cands[row])
            for s, r in zip(group, rows):
                self._glue_in[s.key] = (True, [r])  # the glue feeds the last draft with the row it continues
            live = [j for j, s in enumerate(group) if len(s.block) < ks[j]]
            if not live:
                break
            group, ks, rows = [group[j] for j in live], [ks[j] for j in live], rows[live]
            # The next draft reads the head's own row (scratch: cut back at the next block).
            logits, rows = self._forward(group, [[s.block[-1]] for s in group], [r[None] for r in rows])
            logits, rows = logits[:, -1], rows[:, -1]
            for s, r in zip(group, rows):
                self._own[s.key].append(r)

    # -- off the critical path -------------------------------------------------------------
    def _ahead_seqs(self, seqs: list[DraftSeq]) -> list[DraftSeq]:
        """As a model draft's, glued as a head's (``_glue_feed``: after a hit, the target's real rows
        first; each tree root on the head's own row for it). A seeded sampled request must draw the
        same tokens whatever the hits: its blocks from the cache (drafted on guessed rows) would differ
        from those drafted on demand, so it gets none."""
        return [s for s in seqs if self.fanout and s.key in self._glue_in and (s.block or s.num_asked) and (s.greedy or not s.seeded)]

    @staticmethod
    def _feed_len(feed) -> int:
        return len(feed[0])

    def _glue_feed(self, s: DraftSeq) -> tuple[list[int], torch.Tensor, int]:
        """(tokens, rows, outputs wanted): what the KV has not read of a sequence and its block."""
        drafted, rows = self._glue_in.pop(s.key)
        if drafted:  # every entry but the last draft's is in the KV
            return [s.block[-1]], rows[0][None], 1
        tokens, real = self._feed(s)  # a hit (or an empty block): the target's rows, then the block with its own rows
        return tokens + s.block, torch.cat([real, torch.stack(rows)]) if rows else real, len(s.block) + 1

    def _glue(self, seqs: list[DraftSeq], feeds: list[tuple[list[int], torch.Tensor, int]]) -> None:
        keep = [n for _, _, n in feeds]
        logits, rows = self._forward(seqs, [t for t, _, _ in feeds], [r for _, r, _ in feeds], keep, timed=False)
        bonus_positions = [s.block_base + len(s.block) for s in seqs]
        _, _, cands = self._choose(seqs, logits[:, -1], bonus_positions, want_cands=True)
        for n, (s, c) in enumerate(zip(seqs, cands)):
            s.block_cands = s.block_cands[: len(s.block)] + [c]
            own = list(rows[n, rows.shape[1] - keep[n]:])
            # Drafted now: the block's other rows came from propose. A hit: all of them from this forward.
            self._own[s.key] = own if len(own) == len(s.block) + 1 else self._own[s.key] + own

    def _root_rows(self, seqs: list[DraftSeq], roots: list[list[tuple[int, int]]], lanes: int) -> torch.Tensor:
        """Each root's input row: the head's own row after the j drafts its verdict accepts."""
        out = torch.zeros(len(seqs), lanes, self.head.config.hidden_size, dtype=self.backend.dtype, device=self.backend.device)
        for i, (s, r) in enumerate(zip(seqs, roots)):
            out[i, :len(r)] = torch.stack(self._own[s.key])[[j for j, _ in r]]
        return out

    def _feed(self, s: DraftSeq) -> tuple[list[int], torch.Tensor]:
        """Tokens and combined target rows the head has not read (positions read .. len - 2); when it
        has read them all, the last one again (its logits start the block)."""
        n = len(s.token_ids)
        read = min(self._read[s.key], n - 1)
        if read == n - 1:
            read -= 1
            rows = self._last[s.key][None]
        else:
            combined = s.rows_combined or self.spec.kind != "eagle3"  # (the target applied the fc, or there is none)
            raw = torch.zeros(n - 1 - read, self.head.config.hidden_size if combined else self.head.fc.in_features,
                              dtype=self.backend.dtype, device=self.backend.device)
            for first, t in s.hidden:  # later rows overwrite earlier ones for the same positions
                lo, hi = max(first, read), min(first + t.shape[0], n - 1)
                if lo < hi:
                    raw[lo - read: hi - read] = t[lo - first: hi - first].to(raw.device, raw.dtype)
            rows = raw if s.rows_combined else self.head.combine(raw)
        s.hidden.clear()
        self.backend.truncate(s.key, read)
        self._read[s.key] = n - 1
        self._last[s.key] = rows[-1]
        return s.token_ids[read + 1:], rows

    @torch.no_grad()
    def _forward(self, seqs: list[DraftSeq], tokens: list[list[int]], rows: list[torch.Tensor], keep: list[int] | None = None,
                 timed: bool = True):
        """One head forward: ([batch, max(keep), vocab] logits, [batch, max(keep), hidden] its own rows),
        right-aligned: the last ``keep[i]`` positions of sequence i."""
        start = time.perf_counter()
        logits = self.backend.forward([s.key for s in seqs], tokens, keep or [1] * len(seqs), hidden=rows)
        if timed:
            self.num_forwards += 1
            self.forward_s += time.perf_counter() - start
            if max(len(t) for t in tokens) <= 2:
                self._time(start, len(seqs))
        return logits, self.backend.last_hidden


def build_head_drafter(cfg, fanout: int = 0) -> HeadDrafter:
    """The head in ``cfg.draft.model`` for the target ``cfg.target.model`` (its config and shared tensors only);
    ``fanout`` > 0 keeps a speculation cache (drafting ahead)."""
    from .models import load_config

    d, t = cfg.draft, cfg.target
    spec = head_spec(d.model)
    target = target_info(load_config(t.model, t.trust_remote_code))
    check_target(spec, target)
    layers = target_layers(spec, target["num_hidden_layers"])
    head = load_head(d.model, t.model, target["num_hidden_layers"], resolve_dtype(d.dtype) if d.dtype != "auto" else torch.float32,
                     d.device)
    sp = cfg.speculation
    drafter = HeadDrafter(HeadBackend(head), spec, layers, t.model, sp.draft_probs, fanout, sp.max_branches, sp.draft_ahead_preempt)
    drafter.fc_digest = getattr(head, "fc_digest", None)
    return drafter
