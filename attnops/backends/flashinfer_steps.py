"""What FlashInfer's paged path (flashinfer.py) and its latent path (flashinfer_mla.py) share: the per-device
workspace, the step key (one plan a step, whatever the number of layers), the page layout made safe for kernels that
read whatever pages it names (docs/design.md, "Bad indices") in FlashInfer's CSR form, and the rows set after run().
"""
from __future__ import annotations

import functools
import weakref

import torch

from .. import errors
from ..cases import query_rows

Q_DTYPES = (torch.bfloat16, torch.float16)
# One float workspace per device, for split-KV partial outputs and the plan's scheduling data. FlashInfer
# recommends 128 MB; 256 MB covers the largest case measured (64 x 64K decode, 256 x 8K) with room.
WORKSPACE_BYTES = 256 * 1024 * 1024
LN2 = 0.6931471805599453  # run()'s LSE is a base-2 log: to the contract's natural log


@functools.lru_cache(maxsize=None)
def workspace(device: torch.device) -> torch.Tensor:
    """The device's FlashInfer workspace, shared by every wrapper on it (their runs are stream-ordered)."""
    return torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=device)


def checked_pages(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int,
                  window_left: int, cu_seqlens_q: torch.Tensor | None = None, num_tokens: int | None = None):
    """The step's page layout with nothing FlashInfer could read out of range, and the query rows the contract
    makes NaN (docs/design.md, "Bad indices"), on the device (no sync). FlashInfer reads every page of a
    sequence's length, so: a length outside [0, the table's capacity] becomes 0 (its rows NaN); a page index
    outside the cache within a length becomes a good page of the same sequence (page 0 where it has none), whose
    keys there only rows that become NaN see (with no page at all, every length becomes 0: no row that stays
    defined sees a key). Rows: one per sequence (decode,
    cu_seqlens_q None: the last position) or cu_seqlens_q's rows (already known good); a row is NaN if its
    sequence's length is bad or it sees (causal, window_left) a key of a bad page. Both are recorded in the
    device's error buffer (attnops.errors).

    Returns (lengths int32 [B], block table int32 [B, W], NaN rows bool [rows])."""
    device = seq_lens.device
    batch, width = block_table.shape
    lens = seq_lens.long()
    seq_bad = (lens < 0) | (lens > width * page_size)
    lens = torch.where(seq_bad, 0, lens)
    column = torch.arange(width, device=device)
    page_bad = (column[None, :] * page_size < lens[:, None]) & ((block_table < 0) | (block_table >= num_pages))
    bad_before = torch.nn.functional.pad(torch.cumsum(page_bad, 1), (1, 0))  # [B, W + 1]: among the first i pages
    row_seq, row_pos, _ = query_rows(lens, cu_seqlens_q, num_tokens)
    has_rows = torch.ones_like(seq_bad) if cu_seqlens_q is None else cu_seqlens_q.diff() > 0
    first_seen = (row_pos - window_left).clamp(min=0) if window_left >= 0 else torch.zeros_like(row_pos)
    last_page = (row_pos.clamp(min=0) // page_size + 1).clamp(max=width)
    row_bad_page = (row_pos >= 0) & (bad_before[row_seq, last_page] > bad_before[row_seq, first_seen // page_size])
    if row_seq.numel():
        errors.record(device, errors.BLOCK_TABLE, torch.where(row_bad_page, row_seq, errors.NONE).min())
    if batch:
        sequence = torch.arange(batch, device=device)
        errors.record(device, errors.SEQ_LENS, torch.where(seq_bad & has_rows, sequence, errors.NONE).min())
    if num_pages == 0:
        lens = torch.zeros_like(lens)
    # a bad page is read as a good page of the same sequence (FlashInfer may meet its values in a tile of the rows
    # that do not see it, at weight 0: a NaN there stays within the sequence, as a NaN value of its own would)
    good = (column[None, :] * page_size < lens[:, None]) & ~page_bad
    if width:
        fallback = torch.where(good, block_table, -1).amax(1, keepdim=True).clamp(min=0)  # (the largest, as the kernel)
        block_table = torch.where(page_bad, fallback, block_table)
    return lens.to(torch.int32), block_table, seq_bad[row_seq] | row_bad_page


def page_metadata(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int):
    """FlashInfer's CSR page layout (indptr, indices, last_page_len), computed on the device from a block table
    and lengths that checked_pages made safe. Sequences of length 0 have no pages and last_page_len 0."""
    pages = (seq_lens + page_size - 1) // page_size
    indptr = torch.zeros(seq_lens.shape[0] + 1, dtype=torch.int32, device=seq_lens.device)
    torch.cumsum(pages, 0, out=indptr[1:])
    used = torch.arange(block_table.shape[1], device=seq_lens.device)[None, :] < pages[:, None]
    indices = block_table[used].to(torch.int32)  # sizes itself from the data: one host sync, at plan time
    last_page_len = torch.where(seq_lens > 0, seq_lens - (pages - 1) * page_size, 0).to(torch.int32)
    return indptr, indices, last_page_len


def host_page_metadata(host_seq_lens: list, page_size: int, capacity: int):
    """indptr and last_page_len of a captured decode graph's replan, from the host's lengths (those the device
    seq_lens hold), made safe as on the device (a length outside [0, capacity] as 0; capacity 0 where the cache has
    no page), with no device sync: pinned host tensors where CUDA runs, which FlashInfer's plan reads on the host
    and copies without blocking."""
    lens = torch.tensor([n if 0 <= n <= capacity else 0 for n in host_seq_lens], dtype=torch.int32)
    pages = (lens + page_size - 1) // page_size
    indptr = torch.zeros(lens.shape[0] + 1, dtype=torch.int32)
    torch.cumsum(pages, 0, out=indptr[1:])
    last_page_len = torch.where(lens > 0, lens - (pages - 1) * page_size, 0).to(torch.int32)
    if torch.cuda.is_available():
        indptr, last_page_len = indptr.pin_memory(), last_page_len.pin_memory()
    return indptr, last_page_len


def fill_nan(out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """Every row NaN (a bad cu_seqlens_q: which rows are whose is undefined, so FlashInfer is not run)."""
    out.fill_(float("nan"))
    if lse is not None:
        lse.fill_(float("nan"))


def set_rows(row_fix, out: torch.Tensor, lse: torch.Tensor | None) -> None:
    """The rows run() leaves undefined or the contract makes NaN, set after it: row_fix = (mask [rows, 1, 1],
    values [rows, 1, 1]: 0 for a row with no key, NaN for a bad one); their LSE -inf or NaN."""
    mask, values = row_fix
    torch.where(mask, values, out, out=out)
    if lse is not None:
        torch.where(mask.view(-1, 1), values.view(-1, 1).float() - float("inf"), lse, out=lse)


def step_key(block_table, seq_lens, cu_seqlens_q):
    """Identity of a step's metadata: the tensor objects (weakly: a freed tensor cannot match a new one that
    reuses its address) and their in-place version counters (a tensor rewritten in place is a new step)."""
    return tuple((weakref.ref(t), t._version) if t is not None else None for t in (block_table, seq_lens, cu_seqlens_q))


def same_step(key, block_table, seq_lens, cu_seqlens_q) -> bool:
    if key is None:
        return False
    for entry, t in zip(key, (block_table, seq_lens, cu_seqlens_q)):
        if entry is None or t is None:
            if entry is not t:
                return False
        elif entry[0]() is not t or entry[1] != t._version:
            return False
    return True
