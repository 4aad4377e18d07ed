"""Smoke test of benchmarks/bench_speculative.py: ``--quick --mode local`` on tiny random models.

Checks what the run writes (tables, plot, JSON fields), never timing values.
"""

from __future__ import annotations

import json

import torch

from benchmarks.bench_speculative import main

from ..conftest import make_model


def test_quick_local_run_writes_tables_plot_and_json(tmp_path, capsys):
    torch.set_num_threads(1)
    target = make_model(tmp_path / "target", seed=0)
    make_model(tmp_path / "draft", seed=1, noise_from=target, noise=0.3)  # perturbed: accepts some, not all
    out = tmp_path / "out"
    main(["--quick", "--mode", "local", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
          "--batch-sizes", "1,2", "--ks", "0,2", "--dtype", "float64", "--out", str(out)])

    data = json.loads((out / "results.json").read_text())
    assert "ray" not in data
    assert len(data["meta"]["prompt_sources"]) == 2 and data["meta"]["torch_threads"] == 1
    runs = data["local"]["runs"]
    assert [(r["batch_size"], r["k"]) for r in runs] == [(1, 0), (1, 2), (2, 0), (2, 2)]
    for r in runs:
        assert r["num_tokens"] == 2 * 8  # 2 prompts x 8 tokens (ignore_eos)
        assert len(r["tokens_per_s"]) == 1 and r["median_tokens_per_s"] > 0 and r["speedup"] > 0
        assert r["greedy_equals_target_only"] is True
        assert "token_ids" not in r
        if r["k"] == 0:
            assert r["speedup"] == 1.0 and r["num_draft_tokens"] == 0
        else:
            assert r["num_draft_tokens"] > 0 and 0.0 <= r["acceptance_rate"] <= 1.0
            assert 1.0 <= r["mean_acceptance_length"] <= r["k"] + 1
    assert [d["batch_size"] for d in data["local"]["draft_decode"]] == [1, 2]

    tables = (out / "tables.md").read_text()
    assert "| batch | k | tokens/s | spread | speedup | acceptance rate | mean acceptance length |" in tables
    assert "RTT < time saved per step" in tables
    assert tables.splitlines()[0] in capsys.readouterr().out  # also printed
    assert (out / "speedup_vs_k.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "speedup_vs_delay.png").exists()

    main(["--from-json", str(out / "results.json"), "--out", str(tmp_path / "redrawn")])  # measures nothing
    assert (tmp_path / "redrawn" / "tables.md").read_text() == tables
