"""A script that never calls ``llm.shutdown()`` exits cleanly, and a collected ``LLM`` stops its threads.

Without the exit hook such a script can abort with "terminate called without an active exception"
(exit code 134): the engine's daemon threads are still inside a torch forward while the interpreter
tears down. The script runs three times, since the abort does not come every time; the gc test is exact.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    from specserve import LLM, SamplingParams

    llm = LLM("demo:target", draft="demo:draft")
    outs = llm.generate(["def f(x):\\n"] * 200, SamplingParams(temperature=1.0, max_tokens=16), use_tqdm=False)
    assert len(outs) == 200
    print("generated")
""")


def test_a_script_without_shutdown_exits_with_code_zero():
    for _ in range(3):
        run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0 and "generated" in run.stdout, run.stderr[-2000:]
        assert "terminate called" not in run.stderr


def test_a_collected_llm_stops_its_engine_thread(tiny_pair):
    from specserve import LLM, SamplingParams

    llm = LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=2)
    llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    thread = llm._engine.loop._thread
    assert thread.is_alive()
    del llm
    gc.collect()
    thread.join(timeout=30)
    assert not thread.is_alive()


def test_shutdown_twice_and_the_context_manager_still_work(tiny_pair):
    from specserve import LLM, SamplingParams

    with LLM(tiny_pair["target"], draft=None) as llm:
        assert llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=2), use_tqdm=False)[0].token_ids
        thread = llm._engine.loop._thread
    assert not thread.is_alive()
    llm.shutdown()  # a second call is a no-op
