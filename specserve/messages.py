"""Wire messages between the target side and the draft side, msgpack-encoded, no pickle.

One frozen dataclass per message. A draft opens each connection with a ``Challenge``; the
target answers with ``Hello`` (its vocabulary fingerprint, its proof of the shared secret and
a challenge of its own, ``secret.py``) and gets ``HelloReply`` (the draft's fingerprint and
proof, or a refusal). Per step it
sends one ``ProposeRequest`` (sequences to open, verify results since the last request as
KV-cache deltas, sequences to close, and how many draft tokens each wanted sequence should
get) and the draft answers one ``ProposeReply`` (a ``DraftBlock`` per wanted sequence,
plus timing the target's cost model uses). A request with ``tree`` set is also answered, once
the draft has drafted ahead, by a ``DraftTree``: the blocks it holds for the verdicts the
target may reach next, from which the target takes its next blocks without asking. Messages
carry changes, never whole sequences:
a ``VerifyResult`` says "keep the first ``base_len`` tokens, of your drafts
``num_accepted`` survived, append ``token_ids``". How payloads travel (bytes over a socket,
tensors over a collective group) is the channel's business, not these types'.

``encode`` cannot fail for a message whose ints fit 64 bits (the edge validates that);
``decode`` turns every malformed input into ``ProtocolError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import msgpack
import numpy as np
import torch

PROTOCOL_VERSION = 8  # 8: DraftBlock.num_cached; 7: ProposeRequest.acceptance; 6: ProposeRequest.tree, DraftTree; 5: OpenSeq.processing; 4: hidden_states (EAGLE heads); 3: draft_misses, budget_s, Challenge, proofs, refused


MAX_DRAFT_TOKENS = 64  # drafts one block (or one tree branch) may carry


class ProtocolError(ValueError):
    """Bytes that are not a valid specserve message (malformed, unknown type or version)."""


@dataclass(frozen=True)
class Challenge:
    """The draft's first frame on every connection."""

    nonce: str  # answer it in Hello.proof
    required: bool = False  # the draft holds a secret: no proof, no connection


@dataclass(frozen=True)
class Hello:
    target_id: str
    vocab: dict  # models.vocab_fingerprint of the target
    info: dict = field(default_factory=dict)  # where the target runs (placement): the draft decides whether to draft ahead
    proof: str = ""  # secret.prove(token, "target", the draft's challenge); "" without a secret
    challenge: str = ""  # the target's own challenge, answered in HelloReply.proof


@dataclass(frozen=True)
class HelloReply:
    draft_id: str
    vocab: dict | None = None  # the draft's fingerprint (None when it refused)
    error: str | None = None  # why the draft refused the connection
    info: dict = field(default_factory=dict)  # node id, pid, backend: for logs and /health
    proof: str = ""  # secret.prove(token, "draft", Hello.challenge)


@dataclass(frozen=True)
class DraftProcessing:
    """What the target does to its distribution beyond temperature, top-k and top-p (penalties,
    ``logit_bias``, ``allowed_token_ids``, ``bad_words``, ``min_tokens``; not a grammar), for the
    draft to do to its own proposals: only acceptance rests on it, never exactness."""

    prompt_len: int  # where the output starts in the sequence's tokens (penalties, min_tokens)
    bias_token_ids: list[int] = field(default_factory=list)
    bias_values: list[float] = field(default_factory=list)  # [len(bias_token_ids)]
    allowed_token_ids: list[int] | None = None
    bad_words: list[list[int]] = field(default_factory=list)  # as token ids: the last is masked after the rest
    min_tokens: int = 0
    stop_token_ids: list[int] = field(default_factory=list)  # masked while the output is shorter than min_tokens
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0

    @property
    def logit_bias(self) -> list[tuple[int, float]]:  # (as ``SamplingParams.logit_bias``, which ``SeqProcessor`` reads)
        return list(zip(self.bias_token_ids, self.bias_values))

    def __post_init__(self) -> None:
        if len(self.bias_token_ids) != len(self.bias_values):
            raise ValueError(f"{len(self.bias_token_ids)} bias_token_ids but {len(self.bias_values)} bias_values")
        if self.prompt_len < 0 or self.min_tokens < 0 or not self.repetition_penalty > 0:
            raise ValueError("prompt_len and min_tokens must be >= 0 and repetition_penalty > 0")
        if not all(self.bad_words):
            raise ValueError("bad_words must not hold an empty word")


@dataclass(frozen=True)
class OpenSeq:
    request_id: str
    token_ids: list[int]  # [num_tokens]: the whole committed sequence (prompt, or prompt + output on resync)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # always set: the target draws one for requests without a seed
    # [num_rows, width] in the target's dtype, or None: the target's rows for positions
    # len(token_ids) - 1 - num_rows .. len(token_ids) - 2 (what an EAGLE head reads; None for other drafts)
    hidden_states: torch.Tensor | None = None
    seeded: bool = False  # the request's own seed: its draws may not depend on speculation-cache hits
    processing: DraftProcessing | None = None  # None: nothing beyond temperature, top-k and top-p


@dataclass(frozen=True)
class VerifyResult:
    """KV-cache delta for one sequence after one or more verifications."""

    request_id: str
    base_len: int  # committed length the draft's last block was built on
    num_accepted: int  # of that block's drafts kept; the draft's KV is valid up to base_len + num_accepted
    token_ids: list[int]  # [num_appended]: tokens committed after base_len
    # [num_rows, width] in the target's dtype, or None: the target's rows for the committed positions
    # committed_len - 1 - num_rows .. committed_len - 2 (the verify input and the accepted drafts; the last
    # token goes as an id only: the target has not read it yet). An EAGLE head's input; None for other drafts.
    hidden_states: torch.Tensor | None = None

    @property
    def committed_len(self) -> int:
        return self.base_len + len(self.token_ids)

    @property
    def verdict(self) -> tuple[int, int, int] | None:
        """(base_len, num_accepted, the token committed after them): the key a speculation cache's
        branch is drafted for; None when the result spans several verifies (coalesced)."""
        if not self.token_ids or len(self.token_ids) != self.num_accepted + 1:
            return None
        return self.base_len, self.num_accepted, self.token_ids[-1]

    def then(self, later: "VerifyResult") -> "VerifyResult":
        """Coalesce with the next result of the same sequence (the draft drafted nothing in between)."""
        assert later.base_len == self.committed_len and later.num_accepted == 0
        hidden = self.hidden_states
        if later.hidden_states is not None:  # the rows are consecutive positions: they concatenate
            hidden = later.hidden_states if hidden is None else torch.cat([hidden, later.hidden_states])
        return VerifyResult(self.request_id, self.base_len, self.num_accepted, self.token_ids + later.token_ids, hidden)


@dataclass(frozen=True)
class CloseSeq:
    request_id: str


@dataclass(frozen=True)
class ProposeRequest:
    step: int
    opens: list[OpenSeq] = field(default_factory=list)
    results: list[VerifyResult] = field(default_factory=list)
    closes: list[CloseSeq] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)  # sequences that need a block now
    num_draft_tokens: list[int] = field(default_factory=list)  # [len(request_ids)]: k per sequence
    live: list[str] | None = None  # when set: every sequence this target still has here; the draft frees the rest
    draft_misses: bool = True  # false: answer only what the speculation cache holds (possibly nothing), draft nothing now
    budget_s: float = 0.0  # the target's estimate of the time until its next request (verify + link); 0: unknown
    tree: bool = False  # also send a DraftTree once drafting ahead for these sequences stops
    # [<= MAX_DRAFT_TOKENS] the target's per-position acceptance, which the draft sizes its trees by; []: unknown
    acceptance: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.acceptance) > MAX_DRAFT_TOKENS or not all(0.0 <= a <= 1.0 for a in self.acceptance):
            raise ValueError(f"acceptance must hold at most {MAX_DRAFT_TOKENS} probabilities in [0, 1]")
        if len(self.request_ids) != len(self.num_draft_tokens):
            raise ValueError(f"{len(self.request_ids)} request_ids but {len(self.num_draft_tokens)} num_draft_tokens")
        if any(not 0 <= k <= MAX_DRAFT_TOKENS for k in self.num_draft_tokens):
            raise ValueError(f"num_draft_tokens must be in [0, {MAX_DRAFT_TOKENS}]")
        if not 0.0 <= self.budget_s < 3600.0:
            raise ValueError(f"budget_s must be in [0, 3600), got {self.budget_s}")


@dataclass(frozen=True)
class DraftBlock:
    request_id: str
    base_len: int  # committed length the drafts continue
    draft_token_ids: list[int]  # [num_draft_tokens]
    # [num_draft_tokens, vocab] float32, or None: a point mass. numpy from the wire; a torch tensor
    # (possibly on the GPU) when a tensor link carried it beside the message.
    draft_probs: np.ndarray | None = None
    # the first this many drafts came from the speculation cache: what it covered, whether or not the
    # rest was drafted on the critical path (the controller's coverage is measured in both modes)
    num_cached: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_cached <= len(self.draft_token_ids):
            raise ValueError(f"num_cached must be in [0, {len(self.draft_token_ids)}], got {self.num_cached}")

    @property
    def cache_hit(self) -> bool:
        return self.num_cached > 0


@dataclass(frozen=True)
class DraftStats:
    queue_s: float = 0.0  # time the request waited for the draft (drafting ahead yielding, another target's request)
    compute_s: float = 0.0  # draft time spent answering this request (on the critical path)
    forward_s: float = 0.0  # of which model forwards
    num_forwards: int = 0  # draft forwards on the critical path
    hidden_s: float = 0.0  # drafting time the speculation cache took off the critical path
    draft_step_s: float = 0.0  # the draft's running estimate of one batched decode forward


@dataclass(frozen=True)
class ProposeReply:
    step: int
    blocks: list[DraftBlock] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # request ids the draft does not know (resync them)
    stats: DraftStats = field(default_factory=DraftStats)
    refused: list[str] = field(default_factory=list)  # sequences over this connection's limits: no drafts for them


@dataclass(frozen=True)
class SeqTree:
    """One sequence's speculation cache as the draft holds it: branch i is the block the draft would
    answer after a verify of the block built on ``base_len`` that accepts ``accepted[i]`` drafts and
    then commits ``tokens[i]`` (greedy sequences only: a branch carries no probabilities)."""

    request_id: str
    base_len: int
    accepted: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)  # [len(accepted)]
    branches: list[list[int]] = field(default_factory=list)  # [len(accepted)] draft token ids

    def __post_init__(self) -> None:
        if not len(self.accepted) == len(self.tokens) == len(self.branches):
            raise ValueError(f"{len(self.accepted)} accepted, {len(self.tokens)} tokens and {len(self.branches)} branches differ")
        if len(self.branches) > MAX_TREE_BRANCHES or any(len(b) > MAX_DRAFT_TOKENS for b in self.branches):
            raise ValueError(f"a tree holds at most {MAX_TREE_BRANCHES} branches of at most {MAX_DRAFT_TOKENS} drafts")


MAX_TREE_BRANCHES = 1024


@dataclass(frozen=True)
class DraftTree:
    step: int  # the request (``tree`` set) it follows
    trees: list[SeqTree] = field(default_factory=list)
    elapsed_s: float = 0.0  # from the request's arrival to this message leaving (the link's delay emulation)

    def __post_init__(self) -> None:
        if not 0.0 <= self.elapsed_s < 3600.0:
            raise ValueError(f"elapsed_s must be in [0, 3600), got {self.elapsed_s}")


# -- codec ------------------------------------------------------------------------------------
_INT64 = (-(2**63), 2**64 - 1)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and _INT64[0] <= v <= _INT64[1]


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


_CHECKS = {
    "str": lambda v: isinstance(v, str),
    "int": _is_int,
    "float": _is_num,
    "bool": lambda v: isinstance(v, bool),
    "dict": lambda v: isinstance(v, dict),
    "dict | None": lambda v: v is None or isinstance(v, dict),
    "str | None": lambda v: v is None or isinstance(v, str),
    "list[int]": lambda v: isinstance(v, list) and all(_is_int(x) for x in v),
    "list[str]": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "list[float]": lambda v: isinstance(v, list) and all(_is_num(x) for x in v),
    "list[int] | None": lambda v: v is None or (isinstance(v, list) and all(_is_int(x) for x in v)),
    "list[list[int]]": lambda v: isinstance(v, list) and all(isinstance(w, list) and all(_is_int(x) for x in w) for w in v),
    "list[str] | None": lambda v: v is None or (isinstance(v, list) and all(isinstance(x, str) for x in v)),
}
_NESTED = {"opens": OpenSeq, "results": VerifyResult, "closes": CloseSeq, "blocks": DraftBlock, "stats": DraftStats,
           "processing": DraftProcessing, "trees": SeqTree}
_SINGLE = ("stats", "processing")  # one nested message (the others: lists of them); processing may be None
MESSAGE_TYPES = {
    cls.__name__: cls
    for cls in (Challenge, Hello, HelloReply, OpenSeq, VerifyResult, CloseSeq, ProposeRequest, DraftBlock, DraftStats, ProposeReply,
                SeqTree, DraftTree)
}


def _to_wire(msg) -> dict:
    body = {}
    for f in fields(msg):
        value = getattr(msg, f.name)
        if f.name in _NESTED:
            if f.name in _SINGLE:
                value = None if value is None else _to_wire(value)
            else:
                value = [_to_wire(v) for v in value]
        elif isinstance(value, np.ndarray):
            value = {"dtype": value.dtype.str, "shape": list(value.shape), "data": value.tobytes()}
        elif isinstance(value, torch.Tensor):  # hidden states, in their own dtype (bfloat16 has no numpy twin)
            t = value.detach().to("cpu").contiguous()
            value = {"dtype": str(t.dtype).split(".")[-1], "shape": list(t.shape), "data": t.view(torch.uint8).numpy().tobytes()}
        body[f.name] = value
    return body


def _array(value) -> np.ndarray:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise ProtocolError("bad draft_probs: expected a map with dtype, shape and data")
    try:
        dtype = np.dtype(value["dtype"])
        if dtype.kind != "f" or not isinstance(value["data"], bytes):
            raise TypeError("not a float array")
        # A writable copy: torch wraps these rows as they are (it warns on read-only memory).
        return np.frombuffer(bytearray(value["data"]), dtype=dtype).reshape(value["shape"])
    except (TypeError, ValueError) as exc:
        raise ProtocolError(f"bad draft_probs array: {exc}") from None


TENSOR_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


def _tensor(value) -> torch.Tensor:
    if not isinstance(value, dict) or set(value) != {"dtype", "shape", "data"}:
        raise ProtocolError("bad hidden_states: expected a map with dtype, shape and data")
    dtype = TENSOR_DTYPES.get(value["dtype"]) if isinstance(value["dtype"], str) else None
    shape, data = value["shape"], value["data"]
    if dtype is None or not isinstance(data, bytes) or not isinstance(shape, list) or len(shape) != 2 or not all(_is_int(n) and n >= 0 for n in shape):
        raise ProtocolError(f"bad hidden_states: dtype must be one of {sorted(TENSOR_DTYPES)}, shape [rows, width], data bytes")
    if len(data) != shape[0] * shape[1] * torch.empty(0, dtype=dtype).element_size():
        raise ProtocolError(f"bad hidden_states: {len(data)} bytes do not hold a {shape} {value['dtype']} tensor")
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=dtype).reshape(shape)


def _from_wire(cls, body):
    if not isinstance(body, dict):
        raise ProtocolError(f"{cls.__name__} body must be a map, got {type(body).__name__}")
    declared = {f.name: f for f in fields(cls)}
    unknown = [k for k in body if k not in declared]
    if unknown:
        raise ProtocolError(f"{cls.__name__} has unknown fields {sorted(map(str, unknown))}")
    kwargs = {}
    for name, value in body.items():
        kind = declared[name].type
        if name in _NESTED:
            if name in _SINGLE:
                value = None if value is None and name == "processing" else _from_wire(_NESTED[name], value)
            elif isinstance(value, list):
                value = [_from_wire(_NESTED[name], v) for v in value]
            else:
                raise ProtocolError(f"{cls.__name__}.{name} must be a list")
        elif name == "draft_probs":
            value = None if value is None else _array(value)
        elif name == "hidden_states":
            value = None if value is None else _tensor(value)
        elif kind in _CHECKS and not _CHECKS[kind](value):
            raise ProtocolError(f"{cls.__name__}.{name} must be {kind}, got {type(value).__name__}")
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:  # missing fields, or a cross-field check in __post_init__
        raise ProtocolError(f"bad {cls.__name__}: {exc}") from None


def encode(msg) -> bytes:
    name = type(msg).__name__
    if name not in MESSAGE_TYPES:
        raise TypeError(f"not a specserve message: {type(msg)!r}")
    return msgpack.packb({"v": PROTOCOL_VERSION, "type": name, "body": _to_wire(msg)}, use_bin_type=True)


def decode(data: bytes):
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"message must be bytes, got {type(data).__name__}")
    try:
        envelope = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated exception types
        raise ProtocolError(f"malformed message bytes: {type(exc).__name__}") from None
    if not isinstance(envelope, dict) or set(envelope) != {"v", "type", "body"}:
        raise ProtocolError("malformed message: expected a map with exactly 'v', 'type' and 'body'")
    if envelope["v"] != PROTOCOL_VERSION or isinstance(envelope["v"], bool):
        raise ProtocolError(f"unsupported protocol version {envelope['v']!r} (this side speaks {PROTOCOL_VERSION})")
    cls = MESSAGE_TYPES.get(envelope["type"]) if isinstance(envelope["type"], str) else None
    if cls is None:
        raise ProtocolError(f"unknown message type {envelope['type']!r}")
    return _from_wire(cls, envelope["body"])
