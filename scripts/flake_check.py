#!/usr/bin/env python3
"""Run the test suite (or part of it) N times and report which tests failed how often.

    scripts/flake_check.sh -n 5                                   # the whole suite, 5 times
    scripts/flake_check.sh -n 2 tests/unit/test_messages.py       # a part: pytest arguments pass through
    scripts/flake_check.sh -n 3 --busy-core 0 -- tests/cluster -k http   # with one core kept busy

Every run is a fresh ``python -m pytest`` in the repository root with ``--junitxml``; failures and
errors are read from that XML (a run that dies before writing it counts as a crashed run). With
``--busy-core C`` a busy loop pinned to core C (``taskset -c C``) runs for the whole check, so the
tests see a loaded machine; it is stopped at the end, also on Ctrl-C or SIGTERM. Prints a table of
the tests that failed (how often, in which runs) and each run's wall time and counts; the XML and
the output of every run stay in ``--out`` (a new temporary folder by default). Exit status: 0 when
every run passed, 1 otherwise, 130 when interrupted.

Anything this script does not know is passed to pytest; put pytest options that collide with this
script's own (``-n``, ``-h``) after ``--``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        prog="flake_check", description=__doc__.split("\n\n")[0],
        epilog="Other arguments go to pytest (paths relative to the repository root); after `--` everything does.")
    parser.add_argument("-n", "--runs", type=int, default=3, help="how many times to run the tests (default: 3)")
    parser.add_argument("--busy-core", type=int, action="append", default=[], metavar="CPU",
                        help="keep this CPU core busy during the runs (taskset -c CPU python -c 'while True: pass'); "
                             "repeat for several cores")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="stop a run that takes longer than S seconds (counted as crashed)")
    parser.add_argument("--out", type=Path, default=None, help="folder for each run's junit XML and output "
                        "(default: a new temporary folder)")
    parser.add_argument("--python", default=sys.executable, help="the Python that runs pytest (default: this one)")
    if "--" in argv:
        at = argv.index("--")
        args, extra = parser.parse_known_args(argv[:at])
        extra += argv[at + 1:]
    else:
        args, extra = parser.parse_known_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args, extra


class BusyLoops:
    """Busy loops pinned to given cores, for the duration of a ``with`` block."""

    def __init__(self, cores: list[int], python: str):
        self.cores, self.python = cores, python
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "BusyLoops":
        if self.cores and shutil.which("taskset") is None:
            raise SystemExit("flake_check: --busy-core needs taskset (util-linux)")
        for core in self.cores:
            proc = subprocess.Popen(["taskset", "-c", str(core), self.python, "-c", "while True: pass"],
                                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs.append(proc)
            print(f"flake_check: busy loop on core {core} (pid {proc.pid})", flush=True)
        time.sleep(0.2)
        for core, proc in zip(self.cores, self.procs):
            if proc.poll() is not None:
                raise SystemExit(f"flake_check: the busy loop on core {core} exited at once ({proc.returncode}); "
                                 "does this machine have that core?")
        return self

    def __exit__(self, *exc) -> None:
        for proc in self.procs:  # only the processes started here, by their own pid
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self.procs:
            print(f"flake_check: stopped {len(self.procs)} busy loop(s)", flush=True)


def stop_group(proc: subprocess.Popen, sig: int, wait_s: float) -> None:
    """Signal the process group of a pytest run started here (its own session), then wait for it."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=wait_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def node_id(case: ET.Element) -> str:
    """pytest's node id from a junit testcase (xunit1: ``file`` attribute, ``classname`` with classes)."""
    name, classname, file = case.get("name", "?"), case.get("classname", ""), case.get("file")
    if file:
        module = file[:-3].replace("/", ".").replace(os.sep, ".") if file.endswith(".py") else file
        classes = classname[len(module):].strip(".") if classname.startswith(module) else ""
        return "::".join([file, *filter(None, classes.split(".")), name])
    return f"{classname}::{name}" if classname else name


def read_junit(path: Path) -> dict:
    """{"failed": {node id: first line of the message}, "counts": Counter} from one junit XML file."""
    root = ET.parse(path).getroot()
    failed: dict[str, str] = {}
    counts: Counter = Counter()
    for case in root.iter("testcase"):
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = child.tag
                message = (child.get("message") or child.text or "").strip().splitlines()
                failed.setdefault(node_id(case) + (" (error)" if child.tag == "error" else ""), message[0][:150] if message else "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        counts[outcome] += 1
    return {"failed": failed, "counts": counts}


def run_once(i: int, args: argparse.Namespace, extra: list[str], out: Path) -> dict:
    xml, log = out / f"run-{i}.xml", out / f"run-{i}.log"
    cmd = [args.python, "-m", "pytest", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={xml}", *extra]
    print(f"flake_check: run {i}/{args.runs}: {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    timed_out = False
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            stop_group(proc, signal.SIGINT, 60)
        except BaseException:  # Ctrl-C or SIGTERM: stop this run (and whatever it started) first
            stop_group(proc, signal.SIGINT, 30)
            raise
    wall = time.perf_counter() - start
    result = {"run": i, "wall_s": wall, "exit": proc.returncode, "failed": {}, "counts": Counter(), "log": log,
              "crashed": None}
    if xml.exists() and not timed_out:
        try:
            result.update(read_junit(xml))
        except ET.ParseError as exc:
            result["crashed"] = f"unreadable junit XML ({exc})"
    else:
        result["crashed"] = f"timed out after {args.timeout:g}s" if timed_out else f"no junit XML (exit {proc.returncode})"
    if result["crashed"] is None and proc.returncode not in (0, 1, 5) and not result["failed"]:
        result["crashed"] = f"pytest exit {proc.returncode}"  # 2: interrupted/usage, 3: internal error, 4: usage
    c = result["counts"]
    state = result["crashed"] or f"{c['passed']} passed, {c['failure']} failed, {c['error']} errors, {c['skipped']} skipped"
    print(f"flake_check: run {i}: {wall:.1f}s, {state}", flush=True)
    return result


def report(results: list[dict], runs: int, busy: list[int], out: Path) -> None:
    print()
    print(f"== flake_check: {len(results)} of {runs} run(s)" + (f", busy loop on core(s) {busy}" if busy else "") + " ==")
    print(f"{'run':>4} {'wall s':>8} {'exit':>5} {'passed':>7} {'failed':>7} {'errors':>7} {'skipped':>8}  note")
    for r in results:
        c = r["counts"]
        print(f"{r['run']:>4} {r['wall_s']:>8.1f} {r['exit']!s:>5} {c['passed']:>7} {c['failure']:>7} {c['error']:>7} "
              f"{c['skipped']:>8}  {r['crashed'] or ''}")
    if results:
        walls = [r["wall_s"] for r in results]
        print(f"wall time: min {min(walls):.1f}s, max {max(walls):.1f}s, total {sum(walls):.1f}s")
    failures: dict[str, list[int]] = defaultdict(list)
    messages: dict[str, str] = {}
    for r in results:
        for test, message in r["failed"].items():
            failures[test].append(r["run"])
            messages.setdefault(test, message)
    print()
    if not results:
        print("no run finished")
    elif not failures:
        crashed = [r["run"] for r in results if r["crashed"]]
        print("no test failed" + (f" (but runs {crashed} crashed: see their logs)" if crashed else ""))
    else:
        width = min(100, max(len(t) for t in failures))
        print(f"{'test':<{width}}  {'failed':>8}  runs")
        for test, which in sorted(failures.items(), key=lambda kv: (-len(kv[1]), kv[0])):
            print(f"{test:<{width}}  {len(which):>3}/{len(results):<4}  {','.join(map(str, which))}")
            if messages[test]:
                print(f"{'':<{width}}    {messages[test]}")
    print(f"\njunit XML and output of each run: {out}")


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(sys.argv[1:] if argv is None else argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="flake_check-"))
    out.mkdir(parents=True, exist_ok=True)
    out = out.resolve()

    def on_term(signum, frame):  # SIGTERM: the same clean-up as Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    # Ctrl-C even where SIGINT came in ignored (a background job of a script): then the pytest runs,
    # which get a handled signal reset to the default when they start, can be stopped with it too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    results: list[dict] = []
    interrupted = False
    try:
        with BusyLoops(args.busy_core, args.python):
            for i in range(1, args.runs + 1):
                results.append(run_once(i, args, extra, out))
    except KeyboardInterrupt:
        interrupted = True
        print("\nflake_check: interrupted", flush=True)
    report(results, args.runs, args.busy_core, out)
    if interrupted:
        print("flake_check: the interrupted run is not in the table; its output is in the folder above")
        return 130
    return 0 if results and all(not r["failed"] and not r["crashed"] and r["exit"] in (0, 5) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
