"""The configuration reference (docs/configuration.md), generated from the schema in ``config.py``.

``python -m specserve.docs_config > docs/configuration.md`` rewrites the page; a unit test fails
while the committed page differs from what the schema gives. One table per section: the YAML key,
the CLI flag (the ``LLM(...)`` keyword is the flag's name with underscores), the type, the
default and the field's own description. Defaults are shown as a clean environment gives them
(the descriptions name the environment variables that change them).
"""

from __future__ import annotations

import os
import types
import typing
from contextlib import contextmanager
from typing import Literal

from pydantic_core import PydanticUndefined

COMMAND = "python -m specserve.docs_config > docs/configuration.md"
_ENV_PREFIX = "SPECSERVE_"


@contextmanager
def _clean_environment():
    """Defaults that come from ``SPECSERVE_*`` variables, as they read without them."""
    saved = {k: v for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)}
    for k in saved:
        del os.environ[k]
    try:
        yield
    finally:
        os.environ.update(saved)


def type_text(annotation) -> str:
    """A field's type as a reader writes it: ``int``, ``str | None``, ``true | false | 'auto'``."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(repr(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_text(a) for a in args)
    if origin is dict:
        return "mapping"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def default_text(info) -> str:
    if info.default is not PydanticUndefined:
        value = info.default
    elif info.default_factory is not None:
        with _clean_environment():
            value = info.default_factory()
    else:
        return "(required)"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if value is None:
        return "`null`"
    if value == {}:
        return "`{}`"
    if isinstance(value, str):
        return f"`{value}`" if value else "(required)"
    return f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
    from .config import SHARED_SIDE_FIELDS, SideConfig, SpecserveConfig, flat_fields

    flags = {(section, name): flat for flat, (section, name, _) in flat_fields().items()}
    lines = [
        "# Configuration",
        "",
        "<!-- Generated from specserve/config.py: do not edit here. -->",
        "",
        "This page is generated from the schema's own descriptions. After changing a field, regenerate it:",
        "",
        "<!-- test: config-page -->",
        "```bash",
        COMMAND,
        "```",
        "",
        "Every setting of specserve is one field of one schema, `SpecserveConfig` in `specserve/config.py`.",
        "The same field is a YAML key (nested: `draft.num_gpus`), a command-line flag (`--draft-num-gpus`) and an",
        "`LLM(...)` keyword (`draft_num_gpus=`). `specserve config` prints every field, resolved, as a file to",
        "start from:",
        "",
        "<!-- test: config -->",
        "```bash",
        "specserve config --target demo:target --draft demo:draft > my-config.yaml   # every field, resolved",
        "specserve serve --config my-config.yaml --port 8001                         # flags override the file",
        "```",
        "",
        "In Python the file is `LLM(config=\"my-config.yaml\")`, in a Serve YAML `args: {config: /abs/path/my-config.yaml}`",
        "(`deployments/specserve.yaml` is such a file); flags and keywords override it, and unknown keys are",
        "refused, naming them. Backends and drafters are chosen by name (`target.backend: auto | hf | sim | vllm`,",
        "`draft.drafter: model | ngram`); a backend's own options pass through `backend_options`.",
        "",
        "Shorthands: `target: PATH` and `draft: PATH | ngram | none` in a file set the model alone; the flags",
        f"{', '.join('`--' + n.replace('_', '-') + '`' for n in SHARED_SIDE_FIELDS)} set both sides at once (the draft keeps its own",
        "`draft_*` value when one is given).",
        "",
    ]
    for section, field in SpecserveConfig.model_fields.items():
        model = typing.get_args(field.annotation)[0] if typing.get_origin(field.annotation) else field.annotation
        lines += [f"## `{section}`", "", field.description, ""]
        if section == "draft":
            own = [n for n in model.model_fields if n not in SideConfig.model_fields]
            lines += ["`draft: null` (the default, `--draft none`) decodes target-only. The draft has the target's fields, "
                      f"and {', '.join(f'`{n}`' for n in own)} of its own.", ""]
        lines += ["| key | flag | type | default | description |", "|---|---|---|---|---|"]
        for name, info in model.model_fields.items():
            flag = flags[(section, name)].replace("_", "-")
            flag = f"--[no-]{flag}" if info.annotation is bool else f"--{flag}"  # (argparse's BooleanOptionalAction)
            lines.append(f"| `{section}.{name}` | `{flag}` | {type_text(info.annotation)} | {default_text(info)} | "
                         f"{_cell(info.description or '')} |")
        lines.append("")
    return "\n".join(lines)


def main() -> int:
    print(render(), end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
