"""User mistakes raise ValueError naming the field and value, before any forward pass."""

from __future__ import annotations

import pytest

from specserve import LLM, SamplingParams

from ..conftest import make_model


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": -0.5}, "temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\], got 1.5"),
        ({"max_tokens": 0}, r"max_tokens must be in \[1, 2147483647\], got 0"),
        ({"top_k": -3}, "top_k"),
        ({"temperature": "hot"}, "temperature must be a number"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_prompt_longer_than_context(tiny_pair):
    with LLM(tiny_pair["target"], draft=tiny_pair["same"], dtype="float64") as llm:
        with pytest.raises(ValueError, match="request 0: prompt has 300 tokens.*max_model_len.*256"):
            llm.generate([[1] * 300], use_tqdm=False)
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate([[]], use_tqdm=False)
        with pytest.raises(ValueError, match=r"token ids must be integers in \[0, 64\)"):
            llm.generate([[1, 99]], use_tqdm=False)
        # Nothing half-started: the engine still works and holds no sequence.
        assert llm.generate([[1, 2]], SamplingParams(max_tokens=2), use_tqdm=False)[0].finish_reason == "length"
        assert llm._engine.target.num_seqs == 0


def test_vocabularies_that_cannot_be_matched(tmp_path, tiny_pair):
    make_model(tmp_path / "big", vocab_size=80)
    with pytest.raises(ValueError, match="vocab_size 80 \\(draft\\) != 64 \\(target\\)"):
        LLM(tiny_pair["target"], draft=str(tmp_path / "big"))


def test_tokenizers_that_differ(tmp_path, tiny_pair):
    from transformers import AutoTokenizer

    make_model(tmp_path / "other", tokenizer=True)
    tok = AutoTokenizer.from_pretrained(tmp_path / "other")
    tok.add_tokens(["zzz"])
    tok.save_pretrained(tmp_path / "other")
    with pytest.raises(ValueError, match="tokenizers differ"):
        LLM(tiny_pair["target"], draft=str(tmp_path / "other"))


@pytest.mark.parametrize("kwargs, match", [
    ({"num_speculative_tokens": -1}, "num_speculative_tokens: Input should be greater than or equal to 0"),
    ({"dtype": "float8"}, "target_dtype: Input should be 'auto', 'float32'"),
    ({"max_num_seqs": 0}, "max_num_seqs: Input should be greater than or equal to 1"),
])
def test_engine_config_validation(tiny_pair, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LLM(tiny_pair["target"], draft="ngram", **kwargs)


def test_unknown_keyword_is_a_type_error(tiny_pair):
    with pytest.raises(TypeError, match="unknown configuration field 'num_speculative_tokenz'"):
        LLM(tiny_pair["target"], num_speculative_tokenz=3)


def test_string_prompt_without_tokenizer(tmp_path):
    make_model(tmp_path / "notok")
    with LLM(str(tmp_path / "notok"), draft="ngram") as llm:
        with pytest.raises(ValueError, match=r"prompts\[0\] is a string but the target has no tokenizer"):
            llm.generate(["hello"], use_tqdm=False)
        assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)[0].token_ids) == 3


def test_mismatched_params_list(tiny_pair):
    with LLM(tiny_pair["target"]) as llm:
        with pytest.raises(ValueError, match="sampling_params has 1 entries but there are 2 prompts"):
            llm.generate([[1], [2]], [SamplingParams()], use_tqdm=False)


def test_missing_model_directory(tmp_path, tiny_pair):
    with pytest.raises(ValueError, match="target .*/nope': no such directory"):
        LLM(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="draft .*/nope': no such directory"):
        LLM(tiny_pair["target"], draft=str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="directory without config.json"):
        LLM(str(tmp_path / "empty"))
    with pytest.raises(ValueError, match="'someorg/somemodel': no such directory, and not in the Hugging Face cache"):
        LLM("someorg/somemodel")
