"""Ray Serve + FastAPI: an OpenAI-compatible HTTP endpoint over Target and Draft deployments.

YAML ``import_path: specserve.serve:build_app``; ``args`` is the configuration
(``specserve.config.SpecserveConfig``), nested, or ``{config: path}`` plus overrides.
"""

from .app import build_app

__all__ = ["build_app"]
