"""``specserve generate`` loses nothing: killed partway, resumed, every line answered once, as uninterrupted.

Real subprocesses of the CLI on the tiny pair (in-process engine, no Ray): a 2,000-line job
is stopped with SIGTERM once a few hundred rows are out, then finished with ``--resume``;
every index appears exactly once and every output equals the uninterrupted run's. The input
is read as it goes (rows come out of a pipe that has not ended yet), a bad line is an error
row and the exit code counts them, and ``--ordered`` writes in input order.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

NUM_LINES = 2000
BAD = {7: "{not json", 11: json.dumps({"prompt_token_ids": [1, 2], "temperature": -1})}  # two bad lines: error rows


def lines(n: int) -> list[str]:
    out = []
    for i in range(n):
        out.append(BAD[i] if i in BAD else json.dumps({"prompt_token_ids": [3 + i % 29, 4 + i % 7, 5 + i % 13], "max_tokens": 6,
                                                       "ignore_eos": True}))
    return out


def command(tiny_pair, inp: str, out: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "specserve.cli", "generate", "--input", inp, "--output", out, "--target", tiny_pair["target"],
            "--draft", tiny_pair["perturbed"], "--dtype", "float64", "--num-speculative-tokens", "3", "--no-progress", *extra]


def rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]  # every line is whole JSON: a kill never leaves a torn row behind


@pytest.fixture(scope="module")
def job(tiny_pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    inp = root / "in.jsonl"
    inp.write_text("\n".join(lines(NUM_LINES)) + "\n")
    full = root / "full.jsonl"
    run = subprocess.run(command(tiny_pair, str(inp), str(full)), capture_output=True, text=True, timeout=900)
    assert run.returncode == len(BAD), run.stderr[-2000:]  # the exit code counts the error rows
    return root, inp, {r["index"]: r for r in rows(str(full))}


def test_the_uninterrupted_run_answers_every_line_once(job):
    _, _, full = job
    assert sorted(full) == list(range(NUM_LINES))
    assert {i for i, r in full.items() if "error" in r} == set(BAD)
    assert "not valid JSON" in full[7]["error"] and "temperature" in full[11]["error"]
    assert all(len(r["token_ids"]) == 6 for i, r in full.items() if i not in BAD)


def test_sigterm_then_resume_loses_nothing_and_repeats_nothing(tiny_pair, job):
    root, inp, full = job
    out = root / "resumed.jsonl"
    proc = subprocess.Popen(command(tiny_pair, str(inp), str(out), "--window", "64"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 600
    while time.time() < deadline and (not out.exists() or sum(1 for _ in open(out)) < 300):
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 130, err[-2000:]
    partial = rows(str(out))
    assert 300 <= len(partial) < NUM_LINES and len({r["index"] for r in partial}) == len(partial)
    resumed = subprocess.run(command(tiny_pair, str(inp), str(out), "--resume"), capture_output=True, text=True, timeout=900)
    assert resumed.returncode == len(BAD), resumed.stderr[-2000:]
    final = rows(str(out))
    indices = [r["index"] for r in final]
    assert sorted(indices) == list(range(NUM_LINES))  # every index exactly once (error rows were redone, not duplicated)
    assert {r["index"]: r.get("token_ids") for r in final} == {i: r.get("token_ids") for i, r in full.items()}


def test_the_input_is_read_as_it_goes(tiny_pair, tmp_path):
    """Rows come out while the input pipe is still open: the job never waits for (or holds) the whole input."""
    out = tmp_path / "piped.jsonl"
    proc = subprocess.Popen(command(tiny_pair, "-", str(out), "--window", "8"), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    first = [line for line in lines(40) if line not in BAD.values()][:20]
    proc.stdin.write("\n".join(first) + "\n")
    proc.stdin.flush()
    deadline = time.time() + 300
    while time.time() < deadline and (not out.exists() or sum(1 for _ in open(out)) < 20):
        time.sleep(0.05)
        assert proc.poll() is None
    assert sum(1 for _ in open(out)) == 20  # all 20 answered before the input ended
    proc.stdin.write(json.dumps({"prompt_token_ids": [9, 9, 9], "max_tokens": 2}) + "\n")
    proc.stdin.close()
    assert proc.wait(timeout=300) == 0
    assert sorted(r["index"] for r in rows(str(out))) == list(range(21))


def test_ordered_output_is_in_input_order(tiny_pair, tmp_path):
    inp = tmp_path / "in.jsonl"
    inp.write_text("\n".join(lines(60)) + "\n")
    out = tmp_path / "ordered.jsonl"
    run = subprocess.run(command(tiny_pair, str(inp), str(out), "--ordered", "--window", "16"), capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 2, run.stderr[-2000:]
    assert [r["index"] for r in rows(str(out))] == list(range(60))


def test_bad_arguments_fail_before_anything_runs(tiny_pair, tmp_path):
    run = subprocess.run(command(tiny_pair, str(tmp_path / "missing.jsonl"), str(tmp_path / "o.jsonl")), capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and "no such file" in run.stderr
    assert not os.path.exists(tmp_path / "o.jsonl")


def test_a_second_stop_abandons_the_requests_in_flight_even_with_the_window_full(tmp_path):
    """In-process: with every slot taken by a request that never ends, two stops end the job at once;
    the abandoned requests are not written (a resume redoes them)."""
    import asyncio

    from specserve import SamplingParams
    from specserve.batch import BatchRunner, Job, OutputFile

    class Hung:
        async def generate_async(self, prompt, params):
            await asyncio.sleep(3600)

    runner = BatchRunner(Hung(), window=2)
    out = OutputFile(str(tmp_path / "o.jsonl"), resume=False, ordered=False)
    jobs = iter([Job(i, [1, 2], SamplingParams()) for i in range(10)])

    async def main():
        task = asyncio.ensure_future(runner.run(jobs, out))
        while len(runner._tasks) < 2:  # the window is full: the admitting loop waits for a slot
            await asyncio.sleep(0.01)
        runner.stop()
        runner.stop()
        return await asyncio.wait_for(task, 60)

    stats = asyncio.run(main())
    out.close()
    assert stats.stopped and stats.abandoned == 2 and stats.written == 0
    assert (tmp_path / "o.jsonl").read_text() == ""
