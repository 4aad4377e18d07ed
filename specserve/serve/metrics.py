"""Render the registry's snapshot as Prometheus text, with vLLM's spec-decode metric names, and
this router's own counts (admission, resumed requests).

Ray metric names may not contain ':' so vLLM's ``vllm:spec_decode_*`` become
``specserve_spec_decode_*``. Counters are summed over the live target replicas; drafts and
targets also get one gauge per replica. Hand-written (a few dozen lines) rather than a
``prometheus_client`` registry: the numbers live in other processes and arrive as one
snapshot per scrape, which the text format renders directly.
"""

from __future__ import annotations

import bisect

RESUME_CAUSES = ("death", "stall", "error", "scale_down")


class ResumeStats:
    """This router's resumed requests: how many, by cause, and how long each resume took (from the
    failure noticed to the first delta from the replica that took over)."""

    BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)

    def __init__(self):
        self.by_cause = dict.fromkeys(RESUME_CAUSES, 0)
        self.buckets = [0] * (len(self.BUCKETS_S) + 1)  # the last: above every bound
        self.sum_s = 0.0
        self.count = 0

    def resumed(self, cause: str) -> None:
        self.by_cause[cause] = self.by_cause.get(cause, 0) + 1

    def took(self, seconds: float) -> None:
        self.buckets[bisect.bisect_left(self.BUCKETS_S, seconds)] += 1
        self.sum_s += seconds
        self.count += 1

    def lines(self, model: str) -> list[str]:
        label = f'model_name="{model}"'
        out = ["# HELP specserve_requests_resumed_total Request choices resumed on another target replica from their committed "
               "output, by why their replica let them go.", "# TYPE specserve_requests_resumed_total counter"]
        out += [f'specserve_requests_resumed_total{{{label},cause="{c}"}} {float(n)}' for c, n in self.by_cause.items()]
        out += ["# HELP specserve_request_resume_seconds Time from a replica's failure noticed to the first delta from the "
                "replica that took over.", "# TYPE specserve_request_resume_seconds histogram"]
        total = 0
        for bound, n in zip((*self.BUCKETS_S, float("inf")), self.buckets):
            total += n
            out.append(f'specserve_request_resume_seconds_bucket{{{label},le="{"+Inf" if bound == float("inf") else bound}"}} {float(total)}')
        out += [f"specserve_request_resume_seconds_sum{{{label}}} {self.sum_s}", f"specserve_request_resume_seconds_count{{{label}}} {float(self.count)}"]
        return out


def prometheus_text(snapshot: dict, model: str, edge, registry_age_s: float, resumes: ResumeStats | None = None) -> str:
    targets = snapshot.get("target", {})
    drafts = snapshot.get("draft", {})
    lines: list[str] = []
    seen: set[str] = set()

    def metric(name: str, kind: str, help_: str, value, labels: dict | None = None) -> None:
        if name not in seen:
            seen.add(name)
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
        all_labels = {"model_name": model, **(labels or {})}
        text = ",".join(f'{k}="{v}"' for k, v in all_labels.items())
        lines.append(f"{name}{{{text}}} {float(value)}")

    def total(key: str) -> float:
        return sum(float(t.get(key, 0) or 0) for t in targets.values())

    metric("specserve_spec_decode_num_drafts", "counter", "Verified draft blocks.", total("num_drafts"))
    metric("specserve_spec_decode_num_draft_tokens", "counter", "Draft tokens proposed and verified.", total("num_draft_tokens"))
    metric("specserve_spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.", total("num_accepted_tokens"))
    width = max((len(t.get("num_accepted_tokens_per_pos", [])) for t in targets.values()), default=0)
    width = max(width, max((t.get("speculation", {}).get("max_k", 0) for t in targets.values()), default=0))
    for pos in range(width):
        n = sum((t.get("num_accepted_tokens_per_pos", []) + [0] * width)[pos] for t in targets.values())
        metric("specserve_spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted draft tokens by position.", n,
               {"position": pos})
    metric("specserve_spec_decode_num_fallback_steps", "counter",
           "Sequence steps decoded target-only because no draft could answer.", total("num_fallback_steps"))
    metric("specserve_spec_decode_num_cache_hits", "counter", "Draft blocks answered from the speculation cache.",
           total("num_cache_hits"))
    metric("specserve_spec_decode_num_blocks", "counter", "Draft blocks received.", total("num_blocks"))
    metric("specserve_draft_failures", "counter", "Times a draft became unavailable to a target.",
           sum(t.get("drafts", {}).get("num_draft_failures", 0) for t in targets.values()))
    metric("specserve_num_generation_tokens", "counter", "Generated tokens.", total("num_generated_tokens"))
    metric("specserve_num_requests_failed", "counter", "Requests that failed inside a target.", total("num_requests_failed"))
    metric("specserve_num_requests_aborted", "counter", "Requests cancelled (e.g. client disconnects).", total("num_requests_aborted"))
    metric("specserve_num_requests_running", "gauge", "Requests in the targets' batches.", total("num_running"))
    metric("specserve_num_requests_waiting", "gauge", "Requests waiting for a batch slot.", total("num_waiting"))
    metric("specserve_num_requests_in_flight", "gauge", "HTTP generation requests admitted by this router.", edge.in_flight)
    metric("specserve_num_requests_in_flight_max", "gauge", "Most HTTP generation requests in flight at once (never above the limit).",
           edge.max_in_flight)
    metric("specserve_num_requests_rejected", "counter", "HTTP requests rejected with 429 by this router.", edge.num_rejected)
    metric("specserve_targets_up", "gauge", "Target replicas alive.", len(targets))
    metric("specserve_drafts_up", "gauge", "Draft replicas alive.", len(drafts))
    for name, t in sorted(targets.items()):
        metric("specserve_target_num_running", "gauge", "Requests in this target's batch.", t.get("num_running", 0), {"target": name})
        metric("specserve_target_draft_up", "gauge", "1 when this target has a draft, 0 when decoding target-only.",
               int(bool(t.get("draft_up"))), {"target": name})
        metric("specserve_target_speculation_k", "gauge", "The speculation length this target chose last.",
               t.get("speculation", {}).get("k", 0), {"target": name})
        if "direct_streams" in t:
            metric("specserve_target_direct_streams", "counter", "Requests the router streamed from this target directly (not through a Serve handle).",
                   t["direct_streams"]["num_streams"], {"target": name})
            metric("specserve_target_direct_streams_refused", "counter", "Direct stream connections this target turned away (wrong secret, or too many open).",
                   t["direct_streams"]["num_refused"], {"target": name})
            metric("specserve_target_direct_stream_spares", "gauge", "Authenticated connections routers hold open to this target ahead of requests.",
                   t["direct_streams"].get("spares", 0), {"target": name})
    for name, d in sorted(drafts.items()):
        metric("specserve_draft_num_sequences", "gauge", "Sequences this draft holds state for.", d.get("num_seqs", 0), {"draft": name})
        metric("specserve_draft_num_connections", "gauge", "Targets connected to this draft.", d.get("num_live_connections", 0),
               {"draft": name})
        for target, t in sorted(d.get("by_target", {}).items()):
            metric("specserve_draft_ahead", "gauge",
                   "1 when this draft drafts ahead for this target (auto: off only where it shares the target's compute).",
                   int(bool(t.get("draft_ahead"))), {"draft": name, "target": target})
    metric("specserve_metrics_age_seconds", "gauge", "Age of the replica snapshot these numbers come from (-1: none yet).",
           registry_age_s)
    if resumes is not None:
        lines += resumes.lines(model)
    return "\n".join(lines) + "\n"
