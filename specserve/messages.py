"""Wire messages between the target side and the draft side, msgpack-encoded, no pickle.

One frozen dataclass per message. Per step the target sends one ``ProposeRequest``
(sequences to open, verify results since the last step as KV-cache deltas, sequences to
close) and the draft answers one ``ProposeReply`` (a ``DraftBlock`` per live sequence).
Messages carry changes, never whole sequences: a ``VerifyResult`` says "keep the first
``base_len`` tokens, of your drafts ``num_accepted`` survived, append ``token_ids``".
Every payload carries ``PROTOCOL_VERSION``; bad bytes raise ``ProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack
import numpy as np

PROTOCOL_VERSION = 1


class ProtocolError(ValueError):
    """Bytes that are not a valid specserve message (malformed, unknown type or version)."""


@dataclass(frozen=True)
class OpenSeq:
    request_id: str
    token_ids: list[int]  # [num_tokens]: the whole committed sequence (prompt, or prompt + output on resync)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None


@dataclass(frozen=True)
class VerifyResult:
    """KV-cache delta for one sequence after one verification."""

    request_id: str
    step: int
    base_len: int  # committed length the draft block was built on
    num_accepted: int  # draft tokens kept; stale KV starts at base_len + num_accepted
    token_ids: list[int]  # [num_appended]: tokens appended after base_len (accepted + recovered/bonus)

    @property
    def rollback_to(self) -> int:
        return self.base_len + self.num_accepted

    @property
    def committed_len(self) -> int:
        return self.base_len + len(self.token_ids)


@dataclass(frozen=True)
class CloseSeq:
    request_id: str
    reason: str = "finished"  # finished | aborted


@dataclass(frozen=True)
class DraftBlock:
    request_id: str
    step: int
    base_len: int  # committed length the drafts continue
    draft_token_ids: list[int]  # [k]
    draft_probs: np.ndarray | None = None  # [k, vocab] float32, or None: point mass (greedy / n-gram)


@dataclass(frozen=True)
class ProposeRequest:
    step: int
    num_speculative_tokens: int
    opens: list[OpenSeq] = field(default_factory=list)
    results: list[VerifyResult] = field(default_factory=list)
    closes: list[CloseSeq] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # sequences that need a block this step


@dataclass(frozen=True)
class ProposeReply:
    step: int
    blocks: list[DraftBlock] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # request ids the draft does not know (resync them)
    # Collective channel only: rows of draft_probs per block sent as one tensor outside this message.
    tensor_rows: list[int] = field(default_factory=list)


MESSAGE_TYPES = {cls.__name__: cls for cls in (OpenSeq, VerifyResult, CloseSeq, DraftBlock, ProposeRequest, ProposeReply)}
_NESTED = {"opens": OpenSeq, "results": VerifyResult, "closes": CloseSeq, "blocks": DraftBlock}


def _to_wire(msg) -> dict:
    body = {}
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name in _NESTED:
            value = [_to_wire(v) for v in value]
        elif isinstance(value, np.ndarray):
            value = {"dtype": value.dtype.str, "shape": list(value.shape), "data": value.tobytes()}
        body[f.name] = value
    return body


def _from_wire(cls, body: dict):
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__} body must be a map, got {type(body).__name__}")
    names = {f.name for f in fields(cls)}
    unknown = set(body) - names
    if unknown:
        raise ProtocolError(f"{cls.__name__} has unknown fields {sorted(unknown)}")
    kwargs = {}
    for name, value in body.items():
        if name in _NESTED:
            value = [_from_wire(_NESTED[name], v) for v in value]
        elif name == "draft_probs" and value is not None:
            try:
                value = np.frombuffer(value["data"], dtype=np.dtype(value["dtype"])).reshape(value["shape"])
            except (KeyError, TypeError, ValueError) as exc:
                raise ProtocolError(f"bad draft_probs array: {exc}") from None
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from None


def encode(msg) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGE_TYPES:
        raise TypeError(f"not a specserve message: {type(msg)!r}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": name, "body": _to_wire(msg)}, use_bin_type=True)


def decode(data: bytes):
    try:
        envelope = msgpack.unpackb(data, raw=False)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"malformed message bytes: {exc}") from None
    if not isinstance(envelope, dict) or not {"v", "type", "body"} <= set(envelope):
        raise ProtocolError("malformed message: expected a map with 'v', 'type' and 'body'")
    if envelope["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {envelope['v']!r} (this side speaks {PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES.get(envelope["type"])
    if cls is None:
        raise ProtocolError(f"unknown message type {envelope['type']!r}")
    return _from_wire(cls, envelope["body"])
