"""The Triton attention kernel's tunables, chosen from shapes and dtypes only (so a choice is fixed per captured
shape, and cached): tile sizes, the split of the keys into programs, and the code-path switches. Each choice
says why in a line; the measurements behind them are in this package's README and docs/bench.md.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ... import formats, invariance
from ...cases import AttentionCase
from . import head_tile
from .common import FMT_CODE
from .kernel import TL_DTYPE

WORKSPACE_BYTES = 64 * 2 ** 20  # the most split partials one call may allocate (heuristic; tuning may exceed it)

# Tunables a caller (benchmarks/triton_tuning.py, tests) may force; None entries fall back to the heuristic.
CONFIG_KEYS = ("BLOCK_N", "num_warps", "num_stages", "CHUNK", "MAX_SPLITS", "BLOCK_Q", "SCALE_BCAST", "FP4_ASM",
               "maxnreg", "HEADS_INNER", "V_DEQUANT_FIRST", "PDL", "FP8_V_PAIRS", "FP8_K_PAIRS", "BOUNDS",
               "PAGE_CLAMP", "FULL_TILES", "OFFSETS_32", "HEAD_PARTS", "PAD_WRAP", "WAVE_PLAN", "FILL_WAVES")


@functools.lru_cache(maxsize=None)
def forced_tunables() -> dict:
    """Tunables forced on every call of the process by ATTNOPS_TRITON_TUNABLES ("KEY=VALUE,...", integer values,
    e.g. "FULL_TILES=1,OFFSETS_32=1"): to measure or test one end to end (serve-bench, the fuzz suite) before it is
    a default. Read once; launch's own `config` still overrides it."""
    text = os.environ.get("ATTNOPS_TRITON_TUNABLES", "")
    forced = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = item.partition("=")
        try:
            if key.strip() not in CONFIG_KEYS:
                raise ValueError
            forced[key.strip()] = int(value)
        except ValueError:
            raise ValueError(f"ATTNOPS_TRITON_TUNABLES: {item!r} is not KEY=<integer> with KEY one of "
                             f"{', '.join(CONFIG_KEYS)}") from None
    return forced


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: small, so that CPU tests exercise several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(device: torch.device) -> int:
    """The GPU's compute capability major (0 off the GPU)."""
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_capability(device)[0]


def _shared_memory_per_block(device: torch.device) -> int:
    """Bytes of shared memory a block may opt into (0 off the GPU, or where torch does not say)."""
    if device.type != "cuda":
        return 0
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 0)


def dot_dtype(q_dtype: torch.dtype, kv_format: str) -> torch.dtype:
    """The dtype of tl.dot operands: fp32 for fp32 q (exact, input_precision="ieee"); fp16 for fp8 and nvfp4
    caches (their values fit fp16 exactly, fp16 keeps 3 more mantissa bits of q and P than bf16, and fp8 ->
    fp16 is a cheaper conversion than fp8 -> bf16); mxfp4's scales span 2^-127..2^127 so it keeps q's dtype;
    plain caches compute in q's dtype."""
    if q_dtype == torch.float32:
        return torch.float32
    if formats.is_fp8(kv_format) or kv_format == "nvfp4":
        return torch.float16
    return q_dtype


def tile_rows(block_q: int, group: int) -> int:
    """Rows of a tile (BLOCK_M): BLOCK_Q tokens x the GQA group, a power of two of at least 16 (tl.dot's M)."""
    return max(16, triton.next_power_of_2(block_q * group))


def working_blocks(decode: bool, batch: int, num_tokens: int, block_q: int) -> int:
    """Query blocks that do work: a sequence each in decode; else the tokens' blocks (the grid's T // BLOCK_Q + B is
    an upper bound that counts partial blocks), at least one a sequence."""
    return batch if decode else max(batch, -(-num_tokens // block_q))


def workspace_splits(num_tokens: int, num_q_heads: int, head_dim: int) -> int:
    """The most splits a row may take within WORKSPACE_BYTES ([T, Hq, MAX_SPLITS, D] fp32 partials; head_dim: the
    tile's padded width)."""
    return max(1, WORKSPACE_BYTES // (num_tokens * num_q_heads * head_dim * 4))


# batch-invariant mode (attnops.invariance): keys a split, fixed per form of call (decode or query blocks), so that
# kv_plan cuts a sequence by its own length. Decode takes short splits (one sequence must still fill the chip); query
# blocks long ones (a block's rows already give the programs; each split more costs its q load and its merge)
INVARIANT_DECODE_CHUNK = 1024
INVARIANT_BLOCK_CHUNK = 4096
INVARIANT_CHUNK_ENV = "ATTNOPS_TRITON_INVARIANT_CHUNK"  # one split size for both forms on a GPU, to time it
# WAVE_PLAN (decode's keys a split chosen on the device from the call's lengths: common.wave_chunk): the shortest
# split it may choose on a GPU (the interpreter: two tiles, so that CPU tests split short sequences)
WAVE_MIN_CHUNK = 512
# FILL_WAVES (fill_waves): the programs of a 128-key decode tile an SM holds (about 168 registers, 4 warps)
FILL_WAVES_PROGRAMS_PER_SM = 3


def heuristic_config(case: AttentionCase, num_tokens: int, device: torch.device) -> dict:
    """Tunables for a case of `num_tokens` query tokens on `device`, from shapes and dtypes only (cached per
    case). The number of splits a sequence actually gets is decided on the device (common.kv_plan); here: CHUNK
    (keys per program), MAX_SPLITS (grid size, workspace) and tile sizes.

    In batch-invariant mode every choice that shapes a row's sums is made from the head shape, formats and the
    call's form (decode or not) only, never from the batch, its tokens or the table's width: the query tile is
    fixed, CHUNK is invariant_chunk(decode) (kv_plan then splits a sequence by its own length), and MAX_SPLITS
    covers the table whatever the workspace (at least 2, so that one compiled variant serves every call)."""
    return _heuristic_config(case, num_tokens, device, invariance.enabled())


@functools.lru_cache(maxsize=4096)
def _heuristic_config(case: AttentionCase, num_tokens: int, device: torch.device, invariant: bool) -> dict:
    decode, batch, group, capacity = case.decode, case.batch, case.group, case.max_kv_len
    # (tiles are chosen for the padded width the kernel computes on)
    num_q_heads, num_kv_heads, head_dim = case.num_q_heads, case.num_kv_heads, head_tile(case.head_dim)
    kv_format, q_dtype = case.kv_format, case.q_dtype
    sms = _num_sms(device)
    if decode:
        block_q = 1
    else:
        avg_q = 16 if invariant else -(-num_tokens // max(batch, 1))
        max_rows = 64 if head_dim >= 256 else 128
        block_q = max(1, min(triton.next_power_of_2(avg_q), max(1, max_rows // group)))
        # verify blocks of 4 or 8 draft tokens x a group of 4 of a 16-bit cache and q at D=128 in the 64-row verify
        # tile below, rows padded to 16 tokens, where the sequences' blocks fill the SMs unsplit: one split a
        # sequence, unmasked full tiles and int32 offsets beat the 16- and 32-row tiles' plans though a block
        # computes rows nobody asked for (fewer sequences, which need splits, and other groups: not measured)
        if (device.type == "cuda" and not invariant and head_dim == 128 and kv_format in ("bf16", "fp16")
                and q_dtype != torch.float32 and group == 4 and block_q in (4, 8) and batch * num_kv_heads >= sms):
            block_q = 16
    block_m = tile_rows(block_q, group)
    # decode, and verify blocks whose tokens x heads fit one 16-row tile: streaming the KV once is the whole job
    decode_like = decode or block_m <= 16
    # programs to fill the chip: the decode kernel holds about two programs per SM (registers); 1.5 per SM beat
    # more, shorter splits at every measured decode case. Tiles of 64+ rows (prefill_128 below) are bound by the
    # tensor cores and hold one program per SM (shared memory): one wave of the fewest splits, each program
    # long (a split's q load, epilogue and merge are paid per program)
    compute_tile = not decode_like and block_m >= 64
    target = (3 * sms) // 2 if decode_like else sms if compute_tile else 4 * sms
    # Decode-like tiles: 128 keys up to D=128 (every format's fastest). Larger query tiles: about 16 KB of bf16 K
    # (64 keys at D=128 for registers, 128 at D<=64, 32 at D=256), except prefill tiles of 64+ rows at D=128,
    # which take 128 keys. The interpreter keeps 64 so that CPU tests cover several tiles and splits.
    # (16-bit dots only: fp32 dots at 128 x 128 need more shared memory than sm_90 has: compile_check --heuristic)
    # Verify blocks of 64-row tiles (e.g. 16 draft tokens x a group of 4) of a 16-bit or fp8 cache: 64 keys and 4
    # warps (a warp's 16 rows, two programs an SM), faster than the prefill tile at 32 x 4096, causal or tree
    verify_64 = (device.type == "cuda" and not decode and block_m == 64 and block_q <= 16 and head_dim == 128
                 and (kv_format in ("bf16", "fp16") or formats.is_fp8(kv_format)))
    prefill_128 = (device.type == "cuda" and not decode_like and block_m >= 64 and head_dim == 128
                   and dot_dtype(q_dtype, kv_format) != torch.float32 and not verify_64)
    # Decode tiles of 512 columns with a 16-bit dot: 32 keys in 8 warps, faster than 16 keys in 4 (4-bit
    # caches and verify blocks keep those: not measured)
    wide_decode = decode and head_dim >= 512 and dot_dtype(q_dtype, kv_format) != torch.float32 and not (
        formats.is_fp4(kv_format))
    # Decode tiles of 256 columns (head dims 129-256) with a 16-bit cache of q's dtype: 64 keys in 8 warps, faster
    # than 32 in 4 (16/8/256 at 32 x 8192 1.16x, 8/4/256 at 1 x 32768 1.14x; 160 and 192 in two tiles 1.08-1.11x at
    # 1 x 32768, within 1.2% elsewhere). (A cache of the other 16-bit dtype converts K and V: 142 registers, one
    # program an SM in 8 warps; not measured, so it keeps 32 keys.)
    sixteen_bit_256 = (head_dim == 256 and device.type == "cuda" and kv_format in ("bf16", "fp16")
                       and formats.FORMATS[kv_format].storage_dtype == q_dtype)
    decode_256 = decode and sixteen_bit_256
    if device.type != "cuda":
        block_n = 32 if head_dim >= 256 else 64
    elif decode_like and head_dim <= 128 or prefill_128:
        block_n = 128
    elif wide_decode:
        block_n = 32
    elif decode_256:
        block_n = 64
    elif verify_64:
        block_n = 64
    else:
        block_n = max(16, min(128, 8192 // head_dim))
    base = working_blocks(decode, batch, num_tokens, block_q) * num_kv_heads
    if invariant:
        chunk = 2 * block_n if device.type != "cuda" else invariant_chunk(decode)
        max_splits = max(2, -(-capacity // chunk))
    elif device.type != "cuda":
        chunk, max_splits = 2 * block_n, 8  # CPU (interpreter): exercise the split + merge path
    elif base >= target and not decode:
        chunk, max_splits = capacity, 1  # prefill-like: enough programs without splitting, no workspace
    else:
        # enough splits to fill the chip for the longest possible sequence, but at least 1024 keys a program (a
        # split's fixed costs: q, the epilogue, the merge) and no more than 4096 whatever the batch, so that one
        # long sequence in a ragged batch does not become the tail
        # (whole programs of a wave for compute tiles: a split more than fits the wave runs as a second one)
        splits_to_fill = max(1, target // base) if compute_tile else -(-target // base)
        if decode_like and base >= 2 * target and kv_format != "mxfp4":
            # three or more programs an SM without splitting, yet halves still paid (mxfp4, ALU-bound, lost)
            splits_to_fill = 2
        chunk = 1 << max(0, (capacity // splits_to_fill).bit_length() - 1)  # a power of two, rounded down
        low, high = (1024, 4096) if decode_like else (4 * block_n, 2048)
        chunk = max(low, min(chunk, high))
        max_splits = max(1, min(-(-capacity // chunk), 256))
        if not decode:  # the workspace is per query token: split only as much as filling the chip needs
            max_splits = min(max_splits, splits_to_fill)
        # a bounded workspace ([T, Hq, MAX_SPLITS, D] fp32); past the cap the device lengthens the splits
        max_splits = min(max_splits, workspace_splits(num_tokens, num_q_heads, head_dim))
    # 64-row tiles of 256 columns with a 16-bit cache (prefill, extend, long verify blocks) on sm_90: 4 warps, not 8
    # (2 programs an SM, not 1: prefill 8 x 4096 at 16/8/256 1.72x faster; head dims padded to 256: not measured;
    # without warpgroup MMAs, e.g. sm_89, the 64 x 256 accumulator in 4 warps spills)
    rows_256 = sixteen_bit_256 and block_m == 64 and case.head_dim == 256 and _capability(device) == 9
    many_rows = block_m >= 64 and not (verify_64 or rows_256)
    num_warps = 8 if many_rows or device.type == "cuda" and (wide_decode or decode_256) else 4
    # 128-key prefill tiles of a 16-bit cache pipeline 3 stages deep where a block may take 227 KB of shared
    # memory (sm_90), 2 elsewhere
    deep_prefill = (prefill_128 and kv_format in ("bf16", "fp16")
                    and _shared_memory_per_block(device) >= 227 * 1024)
    num_stages = 2 if head_dim >= 256 or (kv_format == "nvfp4" and decode_like) or (
        prefill_128 and not deep_prefill) or (verify_64 and formats.is_fp8(kv_format)) else 3
    # fp8 decode tiles: capping registers at 168 (from 198) fits 3 programs per SM instead of 2, worth its spills;
    # mxfp4 decode with PAGE_CLAMP (below) takes 180 without the cap, an SM's program fewer
    # fp8 decode tiles of 256 columns (32 keys) capped at 128 registers: 4 programs an SM, faster than 3
    capped = formats.is_fp8(kv_format) and decode_like or kv_format == "mxfp4" and decode
    maxnreg = None
    if capped and device.type == "cuda":
        maxnreg = 128 if formats.is_fp8(kv_format) and decode and head_dim == 256 else 168
    # SCALE_BCAST: one load per 4-bit block scale, not one per value. FP4_ASM: the inline-PTX nibble decode (4 values
    # a register). HEADS_INNER for decode-like tiles: neighbouring programs read every head of the same pages.
    # V_DEQUANT_FIRST for mxfp4 decode-like tiles only (slower for fp8 and nvfp4 despite fewer instructions).
    # PDL where the GPU has it (sm_90+): the merge kernel launches as a dependent of the attention kernel.
    # FP8_V_PAIRS/FP8_K_PAIRS for fp8 decode-like tiles on the GPU (the split is inline PTX): the tile reaches the
    # mma layout by ldmatrix instead of a shared-memory load a byte; prefill tiles are not measured, so off there.
    # PAGE_CLAMP for decode: the pages checked after the loop, not before it (faster or equal in every format).
    # HEAD_PARTS for decode-like tiles of 256 columns: a head dim between 128 and 256 (160, 192) in two tiles (128 and
    # the rest), not one padded one, 1.08-1.35x faster in bf16; at 80 and 96 (128's tile) 1.06-1.28x slower; fp8
    # keeps the padded tile, whose register cap (128, below) two tiles cannot take: 1.06-1.46x faster.
    # PAD_WRAP (a padded tile's columns past the head dim read as copies of its first ones, not masked): off, up to
    # 1.24x slower (bf16 at 80).
    # WAVE_PLAN (decode's split size from the call's lengths, on the device: the programs a wave holds an SM; 0 off):
    # off: 1.8-3.1x faster than the plan of shapes on a long sequence among short ones, but 0.87-0.98x on uniform
    # batches, where its loop over the lengths and its grid of 512-key splits cost more than its choice saves.
    # FULL_TILES and OFFSETS_32 for the 64-row verify tile (unmasked full tiles, int32 cache offsets): faster there
    # (bf16 1.18-1.19x); in decode tiles neutral (bf16) to slower (fp8, and nvfp4 by a third: registers).
    # FILL_WAVES (where the plan's programs overrun a wave by at most half a wave, more and shorter splits that
    # fill two: fill_waves) for 128-key decode tiles of fp8 caches and of 16-bit ones at 128 columns (32 x 8192 x 8
    # KV heads: fp8 1.10-1.17x, bf16 1.05x, ragged tables of 8192 keys up to 1.29x); 16-bit at 64 columns, whose
    # tile holds more programs an SM, ran 1.04x slower; verify blocks, fp32 dots and 4-bit caches: not measured.
    # The measurements behind each choice: this package's README.
    fp8_pairs = formats.is_fp8(kv_format) and decode_like and device.type == "cuda"
    fill = (device.type == "cuda" and decode and not invariant and block_n == 128 and head_dim <= 128
            and dot_dtype(q_dtype, kv_format) != torch.float32
            and (formats.is_fp8(kv_format) or kv_format in ("bf16", "fp16") and head_dim == 128))
    return dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, CHUNK=chunk, MAX_SPLITS=max_splits,
                BLOCK_Q=block_q, SCALE_BCAST=True, FP4_ASM=device.type == "cuda", maxnreg=maxnreg,
                HEADS_INNER=decode_like,
                V_DEQUANT_FIRST=kv_format == "mxfp4" and decode_like and device.type == "cuda",
                PDL=_capability(device) >= 9, FP8_V_PAIRS=fp8_pairs, FP8_K_PAIRS=fp8_pairs, BOUNDS=True,
                PAGE_CLAMP=decode, FULL_TILES=verify_64, OFFSETS_32=verify_64,
                HEAD_PARTS=decode_like and head_dim == 256 and not formats.is_fp8(kv_format), PAD_WRAP=False,
                WAVE_PLAN=0, FILL_WAVES=fill)


heuristic_config.cache_clear = _heuristic_config.cache_clear  # (tests and compile_check clear the choices)


def invariant_chunk(decode: bool) -> int:
    """Keys a split in batch-invariant mode on a GPU for a decode call or one of query blocks (verify, extend,
    prefill): INVARIANT_DECODE_CHUNK or INVARIANT_BLOCK_CHUNK, or ATTNOPS_TRITON_INVARIANT_CHUNK's for both (a
    multiple of 128, every tile's keys; benchmarks/gpu_round.sh's invariance step times several with
    INVARIANCE_CHUNKS)."""
    default = INVARIANT_DECODE_CHUNK if decode else INVARIANT_BLOCK_CHUNK
    return invariance.chunk_setting(INVARIANT_CHUNK_ENV, default, 128)


def wave_plan(cfg: dict, case: AttentionCase, num_tokens: int, on_gpu: bool) -> dict:
    """`cfg` with WAVE_PLAN (decode's split size from the call's lengths, on the device) off where it does not apply
    (verify, prefill, batch-invariant mode: there a row's splits must not depend on the other sequences), and
    MAX_SPLITS raised where it does, so that a sequence as long as the table can take splits of the shortest size the
    device may choose (within the workspace's bound). Shapes only: graph-safe."""
    if not cfg.get("WAVE_PLAN"):
        return cfg
    if not case.decode or invariance.enabled():
        return dict(cfg, WAVE_PLAN=0)
    splits = min(-(-case.max_kv_len // wave_min_chunk(cfg, on_gpu)), 256,
                 workspace_splits(num_tokens, case.num_q_heads, head_tile(case.head_dim)))
    return dict(cfg, MAX_SPLITS=max(cfg["MAX_SPLITS"], splits))


def fill_waves(cfg: dict, case: AttentionCase, num_tokens: int, device: torch.device) -> dict:
    """`cfg` with FILL_WAVES applied: where a decode-like tile's plan (the longest possible sequence's splits,
    ceil(capacity / CHUNK), x the query blocks x the KV heads) launches more programs than a wave of the chip holds
    but at most one and a half waves, CHUNK shortened so that the splits fill two whole waves (e.g. 32 sequences x 8
    KV heads x 8192 keys on 132 SMs: 3 splits of 2816 keys, 768 programs, not 2 of 4096, 512 programs of which 116
    run as a second wave alone). The splits stay at least 1024 keys. Shapes only (the table's capacity, never the
    lengths): graph-safe. FILL_WAVES is switched off where it does not apply: other tiles than 128-key ones of
    16-bit and fp8 caches, batch-invariant mode (the mode's splits are fixed), WAVE_PLAN (the device chooses the
    split size), the interpreter."""
    if not cfg.get("FILL_WAVES"):
        return cfg
    if (device.type != "cuda" or invariance.enabled() or tile_rows(cfg["BLOCK_Q"], case.group) > 16
            or cfg["BLOCK_N"] != 128 or head_tile(case.head_dim) > 128 or formats.is_fp4(case.kv_format)
            or cfg.get("WAVE_PLAN")):
        return dict(cfg, FILL_WAVES=0)
    base = working_blocks(case.decode, case.batch, num_tokens, cfg["BLOCK_Q"]) * case.num_kv_heads
    capacity = case.max_kv_len
    wave = FILL_WAVES_PROGRAMS_PER_SM * _num_sms(device)
    programs = base * min(-(-capacity // cfg["CHUNK"]), cfg["MAX_SPLITS"])
    if not wave < programs <= wave + wave // 2:
        return cfg
    splits = (2 * wave) // base
    chunk = -(-capacity // splits)
    chunk = -(-chunk // cfg["BLOCK_N"]) * cfg["BLOCK_N"]
    max_splits = min(-(-capacity // chunk), 256, workspace_splits(num_tokens, case.num_q_heads,
                                                                  head_tile(case.head_dim)))
    if chunk < 1024 or max_splits * base <= programs:
        return cfg
    return dict(cfg, CHUNK=chunk, MAX_SPLITS=max_splits)


def wave_min_chunk(cfg: dict, on_gpu: bool) -> int:
    """The shortest split WAVE_PLAN may choose (a power of two): WAVE_MIN_CHUNK on a GPU, two tiles in the
    interpreter."""
    return WAVE_MIN_CHUNK if on_gpu else 2 * cfg["BLOCK_N"]


def smaller_tile(cfg: dict) -> dict | None:
    """The configuration to try when `cfg`'s tile does not fit the GPU: one pipeline stage fewer down to 2, then
    half the keys per tile down to 16, then 1 stage; None past that. (The split plan needs no change: the device
    rounds splits to BLOCK_N multiples.)"""
    if cfg["num_stages"] > 2:
        return dict(cfg, num_stages=cfg["num_stages"] - 1)
    if cfg["BLOCK_N"] > 16:
        return dict(cfg, BLOCK_N=cfg["BLOCK_N"] // 2)
    if cfg["num_stages"] > 1:
        return dict(cfg, num_stages=1)
    return None


def head_parts(head_dim: int, kv_format: str) -> int:
    """The second tile's width when a head dim between powers of two runs in two tiles (HEAD_PARTS): the power of
    two below it, then the rest rounded up to a power of two of at least 32 columns (64 for 4-bit, whose tiles are
    its even and odd halves; fp8 reads its second tile as plain bytes), so 96 is 64 + 32 and 80 is 64 + 32 (with a
    16-column dot operand the whole loop took 2-3x the instructions, and spilled: sm_90 SASS, Triton 3.9); 0 where
    that is no narrower than the one padded tile (a power of two; 112 = 64 + 64)."""
    low = 1 << (head_dim.bit_length() - 1)
    if low == head_dim:
        return 0
    rest = max(64 if formats.is_fp4(kv_format) else 32, 1 << (head_dim - low - 1).bit_length())
    return rest if low + rest < head_tile(head_dim) else 0


def kernel_constexprs(cfg: dict, case: AttentionCase, *, on_gpu: bool, lse: bool = False,
                      offsets_fit_32: bool = False) -> tuple[dict, dict]:
    """The attention kernel's constexpr arguments and compiler options (num_warps, num_stages, maxnreg) for a
    configuration and a case: the one place that turns tunables into what Triton compiles, for launch() and for
    compile_check (which compiles the heuristic's choices for a GPU target without one). Tunables that do not
    apply to the format, q dtype or machine are switched off here. on_gpu: compiled for a GPU (not the
    interpreter): inline PTX and register caps apply. lse: each row's LSE is written (paged_attention_with_lse).
    offsets_fit_32: every element offset into the caches (and 4-bit scales) fits int32, which OFFSETS_32 needs."""
    kv_format, group = case.kv_format, case.group
    ddt = dot_dtype(case.q_dtype, kv_format)
    # fp8 pairs need fp16 dots; a forced V_DEQUANT_FIRST is another way to read V
    fp8_pairs = formats.is_fp8(kv_format) and ddt == torch.float16
    constexprs = dict(
        NUM_Q_HEADS=case.num_q_heads, HEAD_DIM=head_tile(case.head_dim), VALID_DIM=case.head_dim,
        PAGE=case.page_size, GROUP=group,
        BLOCK_Q=cfg["BLOCK_Q"], BLOCK_M=tile_rows(cfg["BLOCK_Q"], group),
        BLOCK_N=cfg["BLOCK_N"], FMT=FMT_CODE[kv_format], IS_DECODE=case.decode, HAS_WINDOW=case.sliding_window,
        HAS_SOFTCAP=case.soft_cap, HAS_SINKS=case.sinks, HAS_TREE=case.tree_mask, WRITE_LSE=lse,
        DOT_DTYPE=TL_DTYPE[ddt], DOT_PRECISION="ieee" if ddt == torch.float32 else "tf32",
        FP8_DTYPE=tl.float8e4nv if kv_format == "fp8_e4m3" else tl.float8e5,
        # block scales loaded once per block and repeated in registers
        SCALE_BCAST=bool(cfg["SCALE_BCAST"]) and case.format.scale == formats.BLOCK_SCALE,
        FP4_ASM=bool(cfg["FP4_ASM"]) and formats.is_fp4(kv_format) and on_gpu,
        V_DEQUANT_FIRST=bool(cfg["V_DEQUANT_FIRST"]) and (formats.is_fp8(kv_format) or formats.is_fp4(kv_format))
        and on_gpu,
        PDL=bool(cfg["PDL"]) and cfg["MAX_SPLITS"] > 1 and on_gpu,
        SOFT_FP8=not on_gpu,
        HEADS_INNER=bool(cfg["HEADS_INNER"]),
        FP8_V_PAIRS=bool(cfg["FP8_V_PAIRS"]) and fp8_pairs and not cfg["V_DEQUANT_FIRST"],
        FP8_K_PAIRS=bool(cfg["FP8_K_PAIRS"]) and fp8_pairs,
        # the in-kernel index bounds (docs/design.md, "Bad indices"): always on; off only to measure what they cost
        BOUNDS=bool(cfg["BOUNDS"]),
        # decode tiles: pages clamped in the loop and checked after it, not before
        PAGE_CLAMP=bool(cfg["PAGE_CLAMP"]),
        # the tiles that end by their split's last key loaded without masks
        FULL_TILES=bool(cfg["FULL_TILES"]),
        # element offsets into the caches in int32 where they fit (launch checks; int64 otherwise)
        OFFSETS_32=bool(cfg["OFFSETS_32"]) and offsets_fit_32,
        # a head dim between powers of two in two tiles (its power of two below, then the rest), not one padded one
        DIM_B=head_parts(case.head_dim, kv_format) if cfg.get("HEAD_PARTS") else 0,
        # a padded tile's columns past the head dim read as copies of its first ones, not masked (off: slower)
        PAD_WRAP=bool(cfg.get("PAD_WRAP")) and case.head_dim < head_tile(case.head_dim),
        # decode's split size from the call's lengths (wave_plan): the shortest split it may choose, as a power of
        # two's exponent; 0 off
        WAVE_PLAN=wave_min_chunk(cfg, on_gpu).bit_length() - 1 if cfg.get("WAVE_PLAN") and case.decode else 0)
    options = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    # a register cap: more resident programs per SM at the price of spills; not on two tiles (fp8's loop then needs
    # 142 registers uncapped and spills under 168: sm_90 SASS)
    if cfg["maxnreg"] and on_gpu and not constexprs["DIM_B"]:
        options["maxnreg"] = cfg["maxnreg"]
    return constexprs, options
