"""A Ray Data batch job against a running specserve app, through Ray Data's own LLM processor.

Start an app first (it keeps serving HTTP while the job runs), e.g. ``specserve serve --target
demo:target --draft demo:draft`` or ``serve run deployments/single_node.yaml``, then:

    python examples/ray_data_batch.py --output out_dir             # a few demo prompts
    python examples/ray_data_batch.py --input prompts.jsonl --output out_dir

Each row goes to the app's ``Router.completions`` (the same request model, validation and
limits as ``POST /v1/completions``) via ``ServeDeploymentProcessorConfig`` + ``build_processor``;
the outputs land in ``out_dir`` as JSON lines with the text and the token ids, or the row's
``__inference_error__`` (one bad row does not stop the job).
"""

from __future__ import annotations

import argparse

DEMO_PROMPTS = ["def add(a, b):\n", "class Stack:\n", "import os\n", "def fibonacci(n):\n"] * 8


def build(app: str, model: str, max_tokens: int, temperature: float, batch_size: int = 16):
    """The processor: rows with a ``prompt`` column in; ``text``, ``token_ids`` and ``__inference_error__`` out."""
    from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

    from specserve.serve.protocol import CompletionRequest

    def preprocess(row: dict) -> dict:
        prompt = row["prompt"]  # text, or token ids (Ray Data hands a list column over as an array)
        prompt = prompt if isinstance(prompt, str) else [int(t) for t in prompt]
        return dict(method="completions", dtype="CompletionRequest",  # built from these fields by Ray Data
                    request_kwargs=dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                        return_token_ids=True))

    def postprocess(row: dict) -> dict:  # success rows only: Ray Data passes error rows on as they are
        choice = row["choices"][0]
        return dict(text=choice["text"], token_ids=list(choice["token_ids"]))

    config = ServeDeploymentProcessorConfig(deployment_name="Router", app_name=app, dtype_mapping={"CompletionRequest": CompletionRequest},
                                            batch_size=batch_size,
                                            concurrency=1, should_continue_on_error=True)
    return build_processor(config, preprocess=preprocess, postprocess=postprocess)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--app", default="specserve", help="the Serve app's name [specserve]")
    parser.add_argument("--address", default="auto", help="the Ray cluster [auto: the one on this machine / RAY_ADDRESS]")
    parser.add_argument("--input", default=None, help="JSONL with a 'prompt' per line (default: a few demo prompts)")
    parser.add_argument("--output", required=True, help="folder for the output JSON lines")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args(argv)

    import ray

    import specserve

    ray.init(address=args.address, log_to_driver=False)
    model = specserve.connect(args.app).model  # the app's model id (a bad app name lists the apps there)
    ds = ray.data.read_json(args.input) if args.input else ray.data.from_items([{"prompt": p} for p in DEMO_PROMPTS])
    out = build(args.app, model, args.max_tokens, args.temperature)(ds)
    out.write_json(args.output)
    rows = ray.data.read_json(args.output).take_all()
    failed = sum(1 for r in rows if r.get("__inference_error__"))
    print(f"wrote {len(rows)} rows to {args.output} ({failed} failed)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
