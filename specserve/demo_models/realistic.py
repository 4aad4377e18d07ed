"""A target/draft pair with a realistic cost ratio, built from the shipped demo pair, and its cache.

The shipped demo pair is so small that on a CPU a draft step costs about half a target step,
so speculation cannot pay there. ``build_pair`` deepens the demo target: after each trained
layer come copies of it whose output projections (``o_proj``, ``down_proj``) are scaled by
``+scale`` and ``-scale`` in turn, so every copy costs a full layer of compute while
consecutive pairs nearly cancel (greedy outputs stay the demo target's); the demo draft is
kept as the draft. The target step then costs many draft steps, as a 32B target's does a
1.7B draft's. Nothing here is shipped as weights: ``cached_pair`` builds the pair once, in
about a second, into a user cache directory and reuses it.
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
    """Write ``out/target`` (the deepened demo target) and ``out/draft`` (a copy of the demo draft),
    each a transformers model folder with the tokenizer; return their paths.

    Works on the weights file directly (safetensors and numpy, no model is built), so a build
    takes about a second; float16 like the demo pair, each scaled copy computed in float32.
    """
    import numpy as np
    from safetensors.numpy import load_file, save_file

    out = Path(out)
    config = json.loads((TARGET_PATH / "config.json").read_text())
    num_base = config["num_hidden_layers"]
    if num_layers < num_base or (num_layers - num_base) % (2 * num_base):
        raise ValueError(f"num_layers must be {num_base} + a multiple of {2 * num_base} (pairs of copies per layer), got {num_layers}")
    copies = (num_layers - num_base) // num_base  # after each trained layer
    old = load_file(TARGET_PATH / "model.safetensors")
    new = {key: value for key, value in old.items() if not key.startswith("model.layers.")}
    for j in range(num_base):
        prefix = f"model.layers.{j}."
        layer = {k[len(prefix):]: v for k, v in old.items() if k.startswith(prefix)}
        for c in range(copies + 1):
            i = j * (copies + 1) + c
            sign = scale if c % 2 else -scale  # c = 0: the trained layer itself, as it is
            for name, value in layer.items():
                if c and name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
                    value = (value.astype(np.float32) * np.float32(sign)).astype(value.dtype)
                new[f"model.layers.{i}.{name}"] = value
    target = out / "target"
    target.mkdir(parents=True)
    save_file(new, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text(json.dumps({**config, "num_hidden_layers": num_layers}, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copyfile(TARGET_PATH / name, target / name)
    shutil.copytree(DRAFT_PATH, out / "draft", ignore=shutil.ignore_patterns("README.md"))
    draft_layers = json.loads((DRAFT_PATH / "config.json").read_text())["num_hidden_layers"]
    (out / MARKER).write_text(json.dumps({"num_layers": num_layers, "scale": scale, "draft_layers": draft_layers}, indent=1))
    return str(target), str(out / "draft")


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
