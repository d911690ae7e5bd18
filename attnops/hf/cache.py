"""PagedCache: a transformers `Cache` whose keys and values live in an attnops PagedKVCache (any KV format), for
`model.generate(..., past_key_values=PagedCache(model.config, max_cache_len=...))` with
attn_implementation="attnops".

Each row of the batch is one sequence of the PagedKVCache. transformers calls `update(key, value, layer)` in each
attention layer before its attention function; `update` writes nothing (which tokens are padding is known only from
the attention mask, which the attention function gets): it hands the cache to that layer's attention call, which
writes the valid new tokens with reshape_and_cache and attends with paged_attention. The step's metadata (slots,
block table, lengths) is built once per forward, at its first layer.

Lengths follow transformers' convention: `get_seq_length()` counts the columns processed so far, padding included
(what generate's attention mask and positions are laid out on); the PagedKVCache holds only the valid tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from transformers import Cache

from .. import formats
from ..serving.kv_cache import BatchMetadata, PagedKVCache, _fp8_scale
from .attention import PLAIN_FORMATS, _index, _rows, _unpack, hand_over, padding_rows, unread_hand_over
from .serving import model_shape


@dataclass
class _Step:
    """One forward's metadata, shared by its layers."""

    meta: BatchMetadata
    index: torch.Tensor | None  # flat rows of the valid new tokens, or None when every one is valid
    batch: int
    q_len: int
    # n -> the step with only each row's last n queries (PagedCache._last_positions), made once for its layers
    last_positions: dict = field(default_factory=dict)


class StepCache(Cache):
    """What transformers asks of attnops' caches (PagedCache, and LatentCache in attnops.hf.mla): every row advances
    by the same `_columns` positions a forward (padding included), up to `_max_cache_len`; no compile (a step's
    metadata is built from the padding mask on the host: attnops' own serving loop is the compiled path), no crop,
    beam search or batch reshaping (each a ValueError naming the cache)."""

    _columns = 0
    _max_cache_len = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self._columns + query_length, 0

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self._columns

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_cache_len

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_croppable(self) -> bool:
        return False

    def reorder_cache(self, beam_idx: torch.LongTensor):
        raise ValueError(f"{type(self).__name__}: beam search (reorder_cache) is not supported")

    def crop(self, max_length: int) -> None:
        raise ValueError(f"{type(self).__name__}: crop (assisted decoding) is not supported")

    def batch_repeat_interleave(self, repeats: int):
        raise ValueError(f"{type(self).__name__}: batch_repeat_interleave is not supported: expand the inputs "
                         "before the first forward (generate's num_return_sequences does)")

    def batch_select_indices(self, indices: torch.Tensor):
        raise ValueError(f"{type(self).__name__}: batch_select_indices is not supported")


class PagedCache(StepCache):
    """The KV cache of `config`'s model in attnops pages.

    max_cache_len: the most tokens a row holds (prompt and generated, padding excluded); the pages, batch x
    max_cache_len / page_size unless num_pages is given, are allocated at the first forward, on its device.
    kv_format: any of attnops' formats ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"); default:
    the model's activation dtype. k_scale/v_scale: fp8 scales (per tensor or [num_kv_heads]; default 1.0).
    One batch per cache: `reset()` empties it for the next one.
    """

    def __init__(self, config, *, max_cache_len: int, kv_format: str | None = None, page_size: int = 16,
                 num_pages: int | None = None, k_scale=None, v_scale=None):
        super().__init__(layers=[])
        self.shape = model_shape(config)
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"PagedCache: max_cache_len must be a positive int (got {max_cache_len!r})")
        if kv_format is not None and kv_format not in formats.KV_FORMATS:
            raise ValueError(f"PagedCache: kv_format must be one of {formats.KV_FORMATS} (got {kv_format!r})")
        if num_pages is not None and (not isinstance(num_pages, int) or num_pages < 1):
            raise ValueError(f"PagedCache: num_pages must be a positive int (got {num_pages!r})")
        if not isinstance(page_size, int) or not 1 <= page_size <= 256 or page_size & (page_size - 1):
            raise ValueError(f"PagedCache: page_size must be a power of two from 1 to 256 (got {page_size!r})")
        self._max_cache_len = max_cache_len  # (transformers 5.17 has a read-only max_cache_len property)
        self.kv_format, self.page_size, self.num_pages = kv_format, page_size, num_pages
        if kv_format is not None and formats.is_fp8(kv_format):  # (checked now, not at the first forward)
            for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
                _fp8_scale("PagedCache", name, scale, "cpu" if not isinstance(scale, torch.Tensor) else scale.device)
        self.k_scale, self.v_scale = k_scale, v_scale
        self.kv: PagedKVCache | None = None  # made at the first forward (its batch, device and dtype)
        self._batch = 0  # rows (sequences) in the cache; 0 until the first forward, and after reset()
        self._columns = 0  # positions processed per row, padding included
        self._last_layer = None  # the layer of the latest update: a layer at or below it starts a new forward
        self._step: _Step | None = None

    # --- what transformers asks of a Cache ---------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        new_forward = self._last_layer is None or layer_idx <= self._last_layer
        if unread_hand_over(self, layer_idx, new_forward):
            raise ValueError("PagedCache: an attention layer did not read the cache it was handed; PagedCache "
                             "needs the model loaded with attn_implementation='attnops' (import attnops.hf first)")
        if new_forward:
            self._columns += key_states.shape[2]
            self._step = None
        self._last_layer = layer_idx
        hand_over(self, layer_idx, key_states)
        for shared, source in self.shape.shared_layers:  # (they read this layer's keys: no update of their own)
            if source == layer_idx:
                hand_over(self, shared, key_states)
        return key_states, value_states

    @property
    def is_initialized(self) -> bool:
        return self.kv is not None

    @property
    def batch_size(self) -> int:
        return self._batch or -1

    def __len__(self) -> int:
        return self.shape.num_hidden_layers

    def reset(self) -> None:
        """Empties the cache (its pages stay allocated) for a new batch."""
        if self.kv is not None:
            for b in range(self._batch):
                self.kv.free(b)
        self._batch, self._columns, self._last_layer, self._step = 0, 0, None, None

    # --- attnops ---------------------------------------------------------------------------------------------
    def _pages_for(self, batch: int, key: torch.Tensor) -> None:
        """The PagedKVCache and one sequence per row, at the first forward."""
        kv_format = self.kv_format or PLAIN_FORMATS.get(key.dtype)
        if kv_format is None:
            raise TypeError(f"PagedCache: keys of dtype {key.dtype} need an explicit kv_format")
        pages_per_row = -(-self._max_cache_len // self.page_size)
        if self.kv is not None and self.num_pages is None and batch * pages_per_row > self.kv.num_pages:
            raise ValueError(f"PagedCache: its pages were sized for {self.kv.num_pages // pages_per_row} rows of "
                             f"max_cache_len={self._max_cache_len}; this batch has {batch}: make a new cache (or "
                             f"give num_pages)")
        if self.kv is None:
            num_pages = self.num_pages or batch * pages_per_row
            self.kv = PagedKVCache(self.shape.num_hidden_layers, num_pages, self.page_size,
                                   **self.shape.cache_layout(), kv_format=kv_format,
                                   device=key.device, k_scale=self.k_scale, v_scale=self.v_scale)
        for b in range(batch):
            self.kv.allocate(b)
        self._batch = batch

    def _prepare(self, query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None) -> _Step:
        batch, q_len = query.shape[0], query.shape[2]
        if self._batch and batch != self._batch:
            raise ValueError(f"PagedCache: this cache holds a batch of {self._batch} rows, the forward has {batch}: "
                             f"reset() it for a new batch")
        if attention_mask is None:
            counts, index = [q_len] * batch, None
        else:
            valid = padding_rows(attention_mask, batch, self._columns, "attnops attention")[:, -q_len:]
            counts = valid.sum(-1).tolist()
            index = None if all(n == q_len for n in counts) else _index(valid, query.device)
        for b, n in enumerate(counts):
            held = self.kv.seq_len(b) if self._batch else 0
            if held + n > self._max_cache_len:
                raise ValueError(f"PagedCache: row {b} would hold {held + n} tokens, over "
                                 f"max_cache_len={self._max_cache_len}")
        if not self._batch:
            self._pages_for(batch, key)
        meta = self.kv.prepare(list(range(batch)), counts, decode=q_len == 1 and index is None)
        return _Step(meta, index, batch, q_len)

    def _last_positions(self, n: int, attention_mask: torch.Tensor | None, device) -> _Step:
        """The step with only each row's last n query positions: its pages and lengths, their own query rows (a
        KV-shared layer of Gemma-4 attends only those when a prefill keeps the last logits only); made once a
        forward, for all its shared layers."""
        if n > self._step.q_len:
            raise ValueError(f"PagedCache: a layer's {n} queries are more than the forward's {self._step.q_len}")
        if n in self._step.last_positions:
            return self._step.last_positions[n]
        batch = self._step.batch
        if attention_mask is None:
            counts, index = [n] * batch, None
        else:
            valid = padding_rows(attention_mask, batch, self._columns, "attnops attention")[:, -n:]
            counts = valid.sum(-1).tolist()
            index = None if all(c == n for c in counts) else _index(valid, device)
        cu = None
        if not (n == 1 and index is None):
            cu = torch.tensor([0] + counts, dtype=torch.int32).cumsum(0).to(device, torch.int32)
        meta = dataclasses.replace(self._step.meta, cu_seqlens_q=cu, cascade=None)
        self._step.last_positions[n] = _Step(meta, index, batch, n)
        return self._step.last_positions[n]

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, options: dict) -> torch.Tensor:
        """Writes the layer's valid new keys and values into the pages and attends; returns [B, S, Hq, D]."""
        if self._step is None:
            self._step = self._prepare(query, key, attention_mask)
        step = self._step
        if layer in self.kv.shared_layers:  # a KV-shared layer reads an earlier layer's pages and writes none
            if query.shape[2] != step.q_len:  # (Gemma-4's, in a prefill that keeps the last logits only)
                step = self._last_positions(query.shape[2], attention_mask, query.device)
            queries = _rows(query)
            if step.index is not None:
                queries = queries.index_select(0, step.index)
        else:
            keys, values, queries = _rows(key), _rows(value), _rows(query)
            if step.index is not None:
                keys, values, queries = (t.index_select(0, step.index) for t in (keys, values, queries))
            torch.ops.attnops.reshape_and_cache(keys, values, slot_mapping=step.meta.slot_mapping,
                                                **self.kv.write_args(layer))
        meta = step.meta
        out = torch.ops.attnops.paged_attention(queries, block_table=meta.block_table, seq_lens=meta.seq_lens,
                                                cu_seqlens_q=meta.cu_seqlens_q, **self.kv.attention_args(layer),
                                                **options)
        return _unpack(out, step.index, step.batch, step.q_len)
