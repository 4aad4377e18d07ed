"""A target/draft pair with a realistic cost ratio, built from the shipped demo pair, and its cache.

The shipped demo pair is so small that on a CPU a draft step costs about half a target step,
so speculation cannot pay there. ``build_pair`` deepens the demo target: after each trained
layer come copies of it whose output projections (``o_proj``, ``down_proj``) are scaled by
``+scale`` and ``-scale`` in turn, so every copy costs a full layer of compute while
consecutive pairs nearly cancel (greedy outputs stay the demo target's); the demo draft is
kept as the draft. The target step then costs many draft steps, as a 32B target's does a
1.7B draft's. Nothing here is shipped as weights: ``cached_pair`` builds the pair once, in a
few seconds, into a user cache directory and reuses it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from . import DRAFT_PATH, TARGET_PATH

DEFAULT_LAYERS = 44
DEFAULT_SCALE = 0.02
MARKER = "pair.json"  # written last inside the build folder; a cached pair without it is not used
STALE_BUILD_S = 3600  # a temporary build folder older than this was left by a run that was killed


def build_pair(out: str | Path, num_layers: int = DEFAULT_LAYERS, scale: float = DEFAULT_SCALE) -> tuple[str, str]:
    """Write ``out/target`` (the deepened demo target) and ``out/draft`` (the demo draft), float16 as
    the demo pair, each with the tokenizer; return their paths."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a build takes seconds: its loading and writing bars would only be noise
    try:
        return _build(Path(out), num_layers, scale)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _build(out: Path, num_layers: int, scale: float) -> tuple[str, str]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    base = AutoModelForCausalLM.from_pretrained(TARGET_PATH, dtype=torch.float32)
    num_base = base.config.num_hidden_layers
    if num_layers < num_base or (num_layers - num_base) % (2 * num_base):
        raise ValueError(f"num_layers must be {num_base} + a multiple of {2 * num_base} (pairs of copies per layer), got {num_layers}")
    copies = (num_layers - num_base) // num_base  # after each trained layer
    config = base.config.to_dict()
    config["num_hidden_layers"] = num_layers
    deep = LlamaForCausalLM(type(base.config).from_dict(config))
    old, new = base.state_dict(), {}
    for key, value in old.items():
        if not key.startswith("model.layers."):
            new[key] = value
    for j in range(num_base):
        prefix = f"model.layers.{j}."
        layer = {k[len(prefix):]: v for k, v in old.items() if k.startswith(prefix)}
        for c in range(copies + 1):
            i = j * (copies + 1) + c
            sign = 0.0 if c == 0 else (scale if c % 2 else -scale)  # c = 0: the trained layer itself
            for name, value in layer.items():
                if c and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    value = value * sign
                new[f"model.layers.{i}.{name}"] = value.clone()
    missing, unexpected = deep.load_state_dict(new, strict=False)
    if unexpected or not all("lm_head" in k for k in missing):
        raise RuntimeError(f"deepened target does not match its layout: missing {missing}, unexpected {unexpected}")
    deep.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(TARGET_PATH)
    draft = AutoModelForCausalLM.from_pretrained(DRAFT_PATH, dtype=torch.float32)
    for name, model in (("target", deep), ("draft", draft)):
        path = out / name
        model.to(torch.float16).save_pretrained(path)
        tokenizer.save_pretrained(path)
        GenerationConfig.from_pretrained(TARGET_PATH).save_pretrained(path)
    (out / MARKER).write_text(json.dumps({"num_layers": num_layers, "scale": scale,
                                          "draft_layers": draft.config.num_hidden_layers}, indent=1))
    return str(out / "target"), str(out / "draft")


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/specserve``, or ``~/.cache/specserve``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specserve"


def pair_key(num_layers: int = DEFAULT_LAYERS, scale: float = DEFAULT_SCALE) -> str:
    """A hash of everything the pair is built from: the shipped pair's files, the depth and scale,
    and this module's code (a changed builder builds a new pair)."""
    h = hashlib.sha256(json.dumps({"num_layers": num_layers, "scale": scale}).encode())
    h.update(Path(__file__).read_bytes())
    for folder in (TARGET_PATH, DRAFT_PATH):
        for f in sorted(folder.iterdir()):
            if f.is_file():
                h.update(f.name.encode())
                h.update(f.read_bytes())
    return h.hexdigest()[:16]


def cached_pair(num_layers: int = DEFAULT_LAYERS, scale: float = DEFAULT_SCALE, root: str | Path | None = None,
                say=None) -> tuple[str, str, bool]:
    """``(target, draft, built)``: the pair from the cache, built first when it is not there.

    A pair is built into a temporary folder beside its final one and renamed into place when
    complete, so a run killed mid-build leaves nothing that a later run would use; two runs
    building at once both succeed (the second rename loses and uses the first's pair).
    ``say(str)`` reports a build as it starts.
    """
    root = Path(root) if root is not None else cache_root()
    final = root / f"realistic-pair-{pair_key(num_layers, scale)}"
    if (final / MARKER).is_file():
        return str(final / "target"), str(final / "draft"), False
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_builds(root, final.name)
    if say is not None:
        say(f"building the realistic pair into {final} (once; later runs reuse it)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        build_pair(tmp, num_layers, scale)
        if final.exists() and not (final / MARKER).is_file():
            shutil.rmtree(final, ignore_errors=True)  # an incomplete folder by that name (not made by this code)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone after a successful rename; a failed or lost build's leftovers
    return str(final / "target"), str(final / "draft"), True


def _remove_stale_builds(root: Path, name: str) -> None:
    now = time.time()
    for p in root.glob(f".{name}.*.tmp"):
        try:
            if now - p.stat().st_mtime > STALE_BUILD_S:
                shutil.rmtree(p, ignore_errors=True)
        except OSError:
            pass
