"""vLLM's ``custom_class`` proposer, answered by specserve's remote draft side.

vLLM constructs ``RemoteDraftProposer(vllm_config)`` in each model-runner process and, after
every step, calls ``propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)``; vLLM's
rejection sampler verifies the drafts next step as point masses (lossless at any
temperature, so the draft always drafts greedily and sends no probabilities). Per step, on
the output rank only (vLLM uses that rank's drafts; the other tensor-parallel ranks return
empty lists), each batch row becomes draft-protocol deltas in a ``DraftPool``: a new request
an ``OpenSeq``, the tokens committed since the last step a ``VerifyResult`` (base_len; the
block prefix they match, i.e. accepted drafts; the tokens appended), a finished request a
``CloseSeq``; then one ``ProposeRequest`` per draft asks k tokens per sequence. Each step's k
comes from the same goodput controller as specserve's own engine (``adaptive.py``: measured
acceptance per position, the verify's cost by batch size and width, timed around the
runner's ``execute_model``, the draft's reply time and hit rate): k = 0 asks nothing and
sends nothing, and the committed tokens reach the draft with the next block it is asked for.
vLLM passes no request ids and has no finish hook: both come from the model runner that
constructs this object (its batch's request ids, its request-removed hook), reached through
``seam`` alone, which checks at construction that every internal is where it expects. A draft
that fails or answers late means empty proposals (target-only steps), never a failed request.
For an EAGLE head (``hidden_layers`` set at launch) the runner also keeps the head's layers,
and each step's committed positions' rows ride with the deltas (``_hook_hidden_states``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field

from ..adaptive import SpeculationController
from ..step_plan import StepRecord, hold_first_blocks, observe, plan_draft_lengths, warm_rows
from ..config import resolve_model
from ..devices import placement
from ..messages import DraftProcessing, Hello, OpenSeq, VerifyResult
from ..pool import DraftPool
from . import link as links
from . import patches, seam

logger = logging.getLogger("specserve.vllm")
RECONCILE_EVERY = 64  # steps between checks that every sequence held here is still live in vLLM
MAX_HELD_ROWS = 256  # hidden rows kept per sequence until the head hears of them (older ones read as zeros there)
HEAD_ENV = "SPECSERVE_HEAD"  # under `vllm serve`: the draft head's directory (its layers are set up before the model loads)


@dataclass
class _Seq:
    token_ids: list[int]  # committed tokens, as the draft last heard them
    length: int = 0  # committed tokens in vLLM now (the ones past token_ids are told with the next block)
    block: list[int] = field(default_factory=list)  # the drafts last handed to vLLM, until the draft is told their fate
    block_base: int = -1  # committed length the block continues (-1: none)
    verifying: bool = False  # the block was handed last step: this step's sampled tokens verify it
    fallback: bool = False  # no draft could answer for it last step
    seeded: bool = False  # a seeded sampled request: keeps the configured k (plan_draft_lengths)


class RemoteDraftProposer:
    def __init__(self, vllm_config):
        patches.apply_all()  # this is the process that samples
        self.k = vllm_config.speculative_config.num_speculative_tokens
        self.max_model_len = vllm_config.model_config.max_model_len
        self.runner = seam.find_runner()
        self.seqs: dict[str, _Seq] = {}
        self.step_stats: dict[str, tuple[int, int, bool]] = {}  # request -> (drafts verified, accepted, fallback), last step
        self.timing = {"propose_s": 0.0, "draft_wait_s": 0.0, "draft_compute_s": 0.0, "draft_forward_s": 0.0,
                       "verify_s": 0.0}
        self.counters = {"num_proposals": 0, "num_cache_only_steps": 0, "num_blocks": 0, "num_resyncs": 0, "num_cache_hits": 0,
                         "num_verify_steps": 0, "num_plain_steps": 0}
        self._lock = threading.RLock()
        self._step = 0
        self._last_propose = time.monotonic()
        self._stop = threading.Event()
        self.pool: DraftPool | None = None
        opts = (vllm_config.additional_config or {}).get("specserve", {}) if isinstance(vllm_config.additional_config, dict) else {}
        # A hybrid target (Qwen3-Next's gated delta net, Mamba layers) keeps its linear-attention state per draft
        # position, and vLLM rolls it back assuming every decoding row carries k drafts (its own MTP always
        # proposes k): each row then gets exactly k, short blocks padded, k fixed (``_uniform``).
        self.uniform = _is_hybrid(vllm_config)
        self.controller = SpeculationController(self.k, adaptive=bool(opts.get("adaptive", True)) and not self.uniform,
                                                cache_only=bool(opts.get("cache_only", False)) and not self.uniform)
        # A sequence whose prompt this step prefilled asks no block yet (speculation.first_step_drafts off): its
        # open goes out now, and the draft prefills it and drafts its first block ahead while the target runs the
        # next step, instead of the whole batch (and this first token's delivery) waiting for that here.
        self.first_step_drafts = bool(opts.get("first_step_drafts", False))
        self._step_started: float | None = None  # when the runner began the step being verified
        self._scheduler_output = None  # the step's scheduler output, as the runner's execute_model got it
        self._last_end: float | None = None  # when the previous step's propose returned
        self._between: float | None = None  # vLLM's own time between that and this step's runner (None: an idle gap)
        self._between_ema: float | None = None
        self._asked = None  # (ProposeOutcome, {request: block handed}, {request: k asked}, cache only, warm rows) of the last ask
        self._num_seeded = 0  # live seeded sampled requests (they keep the configured k)
        self._prev_arm = None  # the arm of the last step's ask
        self._last_rows: set[str] = set()  # the requests the last step ran
        head = opts.get("head") or os.environ.get(HEAD_ENV)
        self.head = resolve_model(head) if head else None  # the draft's directory, when it may be a head
        self.hidden_layers = _head_layers(self.head, vllm_config)  # an EAGLE/MTP head's rows, fixed at launch (None: no head)
        self._rows: dict[str, list] = {}  # request id -> committed positions' rows the draft has not heard of yet
        self._step_hidden = None  # this step's (hidden_states, aux_hidden_states), from the runner
        self._fc = None  # an EAGLE-3 head's fc weight when it runs here (speculation.head_fc)
        if not seam.is_output_rank():
            return  # vLLM takes the output rank's drafts; this rank proposes nothing
        if self.runner is None:
            seam.check(None)  # raises: no model runner constructs this proposer
        slot = links.find(opts.get("link"))
        delay_ms = float(opts.get("delay_ms", 0.0))
        link = slot.link if slot is not None else (links.from_names(opts.get("addresses") or [], opts.get("app"), delay_ms,
                                                                    opts.get("target_id")) or links.from_env(delay_ms))
        if link is None:
            raise ValueError(f"RemoteDraftProposer: no draft named: set {links.ADDRESS_ENV}=host:port[,host:port] "
                             f"(draft servers, e.g. `specserve draft`) or {links.APP_ENV}=<specserve Serve app>")
        seam.check(type(self.runner))  # every internal used below is where the seam expects it, or one error names what is not
        if slot is not None:
            slot.proposer = self
        self._hook_finished()
        self._hook_step_timer()
        self._hook_plain_steps()
        device = str(getattr(getattr(vllm_config, "device_config", None), "device", "cpu") or "cpu")
        hello_info = {**link.hello_info, "placement": placement(device)}
        if self.hidden_layers is not None:
            hello_info.update(self._hook_hidden_states(vllm_config, opts, device))
        self.pool = DraftPool(
            discover=link.discover, connect=link.connect, hello=Hello(link.target_id, opts.get("vocab") or _fingerprint(vllm_config), hello_info),
            reopen=self._reopen, min_timeout_s=float(opts.get("min_timeout_s", 0.5)),
            max_timeout_s=float(opts.get("max_timeout_s", 10.0)), background=link.background,
            keep_hidden=self._keep_hidden if self.hidden_layers is not None else None, trees=bool(opts.get("draft_trees", False)),
        )
        threading.Thread(target=self._idle_flush, name="specserve-proposer-flush", daemon=True).start()
        mode = "adaptive" if self.controller.adaptive else "fixed, every row padded to k: a hybrid target" if self.uniform else "fixed"
        logger.info("RemoteDraftProposer: k<=%d (%s), target %s", self.k, mode, link.target_id)

    def load_model(self, *args, **kwargs) -> None:
        """vLLM's runner calls this with the target model once its constructor is done: a remote draft needs
        nothing from it, but every attribute the seam reads is set by now, and checked."""
        if self.pool is not None:
            seam.check(self.runner)

    # -- sequences ------------------------------------------------------------------------------
    def _hook_finished(self) -> None:
        """A finished or aborted request closes its draft state."""
        seam.on_request_removed(self.runner, self.close)

    def _hook_step_timer(self) -> None:
        """Time each verify: from the runner's ``execute_model`` to this step's ``propose``; keep the step's
        scheduler output (which rows carry drafts), which ``propose`` is not passed."""
        seam.on_step(self.runner, self._step_begins)

    def _step_begins(self, scheduler_output) -> None:
        now = self._step_started = time.perf_counter()
        self._scheduler_output = scheduler_output
        # vLLM's scheduling and output handling since the last step (an idle engine's wait is no cost).
        gap = None if self._last_end is None else now - self._last_end
        typical = self._between_ema
        self._between = gap if gap is not None and (typical is None or gap < max(0.02, 4 * typical)) else None
        if self._between is not None:
            self._between_ema = gap if typical is None else 0.9 * typical + 0.1 * gap

    def _hook_plain_steps(self) -> None:
        """A step that verifies no drafts runs as vLLM runs a target without speculation.

        With a speculative config, vLLM's runner builds speculative metadata and samples through its
        rejection sampler on every step, drafts or none, which costs a k = 0 step several times what the
        plain sampler does. Without speculative metadata
        (``seam.plain_steps``) vLLM samples with its plain sampler, whose one token per row the
        bookkeeping reads as it reads a rejection sampler's. Left as is:
        a hybrid target (its linear-attention state is rolled back per draft position, also at zero
        drafts) and steps with a seeded sampled request (its draws must not depend on whether a step
        carried drafts)."""
        if not self.uniform:
            seam.plain_steps(self.runner, self._plain_step)

    def _plain_step(self, scheduler_output) -> bool:
        if seam.scheduled_drafts(scheduler_output) or self._num_seeded:
            return False
        self.counters["num_plain_steps"] += 1
        return True

    # -- hidden states for an EAGLE head ----------------------------------------------------------
    def _hook_hidden_states(self, vllm_config, opts: dict, device: str) -> dict:
        """Make vLLM's runner keep the rows the head reads and hand them to this proposer each step
        (``seam.keep_hidden_states``: the head's layers, fixed at launch; EAGLE-1 reads the final hidden
        state); returns what the hello tells the head (width, depth, dtype). With ``head_fc`` on the
        target, the head's fc weight is read from its checkpoint here and applied to the rows before they
        leave."""
        from ..eagle import FINAL, fc_runs_on_target, head_fc

        layers = self.hidden_layers
        seam.keep_hidden_states(self.runner, None if layers == (FINAL,) else list(layers), self._receive_hidden)
        hf = vllm_config.model_config.hf_config
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        dtype = str(vllm_config.model_config.dtype).split(".")[-1]
        info = {"hidden_size": text.hidden_size, "num_hidden_layers": text.num_hidden_layers, "hidden_dtype": dtype}
        fc = head_fc(self.head) if fc_runs_on_target(opts.get("head_fc", "auto"), device) else None
        if fc is not None:
            self._fc = fc[0].to(device=device, dtype=vllm_config.model_config.dtype)
            info["hidden_fc"] = fc[1]
        return info

    def _receive_hidden(self, step_hidden) -> None:
        self._step_hidden = step_hidden

    def _keep_hidden(self, layers: tuple[int, ...]) -> None:
        if tuple(layers) != self.hidden_layers:
            raise ValueError(f"this vLLM target keeps the rows of layers {list(self.hidden_layers)} (set at launch from the "
                             f"draft's config); the head reads {list(layers)}")

    def _hold_rows(self, rid: str, i: int, num_committed: int | None) -> None:
        """Keep the rows of batch row i's first ``num_committed`` scheduled tokens (None: all of them)."""
        hidden, aux = self._step_hidden or (None, None)
        loc = seam.query_start_loc(self.runner)
        if hidden is None or loc is None:
            return
        start, end = int(loc[i]), int(loc[i + 1])
        end = end if num_committed is None else min(end, start + num_committed)
        if end <= start:
            return
        rows = _torch().cat([h[start:end] for h in aux], dim=-1) if aux else hidden[start:end].clone()
        if self._fc is not None:  # the head's fc, here: one H-wide row travels instead of three
            rows = _torch().nn.functional.linear(rows, self._fc)
        held = self._rows.setdefault(rid, [])
        held.append(rows)
        if sum(r.shape[0] for r in held) > 2 * MAX_HELD_ROWS:
            self._rows[rid] = [_torch().cat(held, dim=0)[-MAX_HELD_ROWS:]]

    def _take_rows(self, rid: str):
        held = self._rows.pop(rid, None)
        if not held:
            return None
        rows = held[0] if len(held) == 1 else _torch().cat(held, dim=0)
        return rows[-MAX_HELD_ROWS:]

    def close(self, rid: str) -> None:
        with self._lock:
            self._rows.pop(rid, None)
            seq = self.seqs.pop(rid, None)
            if seq is not None:
                self._num_seeded -= seq.seeded
                if self.pool is not None:
                    self.pool.close(rid)

    def retain(self, live: set[str]) -> None:
        """Close every sequence not in ``live`` (vLLM request ids the engine still runs)."""
        with self._lock:
            for rid in [r for r in self.seqs if r not in live]:
                self.close(rid)

    def _reopen(self, rid: str) -> OpenSeq | None:
        seq = self.seqs.get(rid)
        if seq is None:
            return None
        # Greedy drafts (point masses). A head gets the held rows when they end where the tokens do (at an
        # open; a later re-open may hold rows of tokens not yet told, and the head reads zeros instead).
        rows = self._take_rows(rid) if self.hidden_layers is not None else None
        return OpenSeq(rid, list(seq.token_ids), hidden_states=rows if seq.length == len(seq.token_ids) else None,
                       processing=self._processing(rid))

    def _processing(self, rid: str) -> DraftProcessing | None:
        """What vLLM does to this request's distribution beyond temperature / top-k / top-p, for the draft
        to do to its proposals (acceptance only: vLLM verifies against its own processed distribution)."""
        p = seam.sampling_params(self.runner, rid)
        try:
            bias, bad = dict(p.logit_bias or {}), list(p.bad_words_token_ids or [])
            allowed, penalties = p.allowed_token_ids, (p.presence_penalty, p.frequency_penalty, p.repetition_penalty)
            if not (bias or allowed or bad or p.min_tokens or penalties != (0.0, 0.0, 1.0)):
                return None
            return DraftProcessing(seam.num_prompt_tokens(self.runner, rid), [int(t) for t in bias], [float(b) for b in bias.values()],
                                   [int(t) for t in allowed] if allowed else None, [[int(t) for t in w] for w in bad],
                                   int(p.min_tokens), sorted(int(t) for t in p.all_stop_token_ids), *map(float, penalties))
        except (AttributeError, TypeError, ValueError):  # no request state, or a vLLM whose state reads otherwise
            return None

    def _open(self, rid: str, token_ids: list[int]) -> _Seq:
        seq = self.seqs[rid] = _Seq(token_ids, len(token_ids), seeded=self._seeded_sampled(rid))
        self._num_seeded += seq.seeded
        self.pool.open(rid)
        return seq

    def _tell(self, rid: str, seq: _Seq, row) -> None:
        """Tell the draft what this sequence committed since it last heard (one ``VerifyResult``):
        base_len, how many drafts of the last block survived, the tokens appended."""
        base, length = len(seq.token_ids), seq.length
        if length < base or int(row[base - 1]) != seq.token_ids[-1]:  # not the sequence we knew: resync
            self.counters["num_resyncs"] += 1
            self.close(rid)
            self._open(rid, row[:length].tolist())
            return
        # .tolist(): the appended tokens travel in a message.
        appended = row[base:length].tolist()
        accepted = 0
        if seq.block_base == base:
            for a, d in zip(appended, seq.block):
                if a != d:
                    break
                accepted += 1
        seq.block, seq.block_base = [], -1
        if appended:
            seq.token_ids.extend(appended)
            rows = self._take_rows(rid) if self.hidden_layers is not None else None
            self.pool.result(VerifyResult(rid, base, accepted, appended, rows))

    def _room(self, rid: str, length: int) -> int:
        """Draft tokens this sequence can use: within max_tokens and the context, leaving the bonus token."""
        room = min(self.k, self.max_model_len - length - 1)
        params, done = seam.sampling_params(self.runner, rid), seam.num_output_tokens(self.runner, rid)
        if params is not None and params.max_tokens is not None:
            room = min(room, params.max_tokens - done - 1)
        min_tokens = getattr(params, "min_tokens", 0) or 0
        if done < min_tokens:
            # vLLM masks the stop tokens of the bonus token's row by the committed length alone, so a
            # block that reaches past min_tokens would mask one that target-only decoding allows:
            # while min_tokens is not reached, drafts stop short of it.
            room = min(room, min_tokens - done - 1)
        return max(0, room)

    def _reconcile(self) -> None:
        live = seam.live_requests(self.runner)
        if live is not None:
            for rid in [r for r in self.seqs if r not in live]:
                self.close(rid)

    # -- a step ---------------------------------------------------------------------------------
    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        n = len(sampled_token_ids)
        if self.pool is None:
            return [[] for _ in range(n)]
        scheduler_output, self._scheduler_output = self._scheduler_output, None
        if scheduler_output is None and self._step_started is None:  # no execute_model hook: the caller has it
            scheduler_output = seam.caller_scheduler_output()
        scheduled = seam.scheduled_drafts(scheduler_output)
        start = time.perf_counter()
        try:
            # A head's rows are cut from vLLM's tensors here, for a head that may run in this process.
            with self._lock, (_normal_tensors() if self.hidden_layers is not None else contextlib.nullcontext()):
                return self._propose(sampled_token_ids, num_tokens_no_spec, token_ids_cpu, scheduled,
                                     seam.num_scheduled_tokens(scheduler_output))
        except Exception:  # a bug here must not fail vLLM's step: this step goes target-only
            logger.exception("RemoteDraftProposer failed; no drafts this step")
            return [[] for _ in range(n)]
        finally:
            self._last_propose = time.monotonic()
            self._last_end = time.perf_counter()
            self.timing["propose_s"] += self._last_end - start

    def _propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, scheduled, num_scheduled=None) -> list[list[int]]:
        entered = time.perf_counter()
        verify_s = entered - self._step_started if self._step_started is not None else None
        step_s = verify_s + self._between if verify_s is not None and self._between is not None else None
        self._step_started = None
        n = len(sampled_token_ids)
        self._step += 1
        self.step_stats = {}
        req_ids = seam.request_ids(self.runner)
        lengths = num_tokens_no_spec[:n].tolist()  # (one conversion, not one per row)
        seqs, hidden = self.seqs, self.hidden_layers is not None
        live, widest, prefill, decoded = {}, 0, False, 0  # request id -> (row, sequence); decode tokens this step
        fresh = False  # a new sequence's block was not asked: its open must go out this step
        opened = []  # sequences this step's prefill opened
        for i in range(n):  # per row only what cannot wait: the committed length, and last step's block's fate
            sampled = sampled_token_ids[i]
            if not sampled:  # a prefill chunk that is not finished: nothing committed yet
                prefill = True
                if hidden:
                    self._hold_rows(req_ids[i], i, None)
                continue
            rid, length = req_ids[i], lengths[i]
            seq = seqs.get(rid)
            if hidden:  # prompt rows, or the verify input's and the accepted drafts'
                self._hold_rows(rid, i, None if seq is None else len(sampled))
            if seq is None:
                prefill = True
                # .tolist(): the whole prompt travels in the OpenSeq.
                seq = self._open(rid, token_ids_cpu[i, :length].tolist())
                opened.append(rid)
            else:
                decoded += 1 + (len(scheduled.get(rid, ())) if scheduled is not None else 0)
            if seq.verifying or seq.fallback:
                verified = (len(scheduled.get(rid, ())) if scheduled is not None else len(seq.block)) if seq.verifying else 0
                accepted = max(0, len(sampled) - 1) if verified else 0
                self.step_stats[rid] = (verified, accepted, seq.fallback)
                if verified:
                    self.controller.observe_acceptance(verified, accepted)
                widest = max(widest, verified)
                seq.verifying = seq.fallback = False
            seq.length = length
            live[rid] = (i, seq)
        verified = (len(live), 1 + widest, verify_s, step_s, prefill, self._asked)
        # This step's whole cycle (from the previous propose's end to this one's): what the arm that
        # drafted for it delivered, every cost included, and the prompt tokens the step prefilled (whose
        # cost the controller takes out); not after an idle gap.
        cycle = [len(live), sum(len(x) for x in sampled_token_ids), self._between is not None and self._last_end is not None,
                 max(0, num_scheduled - decoded) if num_scheduled is not None else 0,  # (the rest of the step's tokens: prompts)
                 len(self._last_rows - live.keys())]  # (sequences that left: vLLM handled their outputs in this cycle)
        self._last_rows = set(live)
        if self._step % RECONCILE_EVERY == 0:
            self._reconcile()
        drafts: list[list[int]] = [[] for _ in range(n)]
        have = self.pool.has_drafts
        if self.uniform:  # every row carries k (padded below), a draft connected or not; no room to read per row
            self.controller.choose(len(live), have)
            wants = {rid: self.k for rid in live}
        else:
            wants = plan_draft_lengths(self.controller, len(live), have,
                                       ((rid, self._room(rid, seq.length), seq.seeded) for rid, (_, seq) in live.items()),
                                       cache=have and self.pool.drafts_ahead, seeded=self._num_seeded > 0)
            if wants and not self.first_step_drafts:
                fresh = hold_first_blocks(wants, opened, lambda rid: self.seqs[rid].seeded)
        arm = self.controller.arm if wants or not (self.controller.arm and self.controller.arm[0]) else None
        previous = self._asked[2] if self._asked is not None else None
        if not wants:  # k = 0: nothing asked; before a probe the deltas go out unawaited, so it starts warm
            self._asked = None
            if have and (fresh or self.controller.push_due(len(live))):
                for rid, (i, seq) in live.items():
                    if rid in self.seqs:
                        self._tell(rid, seq, token_ids_cpu[i])
                with _normal_tensors():
                    self.pool.push(self._step)
            self._observe_verify(*verified, own_s=time.perf_counter() - entered)
            self._observe_cycle(*cycle, arm)
            return drafts
        for rid in wants:
            i, seq = live[rid]
            self._tell(rid, seq, token_ids_cpu[i])
        wants = {rid: k for rid, k in wants.items() if rid in self.seqs}  # (a resync reopened it: asked next step)
        cache_only = self.controller.cache_only
        with _normal_tensors():
            outcome = self.pool.propose(self._step, wants, not cache_only, self.controller.budget(len(live), max(wants.values(), default=0)),
                                        self.controller.acceptance)
        handed = {}
        for rid in wants:
            seq = self.seqs[rid]
            block = outcome.blocks.get(rid)
            seq.fallback = rid in outcome.fallback
            if block is not None and block.base_len == len(seq.token_ids) and block.draft_token_ids:
                seq.block, seq.block_base = list(block.draft_token_ids[: wants[rid]]), len(seq.token_ids)
                seq.verifying = True
                drafts[live[rid][0]] = seq.block
                handed[rid] = block
                self.counters["num_blocks"] += 1
        if self.uniform:
            self._uniform(drafts, live, token_ids_cpu)
        self._asked = (outcome, handed, wants, cache_only, warm_rows(previous, wants))
        self.counters["num_proposals"] += 1
        self.counters["num_cache_only_steps"] += cache_only
        t = self.timing
        t["draft_wait_s"] += outcome.wait_s
        t["draft_compute_s"] += outcome.compute_s
        t["draft_forward_s"] += outcome.forward_s
        self._observe_verify(*verified, own_s=time.perf_counter() - entered - outcome.wait_s)
        self._observe_cycle(*cycle, arm)
        return drafts

    def _uniform(self, drafts: list[list[int]], live: dict, token_ids_cpu) -> None:
        """Pad every decoding row's drafts to k (a hybrid target): with the block's last token, or the row's last
        committed one. The padding is verified like any draft; the draft hears only of its own block's fate."""
        for rid, (i, seq) in live.items():
            block = drafts[i]
            if len(block) < self.k:
                fill = block[-1] if block else int(token_ids_cpu[i, seq.length - 1])
                drafts[i] = block + [fill] * (self.k - len(block))

    def _observe_verify(self, batch_size: int, tokens_per_row: int, verify_s: float | None, step_s: float | None,
                        prefill: bool, last_ask, own_s: float) -> None:
        """The controller learns from the step vLLM just verified (the blocks of ``last_ask``): its cost is
        vLLM's whole step (scheduling and output handling included) and this proposer's own time, all but
        the wait for the drafts. A step that also prefilled, or followed an idle gap, is left out."""
        outcome, handed, asked, cache_only, warm = last_ask if last_ask is not None else (None, {}, {}, False, frozenset())
        hits = sum(1 for b in handed.values() if b.cache_hit)
        self.counters["num_cache_hits"] += hits
        if verify_s is None or prefill or not batch_size:
            return
        self.timing["verify_s"] += verify_s
        self.counters["num_verify_steps"] += 1
        if step_s is not None:
            observe(self.controller, StepRecord(batch_size, tokens_per_row, step_s + own_s, outcome, len(handed), hits, asked,
                                                cache_only, warm))

    def _observe_cycle(self, batch_size: int, num_tokens: int, busy: bool, prefill_tokens: int, left: int, arm) -> None:
        """This cycle verified the last ask's drafts and waited on this step's ask: it measures ``arm``
        when both asks ran it (None: a step that asked nothing while its arm speculates)."""
        pure = arm is not None and arm == self._prev_arm
        self._prev_arm = arm
        if busy and batch_size:
            self.controller.observe_cycle(batch_size, num_tokens, time.perf_counter() - self._last_end, arm, pure, prefill_tokens, left)

    def _seeded_sampled(self, rid: str) -> bool:
        params = seam.sampling_params(self.runner, rid)
        return params is not None and getattr(params, "seed", None) is not None and (getattr(params, "temperature", 0.0) or 0.0) > 0

    # -- idle, status, shutdown -----------------------------------------------------------------
    def _idle_flush(self) -> None:
        """While vLLM is idle, deliver queued closes and heartbeat the drafts (as specserve's engine does)."""
        while not self._stop.wait(0.5):
            if time.monotonic() - self._last_propose < 1.0:
                continue
            with self._lock:
                try:
                    self.pool.poll()
                    self.pool.flush(self._step)
                except Exception:  # best effort: the next step retries
                    logger.exception("RemoteDraftProposer: idle flush failed")

    def status(self) -> dict:
        """Lock-free (a step may hold the lock while a draft is slow, and metrics must never wait on it)."""
        return {**(self.pool.status() if self.pool is not None else {}), **self.counters, "timing": dict(self.timing),
                "num_seqs": len(self.seqs), "speculation": self.controller.state()}

    def shutdown(self) -> None:
        self._stop.set()
        if self.pool is not None:
            self.pool.shutdown()


def _torch():
    import torch

    return torch


def _normal_tensors():
    """vLLM samples (and calls ``propose``) under torch.inference_mode; a draft that runs in this process
    computes when it is sent a request, and its KV cache must stay a normal tensor."""
    return _torch().inference_mode(False)


def _is_hybrid(vllm_config) -> bool:
    try:
        return bool(vllm_config.model_config.is_hybrid)
    except Exception:  # an older vLLM, or a config without model info
        return False


def _head_layers(head: str | None, vllm_config) -> tuple[int, ...] | None:
    """The target layers a draft head in ``head`` reads (None: not a head, or none named)."""
    if not head:
        return None
    from ..eagle import head_spec, target_layers

    spec = head_spec(head)
    if spec is None:
        return None
    hf = vllm_config.model_config.hf_config
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    return target_layers(spec, text.num_hidden_layers)


def _fingerprint(vllm_config) -> dict:
    """The target's vocabulary fingerprint, as specserve's own target computes it."""
    from ..models import load_tokenizer, vocab_fingerprint

    mc = vllm_config.model_config
    tokenizer = None if getattr(mc, "skip_tokenizer_init", False) else load_tokenizer(mc.tokenizer, mc.trust_remote_code)
    return vocab_fingerprint(tokenizer, mc.get_vocab_size())
