"""The reference backend: plain PyTorch on any device, every feature of the contract, written for clarity.

It is the oracle every kernel is tested against (call `paged_attention_reference(..., compute_dtype=torch.float64)`;
latent attention's: `mla_attention_reference`) and serves any case no faster backend covers. It loops over
sequences on the host (reading seq_lens), so it is slow and not CUDA-graph safe: dispatch puts it last.
"""
from __future__ import annotations

import torch

from .. import errors, formats
from .base import Backend, MLACase, MLAWriteCase, common_reasons

# Every format formats.py defines, each read through its (de)quantization there; a new format is served here once
# it is named
KV_FORMATS = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4")


def _gather_sequence(cache: torch.Tensor, scale: torch.Tensor | None, pages: torch.Tensor, length: int, fmt: str,
                     dtype: torch.dtype) -> torch.Tensor:
    """The first `length` tokens of one sequence from its pages (indices inside the cache), dequantized:
    [length, Hkv, D]."""
    stored = cache[pages].flatten(0, 1)[:length]
    if fmt is None:  # values already: the latent reference's float64 rows of an "fp8_ds_mla" cache
        return stored.to(dtype)
    if formats.FORMATS[fmt].scale == formats.BLOCK_SCALE:  # paged like the cache
        scale = scale[pages].flatten(0, 1)[:length]
    return formats.dequantize(stored, fmt, scale, dtype)


def paged_attention_reference(q, k_cache, v_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale=None,
                              soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None, v_scale=None,
                              sinks=None, tree_mask=None, topk_indices=None, compute_dtype=torch.float64,
                              return_lse=False):
    """Paged attention, one sequence at a time, in `compute_dtype`. Returns [T, Hq, D] in q's dtype; with
    `return_lse`, (that, lse [T, Hq] in compute_dtype): each row's log-sum-exp, the natural log of its softmax
    denominator (sink included), -inf for a row that sees no key (with sinks: the sink's logit, its term alone),
    NaN for a row the bad-index rules make NaN.

    sinks [Hq]: a logit per head that joins every row's softmax denominator (and nothing of V). tree_mask
    [T, Q] bool: inside its query block, row i of a sequence sees block key j iff tree_mask[row, j] (j < Q),
    in place of the causal rule; keys before the block stay visible.
    topk_indices [T, K] (latent attention's sparse form): row t sees only the key positions it lists (-1: none)
    that its rules above let it see, each listing one term of its softmax; a listed position outside its sequence
    makes the row NaN (recorded under topk_indices, at the row).
    Bad indices give docs/design.md's results ("Bad indices") and are recorded in the device's error buffer
    (attnops.errors): nothing outside a tensor is read."""
    fmt = formats.resolve_kv_format(kv_format, k_cache.dtype)
    num_tokens, num_q_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = head_dim ** -0.5 if scale is None else scale
    out = torch.zeros(q.shape, dtype=compute_dtype, device=q.device)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), dtype=compute_dtype, device=q.device)
    if sinks is not None:
        lse[:] = sinks.to(compute_dtype)

    lengths = seq_lens.tolist()
    starts = list(range(len(lengths) + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
    bad_entry = errors.cu_seqlens_violation(starts, num_tokens)
    if bad_entry is not None:  # which rows are whose is undefined: every row is NaN, nothing is read
        errors.record(q.device, errors.CU_SEQLENS_Q, bad_entry)
        nan = torch.full_like(q, float("nan"))
        return (nan, lse.fill_(float("nan"))) if return_lse else nan
    num_pages = k_cache.shape[0]
    capacity = block_table.shape[1] * page_size
    for b, kv_len in enumerate(lengths):
        q_start, q_end = starts[b], starts[b + 1]
        num_queries = q_end - q_start
        if num_queries == 0:
            continue  # no rows: nothing of the sequence is read
        if not 0 <= kv_len <= capacity:  # no defined keys: the rows are NaN
            errors.record(q.device, errors.SEQ_LENS, b)
            out[q_start:q_end] = float("nan")
            lse[q_start:q_end] = float("nan")
            continue
        topk_bad = torch.zeros(num_queries, dtype=torch.bool, device=q.device)
        if topk_indices is not None:
            listed = topk_indices[q_start:q_end].long()
            topk_bad = ((listed < -1) | (listed >= kv_len)).any(-1)
            if bool(topk_bad.any()):
                errors.record(q.device, errors.TOPK_INDICES, q_start + int(topk_bad.nonzero()[0, 0]))
        if kv_len == 0:  # an empty sequence's rows stay 0
            out[q_start:q_end][topk_bad] = float("nan")
            lse[q_start:q_end][topk_bad] = float("nan")
            continue
        pages = block_table[b, : (kv_len + page_size - 1) // page_size].long()
        page_ok = (pages >= 0) & (pages < num_pages)
        # a key on a page outside the cache is never read: it is 0 here and a NaN score for the rows that see it
        bad_key = (~page_ok).repeat_interleave(page_size)[:kv_len]
        safe_pages = torch.where(page_ok, pages, 0)
        if num_pages == 0:
            k = v = torch.zeros(kv_len, num_q_heads, head_dim, dtype=compute_dtype, device=q.device)
        else:
            k = _gather_sequence(k_cache, k_scale, safe_pages, kv_len, fmt, compute_dtype)
            v = _gather_sequence(v_cache, v_scale, safe_pages, kv_len, fmt, compute_dtype)
            k = k.masked_fill(bad_key[:, None, None], 0).repeat_interleave(group, dim=1)
            v = v.masked_fill(bad_key[:, None, None], 0).repeat_interleave(group, dim=1)
        queries = q[q_start:q_end].to(compute_dtype)  # [n, Hq, D]

        scores = torch.einsum("qhd,khd->hqk", queries, k) * scale
        if 0 < soft_cap < float("inf"):  # inf: no cap
            scores = soft_cap * torch.tanh(scores / soft_cap)
        scores = scores.masked_fill(bad_key, float("nan"))
        # the queries are the sequence's last num_queries positions; each sees keys at positions <= its own, or
        # with a tree mask, every key before the block and the block's keys its mask row names
        block_start = kv_len - num_queries
        query_pos = torch.arange(block_start, kv_len, device=q.device)[:, None]
        key_pos = torch.arange(kv_len, device=q.device)[None, :]
        if tree_mask is None:
            visible = key_pos <= query_pos
        else:
            in_block = torch.zeros(num_queries, num_queries, dtype=torch.bool, device=q.device)
            cols = min(num_queries, tree_mask.shape[1])  # columns past Q: not visible
            in_block[:, :cols] = tree_mask[q_start:q_end, :cols]
            # (more query rows than keys, which only a bad call has: the block's first columns have no key)
            visible = torch.cat([torch.ones(num_queries, max(block_start, 0), dtype=torch.bool, device=q.device),
                                 in_block[:, max(-block_start, 0):]], dim=1)
        if window_left >= 0:
            visible &= query_pos - key_pos <= window_left
        if topk_indices is not None:  # a key listed n times is n terms: log(n) joins its score
            counts = torch.zeros(num_queries, kv_len + 1, dtype=compute_dtype, device=q.device)
            counts.scatter_add_(1, torch.where((listed >= 0) & (listed < kv_len), listed, kv_len),
                                torch.ones_like(listed, dtype=compute_dtype))
            counts = counts[:, :kv_len]
            visible &= counts > 0
            scores = scores + torch.log(counts)
        if bool((visible & bad_key).any()):
            errors.record(q.device, errors.BLOCK_TABLE, b)
        scores = scores.masked_fill(~visible, float("-inf"))
        # the sink is one more logit in the denominator, with no value: its column is dropped after the softmax
        sink = None if sinks is None else sinks.to(compute_dtype)[:, None, None].expand(num_q_heads, num_queries, 1)
        lse[q_start:q_end] = torch.logsumexp(scores if sink is None else torch.cat([scores, sink], -1), -1).T
        # a row that sees no key is 0; NaN in a visible score (from q or K) or in V reaches exactly the rows that
        # read it, as in SDPA (masked keys are -inf before the softmax, so a NaN key outside a row's view is not read)
        sees_a_key = visible.any(-1)  # [n]
        scores = torch.where(sees_a_key[None, :, None], scores, 0.0)
        if sink is None:
            probs = torch.softmax(scores, dim=-1)
        else:
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        if bool(torch.isfinite(v).all()):
            rows = torch.einsum("hqk,khd->qhd", probs, v)
        else:  # 0 x NaN is NaN: each row reads only the values it sees
            rows = torch.stack([torch.einsum("hk,khd->hd", probs[:, i, seen], v[seen])
                                for i, seen in enumerate(visible)])
        out[q_start:q_end] = torch.where(sees_a_key[:, None, None], rows, 0.0)
        out[q_start:q_end][topk_bad] = float("nan")
        lse[q_start:q_end][topk_bad] = float("nan")
    return (out.to(q.dtype), lse) if return_lse else out.to(q.dtype)


def reshape_and_cache_reference(key, value, k_cache, v_cache, slot_mapping, *, kv_format="auto", k_scale=None,
                                v_scale=None, k_block_scale=None, v_block_scale=None) -> None:
    """Writes each token t to slot slot_mapping[t] (page * page_size + offset), quantizing; slot -1 is skipped. A
    slot below -1 or past the cache is a bad index: that token writes nothing, the others are written."""
    fmt = formats.resolve_kv_format(kv_format, k_cache.dtype)
    page_size = k_cache.shape[1]
    num_slots = k_cache.shape[0] * page_size
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        errors.record(key.device, errors.SLOT_MAPPING, int(bad.nonzero()[0, 0]))
    keep = (slot_mapping >= 0) & ~bad
    slots = slot_mapping[keep]
    pages, offsets = slots // page_size, slots % page_size
    for src, cache, scale, block_scale in ((key, k_cache, k_scale, k_block_scale),
                                           (value, v_cache, v_scale, v_block_scale)):
        stored, new_block_scale = formats.quantize(src[keep], fmt, scale, cache.dtype)
        cache[pages, offsets] = stored
        if new_block_scale is not None:
            block_scale[pages, offsets] = new_block_scale


def merge_attention_states_reference(out_a, lse_a, out_b, lse_b, out, lse) -> None:
    """The exact softmax merge of two partial results over disjoint key sets, in float64: with m the larger LSE,
    out = (e^(lse_a - m) out_a + e^(lse_b - m) out_b) / (e^(lse_a - m) + e^(lse_b - m)), lse = m + log(that sum).
    A side with lse -inf (no key) leaves the other unchanged; both: out 0, lse -inf. NaN in an LSE reaches its
    row."""
    la, lb = lse_a.double(), lse_b.double()
    m = torch.maximum(la, lb)
    m_use = torch.where(m == float("-inf"), 0.0, m)
    wa, wb = torch.exp(la - m_use), torch.exp(lb - m_use)
    total = wa + wb
    a = torch.where((wa > 0)[..., None], out_a.double() * (wa / total)[..., None], 0.0)
    b = torch.where((wb > 0)[..., None], out_b.double() * (wb / total)[..., None], 0.0)
    has_nan = (la.isnan() | lb.isnan())[..., None]
    out.copy_(torch.where(has_nan, float("nan"), a + b))
    lse.copy_(torch.where(total > 0, m_use + torch.log(total), float("-inf")).masked_fill(
        la.isnan() | lb.isnan(), float("nan")))


# Latent attention (MLA): absorbed MLA is multi-query attention with one KV head whose key is the whole latent row
# [c, r] (R + P values) and whose value is its first R values, so its reference is paged_attention's on that view
# (q = [q_nope, q_pe], one KV head, the row as K and as V), the output cut to the first R values: every rule of
# paged_attention's (bad indices and their record, sinks, tree masks, the LSE, NaN) carries over unchanged.

def mla_attention_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                            kv_format="auto", kv_scale=None, sinks=None, tree_mask=None, topk_indices=None,
                            compute_dtype=torch.float64, return_lse=False):
    """[T, H, R] in q_nope's dtype (with `return_lse`, and each row's natural-log LSE [T, H] in compute_dtype)."""
    latent_dim, rope_dim = q_nope.shape[2], q_pe.shape[2]
    q = torch.cat([q_nope, q_pe], dim=-1)
    if kv_format == formats.LATENT_FP8_FORMAT:  # its rows as values, exactly (float64)
        kv_cache = formats.dequantize_latent_fp8(kv_cache, latent_dim, rope_dim, torch.float64)
    rows = kv_cache[:, :, None, :]  # [num_pages, page_size, 1 KV head, R + P]
    out, lse = paged_attention_reference(q, rows, rows, block_table, seq_lens, cu_seqlens_q, scale=scale,
                                         kv_format="auto", k_scale=kv_scale, v_scale=kv_scale, sinks=sinks,
                                         tree_mask=tree_mask, topk_indices=topk_indices, compute_dtype=compute_dtype,
                                         return_lse=True)
    out = out[..., :latent_dim].contiguous()
    return (out, lse) if return_lse else out


def mla_cache_write_reference(kv_c, k_pe, kv_cache, slot_mapping, *, kv_format="auto", kv_scale=None) -> None:
    """Row slot_mapping[i] = [kv_c[i], k_pe[i]], quantized as attnops.formats does; slot -1 is skipped, any other
    slot outside the cache writes nothing and is recorded."""
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    bad = (slot_mapping < -1) | (slot_mapping >= num_slots)
    if bool(bad.any()):
        errors.record(kv_c.device, errors.SLOT_MAPPING, int(bad.nonzero()[0, 0]))
    keep = (slot_mapping >= 0) & ~bad
    if kv_format == formats.LATENT_FP8_FORMAT:
        stored = formats.quantize_latent_fp8(kv_c[keep], k_pe[keep])
    else:
        rows = torch.cat([kv_c, k_pe], dim=-1)[keep]
        stored, _ = formats.quantize(rows, formats.resolve_kv_format(kv_format, kv_cache.dtype), kv_scale,
                                     kv_cache.dtype)
    slots = slot_mapping[keep]  # (page, offset), not a flat view: a page- or row-strided cache has none
    kv_cache[slots // kv_cache.shape[1], slots % kv_cache.shape[1]] = stored


class ReferenceBackend(Backend):
    name = "reference"
    description = "plain PyTorch, any device, every format and feature; host loop per sequence (slow, not graph-safe)"
    serves_mla = True

    def supports(self, case) -> list[str]:
        if isinstance(case, (MLACase, MLAWriteCase)):
            return []  # every valid latent-attention case (the checks bound its formats and shapes)
        return common_reasons(case, kv_formats=KV_FORMATS)  # the oracle serves every valid case of its formats

    def invariance_reasons(self, case) -> list[str]:
        return []  # one sequence at a time: a row's sums are its own sequence's, in one order

    def mla_attention(self, call) -> None:
        out, lse = mla_attention_reference(
            call.q_nope, call.q_pe, call.kv_cache, call.block_table, call.seq_lens, call.cu_seqlens_q,
            scale=call.scale, kv_format=call.case.kv_format, kv_scale=call.kv_scale, sinks=call.sinks,
            tree_mask=call.tree_mask, topk_indices=call.topk_indices, compute_dtype=torch.float64, return_lse=True)
        call.out.copy_(out)
        if call.lse is not None:
            call.lse.copy_(lse)

    def mla_cache_write(self, call) -> None:
        mla_cache_write_reference(call.kv_c, call.k_pe, call.kv_cache, call.slot_mapping,
                                  kv_format=call.case.kv_format, kv_scale=call.kv_scale)

    def paged_attention(self, call) -> None:
        result = paged_attention_reference(
            call.q, call.k_cache, call.v_cache, call.block_table, call.seq_lens, call.cu_seqlens_q, scale=call.scale,
            soft_cap=call.soft_cap, window_left=call.window_left, kv_format=call.kv_format, k_scale=call.k_scale,
            v_scale=call.v_scale, sinks=call.sinks, tree_mask=call.tree_mask, compute_dtype=torch.float64,
            return_lse=call.lse is not None)
        if call.lse is None:
            call.out.copy_(result)
        else:
            call.out.copy_(result[0])
            call.lse.copy_(result[1])

    def reshape_and_cache(self, call) -> None:
        reshape_and_cache_reference(call.key, call.value, call.k_cache, call.v_cache, call.slot_mapping,
                                    kv_format=call.kv_format, k_scale=call.k_scale, v_scale=call.v_scale,
                                    k_block_scale=call.k_block_scale, v_block_scale=call.v_block_scale)
