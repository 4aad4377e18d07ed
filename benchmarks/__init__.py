"""Benchmarks for specserve (run as modules: ``python -m benchmarks.bench_systems``)."""
