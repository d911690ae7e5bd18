"""Peers called directly, not through attnops: FlashInfer's paged decode (CUDA-core and tensor-core, planned; and
its plan-free block-table decode, which runs TensorRT-LLM's XQA kernel on sm_90), paged prefill (fa2, fa3), its
latent-attention (MLA) wrapper, and PyTorch's scaled_dot_product_attention on pre-gathered contiguous KV.

Each peer is a function (case, args) -> run, where `run()` computes the output with all host planning already
done; it raises Unsupported with the reason for a case it cannot serve."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from attnops import formats
from attnops.backends.flashinfer import HEAD_DIMS as FLASHINFER_HEAD_DIMS
from attnops.backends.flashinfer import fa3_serves
from attnops.backends.flashinfer_steps import page_metadata


class Unsupported(Exception):
    pass


_WORKSPACE = {}


def _workspace(device):
    if device not in _WORKSPACE:
        _WORKSPACE[device] = torch.zeros(512 * 1024 * 1024, dtype=torch.uint8, device=device)
    return _WORKSPACE[device]


def _no_spec_features(case):
    if case.sinks or case.tree:
        raise Unsupported("timed without sinks and tree masks (the peer's call would not apply them)")


def _flashinfer_kv(case, args):
    _no_spec_features(case)
    if case.head_dim not in FLASHINFER_HEAD_DIMS:
        # (its JIT takes other sizes, but attnops has checked FlashInfer at these only: a peer that faults takes
        # the whole run down with it)
        raise Unsupported(f"timed at the head dims attnops' FlashInfer backend serves, {FLASHINFER_HEAD_DIMS}")
    if formats.is_fp4(case.kv_format):
        raise Unsupported("FlashInfer has no paged nvfp4/mxfp4 decode on sm_90")
    if case.scale_kind == "per_head" and formats.is_fp8(case.kv_format):
        raise Unsupported("FlashInfer takes per-tensor fp8 scales only")
    scales = {}
    if formats.FORMATS[case.kv_format].scale == formats.TENSOR_SCALE:
        scales = dict(k_scale=args["k_scale"].item(), v_scale=args["v_scale"].item())
    return (args["k_cache"], args["v_cache"]), scales


def flashinfer_decode(use_tensor_cores: bool):
    def make(case, args):
        if case.q_lens is not None:
            raise Unsupported("decode wrapper: one query token per sequence")
        import flashinfer
        kv, scales = _flashinfer_kv(case, args)
        indptr, indices, last = page_metadata(args["block_table"], args["seq_lens"], case.page_size)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(_workspace(args["q"].device), "NHD",
                                                                use_tensor_cores=use_tensor_cores)
        wrapper.plan(indptr, indices, last, case.num_q_heads, case.num_kv_heads, case.head_dim, case.page_size,
                     q_data_type=args["q"].dtype, kv_data_type=args["k_cache"].dtype)
        return lambda: wrapper.run(args["q"], kv, **scales)
    return make


XQA_PAGE_SIZES = (16, 32, 64, 128)


def flashinfer_xqa(case, args):
    """FlashInfer's plan-free decode: block table and lengths go straight to the kernel (no host planning, so it
    captures in a CUDA graph as is). On sm_90 this is XQA, the entry point that trtllm_batch_decode_with_kv_cache
    picks there."""
    if case.q_lens is not None:
        raise Unsupported("timed on decode (one query token per sequence)")
    if case.page_size not in XQA_PAGE_SIZES:
        raise Unsupported(f"XQA takes page sizes {XQA_PAGE_SIZES}")
    if case.kv_format == "fp8_e5m2":
        raise Unsupported("XQA takes fp8 e4m3 KV only")
    import flashinfer.decode
    kv, scales = _flashinfer_kv(case, args)
    workspace = torch.zeros(256 * 1024 * 1024, dtype=torch.uint8, device=args["q"].device)  # zeroed: semaphores
    block_table = args["block_table"].to(torch.int32)
    seq_lens = args["seq_lens"].to(torch.int32).view(torch.uint32)
    max_seq_len = block_table.shape[1] * case.page_size
    out = torch.empty_like(args["q"])
    bmm1_scale = case.head_dim ** -0.5 * scales.get("k_scale", 1.0)
    bmm2_scale = scales.get("v_scale", 1.0)
    return lambda: flashinfer.decode.xqa_batch_decode_with_kv_cache(
        args["q"], kv, workspace, block_table, seq_lens, max_seq_len, bmm1_scale=bmm1_scale, bmm2_scale=bmm2_scale,
        out=out)


def flashinfer_prefill(backend: str):
    def make(case, args):
        if case.q_lens is None:
            raise Unsupported("prefill wrapper is timed on verify/prefill cases")
        if backend == "fa3" and not fa3_serves(torch.cuda.get_device_capability(args["q"].device),
                                               args["q"].dtype, args["k_cache"].dtype):
            raise Unsupported("fa3 serves sm_90 only, and no bf16/fp16 q with fp8 KV")
        import flashinfer
        kv, scales = _flashinfer_kv(case, args)
        indptr, indices, last = page_metadata(args["block_table"], args["seq_lens"], case.page_size)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(_workspace(args["q"].device), "NHD",
                                                                 backend=backend)
        wrapper.plan(args["cu_seqlens_q"], indptr, indices, last, case.num_q_heads, case.num_kv_heads,
                     case.head_dim, case.page_size, causal=True, q_data_type=args["q"].dtype,
                     kv_data_type=args["k_cache"].dtype)
        return lambda: wrapper.run(args["q"], kv, **scales)
    return make


def gather_dense(args, case, dtype):
    """The pages of every sequence gathered (and dequantized) into contiguous [B, Hkv, L, D] K and V: what a user
    without a paged kernel does before calling SDPA. Needs equal lengths."""
    length = case.kv_lens[0]
    pages_per_seq = -(-length // case.page_size)
    pages = args["block_table"][:, :pages_per_seq].long()
    out = []
    for cache, scale in ((args["k_cache"], args.get("k_scale")), (args["v_cache"], args.get("v_scale"))):
        fmt = formats.resolve_kv_format(args["kv_format"], cache.dtype)
        stored = cache[pages].flatten(1, 2)[:, :length]  # [B, L, Hkv, Ds]
        if formats.FORMATS[fmt].scale == formats.BLOCK_SCALE:  # paged like the cache
            scale = scale[pages].flatten(1, 2)[:, :length]
        out.append(formats.dequantize(stored, fmt, scale, dtype).transpose(1, 2).contiguous())
    return out


def sdpa_on_gathered(case, args, include_gather=False):
    _no_spec_features(case)
    if len(set(case.kv_lens)) != 1 or (case.q_lens is not None and len(set(case.q_lens)) != 1):
        raise Unsupported("SDPA needs equal lengths (a ragged batch would need padding)")
    q = args["q"]
    q_len = 1 if case.q_lens is None else case.q_lens[0]
    k, v = gather_dense(args, case, q.dtype)
    length = case.kv_lens[0]
    qd = q.view(len(case.kv_lens), q_len, case.num_q_heads, case.head_dim).transpose(1, 2)
    mask = None
    if q_len > 1:
        query_pos = torch.arange(length - q_len, length, device=q.device)[:, None]
        mask = torch.arange(length, device=q.device)[None, :] <= query_pos

    def run():
        keys, values = gather_dense(args, case, q.dtype) if include_gather else (k, v)
        o = F.scaled_dot_product_attention(qd, keys, values, attn_mask=mask, enable_gqa=True)
        return o.transpose(1, 2).reshape(q.shape)

    run.gather = lambda: gather_dense(args, case, q.dtype)
    return run


def flashinfer_mla_runner(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale, out=None):
    """FlashInfer's BatchMLAPagedAttentionWrapper over a latent cache [pages, page_size, R + P] (its two caches, the
    latent and rotary parts, copied: the same values), planned here, once (host work a serving loop does before
    its graph replays): run() computes the output (into `out` if given). Causal where a sequence has several query
    rows (verify)."""
    import flashinfer
    batch, width = block_table.shape
    heads, latent = q_nope.shape[1:]
    device = q_nope.device
    workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device=device)
    wrapper = flashinfer.mla.BatchMLAPagedAttentionWrapper(workspace, backend="auto")
    qo_indptr = torch.arange(batch + 1, dtype=torch.int32, device=device) if cu_seqlens_q is None else cu_seqlens_q
    # each sequence's pages, exactly as many as its keys fill (FlashInfer's plan checks the counts)
    pages = (seq_lens.long() + kv_cache.shape[1] - 1) // kv_cache.shape[1]
    kv_indptr = torch.nn.functional.pad(pages.cumsum(0), (1, 0)).to(torch.int32)
    kv_indices = block_table[torch.arange(width, device=device) < pages[:, None]]
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, seq_lens, heads, latent, q_pe.shape[2],
                 kv_cache.shape[1], cu_seqlens_q is not None, scale, q_nope.dtype, kv_cache.dtype)
    ckv, kpe = kv_cache[..., :latent].contiguous(), kv_cache[..., latent:].contiguous()
    return lambda: wrapper.run(q_nope, q_pe, ckv, kpe, out=out)


def flashinfer_mla(case, args):
    if not case.latent:
        raise Unsupported("latent attention (MLA) only")
    if case.kv_format not in ("bf16", "fp16") or (case.latent_dim, case.rope_dim) != (512, 64):
        raise Unsupported("FlashInfer's MLA wrapper: bf16/fp16 latent caches of R 512, P 64")
    return flashinfer_mla_runner(args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"],
                                 args["seq_lens"], args["cu_seqlens_q"], args["scale"])


def paged(peer):
    """A peer of paged attention, which has nothing to run for a latent-attention case."""
    def run(case, args):
        if case.latent:
            raise Unsupported("a paged-attention peer (latent attention: fi-mla)")
        return peer(case, args)
    return run


GPU_PEERS = {
    "fi-decode-cuda-core": paged(flashinfer_decode(False)),
    "fi-decode-tensor-core": paged(flashinfer_decode(True)),
    "fi-xqa": paged(flashinfer_xqa),
    "fi-prefill-fa2": paged(flashinfer_prefill("fa2")),
    "fi-prefill-fa3": paged(flashinfer_prefill("fa3")),
    "fi-mla": flashinfer_mla,
    "sdpa-gathered": paged(sdpa_on_gathered),
}
# On the CPU the gather is part of what a user pays (nothing else is paged there): time them together.
CPU_PEERS = {"gather+sdpa": paged(lambda case, args: sdpa_on_gathered(case, args, include_gather=True))}
