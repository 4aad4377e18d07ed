"""Render the target actor's counters as Prometheus text, with vLLM's spec-decode names.

Ray metric names may not contain ':' so vLLM's ``vllm:spec_decode_*`` become
``specserve_spec_decode_*``. Hand-written (a dozen lines) rather than a prometheus_client
registry: the numbers live in another actor and are read per scrape.
"""

from __future__ import annotations


def prometheus_text(m: dict, model: str, in_flight: int, draft_seqs: int | None) -> str:
    lab = f'model_name="{model}"'
    lines = []

    def metric(name: str, kind: str, help_: str, value, extra: str = "") -> None:
        if not any(line.startswith(f"# HELP {name} ") for line in lines):
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
        labels = lab + ("," + extra if extra else "")
        lines.append(f"{name}{{{labels}}} {float(value)}")

    metric("specserve_spec_decode_num_drafts", "counter", "Verified draft blocks.", m["num_drafts"])
    metric("specserve_spec_decode_num_draft_tokens", "counter", "Draft tokens proposed and verified.", m["num_draft_tokens"])
    metric("specserve_spec_decode_num_accepted_tokens", "counter", "Draft tokens accepted.", m["num_accepted_tokens"])
    per_pos = list(m["num_accepted_tokens_per_pos"])
    per_pos += [0] * (m.get("num_speculative_tokens", 0) - len(per_pos))  # every position exists from the start
    for pos, n in enumerate(per_pos):
        metric("specserve_spec_decode_num_accepted_tokens_per_pos", "counter", "Accepted draft tokens by position.", n, f'position="{pos}"')
    metric("specserve_spec_decode_num_fallback_steps", "counter", "Sequence steps decoded target-only because the draft was unavailable.", m["num_fallback_steps"])
    metric("specserve_draft_failures", "counter", "Times the draft became unavailable.", m["num_draft_failures"])
    metric("specserve_draft_recoveries", "counter", "Times speculation resumed after a draft failure.", m["num_draft_recoveries"])
    metric("specserve_draft_up", "gauge", "1 when the draft answers, 0 when decoding target-only.", int(m["draft_up"]))
    metric("specserve_num_requests_running", "gauge", "Requests in the target's batch.", m["num_running"])
    metric("specserve_num_requests_waiting", "gauge", "Requests waiting for a batch slot.", m["num_waiting"])
    metric("specserve_num_requests_in_flight", "gauge", "HTTP requests in flight at the router.", in_flight)
    if draft_seqs is not None:
        metric("specserve_draft_num_sequences", "gauge", "Sequences the draft holds state for.", draft_seqs)
    metric("specserve_num_requests_finished", "counter", "Finished requests.", m["num_requests_finished"])
    metric("specserve_num_requests_aborted", "counter", "Aborted (cancelled) requests.", m["num_requests_aborted"])
    metric("specserve_num_generation_tokens", "counter", "Generated tokens.", m["num_generated_tokens"])
    return "\n".join(lines) + "\n"
