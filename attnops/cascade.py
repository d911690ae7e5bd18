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

from typing import NamedTuple

import torch

from . import errors
from .checks import MAX_PAGE_SIZE, check_cascade_prefix_values, is_page_size
from .env import values_checked
from .ops import merge_attention_states, paged_attention_with_lse


class PrefixPass(NamedTuple):
    """paged_attention_with_lse's arguments for the prefix pass: the T query rows as one block of one sequence,
    placed right after the prefix and seeing none of their own block. The same for every layer of a step, so a
    serving loop makes it once a step (prefix_pass(), or on the host: PagedKVCache.cascade_split)."""

    block_table: torch.Tensor  # int32 [1, P + ceil(T / page_size)]
    seq_lens: torch.Tensor  # int32 [1]: prefix_len + T
    cu_seqlens_q: torch.Tensor  # int32 [2]: [0, T]
    tree_mask: torch.Tensor  # bool [T, max(T, 1)], all False
    # bool [1] on the device: the caller's prefix_len or prefix_table was bad (every row of the result is NaN);
    # None where the prefix came from the host, which checked it
    bad: torch.Tensor | None = None


def _check_page_size(function: str, page_size) -> None:
    # (not isinstance(int): under torch.compile a cache's page size may be a SymInt)
    if isinstance(page_size, (bool, float)) or not is_page_size(page_size):
        raise ValueError(f"attnops.cascade.{function}: page_size must be a power of two from 1 to {MAX_PAGE_SIZE} "
                         f"(got {page_size!r})")


def prefix_pass(prefix_table: torch.Tensor, prefix_len: torch.Tensor, page_size: int, num_rows: int,
                num_pages: int | None = None) -> PrefixPass:
    """The prefix pass's inputs, made on the device from the prefix's pages and length (graph-safe: no host sync).
    The T rows' own positions (prefix_len ... prefix_len + T - 1) are never seen, so they only need a page the
    kernel may read: page 0 past the prefix's own pages (page 0 exists in any cache with pages).

    Bad indices follow the ops' rules (docs/design.md, "Bad indices"): a prefix_len outside
    [0, P x page_size], or a page of the prefix outside [0, num_pages) (checked when num_pages is given), reads
    no page of the prefix, marks the pass `bad` (cascade_attention makes every row NaN) and is recorded for
    attnops.take_errors() as "prefix_len" (position 0) or "prefix_table" (the first bad entry)."""
    _check_page_size("prefix_pass", page_size)
    device = prefix_table.device
    extra = -(-num_rows // page_size)
    width = prefix_table.shape[0] + extra
    length = prefix_len.view(-1)[:1]
    bad_len = (length < 0) | (length > prefix_table.shape[0] * page_size)
    length = torch.where(bad_len, 0, length)
    prefix_pages = torch.div(length + page_size - 1, page_size, rounding_mode="floor")
    index = torch.arange(width, device=device)
    padded = torch.cat((prefix_table, prefix_table.new_zeros(extra)))
    in_prefix = index < prefix_pages
    bad = bad_len
    if num_pages is not None:
        bad_page = in_prefix & ((padded < 0) | (padded >= num_pages))
        in_prefix = in_prefix & ~bad_page
        errors.record(device, errors.PREFIX_TABLE, torch.where(bad_page, index, errors.NONE).min())
        bad = bad | bad_page.any()
    errors.record(device, errors.PREFIX_LEN, torch.where(bad_len, 0, errors.NONE))
    table = torch.where(in_prefix, padded, torch.zeros_like(padded))
    return PrefixPass(block_table=table.view(1, width), seq_lens=(length + num_rows).to(torch.int32).view(1),
                      cu_seqlens_q=torch.arange(2, dtype=torch.int32, device=device) * num_rows,  # no host copy
                      tree_mask=torch.zeros(num_rows, max(num_rows, 1), dtype=torch.bool, device=device), bad=bad)


def host_prefix_pass(prefix_pages: list[int], prefix_tokens: int, page_size: int, num_rows: int,
                     device) -> PrefixPass:
    """prefix_pass() from the host's list of the prefix's pages: one copy a tensor, no device arithmetic (a
    serving loop that knows its pages)."""
    _check_page_size("host_prefix_pass", page_size)
    if not 0 <= prefix_tokens <= len(prefix_pages) * page_size:
        raise ValueError(f"attnops.cascade.host_prefix_pass: prefix_tokens must be in [0, {len(prefix_pages)} pages "
                         f"x {page_size}] (got {prefix_tokens})")
    used = -(-prefix_tokens // page_size)
    pages = [p if i < used else 0 for i, p in enumerate(prefix_pages)] + [0] * -(-num_rows // page_size)
    return PrefixPass(block_table=torch.tensor([pages], dtype=torch.int32, device=device),
                      seq_lens=torch.tensor([prefix_tokens + num_rows], dtype=torch.int32, device=device),
                      cu_seqlens_q=torch.tensor([0, num_rows], dtype=torch.int32, device=device),
                      tree_mask=torch.zeros(num_rows, max(num_rows, 1), dtype=torch.bool, device=device))


def cascade_attention(q, k_cache, v_cache, prefix_table, prefix_len, block_table, seq_lens, cu_seqlens_q=None, *,
                      scale=None, soft_cap=0.0, kv_format="auto", k_scale=None, v_scale=None, sinks=None,
                      prefix=None):
    """paged_attention over a shared prefix and per-sequence suffixes, reading the prefix once.

    q: [T, Hq, D], the batch's query rows (decode: one a sequence; with cu_seqlens_q: each sequence's last
    positions, as in paged_attention); prefix_table: int32 [P], the pages of the prefix every sequence starts with;
    prefix_len: int32 [1], its tokens (at most P x page_size; 0: no prefix); block_table [B, W] and seq_lens [B]:
    each sequence's own pages and tokens after the prefix (including this step's). The other arguments as
    paged_attention's; sliding windows and tree masks are not offered (their positions would have to be shifted
    by the prefix). prefix: the step's PrefixPass, made once for every layer (then prefix_table and prefix_len
    must be None: the pass is the prefix); by default made here from them. Equal to paged_attention over the
    concatenated pages, up to rounding."""
    # (what this function reads itself, before the ops' own checks: q's rows and heads, the cache's page size)
    for name, t in (("q", q), ("k_cache", k_cache)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"attnops.cascade_attention: {name} must be a Tensor (got {type(t).__name__})")
    if q.dim() != 3:
        raise ValueError(f"attnops.cascade_attention: q must be [num_tokens, num_q_heads, head_dim] (got "
                         f"{list(q.shape)})")
    if k_cache.dim() < 2 or not is_page_size(k_cache.shape[1]):
        raise ValueError(f"attnops.cascade_attention: k_cache must be [num_pages, page_size, ...] with a page_size "
                         f"of a power of two from 1 to {MAX_PAGE_SIZE} (got {list(k_cache.shape)})")
    if prefix is not None:
        if not isinstance(prefix, PrefixPass):
            raise TypeError(f"attnops.cascade_attention: prefix must be a PrefixPass (prefix_pass or "
                            f"host_prefix_pass; got {type(prefix).__name__})")
        if prefix_table is not None or prefix_len is not None:
            raise ValueError("attnops.cascade_attention: give the prefix as prefix= or as prefix_table and "
                             "prefix_len, not both (prefix= would be used and the others ignored)")
    else:
        if not isinstance(prefix_table, torch.Tensor) or prefix_table.dim() != 1 or prefix_table.dtype != torch.int32:
            got = (f"{prefix_table.dtype} {list(prefix_table.shape)}" if isinstance(prefix_table, torch.Tensor)
                   else type(prefix_table).__name__)
            raise ValueError(f"attnops.cascade_attention: prefix_table must be int32 [P] (got {got})")
        if not isinstance(prefix_len, torch.Tensor) or prefix_len.numel() != 1 or prefix_len.dtype != torch.int32:
            raise ValueError("attnops.cascade_attention: prefix_len must be an int32 tensor of one element (a "
                             "tensor, so that a compiled or captured step takes a new length without recompiling)")
        if prefix_table.device != q.device or prefix_len.device != q.device:
            raise ValueError(f"attnops.cascade_attention: prefix_table and prefix_len must be on q's device "
                             f"{q.device}")
        if values_checked():
            check_cascade_prefix_values(prefix_table, prefix_len, k_cache)
        prefix = prefix_pass(prefix_table, prefix_len.view(-1), k_cache.shape[1], q.shape[0], k_cache.shape[0])
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or sinks.shape != (q.shape[1],)
                              or sinks.dtype != torch.float32):
        raise ValueError(f"attnops.cascade_attention: sinks must be a float32 tensor [num_q_heads={q.shape[1]}]")
    common = dict(scale=scale, soft_cap=soft_cap, kv_format=kv_format, k_scale=k_scale, v_scale=v_scale)
    out_prefix, lse_prefix = paged_attention_with_lse(q, k_cache, v_cache, prefix.block_table, prefix.seq_lens,
                                                      prefix.cu_seqlens_q, tree_mask=prefix.tree_mask, **common)
    out_own, lse_own = paged_attention_with_lse(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, **common)
    if prefix.bad is not None:  # a NaN LSE makes its row NaN in the merge
        lse_prefix = torch.where(prefix.bad, torch.nan, lse_prefix)
    out, lse = merge_attention_states(out_prefix, lse_prefix, out_own, lse_own, out=out_prefix, lse=lse_prefix)
    if sinks is not None:  # the sink's e^s joins the denominator: out x e^lse / (e^lse + e^s)
        out = (out.float() * torch.sigmoid(lse - sinks)[..., None]).to(out.dtype)
    return out


def shared_prefix_pages(tables: list[list[int]], lengths: list[int], page_size: int) -> int:
    """How many leading full pages every sequence of a batch holds in common (the same page ids), leaving each at
    least one key of its own: what cascade_attention can read once."""
    _check_page_size("shared_prefix_pages", page_size)
    if not tables:
        return 0
    limit = min((n - 1) // page_size for n in lengths)
    first = tables[0]
    count = 0
    while count < limit and all(len(t) > count and t[count] == first[count] for t in tables):
        count += 1
    return count


def cascade_pays(batch: int, prefix_tokens: int) -> bool:
    """Whether a decode step should read a shared prefix through cascade_attention: the prefix tokens it saves
    reading, (batch - 1) x prefix_tokens, must outweigh its fixed costs (a second attention launch, a merge, the
    prefix pass's split merge). The threshold is where benchmarks/cascade.py --sweep crossed 1x on the H200
    (docs/bench.md, "Cascade decode")."""
    least = cascade_min_prefix_tokens(batch)
    return least is not None and prefix_tokens >= least


def cascade_min_prefix_tokens(batch: int) -> int | None:
    """The fewest shared prefix tokens at which cascade_pays for a batch (None for a batch of one: never), so that
    a serving loop can skip making a split that would not be used."""
    return None if batch < 2 else -(-CASCADE_MIN_SAVED_TOKENS // (batch - 1))


CASCADE_MIN_SAVED_TOKENS = 98304
