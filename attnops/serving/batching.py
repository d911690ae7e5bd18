"""Batch-size buckets and the static decode inputs of each: the one place that decides how a batch is padded to
fixed shapes (what torch.compile with static shapes and a CUDA graph per bucket need). DecodeStep and
DecodeGraphRunner both read their inputs from here."""
from __future__ import annotations

import torch

from .kv_cache import BatchMetadata

# what a padding row holds: no token written (slot -1), no key read (length 0, pages -1); its output row is 0
PADDING = dict(token_ids=0, positions=0, block_table=-1, seq_lens=0, slot_mapping=-1)


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """Powers of two below max_batch, and max_batch: padding wastes at most half a step."""
    sizes, n = [], 1
    while n < max_batch:
        sizes.append(n)
        n *= 2
    return tuple(sizes + [max_batch])


class StaticDecodeInputs:
    """Per bucket, the decode step's input tensors at fixed shapes ([bucket], block tables [bucket, max_pages]),
    made on first use and then only written in place, so that a graph captured over them stays valid."""

    def __init__(self, buckets, max_pages: int, device, owner: str = "decode step"):
        self.buckets = tuple(sorted(buckets))
        self.max_pages, self.device, self.owner = max_pages, torch.device(device), owner
        self._buffers: dict = {}

    def bucket_for(self, batch: int) -> int:
        for n in self.buckets:
            if n >= batch:
                return n
        raise ValueError(f"{self.owner}: batch {batch} exceeds the largest bucket {self.buckets[-1]}")

    def __getitem__(self, bucket: int) -> dict:
        if bucket not in self._buffers:
            dev = self.device
            self._buffers[bucket] = dict(
                token_ids=torch.full((bucket,), PADDING["token_ids"], dtype=torch.int64, device=dev),
                positions=torch.full((bucket,), PADDING["positions"], dtype=torch.int64, device=dev),
                block_table=torch.full((bucket, self.max_pages), PADDING["block_table"], dtype=torch.int32,
                                       device=dev),
                seq_lens=torch.full((bucket,), PADDING["seq_lens"], dtype=torch.int32, device=dev),
                slot_mapping=torch.full((bucket,), PADDING["slot_mapping"], dtype=torch.int64, device=dev))
        return self._buffers[bucket]

    def pad(self, bucket: int) -> dict:
        """Makes every row of the bucket's inputs padding; returns them."""
        inputs = self[bucket]
        for name, value in PADDING.items():
            inputs[name].fill_(value)
        return inputs

    def fill(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata) -> tuple[int, dict]:
        """Writes a batch's live rows into its bucket's inputs and pads the rest; returns (bucket, inputs)."""
        batch, width = meta.block_table.shape
        if width > self.max_pages:
            raise ValueError(f"{self.owner}: block_table has {width} pages per row, above max_pages "
                             f"{self.max_pages}")
        bucket = self.bucket_for(batch)
        inputs = self[bucket]
        for name, live in (("token_ids", token_ids), ("positions", positions), ("seq_lens", meta.seq_lens),
                           ("slot_mapping", meta.slot_mapping)):
            inputs[name][:batch].copy_(live, non_blocking=True)
            inputs[name][batch:].fill_(PADDING[name])  # rows a larger batch left behind are padding again
        table = inputs["block_table"]
        table[:batch, :width].copy_(meta.block_table, non_blocking=True)
        table[:batch, width:].fill_(PADDING["block_table"])
        table[batch:].fill_(PADDING["block_table"])
        return bucket, inputs


class StaticCascadeInputs(StaticDecodeInputs):
    """The static inputs of a cascade decode step (attnops.cascade_attention in every layer): the decode step's,
    and per bucket the prefix pass's (PrefixPass: a one-row block table of max_pages + the bucket's own rows,
    the length, the row offsets [0, bucket], an all-False tree mask) and the suffix pass's table and lengths.
    The prefix pass always has the bucket's rows (a padding row sees the prefix too; its output is ignored)."""

    def __init__(self, buckets, max_pages: int, page_size: int, device, owner: str = "decode step"):
        super().__init__(buckets, max_pages, device, owner)
        self.page_size = page_size

    def __getitem__(self, bucket: int) -> dict:
        if bucket not in self._buffers:
            inputs = super().__getitem__(bucket)
            dev, width = self.device, self.max_pages + -(-bucket // self.page_size)
            inputs.update(
                prefix_block_table=torch.zeros((1, width), dtype=torch.int32, device=dev),
                prefix_seq_lens=torch.full((1,), bucket, dtype=torch.int32, device=dev),
                prefix_cu_seqlens_q=torch.tensor([0, bucket], dtype=torch.int32, device=dev),
                prefix_tree_mask=torch.zeros((bucket, bucket), dtype=torch.bool, device=dev),
                suffix_block_table=torch.full((bucket, self.max_pages), -1, dtype=torch.int32, device=dev),
                suffix_seq_lens=torch.zeros((bucket,), dtype=torch.int32, device=dev))
        return self._buffers[bucket]

    def pad(self, bucket: int) -> dict:
        """Every row padding and no prefix (the prefix pass's rows then see no key)."""
        inputs = super().pad(bucket)
        inputs["prefix_block_table"].fill_(0)
        inputs["prefix_seq_lens"].fill_(bucket)
        inputs["suffix_block_table"].fill_(-1)
        inputs["suffix_seq_lens"].fill_(0)
        return inputs

    def fill(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: BatchMetadata) -> tuple[int, dict]:
        """The decode step's rows and meta.cascade's split (PagedKVCache.cascade_split)."""
        bucket, inputs = super().fill(token_ids, positions, meta)
        split = meta.cascade
        batch, own_width = split.block_table.shape
        shared = len(split.prefix_pages)
        table = inputs["prefix_block_table"]
        pages = torch.tensor(split.prefix_pages, dtype=torch.int32)  # from the host's list: one copy, no sync
        table[:, :shared].copy_(pages.pin_memory() if table.is_cuda else pages, non_blocking=True)
        table[:, shared:].fill_(0)  # past the prefix: a page the kernel may read for rows that see none of it
        inputs["prefix_seq_lens"].fill_(split.prefix_tokens + bucket)
        suffix = inputs["suffix_block_table"]
        suffix[:batch, :own_width].copy_(split.block_table, non_blocking=True)
        suffix[:batch, own_width:].fill_(-1)
        suffix[batch:].fill_(-1)
        lens = inputs["suffix_seq_lens"]
        lens[:batch].copy_(split.seq_lens, non_blocking=True)
        lens[batch:].fill_(0)
        return bucket, inputs
