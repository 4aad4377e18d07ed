"""Writes a tiny, randomly initialised target/draft pair (shared tokenizer) for the two-host test.

    python3 cluster/twohost/make_tiny_models.py OUT_DIR   ->  OUT_DIR/{target,draft}

Seeded, CPU, a few seconds. The weights are random: the point is placement and the
HTTP path, not acceptance rates. Knows nothing about Ray or specserve.
"""

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
ARCH = {
    "target": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128),
    "draft": dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64),
}


def train_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    corpus = [Path(m.__file__).read_text() for m in (argparse, torch.nn.functional) if m.__file__]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--vocab-size", type=int, default=512)
    args = parser.parse_args()

    tokenizer = train_tokenizer(args.vocab_size)
    for offset, (role, arch) in enumerate(ARCH.items()):
        torch.manual_seed(1234 + offset)
        config = LlamaConfig(
            vocab_size=len(tokenizer), max_position_embeddings=512,
            eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
            pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False, **arch,
        )
        model = LlamaForCausalLM(config).eval()
        out = args.out / role
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        print(f"{role}: {sum(p.numel() for p in model.parameters())} parameters -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
