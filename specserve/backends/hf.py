"""transformers backend: any ``AutoModelForCausalLM`` loaded with ``from_pretrained``.

Data flow: token lists are left-padded into one ``[batch_size, width]`` block; real tokens
are written at each sequence's committed length in a ``SlotKVCache``, padding goes to stale
slots past them, so the last ``num_logits`` positions of every row are real tokens.
"""

from __future__ import annotations

import logging

import torch

from .slot_cache import SlotKVCache

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "auto": "auto",
}


def resolve_dtype(dtype: str | torch.dtype):
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def model_max_len(config) -> int:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(text_config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return 2048


class HFBackend:
    """Batched forward with per-sequence KV rows; see ``ModelBackend``."""

    def __init__(
        self,
        model: str,
        dtype: str | torch.dtype = "float32",
        device: str = "cpu",
        device_map: str | dict | None = None,
        trust_remote_code: bool = False,
        max_model_len: int | None = None,
    ):
        from transformers import AutoModelForCausalLM

        kwargs = dict(dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code)
        if device_map is not None:
            kwargs["device_map"] = device_map
        self.model = AutoModelForCausalLM.from_pretrained(model, **kwargs)
        if device_map is None:
            self.model.to(device)
        self.model.eval()
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        config = self.model.config
        self.vocab_size = self.model.get_output_embeddings().weight.shape[0]
        limit = model_max_len(config)
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = max_model_len or limit
        self.cache = SlotKVCache()
        self._row: dict[str, int] = {}  # seq_id -> pool row; live rows are 0..n-1
        self._seq_at_row: list[str] = []
        self._length: list[int] = []  # committed length per row

    # -- sequence bookkeeping -------------------------------------------------------------
    def add(self, seq_id: str) -> None:
        if seq_id in self._row:
            raise KeyError(f"sequence {seq_id!r} already exists")
        self._row[seq_id] = len(self._seq_at_row)
        self._seq_at_row.append(seq_id)
        self._length.append(0)

    def free(self, seq_id: str) -> None:
        """Drop a sequence; the last row moves into its place so live rows stay 0..n-1."""
        row = self._row.pop(seq_id)
        last = len(self._seq_at_row) - 1
        if row != last:
            moved = self._seq_at_row[last]
            self.cache.copy_row(last, row, self._length[last])
            self._seq_at_row[row] = moved
            self._length[row] = self._length[last]
            self._row[moved] = row
        self._seq_at_row.pop()
        self._length.pop()

    def num_cached(self, seq_id: str) -> int:
        return self._length[self._row[seq_id]]

    def truncate(self, seq_id: str, num_tokens: int) -> None:
        row = self._row[seq_id]
        assert 0 <= num_tokens <= self._length[row], (seq_id, num_tokens, self._length[row])
        self._length[row] = num_tokens

    @property
    def num_seqs(self) -> int:
        return len(self._seq_at_row)

    # -- compute --------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, seq_ids, token_ids, num_logits) -> torch.Tensor:
        assert len(seq_ids) == len(token_ids) == len(num_logits) > 0
        # Sort by row so a full batch reads the pool as a view, not a gather.
        order = sorted(range(len(seq_ids)), key=lambda i: self._row[seq_ids[i]])
        rows = [self._row[seq_ids[i]] for i in order]
        width = max(len(t) for t in token_ids)
        input_ids, position_ids, slots = [], [], []
        for i in order:
            toks, start = token_ids[i], self._length[self._row[seq_ids[i]]]
            n, pad = len(toks), width - len(toks)
            assert n >= 1 and 1 <= num_logits[i] <= n
            if start + n > self.max_model_len:
                raise ValueError(f"sequence {seq_ids[i]!r} would reach {start + n} tokens, over max_model_len={self.max_model_len}")
            input_ids.append([0] * pad + list(toks))
            position_ids.append([0] * pad + list(range(start, start + n)))
            # Padding writes to stale slots after the real tokens, where no real query looks.
            slots.append(list(range(start + n, start + n + pad)) + list(range(start, start + n)))
            self._length[self._row[seq_ids[i]]] = start + n
        dev = self.device
        allowed = self.cache.prepare(
            torch.tensor(rows, device=dev), torch.tensor(slots, device=dev)
        )  # [batch_size, 1, width, kv_len]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        keep = max(num_logits)
        out = self.model(
            input_ids=torch.tensor(input_ids, device=dev),
            position_ids=torch.tensor(position_ids, device=dev),
            attention_mask=mask,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=keep,
        )
        logits = out.logits[:, -keep:].float() if self.dtype != torch.float64 else out.logits[:, -keep:]
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        return logits[inverse]
