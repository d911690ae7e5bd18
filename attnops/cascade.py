"""Cascade attention: a batch whose sequences share a prefix reads the prefix's pages once for all of them.

    out = attnops.cascade_attention(q, k_cache, v_cache, prefix_table, prefix_len, block_table, seq_lens)

Attention over a sequence's keys is the softmax merge of attention over any split of them. Here the split is the
shared prefix (the same pages for every sequence) and each sequence's own suffix:
1. the prefix pass: every query row of the batch against the prefix's keys, as one block of query rows of one
   sequence that see no key of their own block (a tree mask of all False): the prefix's pages are read once per
   KV head for the whole batch, and the work becomes a dense multi-query tile instead of B memory-bound decodes;
2. the suffix pass: the usual paged attention over each sequence's own pages, positions counted from the end
   of the prefix (`seq_lens` are the suffix lengths, `block_table` the suffix pages);
3. `merge_attention_states` of the two by their log-sum-exps; sinks, when given, join once, after the merge.

Both passes are `paged_attention_with_lse` calls and the glue is plain torch on device tensors (the prefix
length is a tensor), so the whole is traced by torch.compile and captured by a CUDA graph like the op itself.
"""
from __future__ import annotations

import torch

from .ops import merge_attention_states, paged_attention_with_lse


def _prefix_pass_inputs(prefix_table: torch.Tensor, prefix_len: torch.Tensor, page_size: int, num_rows: int):
    """The prefix pass's block table [1, P + ceil(T / page)], length [1] and tree mask [T, T]: the T query rows
    are placed right after the prefix (positions prefix_len ... prefix_len + T - 1) and see none of them, so
    their positions only need a page the kernel may read: page 0 past the prefix's own pages (their keys are
    masked out; page 0 exists in any cache with pages)."""
    extra = -(-num_rows // page_size)
    width = prefix_table.shape[0] + extra
    prefix_pages = torch.div(prefix_len + page_size - 1, page_size, rounding_mode="floor")
    index = torch.arange(width, device=prefix_table.device)
    padded = torch.cat((prefix_table, prefix_table.new_zeros(extra)))
    table = torch.where(index < prefix_pages, padded, torch.zeros_like(padded))
    lens = (prefix_len + num_rows).to(torch.int32)
    tree_mask = torch.zeros(num_rows, num_rows, dtype=torch.bool, device=prefix_table.device)
    return table.view(1, width), lens.view(1), tree_mask


def cascade_attention(q, k_cache, v_cache, prefix_table, prefix_len, block_table, seq_lens, cu_seqlens_q=None, *,
                      scale=None, soft_cap=0.0, kv_format="auto", k_scale=None, v_scale=None, sinks=None):
    """paged_attention over a shared prefix and per-sequence suffixes, reading the prefix once.

    q: [T, Hq, D], the batch's query rows (decode: one a sequence; with cu_seqlens_q: each sequence's last
    positions, as in paged_attention); prefix_table: int32 [P], the pages of the prefix every sequence starts with;
    prefix_len: int32 [1], its tokens (at most P x page_size; 0: no prefix); block_table [B, W] and seq_lens [B]:
    each sequence's own pages and tokens after the prefix (including this step's). The other arguments as
    paged_attention's; sliding windows and tree masks are not offered (their positions would have to be shifted
    by the prefix). Equal to paged_attention over the concatenated pages, up to rounding."""
    if prefix_table.dim() != 1 or prefix_table.dtype != torch.int32:
        raise ValueError(f"attnops.cascade_attention: prefix_table must be int32 [P] (got {prefix_table.dtype} "
                         f"{list(prefix_table.shape)})")
    if not isinstance(prefix_len, torch.Tensor) or prefix_len.numel() != 1 or prefix_len.dtype != torch.int32:
        raise ValueError("attnops.cascade_attention: prefix_len must be an int32 tensor of one element (a tensor, "
                         "so that a compiled or captured step takes a new length without recompiling)")
    if prefix_table.device != q.device or prefix_len.device != q.device:
        raise ValueError(f"attnops.cascade_attention: prefix_table and prefix_len must be on q's device {q.device}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],)
                              or sinks.dtype != torch.float32):
        raise ValueError(f"attnops.cascade_attention: sinks must be a float32 tensor [num_q_heads={q.shape[1]}]")
    common = dict(scale=scale, soft_cap=soft_cap, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale)
    table, lens, tree_mask = _prefix_pass_inputs(prefix_table, prefix_len.view(-1), k_cache.shape[1], q.shape[0])
    rows = torch.arange(2, dtype=torch.int32, device=q.device) * q.shape[0]  # [0, T], made on the device (capture)
    out_prefix, lse_prefix = paged_attention_with_lse(q, k_cache, v_cache, table, lens, rows, tree_mask=tree_mask,
                                                      **common)
    out_own, lse_own = paged_attention_with_lse(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, **common)
    out, lse = merge_attention_states(out_prefix, lse_prefix, out_own, lse_own, out=out_own, lse=lse_own)
    if sinks is not None:  # the sink's e^s joins the denominator: out x e^lse / (e^lse + e^s)
        out = (out.float() * torch.sigmoid(lse - sinks)[..., None]).to(out.dtype)
    return out


def shared_prefix_pages(tables: list[list[int]], lengths: list[int], page_size: int) -> int:
    """How many leading full pages every sequence of a batch holds in common (the same page ids), leaving each at
    least one key of its own: what cascade_attention can read once."""
    if not tables:
        return 0
    limit = min((n - 1) // page_size for n in lengths)
    first = tables[0]
    count = 0
    while count < limit and all(len(t) > count and t[count] == first[count] for t in tables):
        count += 1
    return count


def cascade_pays(batch: int, prefix_tokens: int) -> bool:
    """Whether a decode step should read a shared prefix through cascade_attention: the prefix's bytes saved,
    (batch - 1) x prefix_tokens, must outweigh the pass's extra launches (a prefix pass, a merge), a few
    microseconds; the crossover is measured by `python -m attnops bench --grid cascade` (docs/bench.md)."""
    return batch >= 2 and (batch - 1) * prefix_tokens >= CASCADE_MIN_SAVED_TOKENS


CASCADE_MIN_SAVED_TOKENS = 16384
