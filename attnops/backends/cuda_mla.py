"""The CUDA backend's latent attention (MLA): decode through attnops' own sm_90a kernel
(csrc/cuda/mla_decode_sm90.cuh: 64 heads a block as the M of Hopper's warpgroup MMAs, each latent row read once
for all of them, the 64 x 512 accumulator over two warpgroups), for DeepSeek's shape (R 512, P 64) with a bf16,
fp8 e4m3 or DeepSeek-layout fp8 cache under bf16 q.

bf16 caches: 0.8-1.1x FlashInfer's MLA speed, much faster than Triton's at many heads (docs/bench.md, "Latent
attention"); fp8 caches: slower than its bf16 (the widening to bf16 sits on its chain of work) but faster than
Triton's fp8 on most decode shapes. sm_90's measured rule (attnops/tables/sm_90.json) makes it the first choice for
most decode cases, captured or not (FlashInfer's MLA plans on the host, so a capture passes it over).
ATTNOPS_CUDA_MLA=0 turns it off, =bf16 keeps it to bf16 caches. `bash benchmarks/gpu_round.sh cuda-mla` runs its GPU
tests and times it. ATTNOPS_CUDA_MLA_VARIANT picks the kernel's form (kernel_variant; the default: the fastest
measured for the call): `tma` (whole tiles copied by the tensor memory accelerator), `cp.async`, `keys` (at most
16 heads: the keys as the MMAs' M, csrc/cuda/mla_keys_sm90.cuh) and `regs` (fp8 at up to 16 heads: the keys form
with the cache's bytes widened in registers, f16 MMAs, a producer warpgroup issuing the copies,
csrc/cuda/mla_regs_sm90.cuh; only when asked for: 0.99-1.11x the keys form on the H100, not yet measured on the
H200).

DeepSeek's fp8 layout (kv_format "fp8_ds_mla"): the keys form reads it at up to 16 heads where its splits are of
KEYS_FP8_MIN_CHUNK keys or more (the values widened exactly, each 128's scale applied to its products), the
cp.async form everywhere else (each value times its scale in fp32 rounded once to bf16, as FlashMLA's): faster
than Triton's over the layout on every measured case (1.4-9.0x on DeepSeek-V3's shards, H200; docs/bench.md).
ATTNOPS_CUDA_MLA_DS=0 leaves the layout to Triton. `bash benchmarks/gpu_round.sh build cuda-mla-ds` tests and times
it.

Verify (a few query tokens a sequence, no tree mask): each query row sees its sequence's keys up to its own
position. At up to 32 heads a block takes several query tokens of a sequence as its 64 rows (tokens_per_block), so
that the sequence's keys are read once for them (1.1-2.6x faster at 16 heads than a block a token, H100;
ATTNOPS_CUDA_MLA_PACK_VERIFY=0 gives each token its own block, as above 32 heads). Faster than Triton's verify on
every measured case, slower than FlashInfer's bf16 (docs/bench.md): sm_90's rule sends fp8 verify here, bf16 verify
to FlashInfer, then here (inside a graph nobody replans). ATTNOPS_CUDA_MLA_VERIFY=0 leaves verify to the others.

The split of each sequence's keys comes from shapes only (the table's capacity, the tokens, the heads, the SM
count), so a CUDA graph replays any lengths; with more than one split, the op's second kernel merges the partials
(and adds the sinks): by warps with a row's loads in flight together where a row has many splits (merge_form).
"""
from __future__ import annotations

import math

import torch

from .. import errors, formats, invariance
from ..checks_mla import rows_16_byte_aligned
from ..env import environ_get, sm_count
from .base import common_reasons, kernel_outputs, pairs_aligned, rows_without_a_sequence

ENV = "ATTNOPS_CUDA_MLA"
VERIFY_ENV = "ATTNOPS_CUDA_MLA_VERIFY"  # 0: decode only
PACK_ENV = "ATTNOPS_CUDA_MLA_PACK_VERIFY"  # 0: each verify token its own block (tokens_per_block)
VARIANT_ENV = "ATTNOPS_CUDA_MLA_VARIANT"
MERGE_ENV = "ATTNOPS_CUDA_MLA_MERGE"  # the splits' merge: columns or warps (default: merge_form's choice)
MERGES = ("columns", "warps")  # (the op's `merge` codes 0 and 1)
WARPS_MERGE_SPLITS = 32  # splits a row from which the warps merge is the default (a round of its loads in flight)
VARIANTS = ("cp.async", "tma", "keys", "regs")  # (the op's `variant` codes 0 to 3)
KEYS_MAX_HEADS = 16  # the keys form's heads a block (its MMAs' N)
KEYS_FP8_MIN_CHUNK = 2048  # fp8: the keys form's splits at least (measured faster at 2048 and 4096, slower at 256)
SHAPE = (512, 64)  # (R, P) the kernel is built for
KV_FORMATS = ("bf16", "fp8_e4m3")  # (fp8: widened to bf16 in shared memory; q is bf16)
DS_ENV = "ATTNOPS_CUDA_MLA_DS"  # 0: DeepSeek's fp8 layout left to the others
ROWS = 64  # heads a block
TILE = 64  # keys a step; splits are whole tiles
MIN_CHUNK = 256  # keys a split at least (a block loads its 64 heads' queries first: 72 KB)
MAX_CHUNK = 4096  # keys a split at most: a ragged batch's long sequences spread over the SMs
MAX_SPLITS = 65535  # a grid dimension
INVARIANT_CHUNK = 1024  # batch-invariant mode: keys a split, from each sequence's start (a multiple of TILE)
INVARIANT_CHUNK_ENV = "ATTNOPS_CUDA_MLA_INVARIANT_CHUNK"  # another split size in the mode, to time it


def served_formats() -> tuple[str, ...]:
    """The cache formats it serves: ATTNOPS_CUDA_MLA unset or 1: bf16, fp8 e4m3 and DeepSeek's fp8 layout (not with
    ATTNOPS_CUDA_MLA_DS=0); bf16: bf16; 0: none."""
    switch = environ_get(ENV) or "1"
    ds = (formats.LATENT_FP8_FORMAT,) if environ_get(DS_ENV) != "0" else ()
    return {"0": (), "bf16": ("bf16",)}.get(switch, KV_FORMATS + ds)


def kernel_variant(kv_format: str, page_size: int, num_heads: int, chunk: int, packed: bool = False) -> int:
    """The kernel's form for a call of `chunk` keys a split, as the op's code (VARIANTS' index):
    ATTNOPS_CUDA_MLA_VARIANT's where it serves the call, by default the fastest measured (docs/bench.md: tma for
    bf16; for fp8 keys at most KEYS_MAX_HEADS heads and KEYS_FP8_MIN_CHUNK keys a split, cp.async otherwise). The
    forms other than cp.async copy through the tensor memory accelerator, pages of 8 rows or more (cp.async
    otherwise), bf16 caches (keys: fp8 too; regs: fp8 only, tma for bf16); keys and regs take at most
    KEYS_MAX_HEADS heads (tma otherwise); `packed` (several tokens a block: tokens_per_block) only the cp.async and
    tma forms (tma for the others). DeepSeek's fp8 layout: keys at up to KEYS_MAX_HEADS heads and pages of 8 rows
    or more where its splits are long, cp.async otherwise (the forms that read it; regs asks for keys, tma for
    cp.async). `bash benchmarks/gpu_round.sh cuda-mla-variants` times them."""
    name = environ_get(VARIANT_ENV) or \
        ("tma" if kv_format == "bf16" else "keys" if chunk >= KEYS_FP8_MIN_CHUNK and not packed else "cp.async")
    if name not in VARIANTS:
        raise ValueError(f"{VARIANT_ENV} must be one of {', '.join(VARIANTS)} (got {name!r})")
    if kv_format == formats.LATENT_FP8_FORMAT:
        keys = name in ("keys", "regs") and num_heads <= KEYS_MAX_HEADS and page_size >= 8 and not packed
        return VARIANTS.index("keys" if keys else "cp.async")
    if (name in ("keys", "regs") and num_heads > KEYS_MAX_HEADS) or (packed and name not in ("cp.async", "tma")) \
            or (name == "regs" and kv_format == "bf16"):
        name = "tma"
    if name != "cp.async" and (page_size < 8 or (kv_format != "bf16" and name not in ("keys", "regs"))):
        return 0
    return VARIANTS.index(name)


_sm90a: dict[int, bool] = {}


def sm90a_built(device_index: int) -> bool:
    """Whether this device runs the kernel's sm_90a code (an sm_90 build has only an empty kernel): a function
    attribute of the build, asked once a device (also inside a capture)."""
    if not hasattr(torch.ops.attnops, "mla_sm90a_built"):  # (a build without CUDA kernels)
        return False
    if device_index not in _sm90a:
        _sm90a[device_index] = bool(torch.ops.attnops.mla_sm90a_built(device_index))
    return _sm90a[device_index]


def reasons(case) -> list[str]:
    """Why the kernel cannot serve an MLACase (empty: it can). The backend's own `unavailable` (a CUDA build, a GPU)
    is asked beside."""
    served = served_formats()
    if not served:
        return [f"latent attention: turned off ({ENV}=0)"]
    found = common_reasons(case, devices=("cuda",), q_dtypes=(torch.bfloat16,), archs=lambda arch: arch == (9, 0))
    if case.kv_format == formats.LATENT_FP8_FORMAT:
        if case.kv_format not in served:
            found.append(f"kv_format {case.kv_format}: turned off ({DS_ENV}=0)" if environ_get(DS_ENV) == "0" else
                         f"kv_format {case.kv_format}: turned off ({ENV}={environ_get(ENV)})")
    elif case.kv_format not in served:
        found.append(f"kv_format {case.kv_format} not supported" if case.kv_format not in KV_FORMATS else
                     f"kv_format {case.kv_format}: turned off ({ENV}={environ_get(ENV)})")
    if (case.latent_dim, case.rope_dim) != SHAPE:
        found.append(f"latent rows of R {case.latent_dim}, P {case.rope_dim}: its kernel is built for R {SHAPE[0]}, "
                     f"P {SHAPE[1]}")
    if not case.decode and not (case.shape_class == "verify" and environ_get(VERIFY_ENV) != "0"):
        found.append(f"verify: turned off ({VERIFY_ENV}=0)" if case.shape_class == "verify" else
                     "decode and verify only (a few query tokens a sequence)")
    if case.tree_mask:
        found.append("tree_mask not supported")
    if case.topk:
        found.append("the sparse form (topk_indices) not supported")
    if not case.aligned_kv:
        found.append("a cache whose latent rows do not all start on a 16-byte boundary (its kernel copies them by "
                     "16-byte words)")
    if not found and torch.cuda.is_available():  # (without a GPU the backend's own `unavailable` says so)
        if not sm90a_built(torch.cuda.current_device()):
            found.append("attnops was built without sm_90a code (TORCH_CUDA_ARCH_LIST=9.0a; setup.py asks for it "
                         "on an sm_90 GPU)")
    return found


def tokens_per_block(num_heads: int, verify: bool) -> int:
    """Query tokens of a sequence one block takes as its ROWS rows (token, head): with several query tokens a
    sequence (verify), ROWS // num_heads where that is 2 or more (at most 32 heads), so that a sequence's keys are
    read once for those tokens, not once a token (at 16 heads, 4 tokens fill the rows one token leaves
    three-quarters empty); 1 otherwise, or with ATTNOPS_CUDA_MLA_PACK_VERIFY=0. A function of shapes: graph-safe,
    and the same for a sequence whatever the batch (batch-invariant mode keeps its bits). Measured by
    `bash benchmarks/gpu_round.sh cuda-mla-pack` (docs/bench.md)."""
    if not verify or environ_get(PACK_ENV) == "0":
        return 1
    return max(1, ROWS // num_heads)


def plan(num_tokens: int, num_heads: int, capacity: int, sm_count: int, sinks: bool) -> tuple[int, int]:
    """(splits, keys a split) of a call: at most one wave of blocks when it splits (a block holds most of an SM's
    shared memory: one block an SM, and a second wave of a few blocks would double the time), at least MIN_CHUNK
    keys a split; with sinks at least two splits (the merge adds them). Shapes only: graph-safe. Splits of at most
    MAX_CHUNK keys, whatever the one wave would give: the plan sees the table's capacity, not the lengths, and a
    ragged batch's longest sequence must not run on one SM while the others idle (the short sequences' splits past
    their ends exit at once). No uniform batch of the grids reaches the cap (docs/bench.md)."""
    blocks = max(1, num_tokens) * math.ceil(num_heads / ROWS)
    tiles = max(1, math.ceil(capacity / TILE))
    splits = max(1, sm_count // blocks)
    chunk = max(MIN_CHUNK, min(math.ceil(tiles / splits) * TILE, MAX_CHUNK), math.ceil(tiles / MAX_SPLITS) * TILE)
    splits = math.ceil(tiles * TILE / chunk)
    return max(splits, 2 if sinks else 1), chunk


def mla_attention(call) -> None:
    out, lse = call.out, call.lse
    if not pairs_aligned(out) or (lse is not None and not lse.is_contiguous()):
        with kernel_outputs(out, lse, writable=pairs_aligned) as (out_w, lse_w):
            mla_attention(call._replace(out=out_w, lse=lse_w))
        return
    num_tokens, num_heads, latent = call.q_nope.shape
    if num_tokens == 0:
        return
    if call.case.batch == 0:
        rows_without_a_sequence(out, lse)
        return
    device = call.q_nope.device
    # (a fresh copy where a row is off 16 bytes: contiguous() would keep a contiguous view at an odd address)
    q_nope, q_pe = (q if rows_16_byte_aligned(q) else q.clone(memory_format=torch.contiguous_format)
                    for q in (call.q_nope, call.q_pe))
    sinks = None if call.sinks is None else call.sinks.contiguous()
    index = device.index if device.index is not None else torch.cuda.current_device()
    group = tokens_per_block(num_heads, call.cu_seqlens_q is not None and call.case.kv_format in KV_FORMATS)
    splits, chunk = (invariance.fixed_splits(call.case.max_kv_len, invariant_chunk()) if invariance.enabled() else
                     plan(math.ceil(num_tokens / group), num_heads, call.case.max_kv_len, sm_count(index),
                          call.sinks is not None))
    part_out = part_lse = out  # (unused with one split: the kernel writes out and lse)
    if splits > 1:
        part_out = torch.empty(num_tokens * num_heads * splits * latent, dtype=torch.float32, device=device)
        part_lse = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=device)
    torch.ops.attnops.mla_decode_sm90(q_nope, q_pe, call.kv_cache, call.kv_scale, call.block_table.contiguous(),
                                      call.seq_lens.contiguous(), sinks, out, lse, part_out, part_lse,
                                      errors.buffer(device), float(call.scale), splits, chunk, 0,
                                      kernel_variant(call.case.kv_format, call.kv_cache.shape[1], num_heads, chunk,
                                                     packed=group > 1),
                                      None if call.cu_seqlens_q is None else call.cu_seqlens_q.contiguous(), group,
                                      merge_form(splits))


def merge_form(splits: int) -> int:
    """The merge kernel of a call's `splits` splits a row, as the op's code (MERGES' index): `columns` (each thread
    four of a row's values over its splits one after another) or `warps` (four warps over a row's splits in turn,
    their loads in flight together: csrc/cuda/mla_decode_sm90.cuh, mla_merge_warps_kernel). By default warps from
    WARPS_MERGE_SPLITS splits on (measured 1.14-1.51x faster at 64 and 128 splits, 1.5-8% slower at 2 and 4:
    docs/bench.md), columns below and always in batch-invariant mode (there the split count follows the table's
    width, and the two merges sum in different orders); ATTNOPS_CUDA_MLA_MERGE picks one.
    `bash benchmarks/gpu_round.sh cuda-mla-merge` times both."""
    name = environ_get(MERGE_ENV)
    if not name:
        name = "warps" if splits >= WARPS_MERGE_SPLITS and not invariance.enabled() else "columns"
    if name not in MERGES:
        raise ValueError(f"{MERGE_ENV} must be one of {', '.join(MERGES)} (got {name!r})")
    return MERGES.index(name)


def invariant_chunk() -> int:
    """Keys a split in batch-invariant mode: INVARIANT_CHUNK, or ATTNOPS_CUDA_MLA_INVARIANT_CHUNK's (a multiple of
    TILE; benchmarks/gpu_round.sh's invariance-mla step times several)."""
    return invariance.chunk_setting(INVARIANT_CHUNK_ENV, INVARIANT_CHUNK, TILE)
