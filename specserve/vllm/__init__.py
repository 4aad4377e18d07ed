"""vLLM on either side of specserve: a vLLM target verifying remote drafts, a vLLM draft engine.

``RemoteDraftProposer`` is the class to name in vLLM's speculative config
(``{"method": "custom_class", "model": "specserve.vllm.RemoteDraftProposer", ...}``); the
engine and drafter classes are reached through ``specserve.backends.vllm``. Importing this
package imports no vLLM: each module imports it inside the function that needs it.
"""

from __future__ import annotations

from .proposer import RemoteDraftProposer

__all__ = ["RemoteDraftProposer"]
