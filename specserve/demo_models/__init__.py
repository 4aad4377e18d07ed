"""Paths of the tiny trained Llama target/draft pair (stdlib Python code) shipped for demos and tests."""

from pathlib import Path

TARGET_PATH = Path(__file__).resolve().parent / "target"
DRAFT_PATH = Path(__file__).resolve().parent / "draft"

__all__ = ["TARGET_PATH", "DRAFT_PATH"]
