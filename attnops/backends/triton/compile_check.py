"""Compiles the Triton kernels for a GPU target without a GPU: catches what the interpreter accepts but the
compiler refuses (plain Python globals in kernels, unsupported casts, layouts, register/shared-memory limits),
for the Triton version installed.

    python -m attnops.backends.triton.compile_check            # sm_90 (H200), every format, decode and extend
    python -m attnops.backends.triton.compile_check --arch 89 --quick
    python -m attnops.backends.triton.compile_check --heuristic   # the heuristic's own choices fit sm_90's 227 KB
    python -m attnops.backends.triton.compile_check --sass nvfp4 mxfp4   # instructions a decode step issues

Each variant goes through Triton's full pipeline (TTIR -> TTGIR -> LLVM -> PTX -> cubin with ptxas), so a variant
that compiles here loads on that GPU; what it cannot check is the numbers (tests/test_triton.py on the GPU does).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import itertools
import os
import re
import shutil
import subprocess
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # compile for real

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from .cache_write import reshape_and_cache_kernel  # noqa: E402
from . import head_tile  # noqa: E402
from .common import FMT_CODE  # noqa: E402
from ...cases import AttentionCase  # noqa: E402
from ...formats import FORMATS  # noqa: E402
from . import KV_FORMATS  # noqa: E402
from . import heuristics  # noqa: E402
from .kernel import TL_DTYPE, merge_splits_kernel, paged_attention_kernel  # noqa: E402

# the caches' pointer types as launch() passes them: 8- and 4-bit formats as bytes
PTR = {name: "*u8" if f.storage_dtype.itemsize == 1 else "*" + name for name, f in FORMATS.items()}
TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}  # q dtypes by name


# do_not_specialize in the kernels (int32, no divisibility assumed)
NOT_DIVISIBLE = ("num_seqs", "window_left", "MAX_SPLITS", "CHUNK", "wave_splits", "num_tokens", "num_pages",
                 "capacity", "num_slots", "batch", "width", "stride_table", "stride_tm", "tm_cols", "topk_len")


def signature(fn, types: dict, constexprs: dict) -> dict:
    sig = {}
    for name in fn.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in types:
            sig[name] = types[name]
        elif name.startswith("stride") or name in NOT_DIVISIBLE:
            sig[name] = "i32"
        elif name in ("sm_scale", "soft_cap"):
            sig[name] = "fp32"
        else:
            raise KeyError(f"no type for {fn.__name__}.{name}")
    return sig




def compile_one(fn, types, constexprs, target, num_warps, num_stages, maxnreg=None):
    sig = signature(fn, types, constexprs)
    # what the JIT sees at run time: 16-byte aligned pointers and strides divisible by 16 (the usual cache, q and
    # table layouts); without it loads stay scalar and the loop is not pipelined, unlike the real launch
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
             if sig[name].startswith("*") or (sig[name] == "i32" and name not in NOT_DIVISIBLE)}
    src = ASTSource(fn, sig, constexprs, attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    return triton.compile(src, target=target, options=options)


def attention_variants(quick: bool, arch: int = 90):
    formats = [f for f in KV_FORMATS if f != "fp32"]  # (fp32: its own variant below)
    q_dtypes = ["bf16", "fp16"] if not quick else ["bf16"]
    for fmt, q_dtype, decode, head_dim in itertools.product(formats, q_dtypes, (True, False), (64, 128, 256)):
        if quick and head_dim != 128:
            continue
        group, page = 4, 16
        if decode:
            block_q, block_n, warps = 1, 32 if head_dim >= 256 else 64, 4
        else:
            block_q, block_n, warps = (16 if head_dim >= 256 else 32), (32 if head_dim >= 256 else 64), 8
        yield dict(fmt=fmt, q_dtype=q_dtype, decode=decode, head_dim=head_dim, group=group, page=page,
                   block_q=block_q, block_n=block_n, warps=warps, window=not decode, soft_cap=decode, scale_bcast=True)
    # the other variants the tuning script tries, and a page larger than the tile
    for fmt in ("nvfp4", "mxfp4"):
        yield dict(fmt=fmt, q_dtype="bf16", decode=True, head_dim=128, group=4, page=256, block_q=1, block_n=64,
                   warps=4, window=True, soft_cap=True, scale_bcast=False)
    # the inline-PTX nibble decode: nvfp4 (fp16 dots) and mxfp4 (bf16 dots), decode and prefill tiles
    for (fmt, q_dtype), decode in itertools.product((("nvfp4", "fp16"), ("mxfp4", "bf16")), (True, False)):
        yield dict(fmt=fmt, q_dtype=q_dtype, decode=decode, head_dim=128, group=4, page=16,
                   block_q=1 if decode else 32, block_n=64, warps=4 if decode else 8, window=False, soft_cap=False,
                   scale_bcast=True, fp4_asm=True)
    # V converted in its load's layout and read by ldmatrix.trans (V_DEQUANT_FIRST): fp8 decode and verify, 4-bit
    # decode
    for fmt, decode in (("fp8_e4m3", True), ("fp8_e5m2", False), ("nvfp4", True), ("mxfp4", True)):
        yield dict(fmt=fmt, q_dtype="bf16", decode=decode, head_dim=128, group=4, page=16, block_q=1 if decode else 4,
                   block_n=128 if decode else 64, warps=4, window=False, soft_cap=False,
                   scale_bcast=fmt.endswith("fp4"), fp4_asm=fmt.endswith("fp4"), v_dequant_first=True)
    # fp8 V (and K) read as 16-bit words and split into even/odd halves by inline PTX (FP8_V_PAIRS, FP8_K_PAIRS)
    for fmt, q_dtype, decode, head_dim, k_pairs in itertools.product(("fp8_e4m3", "fp8_e5m2"), ("bf16", "fp16"),
                                                                      (True, False), (64, 128, 256), (False, True)):
        if quick and (head_dim != 128 or q_dtype != "bf16"):
            continue
        yield dict(fmt=fmt, q_dtype=q_dtype, decode=decode, head_dim=head_dim, group=4, page=16,
                   block_q=1 if decode else 16, block_n=32 if head_dim >= 256 else 128 if decode else 64,
                   warps=4 if decode else 8, window=not decode, soft_cap=decode, scale_bcast=False,
                   fp8_v_pairs=True, fp8_k_pairs=k_pairs)
    # the merge kernel as a programmatic dependent launch of the attention kernel (PDL, sm_90+)
    if arch >= 90:
        yield dict(fmt="bf16", q_dtype="bf16", decode=True, head_dim=128, group=4, page=16, block_q=1, block_n=128,
                   warps=4, window=False, soft_cap=False, scale_bcast=False, pdl=True)
    # decode's split size from the call's lengths (WAVE_PLAN), bf16 and fp8 pairs, the merge a dependent launch
    for fmt in ("bf16", "fp8_e4m3"):
        yield dict(fmt=fmt, q_dtype="bf16", decode=True, head_dim=128, group=4, page=16, block_q=1, block_n=128,
                   warps=4, window=False, soft_cap=False, scale_bcast=False, fp8_v_pairs=fmt != "bf16",
                   fp8_k_pairs=fmt != "bf16", heads_inner=True, page_clamp=True, pdl=arch >= 90, wave_plan=9)
    # the heads-inner grid order, decode and verify tiles
    for decode in (True, False):
        yield dict(fmt="bf16", q_dtype="bf16", decode=decode, head_dim=128, group=4, page=16,
                   block_q=1 if decode else 4, block_n=64, warps=4, window=not decode, soft_cap=False,
                   scale_bcast=False, heads_inner=decode)
    # the bounds switched off (BOUNDS=0: what benchmarks/triton_tuning.py --compare measures them against)
    for decode in (True, False):
        yield dict(fmt="bf16", q_dtype="bf16", decode=decode, head_dim=128, group=4, page=16,
                   block_q=1 if decode else 16, block_n=128 if decode else 64, warps=4 if decode else 8,
                   window=False, soft_cap=False, scale_bcast=False, bounds=False)
    # decode's pages clamped in the loop and checked after it (PAGE_CLAMP), with a window and a 4-bit cache too
    for fmt in ("bf16", "nvfp4"):
        yield dict(fmt=fmt, q_dtype="bf16", decode=True, head_dim=128, group=4, page=16, block_q=1, block_n=128,
                   warps=4, window=fmt == "nvfp4", soft_cap=False, scale_bcast=fmt == "nvfp4", page_clamp=True)
    # full tiles' loads unmasked and 32-bit offsets (FULL_TILES, OFFSETS_32): decode of every format with a
    # window, and a tree-masked verify tile
    for fmt in ("bf16", "fp8_e4m3", "nvfp4", "mxfp4"):
        yield dict(fmt=fmt, q_dtype="bf16", decode=True, head_dim=128, group=4, page=16, block_q=1, block_n=128,
                   warps=4, window=True, soft_cap=False, scale_bcast=fmt.endswith("fp4"), page_clamp=True,
                   full_tiles=True, offsets_32=True)
    yield dict(fmt="bf16", q_dtype="bf16", decode=False, head_dim=128, group=4, page=16, block_q=16, block_n=64,
               warps=4, window=False, soft_cap=False, scale_bcast=False, tree=True, full_tiles=True, offsets_32=True)
    # sinks and draft-tree masks: a verify tile with both, and decode with sinks
    for decode in (True, False):
        yield dict(fmt="bf16", q_dtype="bf16", decode=decode, head_dim=128, group=4, page=16,
                   block_q=1 if decode else 16, block_n=128 if decode else 64, warps=4 if decode else 8,
                   window=not decode, soft_cap=False, scale_bcast=False, sinks=True, tree=not decode)
    # with each row's LSE (paged_attention_with_lse): split decode with sinks (the merge kernel writes it), and a
    # verify tile with a window and soft cap
    for decode in (True, False):
        yield dict(fmt="bf16", q_dtype="bf16", decode=decode, head_dim=128, group=4, page=16,
                   block_q=1 if decode else 16, block_n=128 if decode else 64, warps=4 if decode else 8,
                   window=not decode, soft_cap=not decode, scale_bcast=False, sinks=decode, lse=True)
    # fp32 q (ieee dots), MQA with 16 heads a group
    yield dict(fmt="fp32", q_dtype="fp32", decode=True, head_dim=64, group=16, page=1, block_q=1, block_n=64,
               warps=4, window=True, soft_cap=False, scale_bcast=False)
    # padded tiles (head dim 80 and 96 in 128's, 160 and 192 in 256's: columns past it masked) and 512, decode and
    # prefill tiles as the heuristic sizes them, 16-bit and fp8
    for (valid, tile), fmt, decode in itertools.product(((80, 128), (96, 128), (160, 256), (192, 256), (512, 512)),
                                                        ("bf16", "fp8_e4m3"), (True, False)):
        if quick and valid not in (96, 512):
            continue
        yield dict(fmt=fmt, q_dtype="bf16", decode=decode, head_dim=tile, valid_dim=valid, group=4, page=16,
                   block_q=1 if decode else (16 if tile >= 256 else 32),
                   block_n=(128 if tile <= 128 else max(16, 8192 // tile)) if decode else max(16, 8192 // tile),
                   warps=4 if decode else 8, window=not decode, soft_cap=decode, scale_bcast=False, sinks=decode,
                   lse=not decode)
    # padded tiles of the paired reads: 4-bit (bytes and block scales past the head dim masked; scales broadcast and
    # per value) and fp8 pairs (fp16 dots)
    for (valid, fmt, extra), decode in itertools.product(
            ((96, "nvfp4", {}), (80, "nvfp4", dict(scale_bcast=False)), (96, "mxfp4", {}),
             (80, "fp8_e4m3", dict(q_dtype="fp16", fp8_v_pairs=True, fp8_k_pairs=True))), (True, False)):
        if quick and valid != 96:
            continue
        yield {**dict(fmt=fmt, q_dtype="bf16", decode=decode, head_dim=128, valid_dim=valid, group=4, page=16,
                      block_q=1 if decode else 32, block_n=64, warps=4 if decode else 8, window=not decode,
                      soft_cap=decode, scale_bcast=True), **extra}
    # a head dim between powers of two in two tiles (HEAD_PARTS: heuristics.head_parts), decode and verify: 16-bit,
    # fp8 as bytes and as pairs (the second tile as bytes), 4-bit (both tiles in halves)
    for (valid, tile, fmt, extra), decode in itertools.product(
            ((96, 128, "bf16", {}), (80, 128, "fp8_e4m3", dict(q_dtype="fp16", fp8_v_pairs=True, fp8_k_pairs=True)),
             (96, 128, "fp8_e5m2", {}), (160, 256, "nvfp4", dict(scale_bcast=True, fp4_asm=True)),
             (192, 256, "mxfp4", dict(scale_bcast=True))), (True, False)):
        if quick and fmt not in ("bf16", "fp8_e4m3"):
            continue
        yield {**dict(fmt=fmt, q_dtype="bf16", decode=decode, head_dim=tile, valid_dim=valid,
                      dim_b=heuristics.head_parts(valid, fmt), group=4, page=16, block_q=1 if decode else 16,
                      block_n=128 if decode and tile <= 128 else 64 if tile <= 128 else 32, warps=4 if decode else 8,
                      window=not decode, soft_cap=decode, scale_bcast=False, sinks=decode, lse=not decode), **extra}
    # padded tiles whose columns past the head dim read as copies of the first ones (PAD_WRAP), one tile and two
    for (valid, tile, fmt, extra), decode in itertools.product(
            ((96, 128, "bf16", {}), (80, 128, "fp8_e5m2", {}), (80, 128, "bf16", dict(dim_b=32))), (True, False)):
        if quick and valid != 96:
            continue
        yield {**dict(fmt=fmt, q_dtype="bf16", decode=decode, head_dim=tile,
                      valid_dim=valid, pad_wrap=True, group=4, page=16, block_q=1 if decode else 16,
                      block_n=128 if decode else 64, warps=4 if decode else 8, window=not decode, soft_cap=decode,
                      scale_bcast=False, sinks=decode, lse=not decode), **extra}


def attention_types(fmt: str, q_dtype: str, lse: bool = False) -> dict:
    """Pointer types of the attention kernel's tensors, as launch() passes them (fp8 caches as bytes; lse's
    placeholder without WRITE_LSE is `out`)."""
    scale_ptr = {"block": "*u8", "tensor": "*fp32"}.get(FORMATS[fmt].scale, PTR[fmt])
    qp = "*" + q_dtype
    return dict(q_ptr=qp, k_ptr=PTR[fmt], v_ptr=PTR[fmt], ks_ptr=scale_ptr, vs_ptr=scale_ptr, bt_ptr="*i32",
                seq_lens_ptr="*i32", cu_ptr="*i32", out_ptr=qp, lse_ptr="*fp32" if lse else qp,
                part_out_ptr="*fp32", part_lse_ptr="*fp32",
                sinks_ptr="*fp32", tm_ptr="*u8", err_ptr="*i32")


# The shapes whose heuristic choices --heuristic compiles: (name, decode, batch, tokens per sequence, capacity)
HEURISTIC_SHAPES = [("decode 128 x 4096", True, 128, 1, 4096), ("decode 1 x 32768", True, 1, 1, 32768),
                    ("verify 32 x 4 on 4096", False, 32, 4, 4096), ("verify 32 x 16 on 4096", False, 32, 16, 4096),
                    ("chunk 4 x 300 on 8192", False, 4, 300, 8192), ("prefill 8 x 4096", False, 8, 4096, 4096)]
# --sass also takes query blocks with a tree mask: a 16-token draft tree's verify, and cascade's prefix pass (64
# query rows as one block that sees only the 32K keys before it, with its LSE)
TREE_SHAPES = [("tree 32 x 16 on 4096", False, 32, 16, 4096), ("prefix 64 x 32768", False, 1, 64, 32768 + 64)]


def heuristic_configurations(arch: int, sms: int, shared_per_block: int, quick: bool):
    """(label, q dtype, format, constexprs, options): the heuristic's own choice for every format, q dtype, head
    dim, GQA group and HEURISTIC_SHAPES case on a GPU of `sms` SMs whose blocks may take `shared_per_block` bytes
    of shared memory, each distinct compilation once."""
    seen = set()
    with _heuristic_for(arch, sms, shared_per_block):
        fmts = list(KV_FORMATS)
        for fmt, q_dtype, head_dim, group, (name, is_decode, batch, q_len, capacity) in itertools.product(
                fmts if not quick else ["bf16", "fp8_e4m3", "nvfp4"], ["bf16", "fp16", "fp32"],
                (64, 96, 128, 160, 256) if not quick else (128,), (1, 4, 16) if not quick else (4,), HEURISTIC_SHAPES):
            num_kv_heads = 8 if group < 16 else 2
            case = target_case(arch, q_dtype, fmt, is_decode, batch, batch * q_len, num_kv_heads * group,
                               num_kv_heads, head_dim, capacity)
            cfg = heuristics.heuristic_config(case, batch * q_len, torch.device("cuda"))
            constexprs, options = heuristics.kernel_constexprs(cfg, case, on_gpu=True)
            key = (fmt, q_dtype, tuple(sorted((k, str(v)) for k, v in constexprs.items())),
                   tuple(sorted(options.items())))
            if key not in seen:
                seen.add(key)
                yield f"{name}, {fmt} cache, {q_dtype} q, D={head_dim}, group {group}", q_dtype, fmt, constexprs, \
                    options


def target_case(arch: int, q_dtype: str, fmt: str, decode: bool, batch: int, num_tokens: int, num_q_heads: int,
                num_kv_heads: int, head_dim: int, capacity: int, tree: bool = False) -> AttentionCase:
    """The case of a call of these shapes on an sm_`arch` GPU (pages of 16), as the heuristic is asked for it."""
    return AttentionCase.of_shapes(device_type="cuda", arch=(arch // 10, arch % 10), q_dtype=TORCH_DTYPE[q_dtype],
                                   kv_format=fmt, head_dim=head_dim, page_size=16, num_q_heads=num_q_heads,
                                   num_kv_heads=num_kv_heads, batch=batch, num_tokens=num_tokens,
                                   max_kv_len=capacity, decode=decode, tree_mask=tree)


@contextlib.contextmanager
def _heuristic_for(arch: int, sms: int, shared_per_block: int):
    """heuristics.heuristic_config as it decides on an sm_`arch` GPU of `sms` SMs and `shared_per_block` bytes of
    shared memory a block (there is none here to ask)."""
    saved = heuristics._capability, heuristics._num_sms, heuristics._shared_memory_per_block
    heuristics.heuristic_config.cache_clear()
    heuristics._capability = lambda device: arch // 10
    heuristics._num_sms = lambda device: sms
    heuristics._shared_memory_per_block = lambda device: shared_per_block
    try:
        yield
    finally:
        heuristics._capability, heuristics._num_sms, heuristics._shared_memory_per_block = saved
        heuristics.heuristic_config.cache_clear()


def compile_attention(v, target):
    from .heuristics import dot_dtype, tile_rows
    ddt = TL_DTYPE[dot_dtype(TORCH_DTYPE[v["q_dtype"]], v["fmt"])]
    qp = "*" + v["q_dtype"]
    types = attention_types(v["fmt"], v["q_dtype"], v.get("lse", False))
    block_m = tile_rows(v["block_q"], v["group"])
    constexprs = dict(NUM_Q_HEADS=8 * v["group"], HEAD_DIM=v["head_dim"], PAGE=v["page"], GROUP=v["group"],
                      BLOCK_Q=v["block_q"], BLOCK_M=block_m, BLOCK_N=v["block_n"], FMT=FMT_CODE[v["fmt"]],
                      IS_DECODE=v["decode"], HAS_WINDOW=v["window"], HAS_SOFTCAP=v["soft_cap"],
                      HAS_SINKS=v.get("sinks", False), HAS_TREE=v.get("tree", False),
                      WRITE_LSE=v.get("lse", False), DOT_DTYPE=ddt,
                      DOT_PRECISION="ieee" if ddt == tl.float32 else "tf32",
                      FP8_DTYPE=tl.float8e4nv if v["fmt"] == "fp8_e4m3" else tl.float8e5,
                      SCALE_BCAST=v["scale_bcast"], FP4_ASM=v.get("fp4_asm", False),
                      V_DEQUANT_FIRST=v.get("v_dequant_first", False), PDL=v.get("pdl", False),
                      SOFT_FP8=False, HEADS_INNER=v.get("heads_inner", False),
                      FP8_V_PAIRS=v.get("fp8_v_pairs", False), FP8_K_PAIRS=v.get("fp8_k_pairs", False),
                      BOUNDS=v.get("bounds", True), PAGE_CLAMP=v.get("page_clamp", False),
                      FULL_TILES=v.get("full_tiles", False), OFFSETS_32=v.get("offsets_32", False),
                      VALID_DIM=v.get("valid_dim", v["head_dim"]), DIM_B=v.get("dim_b", 0),
                      PAD_WRAP=v.get("pad_wrap", False), WAVE_PLAN=v.get("wave_plan", 0))
    stages = 2 if v["head_dim"] >= 256 else 3
    compiled = compile_one(paged_attention_kernel, types, constexprs, target, v["warps"], stages)
    merge = compile_one(merge_splits_kernel, dict(out_ptr=qp, lse_ptr=types["lse_ptr"], part_out_ptr="*fp32",
                                                  part_lse_ptr="*fp32", seq_lens_ptr="*i32", cu_ptr="*i32",
                                                  sinks_ptr="*fp32"),
                        dict(NUM_Q_HEADS=32, HEAD_DIM=v["head_dim"], BLOCK_Q=v["block_q"], BLOCK_N=v["block_n"],
                             SPLITS_P2=64, IS_DECODE=v["decode"], HAS_WINDOW=v["window"],
                             HAS_TREE=v.get("tree", False), HAS_SINKS=v.get("sinks", False),
                             PDL=v.get("pdl", False), BOUNDS=v.get("bounds", True), ALIGN=v["block_n"],
                             WRITE_LSE=v.get("lse", False), VALID_DIM=v.get("valid_dim", v["head_dim"]),
                             WAVE_PLAN=v.get("wave_plan", 0)),
                        target, 4, 2)
    return compiled, merge


def compile_cache_write(fmt, src, head_dim, target, valid_dim=None):
    scale_ptr = "*fp32" if fmt.startswith("fp8") else "*u8"
    cache_ptr = PTR[fmt]
    sp = "*" + src
    types = dict(key_ptr=sp, value_ptr=sp, k_cache_ptr=cache_ptr, v_cache_ptr=cache_ptr, slot_ptr="*i64",
                 k_scale_ptr=scale_ptr, v_scale_ptr=scale_ptr, kb_ptr="*u8", vb_ptr="*u8", err_ptr="*i32")
    constexprs = dict(PAGE=16, HEAD_DIM=head_dim, FMT=FMT_CODE[fmt], SCALE_BLOCK=FORMATS[fmt].block or 16,
                      FP8_DTYPE=tl.float8e5 if fmt == "fp8_e5m2" else tl.float8e4nv,
                      FP8_MAX=57344.0 if fmt == "fp8_e5m2" else 448.0, SOFT_FP8=False,
                      VALID_DIM=valid_dim or head_dim)
    return compile_one(reshape_and_cache_kernel, types, constexprs, target, 2, 1)


def compile_page_layout(window: bool, target):
    """FlashInfer's decode page layout kernel (attnops/backends/pages.py)."""
    from ..pages import decode_page_layout_kernel
    types = dict(table_ptr="*i32", lens_ptr="*i32", indptr_ptr="*i32", indices_ptr="*i32", last_ptr="*i32",
                 fix_ptr="*i1", value_ptr="*bf16", err_ptr="*i32")
    return compile_one(decode_page_layout_kernel, types, dict(PAGE=16, BLOCK_B=64, BLOCK_W=128, HAS_WINDOW=window),
                       target, 4, 1)


def compile_merge_states(out_dtype: str, target):
    """merge_attention_states' kernel (merge_states.py)."""
    from .merge_states import merge_states_kernel
    op = "*" + out_dtype
    types = dict(out_a_ptr=op, lse_a_ptr="*fp32", out_b_ptr=op, lse_b_ptr="*fp32", out_ptr=op, lse_ptr="*fp32")
    compile_one(merge_states_kernel, types, dict(NUM_HEADS=128, BLOCK_H=8, HEAD_DIM=512, HEAD_DIM_P2=512), target, 4,
                1)  # (latent attention's 128 heads of 512, in head blocks)
    return compile_one(merge_states_kernel, types, dict(NUM_HEADS=8, BLOCK_H=8, HEAD_DIM=96, HEAD_DIM_P2=128), target,
                       4, 1)


def compile_mla(q_dtype: str, kv_format: str, num_heads: int, latent: int, rope: int, target, *, tokens: int = 32,
                capacity: int = 8192, decode: bool = True, sinks: bool = False, tree: bool = False,
                topk: bool = False):
    """Latent attention's kernels (mla_kernel.py) at the tiles mla_launch plans for a GPU over a cache of
    `kv_format` ("auto": q's dtype; "fp8_e4m3"; "fp8_ds_mla"): the attention kernel, the split merge when it plans
    splits, and the cache write. Returns the attention kernel."""
    from .mla_kernel import mla_attention_kernel, mla_cache_write_kernel, mla_merge_kernel
    from .mla_launch import _FMT, mla_plan
    plan = mla_plan(tokens, num_heads, capacity, latent, on_gpu=True)
    r_p2, p_p2 = triton.next_power_of_2(latent), triton.next_power_of_2(rope)
    q = "*" + q_dtype
    fmt = _FMT[kv_format]
    types = dict(qn_ptr=q, qp_ptr=q, kv_ptr="*u8" if fmt else q, bt_ptr="*i32", seq_lens_ptr="*i32", cu_ptr="*i32",
                 kv_scale_ptr="*fp32", sinks_ptr="*fp32", tm_ptr="*u8", topk_ptr="*i32", out_ptr=q, lse_ptr="*fp32",
                 part_out_ptr="*fp32", part_lse_ptr="*fp32", err_ptr="*i32")
    constexprs = dict(NUM_HEADS=num_heads, R=latent, P=rope, R_P2=r_p2, P_P2=p_p2, PAGE=64, BLOCK_H=plan["BLOCK_H"],
                      BLOCK_N=plan["BLOCK_N"], SPLIT=plan["MAX_SPLITS"] > 1, IS_DECODE=decode, FMT=fmt,
                      HAS_SINKS=sinks, HAS_TREE=tree, HAS_TOPK=topk, WRITE_LSE=sinks)
    kernel = compile_one(mla_attention_kernel, types, constexprs, target, plan["num_warps"], plan["num_stages"])
    if plan["MAX_SPLITS"] > 1:
        compile_one(mla_merge_kernel, dict(out_ptr=q, lse_ptr="*fp32", part_out_ptr="*fp32", part_lse_ptr="*fp32",
                                           sinks_ptr="*fp32"),
                    dict(NUM_HEADS=num_heads, R=latent, R_P2=r_p2,
                         SPLITS_P2=triton.next_power_of_2(plan["MAX_SPLITS"]),
                         SPLIT_BLOCK=min(8, triton.next_power_of_2(plan["MAX_SPLITS"])), HAS_SINKS=sinks,
                         WRITE_LSE=sinks),
                    target, 4, 1)
    compile_one(mla_cache_write_kernel, dict(kv_c_ptr=q, k_pe_ptr=q, kv_ptr="*u8" if fmt else q, slot_ptr="*i64",
                                             kv_scale_ptr="*fp32", err_ptr="*i32"),
                dict(R=latent, P=rope, R_P2=r_p2, P_P2=p_p2, PAGE=64, FMT=fmt, SOFT_FP8=False), target, 4, 1)
    return kernel


def _cuobjdump() -> str:
    """Triton's own cuobjdump (its wheel ships one with ptxas), else one on PATH."""
    bundled = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    found = bundled if os.path.exists(bundled) else shutil.which("cuobjdump")
    if not found:
        raise SystemExit("--sass needs cuobjdump (Triton's nvidia backend ships one; or put CUDA's on PATH)")
    return found


def sass_profile(cubin: bytes) -> dict:
    """Registers, stack bytes and the main loop of a cubin: the longest backward branch's body in its SASS, as an
    instruction count (what one thread issues per KV step) and a histogram of opcodes; `loops`: every loop of over
    100 instructions, in code order (a tree mask's kernel has two key loops, the block's tiles in the second)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_cuobjdump(), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    regs, stack = map(int, re.search(r"REG:(\d+) STACK:(\d+)", usage).groups())
    code = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;/]*);", sass)]
    index = {address: i for i, (address, _) in enumerate(code)}
    loops = []
    for i, (address, text) in enumerate(code):
        target = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)\s*)?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address:
            loops.append((index.get(int(target.group(1), 16), 0), i))
    first, last = max(loops, key=lambda loop: loop[1] - loop[0]) if loops else (0, len(code) - 1)
    big = [last - first + 1 for first, last in sorted(set(loops)) if last - first >= 100]
    ops = collections.Counter()
    for _, text in code[first:last + 1]:
        words = text.split()
        opcode = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
        # IMAD.MOV is a register move on the integer pipe (operand shuffling), not arithmetic: counted apart
        ops["IMAD.MOV" if opcode.startswith("IMAD.MOV") else opcode.split(".")[0]] += 1
    return dict(registers=regs, stack=stack, instructions=len(code), loop=last - first + 1, ops=ops, loops=big)


def programs_per_sm(registers: int, num_warps: int, shared: int, shared_per_block: int) -> int:
    """Programs of a kernel resident on one SM at once (sm_80+: 64K registers, allocated 256 a warp, at most 64
    warps; shared memory: an SM has 1 KB more than a block may take, and each block reserves 1 KB of it). Decode
    is bound by the bytes in flight, so this and the split plan's programs decide how full the chip is."""
    by_registers = 65536 // (num_warps * -(-registers * 32 // 256) * 256)
    by_shared = (shared_per_block + 1024) // (shared + 1024) if shared else 32
    return min(by_registers, by_shared, 64 // num_warps)


def print_sass(formats_: list, q_dtype: str, target, sms: int, shared_per_block: int, overrides: dict,
               case: str = "decode 128 x 4096", heads: tuple = (32, 8, 128)) -> None:
    """For each format, the heuristic's tile for `case` (one of HEURISTIC_SHAPES; `heads` = (q heads, KV heads,
    head dim), pages of 16) on the target, with `overrides` (tunables, e.g. {"V_DEQUANT_FIRST": 1}; maxnreg 0 = no
    cap): its registers and the instructions one thread issues per step of BLOCK_N keys. Decode of a quantized
    cache is bound by its instructions, not bytes, when these are high: this is the number to lower."""
    _, decode, batch, q_len, capacity = next(shape for shape in HEURISTIC_SHAPES + TREE_SHAPES if shape[0] == case)
    tree = any(shape[0] == case for shape in TREE_SHAPES)
    lse = case.startswith("prefix")
    num_q_heads, num_kv_heads, head_dim = heads
    for fmt in formats_:
        shaped = target_case(target.arch, q_dtype, fmt, decode, batch, batch * q_len, num_q_heads, num_kv_heads,
                             head_dim, capacity, tree)
        with _heuristic_for(target.arch, sms, shared_per_block):
            cfg = dict(heuristics.heuristic_config(shaped, batch * q_len, torch.device("cuda")), **overrides)
        constexprs, options = heuristics.kernel_constexprs(cfg, shaped, on_gpu=True, lse=lse,
                                                           offsets_fit_32=True)  # (a cache of the case's size)
        compiled = compile_one(paged_attention_kernel, attention_types(fmt, q_dtype, lse), constexprs, target,
                               **options)
        prof = sass_profile(compiled.asm["cubin"])
        shared = compiled.metadata.shared
        resident = programs_per_sm(prof["registers"], options["num_warps"], shared, shared_per_block)
        values = constexprs["BLOCK_N"] * head_dim * 2 / (32 * options["num_warps"])  # K and V values a thread, a step
        top = ", ".join(f"{op} {n}" for op, n in prof["ops"].most_common(12))
        print(f"{case}, {num_q_heads}/{num_kv_heads}/{head_dim}, {fmt} ({q_dtype} q): BLOCK_Q {constexprs['BLOCK_Q']}, "
              f"BLOCK_N {constexprs['BLOCK_N']}, {options['num_warps']} warps, "
              f"{options['num_stages']} stages{', maxnreg ' + str(options['maxnreg']) if 'maxnreg' in options else ''}"
              f": {prof['registers']} registers, {prof['stack']} stack bytes, {shared} B shared "
              f"({resident} programs an SM); main loop {prof['loop']} instructions a thread a step "
              f"({prof['loop'] / values:.1f} per K/V value): {top}"
              + (f"; loops of {', '.join(map(str, prof['loops']))} instructions" if len(prof['loops']) > 1 else ""),
              flush=True)


def check_heuristic(target, sms: int, shared_per_block: int, quick: bool) -> int:
    """Compiles every distinct heuristic choice. A choice that does not fit the target's shared memory is stepped
    down the way launch() does at run time (heuristics.smaller_tile) until one fits: "STEP" rows (the GPU would warn
    once and run the smaller tile), "FAIL" rows where nothing fits or nothing compiles. Returns the FAIL count."""
    from .heuristics import smaller_tile
    failures = steps = 0
    choices = heuristic_configurations(target.arch, sms, shared_per_block, quick)
    for label, q_dtype, fmt, constexprs, options in choices:
        tried = []
        try:
            while True:
                compiled = compile_one(paged_attention_kernel, attention_types(fmt, q_dtype), constexprs, target,
                                       **options)
                tried.append(f"BLOCK_N {constexprs['BLOCK_N']}, {options['num_stages']} stages: "
                             f"{compiled.metadata.shared} B")
                if compiled.metadata.shared <= shared_per_block:
                    break
                smaller = smaller_tile(dict(BLOCK_N=constexprs["BLOCK_N"], num_stages=options["num_stages"]))
                if smaller is None:
                    raise RuntimeError("no tile fits")
                constexprs = dict(constexprs, BLOCK_N=smaller["BLOCK_N"])
                options = dict(options, num_stages=smaller["num_stages"])
            status = "ok  " if len(tried) == 1 else "STEP"
            steps += len(tried) > 1
        except Exception as e:
            failures += 1
            status = f"FAIL ({type(e).__name__}: {str(e)[:300]})"
        print(f"{status} {label}, BLOCK_Q {constexprs['BLOCK_Q']}, {options['num_warps']} warps"
              f"{', maxnreg ' + str(options['maxnreg']) if 'maxnreg' in options else ''}: " + " -> ".join(tried),
              flush=True)
    print(f"{steps} choices stepped down to fit {shared_per_block} B")
    return failures


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--heuristic", action="store_true",
                        help="compile the heuristic's own choices (every format, q dtype, head dim, group, and the "
                             "shapes of HEURISTIC_SHAPES) and check that each fits the target's shared memory, or "
                             "that a smaller tile launch() would step down to does")
    parser.add_argument("--sass", nargs="+", metavar="FORMAT",
                        help="for these KV formats, the heuristic decode tile's registers and the SASS instructions "
                             "its main loop issues a step, by opcode (needs cuobjdump: Triton ships one)")
    parser.add_argument("--q-dtype", default="bf16", choices=["bf16", "fp16", "fp32"], help="--sass: q's dtype")
    parser.add_argument("--case", default="decode 128 x 4096",
                        choices=[shape[0] for shape in HEURISTIC_SHAPES + TREE_SHAPES],
                        help="--sass: the shape whose heuristic tile is compiled")
    parser.add_argument("--heads", default="32/8/128", metavar="HQ/HKV/D",
                        help="--sass: query heads, KV heads and head dim of the case")
    parser.add_argument("--set", nargs="+", default=[], metavar="KEY=VALUE",
                        help="--sass: tunables to set on the heuristic's tile, e.g. V_DEQUANT_FIRST=1 maxnreg=0")
    parser.add_argument("--sms", type=int, default=132,
                        help="--heuristic/--sass: the target's SMs (132: H100/H200)")
    parser.add_argument("--shared", type=int, default=232448,
                        help="--heuristic/--sass: bytes of shared memory a block may take (232448, 227 KB: sm_90)")
    opts = parser.parse_args()
    target = GPUTarget("cuda", opts.arch, 32)
    print(f"triton {triton.__version__}, target sm_{opts.arch}")
    failures = 0
    t0 = time.time()
    if opts.sass:
        overrides = {key: int(value) for key, value in (item.split("=", 1) for item in opts.set)}
        heads = tuple(int(x) for x in opts.heads.split("/"))
        print_sass(opts.sass, opts.q_dtype, target, opts.sms, opts.shared, overrides, opts.case, heads)
        return
    if opts.heuristic:
        failures = check_heuristic(target, opts.sms, opts.shared, opts.quick)
        print(f"{failures} failures, {time.time() - t0:.0f} s")
        sys.exit(1 if failures else 0)
    for v in attention_variants(opts.quick, opts.arch):
        try:
            compiled, _ = compile_attention(v, target)
            ttgir = compiled.asm["ttgir"]
            mma = "wgmma" if "warp_group_dot" in ttgir else "mma"
            print(f"ok   attention {v}: {compiled.metadata.shared} B shared, {mma}, "
                  f"{ttgir.count('async_copy_global_to_local')} pipelined (cp.async) loads", flush=True)
        except Exception as e:
            failures += 1
            print(f"FAIL attention {v}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    # the other kernels: (label, compile call)
    others = [(f"reshape_and_cache {fmt} from {src}, head_dim {head_dim}",
               functools.partial(compile_cache_write, fmt, src, head_dim, target))
              for fmt, src, head_dim in itertools.product(list(KV_FORMATS), ["bf16", "fp32"], [32, 128])]
    others += [(f"reshape_and_cache {fmt} from bf16, head_dim {valid} (a padded tile)",
                functools.partial(compile_cache_write, fmt, "bf16", head_tile(valid), target, valid))
               for fmt, valid in itertools.product(("bf16", "fp8_e4m3"), (80, 192))]
    others += [(f"decode page layout, window {window}", functools.partial(compile_page_layout, window, target))
               for window in (False, True)]
    others += [(f"merge_attention_states, {out_dtype}", functools.partial(compile_merge_states, out_dtype, target))
               for out_dtype in ("bf16", "fp32")]
    others += [(f"latent attention, {kv_format} cache, {heads} heads, {shape}",
                functools.partial(compile_mla, "bf16", kv_format, heads, 512, 64, target, tokens=tokens,
                                  decode=tokens <= 128, sinks=kv_format == "auto", tree=tokens > 128))
               for kv_format, heads, (shape, tokens) in itertools.product(
                   ("auto", "fp8_e4m3", "fp8_ds_mla"), (16, 128),
                   (("decode 1", 1), ("decode 128", 128), ("verify 4 x 64", 256)))]
    for label, compile_it in others:
        try:
            compile_it()
            print(f"ok   {label}", flush=True)
        except Exception as e:
            failures += 1
            print(f"FAIL {label}: {type(e).__name__}: {str(e)[:2000]}", flush=True)
    print(f"{failures} failures, {time.time() - t0:.0f} s")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
