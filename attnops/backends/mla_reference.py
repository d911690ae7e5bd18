"""Latent attention (MLA) in plain PyTorch: the oracle the MLA kernels are tested against, and what serves MLA where
no kernel does (the CPU).

Absorbed MLA is multi-query attention with one KV head whose key is the whole latent row [c, r] (R + P values) and
whose value is its first R values: so this is paged_attention's reference on that view (q = [q_nope, q_pe], one KV
head, the row as K and as V), its output cut to the first R values. Every rule of paged_attention's (bad indices
and their record, sinks, tree masks, the LSE, NaN) carries over unchanged.
"""
from __future__ import annotations

import torch

from .. import errors, formats
from .reference import paged_attention_reference


def mla_attention_reference(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale,
                            kv_format="auto", kv_scale=None, sinks=None, tree_mask=None,
                            compute_dtype=torch.float64, return_lse=False):
    """[T, H, R] in q_nope's dtype (with `return_lse`, and each row's natural-log LSE [T, H] in compute_dtype)."""
    latent_dim = q_nope.shape[2]
    q = torch.cat([q_nope, q_pe], dim=-1)
    rows = kv_cache[:, :, None, :]  # [num_pages, page_size, 1 KV head, R + P]
    out, lse = paged_attention_reference(q, rows, rows, block_table, seq_lens, cu_seqlens_q, scale=scale,
                                         kv_format="auto", k_scale=kv_scale, v_scale=kv_scale, sinks=sinks,
                                         tree_mask=tree_mask, compute_dtype=compute_dtype, return_lse=True)
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
    rows = torch.cat([kv_c, k_pe], dim=-1)[keep]
    fmt = formats.resolve_kv_format(kv_format, kv_cache.dtype)
    stored, _ = formats.quantize(rows, fmt, kv_scale, kv_cache.dtype)
    kv_cache.view(-1, kv_cache.shape[2])[slot_mapping[keep]] = stored
