"""Micro-benchmarks for developers of specserve: one component at a time (a draft forward, the stream path,
the batch paths, the draft port under a flood, a GPU step's host time). Run as modules:
``python -m benchmarks.dev.bench_stream_path``."""
