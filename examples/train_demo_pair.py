"""Train the tiny target/draft demo pair shipped in ``specserve/demo_models/``.

Data flow: this interpreter's stdlib ``*.py`` sources -> byte-level BPE tokenizer
-> target LlamaForCausalLM (cross-entropy) -> draft LlamaForCausalLM (KL to the
target's logits) -> float16 safetensors + tokenizer files in ``--out/{target,draft}``.
CPU only, seeded; step counts are fixed and the ``--*-minutes`` budgets are hard caps.

    python examples/train_demo_pair.py --out specserve/demo_models
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
MAX_POSITIONS = 512
SEQ_LEN = 256  # training / evaluation window
BATCH_SIZE = 16
HOLDOUT_EVERY = 30  # every 30th file (sorted order) is held out: ~3%
EXCLUDED_DIRS = {
    "test", "tests", "idlelib", "lib2to3", "site-packages", "__pycache__",
    "encodings",  # generated codec tables
    "pydoc_data",  # English prose stored in a dict
    "__phello__",
}
TARGET_ARCH = dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=8,
                   num_key_value_heads=8, intermediate_size=768)
DRAFT_ARCH = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, intermediate_size=384)
SAMPLE_PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):\n",
]


# ----------------------------------------------------------------------------- data


def stdlib_files() -> list[Path]:
    """All stdlib ``*.py`` files outside EXCLUDED_DIRS, in sorted (deterministic) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).parts
        if set(parts[:-1]) & EXCLUDED_DIRS or parts[0].startswith("config-"):
            continue
        files.append(path)
    return files


def split_files(files: list[Path]) -> tuple[list[Path], list[Path]]:
    """(train, heldout): every HOLDOUT_EVERY-th file, offset by half, is held out."""
    heldout = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY // 2]
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != HOLDOUT_EVERY // 2]
    return train, heldout


def read_texts(files: list[Path]) -> list[str]:
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE, EOS = id 0, no BOS added.

    Runs of newlines are pre-tokenized on their own (GPT-2's regex would merge a newline
    with the next line's indentation), so a prompt ending in "\n" is tokenized the way
    the models saw it in training.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(r"\n+"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    assert tok.token_to_id(EOS) == 0 and tok.get_vocab_size() == VOCAB_SIZE
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, pad_token=EOS,
        model_max_length=MAX_POSITIONS,
    )


def encode_stream(tokenizer: PreTrainedTokenizerFast, texts: list[str]) -> torch.Tensor:
    """One int64 token stream: ``EOS file0 EOS file1 ...``."""
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.append(tokenizer.eos_token_id)
        ids.extend(enc.ids)
    return torch.tensor(ids, dtype=torch.long)


def sample_windows(stream: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """Random training windows. Returns [BATCH_SIZE, SEQ_LEN + 1] int64."""
    starts = torch.randint(0, len(stream) - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
    return torch.stack([stream[s : s + SEQ_LEN + 1] for s in starts.tolist()])


def eval_windows(stream: torch.Tensor) -> torch.Tensor:
    """Windows overlapping by one token, so every token but the first is predicted once.

    Returns [num_windows, SEQ_LEN + 1] int64 (the ragged tail is dropped).
    """
    n = (len(stream) - 1) // SEQ_LEN
    return torch.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n)])


# ---------------------------------------------------------------------------- models


def make_model(arch: dict, eos_token_id: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True, bos_token_id=eos_token_id, eos_token_id=eos_token_id,
        pad_token_id=eos_token_id, **arch,
    )
    return LlamaForCausalLM(config)


def num_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are counted once


def lr_at(step: int, num_steps: int, peak_lr: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak_lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, num_steps - warmup)
    return peak_lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: torch.nn.Module, lr: float) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), eps=1e-8)


def logits_of(model: LlamaForCausalLM, input_ids: torch.Tensor) -> torch.Tensor:
    """[batch, seq, vocab] float32 logits, forward in bf16 autocast (faster on CPU)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(input_ids=input_ids).logits.float()


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, windows: torch.Tensor, bf16: bool = True) -> float:
    """Mean next-token cross-entropy (nats/token) over ``windows`` [n, SEQ_LEN + 1]."""
    model.eval()
    total, count = 0.0, 0
    for batch in windows.split(BATCH_SIZE):
        x, y = batch[:, :-1], batch[:, 1:]
        logits = logits_of(model, x) if bf16 else model(input_ids=x).logits.float()
        total += F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum").item()
        count += y.numel()
    model.train()
    return total / count


def train_loop(name, model, loss_fn, stream, eval_set, args, num_steps, minutes, peak_lr):
    """Shared AdamW + cosine loop; ``loss_fn(x, y) -> (loss, extra_metric)``."""
    gen = torch.Generator().manual_seed(args.seed + (1 if name == "target" else 2))
    opt = make_optimizer(model, peak_lr)
    warmup = max(1, min(100, num_steps // 10))
    t0 = time.time()
    model.train()
    for step in range(num_steps):
        if time.time() - t0 > minutes * 60:
            print(f"[{name}] WARNING: --{name}-minutes budget hit at step {step}/{num_steps}; "
                  "the schedule did not finish and the result is not reproducible", flush=True)
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step, num_steps, peak_lr, warmup)
        batch = sample_windows(stream, gen)
        loss, extra = loss_fn(batch[:, :-1], batch[:, 1:])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == num_steps - 1:
            elapsed = time.time() - t0
            tok_s = (step + 1) * BATCH_SIZE * SEQ_LEN / elapsed
            print(f"[{name}] step {step:5d}/{num_steps} loss {loss.item():.4f} {extra} "
                  f"lr {opt.param_groups[0]['lr']:.2e} {tok_s:,.0f} tok/s {elapsed / 60:.1f} min",
                  flush=True)
        if (step + 1) % 500 == 0:
            print(f"[{name}] step {step + 1} held-out loss (subset) "
                  f"{evaluate(model, eval_set[:32]):.4f}", flush=True)
    return {"steps": step + 1, "train_seconds": round(time.time() - t0, 1)}


def train_target(model, stream, eval_set, args):
    def loss_fn(x, y):
        logits = logits_of(model, x)
        return F.cross_entropy(logits.flatten(0, 1), y.flatten()), ""

    return train_loop("target", model, loss_fn, stream, eval_set, args,
                      args.target_steps, args.target_minutes, peak_lr=2e-3)


@torch.no_grad()
def init_draft_embeddings(draft: LlamaForCausalLM, target: LlamaForCausalLM) -> None:
    """Start the draft's (tied) embeddings at the target's, projected on their top principal axes.

    This starts the draft far closer to the target than a random embedding does (the draft's model
    card gives the trial's numbers).
    """
    emb = target.get_input_embeddings().weight.float()  # [vocab, target_hidden]
    centered = emb - emb.mean(0)
    _, _, v = torch.linalg.svd(centered, full_matrices=False)  # v: [target_hidden, target_hidden]
    draft_hidden = draft.config.hidden_size
    draft.get_input_embeddings().weight.copy_(centered @ v[:draft_hidden].T)


def distill_draft(draft, target, stream, eval_set, args):
    """Forward KL(target || draft) per token; logs draft/target top-1 agreement."""
    target.eval()
    init_draft_embeddings(draft, target)

    def loss_fn(x, y):
        with torch.no_grad():
            target_logprobs = logits_of(target, x).log_softmax(-1).flatten(0, 1)
        draft_logprobs = logits_of(draft, x).log_softmax(-1).flatten(0, 1)
        loss = F.kl_div(draft_logprobs, target_logprobs, log_target=True, reduction="batchmean")
        agree = (draft_logprobs.argmax(-1) == target_logprobs.argmax(-1)).float().mean()
        return loss, f"top1-agree {agree.item():.3f}"

    return train_loop("draft", draft, loss_fn, stream, eval_set, args,
                      args.draft_steps, args.draft_minutes, peak_lr=3e-3)


# ------------------------------------------------------------------------------ save


def save_pair(out: Path, name: str, model, tokenizer) -> Path:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    model.to(torch.float16).save_pretrained(folder)
    model.to(torch.float32)
    eos = tokenizer.eos_token_id
    GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
                     do_sample=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # Name the class transformers 4.x knows too (5.x writes "TokenizersBackend").
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    return folder


@torch.no_grad()
def greedy_samples(model, tokenizer, prompts: list[str], max_new_tokens: int = 96) -> list[str]:
    model.eval()
    texts = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]
        for _ in range(max_new_tokens):
            next_id = model(input_ids=ids).logits[0, -1].argmax()
            if next_id.item() == tokenizer.eos_token_id:  # host sync: stop at EOS
                break
            ids = torch.cat([ids, next_id.view(1, 1)], dim=1)
        texts.append(tokenizer.decode(ids[0]))
    return texts


# ------------------------------------------------------------------------------ main


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("specserve/demo_models"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--target-steps", type=int, default=1500)
    parser.add_argument("--draft-steps", type=int, default=900)
    parser.add_argument("--target-minutes", type=float, default=30.0, help="hard cap")
    parser.add_argument("--draft-minutes", type=float, default=18.0, help="hard cap")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ["TOKENIZERS_PARALLELISM"] = "true" if args.threads > 1 else "false"
    torch.manual_seed(args.seed)
    phases: dict[str, float] = {}
    print(f"python {platform.python_version()} torch {torch.__version__} "
          f"threads {args.threads} seed {args.seed}", flush=True)

    t = time.time()
    train_files, heldout_files = split_files(stdlib_files())
    train_texts, heldout_texts = read_texts(train_files), read_texts(heldout_files)
    corpus_sha = hashlib.sha256("".join(train_texts + heldout_texts).encode()).hexdigest()[:16]
    tokenizer = train_tokenizer(train_texts)
    train_stream = encode_stream(tokenizer, train_texts)
    heldout_stream = encode_stream(tokenizer, heldout_texts)
    heldout_set = eval_windows(heldout_stream)
    heldout_bytes = sum(len(s.encode()) for s in heldout_texts)
    phases["data_and_tokenizer"] = time.time() - t
    print(f"corpus: {len(train_files)} train files ({len(train_stream):,} tokens), "
          f"{len(heldout_files)} held-out files ({len(heldout_stream):,} tokens), "
          f"sha256[:16] {corpus_sha}, {phases['data_and_tokenizer']:.1f}s", flush=True)

    target = make_model(TARGET_ARCH, tokenizer.eos_token_id)
    draft = make_model(DRAFT_ARCH, tokenizer.eos_token_id)
    print(f"target {num_params(target):,} params, draft {num_params(draft):,} params", flush=True)

    t = time.time()
    target_run = train_target(target, train_stream, heldout_set, args)
    phases["target_training"] = time.time() - t
    t = time.time()
    draft_run = distill_draft(draft, target, train_stream, heldout_set, args)
    phases["draft_training"] = time.time() - t

    t = time.time()
    summary = {"corpus": {"python": platform.python_version(), "sha256_16": corpus_sha,
                          "train_files": len(train_files), "train_tokens": len(train_stream),
                          "heldout_files": [str(f.relative_to(Path(sysconfig.get_paths()["stdlib"])))
                                            for f in heldout_files],
                          "heldout_tokens": len(heldout_stream), "heldout_bytes": heldout_bytes},
               "args": {k: str(v) for k, v in vars(args).items()}}
    for name, model, run in [("target", target, target_run), ("draft", draft, draft_run)]:
        folder = save_pair(args.out, name, model, tokenizer)
        # Evaluate exactly what was saved: float16 weights loaded back as float32.
        reloaded = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        loss = evaluate(reloaded, heldout_set, bf16=False)
        bits_per_byte = loss / math.log(2) * len(heldout_stream) / heldout_bytes  # approximate
        summary[name] = {**run, "params": num_params(model), "heldout_loss": round(loss, 4),
                         "heldout_ppl": round(math.exp(loss), 2),
                         "heldout_bits_per_byte": round(bits_per_byte, 3)}
        print(f"{name}: held-out loss {loss:.4f} ppl {math.exp(loss):.2f} "
              f"~{bits_per_byte:.3f} bits/byte", flush=True)
    summary["samples"] = dict(zip(SAMPLE_PROMPTS, greedy_samples(target, tokenizer, SAMPLE_PROMPTS)))
    phases["save_and_eval"] = time.time() - t
    summary["phase_seconds"] = {k: round(v, 1) for k, v in phases.items()}
    (args.out / "training_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    for prompt, text in summary["samples"].items():
        print(f"--- greedy sample for {prompt!r}\n{text}\n", flush=True)
    for phase, seconds in phases.items():
        print(f"phase {phase}: {seconds / 60:.1f} min", flush=True)


if __name__ == "__main__":
    sys.exit(main())
