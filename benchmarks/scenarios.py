"""What the benchmark runs on: a scenario is a target/draft pair, its prompts and its systems.

Data flow: ``make_scenario(name, args)`` -> ``Scenario`` (the pair, token-id prompts and the
list of ``SystemSpec`` to compare, each naming the target-only system its speed-up divides
by). Pairs: ``demo`` (the shipped pair), ``realistic`` (``examples/make_realistic_pair.py``,
built on the fly unless a path is given), ``sim`` (the simulator: a Qwen3-32B target on a
DGX Spark, a Qwen3-1.7B draft on an RTX 5090, over link profiles) and ``custom``
(``--target``/``--draft`` directories, e.g. tiny test models). Prompts: held-out stdlib
chunks for model pairs (files the demo pair never trained on), seeded random ids for the
simulator. Knows how to describe systems, not how to run them (``systems.py``).
"""

from __future__ import annotations

import importlib.util
import os
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

# examples/train_demo_pair.py holds out every 30th stdlib file (offset 15) from training: prompt with those.
HOLDOUT_EVERY = 30
EXCLUDED_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__", "encodings", "pydoc_data", "__phello__"}
SIM_TARGET, SIM_DRAFT, SIM_COLOCATED_DRAFT = "qwen3-32b-dgx-spark", "qwen3-1.7b-rtx5090", "qwen3-1.7b-dgx-spark"
SIM_VOCAB = 1024


@dataclass
class SystemSpec:
    name: str  # unique within a scenario, e.g. "specserve k=4", "ray k=4 d=1ms"
    kind: str  # specserve | ray | hf | vllm
    baseline: str  # the target-only system its speed-up and greedy check compare with
    k: int = 0  # draft tokens per step (0: target-only; the maximum when adaptive)
    options: dict = field(default_factory=dict)  # LLM keywords (specserve, ray) or runner options (hf, vllm)
    delay_ms: float = 0.0  # emulated one-way link delay (ray)
    link: str = ""  # link profile behind delay_ms (sim)


@dataclass
class Scenario:
    name: str
    target: str
    draft: str
    prompts: list[list[int]]
    sources: list[str]
    systems: list[SystemSpec]
    sim: bool = False
    time_scale: float = 1.0  # sim: every modelled time (and link delay) is multiplied by this
    notes: list[str] = field(default_factory=list)


# -------------------------------------------------------------------------------- prompts


def heldout_files() -> list[Path]:
    """The stdlib files the demo pair never trained on (same rule as examples/train_demo_pair.py)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not (Path(dirpath) == root and d.startswith("config-"))]
        files += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return [f for i, f in enumerate(sorted(files)) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]


def heldout_prompts(target: str, num_prompts: int, prompt_tokens: int) -> tuple[list[list[int]], list[str]]:
    """Token-id prompts: chunk c of every held-out file, for c = 0, 1, ... until there are enough."""
    from specserve.models import load_config, load_tokenizer, vocab_size_of

    tokenizer = load_tokenizer(target)
    vocab_size = vocab_size_of(load_config(target))
    root = Path(sysconfig.get_paths()["stdlib"])
    encoded = []
    for path in heldout_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if tokenizer is not None:
            ids = tokenizer.encode(text, add_special_tokens=False)
        else:  # a model without a tokenizer (tests): bytes folded into its vocabulary
            ids = [b % vocab_size for b in text.encode()[: 16 * prompt_tokens]]
        encoded.append((str(path.relative_to(root)), ids))
    prompts, sources = [], []
    for chunk in range(16):
        for name, ids in encoded:
            piece = ids[chunk * prompt_tokens : (chunk + 1) * prompt_tokens]
            if len(piece) == prompt_tokens and len(prompts) < num_prompts:
                prompts.append(piece)
                sources.append(f"{name}#{chunk}")
    if len(prompts) < num_prompts:
        raise ValueError(f"only {len(prompts)} held-out snippets of {prompt_tokens} tokens for {num_prompts} prompts")
    return prompts, sources


# -------------------------------------------------------------------------------- systems


def model_pair_systems(args, target: str, draft: str) -> list[SystemSpec]:
    """Every system for a real (transformers) pair; ``args`` selects which families run."""
    k, out = args.k, [SystemSpec("target-only", "specserve", "target-only")]
    out += [SystemSpec(f"specserve k={kk}", "specserve", "target-only", kk, {"adaptive": False}) for kk in args.ks]
    out.append(SystemSpec(f"specserve adaptive k<={max(args.ks)}", "specserve", "target-only", max(args.ks), {"adaptive": True}))
    if args.ray:
        out.append(SystemSpec("ray target-only", "ray", "ray target-only"))
        out += [SystemSpec(f"ray k={k} d={d:g}ms", "ray", "ray target-only", k, {"adaptive": False}, d) for d in args.delays_ms]
        out.append(SystemSpec(f"ray k={k} d={args.delays_ms[0]:g}ms no-ahead", "ray", "ray target-only", k,
                              {"adaptive": False, "draft_ahead": False}, args.delays_ms[0]))
    if args.hf:
        out += [SystemSpec("hf target-only", "hf", "hf target-only"),
                SystemSpec(f"hf assisted k={k}", "hf", "hf target-only", k, {"schedule": "constant"}),
                SystemSpec(f"hf assisted heuristic k0={k}", "hf", "hf target-only", k, {"schedule": "heuristic"})]
    if args.vllm:
        out += [SystemSpec("vllm target-only", "vllm", "vllm target-only"),
                SystemSpec(f"vllm k={k}", "vllm", "vllm target-only", k)]
    return out


def sim_systems(args) -> list[SystemSpec]:
    """The simulated Spark + 5090 pair: in-process (no link), colocated on the Spark, remote over link profiles."""
    from specserve.backends.sim_latency import load_link

    s, k = args.sim_time_scale, args.k
    target = {"target_backend_options": {"profile": SIM_TARGET, "time_scale": s, "vocab_size": SIM_VOCAB}}
    remote = {**target, "draft_backend_options": {"profile": SIM_DRAFT, "time_scale": s, "vocab_size": SIM_VOCAB,
                                                  "acceptance": args.sim_acceptance}}
    # Colocated: the draft on the Spark too, taking turns with the target on the one device (no drafting ahead).
    shared = {"target_backend_options": {**target["target_backend_options"], "shared_device": "spark"},
              "draft_backend_options": {**remote["draft_backend_options"], "profile": SIM_COLOCATED_DRAFT, "shared_device": "spark"}}
    out = [SystemSpec("target-only", "specserve", "target-only", 0, target)]
    out += [SystemSpec(f"specserve k={kk}", "specserve", "target-only", kk, {**remote, "adaptive": False}) for kk in args.ks]
    out.append(SystemSpec(f"specserve adaptive k<={max(args.ks)}", "specserve", "target-only", max(args.ks), {**remote, "adaptive": True}))
    out.append(SystemSpec(f"colocated k={k}", "specserve", "target-only", k, {**shared, "adaptive": False, "draft_ahead": False}))
    if args.ray:
        out.append(SystemSpec("ray target-only", "ray", "ray target-only", 0, target))
        for name in args.links:
            delay = load_link(name).one_way_s(64) * 1e3 * s  # a greedy step's message: token ids only
            out.append(SystemSpec(f"ray k={k} {name}", "ray", "ray target-only", k, {**remote, "adaptive": False}, delay, name))
        delay = load_link(args.links[0]).one_way_s(64) * 1e3 * s
        out.append(SystemSpec(f"ray k={k} {args.links[0]} no-ahead", "ray", "ray target-only", k,
                              {**remote, "adaptive": False, "draft_ahead": False}, delay, args.links[0]))
    return out


# -------------------------------------------------------------------------------- scenarios


def load_example(name: str):
    """A module from examples/ (not a package) by file path."""
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_scenario(name: str, args, num_prompts: int) -> Scenario:
    if name == "sim":
        r = random.Random(0)
        prompts = [[r.randrange(SIM_VOCAB) for _ in range(args.prompt_tokens)] for _ in range(num_prompts)]
        note = (f"simulated: {SIM_TARGET} target, {SIM_DRAFT} draft (greedy acceptance {args.sim_acceptance} per token), "
                f"colocated draft {SIM_COLOCATED_DRAFT}; every modelled time and link delay x{args.sim_time_scale:g}")
        return Scenario("sim", f"sim:{SIM_TARGET}", f"sim:{SIM_DRAFT}", prompts, [f"random#{i}" for i in range(num_prompts)],
                        sim_systems(args), sim=True, time_scale=args.sim_time_scale, notes=[note])
    if name == "demo":
        from specserve.demo_models import DRAFT_PATH, TARGET_PATH

        target, draft = str(TARGET_PATH), str(DRAFT_PATH)
    elif name == "realistic":
        pair = Path(args.realistic_pair or Path(args.out) / "realistic_pair")
        if not (pair / "target" / "config.json").exists():
            load_example("make_realistic_pair").build_pair(pair)
        target, draft = str(pair / "target"), str(pair / "draft")
    elif name == "custom":
        if not (args.target and args.draft):
            raise ValueError("scenario 'custom' needs --target and --draft")
        target, draft = args.target, args.draft
    else:
        raise ValueError(f"unknown scenario {name!r}: demo, realistic, sim or custom")
    prompts, sources = heldout_prompts(target, num_prompts, args.prompt_tokens)
    return Scenario(name, target, draft, prompts, sources, model_pair_systems(args, target, draft))
