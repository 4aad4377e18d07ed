"""Ray Serve + FastAPI: an OpenAI-compatible HTTP endpoint over the draft/target actors.

YAML ``import_path: specserve.serve:build_app``; ``args`` follow ``ServeArgs``.
"""

from .app import build_app
from .protocol import ServeArgs

__all__ = ["build_app", "ServeArgs"]
