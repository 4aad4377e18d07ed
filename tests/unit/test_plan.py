"""``specserve plan``: its prediction from profiles against a run of the simulator with the same
profiles, and its command line."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from specserve import LLM, SamplingParams
from specserve.adaptive import Arm
from specserve.plan import predict

TARGET, DRAFT, SCALE = "qwen3-8b-h100", "qwen3-0.6b-h100", 8.0  # a ~50 ms target step, a ~6 ms draft step
ACCEPTANCE = 0.7


def sim_run(batch: int, **kw) -> dict:
    """The engine's metrics after a run (and an untimed one before it) of the simulated pair in one process."""
    r = random.Random(0)
    prompts = [[r.randrange(1024) for _ in range(32)] for _ in range(4 * batch)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    options = {"time_scale": SCALE, "vocab_size": 1024}
    with LLM(f"sim:{TARGET}", draft=f"sim:{DRAFT}", target_backend="sim", draft_backend="sim", cpu_threads=1,
             target_backend_options={**options, "profile": TARGET},
             draft_backend_options={**options, "profile": DRAFT, "acceptance": ACCEPTANCE}, **kw) as llm:
        for _ in range(2):
            llm.generate(prompts, params, use_tqdm=False, max_in_flight=batch)
        return llm.metrics()


def test_the_plans_tokens_per_cycle_are_the_simulated_pairs():
    """The plan's expected tokens per verify, from the acceptance it was given, are what a fixed k = 3
    run of the simulated draft with that acceptance commits (counts, not timings)."""
    from specserve.adaptive import SpeculationController

    m = sim_run(1, num_speculative_tokens=3, adaptive=False)
    ctrl = SpeculationController(3)
    ctrl.acceptance = [ACCEPTANCE] * 3
    measured = 1 + m["num_accepted_tokens"] / m["num_drafts"]
    assert measured == pytest.approx(ctrl.expected_tokens(3, False, 1), rel=0.05)


@pytest.mark.parametrize("batch", [1, 8])
def test_the_controller_settles_on_an_arm_the_plan_rates_near_the_best(batch):
    """Replayed on recorded cycles of a simulated pair (the oracle benchmark's h100-pair setting: every
    fixed arm's cycles at batch 1, 8 and 32), the arm the controller settles on is one the plan, from
    the same profiles alone, rates within 10% of its best: the two models agree. Recorded seconds, no
    timing of this machine. (How close the plan's tokens/s come to measured ones is bench_plan's to report.)"""
    from benchmarks import bench_oracle
    from benchmarks.bench_replay import load_traces, run

    from specserve.adaptive import SpeculationController

    traces = load_traces(Path(__file__).parent / "data" / "oracle_h100_pair.json.gz")
    controllers = []
    run(traces, {"adaptive": lambda k: controllers.append(SpeculationController(k)) or controllers[-1]})
    chosen = controllers[0].state()["arm_by_bucket"][str(batch)]
    arm = Arm(int(chosen.rstrip("c")), chosen.endswith("c"))
    setting = next(s for s in bench_oracle.SETTINGS if s.name == "h100-pair")
    scale = bench_oracle.time_scale(setting, 25.0)  # (bench_oracle's defaults, as the traces were recorded: a 25 ms step, 32-token prompts)
    (row,) = [r for r in predict(setting.target, setting.draft, setting.link, setting.acceptance, [batch], k=traces["k"], context=64,
                                 time_scale=scale, prompt_tokens=32, max_tokens=traces["max_tokens"]) if r["deployment"] == "remote, drafting ahead"]
    assert row["rates"][arm] >= 0.9 * row["tokens_per_s"], (chosen, {str(a): round(v) for a, v in row["rates"].items()})


def test_the_command_prints_each_deployment_and_a_recommendation():
    out = subprocess.run([sys.executable, "-m", "specserve.cli", "plan", "--target", "qwen3-32b-dgx-spark", "--draft",
                          "qwen3-1.7b-rtx5090", "--acceptance", "0.8", "--batch-sizes", "1,32"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    for deployment in ("target-only", "colocated", "remote", "remote, drafting ahead"):
        assert f"| 1 | {deployment} |" in out.stdout and f"| 32 | {deployment} |" in out.stdout
    assert "batch 1: disaggregate" in out.stdout


def test_a_loads_prompts_cost_every_arm_the_same_time_per_token():
    """A request's prefill is paid whatever the arm: spread over its tokens, the same seconds per token
    added to every arm's rate, and none at all without a prompt."""
    from specserve import plan

    steady = plan.predict(TARGET, DRAFT, "10gbe", 0.7, (1, 8), 4, prompt_tokens=0, max_tokens=64)
    loaded = plan.predict(TARGET, DRAFT, "10gbe", 0.7, (1, 8), 4, prompt_tokens=1024, max_tokens=64)
    for s, l in zip(steady, loaded):
        prefill = plan.profile_costs(TARGET, DRAFT, "10gbe", s["batch_size"], 4, prompt_tokens=1024).prefill
        assert prefill > 0
        for arm, rate in s["rates"].items():
            assert 1 / l["rates"][arm] - 1 / rate == pytest.approx(prefill / 64, rel=1e-6)


def test_a_requests_first_two_tokens_take_a_cycle_each_whatever_the_arm():
    """A request's first token comes from its prefill and its second from a step without drafts: at two
    tokens a request every arm yields one token a row per cycle, and long requests approach each arm's
    steady E tokens a cycle."""
    from specserve import plan

    two = plan.predict(TARGET, DRAFT, "10gbe", 0.7, (1, 8), 4, max_tokens=2)
    endless = plan.predict(TARGET, DRAFT, "10gbe", 0.7, (1, 8), 4, max_tokens=10**9)
    for t, e in zip(two, endless):
        for arm, rate in t["rates"].items():
            if not arm.cache_only:
                assert e["rates"][arm] / rate == pytest.approx(sum(0.7 ** j for j in range(arm.k + 1)), rel=1e-6)


def test_a_prompt_prefilled_apart_gives_its_first_token_outside_the_cycles():
    """An engine that prefills a prompt in a forward of its own (specserve's transformers target) takes
    the first token from it: the first two tokens take one cycle, the forward's time is the request's."""
    from specserve.plan import load_rate

    assert load_rate(100.0, 0.0, 2, 2.5, prefilled_apart=1.0) == pytest.approx(2 * load_rate(100.0, 0.0, 2, 2.5))
    assert load_rate(100.0, 0.25, 1, 2.5, prefilled_apart=1.0) == pytest.approx(1 / 0.25)  # no cycle at all
    half = load_rate(100.0, 0.0, 64, 2.5, prefilled_apart=0.5)
    assert 64 / half == pytest.approx((1.5 + 62 / 2.5) * 2.5 / 100.0)


@pytest.mark.parametrize("args,message", [
    (["--target", "no-such-profile", "--draft", DRAFT], "unknown sim profile 'no-such-profile'"),
    (["--target", TARGET, "--draft", DRAFT, "--acceptance", "1.5"], "acceptance must be a probability"),
    (["--target", TARGET, "--draft", DRAFT, "--draft", DRAFT, "--acceptance", "0.5", "--acceptance", "0.6", "--acceptance", "0.7"],
     "give --acceptance once, or once per --draft"),
    (["--target", TARGET, "--draft", DRAFT, "--batch-sizes", "0"], "--batch-sizes and -k must be >= 1"),
    (["--target", TARGET, "--draft", DRAFT, "--max-tokens", "0"], "--max-tokens must be >= 1 and --prompt-tokens >= 0"),
])
def test_bad_input_is_one_line_naming_it(args, message):
    out = subprocess.run([sys.executable, "-m", "specserve.cli", "plan", *args], capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_the_controller_pages_commands_run_as_written():
    from ..doc_blocks import block

    out = subprocess.run(block("plan"), shell=True, capture_output=True, text=True, executable="/bin/bash")
    assert out.returncode == 0 and "batch 1: disaggregate" in out.stdout, out.stdout + out.stderr
    out = subprocess.run([sys.executable, "-c", block("fixed-arm")], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip(), out.stderr
