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
        for name, tensor in inputs.items():
            tensor.fill_(PADDING[name])
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
