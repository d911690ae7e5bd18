"""DeepSeek-V2/V3/V3.2 and GLM-5 latent attention (MLA) through attnops' latent ops, in the absorbed form vLLM and
SGLang serve.

    import attnops.hf
    model = attnops.hf.enable_mla(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16))
    cache = attnops.hf.LatentCache(model.config, max_cache_len=4096)              # or kv_format="fp8_e4m3"
    out = model.generate(input_ids, attention_mask=mask, past_key_values=cache, max_new_tokens=256)

Why it is its own path: transformers' DeepseekV3Attention (and V2's) up-projects the latents into full per-head
keys (DeepSeek-V3: qk_nope + rope = 192 values) and values (128) before it calls the attention interface, so the
function behind attn_implementation="attnops" only ever sees decompressed keys: it could not keep the latent cache
(one row of R + P values a token, shared by every head), and paged_attention does not take those head dims anyway.
The absorbed form needs the module's own projections, so `enable_mla` replaces the forward of each latent-attention
module of the model with `latent_attention_forward`, which:

- makes q (q_proj, or q_a_proj / q_a_layernorm / q_b_proj) and the compressed kv (kv_a_proj_with_mqa,
  kv_a_layernorm): c [T, R] and k_pe [T, P]; applies RoPE to q_pe and k_pe with transformers' own functions;
- absorbs the key up-projection into the query: with kv_b_proj's weight viewed [H, qk_nope + v_head, R], W_UK
  its first qk_nope rows a head, q_latent[h] = W_UK[h]^T q_nope[h], so that q_latent . c_j = q_nope . k_nope_j;
- writes [c, k_pe] with mla_cache_write and attends with mla_attention at the module's own `scaling` (YaRN's
  mscale included); applies the value up-projection W_UV (the next v_head rows) a head, then o_proj.

DeepSeek-V3.2's attention is V3's with an indexer that picks each query's keys: the forward runs that indexer
(transformers' own module) and attends with mla_attention's sparse form (`topk_indices`, the picked positions).
GLM-5's is V3.2's, some of its layers taking the previous layer's picks instead of an indexer of their own.

The latents reach it as the generic attention function's keys do (attnops/hf/attention.py): from a LatentCache
(generate's incremental decoding: the new tokens are written to its pages), from a cache of transformers' (a
DynamicCache keeps the latents and hands back the whole history: paged into a scratch cache for the call), or from
none (a plain forward). `enable_mla` also sets attn_implementation "attnops", whose mask function hands each layer
the padding mask: padded tokens (left padding) are neither written nor attended, their output rows are 0.
"""
from __future__ import annotations

import functools
import inspect
import types
from dataclasses import dataclass

import torch
from transformers import Cache, DynamicCache

from .. import formats, ops  # noqa: F401  (ops: the op schemas and implementations)
from ..cases import query_rows
from ..checks_mla import MAX_HEADS, MAX_LATENT_DIM, MAX_ROPE_DIM
from ..serving.kv_cache import LatentKVCache
from .attention import ATTN_IMPLEMENTATION, PLAIN_FORMATS, SCRATCH_PAGE_SIZE, _index, _unpack, padding_rows
from .cache import StepCache

KV_FORMATS = ("fp8_e4m3", "fp8_ds_mla")  # beside the default, the model's own dtype (fp32, bf16, fp16)


def _rotary_v3(module, q_pe, k_pe, position_embeddings, *, plain, interleaved):
    cos, sin = position_embeddings
    # DeepSeek's checkpoints lay the rotary dims out in interleaved pairs (config.rope_interleave)
    rotate = interleaved if module.config.rope_interleave else plain
    return rotate(q_pe, k_pe, cos, sin)


def _rotary_v2(module, q_pe, k_pe, position_embeddings, *, apply):
    return apply(q_pe, k_pe, position_embeddings.to(q_pe.device))  # complex freqs_cis


def _rotary_v32(module, q_pe, k_pe, position_embeddings, *, interleaved):
    cos, sin = position_embeddings
    return interleaved(q_pe, k_pe, cos, sin)  # (DeepSeek-V3.2's attention always interleaves; its indexer does not)


@functools.cache
def latent_attention_classes() -> dict:
    """{transformers' latent-attention module class: its RoPE, as its own forward applies it}. transformers'
    functions are looked up here, outside any compiled region (an import inside one breaks torch.compile's graph on
    transformers' lazy modules)."""
    from transformers.models.deepseek_v2 import modeling_deepseek_v2 as v2
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as v3
    classes = {v3.DeepseekV3Attention: functools.partial(_rotary_v3, plain=v3.apply_rotary_pos_emb,
                                                         interleaved=v3.apply_rotary_pos_emb_interleave),
               v2.DeepseekV2Attention: functools.partial(_rotary_v2, apply=v2.apply_rotary_emb)}
    try:  # DeepSeek-V3.2: latent attention with an indexer that picks each query's keys (the sparse form)
        from transformers.models.deepseek_v32 import modeling_deepseek_v32 as v32
        classes[v32.DeepseekV32Attention] = functools.partial(_rotary_v32,
                                                              interleaved=v32.apply_rotary_pos_emb_interleave)
    except ImportError:  # (a transformers without it)
        pass
    try:  # GLM-5: V3.2's, some layers sharing an earlier layer's picks
        from transformers.models.glm_moe_dsa import modeling_glm_moe_dsa as glm5
        classes[glm5.GlmMoeDsaAttention] = functools.partial(_rotary_v32,
                                                             interleaved=glm5.apply_rotary_pos_emb_interleave)
    except ImportError:
        pass
    return classes


def has_latent_attention(model: torch.nn.Module) -> bool:
    """Whether `model` has layers enable_mla serves."""
    classes = latent_attention_classes()
    return any(type(m) in classes for m in model.modules())


def enable_mla(model: torch.nn.Module) -> torch.nn.Module:
    """Serves every latent-attention layer of `model` (a transformers DeepSeek-V2/V3/V3.2 or GLM-5 causal LM)
    through attnops' latent ops: replaces each layer's forward with `latent_attention_forward` and sets
    attn_implementation "attnops" (for its padding mask). Returns the model."""
    classes = latent_attention_classes()
    layers = [m for m in model.modules() if type(m) in classes]
    if not layers:
        raise TypeError(f"enable_mla: model must have latent-attention layers ("
                        f"{', '.join(c.__name__ for c in classes)}); {type(model).__name__} has none")
    if not hasattr(model, "set_attn_implementation"):
        raise TypeError(f"enable_mla: model must be a transformers PreTrainedModel (got {type(model).__name__})")
    for m in layers:
        _check_layer(m)
    for m in layers:
        m.forward = types.MethodType(latent_attention_forward, m)
        m.attnops_rotary = classes[type(m)]  # (looked up once: the forward compiles without a cached call)
        # GLM-5's layers hand the indexer's picks on (their next layer may share them)
        m.attnops_returns_picks = "prev_topk_indices" in inspect.signature(type(m).forward).parameters
    model.set_attn_implementation(ATTN_IMPLEMENTATION)
    return model


def disable_mla(model: torch.nn.Module) -> torch.nn.Module:
    """Undoes enable_mla: every latent-attention layer runs transformers' own forward again (then
    model.set_attn_implementation picks its attention, e.g. "sdpa"). Returns the model."""
    for m in model.modules():
        if type(m) in latent_attention_classes() and "forward" in vars(m):
            del m.forward, m.attnops_rotary, m.attnops_returns_picks
    return model


def _check_layer(m) -> None:
    """What the absorbed form and the ops need of a layer, said before any forward."""
    where = f"enable_mla: layer {m.layer_idx}"
    heads = m.kv_b_proj.weight.shape[0] // (m.qk_nope_head_dim + m.v_head_dim)
    if not (m.kv_lora_rank % 64 == 0 and 64 <= m.kv_lora_rank <= MAX_LATENT_DIM):
        raise ValueError(f"{where}: kv_lora_rank must be a multiple of 64 from 64 to {MAX_LATENT_DIM}, as "
                         f"mla_attention takes (got {m.kv_lora_rank})")
    if not (m.qk_rope_head_dim % 16 == 0 and 16 <= m.qk_rope_head_dim <= MAX_ROPE_DIM):
        raise ValueError(f"{where}: qk_rope_head_dim must be a multiple of 16 from 16 to {MAX_ROPE_DIM}, as "
                         f"mla_attention takes (got {m.qk_rope_head_dim})")
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"{where}: num_attention_heads must be from 1 to {MAX_HEADS} (got {heads})")
    # absorbing W_UK into the query and applying W_UV to the latent output needs the plain weight, and no bias
    if m.kv_b_proj.bias is not None or not m.kv_b_proj.weight.is_floating_point() or \
            m.kv_b_proj.weight.element_size() == 1:
        raise TypeError(f"{where}: kv_b_proj must be a plain linear layer without bias (weight fp32/bf16/fp16, got "
                        f"{type(m.kv_b_proj).__name__} of {m.kv_b_proj.weight.dtype}); dequantize it first")


def latent_attention_forward(self, hidden_states: torch.Tensor, position_embeddings=None,
                             attention_mask: torch.Tensor | None = None, cache: Cache | None = None,
                             past_key_values: Cache | None = None, **kwargs) -> tuple:
    """DeepseekV3Attention.forward (and V2's, V3.2's, GLM-5's) in the absorbed form over attnops' latent ops (bound
    to the module by enable_mla). transformers 5.2x passes the cache as `cache`, earlier versions as
    `past_key_values`. GLM-5's returns the indexer's picks as its third value (its next layer may share them)."""
    meta = kwargs.get("attnops_meta")
    if self.training and self.attention_dropout:
        raise ValueError(f"attnops latent attention: dropout must be 0 (inference only; got "
                         f"{self.attention_dropout}): call model.eval()")
    cache = cache if cache is not None else past_key_values
    if meta is not None:  # a step of attnops' serving loop (attnops.hf.serving_model): its cache is attnops'
        cache = kwargs.get("attnops_cache")
        if not isinstance(cache, LatentKVCache):
            raise TypeError(f"attnops latent attention: attnops_meta needs attnops_cache, the LatentKVCache it "
                            f"indexes (attnops.hf.paged_kv_cache makes one for this model; got "
                            f"{type(cache).__name__})")
        if hidden_states.shape[0] != 1:
            raise ValueError(f"attnops latent attention: a serving step passes its tokens as one row [1, T] (got "
                             f"a batch of {hidden_states.shape[0]})")
    elif cache is not None and not isinstance(cache, (LatentCache, DynamicCache)):
        raise TypeError(f"attnops latent attention: cache must be an attnops.hf.LatentCache or a transformers "
                        f"DynamicCache (got {type(cache).__name__})")
    batch, q_len = hidden_states.shape[:2]
    nope, rope, v_dim, rank = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim, self.kv_lora_rank

    sparse = hasattr(self, "indexer")  # DeepSeek-V3.2's and GLM-5's: an indexer picks each query's keys
    if sparse and meta is not None and cache.index_keys is None:
        raise ValueError("attnops latent attention: a sparse-attention model (DeepSeek-V3.2, GLM-5) needs a "
                         "LatentKVCache with its indexer's keys (index_dim): attnops.hf.paged_kv_cache of its config "
                         "makes one")
    q_resid = None
    if self.q_lora_rank is None:
        q = self.q_proj(hidden_states)
    else:
        q_resid = self.q_a_layernorm(self.q_a_proj(hidden_states))
        q = self.q_b_proj(q_resid)
    q_nope, q_pe = q.view(batch, q_len, -1, nope + rope).transpose(1, 2).split([nope, rope], -1)  # [B, H, S, .]
    kv_c, k_pe = self.kv_a_proj_with_mqa(hidden_states).split([rank, rope], -1)
    kv_c = self.kv_a_layernorm(kv_c)  # [B, S, R]
    # RoPE in transformers' layout ([B, H, S, P], the key one shared head), by transformers' function
    q_pe, k_pe = self.attnops_rotary(self, q_pe, k_pe.view(batch, 1, q_len, rope), position_embeddings)
    q_pe, k_pe = q_pe.transpose(1, 2), k_pe[:, 0]  # [B, S, H, P], [B, S, P]

    weight = self.kv_b_proj.weight.view(-1, nope + v_dim, rank)  # [H, qk_nope + v_head, R]: W_UK over W_UV
    q_latent = torch.einsum("bhsd,hdr->bshr", q_nope, weight[:, :nope])  # [B, S, H, R]
    picked = topk = None  # the indexer's picks (columns [B, S, k]), and as the op's topk_indices
    picks = (self, hidden_states, q_resid, position_embeddings, attention_mask)
    shared = kwargs.get("prev_topk_indices")  # (GLM-5: the previous layer's picks, for a layer without an indexer)
    if meta is not None:
        if sparse:
            picked, topk = _step_picks(*picks, cache, meta, shared=shared)
        out = _serving_step(cache.attention_args(self.layer_idx), meta, q_latent, q_pe, kv_c, k_pe, self.scaling,
                            topk)
    elif isinstance(cache, LatentCache):
        if sparse:
            picked, topk = _listed_keys(*picks, cache, cache.columns_after(self.layer_idx, q_len), shared=shared)
        out = cache.attend(self.layer_idx, q_latent, q_pe, kv_c, k_pe, attention_mask, self.scaling, topk)
    else:
        if cache is not None:  # transformers' cache keeps the latents and hands back the whole history
            kv_c, k_pe = cache.update(kv_c[:, None], k_pe[:, None], self.layer_idx)
            kv_c, k_pe = kv_c[:, 0], k_pe[:, 0]
        if sparse:
            picked, topk = _listed_keys(*picks, cache, kv_c.shape[1], shared=shared)
        out = _scratch_attention(q_latent, q_pe, kv_c, k_pe, attention_mask, self.scaling, topk)
    out = torch.einsum("bshr,hvr->bshv", out, weight[:, nope:])  # [B, S, H, v_head]
    out = self.o_proj(out.reshape(batch, q_len, -1))
    return (out, None, picked) if self.attnops_returns_picks else (out, None)


def _listed_keys(module, hidden_states, q_resid, position_embeddings, attention_mask, cache, columns: int, *,
                 shared=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the keys the layer's indexer picks for each query, as its columns [B, S, k]; the same as mla_attention's
    topk_indices: int32, each a position among its row's valid tokens (the pages hold only those), -1 where the pick
    is a padding column, which the indexer picks only for a row with fewer keys than k). The indexer is
    transformers' own module, scoring the `columns` columns the forward sees (padding included) under the causal
    padding mask; a cache keeps its keys (update_indexer). GLM-5's layers without one take the previous layer's
    picks (`shared`)."""
    batch, q_len = hidden_states.shape[:2]
    valid = (torch.ones(batch, columns, dtype=torch.bool) if attention_mask is None else
             _padding(attention_mask, batch, columns))
    device = hidden_states.device
    if module.indexer is not None:
        causal = torch.arange(columns)[None, :] <= torch.arange(columns - q_len, columns)[:, None]  # [S, T]
        mask = (valid[:, None, :] & causal[None]).to(device)
        picked = module.indexer(hidden_states, q_resid, position_embeddings, mask, None, cache)  # [B, S, k]
    else:
        picked = _shared_picks(module, shared)
    valid = valid.to(device)
    flat = picked.flatten(1).long()
    position = (valid.cumsum(-1) - 1).gather(1, flat)  # (the valid tokens before a column: its row's position)
    positions = torch.where(valid.gather(1, flat), position, -1).view(picked.shape).to(torch.int32)
    return picked, positions


def _shared_picks(module, shared) -> torch.Tensor:
    """The picks a GLM-5 layer without an indexer takes: the previous layer's, which transformers hands it."""
    if shared is None:
        raise ValueError(f"attnops latent attention: layer {module.layer_idx} shares the picks of an earlier layer's "
                         f"indexer (prev_topk_indices), and none came")
    return shared


class _StepIndexerKeys:
    """transformers' indexer-cache protocol (update_indexer) over a LatentKVCache's paged indexer keys, for one step
    of attnops' serving loop: the step's keys go to their slots; back comes every sequence's table of keys, in one
    row of B x (the table's width in tokens) columns, sequence b's position j at column b * width + j."""

    def __init__(self, cache: LatentKVCache, meta):
        self.cache, self.meta = cache, meta

    def update_indexer(self, keys: torch.Tensor, layer_idx: int) -> torch.Tensor:
        self.cache.write_index_keys(layer_idx, keys[0], self.meta.slot_mapping)
        pages = self.cache.index_keys[layer_idx]
        return pages[self.meta.block_table.clamp(min=0).long()].reshape(1, -1, pages.shape[-1])


def _step_picks(module, hidden_states, q_resid, position_embeddings, attention_mask, cache, meta, *,
                shared=None) -> tuple[torch.Tensor, torch.Tensor]:
    """_listed_keys for a step of attnops' serving loop (its tokens one row [1, T] of several sequences): the
    indexer scores each token against its own sequence's keys up to its position (the columns _StepIndexerKeys
    lays out); returns (its picks [1, T, k], as topk_indices [T, k]). Shapes only (graph-safe)."""
    num_tokens = hidden_states.shape[1]
    batch, width = meta.block_table.shape[0], meta.block_table.shape[1] * cache.page_size
    seq, position, _ = query_rows(meta.seq_lens, meta.cu_seqlens_q, num_tokens)
    columns = torch.arange(batch * width, device=hidden_states.device)
    visible = (columns[None] // width == seq[:, None]) & (columns[None] % width <= position[:, None])  # [T, B W]
    if module.indexer is not None:
        picked = module.indexer(hidden_states, q_resid, position_embeddings, visible[None], None,
                                _StepIndexerKeys(cache, meta))
    else:
        picked = _shared_picks(module, shared)
    flat = picked[0].long()
    topk = torch.where(visible.gather(1, flat), flat - seq[:, None] * width, -1).to(torch.int32)
    return picked, topk


@dataclass
class _Step:
    """One forward's metadata for the ops (a LatentCache's is shared by the forward's layers)."""

    block_table: torch.Tensor
    seq_lens: torch.Tensor
    slot_mapping: torch.Tensor
    cu_seqlens_q: torch.Tensor | None
    kv_index: torch.Tensor | None  # flat rows of the latents to write (the valid ones), or None: every one
    q_index: torch.Tensor | None  # flat rows of the valid queries, or None: every one
    batch: int
    q_len: int


def _step(held: list[int], new: list[int], q_counts: list[int] | None, kv_index, q_index, q_len: int,
          pages_per_row: int, page_size: int, device) -> _Step:
    """Row b of the batch owns pages [b * pages_per_row, (b + 1) * pages_per_row) of its cache (one batch a
    cache: no allocator needed); it holds held[b] tokens, and its new[b] valid new latents follow them. Its query
    rows are its last q_counts[b] tokens (None: decode, one a row)."""
    batch = len(held)
    lengths = [h + n for h, n in zip(held, new)]
    width = max(1, -(-max(lengths) // page_size))
    table = torch.arange(width, dtype=torch.int32) + torch.arange(batch, dtype=torch.int32)[:, None] * pages_per_row
    row_size = pages_per_row * page_size
    slots = torch.cat([torch.arange(h, h + n) + b * row_size for b, (h, n) in enumerate(zip(held, new))])
    cu = None if q_counts is None else torch.tensor([0] + q_counts).cumsum(0).to(device, torch.int32)
    return _Step(table.to(device), torch.tensor(lengths, dtype=torch.int32, device=device), slots.to(device), cu,
                 kv_index, q_index, batch, q_len)


def _attend(pages: torch.Tensor, step: _Step, q_latent, q_pe, kv_c, k_pe, scale, format_args,
            topk: torch.Tensor | None = None) -> torch.Tensor:
    """Writes the valid latents (kv_c [B, L, R], k_pe [B, L, P]) at the step's slots and attends the valid
    queries (q_latent [B, S, H, R], q_pe [B, S, H, P]; with topk [B, S, k], each to the keys it lists); returns
    [B, S, H, R], padding rows 0."""
    kv_c, k_pe, q_latent, q_pe = (t.flatten(0, 1) for t in (kv_c, k_pe, q_latent, q_pe))
    topk = None if topk is None else topk.flatten(0, 1)
    if step.kv_index is not None:
        kv_c, k_pe = kv_c.index_select(0, step.kv_index), k_pe.index_select(0, step.kv_index)
    if step.q_index is not None:
        q_latent, q_pe = q_latent.index_select(0, step.q_index), q_pe.index_select(0, step.q_index)
        topk = None if topk is None else topk.index_select(0, step.q_index)
    torch.ops.attnops.mla_cache_write(kv_c, k_pe, pages, step.slot_mapping, **format_args)
    out = torch.ops.attnops.mla_attention(q_latent, q_pe, pages, step.block_table, step.seq_lens, step.cu_seqlens_q,
                                          scale=float(scale), topk_indices=topk, **format_args)
    return _unpack(out, step.q_index, step.batch, step.q_len)


def _serving_step(cache_args: dict, meta, q_latent, q_pe, kv_c, k_pe, scale, topk=None) -> torch.Tensor:
    """One layer of a step of attnops' serving loop: every sequence's tokens in one row (q_latent [1, T, H, R],
    q_pe [1, T, H, P], kv_c [1, T, R], k_pe [1, T, P]), written at the step's slots of the LatentKVCache and attended
    through its block table (the whole table: latent attention has no cascade; with topk [T, k], each token to the
    positions it lists). Returns [1, T, H, R]."""
    torch.ops.attnops.mla_cache_write(kv_c[0], k_pe[0], slot_mapping=meta.slot_mapping, **cache_args)
    out = torch.ops.attnops.mla_attention(q_latent[0].contiguous(), q_pe[0].contiguous(), block_table=meta.block_table,
                                          seq_lens=meta.seq_lens, cu_seqlens_q=meta.cu_seqlens_q, scale=float(scale),
                                          topk_indices=topk, **cache_args)
    return out[None]


def _scratch_attention(q_latent, q_pe, kv_c, k_pe, attention_mask, scale, topk=None) -> torch.Tensor:
    """Latents kv_c/k_pe [B, L, R]/[B, L, P] that are the whole history (a plain forward, or a cache of
    transformers'): the valid ones written to a scratch cache of one layer, the valid queries (the last S
    columns) attended there (to the keys topk [B, S, k] lists, where given)."""
    batch, q_len, kv_len = q_latent.shape[0], q_latent.shape[1], kv_c.shape[1]
    if kv_c.dtype not in PLAIN_FORMATS:
        raise TypeError(f"attnops latent attention: the model's activations must be float32, bfloat16 or float16 "
                        f"(got {kv_c.dtype})")
    kv_counts, q_counts, kv_index, q_index = [kv_len] * batch, [q_len] * batch, None, None
    if attention_mask is not None:
        valid = _padding(attention_mask, batch, kv_len)
        kv_counts, q_counts = valid.sum(-1).tolist(), valid[:, kv_len - q_len:].sum(-1).tolist()
        kv_index = None if all(n == kv_len for n in kv_counts) else _index(valid, kv_c.device)
        q_index = None if all(n == q_len for n in q_counts) else _index(valid[:, kv_len - q_len:], kv_c.device)
    pages_per_row = -(-kv_len // SCRATCH_PAGE_SIZE)
    pages = kv_c.new_empty(batch * pages_per_row, SCRATCH_PAGE_SIZE, kv_c.shape[2] + k_pe.shape[2])
    step = _step([0] * batch, kv_counts, q_counts, kv_index, q_index, q_len, pages_per_row, SCRATCH_PAGE_SIZE,
                 kv_c.device)
    return _attend(pages, step, q_latent, q_pe, kv_c, k_pe, scale, {}, topk)


def _padding(attention_mask, batch: int, columns: int) -> torch.Tensor:
    """The padding mask (True: a token) on the host, [batch, columns] (enable_mla sets the attn_implementation whose
    masks these are)."""
    return padding_rows(attention_mask, batch, columns, "attnops latent attention")


class LatentCache(StepCache):
    """The latent KV cache of a DeepSeek-V2/V3 model (`config`) in attnops pages: one row of kv_lora_rank +
    qk_rope_head_dim values a token and layer, shared by every head (DeepSeek-V3: 576 values, against 128 heads x
    (192 + 128) of decompressed keys and values), for `model.generate(..., past_key_values=LatentCache(...))` on a
    model passed through `enable_mla`.

    max_cache_len: the most tokens a row holds (prompt and generated, padding excluded); the pages, batch x
    max_cache_len / page_size a layer, are allocated at the first forward, on its device.
    kv_format: None (the model's activation dtype), "fp8_e4m3" (kv_scale: float, stored = value / kv_scale;
    default 1.0) or "fp8_ds_mla" (DeepSeek's fp8 layout: a scale a 128 latent values, kept in the row; R a multiple
    of 128). One batch per cache: `reset()` empties it for the next one. `pages` is the storage,
    [num_layers, num_pages, page_size, R + P] (uint8 [.., R + 4 R/128 + 2 P] bytes for "fp8_ds_mla").

    Lengths follow transformers' convention, as PagedCache's: `get_seq_length()` counts the columns processed,
    padding included; the pages hold only the valid tokens.
    """

    def __init__(self, config, *, max_cache_len: int, kv_format: str | None = None, page_size: int = 16,
                 kv_scale: float | None = None):
        super().__init__(layers=[])
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        dims = {name: getattr(config, name, None) for name in ("num_hidden_layers", "kv_lora_rank",
                                                               "qk_rope_head_dim")}
        if not all(isinstance(v, int) and v > 0 for v in dims.values()):
            raise ValueError(f"LatentCache: config must be a latent-attention (MLA) model's, with positive "
                             f"{', '.join(dims)} (got {dims} for model_type {getattr(config, 'model_type', None)!r})")
        if isinstance(max_cache_len, bool) or not isinstance(max_cache_len, int) or max_cache_len < 1:
            raise ValueError(f"LatentCache: max_cache_len must be a positive int (got {max_cache_len!r})")
        if isinstance(page_size, bool) or not isinstance(page_size, int) or not 1 <= page_size <= 256 or \
                page_size & (page_size - 1):
            raise ValueError(f"LatentCache: page_size must be a power of two from 1 to 256 (got {page_size!r})")
        if kv_format is not None and kv_format not in KV_FORMATS:
            raise ValueError(f"LatentCache: kv_format must be None (the model's dtype) or one of {KV_FORMATS} (got "
                             f"{kv_format!r})")
        if kv_scale is not None and (kv_format != "fp8_e4m3" or isinstance(kv_scale, bool) or
                                     not isinstance(kv_scale, (int, float)) or not 0 < kv_scale < float("inf")):
            raise ValueError(f"LatentCache: kv_scale must be a finite float > 0, with kv_format 'fp8_e4m3' (got "
                             f"{kv_scale!r} with kv_format {kv_format!r})")
        self.num_layers, self.latent_dim, self.rope_dim = dims.values()
        if kv_format == formats.LATENT_FP8_FORMAT and self.latent_dim % formats.LATENT_FP8_TILE:
            raise ValueError(f"LatentCache: kv_format {kv_format!r} takes kv_lora_rank a multiple of "
                             f"{formats.LATENT_FP8_TILE} (got {self.latent_dim})")
        self._max_cache_len, self.kv_format, self.page_size = max_cache_len, kv_format, page_size
        self.kv_scale = 1.0 if kv_scale is None else float(kv_scale)
        self.pages_per_row = -(-max_cache_len // page_size)
        self.pages: torch.Tensor | None = None  # [num_layers, num_pages, page_size, R + P], at the first forward
        self._scale: torch.Tensor | None = None  # kv_scale on the pages' device (fp8)
        self._lengths: list[int] = []  # valid tokens held per row; [] until the first forward, and after reset()
        self._columns = 0  # positions processed per row, padding included
        self._last_layer = None  # the layer of the latest call: a layer at or below it starts a new forward
        self._step: _Step | None = None
        self._indexer_keys: dict[int, torch.Tensor] = {}  # DeepSeek-V3.2's indexer keys a layer, [B, columns, D]

    # --- what transformers asks of a Cache beyond StepCache ------------------------------------------------------
    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        raise ValueError("LatentCache: a layer called update, so its attention is transformers' own: pass the model "
                         "through attnops.hf.enable_mla(model) first")

    @property
    def is_initialized(self) -> bool:
        return self.pages is not None

    @property
    def batch_size(self) -> int:
        return len(self._lengths) or -1

    def __len__(self) -> int:
        return self.num_layers

    def reset(self) -> None:
        """Empties the cache (its pages stay allocated) for a new batch."""
        self._lengths, self._columns, self._last_layer, self._step = [], 0, None, None
        self._indexer_keys = {}

    def update_indexer(self, indexer_key_states: torch.Tensor, layer_idx: int) -> torch.Tensor:
        """DeepSeek-V3.2's indexer keys (transformers' indexer calls this): the forward's [B, S, D] appended to the
        layer's, every column (padding included, as the indexer scores columns), returned whole. Kept dense: they
        are the indexer's, which scores every cached key, not the attention's."""
        held = self._indexer_keys.get(layer_idx)
        keys = indexer_key_states if held is None else torch.cat([held, indexer_key_states], dim=1)
        self._indexer_keys[layer_idx] = keys
        return keys

    def columns_after(self, layer: int, q_len: int) -> int:
        """The columns a row has processed once layer `layer`'s call of this forward (q_len new columns) is in."""
        new_forward = self._last_layer is None or layer <= self._last_layer
        return self._columns + (q_len if new_forward else 0)

    # --- attnops ---------------------------------------------------------------------------------------------
    def _format_args(self) -> dict:
        if self.kv_format == "fp8_e4m3":
            return dict(kv_format="fp8_e4m3", kv_scale=self._scale)
        return dict(kv_format=self.kv_format) if self.kv_format else {}

    def _prepare(self, kv_c: torch.Tensor, q_len: int, attention_mask) -> _Step:
        batch = kv_c.shape[0]
        if self._lengths and batch != len(self._lengths):
            raise ValueError(f"LatentCache: this cache holds a batch of {len(self._lengths)} rows, the forward has "
                             f"{batch}: reset() it for a new batch")
        if kv_c.dtype not in PLAIN_FORMATS:
            raise TypeError(f"LatentCache: the model's activations must be float32, bfloat16 or float16 (got "
                            f"{kv_c.dtype})")
        counts, index = [q_len] * batch, None
        if attention_mask is not None:
            valid = _padding(attention_mask, batch, self._columns)[:, -q_len:]
            counts = valid.sum(-1).tolist()
            index = None if all(n == q_len for n in counts) else _index(valid, kv_c.device)
        held = self._lengths or [0] * batch
        for b, n in enumerate(counts):
            if held[b] + n > self._max_cache_len:
                raise ValueError(f"LatentCache: row {b} would hold {held[b] + n} tokens, over "
                                 f"max_cache_len={self._max_cache_len}")
        row, dtype = formats.latent_row(self.kv_format or PLAIN_FORMATS[kv_c.dtype], self.latent_dim, self.rope_dim)
        num_pages = batch * self.pages_per_row
        if self.pages is None or self.pages.dtype != dtype or self.pages.device != kv_c.device or \
                self.pages.shape[1] < num_pages:
            self.pages = torch.zeros(self.num_layers, num_pages, self.page_size, row, dtype=dtype,
                                     device=kv_c.device)
            self._scale = torch.tensor([self.kv_scale], dtype=torch.float32, device=kv_c.device)
        decode = q_len == 1 and index is None  # one valid token a row: cu_seqlens_q None
        step = _step(held, counts, None if decode else counts, index, index, q_len, self.pages_per_row,
                     self.page_size, kv_c.device)
        self._lengths = [h + n for h, n in zip(held, counts)]
        return step

    def attend(self, layer: int, q_latent, q_pe, kv_c, k_pe, attention_mask, scale, topk=None) -> torch.Tensor:
        """Writes the layer's valid new latents (kv_c [B, S, R], k_pe [B, S, P]) into its pages and attends the
        absorbed queries (q_latent [B, S, H, R], q_pe [B, S, H, P]; with topk [B, S, k], each to the key positions
        it lists); returns [B, S, H, R]."""
        if self._last_layer is None or layer <= self._last_layer:  # a new forward
            self._columns += kv_c.shape[1]
            self._step = None
        self._last_layer = layer
        if self._step is None:
            self._step = self._prepare(kv_c, kv_c.shape[1], attention_mask)
        return _attend(self.pages[layer], self._step, q_latent, q_pe, kv_c, k_pe, scale, self._format_args(), topk)
