"""The link between the target side and the draft actor: one round trip per step.

``RayChannel`` (default, works everywhere): the msgpack ``ProposeRequest`` goes to the
draft actor as bytes and the ``ProposeReply`` comes back as bytes through Ray's object
store, draft probabilities inline. ``CollectiveChannel``: the same messages, but the draft
probabilities of a step travel as one packed tensor over ``ray.util.collective``
(``gloo`` on CPU, ``nccl`` between GPUs, which Ray builds on cupy's NCCL bindings).
``delay_ms`` emulates a slow link (one-way, applied in both directions).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from ..messages import ProposeReply, ProposeRequest, decode, encode

logger = logging.getLogger(__name__)

TARGET_RANK, DRAFT_RANK = 0, 1


class RayChannel:
    name = "ray"

    def __init__(self, draft_actor, delay_ms: float = 0.0):
        self.draft = draft_actor
        self.delay_s = delay_ms / 1000.0

    async def _delay(self) -> None:
        if self.delay_s:
            await asyncio.sleep(self.delay_s)

    async def propose(self, req: ProposeRequest) -> ProposeReply:
        await self._delay()
        data = await self.draft.handle.remote(encode(req), False)
        await self._delay()
        return decode(data)

    def degrade(self) -> None:
        """Called after a draft failure; the Ray path needs no repair."""


class CollectiveChannel(RayChannel):
    name = "collective"

    def __init__(self, draft_actor, delay_ms: float, backend: str, group_name: str, vocab_size: int, device):
        super().__init__(draft_actor, delay_ms)
        self.backend, self.group_name, self.vocab_size, self.device = backend, group_name, vocab_size, device
        self.tensor_path = True
        self.num_tensor_bytes = 0  # draft probabilities received over the collective path

    @staticmethod
    def init_group(backend: str, group_name: str, rank: int) -> None:
        import ray.util.collective as col

        col.init_collective_group(2, rank, backend=backend, group_name=group_name)

    async def propose(self, req: ProposeRequest) -> ProposeReply:
        if not self.tensor_path:
            return await super().propose(req)
        await self._delay()
        reply = decode(await self.draft.handle.remote(encode(req), True))
        rows = sum(reply.tensor_rows)
        if rows:
            import torch
            import ray.util.collective as col

            device = "cuda" if self.backend == "nccl" else "cpu"
            buf = torch.empty(rows, self.vocab_size, dtype=torch.float32, device=device)
            await asyncio.to_thread(col.recv, buf, DRAFT_RANK, self.group_name)
            self.num_tensor_bytes += buf.numel() * buf.element_size()
            blocks, start = [], 0
            for block, n in zip(reply.blocks, reply.tensor_rows):
                probs = buf[start : start + n] if n else None
                start += n
                blocks.append(type(block)(block.request_id, block.step, block.base_len, block.draft_token_ids, probs))
            reply = ProposeReply(reply.step, blocks, reply.missing)
        await self._delay()
        return reply

    def degrade(self) -> None:
        # A restarted draft has lost its end of the group; rebuilding it needs both sides to
        # rendezvous again, so after a failure payloads stay on the object-store path.
        if self.tensor_path:
            logger.warning("collective channel disabled after a draft failure: draft probabilities now travel through Ray's object store")
        self.tensor_path = False


def pack_probs(reply: ProposeReply, backend: str):
    """Draft side: strip probabilities out of ``reply`` into one tensor ([rows, vocab] float32)."""
    import torch

    tensors, rows, blocks = [], [], []
    for b in reply.blocks:
        if b.draft_probs is not None and len(b.draft_token_ids):
            tensors.append(torch.as_tensor(np.asarray(b.draft_probs, dtype=np.float32)))
            rows.append(len(b.draft_token_ids))
        else:
            rows.append(0)
        blocks.append(type(b)(b.request_id, b.step, b.base_len, b.draft_token_ids, None))
    if not tensors:
        return reply, None
    packed = torch.cat(tensors).contiguous()
    if backend == "nccl":
        packed = packed.cuda()
    return ProposeReply(reply.step, blocks, reply.missing, rows), packed
