"""Model backends behind one small protocol (``base.ModelBackend``); ``build.BACKENDS`` names them."""

from __future__ import annotations

from .base import ModelBackend

__all__ = ["ModelBackend"]
