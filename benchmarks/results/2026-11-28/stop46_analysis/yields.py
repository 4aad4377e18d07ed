import time, asyncio, statistics
if __name__ == "__main__":
    import ray
    from benchmarks.bench_cluster import local_cluster, ROLE
    @ray.remote(num_cpus=0.25)
    class A:
        def validate(self, reqs):
            return None
        async def many(self, n, batched):
            out = [{"request_id": f"r{i}", "token_ids": list(range(64)), "text": "x"*200, "metrics": {"a": 1.0}} for i in range(n)]
            if batched:
                yield out
            else:
                for o in out:
                    yield o
    with local_cluster(two_device=True):
        a = A.options(label_selector={ROLE: "target"}).remote()
        ray.get(a.validate.remote([]))
        for name, fn in [("validate", lambda: ray.get(a.validate.remote([([1]*32, {"max_tokens": 64})]*24))),
                         ("stream24", lambda: [ray.get(r) for r in a.many.options(num_returns="streaming").remote(24, False)]),
                         ("stream1x24", lambda: [ray.get(r) for r in a.many.options(num_returns="streaming").remote(24, True)])]:
            ts = []
            for _ in range(30):
                t = time.perf_counter(); fn(); ts.append((time.perf_counter() - t) * 1e3)
            print(name, "median ms", round(statistics.median(ts), 2), "min", round(min(ts), 2))
