"""A ``TensorLink`` over ``ray.util.collective``: one two-rank group per target/draft connection.

The target (rank 0) names a fresh group when it connects; both ends join it (the rendezvous
goes through Ray, so both must be Ray workers), then every reply's draft probabilities are
one ``send``/``recv`` of a packed ``[rows, vocab]`` float32 tensor, and every request's hidden
states (for a draft head) one packed ``[rows, width]`` tensor in the target's dtype. ``gloo`` runs on CPUs,
``nccl`` between two GPUs (Ray builds it on cupy's NCCL bindings; two ranks on one GPU are
refused). The same code path serves both; the message channel stays on TCP.
"""

from __future__ import annotations

import logging

logger = logging.getLogger(__name__)


class CollectiveLink:
    def __init__(self, group: str, backend: str, rank: int, device: str = "cpu"):
        import ray.util.collective as col

        if backend == "nccl" and not device.startswith("cuda"):
            raise ValueError(f"the nccl tensor path needs a CUDA device on both sides, this side has {device!r}")
        self.group, self.backend, self.rank = group, backend, rank
        self.device = device if backend == "nccl" else "cpu"
        col.init_collective_group(2, rank, backend=backend, group_name=group)
        self._col = col

    def send(self, tensor) -> None:
        self._col.send(tensor.to(self.device).contiguous(), 1 - self.rank, self.group)

    def recv(self, rows: int, width: int, dtype=None):
        import torch

        buf = torch.empty(rows, width, dtype=dtype or torch.float32, device=self.device)
        self._col.recv(buf, 1 - self.rank, self.group)
        return buf

    def close(self) -> None:
        try:
            self._col.destroy_collective_group(self.group)
        except Exception as exc:  # the peer went first: nothing left to free here
            logger.debug("closing collective group %s: %s", self.group, exc)


def link_factory(backend: str, rank: int, device: str = "cpu"):
    """A factory for one side: group name -> ``CollectiveLink``."""
    return lambda group: CollectiveLink(group, backend, rank, device)
