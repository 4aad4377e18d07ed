"""A compiled draft forward (``draft.compile``): the same logits as eager, no request waits for a
compilation, eager when it cannot compile, and which drafts compile by default."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.backends.hf import HFBackend
from specserve.build import _compile_policy, _model_drafter
from specserve.cli import main
from specserve.config import DraftConfig, SpecserveConfig
from specserve.eagle import load_head
from specserve.head_drafter import HeadBackend

from ..conftest import make_model
from ..heads import make_eagle3_head

HAS_CXX = any(shutil.which(c) for c in ("g++", "c++", "clang++"))  # inductor's CPU code needs one


def _steps(backend: HFBackend, width: int = 0) -> list[torch.Tensor]:
    """Drafting's forward shapes (one logit row per sequence; branch trees) in a fixed order: prompts,
    single tokens, trees, a freed row. ``width`` > 0: a draft head's, with seeded random input rows that wide."""
    out, gen = [], torch.Generator().manual_seed(0)

    def rows(*counts):
        return [torch.randn(n, width, generator=gen) for n in counts] if width else None

    def lanes(n, k):
        return torch.randn(n, k, width, generator=gen) if width else None

    for s in ("a", "b", "c"):
        backend.add(s)
    out.append(backend.forward(["a", "b", "c"], [[5, 9, 11, 3], [7, 2], [4, 4, 8, 1, 6]], [1, 1, 1], hidden=rows(4, 2, 5)))
    out.append(backend.forward(["a", "c"], [[12], [13]], [1, 1], hidden=rows(1, 1)))
    for depth in range(3):
        out.append(backend.forward_branches(["a", "b", "c"], [[20, 21, 22], [23], [24, 25]],
                                            [[5, 4, 3], [2], [6, 6]], depth, 3, hidden=lanes(3, 3)))
    backend.free("b")
    backend.add("d")
    out.append(backend.forward(["d"], [list(range(1, 30))], [1], hidden=rows(29)))
    out.append(backend.forward(["c", "d", "a"], [[30, 31], [32], [33, 34, 35]], [1, 1, 1], hidden=rows(2, 1, 3)))
    if not width:  # a causal LM's glue with its tree's first depth, then a depth where lanes start late
        out.extend(backend.forward_glue_branches(["a", "c"], [[40, 41, 42], [43]], [[44, 45], [46]], [[9, 10], [9]], 3))
        out.extend(backend.forward_glue_branches(["d"], [[47]], [[48]], [[30]], 1))
        out.append(backend.forward_branches(["a", "c"], [[50, 51, 52], [53, 54]], [[9, 10, 11], [9, 9]], 1, 3,
                                            starts=[[0, 0, 1], [0, 1]]))
    return out


def _assert_same(want: list[torch.Tensor], got: list[torch.Tensor]) -> None:
    assert len(want) == len(got)
    for w, g in zip(want, got):
        assert w.shape == g.shape
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)
        assert torch.equal(g.argmax(-1), w.argmax(-1))


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: torch.compile cannot build CPU code here")
def test_compiled_forward_matches_eager(tiny_pair):
    eager = HFBackend(tiny_pair["perturbed"], dtype="float32")
    compiled = HFBackend(tiny_pair["perturbed"], dtype="float32")
    assert compiled.compile() is True and compiled.compiled
    assert compiled.num_seqs == 0  # the warm-up's scratch sequences are gone
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    _assert_same(_steps(eager), _steps(compiled))
    # The warm-up covered every shape above: nothing compiled while "serving".
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


@pytest.fixture(scope="module")
def head_pair(tmp_path_factory):
    """A 4-layer target and an EAGLE-3 head for it over a reduced draft vocabulary (its d2t map in the forward)."""
    root = tmp_path_factory.mktemp("compiled_head")
    make_model(root / "target", seed=0, tokenizer=True, hidden=64, layers=4)
    return str(root / "target"), make_eagle3_head(root / "head", str(root / "target"), layer_ids=[1, 2, 3], draft_vocab_size=32)


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: torch.compile cannot build CPU code here")
def test_compiled_head_matches_eager(head_pair):
    """An EAGLE head's forward reads the target's rows beside its tokens: the warm-up compiles those shapes too."""
    target, head = head_pair

    def load():
        return HeadBackend(load_head(head, target, 4))

    eager, compiled = load(), load()
    assert compiled.compile() is True and compiled.num_seqs == 0
    compiles = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    width = eager.model.config.hidden_size
    _assert_same(_steps(eager, width), _steps(compiled, width))
    assert compiled.last_hidden.shape == eager.last_hidden.shape  # the head's own rows, which its next step reads
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == compiles


def test_compile_failure_keeps_eager(tiny_pair, monkeypatch, caplog):
    backend = HFBackend(tiny_pair["perturbed"], dtype="float32")
    model = backend.model

    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", broken)
    with caplog.at_level(logging.WARNING, logger="specserve.backends.hf"):
        assert backend.compile() is False
    assert backend.model is model and not backend.compiled
    assert "not compiled, running eager: RuntimeError: no C++ compiler found" in caplog.text
    backend.add("s")
    assert backend.forward(["s"], [[1, 2, 3]], [1]).shape == (1, 1, 64)


def test_compiled_forward_that_fails_turns_eager(tiny_pair, caplog):
    """A shape the warm-up did not foresee that fails to compile costs that call nothing but the retry."""
    backend, reference = HFBackend(tiny_pair["perturbed"], dtype="float32"), HFBackend(tiny_pair["perturbed"], dtype="float32")
    eager = backend.model
    backend._eager, backend.compiled = eager, True  # the state compile() leaves, without paying for a compilation

    def broken(**kwargs):
        raise RuntimeError("InductorError: a shape it cannot lower")

    backend.model = broken
    for b in (backend, reference):
        b.add("s")
    with caplog.at_level(logging.WARNING, logger="specserve.backends.hf"):
        got = backend.forward(["s"], [[5, 9, 11]], [1])
    assert backend.model is eager and not backend.compiled
    assert "compiled forward failed, running eager from now on: RuntimeError: InductorError" in caplog.text
    torch.testing.assert_close(got, reference.forward(["s"], [[5, 9, 11]], [1]))
    assert backend.num_cached("s") == 3


def test_compile_policy_and_setting(monkeypatch, capsys):
    def draft(**kw):
        return DraftConfig(model="some/draft", **kw)

    assert _compile_policy(draft(compile="auto"), own_process=True)  # a CPU draft in its own process
    assert not _compile_policy(draft(compile="auto"), own_process=False)  # in the target's process: starts at once
    assert not _compile_policy(draft(compile="auto", device="cuda"), own_process=True)  # GPUs: only when asked
    assert _compile_policy(draft(compile=True, device="cuda"), own_process=False)
    assert not _compile_policy(draft(compile=False), own_process=True)
    assert not _compile_policy(draft(compile=True, backend="sim"), own_process=True)  # hf drafts only
    assert not _compile_policy(draft(compile="auto", device_map="auto"), own_process=True)

    cfg = SpecserveConfig.load(target="some/target", draft="some/draft", draft_compile=False)
    assert cfg.draft.compile is False
    monkeypatch.setenv("SPECSERVE_DRAFT_COMPILE", "auto")
    assert draft().compile == "auto"
    monkeypatch.setenv("SPECSERVE_DRAFT_COMPILE", "0")
    assert draft().compile is False
    monkeypatch.setenv("SPECSERVE_DRAFT_COMPILE", "sometimes")
    with pytest.raises(ValueError, match="SPECSERVE_DRAFT_COMPILE='sometimes': expected true, false or auto"):
        draft()
    # The CLI reads that default while it builds its flags: a clear error, not a traceback.
    assert main(["config", "--target", "some/target", "--draft", "some/draft"]) == 2
    assert "specserve: error: SPECSERVE_DRAFT_COMPILE='sometimes': expected true, false or auto" in capsys.readouterr().err


@pytest.mark.skipif(not HAS_CXX, reason="no C++ compiler: torch.compile cannot build CPU code here")
def test_compiled_draft_is_lossless(tiny_pair):
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompts = ["w1 w2 w3", "w7 w7 w9 w10 w11", "w30"]
    with LLM(tiny_pair["target"]) as ref:
        want = [o.token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    with LLM(tiny_pair["target"], draft=tiny_pair["perturbed"], draft_compile=True, num_speculative_tokens=3) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert llm._engine.draft_service.metrics()["compiled"] is True
        assert llm.metrics()["num_speculative_steps"] > 0
    assert got == want


def test_head_drafts_follow_the_compile_setting(head_pair, monkeypatch):
    """A draft head is compiled as a draft model is: the same policy, on the ``HeadBackend`` the drafter runs."""
    target, head = head_pair
    compiled = []
    monkeypatch.setattr(HFBackend, "compile", lambda self: compiled.append(type(self).__name__) or True)
    for setting, own_process, want in ((True, False, 1), ("auto", True, 1), ("auto", False, 0), (False, True, 0)):
        compiled.clear()
        drafter = _model_drafter(SpecserveConfig.load(target=target, draft=head, draft_compile=setting), own_process)
        assert isinstance(drafter.backend, HeadBackend)
        assert compiled == ["HeadBackend"] * want, (setting, own_process)
