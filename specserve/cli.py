"""``specserve`` command line: ``demo``, ``serve`` (OpenAI HTTP) and ``generate`` (batch JSONL).

Argument parsing only; the work lives in ``demo``, ``serve`` and ``LLM``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


def _label(value: str) -> dict[str, str]:
    out = {}
    for part in value.split(","):
        if "=" not in part:
            raise argparse.ArgumentTypeError(f"labels are key=value[,key=value], got {value!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


def _default_pair() -> tuple[str | None, str | None]:
    from .demo_models import DRAFT_PATH, TARGET_PATH

    if (TARGET_PATH / "config.json").exists() and (DRAFT_PATH / "config.json").exists():
        return str(TARGET_PATH), str(DRAFT_PATH)
    return None, None


def _add_model_args(p: argparse.ArgumentParser) -> None:
    target, draft = _default_pair()
    p.add_argument("--target", default=target, required=target is None, help="target model directory or hub id (default: the shipped demo target)")
    p.add_argument("--draft", default=draft, help="draft model directory/id, 'ngram', or 'none' (default: the shipped demo draft)")
    p.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="draft tokens per verification step (default 4)")
    p.add_argument("--dtype", default="float32", help="target dtype: float32, bfloat16, float16, float64 (default float32)")
    p.add_argument("--draft-dtype", default=None, help="draft dtype (default: --dtype)")
    p.add_argument("--device", default="cpu", help="target device, e.g. cuda (default cpu)")
    p.add_argument("--draft-device", default=None, help="draft device (default: --device)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences verified together per step (default 64)")


def _placement_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", default=None, help="Ray cluster: 'auto' or host:port to join, 'local' to start a fresh one; default: join a running one, else start one")
    p.add_argument("--target-label", type=_label, default=None, help="node labels for the target, e.g. ray.io/accelerator-type=GB10 (default specserve.io/role=target)")
    p.add_argument("--draft-label", type=_label, default=None, help="node labels for the draft, e.g. ray.io/accelerator-type=GeForce-RTX-5090 (default specserve.io/role=draft)")
    p.add_argument("--target-num-gpus", type=float, default=0, help="GPUs for the target's bundle")
    p.add_argument("--draft-num-gpus", type=float, default=0, help="GPUs for the draft's bundle")
    p.add_argument("--channel", choices=["ray", "collective"], default="ray", help="draft/target link (default ray)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative decoding with the draft and target on different machines, lossless.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="local 2-node Ray cluster + HTTP endpoint with the shipped demo pair; prints text and speculation stats")
    demo.add_argument("--once", action="store_true", help="exit after the demo requests instead of serving")
    demo.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1)")
    demo.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    demo.add_argument("-k", "--num-speculative-tokens", type=int, default=4, help="draft tokens per step (default 4)")
    demo.add_argument("--max-tokens", type=int, default=48, help="tokens per demo completion (default 48)")
    demo.add_argument("--target", default=None, help="override the demo target")
    demo.add_argument("--draft", default=None, help="override the demo draft")
    demo.add_argument("--json", dest="json_out", default=None, help="also write the demo's measurements to this JSON file")

    serve_p = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP endpoint through Ray Serve")
    _add_model_args(serve_p)
    _placement_args(serve_p)
    serve_p.add_argument("--host", default="127.0.0.1", help="HTTP host (default 127.0.0.1; 0.0.0.0 to expose)")
    serve_p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    serve_p.add_argument("--api-key", default=None, help="require this bearer key (or set SPECSERVE_API_KEY)")
    serve_p.add_argument("--model-name", default=None, help="model id in /v1/models (default: target folder name)")
    serve_p.add_argument("--max-pending-requests", type=int, default=256, help="beyond this, 429 + Retry-After (default 256)")

    gen = sub.add_parser("generate", help="batch generation: JSONL prompts in, JSONL outputs out (input order)")
    _add_model_args(gen)
    gen.add_argument("--input", required=True, help="JSONL: one {'prompt': str} or {'prompt_token_ids': [...]} per line, optional sampling fields")
    gen.add_argument("--output", required=True, help="JSONL written in input order")
    gen.add_argument("--max-tokens", type=int, default=64, help="default max_tokens per prompt (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="default temperature (default 0: greedy)")
    gen.add_argument("--ray", action="store_true", help="run draft and target as Ray actors (placement by role label)")
    _placement_args(gen)
    gen.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return parser


def _engine_config(args):
    from .config import EngineConfig, SideConfig

    draft = None if args.draft in (None, "none", "") else SideConfig(
        args.draft, dtype=args.draft_dtype or args.dtype, device=args.draft_device or args.device,
        num_gpus=getattr(args, "draft_num_gpus", 0) or 0, label_selector=getattr(args, "draft_label", None) or {})
    target = SideConfig(args.target, dtype=args.dtype, device=args.device, num_gpus=getattr(args, "target_num_gpus", 0) or 0,
                        label_selector=getattr(args, "target_label", None) or {})
    return EngineConfig(target=target, draft=draft, num_speculative_tokens=args.num_speculative_tokens, max_num_seqs=args.max_num_seqs)


def cmd_generate(args) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    prompts, params = [], []
    fields = set(SamplingParams.__dataclass_fields__)
    with open(args.input) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{args.input}:{n}: not valid JSON ({exc})") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("prompt_token_ids" in row):
                raise ValueError(f"{args.input}:{n}: each line needs exactly one of 'prompt' or 'prompt_token_ids'")
            unknown = set(row) - fields - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"{args.input}:{n}: unknown fields {sorted(unknown)}")
            prompts.append(row.get("prompt", row.get("prompt_token_ids")))
            sp = {"max_tokens": args.max_tokens, "temperature": args.temperature}
            sp.update({k: v for k, v in row.items() if k in fields})
            params.append(SamplingParams(**sp))
    placement = None
    if args.ray:
        from .distributed import Placement

        placement = Placement(address=args.address, channel=args.channel)
    llm = LLM.from_config(_engine_config(args), placement)
    try:
        outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    finally:
        llm.shutdown()
    with open(args.output, "w") as f:
        for i, o in enumerate(outs):
            f.write(json.dumps({"index": i, "prompt": o.prompt, "text": o.text, "token_ids": o.token_ids,
                                "finish_reason": o.finish_reason, "metrics": o.metrics.to_dict()}) + "\n")
    drafted = sum(o.metrics.num_draft_tokens for o in outs)
    accepted = sum(o.metrics.num_accepted_tokens for o in outs)
    rate = f"{accepted / drafted:.1%}" if drafted else "n/a"
    print(f"wrote {len(outs)} outputs to {args.output} (acceptance rate {rate})", file=sys.stderr)
    return 0


def cmd_serve(args) -> int:
    from .serve.serve_cli import run_server

    return run_server(args)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "demo":
            from .demo import run_demo

            return run_demo(args)
        if args.command == "serve":
            return cmd_serve(args)
        return cmd_generate(args)
    except (ValueError, TypeError, FileNotFoundError) as exc:
        print(f"specserve: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
