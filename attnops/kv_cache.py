"""PagedKVCache: the cache tensors, a page allocator, and the per-step metadata the ops take.

For users with no serving engine of their own, and for the demo, tests and benchmarks. Each layer's K and V are
views of one [num_pages, 2, page_size, Hkv, D] tensor (FlashInfer's layout).
"""
from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from . import formats


@dataclass
class BatchMetadata:
    """What paged_attention and reshape_and_cache need for one step of a batch."""

    seq_ids: list
    block_table: torch.Tensor  # int32 [B, max_pages]; -1 past each sequence's last page
    seq_lens: torch.Tensor  # int32 [B], counting this step's tokens
    slot_mapping: torch.Tensor  # int64 [T], where this step's tokens go
    cu_seqlens_q: torch.Tensor | None  # int32 [B+1]; None for decode (one token per sequence)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]


class PagedKVCache:
    """KV cache of `num_layers` layers in pages of `page_size` tokens.

    kv_format: "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2" (k_scale/v_scale: float32 per tensor or [Hkv],
    default 1.0), "nvfp4" or "mxfp4" (block scales kept beside the cache).
    shuffle_pages: hand out pages in random order, as a real allocator's free list ends up (benchmarks use it).
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 kv_format: str = "bf16", device="cpu", k_scale: torch.Tensor | float | None = None,
                 v_scale: torch.Tensor | float | None = None, shuffle_pages: bool = False, seed: int = 0):
        if kv_format not in formats.KV_FORMATS:
            raise ValueError(f"PagedKVCache: kv_format must be one of {formats.KV_FORMATS} (got {kv_format!r})")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.kv_format = num_kv_heads, head_dim, kv_format
        self.device = torch.device(device)
        storage_dtype = {v: k for k, v in {**formats.PLAIN_FORMATS, **formats.FP8_FORMATS}.items()}.get(
            kv_format, torch.uint8)
        shape = (num_pages, 2, page_size, num_kv_heads, formats.stored_head_dim(kv_format, head_dim))
        self.kv = [torch.zeros(shape, dtype=storage_dtype, device=self.device) for _ in range(num_layers)]
        self.block_scales = None
        if formats.is_fp4(kv_format):
            scale_shape = (*shape[:4], head_dim // formats.FP4_BLOCK[kv_format])
            self.block_scales = [torch.zeros(scale_shape, dtype=formats.FP4_SCALE_DTYPE[kv_format],
                                             device=self.device) for _ in range(num_layers)]
        self.k_scale = self.v_scale = None
        if formats.is_fp8(kv_format):
            self.k_scale = torch.as_tensor(1.0 if k_scale is None else k_scale, dtype=torch.float32,
                                           device=self.device)
            self.v_scale = torch.as_tensor(1.0 if v_scale is None else v_scale, dtype=torch.float32,
                                           device=self.device)
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        if shuffle_pages:
            random.Random(seed).shuffle(self._free_pages)
        self._pages: dict = {}  # seq_id -> list of page indices
        self._lengths: dict = {}  # seq_id -> tokens stored

    # --- the tensors the ops take, per layer ---------------------------------------------------------------------
    @property
    def op_kv_format(self) -> str:
        """The ops' kv_format argument: 4-bit formats are named, the rest read from the dtype."""
        return self.kv_format if formats.is_fp4(self.kv_format) else "auto"

    def attention_args(self, layer: int) -> dict:
        """Keyword arguments of paged_attention for `layer`: k_cache, v_cache, kv_format, k_scale, v_scale."""
        kv = self.kv[layer]
        args = dict(k_cache=kv[:, 0], v_cache=kv[:, 1], kv_format=self.op_kv_format)
        if self.block_scales is not None:
            args.update(k_scale=self.block_scales[layer][:, 0], v_scale=self.block_scales[layer][:, 1])
        elif self.k_scale is not None:
            args.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return args

    def write_args(self, layer: int) -> dict:
        """Keyword arguments of reshape_and_cache for `layer`."""
        kv = self.kv[layer]
        args = dict(k_cache=kv[:, 0], v_cache=kv[:, 1], kv_format=self.op_kv_format)
        if self.block_scales is not None:
            args.update(k_block_scale=self.block_scales[layer][:, 0], v_block_scale=self.block_scales[layer][:, 1])
        elif self.k_scale is not None:
            args.update(k_scale=self.k_scale, v_scale=self.v_scale)
        return args

    # --- the allocator -------------------------------------------------------------------------------------------
    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def allocate(self, seq_id) -> None:
        if seq_id in self._pages:
            raise ValueError(f"PagedKVCache.allocate: sequence {seq_id!r} already exists")
        self._pages[seq_id], self._lengths[seq_id] = [], 0

    def free(self, seq_id) -> None:
        self._free_pages.extend(reversed(self._pages.pop(seq_id)))
        del self._lengths[seq_id]

    def seq_len(self, seq_id) -> int:
        return self._lengths[seq_id]

    def prepare(self, seq_ids: list, num_new_tokens: list[int] | int = 1, *, decode: bool | None = None,
                max_pages: int | None = None) -> BatchMetadata:
        """Reserves slots for each sequence's new tokens and returns the step's metadata.

        decode: one token per sequence and cu_seqlens_q None; by default, when every sequence adds one token.
        max_pages: width of block_table (default: the most any sequence of the batch needs)."""
        if isinstance(num_new_tokens, int):
            num_new_tokens = [num_new_tokens] * len(seq_ids)
        if decode is None:
            decode = all(n == 1 for n in num_new_tokens)
        if decode and any(n != 1 for n in num_new_tokens):
            raise ValueError("PagedKVCache.prepare: decode=True needs one new token per sequence")
        needed = sum(max(0, -(-(self._lengths[s] + n) // self.page_size) - len(self._pages[s]))
                     for s, n in zip(seq_ids, num_new_tokens))
        if needed > len(self._free_pages):
            raise RuntimeError(f"PagedKVCache: out of pages ({needed} needed, {len(self._free_pages)} free)")
        slots, lengths = [], []
        for seq_id, n in zip(seq_ids, num_new_tokens):
            pages, start = self._pages[seq_id], self._lengths[seq_id]
            while len(pages) * self.page_size < start + n:
                pages.append(self._free_pages.pop())
            slots.extend(pages[p // self.page_size] * self.page_size + p % self.page_size
                         for p in range(start, start + n))
            self._lengths[seq_id] = start + n
            lengths.append(start + n)
        width = max([len(self._pages[s]) for s in seq_ids] + [1]) if max_pages is None else max_pages
        table = [self._pages[s] + [-1] * (width - len(self._pages[s])) for s in seq_ids]
        cu = None
        if not decode:
            cu = [0]
            for n in num_new_tokens:
                cu.append(cu[-1] + n)
            cu = torch.tensor(cu, dtype=torch.int32, device=self.device)
        return BatchMetadata(
            seq_ids=list(seq_ids),
            block_table=torch.tensor(table, dtype=torch.int32, device=self.device).reshape(len(seq_ids), width),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=self.device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=self.device),
            cu_seqlens_q=cu)
