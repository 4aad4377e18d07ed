"""A vLLM target behind specserve's engine surface: ``EngineLoop`` drives it unchanged.

``VLLMEngineCore`` owns an in-process ``vllm.LLMEngine`` whose speculative method is
``custom_class`` with ``RemoteDraftProposer``: continuous batching, the paged KV cache and
rejection sampling are vLLM's; drafts come from specserve's draft side through the
``DraftLink`` the proposer picks up in this process (``link.park``). Per step: add the
waiting requests (specserve ``SamplingParams`` -> vLLM's, delta outputs), ``step()``, turn
each ``RequestOutput`` into a ``StepDelta`` carrying that step's draft and accepted counts
from the proposer. A resumed request continues after its committed output, or replays it
(``vllm/resume.py``). Tensor/data parallelism, dtype and everything else of the target are
vLLM's own arguments (``target_tensor_parallel_size``, ``target_backend_options``). Knows
nothing of Ray or HTTP.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import deque

from ..engine import EngineLoop, RequestQueue, StepResult
from ..logits_processing import check_token_ids
from ..models import load_tokenizer, vocab_fingerprint
from ..outputs import Committed, SpecMetrics, StepDelta
from ..secret import TOKEN_ENV, resolve_token
from ..stopping import StopChecker
from . import link as links
from . import patches, resume, seam
from .options import engine_kwargs, prepare_env, require_vllm, sync_omp_threads

logger = logging.getLogger("specserve.vllm")
PROPOSER = "specserve.vllm.RemoteDraftProposer"
VLLM_METRICS_EVERY_S = 0.5  # how often the engine thread copies vLLM's own counters


class VLLMTarget:
    """What the workers read of a target: tokenizer, context, vocabulary and live requests."""

    def __init__(self, tokenizer, max_model_len: int, vocab_size: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.seqs: dict[str, str] = {}  # request id -> vLLM's internal request id

    def vocab_fingerprint(self) -> dict:
        return vocab_fingerprint(self.tokenizer, self.vocab_size)

    @property
    def num_seqs(self) -> int:
        return len(self.seqs)


class VLLMEngineCore(RequestQueue):
    def __init__(self, cfg, link=None):
        require_vllm()
        from vllm import LLM

        t = cfg.target
        prepare_env(t)
        tokenizer = load_tokenizer(t.model, t.trust_remote_code)
        # vLLM's stat logging costs its engine ~10% of a batch-8 step on CPU (Prometheus histograms per token); it is
        # kept only where its spec-decode counters are the authority: a proposer in vLLM's worker processes.
        extra = {"max_num_seqs": cfg.engine.max_num_seqs, "disable_log_stats": True}
        self.k = cfg.speculation.num_speculative_tokens if (cfg.speculative and link is not None) else 0
        self._key = None
        if self.k:
            spec = cfg.speculation
            self._key = links.park(link)
            extra["speculative_config"] = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": self.k}
            opts = {"link": self._key, "min_timeout_s": spec.draft_min_timeout_s, "max_timeout_s": spec.draft_timeout_s,
                    "delay_ms": cfg.channel.delay_ms, "target_id": link.target_id, "adaptive": spec.adaptive, "cache_only": spec.cache_only,
                    "first_step_drafts": spec.first_step_drafts, "draft_trees": spec.draft_trees,
                    "head_fc": cfg.speculation.head_fc, "head": cfg.draft.model if cfg.draft is not None and cfg.draft.backend == "hf" else None}
            if t.tensor_parallel_size > 1 or os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
                opts.update(links.portable(link))  # the proposer will run in vLLM's worker processes
                extra["disable_log_stats"] = False
                token = resolve_token(cfg.channel.draft_token, cfg.channel.draft_token_file)
                if token:  # they inherit this environment (vLLM logs its config, so the secret stays out of it)
                    os.environ[TOKEN_ENV] = token
            extra["additional_config"] = {"specserve": opts}
            seam.check_installed()  # before the model loads: every vLLM internal the proposer relies on is there
            patches.allow_in_validation()  # min_p and logit_bias: vLLM's validation refuses them under speculation
        self.llm = LLM(**engine_kwargs(t, cfg.engine.max_model_len, tokenizer is not None, **extra))
        self.engine = self.llm.llm_engine
        slot = links.find(self._key)
        self.proposer = slot.proposer if slot is not None else None  # None: vLLM built it in another process
        mc = seam.engine_config(self.llm).model_config
        self.target = VLLMTarget(tokenizer, mc.max_model_len, mc.get_vocab_size())
        self.waiting: deque = deque()
        self._top_n: dict[str, int] = {}  # request id -> top logprobs asked for (requests that asked)
        self._prompt_n: dict[str, tuple[int, list[int]]] = {}  # request id -> (top prompt logprobs, prompt), until vLLM sends them
        self._prompt_lp: dict[str, list] = {}  # request id -> prompt logprobs received, until its first delta carries them
        self._replays: dict[str, resume.Replay] = {}  # resumed requests regenerating their committed output
        self.totals = SpecMetrics()
        self.counters = {"num_steps": 0, "num_requests_failed": 0, "num_requests_aborted": 0, "num_generated_tokens": 0,
                         "num_proposals": 0, "num_verify_steps": 0}
        self.timing = {"wall_s": 0.0, "target_forward_s": 0.0, "draft_wait_s": 0.0, "draft_compute_s": 0.0, "draft_forward_s": 0.0,
                       "verify_s": 0.0, "specserve_s": 0.0}
        self._logits_processing = patches.logits_processing_supported()
        self.vllm_counters: dict = {}
        self._vllm_counters_at = 0.0
        self._vllm_counters_step = -1

    @property
    def pool(self):
        return self.proposer.pool if self.proposer is not None else None

    # -- requests (EngineLoop's surface) --------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params, committed: Committed | None = None) -> None:
        t = self.target
        if not prompt_token_ids:
            raise ValueError("prompt is empty: it must have at least one token")
        if len(prompt_token_ids) >= t.max_model_len:
            raise ValueError(f"prompt has {len(prompt_token_ids)} tokens, but the target's context (max_model_len) is "
                             f"{t.max_model_len}: it must be shorter to leave room for one generated token")
        bad = [x for x in prompt_token_ids if isinstance(x, bool) or not (isinstance(x, int) and 0 <= x < t.vocab_size)]
        if bad:
            raise ValueError(f"prompt token ids must be integers in [0, {t.vocab_size}), got {bad[:5]}")
        StopChecker(params, set(), t.tokenizer, len(prompt_token_ids), t.max_model_len)  # stop strings need a tokenizer
        check_token_ids(params, t.vocab_size, t.tokenizer)
        if self.k and (params.logit_bias or params.min_p) and not self._logits_processing:
            # this vLLM's layout is not the one ``patches`` knows: it would ignore them under speculation
            name = "logit_bias" if params.logit_bias else "min_p"
            raise ValueError(f"{name} is not applied by this vLLM's sampler when speculation is on; "
                             "use specserve's own target engine (target_backend: hf) or a deployment without a draft")
        if committed is not None:
            committed.check(len(prompt_token_ids), params, t.vocab_size, t.max_model_len)
            resume.check(params, committed, t.tokenizer)

    def abort(self, request_id: str) -> bool:
        if self._drop_waiting(request_id):
            return True
        self._top_n.pop(request_id, None)
        self._prompt_n.pop(request_id, None)
        self._prompt_lp.pop(request_id, None)
        self._replays.pop(request_id, None)
        if self.target.seqs.pop(request_id, None) is None:
            return False
        self.engine.abort_request([request_id])  # vLLM frees it; the proposer's hook closes it on the draft
        return True

    def idle(self) -> None:
        """Nothing to step: refresh vLLM's counters, and close on the draft whatever finished last
        (vLLM tells the runner about finished requests only with its next step)."""
        if self._vllm_counters_step != self.counters["num_steps"]:
            self._read_vllm_counters()
        if self.proposer is not None:
            self.proposer.retain(set(self.target.seqs.values()))

    def _params(self, p):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        structured = None
        if p.structured_outputs is not None:  # vLLM's own structured outputs (its grammar masks draft positions too)
            kind, spec = p.structured_outputs
            value = {"json": spec, "json_object": True, "regex": spec, "choice": json.loads(spec) if kind == "choice" else None,
                     "grammar": spec}[kind]
            structured = StructuredOutputsParams(**{kind: value})

        return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=p.max_tokens,
                              stop=list(p.stop) or None, stop_token_ids=list(p.stop_token_ids) or None, ignore_eos=p.ignore_eos,
                              seed=p.seed, skip_special_tokens=p.skip_special_tokens, detokenize=self.target.tokenizer is not None,
                              output_kind=RequestOutputKind.DELTA, presence_penalty=p.presence_penalty,
                              frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty, min_p=p.min_p,
                              min_tokens=p.min_tokens, logit_bias=dict(p.logit_bias) or None,
                              allowed_token_ids=list(p.allowed_token_ids) if p.allowed_token_ids is not None else None,
                              bad_words=list(p.bad_words) or None, include_stop_str_in_output=p.include_stop_str_in_output,
                              logprobs=p.logprobs, prompt_logprobs=p.prompt_logprobs, structured_outputs=structured)

    # -- one step -------------------------------------------------------------------------------
    def step(self) -> StepResult:
        from vllm.inputs import TokensPrompt

        start = time.perf_counter()
        sync_omp_threads()
        result = StepResult()
        while self.waiting:
            rid, prompt, params, committed = self.waiting.popleft()
            if committed is not None:
                if resume.continues(params, committed, self.target.tokenizer):
                    prompt, params = resume.continued(prompt, params, committed)
                else:
                    self._replays[rid] = resume.Replay(committed)
            try:
                self.target.seqs[rid] = self.engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), self._params(params))
                if params.logprobs is not None:
                    self._top_n[rid] = params.logprobs
                if params.prompt_logprobs is not None:
                    self._prompt_n[rid] = (params.prompt_logprobs, list(prompt))
            except Exception as exc:  # this request's fault (vLLM rejected it): it fails alone
                logger.exception("request %s rejected by vLLM", rid)
                result.failed[rid] = exc
        p = self.proposer
        before = (p._step, dict(p.timing), dict(p.counters)) if p is not None else None
        engine_start = time.perf_counter()
        outputs = self.engine.step()
        engine_s = time.perf_counter() - engine_start
        stats = p.step_stats if p is not None and p._step != before[0] else {}
        for out in outputs:
            internal = self.target.seqs.get(out.request_id)
            if internal is None or not out.outputs:
                continue
            comp = out.outputs[0]
            if out.request_id in self._prompt_n and out.prompt_logprobs is not None:
                top_n, prompt = self._prompt_n.pop(out.request_id)
                self._prompt_lp[out.request_id] = _prompt_logprobs(out.prompt_logprobs, prompt, top_n)
            if not comp.token_ids and not out.finished:
                continue
            drafted, accepted, fallback = stats.get(internal, (0, 0, False))
            done = out.finished
            token_ids, text, logprobs = list(comp.token_ids), comp.text or "", _logprobs(comp, self._top_n.get(out.request_id, 0))
            replay = self._replays.get(out.request_id)
            if replay is not None:
                try:
                    token_ids, text, logprobs = replay.take(token_ids, text, logprobs)
                except Exception as exc:  # it diverged: this request cannot go on exactly
                    self.abort(out.request_id)
                    result.failed[out.request_id] = exc
                    continue
                if replay.done:
                    del self._replays[out.request_id]
                if not token_ids and not text and not done:
                    continue
            delta = StepDelta(out.request_id, token_ids, text, done, comp.finish_reason if done else None,
                              comp.stop_reason if done else None, drafted, accepted, fallback,
                              logprobs, self._prompt_lp.pop(out.request_id, None))
            if done:
                del self.target.seqs[out.request_id]
                self._top_n.pop(out.request_id, None)
                self._prompt_n.pop(out.request_id, None)
                self._replays.pop(out.request_id, None)
            self.totals.record(drafted, accepted, fallback)
            self.counters["num_generated_tokens"] += len(delta.token_ids)
            result.deltas.append(delta)
        elapsed = time.perf_counter() - start
        t = self.timing
        propose_s = wait_s = 0.0
        if p is not None:
            for key in ("draft_wait_s", "draft_compute_s", "draft_forward_s", "verify_s"):
                t[key] += p.timing[key] - before[1][key]
            for key in ("num_proposals", "num_verify_steps"):
                self.counters[key] += p.counters[key] - before[2][key]
            propose_s = p.timing["propose_s"] - before[1]["propose_s"]
            wait_s = p.timing["draft_wait_s"] - before[1]["draft_wait_s"]
        t["wall_s"] += elapsed
        t["target_forward_s"] += engine_s - propose_s  # vLLM's step less the proposer's time (includes its scheduling)
        t["specserve_s"] += (elapsed - engine_s) + (propose_s - wait_s)  # ours: this loop and the proposer, not the link
        self.counters["num_steps"] += 1
        self.counters["num_requests_failed"] += len(result.failed)
        if time.monotonic() - self._vllm_counters_at > VLLM_METRICS_EVERY_S:
            self._read_vllm_counters()
        return result

    def _read_vllm_counters(self) -> None:
        """vLLM's own spec-decode counters (the authority when the proposer runs in other processes)."""
        self._vllm_counters_at = time.monotonic()
        self._vllm_counters_step = self.counters["num_steps"]
        if not seam.logs_stats(self.engine):
            return
        out = {}
        for m in self.llm.get_metrics():
            if "spec_decode" in m.name or m.name.endswith(("generation_tokens", "prompt_tokens")):
                out[m.name] = getattr(m, "values", None) if hasattr(m, "values") else getattr(m, "value", None)
        self.vllm_counters = out

    def metrics(self) -> dict:
        steps = max(1, self.counters["num_steps"])
        spec = max(1, self.counters["num_proposals"])
        t = dict(self.timing)
        per_step = {"step_ms": t["wall_s"] / steps * 1e3, "target_forward_ms": t["target_forward_s"] / steps * 1e3,
                    "verify_ms": t["verify_s"] / max(1, self.counters["num_verify_steps"]) * 1e3,  # the runner's part
                    "draft_wait_ms": t["draft_wait_s"] / spec * 1e3, "draft_forward_ms": t["draft_forward_s"] / spec * 1e3,
                    "link_ms": (t["draft_wait_s"] - t["draft_compute_s"]) / spec * 1e3,
                    "overhead_ms": t["specserve_s"] / steps * 1e3}  # specserve's own time per step, beyond vLLM and the link
        totals = self.totals.to_dict()
        v = self.vllm_counters
        if self.proposer is None and self.k and v:  # the proposer runs in vLLM's workers: vLLM's own counts
            totals.update(num_drafts=v.get("vllm:spec_decode_num_drafts", 0), num_draft_tokens=v.get("vllm:spec_decode_num_draft_tokens", 0),
                          num_accepted_tokens=v.get("vllm:spec_decode_num_accepted_tokens", 0),
                          num_accepted_tokens_per_pos=list(v.get("vllm:spec_decode_num_accepted_tokens_per_pos") or []))
            drafted = totals["num_draft_tokens"]
            totals["acceptance_rate"] = totals["num_accepted_tokens"] / drafted if drafted else 0.0
            totals["mean_acceptance_length"] = 1 + totals["num_accepted_tokens"] / totals["num_drafts"] if totals["num_drafts"] else 1.0
        out = {**totals, **self.counters, "timing": t, "per_step": per_step, "num_running": self.num_running,
               "num_waiting": len(self.waiting), "backend": "vllm", "vllm": dict(self.vllm_counters),
               "speculation": {"k": self.k, "max_k": self.k, "adaptive": False}}
        if self.proposer is not None:
            status = self.proposer.status()
            out["drafts"] = status
            out["speculation"] = status["speculation"]
            for key in ("num_cache_hits", "num_blocks", "num_cache_only_steps", "num_plain_steps"):
                out[key] = status[key]
        return out

    def shutdown(self) -> None:
        if self.proposer is not None:
            self.proposer.shutdown()
        if self._key is not None:
            links.release(self._key)
        try:
            seam.shutdown(self.engine)
        except Exception:  # already down
            logger.debug("vLLM engine shutdown", exc_info=True)


class VLLMEngineLoop(EngineLoop):
    """specserve's engine loop over a ``VLLMEngineCore``; shutting down also stops vLLM."""

    def shutdown(self) -> None:
        super().shutdown()
        self.core.shutdown()


def build_engine_loop(cfg, link, name: str = "specserve-engine") -> VLLMEngineLoop:
    return VLLMEngineLoop(VLLMEngineCore(cfg, link), name=name)


def _prompt_logprobs(entries, prompt: list[int], top_n: int) -> list:
    """vLLM's prompt logprobs (None for the first token, then token id -> Logprob dicts) as
    ``StepDelta.prompt_logprobs``."""
    out = [None]
    for tok, d in zip(prompt[1:], list(entries)[1:]):
        own = d.get(tok) if d is not None else None
        tops = sorted((lp.rank, i, lp.logprob) for i, lp in (d or {}).items() if lp.rank is not None and 1 <= lp.rank <= top_n)
        own_entry = [tok, own.logprob, own.rank] if own is not None else [tok, float("-inf"), None]
        out.append([own_entry] + [[i, v] for _, i, v in tops])
    return out


def _logprobs(comp, top_n: int) -> list | None:
    """vLLM's per-token logprob dicts (token id -> Logprob: the token's own, and the top ``top_n`` by
    rank) as ``StepDelta.logprobs``."""
    if comp.logprobs is None:
        return None
    out = []
    for tok, d in zip(comp.token_ids, comp.logprobs):
        own = d.get(tok)
        tops = sorted((lp.rank, i, lp.logprob) for i, lp in d.items() if lp.rank is not None and 1 <= lp.rank <= top_n)
        out.append([[tok, own.logprob if own is not None else float("-inf")]] + [[i, v] for _, i, v in tops])
    return out
