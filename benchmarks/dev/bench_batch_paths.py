"""One specserve app, three ways in at the same concurrency: Ray Data's processor, the handle client, HTTP.

Starts a local Ray cluster and the demo pair as a Serve app, then runs the same greedy prompts
through (1) ``build_processor(ServeDeploymentProcessorConfig(...))`` (Ray Data's LLM
processor, ``batch_size`` = the concurrency), (2) ``specserve.connect(...).generate`` with
``max_in_flight`` = the concurrency and (3) the ``openai`` client over HTTP with that many
requests in flight, in turn, ``--repeats`` rounds; prints medians of tokens/s and the ratios,
and checks that every path returned the same tokens.

    python -m benchmarks.dev.bench_batch_paths [--prompts 256] [--concurrency 16] [--max-tokens 16]
"""

from __future__ import annotations

import asyncio
import statistics
import time

from benchmarks.cli import parser


def main(argv=None) -> int:
    p = parser("benchmarks.dev.bench_batch_paths", __doc__)
    p.add_argument("--prompts", type=int, default=256, help="prompts per path and round")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight on every path")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per prompt")
    p.add_argument("--repeats", type=int, default=3, help="rounds, every path once a round")
    p.add_argument("--port", type=int, default=8123, help="Serve's HTTP port")
    args = p.parse_args(argv)

    import openai
    import ray
    from ray import serve
    from ray.data.llm import ServeDeploymentProcessorConfig, build_processor

    import specserve
    from specserve import SamplingParams
    from specserve.serve import build_app

    ray.init(num_cpus=8, log_to_driver=False, include_dashboard=False)  # logical CPUs: Ray Data needs one for its actor
    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config={"log_level": "WARNING"})
    serve.run(build_app({"target": {"model": "demo:target", "backend": "hf", "num_cpus": 0.5}, "draft": {"model": "demo:draft", "num_cpus": 0.5},
                         "server": {"max_pending_requests": 4 * args.concurrency}}), name="bench", route_prefix="/")
    client = specserve.connect("bench")
    prompts = [[3 + i % 97, 20 + i % 13, 40 + i % 29, 11] for i in range(args.prompts)]
    n = args.max_tokens
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)

    def via_ray_data():
        config = ServeDeploymentProcessorConfig(deployment_name="Router", app_name="bench", dtype_mapping={},
                                                batch_size=args.concurrency, concurrency=1)
        processor = build_processor(config, preprocess=lambda row: dict(method="completions", dtype=None, request_kwargs=dict(
            model=client.model, prompt=[int(t) for t in row["prompt"]], max_tokens=n, temperature=0, ignore_eos=True,
            return_token_ids=True)), postprocess=lambda row: dict(i=row["i"], token_ids=list(row["choices"][0]["token_ids"])))
        rows = processor(ray.data.from_items([{"i": i, "prompt": p} for i, p in enumerate(prompts)])).take_all()
        return [list(r["token_ids"]) for r in sorted(rows, key=lambda r: r["i"])]

    def via_handle():
        return [o.token_ids for o in client.generate(prompts, params, use_tqdm=False, max_in_flight=args.concurrency)]

    def via_http():
        http = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="none", max_retries=0, timeout=600)
        slots = asyncio.Semaphore(args.concurrency)

        async def one(p):
            async with slots:
                r = await http.completions.create(model=client.model, prompt=p, max_tokens=n, temperature=0,
                                                  extra_body={"ignore_eos": True, "return_token_ids": True})
                return r.choices[0].model_extra["token_ids"]

        async def run():
            return await asyncio.gather(*[one(p) for p in prompts])

        return asyncio.run(run())

    paths = {"ray data processor": via_ray_data, "specserve.connect": via_handle, "http (openai client)": via_http}
    for fn in paths.values():  # warm-up (Ray Data starts its actors; the app warms its buckets)
        fn()
    rates, outputs = {name: [] for name in paths}, {}
    for _ in range(args.repeats):
        for name, fn in paths.items():
            start = time.perf_counter()
            outputs[name] = fn()
            rates[name].append(len(prompts) * n / (time.perf_counter() - start))
            print(f"{name:22s} {rates[name][-1]:8.1f} tok/s", flush=True)
    http = statistics.median(rates["http (openai client)"])
    same = len({repr(v) for v in outputs.values()}) == 1
    print(f"\n{args.prompts} prompts x {n} tokens, {args.concurrency} in flight, demo pair, medians of {args.repeats}; "
          f"all paths the same tokens: {same}\n\n| path | tok/s | vs HTTP |\n|---|---:|---:|")
    for name in paths:
        print(f"| {name} | {statistics.median(rates[name]):.1f} | {statistics.median(rates[name]) / http:.2f}x |")
    serve.shutdown()
    ray.shutdown()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
