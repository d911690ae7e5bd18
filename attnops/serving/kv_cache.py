"""PagedKVCache: the cache tensors, a page allocator, and the per-step metadata the ops take.

For users with no serving engine of their own, and for the demo, tests and benchmarks. Each layer's K and V are
views of one [num_pages, 2, page_size, Hkv, D] tensor (FlashInfer's layout). LatentKVCache: the same allocator over
latent attention's rows, one [num_pages, page_size, R + P] tensor a layer.
"""
from __future__ import annotations

import numbers
import random
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .. import formats
from ..checks import MAX_PAGE_SIZE, check_fp8_scale_values, head_dim_error, is_page_size
from ..checks_mla import MAX_LATENT_DIM, MAX_ROPE_DIM


@dataclass
class BatchMetadata:
    """What paged_attention and reshape_and_cache need for one step of a batch."""

    seq_ids: list
    block_table: torch.Tensor  # int32 [B, max_pages]; -1 past each sequence's last page
    seq_lens: torch.Tensor  # int32 [B], counting this step's tokens
    slot_mapping: torch.Tensor  # int64 [T], where this step's tokens go
    cu_seqlens_q: torch.Tensor | None  # int32 [B+1]; None for decode (one token per sequence)
    host_seq_lens: list[int] | None = None  # seq_lens as host ints, when the host knows them (planning needs no sync)
    cascade: "CascadeSplit | None" = None  # set: attention reads a prefix all sequences share once (attend)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def attend(self, q: torch.Tensor, **attention_args) -> torch.Tensor:
        """paged_attention of this step's queries (attention_args: PagedKVCache.attention_args and the model's
        own scale, soft_cap, window_left, sinks), or cascade_attention over the shared prefix and the suffixes
        when `cascade` is set (a layer with a sliding window reads the whole sequences: its window counts
        positions from the start)."""
        if self.cascade is None or attention_args.get("window_left", -1) >= 0:
            return torch.ops.attnops.paged_attention(q, block_table=self.block_table, seq_lens=self.seq_lens,
                                                     cu_seqlens_q=self.cu_seqlens_q, **attention_args)
        from ..cascade import cascade_attention
        c = self.cascade
        attention_args.pop("window_left", None)
        return cascade_attention(q, prefix_table=None, prefix_len=None, block_table=c.block_table,
                                 seq_lens=c.seq_lens, cu_seqlens_q=self.cu_seqlens_q, prefix=c.prefix,
                                 **attention_args)


@dataclass
class CascadeSplit:
    """A batch's keys as a prefix every sequence shares and each sequence's own pages and lengths after it:
    cascade_attention's arguments, the prefix pass's made once for all layers (`prefix`)."""

    block_table: torch.Tensor  # int32 [B, W - P]
    seq_lens: torch.Tensor  # int32 [B]
    prefix_tokens: int  # prefix_len on the host
    prefix_pages: list  # the prefix's pages on the host
    host_seq_lens: list  # seq_lens on the host (a re-planning backend plans the suffix pass from them)
    prefix_pass: "PrefixPass | None" = None  # attnops.cascade.PrefixPass, or made by make_prefix on first use
    make_prefix: Callable[[], "PrefixPass"] | None = field(default=None, repr=False)

    @property
    def prefix(self) -> "PrefixPass":
        """The prefix pass's inputs on the device. Made (copied there) on first use: a serving loop that writes
        the split into its own static inputs (batching.StaticCascadeInputs) reads only the host fields."""
        if self.prefix_pass is None:
            self.prefix_pass = self.make_prefix()
        return self.prefix_pass


def _positive_int(owner: str, name: str, value, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{owner}: {name} must be an int (got {type(value).__name__})")
    if value < least:
        raise ValueError(f"{owner}: {name} must be at least {least} (got {value})")


def _fp8_scale(owner: str, name: str, value, device) -> torch.Tensor:
    """An fp8 cache's scale (stored = value / scale) as a float32 tensor on `device`: 1.0 for None; every element
    finite and > 0 (0 would store every value as the format's largest, inf or NaN make every output NaN)."""
    if value is None:
        value = 1.0
    if isinstance(value, bool) or not isinstance(value, (torch.Tensor, numbers.Real)):
        raise TypeError(f"{owner}: {name} must be a float or a float32 tensor (got {type(value).__name__})")
    scale = torch.as_tensor(value, dtype=torch.float32, device=device)
    if scale.numel() == 0:
        raise ValueError(f"{owner}: {name} must be finite and > 0 (got an empty tensor)")
    check_fp8_scale_values(owner, scale, None, names=(name,))  # (the ops' own check of scale values)
    return scale


def _check_pages(owner: str, num_layers, num_pages, page_size) -> None:
    """A cache's layer and page counts (positive ints) and page size (a power of two the ops take)."""
    for name, value in (("num_layers", num_layers), ("num_pages", num_pages), ("page_size", page_size)):
        _positive_int(owner, name, value, 1)
    if not is_page_size(page_size):
        raise ValueError(f"{owner}: page_size must be a power of two from 1 to {MAX_PAGE_SIZE}, as the ops take (got "
                         f"{page_size})")


class PagedKVCache:
    """KV cache of `num_layers` layers in pages of `page_size` tokens.

    kv_format: "bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2" (k_scale/v_scale: float32 per tensor or [Hkv],
    default 1.0), "nvfp4" or "mxfp4" (block scales kept beside the cache).
    shuffle_pages: hand out pages in random order, as a real allocator's free list ends up (benchmarks use it).

    Pages are reference-counted: `fork` gives a new sequence another's pages without copying them, and
    `share_prefix`/`index_prefix` do the same for any sequence whose tokens start with pages already cached (a
    prefix index over full pages). A shared page is copied before a sequence writes into it (copy on write), and
    goes back to the free list when its last sequence lets it go. A page's index entry dies when the page is
    written again (after `truncate`, or a `fork` mid-page whose source let the page go) or freed, so the index
    only ever names pages that hold its tokens.

    Bad arguments are ValueErrors (TypeErrors for a wrong type) naming them, and an operation that fails (out of
    pages, an unknown sequence) changes nothing.
    """

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads, head_dim, *,
                 kv_format: str = "bf16", device="cpu", k_scale: torch.Tensor | float | None = None,
                 v_scale: torch.Tensor | float | None = None, shuffle_pages: bool = False, seed: int = 0,
                 shared_layers: dict | None = None):
        if kv_format not in formats.KV_FORMATS:
            raise ValueError(f"PagedKVCache: kv_format must be one of {formats.KV_FORMATS} (got {kv_format!r})")
        _check_pages("PagedKVCache", num_layers, num_pages, page_size)
        # num_kv_heads, head_dim: one for every layer, or one a layer (a model whose layers differ, as Gemma-4's
        # sliding and full layers)
        layer_shapes = []
        for name, value in (("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
            values = [value] * num_layers if isinstance(value, int) and not isinstance(value, bool) else value
            if not isinstance(values, (list, tuple)):
                raise TypeError(f"PagedKVCache: {name} must be an int or one int a layer (got "
                                f"{type(value).__name__})")
            if len(values) != num_layers:
                raise ValueError(f"PagedKVCache: {name} must be an int or one a layer ({num_layers}; got "
                                 f"{len(values)})")
            for v in values:
                _positive_int("PagedKVCache", name, v, 1)
            layer_shapes.append(list(values))
        heads_of, dims_of = layer_shapes
        for d in sorted(set(dims_of)):
            error = head_dim_error(d, kv_format)
            if error:
                raise ValueError(f"PagedKVCache: {error}")
        # shared_layers {layer: an earlier layer}: the layer reads that layer's keys and values and writes none
        # (transformers' KV-shared layers, Gemma-3n's and Gemma-4's last ones): its pages are that layer's
        shared_layers = dict(shared_layers or {})
        for layer, source in shared_layers.items():
            if not (isinstance(layer, int) and isinstance(source, int) and 0 <= source < layer < num_layers):
                raise ValueError(f"PagedKVCache: shared_layers must map a layer to an earlier layer, both below "
                                 f"num_layers={num_layers} (got {layer!r}: {source!r})")
            if source in shared_layers:
                raise ValueError(f"PagedKVCache: shared_layers: layer {layer} reads layer {source}, which reads "
                                 f"another: name the layer that holds the keys")
            if (heads_of[layer], dims_of[layer]) != (heads_of[source], dims_of[source]):
                raise ValueError(f"PagedKVCache: shared_layers: layer {layer} ({heads_of[layer]} KV heads of "
                                 f"{dims_of[layer]}) cannot read layer {source} ({heads_of[source]} of "
                                 f"{dims_of[source]})")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.num_kv_heads, self.head_dim, self.kv_format = num_kv_heads, head_dim, kv_format
        self.shared_layers = shared_layers
        self.device = torch.device(device)
        fmt = formats.FORMATS[kv_format]
        self.kv, self.block_scales = [], [] if fmt.scale == "block" else None
        for layer in range(num_layers):
            source = shared_layers.get(layer)
            if source is not None:  # (the same tensors: written once, by the layer that holds them)
                self.kv.append(self.kv[source])
                if self.block_scales is not None:
                    self.block_scales.append(self.block_scales[source])
                continue
            shape = (num_pages, 2, page_size, heads_of[layer], fmt.stored_head_dim(dims_of[layer]))
            self.kv.append(torch.zeros(shape, dtype=fmt.storage_dtype, device=self.device))
            if self.block_scales is not None:
                self.block_scales.append(torch.zeros(fmt.block_scale_shape(shape, dims_of[layer]),
                                                     dtype=fmt.scale_dtype, device=self.device))
        self.k_scale = self.v_scale = None
        if formats.is_fp8(kv_format):
            self.k_scale = _fp8_scale("PagedKVCache", "k_scale", k_scale, self.device)
            self.v_scale = _fp8_scale("PagedKVCache", "v_scale", v_scale, self.device)
        self._init_pages(shuffle_pages, seed)

    def _init_pages(self, shuffle_pages: bool, seed: int) -> None:
        """The allocator's state: every page free, no sequence."""
        num_pages = self.num_pages
        self._free_pages = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        if shuffle_pages:
            random.Random(seed).shuffle(self._free_pages)
        self._pages: dict = {}  # seq_id -> list of page indices
        self._lengths: dict = {}  # seq_id -> tokens stored
        # the same pages as a host page table, one row per live sequence, so that a step's block_table is one
        # gather (rebuilding it from Python lists cost ms per step at 128 sequences x 8K tokens)
        self._table = torch.full((8, 64), -1, dtype=torch.int32)
        self._row: dict = {}  # seq_id -> its row of _table
        self._free_rows = list(range(7, -1, -1))
        self._refs = [0] * num_pages  # sequences holding each page
        # the prefix index: key of a full page (a hash of its tokens and of the key of the page before) -> the page,
        # and back; and what the key stands for, compared on every match, so that two contents whose hashes collide
        # (hash(-1) == hash(-2), or ids 2^61 apart) never share a page: page -> (the page before it, its tokens)
        self._indexed: dict = {}
        self._key_of: dict = {}
        self._content_of: dict = {}

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
        if not self._free_rows:  # twice the rows
            rows = self._table.shape[0]
            self._table = torch.cat((self._table, torch.full_like(self._table, -1)))
            self._free_rows = list(range(2 * rows - 1, rows - 1, -1))
        self._row[seq_id] = self._free_rows.pop()

    @property
    def pages_in_use(self) -> int:
        """Distinct pages held by live sequences (a page shared by several counts once)."""
        return self.num_pages - len(self._free_pages)

    def __contains__(self, seq_id) -> bool:
        """Whether the sequence is allocated."""
        return seq_id in self._pages

    def _known(self, method: str, seq_id) -> None:
        if seq_id not in self._pages:
            raise ValueError(f"PagedKVCache.{method}: no sequence {seq_id!r} (allocate it first)")

    @staticmethod
    def _count(method: str, name: str, value) -> None:
        """A token count or position argument must be an int (a float slices nothing and fails halfway)."""
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"PagedKVCache.{method}: {name} must be an int (got {type(value).__name__})")

    def _forget_index(self, page: int) -> None:
        """The page is about to be written: its tokens will no longer be the ones its index entry names."""
        key = self._key_of.pop(page, None)
        if key is not None:
            del self._indexed[key], self._content_of[page]

    def _take_page(self) -> int:
        if not self._free_pages:
            raise RuntimeError(f"PagedKVCache: out of pages (all {self.num_pages} in use)")
        page = self._free_pages.pop()
        self._refs[page] = 1
        return page

    def _release(self, pages: list) -> None:
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._indexed.pop(self._key_of.pop(page, None), None)
                self._content_of.pop(page, None)
                self._free_pages.append(page)

    def _copy_page(self, src: int, dst: int) -> None:
        for layer in range(self.num_layers):
            if layer not in self.shared_layers:  # (a shared layer's tensors are its source's)
                for storage in [self.kv] + ([self.block_scales] if self.block_scales is not None else []):
                    storage[layer][dst] = storage[layer][src]

    def _own_page(self, seq_id, i: int) -> None:
        """Copy on write: the sequence's i-th page becomes its own before it writes into it."""
        page = self._pages[seq_id][i]
        if self._refs[page] > 1:
            fresh = self._take_page()
            self._copy_page(page, fresh)
            self._refs[page] -= 1
            self._pages[seq_id][i] = fresh
            self._table[self._row[seq_id], i] = fresh

    def fork(self, src, dst, num_tokens: int | None = None) -> None:
        """A new sequence `dst` holding the first `num_tokens` (default: all) tokens of `src`, sharing its pages;
        the last page, if partial, is copied when either sequence writes into it."""
        self._known("fork", src)
        if dst in self._pages:
            raise ValueError(f"PagedKVCache.fork: sequence {dst!r} already exists")
        n = self._lengths[src] if num_tokens is None else num_tokens
        self._count("fork", "num_tokens", n)
        if not 0 <= n <= self._lengths[src]:
            raise ValueError(f"PagedKVCache.fork: num_tokens must be in [0, {self._lengths[src]}] (got {n})")
        self.allocate(dst)
        shared = self._pages[src][: -(-n // self.page_size)]
        for page in shared:
            self._refs[page] += 1
        self._grow(dst, shared)
        self._lengths[dst] = n

    def _page_keys(self, tokens: list[int]) -> list:
        """(key, tokens) of each full page of `tokens`."""
        keys, key = [], None
        for start in range(0, len(tokens) - self.page_size + 1, self.page_size):
            chunk = tuple(tokens[start:start + self.page_size])
            key = hash((key, chunk))
            keys.append((key, chunk))
        return keys

    def share_prefix(self, seq_id, tokens: list[int]) -> int:
        """For a new, empty sequence whose tokens will be `tokens`: attaches the longest run of cached full pages
        that holds their start (see index_prefix), leaving at least the last token to compute. Returns the tokens
        now in the sequence (a multiple of page_size)."""
        self._known("share_prefix", seq_id)
        if self._lengths[seq_id]:
            raise ValueError(f"PagedKVCache.share_prefix: sequence {seq_id!r} is not empty")
        pages, before = [], None
        for key, chunk in self._page_keys(tokens[:-1]):
            page = self._indexed.get(key)
            if page is None or self._content_of[page] != (before, chunk):  # (a hash collision: not these tokens)
                break
            pages.append(page)
            before = page
        for page in pages:
            self._refs[page] += 1
        self._grow(seq_id, pages)
        self._lengths[seq_id] = len(pages) * self.page_size
        return self._lengths[seq_id]

    def index_prefix(self, seq_id, tokens: list[int]) -> None:
        """Records the sequence's full pages, whose stored tokens are `tokens` (written already), so that later
        sequences starting with the same tokens share them (share_prefix)."""
        self._known("index_prefix", seq_id)
        before = None  # the page the index names for the tokens so far (share_prefix matches through it)
        for page, (key, chunk) in zip(self._pages[seq_id], self._page_keys(tokens[: self._lengths[seq_id]])):
            if key not in self._indexed and page not in self._key_of:
                self._indexed[key], self._key_of[page], self._content_of[page] = page, key, (before, chunk)
            named = self._indexed.get(key)
            before = named if named is not None and self._content_of[named] == (before, chunk) else page

    def free(self, seq_id) -> None:
        self._known("free", seq_id)
        self._release(self._pages.pop(seq_id))
        del self._lengths[seq_id]
        row = self._row.pop(seq_id)
        self._table[row].fill_(-1)
        self._free_rows.append(row)

    def _grow(self, seq_id, new_pages: list) -> None:
        """Appends `new_pages` to the sequence's pages and its row of the host table."""
        pages = self._pages[seq_id]
        end = len(pages) + len(new_pages)
        if end > self._table.shape[1]:  # twice the columns (at least enough)
            wider = torch.full((self._table.shape[0], max(end, 2 * self._table.shape[1])), -1, dtype=torch.int32)
            wider[:, : self._table.shape[1]] = self._table
            self._table = wider
        self._table[self._row[seq_id], len(pages):end] = torch.tensor(new_pages, dtype=torch.int32)
        pages.extend(new_pages)

    def seq_len(self, seq_id) -> int:
        self._known("seq_len", seq_id)
        return self._lengths[seq_id]

    def truncate(self, seq_id, length: int) -> None:
        """Drops the sequence's tokens from position `length` on; pages left empty go back to the free list."""
        self._known("truncate", seq_id)
        self._count("truncate", "length", length)
        if not 0 <= length <= self._lengths[seq_id]:
            raise ValueError(f"PagedKVCache.truncate: length must be in [0, {self._lengths[seq_id]}] for sequence "
                             f"{seq_id!r} (got {length})")
        pages = self._pages[seq_id]
        keep = -(-length // self.page_size)
        self._release(pages[keep:])
        self._table[self._row[seq_id], keep:len(pages)] = -1
        del pages[keep:]
        self._lengths[seq_id] = length

    def keep_path(self, seq_id, block_start: int, path: list[int]) -> None:
        """After a draft tree's verification: the tokens of the block that starts at position `block_start`
        whose indices in the block are `path` (increasing: the accepted root-to-leaf path) move to positions
        block_start, block_start + 1, ..., in every layer (keys, values and block scales), and the sequence ends
        after them."""
        self._known("keep_path", seq_id)
        self._count("keep_path", "block_start", block_start)
        end = self._lengths[seq_id]
        if not 0 <= block_start <= end:
            raise ValueError(f"PagedKVCache.keep_path: block_start must be in [0, {end}] (got {block_start})")
        if not isinstance(path, (list, tuple)) or any(isinstance(i, bool) or not isinstance(i, int) for i in path):
            raise TypeError(f"PagedKVCache.keep_path: path must be a list of ints (got {path!r})")
        if any(not 0 <= i < end - block_start for i in path) or any(a >= b for a, b in zip(path, path[1:])):
            raise ValueError(f"PagedKVCache.keep_path: path must be increasing indices into the block's "
                             f"{end - block_start} tokens (got {path})")
        if list(path) != list(range(len(path))):
            written = range(block_start // self.page_size, -(-(block_start + len(path)) // self.page_size))
            copies = sum(self._refs[self._pages[seq_id][i]] > 1 for i in written)
            if copies > len(self._free_pages):  # fail before anything changes
                raise RuntimeError(f"PagedKVCache: out of pages ({copies} needed for copy on write, "
                                   f"{len(self._free_pages)} free)")
            for i in written:
                self._own_page(seq_id, i)  # the pages written below
                self._forget_index(self._pages[seq_id][i])
            pages = torch.tensor(self._pages[seq_id], dtype=torch.long)
            src = torch.tensor(path, dtype=torch.long) + block_start
            dst = torch.arange(block_start, block_start + len(path))
            src_page, src_off = pages[src // self.page_size].to(self.device), (src % self.page_size).to(self.device)
            dst_page, dst_off = pages[dst // self.page_size].to(self.device), (dst % self.page_size).to(self.device)
            self._move_tokens(src_page, src_off, dst_page, dst_off)
        self.truncate(seq_id, block_start + len(path))

    def _move_tokens(self, src_page, src_off, dst_page, dst_off) -> None:
        """Every layer's tokens at (src_page, src_off) copied to (dst_page, dst_off): keys, values, block scales."""
        for storage in self.kv + (self.block_scales or []):  # [pages, 2 (K, V), page_size, ...]
            if storage.element_size() == 1:  # as bytes: indexing kernels do not all take float8 dtypes
                storage = storage.view(torch.uint8)
            storage[dst_page, :, dst_off] = storage[src_page, :, src_off]  # the gather copies first

    def prepare(self, seq_ids: list, num_new_tokens: list[int] | int = 1, *, decode: bool | None = None,
                max_pages: int | None = None) -> BatchMetadata:
        """Reserves slots for each sequence's new tokens and returns the step's metadata.

        decode: one token per sequence and cu_seqlens_q None; by default, when every sequence adds one token.
        max_pages: width of block_table (default: the most any sequence of the batch needs)."""
        for seq_id in seq_ids:
            self._known("prepare", seq_id)
        if len(set(seq_ids)) != len(seq_ids):  # a sequence twice would be given the same slots twice
            raise ValueError(f"PagedKVCache.prepare: seq_ids must be distinct (got {list(seq_ids)})")
        if isinstance(num_new_tokens, int):
            num_new_tokens = [num_new_tokens] * len(seq_ids)
        if not isinstance(num_new_tokens, (list, tuple)) or len(num_new_tokens) != len(seq_ids) or any(
                isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in num_new_tokens):
            raise ValueError(f"PagedKVCache.prepare: num_new_tokens must be an int >= 0 or one per sequence "
                             f"(got {num_new_tokens!r} for {len(seq_ids)} sequences)")
        if max_pages is not None:  # (checked before anything changes)
            _positive_int("PagedKVCache.prepare", "max_pages", max_pages, 1)
        if decode is None:
            decode = all(n == 1 for n in num_new_tokens)
        if decode and any(n != 1 for n in num_new_tokens):
            raise ValueError("PagedKVCache.prepare: decode=True needs one new token per sequence")
        # a shared partial last page that this step writes into is copied first (copy on write)
        writes_shared = [s for s, n in zip(seq_ids, num_new_tokens)
                         if n and self._lengths[s] % self.page_size and self._refs[self._pages[s][-1]] > 1]
        page_counts = [-(-(self._lengths[s] + n) // self.page_size) for s, n in zip(seq_ids, num_new_tokens)]
        needed = len(writes_shared) + sum(max(0, count - len(self._pages[s])) for s, count in zip(seq_ids, page_counts))
        if needed > len(self._free_pages):
            raise RuntimeError(f"PagedKVCache: out of pages ({needed} needed, {len(self._free_pages)} free)")
        width = max(page_counts + [1]) if max_pages is None else max_pages
        if max(page_counts, default=0) > width:
            raise ValueError(f"PagedKVCache.prepare: max_pages must be at least the {max(page_counts)} pages a "
                             f"sequence needs (got {width})")
        for s in writes_shared:
            self._own_page(s, len(self._pages[s]) - 1)
        # slots of short runs (decode) as Python ints, flushed as one tensor before each long run (prefill)
        slot_runs, pending, lengths = [], [], []
        page_size = self.page_size
        for seq_id, n in zip(seq_ids, num_new_tokens):
            pages, start = self._pages[seq_id], self._lengths[seq_id]
            if n and start % page_size:
                # a partial last page written into leaves the prefix index (its tokens change; a shared one was
                # copied above, and the copy is not indexed)
                self._forget_index(pages[-1])
            missing = -(-(start + n) // page_size) - len(pages)
            if missing > 0:
                self._grow(seq_id, [self._take_page() for _ in range(missing)])
            if n <= 16:
                pending.extend(pages[p // page_size] * page_size + p % page_size for p in range(start, start + n))
            else:
                slot_runs.append(torch.tensor(pending, dtype=torch.int64))
                pending = []
                positions = torch.arange(start, start + n)
                row = self._table[self._row[seq_id]]
                slot_runs.append(row[positions // page_size].long() * page_size + positions % page_size)
            self._lengths[seq_id] = start + n
            lengths.append(start + n)
        rows = self._table.index_select(0, torch.tensor([self._row[s] for s in seq_ids], dtype=torch.long))
        table = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        used = min(width, rows.shape[1])
        table[:, :used] = rows[:, :used]
        slot_runs.append(torch.tensor(pending, dtype=torch.int64))
        slot_mapping = torch.cat(slot_runs) if len(slot_runs) > 1 else slot_runs[0]
        cu = None
        if not decode:
            cu = [0]
            for n in num_new_tokens:
                cu.append(cu[-1] + n)
            cu = self._to_device(torch.tensor(cu, dtype=torch.int32))
        return BatchMetadata(
            seq_ids=list(seq_ids),
            block_table=self._to_device(table),
            seq_lens=self._to_device(torch.tensor(lengths, dtype=torch.int32)),
            slot_mapping=self._to_device(slot_mapping),
            cu_seqlens_q=cu,
            host_seq_lens=lengths)

    def cascade_split(self, meta: BatchMetadata, min_pages: int = 1) -> CascadeSplit | None:
        """The leading full pages every sequence of `meta`'s batch shares (pages shared by share_prefix or fork),
        as cascade_attention's split of the batch, or None if fewer than `min_pages` are shared. The prefix pass's
        inputs go to the device when the split's `prefix` is first read."""
        from ..cascade import host_prefix_pass, shared_prefix_pages
        lengths = meta.host_seq_lens if meta.host_seq_lens is not None else meta.seq_lens.tolist()
        shared = shared_prefix_pages([self._pages[s] for s in meta.seq_ids], lengths, self.page_size)
        if shared < max(min_pages, 1):
            return None
        tokens = shared * self.page_size
        pages = self._pages[meta.seq_ids[0]][:shared]

        def make_prefix():
            prefix = host_prefix_pass(pages, tokens, self.page_size, meta.num_tokens, "cpu")
            return prefix._replace(**{k: self._to_device(v) for k, v in prefix._asdict().items() if v is not None})
        return CascadeSplit(block_table=meta.block_table[:, shared:], seq_lens=meta.seq_lens - tokens,
                            prefix_tokens=tokens, prefix_pages=pages, host_seq_lens=[n - tokens for n in lengths],
                            make_prefix=make_prefix)

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host tensor's copy on the cache's device. CUDA: through pinned memory, non-blocking, because a copy
        from pageable memory synchronizes the stream, which would stop the host from preparing step N+1 while
        the GPU still runs step N (the caching host allocator keeps the pinned block until the copy is done)."""
        if self.device.type != "cuda":
            return host.to(self.device)
        return host.pin_memory().to(self.device, non_blocking=True)


class LatentKVCache(PagedKVCache):
    """The cache of latent attention (mla_attention, DeepSeek-V2/V3's MLA): one row a token and layer, the
    compressed latent and the rotary key, [c (latent_dim values), k_pe (rope_dim values)], shared by every query
    head; each layer's rows are one [num_pages, page_size, latent_dim + rope_dim] tensor. The allocator, prefix
    sharing and step metadata are PagedKVCache's.

    kv_format: the cache's dtype, "bf16", "fp16" or "fp32" (the ops' "auto"), "fp8_e4m3" (kv_scale: a float32
    tensor of one element or a float, default 1.0; stored = value / kv_scale) or "fp8_ds_mla" (DeepSeek's fp8
    layout, a scale a 128 latent values kept in the row: uint8 rows of latent_dim + 4 latent_dim/128 + 2 rope_dim
    bytes; latent_dim a multiple of 128).
    index_dim: the width of a sparse-attention indexer's key (DeepSeek-V3.2, GLM-5: its indexer scores every cached
    key to pick each query's), kept a token and layer in `index_keys` ([num_pages, page_size, index_dim] a layer,
    in the cache's dtype, bf16 for fp8), on the same pages as the latents; 0: none."""

    KV_FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3", formats.LATENT_FP8_FORMAT)

    def __init__(self, num_layers: int, num_pages: int, page_size: int, latent_dim: int, rope_dim: int, *,
                 kv_format: str = "bf16", device="cpu", kv_scale: torch.Tensor | float | None = None,
                 shuffle_pages: bool = False, seed: int = 0, index_dim: int = 0):
        if kv_format not in self.KV_FORMATS:
            raise ValueError(f"LatentKVCache: kv_format must be one of {self.KV_FORMATS} (got {kv_format!r})")
        _positive_int("LatentKVCache", "index_dim", index_dim, 0)
        _check_pages("LatentKVCache", num_layers, num_pages, page_size)
        for name, value in (("latent_dim", latent_dim), ("rope_dim", rope_dim)):
            _positive_int("LatentKVCache", name, value, 1)
        if latent_dim % 64 or latent_dim > MAX_LATENT_DIM or rope_dim % 16 or rope_dim > MAX_ROPE_DIM:
            raise ValueError(f"LatentKVCache: latent_dim must be a multiple of 64 up to {MAX_LATENT_DIM} and rope_dim "
                             f"a multiple of 16 up to {MAX_ROPE_DIM}, as mla_attention takes (got {latent_dim}, "
                             f"{rope_dim})")
        if kv_format == formats.LATENT_FP8_FORMAT and latent_dim % formats.LATENT_FP8_TILE:
            raise ValueError(f"LatentKVCache: kv_format {kv_format!r} takes latent_dim a multiple of "
                             f"{formats.LATENT_FP8_TILE} (got {latent_dim})")
        self.num_layers, self.num_pages, self.page_size = num_layers, num_pages, page_size
        self.latent_dim, self.rope_dim, self.kv_format = latent_dim, rope_dim, kv_format
        self.shared_layers = {}
        self.device = torch.device(device)
        row, dtype = formats.latent_row(kv_format, latent_dim, rope_dim)
        self.kv = [torch.zeros(num_pages, page_size, row, dtype=dtype, device=self.device)
                   for _ in range(num_layers)]
        self.block_scales = None
        self.kv_scale = None
        if kv_format == "fp8_e4m3":
            self.kv_scale = _fp8_scale("LatentKVCache", "kv_scale", kv_scale, self.device)
            if self.kv_scale.numel() != 1:
                raise ValueError(f"LatentKVCache: kv_scale must be one value (got {self.kv_scale.numel()})")
            self.kv_scale = self.kv_scale.reshape(1)
        # the indexer's keys: a spare row after the pages takes the writes of padding tokens (slot -1)
        self.index_dim, self.index_keys, self._index_rows = index_dim, None, None
        if index_dim:
            dtype = torch.bfloat16 if dtype.itemsize == 1 else dtype  # (fp8: the indexer's keys in bf16)
            self._index_rows = [torch.zeros(num_pages * page_size + 1, index_dim, dtype=dtype, device=self.device)
                                for _ in range(num_layers)]
            self.index_keys = [rows[:-1].view(num_pages, page_size, index_dim) for rows in self._index_rows]
        self._init_pages(shuffle_pages, seed)

    def write_index_keys(self, layer: int, keys: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The indexer's keys [T, index_dim] of a step's tokens at their slots (-1, or a slot outside the cache:
        none written; mla_cache_write records a bad one)."""
        rows = self._index_rows[layer]
        spare = rows.shape[0] - 1
        inside = (slot_mapping >= 0) & (slot_mapping < spare)
        rows.index_copy_(0, torch.where(inside, slot_mapping, spare), keys.to(rows.dtype))

    def _copy_page(self, src: int, dst: int) -> None:
        super()._copy_page(src, dst)
        for keys in self.index_keys or ():
            keys[dst] = keys[src]

    def _move_tokens(self, src_page, src_off, dst_page, dst_off) -> None:
        for storage in self.kv + (self.index_keys or []):  # [pages, page_size, ...]: a row a token
            if storage.element_size() == 1:
                storage = storage.view(torch.uint8)
            storage[dst_page, dst_off] = storage[src_page, src_off]

    def attention_args(self, layer: int) -> dict:
        """Keyword arguments of mla_attention (and mla_cache_write) for `layer`: kv_cache, kv_format, kv_scale."""
        kv_format = "auto" if self.kv_format in ("bf16", "fp16", "fp32") else self.kv_format
        args = dict(kv_cache=self.kv[layer], kv_format=kv_format)
        if self.kv_scale is not None:
            args["kv_scale"] = self.kv_scale
        return args

    write_args = attention_args

    def cascade_split(self, meta: BatchMetadata, min_pages: int = 1) -> None:
        """None: latent attention has no cascade (its decode reads each row once for every head already)."""
        return None

