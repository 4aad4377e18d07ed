"""GPU checks: run on a CUDA machine; skipped cleanly without CUDA.

`python -m pytest tests/gpu -m gpu` on a machine with one GPU runs the single-GPU checks;
the NCCL tensor path needs two GPUs (NCCL refuses two ranks on one GPU).
"""

from __future__ import annotations

import pytest
import torch

from specserve import LLM, SamplingParams

from ..unit.test_mtp import mtp_target  # noqa: F401  (a fixture)

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_two = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the NCCL path needs two GPUs")

PROMPTS = [[5, 6, 7, 8, 9], [10, 11], list(range(12, 40))]


@needs_cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_greedy_on_cuda_equals_target_only(tiny_pair, dtype):
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(tiny_pair["target"], dtype=dtype, device="cuda") as llm:
        ref = llm.generate(PROMPTS, params, use_tqdm=False)
    for draft in (tiny_pair["perturbed"], "ngram"):
        with LLM(tiny_pair["target"], draft=draft, num_speculative_tokens=4, dtype=dtype, device="cuda", adaptive=False) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        if dtype == "float32":
            assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
        else:  # bf16 batched-vs-step numerics may flip near-ties; the draft must still be accepted often
            assert sum(o.token_ids == r.token_ids for o, r in zip(outs, ref)) >= 2


@needs_cuda
def test_seeded_sampling_on_cuda_equals_the_reference(tiny_pair):
    from transformers import AutoModelForCausalLM

    from specserve.reference import reference_generate

    params = [SamplingParams(temperature=0.9, max_tokens=16, seed=s, ignore_eos=True) for s in range(3)]
    target = AutoModelForCausalLM.from_pretrained(tiny_pair["target"], dtype=torch.float64).cuda().eval()
    draft = AutoModelForCausalLM.from_pretrained(tiny_pair["perturbed"], dtype=torch.float64).cuda().eval()
    ref = [reference_generate(target, p, sp, draft, 3) for p, sp in zip(PROMPTS, params)]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64", device="cuda",
             adaptive=False) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)] == ref


@needs_cuda
def test_draft_on_cpu_target_on_cuda(tiny_pair):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(tiny_pair["target"], device="cuda") as llm:
        ref = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(tiny_pair["target"], draft=tiny_pair["same"], target_device="cuda", draft_device="cpu",
             num_speculative_tokens=4) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]


@needs_two
def test_nccl_tensor_path(tiny_pair):
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1, "labels": {"specserve.io/role": "target"}})
    cluster.add_node(num_cpus=2, num_gpus=1, labels={"specserve.io/role": "draft"})
    ray.init(address=cluster.address)
    try:
        llm = LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], device="cuda", target_num_gpus=1, draft_num_gpus=1,
                  channel_tensors="collective", collective_backend="nccl", ray=True, adaptive=False)
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0.8, max_tokens=16, seed=1, ignore_eos=True), use_tqdm=False)
        assert all(len(o.token_ids) == 16 for o in outs)
        assert llm.metrics()["drafts"]["tensor_bytes"] > 0
        llm.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


@needs_cuda
@pytest.mark.parametrize("head", ["eagle3", "eagle"])
@pytest.mark.parametrize("ahead", [False, True])
def test_a_head_on_cuda_equals_target_only(tmp_path, head, ahead, ordered_draft_ahead):
    """The target's hidden rows, captured on the GPU, feed an EAGLE head on the GPU (drafting ahead on its
    own rows too); greedy output is the target's."""
    from ..conftest import make_model
    from ..heads import make_eagle3_head, make_eagle_head

    make_model(tmp_path / "target", seed=0, tokenizer=True, hidden=64, layers=4)
    target = str(tmp_path / "target")
    path = (make_eagle3_head(tmp_path / head, target, layer_ids=[1, 2, 3]) if head == "eagle3"
            else make_eagle_head(tmp_path / head, target, seed=4))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(target, dtype="float64", device="cuda") as llm:
        ref = llm.generate(PROMPTS, params, use_tqdm=False)
    with LLM(target, draft=path, num_speculative_tokens=3, dtype="float64", device="cuda", adaptive=False, draft_ahead=ahead,
             draft_ahead_preempt=False) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        hits = llm.metrics()["num_cache_hits"]
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    assert (hits > 0) == ahead


@needs_cuda
def test_the_same_prompt_is_prefilled_once_on_cuda(tiny_pair):
    """The prompt's KV rows are copied on the GPU (``HFBackend.fork``); outputs equal each prompt run alone."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = PROMPTS[2]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], num_speculative_tokens=3, dtype="float64", device="cuda") as llm:
        alone = llm.generate([prompt], params, use_tqdm=False)[0].token_ids
        outs = llm.generate([prompt, PROMPTS[0], prompt], params, use_tqdm=False)
        assert llm.metrics()["num_prefills_shared"] == 1
    assert outs[0].token_ids == alone and outs[2].token_ids == alone


@needs_cuda
def test_decode_attention_stays_off_cudnn(tmp_path):
    """cuDNN's attention builds a graph per key length: a decode step (a new length every step) must not
    reach it. PyTorch may pick it for bfloat16 (head_dim 64 here) unless told not to."""
    from torch.profiler import ProfilerActivity, profile

    from specserve.backends.hf import HFBackend

    from ..conftest import make_model

    make_model(tmp_path / "m", hidden=256, layers=2)  # 4 heads of 64
    backend = HFBackend(str(tmp_path / "m"), dtype="bfloat16", device="cuda")
    backend.add("a")
    backend.add("b")
    logits = backend.forward(["a", "b"], [PROMPTS[0], PROMPTS[2]], [1, 1])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            logits = backend.forward(["a", "b"], [[t] for t in logits[:, -1].argmax(-1).tolist()], [1, 1])
    names = {e.key for e in prof.key_averages()}
    assert any("attention" in n for n in names), sorted(names)  # attention ran and the profiler saw it
    assert not [n for n in names if "cudnn" in n.lower() and "attention" in n.lower()]


@needs_cuda
def test_a_deepseek_mtp_layer_on_cuda_equals_target_only(mtp_target):
    """A DeepSeek-V3 checkpoint's MTP layer drafting on the GPU (MLA, MoE, slot cache); greedy output is the target's."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    path = mtp_target["path"]
    with LLM(path, dtype="float32", device="cuda") as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    with LLM(path, draft=path, num_speculative_tokens=3, dtype="float32", device="cuda", adaptive=False) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == ref
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0


# Logits processing, logprobs and structured outputs on the GPU. Each check is a function of the device so
# that it can be run on a CPU too (the tests below call it with "cuda").
PROCESSING = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.4, "logit_bias": {12: 2.0, 30: 3.0}}


def check_processing_keeps_greedy_lossless(pair: dict, device: str) -> None:
    """Penalties and a bias applied to the target's rows on the device at every verified position: greedy
    output equals target-only with the same parameters; a draft with the target's weights, processing its
    proposals the same way on the device, has every draft accepted; sampled with min-p and allowed tokens,
    only allowed tokens come out. (A processor whose ids, biases and masks stayed on the CPU fails this.)"""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **PROCESSING)
    with LLM(pair["target"], dtype="float32", device=device) as llm:
        ref = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        plain = [o.token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                                                   use_tqdm=False)]
    assert ref != plain  # the processing moves the output, so the checks below can fail
    for draft in (pair["perturbed"], pair["same"]):
        with LLM(pair["target"], draft=draft, num_speculative_tokens=4, dtype="float32", device=device, adaptive=False) as llm:
            outs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert [o.token_ids for o in outs] == ref, draft
        drafted = sum(o.metrics.num_draft_tokens for o in outs)
        assert drafted > 0
        if draft == pair["same"]:
            assert sum(o.metrics.num_accepted_tokens for o in outs) == drafted
    # Sampled, with min-p and allowed tokens too: every token drawn is an allowed one.
    allowed = [3, 7, 11, 19, 23, 29, 31, 37, 41, 43]
    sampled = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s, min_p=0.05, allowed_token_ids=allowed,
                              **PROCESSING) for s in range(len(PROMPTS))]
    with LLM(pair["target"], draft=pair["perturbed"], num_speculative_tokens=4, dtype="float32", device=device) as llm:
        outs = llm.generate(PROMPTS, sampled, use_tqdm=False)
    assert all(len(o.token_ids) == 16 and set(o.token_ids) <= set(allowed) for o in outs)


def check_logprobs_do_not_depend_on_speculation(pair: dict, device: str) -> None:
    """Logprobs come from the target's rows on the device: the same with and without speculation, and the
    model's own log-softmax after each output's prefix."""
    from transformers import AutoModelForCausalLM

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    runs = []
    for kw in ({}, {"draft": pair["perturbed"], "num_speculative_tokens": 4, "adaptive": False}):
        with LLM(pair["target"], dtype="float64", device=device, **kw) as llm:
            runs.append(llm.generate(PROMPTS, params, use_tqdm=False))
    plain, spec = runs
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert sum(o.metrics.num_accepted_tokens for o in spec) > 0
    model = AutoModelForCausalLM.from_pretrained(pair["target"], dtype=torch.float64).to(device).eval()
    for prompt, a, b in zip(PROMPTS, plain, spec):
        with torch.no_grad():
            ids = torch.tensor([prompt + a.token_ids], device=device)
            ref = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1], dim=-1).cpu()
        for j, (x, y, tok) in enumerate(zip(a.logprobs, b.logprobs, a.token_ids)):
            assert x[0][0] == tok == y[0][0] and len(x) == len(y) == 4
            assert abs(x[0][1] - y[0][1]) < 1e-6 and abs(x[0][1] - ref[j, tok].item()) < 1e-6
            assert [t for t, _ in y[1:]] == ref[j].topk(3).indices.tolist()


def check_structured_greedy_equals_target_only(device: str) -> None:
    """xgrammar's mask (built on the host) applied to the target's rows on the device: greedy constrained
    output with the demo draft equals target-only constrained decoding, and finished outputs parse."""
    import json

    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10}, "size": {"type": "integer"}},
              "required": ["name", "size"]}
    params = SamplingParams(temperature=0, max_tokens=48, structured_outputs=("json", json.dumps(schema)))
    prompts = ["def parse(text):\n", "class Stack:\n", "import "]
    with LLM("demo:target", dtype="float32", device=device) as llm:
        ref = llm.generate(prompts, params, use_tqdm=False)
    with LLM("demo:target", draft="demo:draft", dtype="float32", device=device, num_speculative_tokens=4,
             adaptive=False) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    assert sum(o.metrics.num_draft_tokens for o in outs) > 0
    for o in outs:
        if o.finish_reason == "stop":
            value = json.loads(o.text)
            assert isinstance(value["name"], str) and isinstance(value["size"], int)


@needs_cuda
def test_processing_on_cuda_keeps_greedy_lossless(tiny_pair):
    check_processing_keeps_greedy_lossless(tiny_pair, "cuda")


@needs_cuda
def test_logprobs_on_cuda_do_not_depend_on_speculation(tiny_pair):
    check_logprobs_do_not_depend_on_speculation(tiny_pair, "cuda")


@needs_cuda
def test_structured_outputs_on_cuda_equal_target_only():
    pytest.importorskip("xgrammar")
    check_structured_greedy_equals_target_only("cuda")
