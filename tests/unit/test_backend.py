"""The slot KV cache: batched appends and per-sequence rollback match a full forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specserve.backends.hf import HFBackend

from ..conftest import make_model


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_slot_cache_matches_full_forward(tmp_path, arch):
    make_model(tmp_path / "m", arch=arch)
    backend = HFBackend(str(tmp_path / "m"), dtype="float64")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float64).eval()

    def full(tokens):
        with torch.no_grad():
            return ref(torch.tensor([tokens])).logits[0]

    seqs = {"a": [1, 2, 3, 4, 5], "b": [7, 8], "c": list(range(9, 16))}
    for s in seqs:
        backend.add(s)
    logits = backend.forward(list(seqs), list(seqs.values()), [1, 2, 1])
    assert torch.allclose(logits[1, -2:], full(seqs["b"])[-2:], atol=1e-9)
    for i, s in enumerate(seqs):
        assert torch.allclose(logits[i, -1], full(seqs[s])[-1], atol=1e-9)
    # Roll "a" back by position, free "b" (its row is reused), extend others by different widths.
    backend.truncate("a", 3)
    seqs["a"] = seqs["a"][:3] + [20, 21]
    backend.free("b")
    del seqs["b"]
    backend.add("d")
    seqs["c"] += [30]
    seqs["d"] = [5, 6, 7]
    logits = backend.forward(["d", "c", "a"], [[5, 6, 7], [30], [20, 21]], [3, 1, 2])
    assert torch.allclose(logits[0], full(seqs["d"]), atol=1e-9)
    assert torch.allclose(logits[1, -1], full(seqs["c"])[-1], atol=1e-9)
    assert torch.allclose(logits[2, -2:], full(seqs["a"])[-2:], atol=1e-9)
    assert backend.num_cached("a") == 5 and backend.num_cached("c") == 8


def test_pool_grows_past_initial_capacity(tmp_path):
    make_model(tmp_path / "m", max_positions=1024)
    backend = HFBackend(str(tmp_path / "m"), dtype="float64")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float64).eval()
    ids = [f"s{i}" for i in range(12)]  # more rows than the initial pool
    tokens = {s: [(7 * i + j) % 60 for j in range(300 + i)] for i, s in enumerate(ids)}
    for s in ids:
        backend.add(s)
    logits = backend.forward(ids, [tokens[s] for s in ids], [1] * len(ids))
    with torch.no_grad():
        for i, s in enumerate(ids):
            assert torch.allclose(logits[i, -1], ref(torch.tensor([tokens[s]])).logits[0, -1], atol=1e-9)


def test_context_overflow_is_a_value_error(tmp_path):
    make_model(tmp_path / "m", max_positions=16)
    backend = HFBackend(str(tmp_path / "m"))
    backend.add("x")
    with pytest.raises(ValueError, match="over max_model_len=16"):
        backend.forward(["x"], [list(range(17))], [1])


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gpt_neox"])
def test_branch_trees_match_full_forwards(tmp_path, arch):
    """Each lane of a branch tree sees its own prefix and path only, and commits nothing."""
    make_model(tmp_path / "m", arch=arch, seed=1)
    backend = HFBackend(str(tmp_path / "m"), dtype="float64")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float64).eval()
    ctx = [5, 6, 7, 8, 9, 10]
    backend.add("a")
    backend.add("b")
    backend.forward(["a", "b"], [ctx, ctx[:3]], [1, 1])
    lens = {"a": [4, 6, 2], "b": [3, 1]}  # each branch continues this many cached tokens
    roots = {"a": [20, 21, 22], "b": [30, 31]}
    base = {"a": ctx, "b": ctx[:3]}
    paths = {(s, i): base[s][: lens[s][i]] + [roots[s][i]] for s in "ab" for i in range(len(roots[s]))}
    tokens = [roots["a"], roots["b"]]
    for depth in range(3):
        out = backend.forward_branches(["a", "b"], tokens, [lens["a"], lens["b"]], depth, num_lanes=4)
        nxt = []
        for row, s in enumerate("ab"):
            picked = []
            for lane in range(len(tokens[row])):
                with torch.no_grad():
                    expect = ref(torch.tensor([paths[(s, lane)]])).logits[0, -1]
                assert torch.allclose(out[row, lane], expect, atol=1e-9), (arch, depth, s, lane)
                picked.append(int(expect.argmax()))
                paths[(s, lane)] = paths[(s, lane)] + [picked[-1]]
            nxt.append(picked)
        tokens = nxt
    assert backend.num_cached("a") == 6 and backend.num_cached("b") == 3
    logits = backend.forward(["a"], [[11]], [1])  # the committed sequence is untouched
    with torch.no_grad():
        assert torch.allclose(logits[0, -1], ref(torch.tensor([ctx + [11]])).logits[0, -1], atol=1e-9)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_feeds_and_a_trees_first_depth_in_one_call_match_full_forwards(tmp_path, arch):
    """``forward_glue_branches``: feeds of different lengths commit as ``forward`` would, branches in the same call
    continue tokens fed in it, and a branch that starts one depth later (``starts``) sees its own path only."""
    make_model(tmp_path / "m", arch=arch, seed=2)
    backend = HFBackend(str(tmp_path / "m"), dtype="float64")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path / "m", dtype=torch.float64).eval()

    def full(tokens):
        with torch.no_grad():
            return ref(torch.tensor([tokens])).logits[0, -1]

    ctx = {"a": [5, 6, 7, 8], "b": [9, 10]}
    feeds = {"a": [11, 12, 13], "b": [14]}  # "a"'s feed is wider: "b" is padded into depth 1's slots
    for s in ctx:
        backend.add(s)
    backend.forward(list(ctx), list(ctx.values()), [1, 1])
    # Early branches continue 5 and 6 tokens of "a" (the second inside its feed), 3 of "b" (all of it).
    early = {"a": ([20, 21], [5, 6]), "b": ([30], [3])}
    lanes = 3  # lane 2 of "a" and lanes 1-2 of "b" stay free at depth 0
    after, out = backend.forward_glue_branches(["a", "b"], [feeds["a"], feeds["b"]], [early["a"][0], early["b"][0]],
                                               [early["a"][1], early["b"][1]], lanes)
    seq = {s: ctx[s] + feeds[s] for s in ctx}
    assert backend.num_cached("a") == 7 and backend.num_cached("b") == 3
    paths = {}
    for row, s in enumerate("ab"):
        assert torch.allclose(after[row], full(seq[s]), atol=1e-9), (arch, s)
        for lane, (tok, n) in enumerate(zip(*early[s])):
            path = seq[s][:n] + [tok]
            assert torch.allclose(out[row, lane], full(path), atol=1e-9), (arch, s, lane)
            paths[(s, lane)] = path + [int(out[row, lane].argmax())]
    # Depth 1: the early branches go on; "a" lane 2 and "b" lane 1 start here, after the whole feed.
    paths[("a", 2)], paths[("b", 1)] = seq["a"] + [40], seq["b"] + [41]
    tokens = [[paths[("a", 0)][-1], paths[("a", 1)][-1], 40], [paths[("b", 0)][-1], 41]]
    for depth in (1, 2):
        out = backend.forward_branches(["a", "b"], tokens, [[5, 6, 7], [3, 3]], depth, lanes, starts=[[0, 0, 1], [0, 1]])
        for row, s in enumerate("ab"):
            for lane in range(len(tokens[row])):
                assert torch.allclose(out[row, lane], full(paths[(s, lane)]), atol=1e-9), (arch, depth, s, lane)
                paths[(s, lane)].append(int(out[row, lane].argmax()))
                tokens[row][lane] = paths[(s, lane)][-1]
    assert backend.num_cached("a") == 7 and backend.num_cached("b") == 3
    logits = backend.forward(["b"], [[15]], [1])  # the committed sequence is untouched by the lanes
    assert torch.allclose(logits[0, -1], full(seq["b"] + [15]), atol=1e-9)


def test_failed_forward_commits_nothing(tmp_path):
    make_model(tmp_path / "m", max_positions=16)
    backend = HFBackend(str(tmp_path / "m"))
    backend.add("x")
    backend.forward(["x"], [[1, 2, 3]], [1])
    with pytest.raises(ValueError):
        backend.forward(["x"], [list(range(20))], [1])
    assert backend.num_cached("x") == 3
