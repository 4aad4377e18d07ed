"""``specserve demo``: the one-command tour, on any machine with Python and pip.

Starts a local Ray cluster of two logical nodes labelled ``specserve.io/role=target`` and
``=draft``, deploys the shipped demo pair behind the OpenAI HTTP endpoint (plus a
target-only baseline app on the same nodes), sends real completion requests to both and one
chat request, and prints the text, the speculation stats and tokens/s against target-only,
measured in the same run. Then keeps serving and prints commands to try (``--once`` exits).
"""

from __future__ import annotations

import json
import time
import urllib.request

DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return",
]
ROLE = "specserve.io/role"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _step(i: int, n: int, msg: str) -> float:
    print(f"[{i}/{n}] {msg}", flush=True)
    return time.perf_counter()


def _app_config(draft: str | None, k: int) -> dict:
    side = {"num_cpus": 0.5}
    cfg = {"target": {"model": "demo:target", **side}, "server": {"model_name": "demo"},
           "speculation": {"num_speculative_tokens": k}}
    if draft:
        cfg["draft"] = {"model": draft, **side}
    return cfg


def run_demo(args) -> int:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from .config import SpecserveConfig
    from .distributed.placement import sigint_shielded
    from .preflight import check_port
    from .serve import build_app

    check_port(args.host, args.port)
    steps = 5
    t0 = _step(1, steps, "starting a local Ray cluster: node 'target' + node 'draft' (labels specserve.io/role)")
    with sigint_shielded():  # Ctrl-C reaches this process only; the finally below stops Ray in order
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "labels": {ROLE: "target"}})
        cluster.add_node(num_cpus=2, labels={ROLE: "draft"})
        ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    print(f"      ready in {time.perf_counter() - t0:.1f}s", flush=True)
    try:
        base = f"http://{args.host}:{args.port}"
        engine = "vLLM" if SpecserveConfig.load(_app_config(None, 0)).target.backend == "vllm" else "specserve's engine"
        t0 = _step(2, steps, f"loading the demo target ({engine}) on node 'target' and the demo draft on node 'draft'")
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(build_app(_app_config(getattr(args, "draft", "demo:draft"), args.num_speculative_tokens)), name="specserve", route_prefix="/")
        print(f"      speculative app up in {time.perf_counter() - t0:.1f}s", flush=True)
        t0 = _step(3, steps, "loading a target-only baseline app (same target, no draft) for comparison")
        serve.run(build_app(_app_config(None, 0)), name="baseline", route_prefix="/baseline")
        print(f"      baseline app up in {time.perf_counter() - t0:.1f}s", flush=True)

        _step(4, steps, f"sending {len(DEMO_PROMPTS)} completions (greedy, max_tokens={args.max_tokens}) to both")
        rows, spec_tokens, spec_time, base_tokens, base_time = [], 0, 0.0, 0, 0.0
        totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_steps": 0}
        for prompt in DEMO_PROMPTS:
            body = {"model": "demo", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0}
            _post(f"{base}/v1/completions", {**body, "max_tokens": 2})  # warm-up
            _post(f"{base}/baseline/v1/completions", {**body, "max_tokens": 2})
            t = time.perf_counter()
            spec = _post(f"{base}/v1/completions", body)
            spec_time += time.perf_counter() - t
            t = time.perf_counter()
            plain = _post(f"{base}/baseline/v1/completions", body)
            base_time += time.perf_counter() - t
            spec_tokens += spec["usage"]["completion_tokens"]
            base_tokens += plain["usage"]["completion_tokens"]
            stats = spec["specserve"]
            for key in totals:
                totals[key] += stats[key]
            same = spec["choices"][0]["text"] == plain["choices"][0]["text"]
            rows.append({"prompt": prompt, "text": spec["choices"][0]["text"], "identical_to_target_only": same,
                         **{k: v for k, v in stats.items() if k != "target"}})
            print("-" * 72)
            print(prompt + spec["choices"][0]["text"])
            print(f"  [acceptance {stats['acceptance_rate']:.0%}, mean acceptance length {stats['mean_acceptance_length']:.2f}, "
                  f"identical to target-only: {'yes' if same else 'NO'}]")
        chat = _post(f"{base}/v1/chat/completions", {"model": "demo", "max_tokens": 32, "temperature": 0, "messages": [
            {"role": "user", "content": "a function that adds two numbers"}]})
        print("-" * 72)
        print("chat: 'a function that adds two numbers' ->")
        print(chat["choices"][0]["message"]["content"])
        rate = totals["num_accepted_tokens"] / max(1, totals["num_draft_tokens"])
        mal = 1 + totals["num_accepted_tokens"] / max(1, totals["num_drafts"])
        spec_tps, base_tps = spec_tokens / spec_time, base_tokens / base_time
        forwards_per_token = totals["num_steps"] / max(1, spec_tokens)  # target-only: exactly 1
        _step(5, steps, "summary")
        print(f"  acceptance rate          {rate:.1%}")
        print(f"  mean acceptance length   {mal:.2f}  (k up to {args.num_speculative_tokens}, chosen per step)")
        print(f"  speculative              {spec_tps:7.1f} tok/s")
        print(f"  target-only              {base_tps:7.1f} tok/s")
        print(f"  speedup                  {spec_tps / base_tps:.2f}x  (same run, same nodes, batch 1)")
        print(f"  target forwards / token  {forwards_per_token:.2f}  (target-only: 1.00)")
        print("  note: this pair is tiny, so on a CPU a draft step costs almost as much as a target step and\n"
              "        speculation saves little wall time; it pays when the target step is far slower than a\n"
              "        draft step plus the link (e.g. a 32B target on a DGX Spark, a 1.7B draft on an RTX 5090).")
        lossless = all(r["identical_to_target_only"] for r in rows)
        print(f"  lossless                 {'all outputs identical to target-only' if lossless else 'MISMATCH'}")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"acceptance_rate": rate, "mean_acceptance_length": mal, "speculative_tok_s": spec_tps,
                           "target_only_tok_s": base_tps, "target_forwards_per_token": forwards_per_token,
                           "num_speculative_tokens": args.num_speculative_tokens, "chat": chat["choices"][0]["message"]["content"],
                           "rows": rows}, f, indent=2)
        if args.once:
            return 0 if lossless else 1
        print("\nspecserve is serving the demo pair. Try (in another terminal):")
        for line in try_commands(base):
            print("  " + line)
        print(f"  metrics: {base}/metrics   health: {base}/health   (Ctrl-C to stop)", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        print("stopping ...", flush=True)
        return 0
    finally:
        ray.shutdown()  # the whole cluster is ours: stopping its nodes stops Serve and every replica
        cluster.shutdown()


def try_commands(base: str) -> list[str]:
    """Commands that work against the demo server with the main install (curl, and the openai client)."""
    client = f"import openai; c = openai.OpenAI(base_url='{base}/v1', api_key='none')"
    return [
        f"curl {base}/v1/completions -H 'Content-Type: application/json' "
        "-d '{\"model\": \"demo\", \"prompt\": \"def add(a, b):\", \"max_tokens\": 32, \"temperature\": 0}'",
        f"python -c \"{client}; print(c.completions.create(model='demo', prompt='def add(a, b):', max_tokens=32, "
        "temperature=0).choices[0].text)\"",
        f"python -c \"{client}; print(c.chat.completions.create(model='demo', max_tokens=32, messages=[{{'role': 'user', "
        "'content': 'a function that adds two numbers'}]).choices[0].message.content)\"",
    ]
