"""specserve: speculative decoding with the draft and the target on different machines, lossless.

``import specserve`` is cheap and needs only the base install; names are imported on first
use, and Ray, Serve, vLLM and GPU extras only by the modules that need them.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("specserve")  # pyproject.toml is the one place the version is written
except PackageNotFoundError:  # a source tree on sys.path that was never installed
    __version__ = "0+unknown"

_EXPORTS = {
    "LLM": "specserve.llm",
    "SamplingParams": "specserve.sampling_params",
    "RequestOutput": "specserve.outputs",
    "SpecMetrics": "specserve.outputs",
    "StepDelta": "specserve.outputs",
    "SpecserveConfig": "specserve.config",
    "SideConfig": "specserve.config",
    "connect": "specserve.app_client",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'specserve' has no attribute {name!r}")
