"""The benchmarks run: every entry point's ``--help``, a tiny bench_systems run (tiny random models and the
simulator, no Ray), the kept reference runs redrawn by ``--from-json``, and the harness's placement.

Checks what the runs write (tables, JSON fields, plots, the skip lines), never timing values.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.bench_systems import main

from ..conftest import make_model

PNG = b"\x89PNG\r\n\x1a\n"
ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
# Every entry point a user or a developer runs, with a phrase of the question its --help opens with.
ENTRY_POINTS = {
    "benchmarks.bench_vllm": "against vLLM",
    "benchmarks.bench_serve": "vllm serve",
    "benchmarks.bench_systems": "what speculation can give",
    "benchmarks.bench_gpu": "CUDA GPU",
    "benchmarks.bench_http": "each hop",
    "benchmarks.bench_cluster": "round trip",
    "benchmarks.bench_oracle": "best fixed arm",
    "benchmarks.bench_plan": "specserve plan",
    "benchmarks.bench_replay": "recorded cycles",
    "benchmarks.bench_resume": "target replica's death",
    "benchmarks.dev.bench_draft_forward": "eager against compiled",
    "benchmarks.dev.bench_stream_path": "streamed token",
    "benchmarks.dev.bench_batch_paths": "three ways in",
    "benchmarks.dev.bench_draft_flood": "flood",
    "benchmarks.dev.profile_gpu": "decode step",
}
HEADER = re.compile(r"^20\d\d-\d\d-\d\d[ ;].*; `python -m benchmarks\.\w+")  # date; machine; `command`


def _flags_without_help(text: str) -> list[str]:
    """The options of an argparse --help whose entry has no help text (argparse prints the flag alone on
    its line, and the next line is another option or the end)."""
    lines = text.split("options:", 1)[1].splitlines()[1:]
    bare = []
    for i, line in enumerate(lines):
        if line.startswith("  -") and not re.search(r"\S\s{2,}\S", line.strip()):
            following = lines[i + 1] if i + 1 < len(lines) else ""
            if not following.startswith(" " * 8) or following.startswith("  -"):
                bare.append(line.strip())
    return bare


def test_every_entry_point_answers_help_with_its_question_and_every_flag_explained():
    """``python -m <entry point> --help`` in a subprocess, all at once: exit 0, the usage names the module,
    the description opens with the benchmark's question, and no flag is left without a help string."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = {m: subprocess.Popen([sys.executable, "-m", m, "--help"], cwd=ROOT, env=env, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for m in ENTRY_POINTS}
    for module, phrase in ENTRY_POINTS.items():
        out, _ = procs[module].communicate(timeout=120)
        assert procs[module].returncode == 0, (module, out[-2000:])
        assert out.startswith(f"usage: python -m {module} "), (module, out[:200])
        question = out.split("\n\n", 2)[1]
        assert phrase in " ".join(question.split()), (module, question)
        assert "options:" in out and "--help" in out
        assert _flags_without_help(out) == [], (module, _flags_without_help(out))


def test_the_help_format_names_defaults_and_the_header_names_date_machine_and_command():
    from benchmarks.cli import header, parser

    p = parser("benchmarks.example", "What does it answer?\n\nMore.")
    p.add_argument("--n", type=int, default=3, help="how many")
    p.add_argument("--out", default=None, help="where; default: --dir")
    p.add_argument("--fast", action="store_true", help="go fast")
    text = p.format_help()
    assert "how many (default: 3)" in " ".join(text.split()) and "(default: None)" not in text and "(default: False)" not in text
    line = header("benchmarks.example", ["--n", "4", "--label", "a b"])
    assert HEADER.match(line) and line.endswith("`python -m benchmarks.example --n 4 --label 'a b'`"), line
    assert re.search(r"\d+ CPUs", line)


def test_the_kept_reference_runs_are_few_and_say_when_where_and_how():
    """benchmarks/results keeps one run per benchmark: few files, each table opening with its date, machine
    and exact command."""
    files = [f for f in RESULTS.rglob("*") if f.is_file()]
    assert 0 < len(files) <= 25, sorted(str(f.relative_to(RESULTS)) for f in files)
    tables = [f for f in files if f.suffix == ".md"]
    folders = {f.name for f in RESULTS.iterdir() if f.is_dir()}
    assert {f.parent.name for f in tables} == folders, "each reference run's folder holds its tables"
    assert all((RESULTS.parent / f"{name}.py").is_file() for name in folders), "each folder is named by its benchmark"
    for f in tables:
        lines = [line for line in f.read_text().splitlines() if line and not line.startswith("# ")]
        assert HEADER.match(lines[0]) or re.match(r"^20\d\d-\d\d-\d\d; .*`python -m benchmarks\.\w+", lines[0]), (f, lines[0])


def test_the_kept_runs_redraw_from_their_raw_json(tmp_path, capsys):
    """``--from-json`` of bench_vllm and bench_systems rebuilds the kept runs' tables and plots, measuring
    nothing: every pair, batch size and system of the run has its row, and every speculative row is exact."""
    from benchmarks.bench_vllm import main as bench_vllm

    vllm = bench_vllm(["--from-json", str(RESULTS / "bench_vllm" / "results.json.gz"), "--out", str(tmp_path / "vllm")])
    rows = {(r["pair"], r["batch"], r["system"]): r for r in vllm["summary"]}
    systems = ("vllm target-only", "vllm colocated k=4", "specserve d=0ms")
    assert set(rows) == {(p, b, s) for p in ("demo", "realistic") for b in (1, 8, 32) for s in systems}
    assert all(rows[(p, b, "specserve d=0ms")]["exact"] for p in ("demo", "realistic") for b in (1, 8, 32))
    tables = (tmp_path / "vllm" / "tables.md").read_text()
    assert "| realistic | 32 | specserve d=0ms |" in tables and tables.splitlines()[0] in capsys.readouterr().out
    assert (tmp_path / "vllm" / "speedup_vs_batch.png").read_bytes()[:8] == PNG

    sim = main(["--from-json", str(RESULTS / "bench_systems" / "results.json.gz"), "--out", str(tmp_path / "sim")])
    summary = {(r["system"], r["batch"]) for r in sim["summary"]}
    assert {("colocated k=4", b) for b in (1, 8, 32)} | {("ray k=4 10gbe", b) for b in (1, 8, 32)} <= summary
    assert all(r["greedy_exact"] for r in sim["summary"])
    text = (tmp_path / "sim" / "tables.md").read_text()
    for part in ("## Scenario `sim`", "### batch 32", "serial bound", "### Does remote drafting pay?"):
        assert part in text
    assert (tmp_path / "sim" / "speedup_vs_batch.png").read_bytes()[:8] == PNG


def test_quick_run_writes_tables_json_and_plots(tmp_path, capsys):
    torch.set_num_threads(1)
    target = make_model(tmp_path / "target", seed=0)
    make_model(tmp_path / "draft", seed=1, noise_from=target, noise=0.3)  # perturbed: accepts some, not all
    out = tmp_path / "out"
    main(["--quick", "--scenarios", "custom,sim", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
          "--no-ray", "--vllm-python", "/bin/false", "--batch-sizes", "1,2", "--ks", "2", "--k", "2", "--max-tokens", "6",
          "--prompt-tokens", "8", "--sim-time-scale", "0.002", "--out", str(out)])

    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["quick"] is True and [s["name"] for s in data["scenarios"]] == ["custom", "sim"]
    records = data["records"]
    systems = {(r["scenario"], r["system"]) for r in records}
    assert {("custom", "target-only"), ("custom", "specserve k=2"), ("custom", "specserve adaptive k<=2"),
            ("custom", "hf target-only"), ("custom", "hf assisted k=2"), ("custom", "hf assisted heuristic k0=2"),
            ("sim", "target-only"), ("sim", "specserve k=2"), ("sim", "colocated k=2")} <= systems
    for r in records:
        assert "token_ids" not in r and r["wall_s"] > 0 and r["repeat"] == 0
        if r["kind"] == "specserve":
            assert {"step_ms", "target_forward_ms", "draft_forward_ms", "link_ms", "overhead_ms", "speculation"} <= set(r)
    assert {r["batch"] for r in records if r["system"] == "hf assisted k=2"} == {1}  # transformers: batch 1 only
    reasons = " ".join(f"{s['system']}: {s['reason']}" for s in data["skipped"])
    assert "vllm target-only: vLLM is not importable" in reasons and "batch size 1 only" in reasons

    summary = {(r["scenario"], r["system"], r["batch"]): r for r in data["summary"]}
    for row in summary.values():
        assert row["greedy_exact"] is True, row["system"]  # every system equals its own target-only, token for token
        assert row["tokens_per_s"] > 0 and row["speedup"] > 0
    fixed = summary[("sim", "specserve k=2", 1)]
    assert fixed["serial_bound"] > 0 and fixed["overlapped_bound"] >= fixed["serial_bound"] and 1 <= fixed["tokens_per_step"] <= 3
    assert summary[("custom", "target-only", 2)]["speedup"] == 1.0
    assert summary[("sim", "specserve adaptive k<=2", 1)]["predicted"][0]["k"] == 0

    tables = (out / "tables.md").read_text()
    assert HEADER.match(tables.splitlines()[2]) and "`python -m benchmarks.bench_systems --quick --scenarios custom,sim" in tables
    for text in ("## Scenario `custom`", "## Scenario `sim`", "### batch 2", "| system | k | tok/s | min-max | speed-up |",
                 "serial bound", "predicted vs measured speed-up", "## Skipped"):
        assert text in tables
    assert tables.splitlines()[0] in capsys.readouterr().out  # also printed
    for name in ("speedup_vs_k", "speedup_vs_batch", "fraction_of_bound"):
        assert (out / f"{name}.png").read_bytes()[:8] == PNG
    assert not (out / "speedup_vs_delay.png").exists()  # no Ray systems ran

    main(["--from-json", str(out / "results.json"), "--out", str(tmp_path / "redrawn")])  # measures nothing
    assert (tmp_path / "redrawn" / "tables.md").read_text() == tables


def test_stream_path_bench_streams_every_delta(tmp_path, capsys):
    from benchmarks.dev.bench_stream_path import main as stream_path

    assert stream_path(["--streams", "4", "--tokens", "20", "--step-ms", "0.5", "--repeats", "1", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "stream_path.json").read_text())["rows"]
    assert row["tokens"] == 4 * 20  # every delta crossed the real TCP path
    assert row["steps"] >= 1 and {"cpu_s", "cpu_us_per_delta", "step_ms"} <= set(row)  # (counted from the first request in)
    assert "replica CPU us / delta" in capsys.readouterr().out


def test_vllm_bench_rates_each_round_against_the_better_vllm_row(tmp_path, capsys):
    """bench_vllm's per-round ratios: within each repeat, a speculative row over the faster of vLLM's rows
    of that same repeat, and --from-json rebuilds the tables from a run's records without measuring."""
    from benchmarks.bench_vllm import main as bench_vllm
    from benchmarks.bench_vllm import per_round_ratios, summarize

    tokens = [[1] * 10] * 4  # 40 tokens a run: tok/s = 40 / wall_s
    walls = {"vllm target-only": [0.4, 0.2, 0.4], "vllm colocated k=4": [0.5, 0.5, 0.2], "specserve d=0ms": [0.2, 0.4, 0.4]}
    spec = {"num_steps": 10, "num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 4, "num_blocks": 4, "num_cache_hits": 2,
            "num_speculative_steps": 4, "verify_ms": 1.0, "draft_wait_ms": 0.5, "link_ms": 0.1, "overhead_ms": 0.2, "draft_compute_s": 0.01}
    records = [{"pair": "demo", "system": s, "batch": 8, "repeat": i, "wall_s": w, "token_ids": tokens, "num_steps": 10,
                "num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, **(spec if s.startswith("specserve") else {})}
               for s, ws in walls.items() for i, w in enumerate(ws)]
    # Round 0: 200 against max(100, 80); round 1: 100 against max(200, 80); round 2: 100 against max(100, 200).
    assert per_round_ratios(records, 4) == {"specserve d=0ms": [2.0, 0.5, 0.5]}
    assert per_round_ratios([r for r in records if not (r["system"] == "specserve d=0ms" and r["repeat"] == 1)], 4) == {
        "specserve d=0ms": [2.0, 0.5]}  # a round without the system is left out, not counted as 0
    rows = {r["system"]: r for r in summarize(records, 4)}
    assert rows["specserve d=0ms"]["vs_best_vllm_by_round"] == [2.0, 0.5, 0.5]
    assert rows["specserve d=0ms"]["vs_best_vllm"] == 1.0  # the medians' ratio: 100 / 100, where the rounds say 0.5x in 2 of 3
    assert rows["vllm target-only"]["vs_best_vllm_by_round"] is None

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"args": {"k": 4}, "records": records}))
    bench_vllm(["--from-json", str(results), "--out", str(tmp_path / "again")])
    tables = (tmp_path / "again" / "tables.md").read_text()
    assert "| 0.50x (0.50-2.00), 1/3 |" in tables and tables.splitlines()[0] in capsys.readouterr().out
    assert (tmp_path / "again" / "speedup_vs_batch.png").read_bytes()[:8] == PNG
    kept = tmp_path / "kept.json.gz"  # as benchmarks/results keeps its runs: the same tables
    kept.write_bytes(gzip.compress(results.read_bytes()))
    bench_vllm(["--from-json", str(kept), "--out", str(tmp_path / "from_gz")])
    assert (tmp_path / "from_gz" / "tables.md").read_text().splitlines()[1:] == tables.splitlines()[1:]
    for bad in (tmp_path / "missing.json", tmp_path / "again" / "tables.md"):
        with pytest.raises(SystemExit):
            bench_vllm(["--from-json", str(bad), "--out", str(tmp_path / "bad")])
        assert f"--from-json {bad}: not a results.json this benchmark wrote" in capsys.readouterr().err


def test_plan_bench_rates_a_load_while_its_batch_is_full():
    """bench_plan compares the plan with the rate while B requests were in flight: up to the departure
    after which fewer ever were, a request running then counted in proportion to its time."""
    from types import SimpleNamespace

    from benchmarks.bench_plan import in_flight_rate

    outs = [SimpleNamespace(first_token_time=f, finished_time=d, token_ids=[0] * 10) for f, d in ((0, 1), (0, 2), (1, 3))]
    assert in_flight_rate(outs, 2, 0.0) == pytest.approx((10 + 10 + 5) / 2)
    assert in_flight_rate(outs, 1, 0.0) == pytest.approx(30 / 3)  # one in flight: up to the last departure
    with pytest.raises(ValueError, match="never leave 3 in flight"):
        in_flight_rate(outs, 3, 0.0)


def test_plan_bench_pairs_each_plan_with_the_run_after_it():
    """bench_plan's ratios are by round (a plan and the run right after it), not of medians taken apart:
    a round whose plan and run both met a slow machine still compares like with like."""
    from benchmarks.bench_plan import summarize, tables

    rows = [{"pair": "demo", "batch": 1, "round": i, "delivered": d, "whole_load": d, "measured_plan": m, "measured_arm": arm, "overhead_ms": 1.0}
            for i, (d, m, arm) in enumerate(((100.0, 90.0, "k=4"), (50.0, 50.0, "k=4"), (100.0, 110.0, "k=3")))]
    rows.append({"pair": "sim", "batch": 8, "round": 0, "delivered": 200.0, "whole_load": 190.0, "measured_plan": 210.0,
                 "measured_arm": "k=4, cache-only", "overhead_ms": 1.5, "profiled_plan": 180.0, "profiled_arm": "k=4"})
    demo, sim = summarize(rows)
    assert demo["measured"] == pytest.approx([0.9, 1.0, 1.1]) and demo["delivered"] == 100.0 and demo["measured_plan"] == 90.0
    assert demo["measured_arms"] == ["k=3", "k=4"] and "profiled" not in demo and demo["rounds"] == 3
    assert sim["profiled"] == pytest.approx([0.9]) and sim["overhead_ms"] == 1.5
    text = tables(["--pairs", "demo,sim"], [demo, sim])
    assert "| demo | 1 | 100.0 (100.0) | 90.0 | k=3; k=4 | 1.00 (0.90-1.10) | - | - |" in text
    assert "| sim | 8 | 200.0 (190.0) | 210.0 | k=4, cache-only | 1.05 (1.05-1.05) | 180.0 | 0.90 (0.90-0.90) |" in text
    assert "Medians of 1/3 rounds" in text and "sim batch 8: 1.5 ms" in text


def test_vllm_bench_spreads_request_lengths_the_same_for_every_system(tmp_path, capsys):
    """--length-spread s: each request's length drawn by its index from L x [1 - s, 1 + s] (every system
    and round gets the same), none at 0; out of [0, 1) it is refused before anything starts."""
    from benchmarks.bench_vllm import main as bench_vllm
    from benchmarks.bench_vllm import request_lengths

    assert request_lengths(5, 64, 0.0) == [64] * 5
    spread = request_lengths(200, 64, 0.5)
    assert spread == request_lengths(200, 64, 0.5) and spread[:20] == request_lengths(20, 64, 0.5)
    assert min(spread) >= 32 and max(spread) <= 96 and len(set(spread)) > 30
    assert min(request_lengths(50, 2, 0.9)) >= 1
    for bad in ("1", "-0.1"):
        with pytest.raises(SystemExit):
            bench_vllm(["--length-spread", bad, "--out", str(tmp_path)])
        assert "--length-spread must be in [0, 1)" in capsys.readouterr().err


def test_vllm_bench_counts_the_own_engines_prefills_as_forwards_not_overhead(tiny_pair):
    """bench_vllm's own-engine rows split a step as the vLLM target's: its overhead is what is neither a
    target forward (verify or prefill) nor the wait for the draft, and the parts add up to the wall time."""
    from benchmarks.bench_vllm import own_engine_timing
    from specserve import LLM, SamplingParams

    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=2, adaptive=False) as llm:
        llm.generate([[1, 2, 3], [4, 5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True), use_tqdm=False)
        tm = llm.metrics()["timing"]
    assert tm["prefill_s"] > 0 and tm["target_forward_s"] > 0  # the prompts' forwards are counted apart from the verifies'
    own_engine_timing(tm)
    assert tm["verify_s"] == tm["target_forward_s"]
    assert tm["specserve_s"] == pytest.approx(tm["wall_s"] - tm["verify_s"] - tm["prefill_s"] - tm["draft_wait_s"])
    assert 0 <= tm["specserve_s"] < tm["wall_s"] - tm["prefill_s"]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the two-device harness needs two cores")
@pytest.mark.parametrize("head", ["target", "draft"])
def test_the_harness_puts_rays_head_on_the_chosen_box(head):
    """``local_cluster(head=...)``: the head node (Ray's control plane, Serve's controller, the router under
    direct ingress) carries the chosen box's role label and runs on that box's cores; the other box too."""
    import ray

    from benchmarks.bench_cluster import local_cluster
    from specserve.serve.ingress import HEAD

    @ray.remote(num_cpus=0)
    def cores() -> list[int]:
        return sorted(os.sched_getaffinity(0))

    with local_cluster(two_device=True, head=head) as cluster:
        heads = [n for n in ray.nodes() if n["Alive"] and HEAD in n["Resources"]]
        assert [n["Labels"]["specserve.io/role"] for n in heads] == [head]
        expected = {"target": sorted(cluster.target_cpus), "draft": sorted(cluster.draft_cpus)}
        assert ray.get(cores.options(resources={HEAD: 0.001}).remote()) == expected[head]
        other = "draft" if head == "target" else "target"
        assert ray.get(cores.options(label_selector={"specserve.io/role": other}).remote()) == expected[other]
    with pytest.raises(ValueError, match="head must be"):
        with local_cluster(two_device=True, head="client"):
            pass
