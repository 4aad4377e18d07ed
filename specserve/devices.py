"""Where a side computes, and whether two sides would compete for the same compute.

Each side reports its ``placement`` (the machine's boot id, the CPU cores its process may
run on, its torch device and, for a GPU, the GPU's UUID); ``shares_compute`` compares two
reports: the draft takes compute from its target only on the same machine and either the
same GPU or, for a CPU draft, overlapping core sets. Two hosts, two GPUs of one host, or two
disjoint core sets of one host (each Ray node pinned to its own cores) are separate devices.
The boot id, not the IP address, names the machine: network namespaces on one host share
its cores. Knows nothing of models or transports.
"""

from __future__ import annotations

import functools
import os
import socket


@functools.lru_cache(maxsize=1)
def host_id() -> str:
    """This machine's kernel boot id (the same in every container and network namespace of it)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux
        return socket.gethostname()


def cpu_set() -> list[int]:
    """The cores this process may run on (a child inherits them: a pinned Ray node's workers do)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows: no affinity API
        return list(range(os.cpu_count() or 1))


def gpu_uuid(device: str) -> str | None:
    """The UUID of the GPU a torch device string names (None for CPU or when it cannot be read)."""
    if not str(device).startswith("cuda"):
        return None
    try:
        import torch

        index = torch.device(device).index
        return str(torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).uuid)
    except Exception:  # no CUDA here, or an old torch without .uuid: compare by device string instead
        return None


def placement(device: str, simulated: bool = False) -> dict:
    """This process's report. ``simulated``: the side models a device of its own (``backend: sim``)."""
    return {"host": host_id(), "cpus": cpu_set(), "device": str(device), "gpu": gpu_uuid(device), "simulated": simulated}


def shares_compute(target: dict | None, draft: dict | None) -> tuple[bool, str]:
    """(whether the draft would take compute from the target, why) from two ``placement`` reports."""
    if not target or not draft or "host" not in target or "host" not in draft:
        return False, "a side did not report its placement (assumed separate devices)"
    if draft.get("simulated"):
        return False, "the draft is simulated on a device of its own"
    if target["host"] != draft["host"]:
        return False, "different hosts"
    draft_device = str(draft.get("device", "cpu"))
    if draft_device.startswith("cuda"):
        if not str(target.get("device", "cpu")).startswith("cuda"):
            return False, "same host, the draft on a GPU and the target on the CPU"
        same = (target.get("gpu") == draft.get("gpu")) if target.get("gpu") and draft.get("gpu") else (
            target.get("device") == draft_device)
        return (True, "same host, same GPU") if same else (False, "same host, different GPUs")
    overlap = set(target.get("cpus") or []) & set(draft.get("cpus") or [])
    if overlap:
        return True, f"same host, overlapping CPU cores ({len(overlap)} shared)"
    return False, "same host, disjoint CPU cores"
