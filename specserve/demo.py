"""``specserve demo``: the one-command tour, on any machine with Python and pip.

Prepares the pair (by default the realistic pair of ``demo_models.realistic``, built from the
shipped target once and then read from the user cache; ``--pair tiny``: the shipped pair as
is), starts a local Ray cluster of two logical nodes labelled ``specserve.io/role=target`` and
``=draft``, deploys the pair behind the OpenAI HTTP endpoint (plus a target-only baseline app
on the same nodes), with the nodes' loading progress forwarded, sends real completion requests
to both and one chat request, and prints the text, the speculation stats and tokens/s beside
target-only, measured in the same run. Then keeps serving and prints commands to try
(``--once`` exits).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import textwrap
import threading
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import dataclass

DEMO_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\ndef main():\n",
    "class Stack:\n    def __init__(self):\n",
    "    def __repr__(self):\n        return",
]
ROLE = "specserve.io/role"
PAIRS = ("realistic", "tiny")
TICK_S = 15  # a waiting step says how long it has waited this often, so a slow start never looks like a hang


@dataclass
class Pair:
    name: str
    target: str  # a model directory or a demo alias
    draft: str
    target_layers: int
    draft_layers: int
    description: str  # what the pair is, for the summary


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        return json.loads(resp.read())


def _wait_for(url: str, deadline: float) -> None:
    """Until ``url`` answers 200; the last error once ``deadline`` (time.monotonic) has passed."""
    while True:
        try:
            with urllib.request.urlopen(url, timeout=10):
                return
        except OSError:  # urllib's HTTPError and URLError among them
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _step(i: int, n: int, msg: str) -> float:
    print(f"[{i}/{n}] {msg}", flush=True)
    return time.perf_counter()


@contextmanager
def _ticking(started: float):
    """Print the time waited every ``TICK_S`` seconds until the block ends."""
    done = threading.Event()

    def tick():
        while not done.wait(TICK_S):
            print(f"      ... {time.perf_counter() - started:.0f}s", flush=True)

    thread = threading.Thread(target=tick, daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


def _num_layers(model_dir: str) -> int:
    with open(os.path.join(model_dir, "config.json")) as f:
        return json.load(f)["num_hidden_layers"]


def prepare_pair(name: str, draft: str, say=print) -> Pair:
    """The demo's pair by name: ``realistic`` (built once into the user cache) or ``tiny`` (shipped)."""
    from .config import resolve_model
    from .demo_models import TARGET_PATH

    tiny_layers = _num_layers(str(TARGET_PATH))
    if name == "tiny":
        draft_layers = _num_layers(resolve_model(draft))
        what = "an EAGLE-3 head trained for it" if draft == "demo:eagle" else f"a {draft_layers}-layer draft"
        return Pair("tiny", "demo:target", draft, tiny_layers, draft_layers,
                    f"tiny: the shipped {tiny_layers}-layer demo target (trained on Python's standard library) and {what}; "
                    "so small that on a CPU a draft step costs almost as much as a target step")
    if draft == "demo:eagle":
        raise ValueError("demo:eagle is trained for the tiny target's hidden states: it drafts for the tiny pair only")
    from .demo_models.realistic import cached_pair

    target, draft_dir, built = cached_pair(say=lambda msg: say("      " + msg))
    if not built:
        say(f"      from the cache: {os.path.dirname(target)}")
    layers, draft_layers = _num_layers(target), _num_layers(draft_dir)
    return Pair("realistic", target, draft_dir, layers, draft_layers,
                f"realistic: a {layers}-layer target built from the shipped {tiny_layers}-layer demo target (the inserted "
                "layers nearly cancel, so its outputs are the demo target's), so that a target step costs many draft "
                f"steps, as a big target's (e.g. 32B) does a small draft's (1.7B); the shipped {draft_layers}-layer draft")


def _app_config(pair: Pair, speculative: bool, k: int) -> dict:
    side = {"num_cpus": 0.5}
    cfg = {"target": {"model": pair.target, **side}, "server": {"model_name": "demo"},
           "speculation": {"num_speculative_tokens": k if speculative else 0}}
    if speculative:
        # Compiling the draft's forward (draft.compile) takes far longer on a small CPU than the whole
        # demo's decoding, and gains little where the target's step dominates it: the demo runs it eager.
        cfg["draft"] = {"model": pair.draft, **side, "compile": False}
    return cfg


def machine_description() -> dict:
    """What the timings ran on: cores, the CPU's model name where the OS says, the load."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        load = round(os.getloadavg()[0], 1)
    except (OSError, AttributeError):
        load = None
    return {"cores": os.cpu_count(), "cpu": cpu, "load_average_1m": load}


def run_demo(args) -> int:
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.serve.api import RunTarget

    from .config import SpecserveConfig
    from .distributed.placement import sigint_shielded
    from .preflight import check_port
    from .serve import build_app
    from .serve.serve_cli import _DropMessages

    check_port(args.host, args.port)
    draft = getattr(args, "draft", "demo:draft")
    name = getattr(args, "pair", None) or ("tiny" if draft == "demo:eagle" else "realistic")
    if name == "realistic" and draft == "demo:eagle":
        raise ValueError("--draft demo:eagle is trained for the tiny target's hidden states: use it with --pair tiny")
    steps = 5
    t0 = _step(1, steps, f"preparing the {name} pair")
    pair = prepare_pair(name, draft)
    print(f"      target {pair.target_layers} layers, draft {pair.draft_layers} layer(s); ready in "
          f"{time.perf_counter() - t0:.1f}s", flush=True)
    t0 = _step(2, steps, "starting a local Ray cluster: node 'target' + node 'draft' (labels specserve.io/role)")
    with sigint_shielded():  # Ctrl-C reaches this process only; the finally below stops Ray in order
        # No dashboard (as `specserve serve` starts Ray): its processes would only slow the start on a small machine.
        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "labels": {ROLE: "target"}, "include_dashboard": False})
        cluster.add_node(num_cpus=2, labels={ROLE: "draft"})
        # The nodes' own log lines (what each side is loading, and how long it took) come to this
        # terminal, as under `specserve serve`; Serve's actors log at WARNING only.
        ray.init(address=cluster.address, log_to_driver=True)
    cluster.wait_for_nodes()
    print(f"      ready in {time.perf_counter() - t0:.1f}s", flush=True)
    try:
        base = f"http://{args.host}:{args.port}"
        spec_cfg = _app_config(pair, True, args.num_speculative_tokens)
        engine = "vLLM" if SpecserveConfig.load(spec_cfg).target.backend == "vllm" else "specserve's engine"
        t0 = _step(3, steps, f"loading the target ({pair.target_layers} layers, {engine}) on node 'target' and the draft "
                             f"({pair.draft_layers} layer(s), transformers) on node 'draft'; beside them, for comparison, a "
                             "target-only app (the same target, no draft) on node 'target'")
        logging.getLogger("ray.serve").addFilter(_DropMessages())
        quiet = {"log_level": "WARNING"}  # Serve's own lines (access logs among them); specserve's progress stays
        serve.start(http_options={"host": args.host, "port": args.port}, logging_config=quiet)
        with _ticking(t0):  # both apps at once: their replicas start in parallel
            serve.run_many([RunTarget(build_app(spec_cfg), name="specserve", route_prefix="/", logging_config=quiet),
                            RunTarget(build_app(_app_config(pair, False, 0)), name="baseline", route_prefix="/baseline",
                                      logging_config=quiet)])
            for route in (base, f"{base}/baseline"):  # Serve's proxy learns a new app's route a moment after it runs
                _wait_for(f"{route}/v1/models", deadline=time.monotonic() + 120)
        print(f"      both apps up in {time.perf_counter() - t0:.1f}s", flush=True)

        _step(4, steps, f"sending {len(DEMO_PROMPTS)} completions (greedy, max_tokens={args.max_tokens}) to both, one at a time")
        rows, spec_tokens, spec_time, base_tokens, base_time = [], 0, 0.0, 0, 0.0
        totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "num_steps": 0}
        machine = machine_description()  # the load as the timed requests start
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
        lossless = all(r["identical_to_target_only"] for r in rows)
        _step(5, steps, "summary")
        load = f", load average {machine['load_average_1m']}" if machine["load_average_1m"] is not None else ""
        for label, text in (("pair", pair.description),
                            ("machine", (f"this machine's CPU: {machine['cores']} cores ({machine['cpu']}){load}; both Ray "
                                         "nodes ('target', 'draft') are on it and share its cores")),
                            ("engine", f"target: {engine}; draft: transformers, eager")):
            print(textwrap.fill(text, 100, initial_indent=f"  {label:<9} ", subsequent_indent=" " * 12))
        print(f"  {'':26}{'speculative':>12}{'target-only':>14}")
        print(f"  {'tok/s':26}{spec_tps:12.1f}{base_tps:14.1f}")
        print(f"  {'ms per token':26}{1e3 / spec_tps:12.1f}{1e3 / base_tps:14.1f}")
        print(f"  {'target forwards / token':26}{forwards_per_token:12.2f}{1.0:14.2f}")
        print(f"  {'speedup':26}{spec_tps / base_tps:11.2f}x  (same run, same nodes, batch 1)")
        print(f"  acceptance rate           {rate:.1%}")
        print(f"  mean acceptance length    {mal:.2f}  (k up to {args.num_speculative_tokens}, chosen per step)")
        print(f"  lossless                  {'all outputs identical to target-only' if lossless else 'MISMATCH'}")
        if pair.name == "tiny":
            print("  note: on a CPU this pair's draft step costs almost as much as its target step, so speculation saves\n"
                  "        little wall time; the default pair (`--pair realistic`) shows where it pays.")
        if args.json_out:
            with open(args.json_out, "w") as f:
                json.dump({"pair": {"name": pair.name, "target_layers": pair.target_layers, "draft_layers": pair.draft_layers,
                                    "description": pair.description}, "machine": machine, "target_engine": engine,
                           "acceptance_rate": rate, "mean_acceptance_length": mal, "speculative_tok_s": spec_tps,
                           "target_only_tok_s": base_tps, "speedup": spec_tps / base_tps,
                           "target_forwards_per_token": forwards_per_token,
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
