"""The attention function attnops registers with transformers (`attn_implementation="attnops"`), and the mask
function registered beside it.

transformers calls `attention_forward(module, query, key, value, attention_mask, scaling=..., dropout=...,
sliding_window=..., softcap=..., s_aux=..., **kwargs)` in every attention layer, with query/key/value
[B, heads, S, D] after RoPE (and after qk-norm, for Qwen3), and expects [B, S, Hq, D] back. The keys and values
reach it in one of three ways:

- from attnops' serving loop (`attnops.hf.serving_model`): the step's tokens flattened into one row [1, H, T, D],
  with the PagedKVCache and the step's BatchMetadata as keyword arguments (`attnops_cache`, `attnops_meta`):
  one reshape_and_cache and one paged_attention, nothing else, so that torch.compile(fullgraph=True) and CUDA
  graphs take the step whole;
- from a `PagedCache` (`model.generate(..., past_key_values=PagedCache(...))`): the cache's `update` hands
  itself to the layer's attention call, which writes the new tokens into the cache's pages and attends there;
- from any other cache, or none (a plain forward): the keys and values are the whole history, paged into a
  scratch cache for this call. Right, but it copies the history in every layer of every step.

Padding reaches the function as a mask [B, 1, 1, kv_length] (True: a token), what the mask function below returns
for attn_implementation "attnops": causality, sliding windows and soft caps are the op's. Padded tokens are never
written (their keys are left out) nor attended (their query rows are left out, and their output rows are 0).
"""
from __future__ import annotations

import threading

import torch

from .. import ops  # noqa: F401  (the op schemas and implementations)
from ..serving.kv_cache import PagedKVCache

ATTN_IMPLEMENTATION = "attnops"
PLAIN_FORMATS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
SCRATCH_PAGE_SIZE = 16
_FROM_MODULE = object()  # sliding_window not passed: read module.sliding_window (Llama passes none)


class _Handoff(threading.local):
    """A PagedCache's `update` hands the cache to the attention call that follows it in the same layer (the
    attention function is not given the cache object itself), and to the calls of the later layers that read that
    layer's keys (KV-shared layers: they get the same key tensor and call no update). Keyed by layer and by the key
    tensor `update` returned, so that a hand-over left behind (a forward that raised in between) is never taken by
    another call."""

    def __init__(self):
        self.pending: dict = {}  # layer -> (cache, the key tensor update returned)


_HANDOFF = _Handoff()


def hand_over(cache, layer: int, key: torch.Tensor) -> None:
    _HANDOFF.pending[layer] = (cache, key)


def unread_hand_over(cache, layer: int, new_forward: bool) -> bool:
    """Whether an attention call left a hand-over of `cache` unread before this update of `layer`: one for an
    earlier layer, or at a new forward any but a KV-shared layer's (those of a forward that stopped early are
    dropped)."""
    shared = cache.kv.shared_layers if cache.kv is not None else {}
    unread = False
    for pending_layer, (owner, _) in list(_HANDOFF.pending.items()):
        if owner is not cache:
            continue
        if new_forward and pending_layer in shared:
            del _HANDOFF.pending[pending_layer]
        elif new_forward or pending_layer < layer:
            unread = True
    return unread


def _take(layer: int, key: torch.Tensor):
    entry = _HANDOFF.pending.get(layer)
    if entry is None or entry[1] is not key:
        return None
    del _HANDOFF.pending[layer]
    return entry[0]


def attention_options(module, scaling, sliding_window, softcap, s_aux) -> dict:
    """paged_attention's keyword arguments for this layer: scale, soft_cap, window_left (and sinks)."""
    if sliding_window is _FROM_MODULE:
        sliding_window = getattr(module, "sliding_window", None)
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"attnops attention: sliding_window must be None or >= 1 (got {sliding_window})")
    # transformers' window of W keys is the query and the W - 1 keys before it (its masks: kv > q - W)
    options = dict(scale=None if scaling is None else float(scaling), soft_cap=float(softcap) if softcap else 0.0,
                   window_left=int(sliding_window) - 1 if sliding_window else -1)
    if s_aux is not None:  # gpt-oss: a learned logit per query head in each softmax's denominator
        options["sinks"] = s_aux.float()
    return options


def _rows(x: torch.Tensor) -> torch.Tensor:
    """[B, H, S, D] -> [B*S, H, D], token-major as the ops take them."""
    return x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3])


def attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = _FROM_MODULE, softcap: float | None = None,
                      s_aux: torch.Tensor | None = None, *, attnops_cache: PagedKVCache | None = None,
                      attnops_meta=None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface over attnops' ops; returns ([B, S, Hq, D], None)."""
    layer = module.layer_idx
    # a PagedCache's hand-over is taken first, so that it is taken even when this call then fails (a serving
    # step, the path torch.compile traces, has none)
    cache = _take(layer, key) if attnops_meta is None else None
    if dropout:
        raise ValueError(f"attnops attention: dropout must be 0 (inference only; got {dropout}): call "
                         f"model.eval()")
    options = attention_options(module, scaling, sliding_window, softcap, s_aux)
    if attnops_meta is not None:
        return _serving_step(module, query, key, value, attnops_cache, attnops_meta, options)
    if cache is not None:
        return cache.attend(layer, query, key, value, attention_mask, options), None
    return _scratch_attention(query, key, value, attention_mask, options), None


def _serving_step(module, query, key, value, cache, meta, options):
    """One step of attnops' serving loop: the tokens of every sequence in one row, the cache and metadata given. A
    KV-shared layer writes nothing: its cache layer is the one whose keys it reads (PagedKVCache's shared_layers)."""
    layer = module.layer_idx
    if cache is None:
        raise ValueError("attnops attention: attnops_meta needs attnops_cache (the PagedKVCache it indexes)")
    if query.shape[0] != 1:
        raise ValueError(f"attnops attention: a serving step passes its tokens as one row [1, T] (got a batch of "
                         f"{query.shape[0]})")
    shared = layer in cache.shared_layers
    if getattr(module, "is_kv_shared_layer", False) != shared:
        raise ValueError(f"attnops attention: layer {layer} {'reads' if not shared else 'does not read'} an earlier "
                         f"layer's keys, but attnops_cache's shared_layers say otherwise: make the cache with "
                         f"attnops.hf.paged_kv_cache(model.config, ...)")
    if not shared:
        torch.ops.attnops.reshape_and_cache(key[0].transpose(0, 1), value[0].transpose(0, 1),
                                            slot_mapping=meta.slot_mapping, **cache.write_args(layer))
    # [T, Hq, D] rows contiguous, as every backend's kernels are fed (transformers' RoPE output may be laid out
    # heads-major; under torch.compile the copy folds into the kernel that makes q)
    out = meta.attend(query[0].transpose(0, 1).contiguous(), **cache.attention_args(layer), **options)
    return out[None], None


def _scratch_attention(query, key, value, attention_mask, options) -> torch.Tensor:
    """Keys and values [B, Hkv, L, D] that are the whole history (no cache, or a cache of transformers'): the valid
    ones paged into a one-layer scratch cache, the valid queries (the last S columns) attended there."""
    batch, num_q_heads, q_len, head_dim = query.shape
    num_kv_heads, kv_len = key.shape[1], key.shape[2]
    if key.dtype not in PLAIN_FORMATS:
        raise TypeError(f"attnops attention: key must be float32, bfloat16 or float16 (got {key.dtype})")
    if attention_mask is None:
        kv_counts, q_counts, kv_index, q_index = [kv_len] * batch, [q_len] * batch, None, None
    else:
        valid = padding_rows(attention_mask, batch, kv_len, "attnops attention")
        kv_counts, q_counts = valid.sum(-1).tolist(), valid[:, kv_len - q_len:].sum(-1).tolist()
        kv_index = None if all(n == kv_len for n in kv_counts) else _index(valid, query.device)
        q_index = None if all(n == q_len for n in q_counts) else _index(valid[:, kv_len - q_len:], query.device)
    scratch = PagedKVCache(1, batch * -(-kv_len // SCRATCH_PAGE_SIZE), SCRATCH_PAGE_SIZE, num_kv_heads, head_dim,
                           kv_format=PLAIN_FORMATS[key.dtype], device=query.device)
    for b in range(batch):
        scratch.allocate(b)
    meta = scratch.prepare(list(range(batch)), kv_counts, decode=False)
    keys, values = _rows(key), _rows(value)
    if kv_index is not None:
        keys, values = keys.index_select(0, kv_index), values.index_select(0, kv_index)
    torch.ops.attnops.reshape_and_cache(keys, values, slot_mapping=meta.slot_mapping, **scratch.write_args(0))
    queries = _rows(query)
    if q_index is not None:
        queries = queries.index_select(0, q_index)
    cu = [0]
    for n in q_counts:
        cu.append(cu[-1] + n)
    out = torch.ops.attnops.paged_attention(queries, block_table=meta.block_table, seq_lens=meta.seq_lens,
                                            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=query.device),
                                            **scratch.attention_args(0), **options)
    return _unpack(out, q_index, batch, q_len)


def _index(valid: torch.Tensor, device) -> torch.Tensor:
    """Flat indices of the True entries of a host bool [B, N], on `device`."""
    return valid.flatten().nonzero().flatten().to(device)


def _unpack(out: torch.Tensor, index: torch.Tensor | None, batch: int, q_len: int) -> torch.Tensor:
    """The op's rows of the valid queries -> [B, S, Hq, D], padding rows 0."""
    if index is not None:
        out = out.new_zeros(batch * q_len, *out.shape[1:]).index_copy_(0, index, out)
    return out.view(batch, q_len, *out.shape[1:])


def padding_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                 mask_function=None, attention_mask: torch.Tensor | None = None, **kwargs):
    """The mask transformers builds for attn_implementation "attnops" (once per forward and mask kind): the padding
    mask over the keys the layers see, [batch, 1, 1, kv_length] (4D as transformers' own masks are, so that model
    code that slices a mask's query axis, as Gemma-4's before its KV-shared layers, can), or None. Causality,
    windows and caps are the op's own."""
    if attention_mask is None:
        return None
    return attention_mask[:, None, None, kv_offset: kv_offset + kv_length].bool()


def padding_rows(attention_mask: torch.Tensor, batch: int, kv_len: int, where: str) -> torch.Tensor:
    """The padding mask (padding_mask's [batch, 1, 1, kv_length], or [batch, kv_length]) as bool [batch, kv_len] on
    the host (the page allocator works there), checked against that shape."""
    mask = attention_mask
    if mask.dim() == 4 and mask.shape[1:3] == (1, 1):
        mask = mask[:, 0, 0]
    if mask.dim() != 2 or tuple(mask.shape) != (batch, kv_len):
        raise ValueError(f"{where}: attention_mask must be a padding mask [batch, kv_length] = [{batch}, {kv_len}] "
                         f"(or [batch, 1, 1, kv_length]; got {list(attention_mask.shape)})")
    return mask.bool().cpu()


def register() -> None:
    """Registers attention_forward and padding_mask under ATTN_IMPLEMENTATION with transformers."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface
    AttentionInterface.register(ATTN_IMPLEMENTATION, attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, padding_mask)
