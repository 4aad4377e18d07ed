"""Tiny random-weight models built from transformers configs, saved and reloaded with from_pretrained."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
import torch

# Tiny models: one intra-op thread avoids OpenMP spinning against other processes on 2 cores.
torch.set_num_threads(1)

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Drafts run eager here: compiling each test's draft (seconds on a small CPU) would multiply the suite's
# time, and a draft's speed never changes an output. tests/unit/test_draft_compile.py covers the compiled default.
os.environ.setdefault("SPECSERVE_DRAFT_COMPILE", "false")
# Targets run specserve's own engine unless a test names vLLM: with vLLM installed the default (auto) would start
# a vLLM engine (a minute on a small CPU) for every test. tests/vllm covers the vLLM target, the default's choice included.
os.environ.setdefault("SPECSERVE_TARGET_BACKEND", "hf")

WORDS = [f"w{i}" for i in range(60)]


def save_word_tokenizer(path: str) -> None:
    """A 64-token word-level tokenizer ("w0".."w59" + specials) so string prompts and stop strings work."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<eos>": 1, "<pad>": 2, "<bos>": 3}
    for i, w in enumerate(WORDS):
        vocab[w] = 4 + i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins word tokens with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", pad_token="<pad>", bos_token="<bos>")
    fast.save_pretrained(path)


def make_model(path, arch: str = "llama", seed: int = 0, vocab_size: int = 64, noise_from=None, noise: float = 0.0,
               tokenizer: bool = False, max_positions: int = 256, eos_token_id=None, hidden: int = 32, layers: int = 2) -> str:
    from transformers import (GPT2Config, GPT2LMHeadModel, GPTNeoXConfig, GPTNeoXForCausalLM, LlamaConfig,
                              LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM)

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, bos_token_id=None, pad_token_id=None)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=max_positions, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                                             num_key_value_heads=2, max_position_embeddings=max_positions, **common))
    elif arch == "gpt2":
        model = GPT2LMHeadModel(GPT2Config(n_embd=hidden, n_layer=layers, n_head=4, n_positions=max_positions, **common))
    elif arch == "gpt_neox":
        model = GPTNeoXForCausalLM(GPTNeoXConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers, num_attention_heads=4,
                                                 max_position_embeddings=max_positions, **common))
    else:
        raise ValueError(arch)
    # Random init is near-uniform; sharpen it so greedy outputs are not all ties in spirit.
    with torch.no_grad():
        emb = model.get_output_embeddings().weight
        emb.mul_(20.0)
        if noise_from is not None:
            src = noise_from.state_dict()
            model.load_state_dict({k: v + noise * torch.randn_like(v) * v.std().clamp_min(1e-3) if v.is_floating_point() and v.dim() > 1 else v
                                   for k, v in src.items()})
    model.save_pretrained(str(path))
    if tokenizer:
        save_word_tokenizer(str(path))
    model._saved_path = str(path)
    return model


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """target, a same-weights draft, a perturbed draft, an unrelated draft (Llama, vocab 64, tokenizer)."""
    root = tmp_path_factory.mktemp("models")
    target = make_model(root / "target", seed=0, tokenizer=True)
    make_model(root / "perturbed", seed=1, noise_from=target, noise=0.3, tokenizer=True)
    make_model(root / "unrelated", seed=2, tokenizer=True)
    return {
        "target": str(root / "target"),
        "same": str(root / "target"),
        "perturbed": str(root / "perturbed"),
        "unrelated": str(root / "unrelated"),
        "target_model": target,
    }


def wait_until(condition, timeout: float, interval: float = 0.1, message: str = "condition"):
    """Poll ``condition()`` until it returns something truthy (returned) or ``timeout`` seconds pass
    (AssertionError naming ``message``). Timeouts here are sized for a loaded 2-core machine: several
    times the usual wait, never the expected time, since a passing test returns as soon as it holds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{message}: not within {timeout:g}s (last value {value!r})")
        time.sleep(interval)


def greedy_references(model_dir: str, prompts: list, params) -> list:
    """Each prompt's output from the target alone (float64 transformers, ``reference_generate``)."""
    from transformers import AutoModelForCausalLM

    from specserve.reference import reference_generate

    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float64).eval()
    return [reference_generate(target, p, params) for p in prompts]


class Sinks:
    """Per-request sinks for ``EngineLoop.submit_many``: each request's tokens by index, the indices
    finished, the errors."""

    def __init__(self):
        self.outs: dict[int, list[int]] = {}
        self.done: set[int] = set()
        self.errors: list[Exception] = []

    def __call__(self, i: int):
        def sink(item):
            if isinstance(item, Exception):
                self.errors.append(item)
                return
            self.outs.setdefault(i, []).extend(item.token_ids)
            if item.finished:
                self.done.add(i)
        return sink


def stream_all(llm, requests: list, delays: list[float] | None = None) -> list:
    """Stream each (prompt, params) at once (after its delay, in seconds); per request its tokens, or the
    ``RequestFailed`` it ended with."""
    import asyncio

    from specserve.engine import RequestFailed

    async def one(prompt, params, delay):
        await asyncio.sleep(delay)
        try:
            return [t async for d in llm.stream(prompt, params) for t in d.token_ids]
        except RequestFailed as exc:
            return exc

    async def main():
        return await asyncio.gather(*[one(p, s, d) for (p, s), d in zip(requests, delays or [0.0] * len(requests))])

    return asyncio.run(main())


def demo_acceptance_range() -> tuple[float, float]:
    """The demo acceptance-rate range the demo target's model card states ("demo acceptance range: a-b")."""
    card = Path(__file__).resolve().parents[1] / "specserve" / "demo_models" / "target" / "README.md"
    m = re.search(r"demo acceptance range[^0-9]*([0-9.]+)\s*[-–]\s*([0-9.]+)", card.read_text(), re.I)
    assert m, f"{card} must state the demo acceptance range"
    return float(m.group(1)), float(m.group(2))


@pytest.fixture
def ordered_draft_ahead(monkeypatch):
    """In-process drafting ahead, in the order the TCP draft server keeps.

    ``LocalEndpoint`` answers a request and then hands ``prepare`` (drafting ahead) to a helper
    thread, which races the engine's next request for the draft's lock: on a loaded machine the
    next request can win, get a miss, and the number of speculation-cache hits moves with thread
    scheduling even with ``draft_ahead_preempt=False``. The TCP ``DraftServer`` drafts ahead on
    its serving thread before it reads the next request; this fixture makes the in-process
    endpoint do the same (each request first waits for the previous ``prepare``), so hits and
    misses follow from the outputs alone. Outputs are unaffected either way.
    """
    from specserve.transport import LocalEndpoint

    original = LocalEndpoint.send

    def send(self, req, awaited=True):
        if self._ahead is not None:
            self._ahead.submit(lambda: None).result()  # one FIFO worker: the previous prepare is done
        return original(self, req, awaited)

    monkeypatch.setattr(LocalEndpoint, "send", send)


def private_ports() -> dict:
    """Head-node arguments that keep a test cluster off Ray's fixed default ports.

    The dashboard (8265) and the head's dashboard agent (52365) otherwise collide with any other
    Ray on the machine (another test's cluster still shutting down, a benchmark, someone else's):
    the dashboard then does not start, and with it go the state API (``list_actors``) and
    ``serve deploy``. The agent picks a free port when given none.
    """
    return {"dashboard_port": free_port(), "dashboard_agent_listen_port": None}


# Ports a test hands to a server come from below the kernel's ephemeral range (32768+) and above
# Ray's worker ports (10002-19999): a port that was free when chosen cannot then be taken by a
# process's ``bind(0)`` (Ray's metrics agent, a worker's socket) before the server binds it.
TEST_PORTS = range(20000, 32000)


def free_ports(n: int = 1) -> int:
    """The first of ``n`` consecutive free ports (a router's port and Serve's proxy's after it)."""
    import random

    for _ in range(200):
        first = random.randrange(TEST_PORTS.start, TEST_PORTS.stop - n)
        try:
            for port in range(first, first + n):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports in {TEST_PORTS}")


def free_port() -> int:
    return free_ports(1)


def assert_admitted_as_slots_freed(outs, window: int) -> None:
    """Each output's times are ordered, and a request beyond the first ``window`` arrived (was taken by the
    engine) only after as many others had finished: time spent waiting for a slot is not its latency."""
    for o in outs:
        assert o.arrival_time <= o.first_token_time <= o.finished_time
    finished = sorted(o.finished_time for o in outs)
    for i, o in enumerate(outs[window:]):
        assert o.arrival_time >= finished[i]
