"""``specserve serve``: join (or start) Ray, deploy the router app, serve until Ctrl-C."""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("specserve")


def run_server(args) -> int:
    from ray import serve

    from ..distributed.placement import Placement, connect
    from .app import build_app

    connect(Placement(address=args.address))
    serve_args = {
        "target": args.target, "draft": None if args.draft in (None, "none", "") else args.draft,
        "num_speculative_tokens": args.num_speculative_tokens, "dtype": args.dtype, "draft_dtype": args.draft_dtype,
        "device": args.device, "draft_device": args.draft_device, "max_num_seqs": args.max_num_seqs,
        "target_label": args.target_label, "draft_label": args.draft_label, "target_num_gpus": args.target_num_gpus,
        "draft_num_gpus": args.draft_num_gpus, "channel": args.channel, "api_key": args.api_key,
        "model_name": args.model_name, "max_pending_requests": args.max_pending_requests,
    }
    serve.start(http_options={"host": args.host, "port": args.port})
    print(f"loading target {args.target} and draft {serve_args['draft']} ...", flush=True)
    serve.run(build_app(serve_args), name="specserve", route_prefix="/")
    print(f"specserve is serving at http://{args.host}:{args.port}/v1 (Ctrl-C to stop)", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        serve.shutdown()
    return 0
