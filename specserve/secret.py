"""The draft channel's shared secret: where it comes from, and the challenge-response that proves it.

A target proves it holds the secret before a draft accepts anything from it: the draft sends a
fresh random challenge when it accepts a connection, the target answers HMAC-SHA256(secret,
"target" + challenge) in its ``Hello`` together with a challenge of its own, which the draft
answers in its ``HelloReply`` (HMAC over "draft" + that challenge), so each side knows the other
holds the secret. The secret never crosses the wire, a proof is good for one connection only,
and every comparison is constant-time. Knows nothing of sockets.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
from pathlib import Path

TOKEN_ENV = "SPECSERVE_DRAFT_TOKEN"


def new_token() -> str:
    """A fresh secret (256 random bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def new_challenge() -> str:
    return secrets.token_hex(16)


def resolve_token(token: str | None = None, token_file: str | None = None) -> str | None:
    """The secret: given directly, else read from a file, else ``$SPECSERVE_DRAFT_TOKEN``; None if none is set."""
    if token:
        return token
    if token_file:
        path = Path(token_file).expanduser()
        if not path.is_file():
            raise ValueError(f"draft_token_file {token_file!r} does not exist")
        text = path.read_text().strip()
        if not text:
            raise ValueError(f"draft_token_file {token_file!r} is empty")
        return text
    return os.environ.get(TOKEN_ENV) or None


def prove(token: str | None, role: str, challenge: str) -> str:
    """The proof that ``role`` ("target" or "draft") holds ``token``, for this challenge ("" without a token)."""
    if not token:
        return ""
    return hmac.new(token.encode(), f"{role}:{challenge}".encode(), hashlib.sha256).hexdigest()


def verify(token: str | None, role: str, challenge: str, proof: str) -> bool:
    """Whether ``proof`` shows ``role`` holds ``token`` (always true when no token is required)."""
    if not token:
        return True
    return isinstance(proof, str) and hmac.compare_digest(prove(token, role, challenge), proof)
