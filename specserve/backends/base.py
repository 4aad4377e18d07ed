"""The model-backend protocol: a batched forward over sequences with per-sequence KV caches.

Data flow: ``forward(seq_ids, token_ids, num_logits)`` appends each sequence's new tokens
at its own committed length and returns logits for the last ``num_logits`` of them;
``truncate(seq_id, n)`` rolls a sequence back to ``n`` cached tokens by position (the next
write overwrites the stale slots). A backend whose forward over ragged rows costs about one
weight read plus its tokens' work (a GPU serving kernel, the simulator) sets ``fuses_prefill =
True``, and new prompts are then prefilled as rows of the step's verify forward; the transformers
backend pads rows to one width, so it keeps prefills apart: fused, every decode row would pay for the
prompt's width. Backends know nothing of drafting or verification.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelBackend(Protocol):
    vocab_size: int  # width of the logits
    max_model_len: int  # longest sequence the model can hold (prompt + output)
    device: torch.device

    def add(self, seq_id: str) -> None: ...

    def free(self, seq_id: str) -> None: ...

    def num_cached(self, seq_id: str) -> int: ...

    def truncate(self, seq_id: str, num_tokens: int) -> None: ...

    def forward(
        self,
        seq_ids: list[str],
        token_ids: list[list[int]],  # [batch_size][num_new_i], every num_new_i >= 1
        num_logits: list[int],  # [batch_size], 1 <= num_logits[i] <= num_new_i
    ) -> torch.Tensor:  # [batch_size, max(num_logits), vocab] float32, right-aligned per row
        ...
