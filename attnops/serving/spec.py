"""Speculative decoding with draft trees: the tree mask of a block of draft tokens, from each token's parent.

A draft tree of n tokens (EAGLE-style top-k drafting) is laid out as one query block of n rows after the sequence's
committed tokens: row i is draft token i, and parents[i] is the index of its parent in the block, or -1 for a token
whose parent is the last committed token. Token i sees every committed token, itself and its ancestors:

    mask = tree_mask_from_parents([[-1, 0, 0, 1, 2]])    # a root, two children, a grandchild under each
    out = torch.ops.attnops.paged_attention(q, ..., cu_seqlens_q=cu, tree_mask=mask)

After verification the accepted path's tokens are moved to the front of the block and the rest dropped:
PagedKVCache.keep_path(seq_id, block_start, path).
"""
from __future__ import annotations

import torch


def tree_mask_from_parents(parents: list[list[int]], width: int | None = None, device=None) -> torch.Tensor:
    """The tree masks of several sequences' draft blocks, stacked in query-row order: bool [sum of n_b, width],
    row i of block b true at its own column and at every ancestor's. width (default: the longest block) is the Q of
    paged_attention's tree_mask, fixed when a CUDA graph holds the mask; columns past a block's size are false."""
    width = max((len(p) for p in parents), default=1) if width is None else width
    rows = []
    for b, block in enumerate(parents):
        if len(block) > width:
            raise ValueError(f"tree_mask_from_parents: block {b} has {len(block)} tokens, more than width={width}")
        mask = torch.zeros(len(block), width, dtype=torch.bool)
        for i, parent in enumerate(block):
            if not -1 <= parent < i:
                raise ValueError(f"tree_mask_from_parents: parents[{b}][{i}] = {parent}: a token's parent is -1 "
                                 f"(the committed sequence) or an earlier token of its block")
            mask[i, i] = True
            if parent >= 0:
                mask[i] |= mask[parent]
        rows.append(mask)
    out = torch.cat(rows) if rows else torch.zeros(0, width, dtype=torch.bool)
    return out if device is None else out.to(device)
