"""Page-table work any backend may use, on the device: FlashInfer's page layout of a decode step (CSR indptr,
indices, last_page_len), made safe, in one launch, what attnops/backends/flashinfer.py's checked_pages +
page_metadata do with some thirty small torch ops, for the step FlashInfer re-plans before every replay of a
captured decode graph (host time per step) and every eager decode step.

The kernel is Triton's: this module imports triton, so a backend imports it where it first needs it (FlashInfer's
plan), not at import, and attnops imports where triton is missing.

docs/design.md, "Bad indices": a length outside [0, the table's capacity] gets no pages and its row NaN; a page index
outside the cache within a length is written as a good page of the same sequence (page 0 where it has none), and
the row NaN if it sees the page (the query is the sequence's last position; window_left limits what it sees); with
no page at all, no sequence gets a page. Both are recorded in the device's error buffer. Rows of empty sequences are 0.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import errors

ERR_BLOCK_TABLE, ERR_SEQ_LENS = tl.constexpr(errors.BLOCK_TABLE), tl.constexpr(errors.SEQ_LENS)


@triton.jit(do_not_specialize=["batch", "width", "stride_table", "num_pages", "window_left"])
def decode_page_layout_kernel(
    table_ptr, lens_ptr, indptr_ptr, indices_ptr, last_ptr, fix_ptr, value_ptr, err_ptr,
    batch, width, stride_table, num_pages, window_left,
    PAGE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_W: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """One program per sequence b: its CSR range (indptr[b + 1], indices, last_page_len), whether its row is set
    after run() (fix: NaN or empty) and to what (value)."""
    b = tl.program_id(0)
    capacity = width * PAGE
    # where b starts in the CSR indices: the pages of the sequences before it (an exclusive prefix, from every
    # length made safe the same way)
    seqs = tl.arange(0, BLOCK_B)
    lens = tl.load(lens_ptr + seqs, mask=seqs < batch, other=0)
    laid = tl.where((lens < 0) | (lens > capacity) | (num_pages == 0), 0, lens)
    start = tl.sum(tl.where(seqs < b, (laid + PAGE - 1) // PAGE, 0), 0)

    n = tl.load(lens_ptr + b)
    seq_bad = (n < 0) | (n > capacity)
    n_ok = tl.where(seq_bad, 0, n)
    n_laid = tl.where(num_pages == 0, 0, n_ok)
    pages = (n_laid + PAGE - 1) // PAGE
    tl.store(indptr_ptr + b + 1, start + pages)
    if b == 0:
        tl.store(indptr_ptr, 0)
    tl.store(last_ptr + b, tl.where(n_laid > 0, n_laid - (pages - 1) * PAGE, 0))
    first_seen = 0  # the first page the query (at n - 1) sees
    if HAS_WINDOW:
        first_seen = tl.maximum(n_ok - 1 - window_left, 0) // PAGE
    seen_bad = tl.full([], 0, tl.int32)  # tensors, not Python ints: loop-carried
    fallback = tl.full([], -1, tl.int32)
    row = table_ptr + b.to(tl.int64) * stride_table
    used_pages = (n_ok + PAGE - 1) // PAGE
    for j0 in tl.range(0, used_pages, BLOCK_W):  # which pages are bad, and a good one of the sequence
        j = j0 + tl.arange(0, BLOCK_W)
        used = j < used_pages
        page = tl.load(row + j, mask=used, other=0)
        bad = used & (page.to(tl.uint32, bitcast=True) >= num_pages.to(tl.uint32))  # (negative: huge unsigned)
        seen_bad = tl.maximum(seen_bad, tl.max((bad & (j >= first_seen)).to(tl.int32), 0))
        fallback = tl.maximum(fallback, tl.max(tl.where(used & ~bad, page, -1), 0))
    # a bad page is written as a good page of the same sequence (page 0 where it has none): FlashInfer may meet its
    # values in a tile of rows that do not see it, at weight 0, where a NaN stays within the sequence
    fallback = tl.maximum(fallback, 0)
    for j0 in tl.range(0, pages, BLOCK_W):
        j = j0 + tl.arange(0, BLOCK_W)
        page = tl.load(row + j, mask=j < pages, other=0)
        bad = page.to(tl.uint32, bitcast=True) >= num_pages.to(tl.uint32)
        tl.store(indices_ptr + start + j, tl.where(bad, fallback, page), mask=j < pages)
    nan_row = seq_bad | (seen_bad > 0)
    tl.store(fix_ptr + b, nan_row | (n == 0))
    tl.store(value_ptr + b, tl.where(nan_row, float("nan"), 0.0).to(value_ptr.dtype.element_ty))
    if seen_bad > 0:
        tl.atomic_min(err_ptr + ERR_BLOCK_TABLE, b)
    if seq_bad:
        tl.atomic_min(err_ptr + ERR_SEQ_LENS, b)


def decode_page_layout(block_table: torch.Tensor, seq_lens: torch.Tensor, page_size: int, num_pages: int,
                       window_left: int, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
                       fix: torch.Tensor, values: torch.Tensor) -> None:
    """Writes the layout into indptr [B + 1], indices [>= B x width], last_page_len [B] (int32) and the rows to set
    into fix [B] (bool) and values [B] (the output's dtype), all on the device; no sync."""
    batch, width = block_table.shape
    if batch == 0:
        indptr.zero_()
        return
    if block_table.stride(1) != 1:
        block_table = block_table.contiguous()
    decode_page_layout_kernel[(batch,)](
        table_ptr=block_table, lens_ptr=seq_lens, indptr_ptr=indptr, indices_ptr=indices, last_ptr=last_page_len,
        fix_ptr=fix, value_ptr=values, err_ptr=errors.buffer(seq_lens.device), batch=batch, width=width,
        stride_table=block_table.stride(0), num_pages=num_pages, window_left=window_left,
        PAGE=page_size, BLOCK_B=max(16, triton.next_power_of_2(batch)), BLOCK_W=128, HAS_WINDOW=window_left >= 0,
        num_warps=4)
