"""The CUDA backend's query-block attention over 16-bit caches on sm_90a: prefill and extend (more than 16 query tokens
a sequence on average, causal) at head dim 128 with a bf16 or fp16 cache of q's dtype, through attnops' own kernel
(csrc/cuda/prefill_sm90.cu: 128 rows a block, (query token, head of the GQA group), as two warpgroups' MMAs; the
scores, softmax and output of each warpgroup's 64 rows in its registers; K and V tiles of 64 keys by cp.async,
three stages, the blocks that see the most keys first).

Why: inside a CUDA graph nobody replans, FlashInfer's planned prefill is passed over, and Triton's query tile
reaches about 60% of FlashInfer's FA3 TFLOP/s there (docs/bench.md).

Off until measured: ATTNOPS_CUDA_PREFILL=1 turns it on, and even then dispatch puts it behind the backends the
measured rule timed on 16-bit caches, so only a pinned `cuda` backend (`attnops.use_backend("cuda")`) runs it.
`bash benchmarks/gpu_round.sh build cuda-prefill` runs its GPU tests and times it against Triton and FlashInfer.
Not served: windows, soft cap, sinks, tree masks, batch-invariant mode (one pass over each sequence's keys from
its first, no splits: invariant by construction, not yet tested so).
"""
from __future__ import annotations

import torch

from .. import errors, formats
from ..checks_mla import rows_16_byte_aligned
from ..env import environ_get
from . import cuda_mla
from .base import common_reasons, kernel_outputs, pairs_aligned, rows_without_a_sequence

ENV = "ATTNOPS_CUDA_PREFILL"
KV_FORMATS = ("bf16", "fp16")
HEAD_DIMS = (128,)
ROWS = 128  # rows a block: (query token, head of the group), so a GQA group of at most 128


def enabled() -> bool:
    return environ_get(ENV) == "1"


def reasons(case) -> list[str]:
    """Why the kernel cannot serve an AttentionCase of a 16-bit cache (empty: it can). The backend's own
    `unavailable` (a CUDA build, a GPU) is asked beside."""
    found = common_reasons(case, devices=("cuda",), kv_formats=KV_FORMATS, head_dims=HEAD_DIMS, soft_cap=False,
                           sliding_window=False, sinks=False, tree_mask=False, archs=lambda arch: arch == (9, 0))
    if case.kv_format in KV_FORMATS and case.q_dtype != formats.FORMATS[case.kv_format].storage_dtype:
        found.append(f"q dtype {case.q_dtype} with a {case.kv_format} cache: its kernel takes q of the cache's dtype")
    if case.shape_class != "prefill":
        found.append("bf16/fp16 caches: prefill and extend only (more than 16 query tokens a sequence on average)")
    if case.num_q_heads // case.num_kv_heads > ROWS:
        found.append(f"a GQA group of more than {ROWS} (a block's rows)")
    if not case.aligned_kv:
        found.append("a cache view it cannot copy by 16-byte words: checks.kv_layout_reasons names why")
    if not enabled():
        found.append(f"bf16/fp16 caches: its prefill kernel is off until measured ({ENV}=1 turns it on)")
    if not found and torch.cuda.is_available():  # (without a GPU the backend's own `unavailable` says so)
        if not cuda_mla.sm90a_built(torch.cuda.current_device()):
            found.append("attnops was built without sm_90a code (TORCH_CUDA_ARCH_LIST=9.0a; setup.py asks for it "
                         "on an sm_90 GPU)")
    return found


def paged_attention(call) -> None:
    out, lse = call.out, call.lse
    if not pairs_aligned(out) or (lse is not None and not lse.is_contiguous()):
        with kernel_outputs(out, lse, writable=pairs_aligned) as (out_w, lse_w):
            paged_attention(call._replace(out=out_w, lse=lse_w))
        return
    if call.num_tokens == 0:
        return
    if call.case.batch == 0:
        rows_without_a_sequence(out, lse)
        return
    q = call.q
    if q.stride(-1) != 1 or not rows_16_byte_aligned(q):
        # (a fresh copy: contiguous() would keep a contiguous view at an odd address)
        q = q.clone(memory_format=torch.contiguous_format)
    block_table = call.block_table if call.block_table.stride(1) == 1 else call.block_table.contiguous()
    torch.ops.attnops.prefill_sm90(q, call.k_cache, call.v_cache, block_table, call.seq_lens.contiguous(),
                                   call.cu_seqlens_q.contiguous(), out, lse, errors.buffer(q.device),
                                   float(call.scale))
