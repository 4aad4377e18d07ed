"""Model backends behind one small protocol, chosen by name from a registry."""

from __future__ import annotations

from .base import ModelBackend

BACKENDS = {"hf": "specserve.backends.hf:HFBackend", "sim": "specserve.backends.sim:SimBackend"}


def create_backend(name: str, **kwargs) -> ModelBackend:
    """Instantiate backend ``name`` (``"hf"``); imports it lazily so optional deps stay optional."""
    import importlib

    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {name!r}")
    module, cls = BACKENDS[name].split(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)


__all__ = ["ModelBackend", "BACKENDS", "create_backend"]
