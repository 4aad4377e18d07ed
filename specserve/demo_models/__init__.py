"""Paths of the tiny trained Llama target/draft pair (stdlib Python code) and the EAGLE-3 head trained for the target."""

from pathlib import Path

TARGET_PATH = Path(__file__).resolve().parent / "target"
DRAFT_PATH = Path(__file__).resolve().parent / "draft"
EAGLE_PATH = Path(__file__).resolve().parent / "eagle"

__all__ = ["TARGET_PATH", "DRAFT_PATH", "EAGLE_PATH"]
