"""``specserve draft``: one draft side on this machine, served over TCP to any target.

Data flow: the configuration's ``draft`` section (model, backend: transformers or vLLM,
dtype, device, tensor parallelism) -> ``build_draft_service`` -> ``DraftServer`` on
``--draft-port``. Targets connect to the printed address: specserve's own
(``SPECSERVE_DRAFT_ADDRESS`` is read by ``specserve.vllm.RemoteDraftProposer``, so
``vllm serve`` with that proposer works too). Targets must prove the shared secret
(``--draft-token`` / ``--draft-token-file`` / ``SPECSERVE_DRAFT_TOKEN``, ``secret.py``); on an
address other hosts can reach it refuses to start without one unless ``--insecure``. Runs until
Ctrl-C; no Ray involved.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import sys
import time

PROPOSER_CONFIG = {"method": "custom_class", "model": "specserve.vllm.RemoteDraftProposer"}


def add_draft_parser(sub) -> None:
    from .cli import add_config_flags

    p = sub.add_parser("draft", help="serve a draft model (or ngram) over TCP for targets on other machines, e.g. "
                       "`vllm serve` with specserve.vllm.RemoteDraftProposer (try: specserve draft --draft demo:draft)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    p.add_argument("--insecure", action="store_true",
                   help="listen on a non-loopback address without a draft token (anyone who reaches the port can use the draft)")
    p.add_argument("--advertise-host", default=None, help="host name or IP targets should use (default: this host's address)")
    add_config_flags(p, include_server=False)


def run_draft(args: argparse.Namespace) -> int:
    from .build import build_draft_service
    from .cli import load_config
    from .secret import TOKEN_ENV, resolve_token
    from .transport import DraftServer

    if "draft" not in vars(args) and not getattr(args, "config", None):
        raise ValueError("specserve draft needs --draft MODEL (a model directory, hub id, demo:draft, or ngram)")
    extra = {} if "target" in vars(args) else {"target": "(unused: a draft side never reads the target)"}
    cfg = load_config(args, **extra)
    if cfg.draft is None:
        raise ValueError("specserve draft needs --draft MODEL (a model directory, hub id, demo:draft, or ngram)")
    from .eagle import head_spec

    head = cfg.draft.drafter == "model" and cfg.draft.backend == "hf" and head_spec(cfg.draft.model) is not None
    if head and "target" not in vars(args):
        raise ValueError(f"--draft {cfg.draft.model!r} is a draft head: pass --target TARGET too (the head reads the "
                         "target's tokenizer and the weights it shares with it, never the whole model)")
    ch = cfg.channel
    token = resolve_token(ch.draft_token, ch.draft_token_file)
    loopback = args.host in ("localhost", "::1") or args.host.startswith("127.")
    if token is None and not loopback and not args.insecure:
        raise ValueError(f"refusing to listen on {args.host} without a draft token: pass --draft-token-file FILE (or "
                         f"--draft-token, or set {TOKEN_ENV}), listen on --host 127.0.0.1, or accept anyone with --insecure")
    name = f"draft-{socket.gethostname()}-{os.getpid()}"
    service = build_draft_service(cfg, name, {"host": socket.gethostname()}, own_process=True)
    server = DraftServer(service, host=args.host, port=ch.draft_port, advertise_host=args.advertise_host, token=token,
                         max_frame_bytes=int(ch.max_frame_mb * 2**20))
    k = cfg.speculation.num_speculative_tokens
    print(f"draft {cfg.draft.model or cfg.draft.drafter} ({cfg.draft.backend}) serving at {server.address}", flush=True)
    secret = "" if token is None else (f"{TOKEN_ENV}=$(cat {ch.draft_token_file}) " if ch.draft_token_file
                                       else f"{TOKEN_ENV}=<the same token> ")
    if token is None:
        print("no draft token: any host that reaches this port can use the draft (--insecure or loopback)", flush=True)
    # A head's layers must be set up before vLLM loads the target: the proposer learns the head from SPECSERVE_HEAD.
    head_env = f"SPECSERVE_HEAD={cfg.draft.model} " if head else ""
    print("on the target machine:\n"
          f"  {secret}{head_env}SPECSERVE_DRAFT_ADDRESS={server.address} vllm serve {cfg.target.model if head else 'TARGET'} "
          f"--speculative-config '{json.dumps({**PROPOSER_CONFIG, 'num_speculative_tokens': k})}'", flush=True)
    signal.signal(signal.SIGTERM, lambda signum, frame: (_ for _ in ()).throw(KeyboardInterrupt()))
    try:
        while server._thread.is_alive():
            time.sleep(1.0)
        print("specserve: error: the draft server stopped", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.close()
