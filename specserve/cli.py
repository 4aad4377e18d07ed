"""``specserve`` command line: ``demo``, ``serve`` (OpenAI HTTP), ``generate`` (batch JSONL), ``draft``, ``plan``, ``config``.

Every configuration flag is generated from the schema (``specserve.config``): one flag per
field, named as in Python (``--draft-num-gpus`` / ``draft_num_gpus=``), with the schema's
default in its help; ``--config FILE`` loads a YAML/JSON file that flags then override.
Argument parsing only; the work lives in ``demo``, ``serve.serve_cli`` and ``LLM``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import typing
from typing import Any, Literal

from pydantic_core import PydanticUndefined

from . import __version__

SECTION_TITLES = {"target": "target model", "draft": "draft model", "speculation": "speculation", "engine": "engine limits",
                  "channel": "draft/target link", "cluster": "Ray cluster and placement", "server": "HTTP server"}


def _dict_arg(value: str) -> dict:
    """JSON ('{"a": 1}') or key=value[,key=value]."""
    value = value.strip()
    if value.startswith("{"):
        try:
            out = json.loads(value)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
        if not isinstance(out, dict):
            raise argparse.ArgumentTypeError("expected a JSON object")
        return out
    out = {}
    for part in filter(None, value.split(",")):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"expected key=value[,key=value] or JSON, got {value!r}")
        k, v = part.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except json.JSONDecodeError:
            out[k.strip()] = v.strip()
    return out


def _bool_or_auto(value: str):
    from .config import bool_or_auto

    parsed = bool_or_auto(value)
    if parsed is None:
        raise argparse.ArgumentTypeError(f"expected true, false or auto, got {value!r}")
    return parsed


def _optional(convert):
    def parse(value: str):
        return None if value.lower() in ("none", "null") else convert(value)
    return parse


def _flag_kwargs(annotation) -> dict:
    """argparse keyword arguments for one schema annotation."""
    args = typing.get_args(annotation)
    origin = typing.get_origin(annotation)
    optional = type(None) in args
    inner = [a for a in args if a is not type(None)] if args else [annotation]
    if origin not in (None, Literal, dict) and not optional and bool in inner:  # bool | Literal["auto"]
        return {"type": _bool_or_auto, "metavar": "{true,false,auto}"}
    base = inner[0] if len(inner) == 1 else annotation
    base_origin = typing.get_origin(base)
    if base is bool:
        return {"action": argparse.BooleanOptionalAction}
    if base_origin is Literal:
        return {"choices": list(typing.get_args(base))}
    if base_origin is dict or base is dict:
        return {"type": _optional(_dict_arg) if optional else _dict_arg, "metavar": "JSON|K=V,.."}
    convert = base if base in (int, float, str) else str
    return {"type": _optional(convert) if optional else convert, "metavar": {int: "N", float: "X", str: "TEXT"}.get(convert)}


def _default_text(info) -> str:
    if info.default is not PydanticUndefined:
        value = info.default
    elif info.default_factory is not None:
        value = info.default_factory()
    else:
        value = None
    if value in ({}, None):
        return "none" if value is None else "{}"
    return str(value).lower() if isinstance(value, bool) else str(value)


def flag_default_text(flat: str, info) -> str:
    """How --help states a flag's default (the model flags are the exceptions)."""
    if flat == "target":
        return "(required; e.g. demo:target)"
    if flat == "draft":
        return "Also 'ngram' (prompt lookup, no model) or 'none'. (default: none: target-only)"
    return f"(default: {_default_text(info)})"


def add_config_flags(parser: argparse.ArgumentParser, include_server: bool = True) -> None:
    from .config import SHARED_SIDE_FIELDS, flat_fields

    parser.add_argument("--config", metavar="FILE", help="YAML or JSON configuration file (flags override it); "
                        "`specserve config` prints one to start from")
    groups: dict[str, Any] = {}
    shared = parser.add_argument_group("both sides")
    for name in SHARED_SIDE_FIELDS:
        from .config import SideConfig

        info = SideConfig.model_fields[name]
        shared.add_argument(f"--{name.replace('_', '-')}", dest=name, default=argparse.SUPPRESS,
                            help=f"{info.description} Sets the target and the draft (default: {_default_text(info)})",
                            **_flag_kwargs(info.annotation))
    for flat, (section, name, info) in flat_fields().items():
        if section == "server" and not include_server:
            continue
        group = groups.setdefault(section, parser.add_argument_group(SECTION_TITLES[section]))
        group.add_argument(f"--{flat.replace('_', '-')}", dest=flat, default=argparse.SUPPRESS,
                           help=f"{info.description} {flag_default_text(flat, info)}", **_flag_kwargs(info.annotation))


def load_config(args: argparse.Namespace, **extra):
    """The configuration from --config plus every flag given on the command line."""
    from .config import SHARED_SIDE_FIELDS, SpecserveConfig, flat_fields

    names = set(flat_fields()) | set(SHARED_SIDE_FIELDS)
    overrides = {k: v for k, v in vars(args).items() if k in names}
    overrides.update(extra)
    return SpecserveConfig.load(getattr(args, "config", None), **overrides)


class _Parser(argparse.ArgumentParser):
    """Usage errors in one line (the full usage of `serve` is long; --help has it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="specserve", description="Speculative decoding with the draft and the target on "
                                     "different machines, lossless. Every flag of serve/generate/config is a field of one "
                                     "configuration schema; `specserve config` prints it.")
    parser.add_argument("--version", action="version", version=f"specserve {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    demo = sub.add_parser("demo", help="a demo pair on a local 2-node Ray cluster, over HTTP; prints text, "
                          "speculation stats and tokens/s against target-only")
    demo.add_argument("--once", action="store_true", help="exit after the demo requests instead of serving")
    demo.add_argument("--pair", default=None, choices=("realistic", "tiny"),
                      help="realistic: a deep target built once from the shipped target (same outputs, the cost of a big target "
                           "beside a small draft) and cached in ~/.cache/specserve; tiny: the shipped pair as is (default: "
                           "realistic; tiny with --draft demo:eagle)")
    demo.add_argument("--draft", default="demo:draft", choices=("demo:draft", "demo:eagle"),
                      help="the demo's draft: the small draft model, or the EAGLE-3 head trained for the tiny target "
                           "(default: demo:draft)")
    demo.add_argument("--host", default="127.0.0.1", help="HTTP host (default: 127.0.0.1)")
    demo.add_argument("--port", type=int, default=8000, help="HTTP port (default: 8000)")
    demo.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="draft tokens per step, the most when adaptive (default: 4)")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens per demo completion (default: 48)")
    demo.add_argument("--json", dest="json_out", default=None, help="also write the demo's measurements to this JSON file")

    serve_p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP endpoint through Ray Serve "
                             "(try: specserve serve --target demo:target --draft demo:draft)")
    add_config_flags(serve_p)

    gen = sub.add_parser("generate", help="batch generation: JSONL prompts in, JSONL outputs out as each finishes; "
                         "resumable, a failed line is an error row")
    gen.add_argument("--input", required=True, help="JSONL ('-': stdin), read as it goes: one {'prompt': str} or "
                     "{'prompt_token_ids': [...]} per line, with optional sampling fields (temperature, max_tokens, stop, seed, ...)")
    gen.add_argument("--output", required=True, help="JSONL, one row per input line as it finishes: {'index': line number from 0, "
                     "'text', 'token_ids', 'finish_reason', 'metrics'} or {'index', 'error'}")
    gen.add_argument("--resume", action="store_true", help="keep the rows --output already has (retrying its error rows) and "
                     "run only the lines it lacks")
    gen.add_argument("--ordered", action="store_true", help="write rows in input order (holding only the rows that wait for "
                     "an earlier one)")
    gen.add_argument("--window", type=int, default=None, help="requests in flight at once (default: twice max_num_seqs; "
                     "with --app 256)")
    gen.add_argument("--max-tokens", type=int, default=64, help="max_tokens for lines that do not set it (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="temperature for lines that do not set it (default: 0, greedy)")
    gen.add_argument("--ray", action="store_true", help="run the target and the draft as Ray actors, placed by label")
    gen.add_argument("--app", default=None, help="use the running specserve Serve app of this name (its handle API) on the "
                     "cluster --address / RAY_ADDRESS names, instead of loading models here")
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    add_config_flags(gen, include_server=False)

    from .draft_cli import add_draft_parser

    add_draft_parser(sub)

    plan = sub.add_parser("plan", help="predict tokens/s before deploying: target-only, colocated and remote drafting at "
                          "batch 1, 8 and 32, the k the controller would run, and which deployment (or draft) to use")
    plan.add_argument("--target", required=True, help="a simulator profile '<model>-<device>' (e.g. qwen3-32b-dgx-spark), or "
                      "with --measure a model (directory or hub id)")
    plan.add_argument("--draft", required=True, action="append", help="the same for the draft; repeat to compare drafts")
    plan.add_argument("--link", default="10gbe", help="link profile between the two machines (default: 10gbe)")
    plan.add_argument("--acceptance", action="append", default=None, help="greedy acceptance per draft position: one "
                      "probability or one per position, comma-separated; repeat once per --draft (default: 0.7; --measure "
                      "measures it)")
    plan.add_argument("--step-overhead-ms", type=float, default=0.0, help="the engine's own work per step beyond the "
                      "forwards and the wait for the draft, on the target's host (scheduling, sampling, output handling), "
                      "which no device profile holds (default: 0)")
    plan.add_argument("--hit", type=float, default=0.9, help="chance the draft foresees a verdict while drafting ahead "
                      "(the speculation cache's hit rate; default: 0.9)")
    plan.add_argument("--batch-sizes", default="1,8,32", help="comma-separated (default: 1,8,32)")
    plan.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="the largest k (default: 4)")
    plan.add_argument("--context", type=int, default=512, help="tokens per sequence the target attends to (default: 512)")
    plan.add_argument("--measure", action="store_true", help="run the real pair briefly on --prompts instead of profiles")
    plan.add_argument("--prompts", default=None, help="with --measure: JSONL of {'prompt': ...} lines (default: a few built in)")
    plan.add_argument("--max-tokens", type=int, default=64, help="tokens per request, over which each request's own costs "
                      "(its prompt's prefill, its first step, which goes without drafts) are spread (default: 64)")
    plan.add_argument("--prompt-tokens", type=int, default=0, help="from profiles: a prompt's length, whose prefill each "
                      "request adds (default: 0, no prefill; --measure reads its prompts)")
    plan.add_argument("--ray", action="store_true", help="with --measure: run the sides as Ray actors placed by label "
                      "(on the cluster --address / RAY_ADDRESS names), as they will be deployed")
    plan.add_argument("--address", default=None, help="with --measure --ray: the Ray cluster to join")

    cfg = sub.add_parser("config", help="print the configuration (defaults, --config file and flags) as YAML")
    add_config_flags(cfg)
    return parser


def _check_output_path(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output {path!r}: the folder {folder!r} does not exist")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"--output {path!r} is not writable")


def cmd_generate(args) -> int:
    """Exit code: 0 when every line got an output; 1-100 the number of error rows (capped);
    130 when stopped by Ctrl-C or SIGTERM (the output is valid: rerun with --resume)."""
    import asyncio
    import signal
    import time

    from tqdm.auto import tqdm

    from .batch import BatchRunner, OutputFile, count_lines, open_input, read_jobs
    from .sampling_params import SamplingParams

    _check_output_path(args.output)
    if args.input != "-" and not os.path.isfile(args.input):
        raise ValueError(f"--input {args.input!r}: no such file")
    if args.app and args.ray:
        raise ValueError("--app and --ray cannot be combined: --app uses a running app's replicas")
    if args.window is not None and args.window < 1:
        raise ValueError(f"--window must be >= 1, got {args.window}")
    defaults = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    SamplingParams(**defaults)  # bad defaults fail here, not on every line
    if args.app:
        from .app_client import connect

        engine, window = connect(args.app, getattr(args, "address", None)), args.window or 256
    else:
        from .llm import LLM
        from .preflight import preflight

        config = load_config(args)
        preflight(config, distributed=args.ray)
        engine, window = LLM(config=config, ray=args.ray), args.window or 2 * config.engine.max_num_seqs
    out = OutputFile(args.output, args.resume, args.ordered)
    total = count_lines(args.input)
    runner = BatchRunner(engine, window)
    started = time.perf_counter()

    async def run():
        loop = asyncio.get_running_loop()

        def on_signal():
            runner.stop()
            print("\nspecserve: stopping: no new requests; waiting for the ones in flight (again to abandon them)",
                  file=sys.stderr)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        with open_input(args.input) as lines, tqdm(total=None if total is None else max(0, total - out.done.count),
                                                   desc="generate", unit="req", disable=args.no_progress) as bar:
            return await runner.run(read_jobs(lines, defaults, out.done), out, bar, threaded=args.input == "-")

    try:
        stats = asyncio.run(run())
    finally:
        out.close()
        if not args.app:
            engine.shutdown()
    elapsed = time.perf_counter() - started
    print(f"wrote {stats.written} rows to {args.output} ({stats.failed} failed, {stats.skipped} already done), "
          f"{stats.tokens} tokens in {elapsed:.1f}s ({stats.tokens / max(elapsed, 1e-9):.0f} tok/s)", file=sys.stderr)
    if stats.stopped:
        print(f"specserve: stopped early{f' ({stats.abandoned} abandoned)' if stats.abandoned else ''}: the output is valid; "
              "rerun with --resume to finish", file=sys.stderr)
        return 130
    return min(stats.failed, 100)


def cmd_plan(args) -> int:
    from . import plan

    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    if any(b < 1 for b in batch_sizes) or args.num_speculative_tokens < 1:
        raise ValueError(f"--batch-sizes and -k must be >= 1, got {args.batch_sizes!r} and {args.num_speculative_tokens}")
    if args.max_tokens < 1 or args.prompt_tokens < 0:
        raise ValueError(f"--max-tokens must be >= 1 and --prompt-tokens >= 0, got {args.max_tokens} and {args.prompt_tokens}")
    acceptances = args.acceptance or ["0.7"]
    if len(acceptances) not in (1, len(args.draft)):
        raise ValueError(f"give --acceptance once, or once per --draft ({len(args.draft)}), not {len(acceptances)} times")
    rows = []
    for i, draft in enumerate(args.draft):
        if args.measure:
            prompts = plan.read_prompts(args.prompts) if args.prompts else list(plan.DEFAULT_PROMPTS)
            kw = dict(ray=True, address=args.address) if args.ray else {}
            got = plan.measure(args.target, draft, prompts, batch_sizes, args.max_tokens,
                               num_speculative_tokens=args.num_speculative_tokens, **kw)
        else:
            acceptance = [float(a) for a in acceptances[i if len(acceptances) > 1 else 0].split(",")]
            got = plan.predict(args.target, draft, args.link, acceptance[0] if len(acceptance) == 1 else acceptance,
                               batch_sizes, args.num_speculative_tokens, args.hit, args.context, args.step_overhead_ms / 1e3,
                               prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
        print(plan.report(got, f"\n{args.target} + draft {draft}" + ("" if args.measure else f" over {args.link}")))
        rows += [{**r, "deployment": r["deployment"] if len(args.draft) == 1 or r["deployment"] == "target-only"
                  else f"{r['deployment']} ({draft})"} for r in got]
    print()
    for line in plan.recommend(rows):
        print(line)
    return 0


def cmd_config(args) -> int:
    import yaml

    print(yaml.safe_dump(load_config(args).model_dump(), sort_keys=False), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()  # (reads defaults, some from the environment: SPECSERVE_DRAFT_COMPILE, ...)
    except ValueError as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "serve":
            from .serve.serve_cli import run_server

            return run_server(load_config(args))
        if args.command == "config":
            return cmd_config(args)
        if args.command == "draft":
            from .draft_cli import run_draft

            return run_draft(args)
        if args.command == "plan":
            return cmd_plan(args)
        return cmd_generate(args)
    except (ValueError, TypeError, FileNotFoundError, ImportError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
