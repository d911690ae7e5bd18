"""Argument validation for the ops: every bad input is a TypeError or ValueError naming the argument, raised
before any kernel runs.

`check_*` look at shapes, dtypes, strides and devices only (they run in the fakes too, at trace time, and never
sync the host) and return the dispatch case. `check_*_values` read tensor data (page indices, lengths) and run
only when ATTNOPS_CHECK=1.
"""
from __future__ import annotations

import math

import torch
from torch._subclasses.fake_tensor import FakeTensor

from . import formats
from .cases import AttentionCall, AttentionCase, CacheWriteCall, CacheWriteCase
from .env import device_arch

# The head dims the ops take: every multiple of 16 from 16 to 512. That covers the models in use (Phi-2's 80,
# Phi-3's 96, 192, 512 ...) and keeps a row a whole number of 16-value blocks (nvfp4's scale block, an AVX-512
# vector of floats). Each backend declares which of them its kernels serve (`supports`); the reference serves all.
HEAD_DIM_MULTIPLE, MAX_HEAD_DIM = 16, 512
HEAD_DIMS = tuple(range(HEAD_DIM_MULTIPLE, MAX_HEAD_DIM + 1, HEAD_DIM_MULTIPLE))
HEAD_DIMS_RULE = f"a multiple of {HEAD_DIM_MULTIPLE} from {HEAD_DIM_MULTIPLE} to {MAX_HEAD_DIM}"
MAX_PAGE_SIZE = 256
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _fail(op: str, error: type, message: str):
    raise error(f"attnops.{op}: {message}")


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')} {list(t.shape)}"


def is_page_size(page_size: int) -> bool:
    """A page size the ops take: a power of two from 1 to MAX_PAGE_SIZE."""
    return 1 <= page_size <= MAX_PAGE_SIZE and page_size & (page_size - 1) == 0


def head_dim_error(head_dim: int, kv_format: str | None = None, what: str = "head_dim") -> str | None:
    """Why the ops cannot take `head_dim` (`what` names it in the message), or None. With `kv_format`, that
    format's scale block must divide it too (mxfp4's 32 values: not 80)."""
    if head_dim not in HEAD_DIMS:
        return f"{what} must be {HEAD_DIMS_RULE} (got {head_dim})"
    block = formats.FORMATS[kv_format].block if kv_format is not None else 0
    if block and head_dim % block:
        return (f"kv_format {kv_format} scales blocks of {block} values, so head_dim must be a multiple of {block} "
                f"(got {head_dim})")
    return None


def _check_tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        _fail(op, TypeError, f"{name} must be a Tensor (got {type(t).__name__})")


def _check_same_device(op, reference_name, reference, **others):
    for name, t in others.items():
        if t is not None and t.device != reference.device:
            _fail(op, ValueError, f"{name} must be on the same device as {reference_name} "
                                  f"({reference.device}), got {t.device}")


def _check_caches(op, k_cache, v_cache, kv_format):
    """The two caches agree and hold `kv_format`; returns (resolved format, page_size, num_kv_heads, last dim)."""
    _check_tensor(op, "k_cache", k_cache)
    _check_tensor(op, "v_cache", v_cache)
    if k_cache.dim() != 4:
        _fail(op, ValueError, f"k_cache must be [num_pages, page_size, num_kv_heads, head_dim] (got "
                              f"{_describe(k_cache)})")
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.dtype != v_cache.dtype:
        _fail(op, ValueError, f"k_cache and v_cache must have the same shape, strides and dtype (got "
                              f"{_describe(k_cache)} strides {k_cache.stride()} and {_describe(v_cache)} strides "
                              f"{v_cache.stride()})")
    if k_cache.stride(-1) != 1:
        _fail(op, ValueError, f"k_cache must be contiguous in its last dimension (strides {k_cache.stride()})")
    if not isinstance(kv_format, str) or (kv_format != "auto" and kv_format not in formats.KV_FORMATS):
        _fail(op, ValueError, f"kv_format must be 'auto' or one of {formats.KV_FORMATS} (got {kv_format!r})")
    fmt = formats.resolve_kv_format(kv_format, k_cache.dtype)
    if fmt is None:
        expected = (str(formats.FORMATS[kv_format].storage_dtype).replace("torch.", "") if kv_format != "auto"
                    else "a float or float8 dtype")
        _fail(op, TypeError, f"k_cache of dtype {k_cache.dtype} cannot hold kv_format {kv_format!r} "
                             f"(expected {expected})")
    _, page_size, num_kv_heads, stored_dim = k_cache.shape
    if num_kv_heads < 1:  # every kernel divides by it (the query heads a KV head serves, a slot's row)
        _fail(op, ValueError, f"num_kv_heads (k_cache.shape[2]) must be at least 1 (got {num_kv_heads})")
    if not is_page_size(page_size):
        _fail(op, ValueError, f"page_size (k_cache.shape[1]) must be a power of two from 1 to {MAX_PAGE_SIZE} "
                              f"(got {page_size})")
    return fmt, page_size, num_kv_heads, stored_dim


def _check_head_dim(op, head_dim, stored_dim, fmt, what):
    error = head_dim_error(head_dim, fmt, f"head_dim of {what}")
    if error:
        _fail(op, ValueError, error)
    if stored_dim != formats.stored_head_dim(fmt, head_dim):
        if formats.is_fp4(fmt):
            _fail(op, ValueError, f"a {fmt} k_cache's last dim must be head_dim/2 = {head_dim // 2} (got "
                                  f"{stored_dim})")
        _fail(op, ValueError, f"head_dim of {what} ({head_dim}) != k_cache's head_dim ({stored_dim})")


def _check_scales(op, fmt, k_cache, num_kv_heads, head_dim, names, k_scale, v_scale) -> str:
    """What the format's scale (KVFormat.scale) asks of k_scale/v_scale: a per-tensor or per-head float32 scale
    each (tensor scales), block scales paged like the cache (block scales), or none. Returns the scale kind."""
    k_name, v_name = names
    f = formats.FORMATS[fmt]
    if f.scale == formats.TENSOR_SCALE:
        for name, s in ((k_name, k_scale), (v_name, v_scale)):
            if s is None:
                _fail(op, ValueError, f"kv_format {fmt} needs {name} (float32, 0-d, [1] or [num_kv_heads])")
            _check_tensor(op, name, s)
            if s.dtype != torch.float32:
                _fail(op, TypeError, f"{name} must be float32 (got {s.dtype})")
            if not (s.numel() == 1 and s.dim() <= 1) and tuple(s.shape) != (num_kv_heads,):
                _fail(op, ValueError, f"{name} must be 0-d, [1] (per tensor) or [num_kv_heads={num_kv_heads}] "
                                      f"(per head) (got {list(s.shape)})")
    elif f.scale == formats.BLOCK_SCALE:
        expected = f.block_scale_shape(tuple(k_cache.shape), head_dim)
        dtype = f.scale_dtype
        for name, s in ((k_name, k_scale), (v_name, v_scale)):
            if s is None:
                _fail(op, ValueError, f"kv_format {fmt} needs {name} ({str(dtype).replace('torch.', '')} "
                                      f"{list(expected)})")
            _check_tensor(op, name, s)
            if s.dtype != dtype:
                _fail(op, TypeError, f"{name} must be {dtype} for {fmt} (got {s.dtype})")
            if tuple(s.shape) != expected:
                _fail(op, ValueError, f"{name} must be {list(expected)} for {fmt} (got {list(s.shape)})")
            if s.stride(-1) != 1:
                _fail(op, ValueError, f"{name} must be contiguous in its last dimension")
    elif f.scale == formats.NO_SCALE:
        for name, s in ((k_name, k_scale), (v_name, v_scale)):
            if s is not None:
                _fail(op, ValueError, f"{name} is only for fp8 and 4-bit caches (this cache is {fmt})")
    return f.scale_kind(k_scale, v_scale)  # (an unknown scale: a ValueError naming it)


def check_outputs_apart(op: str, outputs: dict, inputs: dict, may_be: tuple = ()) -> None:
    """What a call writes (`outputs`, name -> tensor or None) shares no memory with itself, with the other
    outputs or with what the call reads (`inputs`): else a kernel would read values it has already overwritten, or
    write one address twice, and return a wrong answer with no error. A view that maps two elements to one address
    (e.g. .expand()) is such an output. `may_be`: (output, input) name pairs whose tensors may be the very same view
    (merge_attention_states' out=out_a: each element is read before it is written). Addresses: checked every call
    (never memoized), and only where the caller gave the outputs (the ops' own are fresh)."""
    given = [(name, t) for name, t in outputs.items() if t is not None]
    for name, t in given:
        if torch._debug_has_internal_overlap(t) == 1:
            _fail(op, ValueError, f"{name} must not overlap itself: its view {list(t.shape)} with strides "
                                  f"{t.stride()} maps several elements to one address (e.g. .expand())")
    others = [(name, t) for name, t in inputs.items() if t is not None]
    for i, (name, t) in enumerate(given):
        for other, u in given[i + 1:] + others:
            if torch._C._overlaps(t, u) and not ((name, other) in may_be and _same_view(t, u)):
                _fail(op, ValueError, f"{name} must not share memory with {other}: an output that overlaps an "
                                      f"input or another output gives a wrong answer (pass a separate tensor)")


def _same_view(t: torch.Tensor, u: torch.Tensor) -> bool:
    return (t.data_ptr() == u.data_ptr() and t.shape == u.shape and t.stride() == u.stride()
            and t.dtype == u.dtype)


def _address(t: torch.Tensor) -> int:
    """Where t's first element is: its address, or for a tensor without memory (meta; fake, in the fakes at trace
    time) its byte offset in its storage."""
    if t.device.type == "meta" or isinstance(t, FakeTensor):
        return t.storage_offset() * t.element_size()
    return t.data_ptr()


def kv_layout_reasons(fmt, k_cache, v_cache, k_scale=None, v_scale=None) -> list[str]:
    """What keeps the caches (validated) from being read by aligned word copies (AttentionCase.aligned_kv): a key
    row is copied in words of a quarter of its bytes, at most 16 (4-bit at head dim 128: 16 bytes, a lane's
    copy), and a 4-bit format's row of block scales in one copy of its bytes, at most 16; so each tensor's address
    and outer strides must be multiples of that, K's and V's strides equal, and pages less than 4 GiB apart (32-bit
    page offsets). Shapes, strides and addresses only. Empty if they can."""
    reasons = []
    tensors = [("k_cache", k_cache), ("v_cache", v_cache)]
    if formats.FORMATS[fmt].scale == formats.BLOCK_SCALE:
        tensors += [("k_scale", k_scale), ("v_scale", v_scale)]
    if k_cache.stride() != v_cache.stride() or (len(tensors) > 2 and k_scale.stride() != v_scale.stride()):
        reasons.append("k and v caches (or their scales) have different strides")
    row = min(k_cache.shape[-1] * k_cache.element_size() // 4, 16)  # bytes a copy of a key takes
    for name, t in tensors:
        align = row if name.endswith("cache") else min(t.shape[-1] * t.element_size(), 16)  # a scale row: one copy
        strides = [s * t.element_size() for s in t.stride()[:3]]
        if _address(t) % align or any(s % align or s < 0 for s in strides) or t.stride(3) != 1:
            reasons.append(f"{name} is not {align}-byte aligned with unit inner stride")
        if strides[0] >= 2 ** 32:
            reasons.append(f"{name}'s pages are 4 GiB or more apart")
    return reasons


def check_batch(op, q_name, num_tokens, block_table, seq_lens, cu_seqlens_q) -> int:
    """The batch's metadata: block_table int32 [B, max_pages], seq_lens int32 [B], cu_seqlens_q int32 [B + 1] or
    None (decode: one query row a sequence). Returns B."""
    for name, t in (("block_table", block_table), ("seq_lens", seq_lens)):
        _check_tensor(op, name, t)
        if t.dtype != torch.int32:
            _fail(op, TypeError, f"{name} must be int32 (got {t.dtype})")
    if block_table.dim() != 2:
        _fail(op, ValueError, f"block_table must be [B, max_pages] (got {_describe(block_table)})")
    if seq_lens.dim() != 1 or seq_lens.shape[0] != block_table.shape[0]:
        _fail(op, ValueError, f"seq_lens must be [B] with B == block_table.shape[0] = {block_table.shape[0]} "
                              f"(got {_describe(seq_lens)})")
    batch = seq_lens.shape[0]
    if cu_seqlens_q is None:
        if num_tokens != batch:
            _fail(op, ValueError, f"{q_name} has {num_tokens} rows but decode (cu_seqlens_q=None) needs one per "
                                  f"sequence: num_tokens == B = {batch}; pass cu_seqlens_q for multi-token queries")
    else:
        _check_tensor(op, "cu_seqlens_q", cu_seqlens_q)
        if cu_seqlens_q.dtype != torch.int32:
            _fail(op, TypeError, f"cu_seqlens_q must be int32 (got {cu_seqlens_q.dtype})")
        if cu_seqlens_q.dim() != 1 or cu_seqlens_q.shape[0] != batch + 1:
            _fail(op, ValueError, f"cu_seqlens_q must be [B+1] = [{batch + 1}] (got {_describe(cu_seqlens_q)})")
    return batch


def check_sinks_and_tree(op, heads_name, num_heads, num_tokens, cu_seqlens_q, sinks, tree_mask) -> None:
    """sinks float32 [num_heads]; tree_mask bool [T, Q >= 1], contiguous rows, only with cu_seqlens_q."""
    if sinks is not None:
        _check_tensor(op, "sinks", sinks)
        if sinks.dtype != torch.float32:
            _fail(op, TypeError, f"sinks must be float32 (got {sinks.dtype})")
        if tuple(sinks.shape) != (num_heads,):
            _fail(op, ValueError, f"sinks must be [{heads_name}] = [{num_heads}] (got {list(sinks.shape)})")
    if tree_mask is not None:
        _check_tensor(op, "tree_mask", tree_mask)
        if cu_seqlens_q is None:
            _fail(op, ValueError, "tree_mask needs cu_seqlens_q: a tree mask orders the query rows of a draft "
                                  "block, and decode (cu_seqlens_q=None) has one row per sequence")
        if tree_mask.dtype != torch.bool:
            _fail(op, TypeError, f"tree_mask must be bool (got {tree_mask.dtype})")
        if tree_mask.dim() != 2 or tree_mask.shape[0] != num_tokens or tree_mask.shape[1] < 1:
            _fail(op, ValueError, f"tree_mask must be [num_query_rows, Q] = [{num_tokens}, Q >= 1], Q at least "
                                  f"the longest query block (got {list(tree_mask.shape)})")
        if tree_mask.stride(-1) != 1 and tree_mask.shape[1] > 1 and tree_mask.numel():  # (a stride nothing steps)
            _fail(op, ValueError, f"tree_mask must be contiguous in its last dimension (strides "
                                  f"{tree_mask.stride()})")


def check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks=None, tree_mask=None, out=None,
                          lse=None) -> AttentionCase:
    """paged_attention's arguments, or paged_attention_with_lse's with `lse` (its float32 [T, Hq] output)."""
    op = "paged_attention" if lse is None else "paged_attention_with_lse"
    _check_tensor(op, "q", q)
    if q.dtype not in Q_DTYPES:
        _fail(op, TypeError, f"q must be bfloat16, float16 or float32 (got {q.dtype})")
    if q.dim() != 3:
        _fail(op, ValueError, f"q must be [num_tokens, num_q_heads, head_dim] (got {_describe(q)})")
    if q.stride(-1) != 1:
        _fail(op, ValueError, f"q must be contiguous in its last dimension (strides {q.stride()})")
    fmt, page_size, num_kv_heads, stored_dim = _check_caches(op, k_cache, v_cache, kv_format)
    num_tokens, num_q_heads, head_dim = q.shape
    _check_head_dim(op, head_dim, stored_dim, fmt, "q")
    if num_q_heads < 1 or num_q_heads % num_kv_heads != 0:
        _fail(op, ValueError, f"q's num_q_heads ({num_q_heads}) must be a multiple of the cache's num_kv_heads "
                              f"({num_kv_heads})")

    batch = check_batch(op, "q", num_tokens, block_table, seq_lens, cu_seqlens_q)
    scale_kind = _check_scales(op, fmt, k_cache, num_kv_heads, head_dim, ("k_scale", "v_scale"), k_scale, v_scale)
    check_sinks_and_tree(op, "num_q_heads", num_q_heads, num_tokens, cu_seqlens_q, sinks, tree_mask)
    if out is not None:
        _check_tensor(op, "out", out)
        if out.shape != q.shape or out.dtype != q.dtype:
            _fail(op, ValueError, f"out must be {_describe(q)} like q (got {_describe(out)})")
    if lse is not None:
        _check_tensor(op, "lse", lse)
        if lse.dtype != torch.float32:
            _fail(op, TypeError, f"lse must be float32 (got {lse.dtype})")
        if tuple(lse.shape) != (num_tokens, num_q_heads):
            _fail(op, ValueError, f"lse must be [num_query_rows, num_q_heads] = [{num_tokens}, {num_q_heads}] "
                                  f"(got {list(lse.shape)})")
    _check_same_device(op, "q", q, k_cache=k_cache, v_cache=v_cache, block_table=block_table, seq_lens=seq_lens,
                       cu_seqlens_q=cu_seqlens_q, k_scale=k_scale, v_scale=v_scale, sinks=sinks,
                       tree_mask=tree_mask, out=out, lse=lse)
    if scale is not None and not (math.isfinite(scale) and scale > 0):
        _fail(op, ValueError, f"scale must be finite and > 0 (got {scale})")
    if not soft_cap >= 0:  # NaN fails too; inf is allowed and means no cap
        _fail(op, ValueError, f"soft_cap must be >= 0: 0 or inf for no cap (got {soft_cap})")
    if window_left < -1:
        _fail(op, ValueError, f"window_left must be -1 (no window) or >= 0 (got {window_left})")

    return AttentionCase.of_shapes(
        device_type=q.device.type, arch=device_arch(q.device), q_dtype=q.dtype, kv_format=fmt, head_dim=head_dim,
        page_size=page_size, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, batch=batch, num_tokens=num_tokens,
        max_kv_len=block_table.shape[1] * page_size, decode=cu_seqlens_q is None, scale_kind=scale_kind,
        soft_cap=0 < soft_cap < math.inf, sliding_window=window_left >= 0, sinks=sinks is not None,
        tree_mask=tree_mask is not None, aligned_kv=not kv_layout_reasons(fmt, k_cache, v_cache, k_scale, v_scale))


def _signature(t):
    """What validation looks at in a tensor argument (raises AttributeError for a non-tensor: not memoized)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device)


def _placed(t):
    """_signature and the address's alignment (up to 16 bytes, what kv_layout_reasons asks of the caches and their
    scales)."""
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16)


_VALID_ATTENTION: dict = {}  # signature of valid arguments -> their case: validation costs tens of us in Python


def attention_case(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                   kv_format, k_scale, v_scale, sinks=None, tree_mask=None, out=None, lse=None) -> AttentionCase:
    """check_paged_attention, memoized on everything it reads (shapes, strides, dtypes, devices, flags): the
    op's hot path validates a signature once and then only looks it up."""
    try:
        key = (_signature(q), _placed(k_cache), _placed(v_cache), _signature(block_table),
               _signature(seq_lens), _signature(cu_seqlens_q), scale, soft_cap, window_left, kv_format,
               _placed(k_scale), _placed(v_scale), _signature(sinks), _signature(tree_mask), _signature(out))
        if lse is not None:  # (a longer key: paged_attention's own calls build the same key as without lse)
            key += (_signature(lse),)
    except AttributeError:  # a non-tensor where a tensor belongs: let the full check name it
        key = None
    case = _VALID_ATTENTION.get(key)
    if case is None:
        case = check_paged_attention(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap,
                                     window_left, kv_format, k_scale, v_scale, sinks, tree_mask, out, lse)
        if key is not None and len(_VALID_ATTENTION) < 4096:
            _VALID_ATTENTION[key] = case
    return case


def attention_call(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                   kv_format, k_scale, v_scale, sinks, tree_mask, out, lse=None) -> AttentionCall:
    """The op's arguments validated (attention_case) and made the call a backend runs: the case, `scale` resolved
    to a float, `soft_cap` 0.0 where there is no cap."""
    case = attention_case(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap, window_left,
                          kv_format, k_scale, v_scale, sinks, tree_mask, out, lse)
    return AttentionCall.of_case(case, q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q, scale, soft_cap,
                                 window_left, k_scale, v_scale, sinks, tree_mask, out, lse)


def check_fp8_scale_values(op, k_scale, v_scale, names=("k_scale", "v_scale")) -> None:
    """fp8 scales (float32; 4-bit block scales have other dtypes and are not checked here)."""
    for name, s in zip(names, (k_scale, v_scale)):
        if s is not None and s.dtype == torch.float32 and not bool(torch.isfinite(s).all() and (s > 0).all()):
            _fail(op, ValueError, f"{name} must be finite and > 0 (got {s.tolist()})")


def check_paged_attention_values(q, k_cache, block_table, seq_lens, cu_seqlens_q, k_scale=None,
                                 v_scale=None, tree_mask=None, *, op="paged_attention",
                                 scale_names=("k_scale", "v_scale")) -> None:
    """The checks that read data (ATTNOPS_CHECK=1 only): lengths fit the table, used pages exist, query rows
    are ordered, no sequence has more queries than keys, and a tree mask has a column for every query of the
    longest block. (Latent attention's too, under its op's name: the same rules.)"""
    check_fp8_scale_values(op, k_scale, v_scale, scale_names)
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    lengths = seq_lens.tolist()
    if any(n < 0 for n in lengths):
        _fail(op, ValueError, f"seq_lens must be >= 0 (got {lengths})")
    capacity = block_table.shape[1] * page_size
    if any(n > capacity for n in lengths):
        _fail(op, ValueError, f"seq_lens {max(lengths)} exceeds block_table's capacity "
                              f"(max_pages {block_table.shape[1]} x page_size {page_size} = {capacity})")
    for b, n in enumerate(lengths):
        used = block_table[b, : (n + page_size - 1) // page_size]
        if used.numel() and (used.min().item() < 0 or used.max().item() >= num_pages):
            _fail(op, ValueError, f"block_table row {b} points outside the cache's {num_pages} pages "
                                  f"(entries {used.tolist()})")
    if cu_seqlens_q is None:
        return
    starts = cu_seqlens_q.tolist()
    if starts[0] != 0 or starts[-1] != q.shape[0] or any(a > b for a, b in zip(starts, starts[1:])):
        _fail(op, ValueError, f"cu_seqlens_q must be non-decreasing from 0 to num_tokens={q.shape[0]} "
                              f"(got {starts})")
    for b, n in enumerate(lengths):
        if starts[b + 1] - starts[b] > n:
            _fail(op, ValueError, f"sequence {b} has {starts[b + 1] - starts[b]} query tokens but seq_lens {n}: "
                                  f"seq_lens counts this step's tokens too")
    longest = max((b - a for a, b in zip(starts, starts[1:])), default=0)
    if tree_mask is not None and tree_mask.shape[1] < longest:
        _fail(op, ValueError, f"tree_mask has {tree_mask.shape[1]} columns but the longest query block has "
                              f"{longest} rows: Q must be at least that")


def check_cascade_prefix_values(prefix_table, prefix_len, k_cache) -> None:
    """cascade_attention's prefix, read on the host (ATTNOPS_CHECK=1 only): its length fits its table and its
    pages exist."""
    op = "cascade_attention"
    num_pages, page_size = k_cache.shape[0], k_cache.shape[1]
    length, capacity = int(prefix_len.reshape(-1)[0]), prefix_table.shape[0] * page_size
    if not 0 <= length <= capacity:
        _fail(op, ValueError, f"prefix_len must be in [0, prefix_table's {prefix_table.shape[0]} pages x page_size "
                              f"{page_size} = {capacity}] (got {length})")
    used = prefix_table[: (length + page_size - 1) // page_size]
    if used.numel() and (used.min().item() < 0 or used.max().item() >= num_pages):
        _fail(op, ValueError, f"prefix_table points outside the cache's {num_pages} pages (entries {used.tolist()})")


def check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, kv_format, k_scale, v_scale,
                            k_block_scale, v_block_scale) -> CacheWriteCase:
    op = "reshape_and_cache"
    for name, t in (("key", key), ("value", value)):
        _check_tensor(op, name, t)
        if t.dtype not in Q_DTYPES:
            _fail(op, TypeError, f"{name} must be bfloat16, float16 or float32 (got {t.dtype})")
        if t.dim() != 3:
            _fail(op, ValueError, f"{name} must be [num_tokens, num_kv_heads, head_dim] (got {_describe(t)})")
    if key.shape != value.shape or key.dtype != value.dtype:
        _fail(op, ValueError, f"key and value must have the same shape and dtype (got {_describe(key)} and "
                              f"{_describe(value)})")
    fmt, page_size, num_kv_heads, stored_dim = _check_caches(op, k_cache, v_cache, kv_format)
    num_tokens, key_heads, head_dim = key.shape
    _check_head_dim(op, head_dim, stored_dim, fmt, "key")
    if key_heads != num_kv_heads:
        _fail(op, ValueError, f"key has {key_heads} heads but k_cache has {num_kv_heads}")
    _check_tensor(op, "slot_mapping", slot_mapping)
    if slot_mapping.dtype != torch.int64:
        _fail(op, TypeError, f"slot_mapping must be int64 (got {slot_mapping.dtype})")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != num_tokens:
        _fail(op, ValueError, f"slot_mapping must be [num_tokens] = [{num_tokens}] (got {_describe(slot_mapping)})")
    if formats.FORMATS[fmt].scale == formats.BLOCK_SCALE:  # scales computed on the way in
        if k_scale is not None or v_scale is not None:
            _fail(op, ValueError, f"k_scale/v_scale are for fp8; {fmt} computes k_block_scale/v_block_scale")
        scale_kind = _check_scales(op, fmt, k_cache, num_kv_heads, head_dim, ("k_block_scale", "v_block_scale"),
                                   k_block_scale, v_block_scale)
    else:
        if k_block_scale is not None or v_block_scale is not None:
            _fail(op, ValueError, f"k_block_scale/v_block_scale are for 4-bit caches (this cache is {fmt})")
        scale_kind = _check_scales(op, fmt, k_cache, num_kv_heads, head_dim, ("k_scale", "v_scale"),
                                   k_scale, v_scale)
    _check_same_device(op, "key", key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping,
                       k_scale=k_scale, v_scale=v_scale, k_block_scale=k_block_scale, v_block_scale=v_block_scale)
    return CacheWriteCase(device_type=key.device.type, arch=device_arch(key.device), src_dtype=key.dtype,
                          kv_format=fmt, head_dim=head_dim, page_size=page_size, num_kv_heads=num_kv_heads,
                          scale_kind=scale_kind)


def cache_write_call(key, value, k_cache, v_cache, slot_mapping, kv_format, k_scale, v_scale, k_block_scale,
                     v_block_scale) -> CacheWriteCall:
    """reshape_and_cache's arguments validated and made the call a backend runs."""
    case = check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, kv_format, k_scale, v_scale,
                                   k_block_scale, v_block_scale)
    return CacheWriteCall(case, key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_block_scale,
                          v_block_scale)


def check_reshape_and_cache_values(k_cache, slot_mapping, k_scale=None, v_scale=None) -> None:
    check_fp8_scale_values("reshape_and_cache", k_scale, v_scale)
    check_slot_mapping_values(k_cache, slot_mapping, op="reshape_and_cache")


def check_slot_mapping_values(cache, slot_mapping, *, op: str) -> None:
    """Every slot is -1 (padding) or inside the cache's pages x page_size (ATTNOPS_CHECK=1 only)."""
    slots = cache.shape[0] * cache.shape[1]
    if slot_mapping.numel() and (slot_mapping.min().item() < -1 or slot_mapping.max().item() >= slots):
        _fail(op, ValueError, f"slot_mapping entries must be -1 (padding) or in [0, {slots}) "
                              f"(got min {slot_mapping.min().item()}, max {slot_mapping.max().item()})")


def check_merge_attention_states(out_a, lse_a, out_b, lse_b, out=None, lse=None) -> None:
    """Two partial attention results [T, H, D] with their LSEs [T, H] (natural log)."""
    op = "merge_attention_states"
    for name, t in (("out_a", out_a), ("lse_a", lse_a), ("out_b", out_b), ("lse_b", lse_b)):
        _check_tensor(op, name, t)
    for name, t in (("out_a", out_a), ("out_b", out_b)) + ((("out", out),) if out is not None else ()):
        if t.dtype not in Q_DTYPES + (torch.float64,):
            _fail(op, TypeError, f"{name} must be bfloat16, float16, float32 or float64 (got {t.dtype})")
        if t.dim() != 3 or t.shape != out_a.shape or t.dtype != out_a.dtype:
            _fail(op, ValueError, f"{name} must be [T, H, D] like out_a ({_describe(out_a)}; got {_describe(t)})")
        if t.stride(-1) != 1:
            _fail(op, ValueError, f"{name} must be contiguous in its last dimension (strides {t.stride()})")
    error = head_dim_error(out_a.shape[-1], what="head_dim (out_a.shape[2])")
    if error:
        _fail(op, ValueError, error)
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)) + ((("lse", lse),) if lse is not None else ()):
        if t.dtype not in (torch.float32, torch.float64) or t.dtype != lse_a.dtype:
            _fail(op, TypeError, f"{name} must be float32 (or float64, like lse_a) (got {t.dtype})")
        if tuple(t.shape) != tuple(out_a.shape[:2]):
            _fail(op, ValueError, f"{name} must be [T, H] = {list(out_a.shape[:2])} (got {list(t.shape)})")
        if t.stride(-1) != 1:
            _fail(op, ValueError, f"{name} must be contiguous in its last dimension (strides {t.stride()})")
    _check_same_device(op, "out_a", out_a, lse_a=lse_a, out_b=out_b, lse_b=lse_b, out=out, lse=lse)
