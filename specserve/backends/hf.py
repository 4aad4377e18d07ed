"""transformers backend: any ``AutoModelForCausalLM`` loaded with ``from_pretrained``.

Data flow: ``forward`` left-pads token lists into one ``[batch_size, width]`` block; real
tokens are written at each sequence's committed length in a ``SlotKVCache`` and padding
goes to stale slots past them, so the last ``num_logits`` positions of every row are real.
``forward_branches`` runs one depth of per-sequence branch trees (the draft's speculation
cache) in scratch slots past the committed length: lane ``b`` of a row sees the row's
first ``prefix_len[b]`` cached tokens and its own lane, nothing else. Scratch is never
committed. ``forward_glue_branches`` runs a ``forward`` and a tree's depth 0 in one call.
The mask is built here, by slot, so any architecture that accepts a 4-D additive mask and
explicit position ids works (Llama, Qwen2, GPT-2, GPT-NeoX are tested).
"""

from __future__ import annotations

import contextlib
import logging
import time

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from .slot_cache import SlotKVCache

logger = logging.getLogger(__name__)

DTYPES = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "auto": "auto",
}


# Attention kernels a CUDA forward may use. cuDNN's is left out: PyTorch builds a cuDNN graph for
# each new key length, and a decode step has a new one every step, so every step would pay for a
# plan on the host (benchmarks/dev/profile_gpu.py compares). The others need no plan per shape.
# Empty: every kernel PyTorch offers.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [""])[0][:200]


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


def check_attention_only(model: str, config) -> None:
    """``ValueError`` for a model with layers other than attention (Qwen3-Next's gated delta net, Mamba): this
    backend rolls a sequence back by cutting its attention KV at a position, which a recurrent state cannot do."""
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    other = sorted({t for t in getattr(text_config, "layer_types", None) or () if "attention" not in t or "linear" in t})
    if other:
        raise ValueError(f"{model!r} ({text_config.model_type}) has {', '.join(other)} layers, whose state cannot be rolled "
                         "back to a position as attention KV is: specserve's own engine and transformers drafts cannot "
                         "run it; serve it with the vLLM target engine (target_backend='vllm')")


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
        from transformers import AutoConfig, AutoModelForCausalLM

        kwargs = dict(dtype=resolve_dtype(dtype), trust_remote_code=trust_remote_code)
        if device_map is not None:
            kwargs["device_map"] = device_map
        config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
        check_attention_only(model, config)
        self.model = AutoModelForCausalLM.from_pretrained(model, config=config, **kwargs)
        if device_map is None:
            self.model.to(device)
        self._adopt(self.model, self.model.get_output_embeddings().weight.shape[0], model_max_len(self.model.config), max_model_len)

    def _adopt(self, model, vocab_size: int, limit: int, max_model_len: int | None) -> None:
        """Serve ``model`` (anything called like a causal LM with a 4-D mask and a cache; a draft head too)."""
        self.model = model.eval()
        self.device = next(self.model.parameters()).device
        self.dtype = next(self.model.parameters()).dtype
        self.vocab_size = vocab_size
        if max_model_len is not None and max_model_len > limit:
            raise ValueError(f"max_model_len={max_model_len} exceeds the model's context of {limit} tokens")
        self.max_model_len = max_model_len or limit
        self.cache = SlotKVCache()
        self._row: dict[str, int] = {}  # seq_id -> pool row; live rows are 0..n-1
        self._seq_at_row: list[str] = []
        self._length: list[int] = []  # committed (cached) length per row
        self.capture_layers: tuple[int, ...] | None = None  # hidden states to keep from each forward (an EAGLE head's)
        self.captured: torch.Tensor | None = None  # [batch_size, width, len(capture_layers) * hidden] of the last forward
        self.last_hidden: torch.Tensor | None = None  # [batch_size, num_logits, hidden]: a head's own rows, last forward
        self.compiled = False  # the forward runs through torch.compile (``compile``)

    @classmethod
    def from_side(cls, side, max_model_len: int | None = None) -> "HFBackend":
        """Build from a ``config.SideConfig``; ``backend_options`` pass through as keyword arguments."""
        return cls(side.model, dtype=side.dtype, device=side.device, device_map=side.device_map,
                   trust_remote_code=side.trust_remote_code, max_model_len=max_model_len, **side.backend_options)

    def hidden_info(self) -> dict:
        """What a draft head checks against (the target's hello): width, depth, dtype of the hidden states."""
        c = self.model.config.get_text_config() if hasattr(self.model.config, "get_text_config") else self.model.config
        return {"hidden_size": c.hidden_size, "num_hidden_layers": c.num_hidden_layers, "hidden_dtype": str(self.dtype).split(".")[-1]}

    def compile(self) -> bool:
        """Run the forward through ``torch.compile`` (dynamic shapes), compiled now for the shapes a
        drafter sends, so no request waits for a compilation; False, eager kept, when it cannot
        (no C++ compiler for a CPU build, an architecture dynamo cannot trace).

        A small model's forward is mostly per-call cost (transformers' wrappers, one dispatch per op),
        which compiling removes, most at one sequence (benchmarks/dev/bench_draft_forward.py)."""
        import torch._dynamo

        eager = self.model
        started = time.perf_counter()
        logger.info("compiling the forward for drafting's shapes (torch.compile, once per start)")
        try:
            # The warm-up's variants (one row or several, one token or several, one branch lane or several,
            # rows that are a contiguous range or not) each compile once; a stray new one must not fall
            # back to eager for good after dynamo's default limit of 8 (``cache_size_limit`` before torch 2.6).
            config = torch._dynamo.config
            limit = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
            setattr(config, limit, max(getattr(config, limit), 64))
            self.model = torch.compile(eager, dynamic=True)
            self._warm_up()
        except Exception as exc:  # noqa: BLE001  (any failure to compile leaves the eager forward, which works)
            self.model = eager
            logger.warning("draft forward not compiled, running eager: %s: %s", type(exc).__name__, _first_line(exc))
            return False
        self._eager, self.compiled = eager, True
        logger.info("forward compiled (torch.compile, dynamic shapes) in %.1f s", time.perf_counter() - started)
        return True

    def _warm_up(self) -> None:
        """The forward shapes of drafting, on scratch sequences freed afterwards: prompts, single
        tokens and branch trees, for one sequence, several, and rows that are not a contiguous range."""
        ids = [f"\0warm-up-{i}" for i in range(3)]
        for s in ids:
            self.add(s)
        try:
            # Each group: one row (the first, or a later one), rows in a range, rows that are not.
            for group in (ids[:1], ids[1:2], ids[:2], [ids[0], ids[2]]):
                n = len(group)
                for widths in ([1] * n, [2] * n, [2 + i for i in range(n)]):
                    self.forward(group, [[1] * w for w in widths], [1] * n, hidden=self._scratch_rows(widths))
                for lanes in (1, 3):
                    rows = self._scratch_rows([lanes] * n)
                    for depth in (0, 1):
                        self.forward_branches(group, [[1] * lanes] * n, [[2] * lanes] * n, depth, lanes,
                                              hidden=None if rows is None else torch.stack(rows))
                    if rows is None:  # a causal LM's glue shares its call with the tree's first depth
                        self.forward_glue_branches(group, [[1] * (lanes + 1)] * n, [[1] * lanes] * n, [[2] * lanes] * n, lanes)
        finally:
            for s in ids:
                self.free(s)

    def _scratch_rows(self, counts: list[int]) -> list[torch.Tensor] | None:
        """The warm-up's input rows beside its tokens, ``counts[i]`` for sequence i: none for a causal LM
        (a draft head reads rows, ``HeadBackend``)."""
        return None

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

    def fork(self, src_id: str, dst_id: str, length: int) -> None:
        """Give ``dst_id`` (added, nothing cached yet) the first ``length`` cached positions of
        ``src_id``: a prompt prefilled once serves every sequence that starts with it."""
        src, dst = self._row[src_id], self._row[dst_id]
        if self._length[dst] != 0 or not 0 < length <= self._length[src]:
            raise ValueError(f"cannot fork {length} positions of {src_id!r} ({self._length[src]} cached) into {dst_id!r}")
        self.cache.ensure(dst + 1, length)
        self.cache.copy_row(src, dst, length)
        self._length[dst] = length

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
    def forward(self, seq_ids, token_ids, num_logits, hidden: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``hidden`` (a draft head's input): per sequence [num_new_i, hidden] rows beside its tokens."""
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
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        zeros = torch.zeros_like(slot_t)
        max_slot = max(self._length[r] for r in rows) + width - 1  # every row's slots end at start + width - 1
        rows_in = None
        if hidden is not None:  # left-padded like the tokens
            rows_in = hidden[0].new_zeros(len(order), width, hidden[0].shape[-1])
            for pos, i in enumerate(order):
                rows_in[pos, width - hidden[i].shape[0]:] = hidden[i]
        logits = self._run(rows, input_ids, position_ids, slot_t, slot_t + 1, zeros, zeros, zeros, max(num_logits), max_slot,
                           rows_in)
        for pos, i in enumerate(order):  # commit only after the forward succeeded
            self._length[rows[pos]] += len(token_ids[i])
        inverse = [0] * len(order)
        for pos, i in enumerate(order):
            inverse[i] = pos
        if self.captured is not None:
            self.captured = self.captured[inverse]
        if self.last_hidden is not None:
            self.last_hidden = self.last_hidden[inverse]
        return logits[inverse]

    @torch.no_grad()
    def forward_branches(
        self,
        seq_ids: list[str],
        token_ids: list[list[int]],  # [batch_size][num_branches_i]: this depth's token of each branch
        prefix_lens: list[list[int]],  # [batch_size][num_branches_i]: cached tokens each branch continues (<= committed)
        depth: int,  # 0 for the branch roots, then 1, 2, ...
        num_lanes: int,  # >= every num_branches_i, the same at every depth of one tree
        hidden: torch.Tensor | None = None,  # [batch_size, num_lanes, hidden]: a draft head's input row per lane
        starts: list[list[int]] | None = None,  # [batch_size][num_branches_i]: the depth each branch started at (0)
    ) -> torch.Tensor:  # [batch_size, num_lanes, vocab] float32 (rows past num_branches_i are padding)
        """One depth of each sequence's branch tree; see the module docstring. Commits nothing. A branch that
        started at depth s > 0 (``starts``) holds its own slots from depth s on: its token at this depth is its
        (depth - s)-th."""
        rows = [self._row[s] for s in seq_ids]
        input_ids, position_ids, slots, prefix, lane_start = [], [], [], [], []
        for i, (row, toks, lens) in enumerate(zip(rows, token_ids, prefix_lens)):
            committed = self._length[row]
            assert len(toks) == len(lens) <= num_lanes and all(0 < p <= committed for p in lens)
            pad = num_lanes - len(toks)
            first = list(starts[i]) + [0] * pad if starts is not None else [0] * num_lanes
            assert all(f <= depth for f in first)
            input_ids.append(list(toks) + [0] * pad)
            pos = [p + depth - f for p, f in zip(lens, first)] + [committed] * pad
            if max(pos) >= self.max_model_len:
                raise ValueError(f"branch of {seq_ids[rows.index(row)]!r} would pass max_model_len={self.max_model_len}")
            position_ids.append(pos)
            base = committed + depth * num_lanes
            slots.append([base + b for b in range(num_lanes)])
            prefix.append(list(lens) + [1] * pad)  # padding lanes see one real slot: never an all-masked row
            lane_start.append([committed + first[b] * num_lanes + b for b in range(num_lanes)])
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        stride = torch.full_like(slot_t, num_lanes)
        return self._run(rows, input_ids, position_ids, slot_t, torch.tensor(prefix, device=dev),
                         torch.tensor(lane_start, device=dev), stride, slot_t, num_lanes, max(s[-1] for s in slots), hidden)

    @torch.no_grad()
    def forward_glue_branches(
        self,
        seq_ids: list[str],
        feeds: list[list[int]],  # [batch_size][n_i >= 1]: tokens to commit, as ``forward``
        token_ids: list[list[int]],  # [batch_size][num_branches_i]: depth 0 of branches that need only cached or fed tokens
        prefix_lens: list[list[int]],  # [batch_size][num_branches_i]: tokens each branch continues (<= committed + n_i)
        num_lanes: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # ([batch_size, vocab] after each feed, [batch_size, num_lanes, vocab])
        """``forward`` of ``feeds`` and depth 0 of a branch tree in one call: the lanes may continue fed tokens (each
        layer writes a row's keys before its queries read them). Lanes sit where ``forward_branches`` would put
        depth 0 after the feeds; a lane without a branch is padding, free for a branch that starts at depth 1.
        Commits the feeds, never the lanes. One call costs about one forward's fixed cost (on a small draft,
        most of it), not two."""
        rows = [self._row[s] for s in seq_ids]
        width = max(len(f) for f in feeds) + num_lanes
        input_ids, position_ids, slots, prefix, lane_start, stride, lane_end = [], [], [], [], [], [], []
        for sid, row, feed, toks, lens in zip(seq_ids, rows, feeds, token_ids, prefix_lens):
            start, n = self._length[row], len(feed)
            committed, pad = start + n, width - num_lanes - len(feed)
            assert n >= 1 and len(toks) == len(lens) <= num_lanes and all(0 < p <= committed for p in lens)
            if committed + 1 > self.max_model_len or max(lens, default=0) >= self.max_model_len:
                raise ValueError(f"sequence {sid!r} would pass max_model_len={self.max_model_len}")
            lane_pad = num_lanes - len(toks)
            input_ids.append([0] * pad + list(feed) + list(toks) + [0] * lane_pad)
            position_ids.append([0] * pad + list(range(start, committed)) + list(lens) + [committed] * lane_pad)
            # Padding of the feed writes to depth 1's slots, which no query of this call sees and depth 1 rewrites.
            lanes = [committed + b for b in range(num_lanes)]
            row_slots = [committed + num_lanes + i for i in range(pad)] + list(range(start, committed)) + lanes
            slots.append(row_slots)
            prefix.append([s + 1 for s in row_slots[:pad + n]] + list(lens) + [1] * lane_pad)
            lane_start.append([0] * (pad + n) + lanes)
            stride.append([0] * (pad + n) + [num_lanes] * num_lanes)
            lane_end.append([0] * (pad + n) + lanes)
        dev = self.device
        slot_t = torch.tensor(slots, device=dev)
        logits = self._run(rows, input_ids, position_ids, slot_t, torch.tensor(prefix, device=dev), torch.tensor(lane_start, device=dev),
                           torch.tensor(stride, device=dev), torch.tensor(lane_end, device=dev), num_lanes + 1,
                           max(max(s) for s in slots))
        for row, feed in zip(rows, feeds):  # commit only after the forward succeeded
            self._length[row] += len(feed)
        return logits[:, 0], logits[:, 1:]

    def _run(self, rows, input_ids, position_ids, slots, prefix_len, lane_start, lane_stride, lane_end, keep, max_slot,
             hidden_states=None):
        """One model call. Query q of row r may see slot s when s < prefix_len[r, q], or when
        s is on its lane: lane_start <= s <= lane_end and (s - lane_start) % lane_stride == 0."""
        dev = self.device
        kv_len = self.cache.prepare(torch.tensor(rows, device=dev), slots, rows, max_slot)
        s = torch.arange(kv_len, device=dev)[None, None, :]
        allowed = s < prefix_len[..., None]
        lanes = lane_stride > 0
        if bool(lanes.any()):  # .any(): branch trees only
            off = s - lane_start[..., None]
            on_lane = (off >= 0) & (s <= lane_end[..., None]) & (off % lane_stride.clamp_min(1)[..., None] == 0)
            allowed |= on_lane & lanes[..., None]
        mask = torch.zeros(allowed.shape, dtype=self.dtype, device=dev).masked_fill_(~allowed, torch.finfo(self.dtype).min)
        extra = {"hidden_states": hidden_states} if hidden_states is not None else {}
        if self.capture_layers:
            extra["output_hidden_states"] = True
        kernels = sdpa_kernel(list(CUDA_SDPA_BACKENDS)) if dev.type == "cuda" and CUDA_SDPA_BACKENDS else contextlib.nullcontext()
        inputs = dict(input_ids=torch.tensor(input_ids, device=dev), position_ids=torch.tensor(position_ids, device=dev),
                      attention_mask=mask[:, None],  # [batch_size, 1, width, kv_len]
                      past_key_values=self.cache, use_cache=True, logits_to_keep=keep, **extra)
        with kernels:
            try:
                out = self.model(**inputs)
            except Exception as exc:
                if not self.compiled:
                    raise
                # A shape the warm-up did not foresee failed to compile: eager from now on (it rewrites the
                # same cache slots, so the call is simply made again).
                logger.warning("compiled forward failed, running eager from now on: %s: %s", type(exc).__name__, _first_line(exc))
                self.model, self.compiled = self._eager, False
                out = self.model(**inputs)
        # HF's hidden_states[i] is the input of layer i (vLLM's aux layer id i); the last is the final, normed output.
        self.captured = (torch.cat([out.hidden_states[i] for i in self.capture_layers], dim=-1)
                         if self.capture_layers else None)
        self.last_hidden = getattr(out, "hidden", None)
        logits = out.logits[:, -keep:]
        return logits if logits.dtype == torch.float64 else logits.float()
