"""Device helpers shared by the Triton kernels: KV-format decoding, how a query block's KV range is cut into
splits, and finding a program's sequence. Written against Triton 3.6 (no newer APIs).

Every function here is @triton.jit and is inlined into the kernels that call it, so the split plan used by the
attention kernel and by the merge kernel comes from the same code and cannot drift apart.
"""
from __future__ import annotations

import os

import triton
import triton.language as tl

from ... import errors
from ...formats import FORMATS

# Globals a kernel reads must be tl.constexpr: Triton 3.6 refuses plain Python globals in compiled kernels (its
# interpreter accepts them, so only the GPU catches this).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)  # base-2 logs (the kernels' softmax) to natural ones
# WAVE_PLAN's estimate of a split's fixed costs, in keys a program reads (wave_chunk): fitted to the H100's timings of
# every split size on uniform and ragged batches (docs/bench.md)
WAVE_PROGRAM_KEYS = tl.constexpr(512)

# The interpreter (TRITON_INTERPRET=1, read by Triton at import as here): its fp8 decode has no NaN or Inf (e4m3's
# 0x7F reads as 480, e5m2's exponent 31 as a number), where the GPU's conversion has them; fp8_decoded restores
# them there, and is nothing on the GPU.
INTERPRETER = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"))

# Entries of the device error buffer (attnops.errors) the kernels record bad indices in.
ERR_BLOCK_TABLE, ERR_SEQ_LENS = tl.constexpr(errors.BLOCK_TABLE), tl.constexpr(errors.SEQ_LENS)
ERR_CU_SEQLENS_Q, ERR_SLOT_MAPPING = tl.constexpr(errors.CU_SEQLENS_Q), tl.constexpr(errors.SLOT_MAPPING)
ERR_TOPK_INDICES = tl.constexpr(errors.TOPK_INDICES)

# Format codes (constexpr in the kernels). Plain formats share one code: the load converts to the dot dtype.
FMT_PLAIN, FMT_FP8, FMT_NVFP4, FMT_MXFP4 = (tl.constexpr(code) for code in range(4))
# The code each format passes as the kernels' FMT argument (plain ints on the host): attnops.formats defines it.
FMT_CODE = {name: f.kernel_code for name, f in FORMATS.items()}


@triton.jit
def fp8_decoded(bits, value, FP8_DTYPE: tl.constexpr):
    """`value`, decoded from the fp8 byte in the low 8 bits of the integer lane `bits`: on the GPU as it is; under
    the interpreter (INTERPRETER) with e4m3's NaN, and e5m2 read as fp16's top byte (exact for every byte)."""
    if INTERPRETER:
        if FP8_DTYPE == tl.float8e4nv:
            value = tl.where((bits & 0x7F) == 0x7F, float("nan"), value)
        else:
            value = ((bits & 0xFF).to(tl.uint16) << 8).to(tl.float16, bitcast=True).to(value.dtype)
    return value


@triton.jit
def e8m0_to_f32(s):
    """mxfp4 e8m0 block scales (uint8 s) -> 2^(s-127) as float32, built from the exponent bits (exact; s = 0 is
    the subnormal 2^-127)."""
    si = s.to(tl.int32)
    normal = (si << 23).to(tl.float32, bitcast=True)
    return tl.where(si == 0, 5.877471754111438e-39, normal)


@triton.jit
def kv_plan(seq_len, q_len, q_block, window_left, MAX_SPLITS, CHUNK,
            BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_TREE: tl.constexpr,
            ALIGN: tl.constexpr):
    """The KV positions the query block `q_block` of a sequence (KV length seq_len, q_len queries at its end)
    needs, and how they are cut into splits.

    Returns (first_pos, last_pos, kv_lo, kv_hi, n_splits, split_len):
    - first_pos/last_pos: positions of the block's first and last query;
    - [kv_lo, kv_hi): the keys any of them sees (with a tree mask, up to the sequence's end: a row may see block
      keys after its own position); kv_lo rounded down to an ALIGN multiple, ALIGN a BLOCK_N
      multiple, or the page size where pages are smaller than a tile, so that tiles stay aligned to pages (a page
      of >= BLOCK_N tokens is never straddled) and, with the page size, every page read holds a key some query
      sees (the bounds checks rely on it); keys before the window are skipped here, not masked after reading;
    - n_splits (>= 1) programs share the range, each split_len keys (a BLOCK_N multiple). The number of splits
      is decided here, on the device, from the data: ceil(range / CHUNK) capped at MAX_SPLITS, so long
      sequences get more splits than short ones and every program does about CHUNK keys of work."""
    first_pos = seq_len - q_len + q_block * BLOCK_Q
    last_pos = tl.minimum(first_pos + BLOCK_Q, seq_len) - 1
    if HAS_TREE:
        kv_hi = tl.maximum(seq_len, 0)
    else:
        kv_hi = tl.maximum(last_pos + 1, 0)
    kv_lo = 0
    if HAS_WINDOW:
        kv_lo = tl.maximum(first_pos - window_left, 0)
    kv_lo = (kv_lo // ALIGN) * ALIGN
    kv_lo = tl.minimum(kv_lo, kv_hi)
    length = kv_hi - kv_lo
    n_splits = tl.minimum(tl.maximum(tl.cdiv(length, CHUNK), 1), MAX_SPLITS)
    split_len = tl.cdiv(tl.cdiv(length, n_splits), BLOCK_N) * BLOCK_N
    return first_pos, last_pos, kv_lo, kv_hi, n_splits, split_len


@triton.jit
def wave_chunk(seq_lens_ptr, num_seqs, capacity, wave_splits, LOG_MIN_CHUNK: tl.constexpr,
               PROGRAM_KEYS: tl.constexpr):
    """Keys a split of a decode call chosen from its lengths (WAVE_PLAN), on the device, so inside a CUDA graph too:
    of MIN_CHUNK = 2^LOG_MIN_CHUNK, 2 MIN_CHUNK, 4 MIN_CHUNK, ..., the one of least estimated time, in keys one
    program reads: the longest split (min(chunk, the longest sequence)) where all splits (the sum over sequences of
    ceil(length / chunk)) fit one wave of `wave_splits` (the programs a wave holds over the KV heads), else the keys
    a wave's program reads on average plus that longest split (the last one started), plus PROGRAM_KEYS for each
    wave's worth of programs (a split's fixed costs: its query load, epilogue, partial and merge); the first of equal
    estimates. So a uniform batch is not cut into a wave and a bit, and a ragged batch's long sequence is cut into
    splits short enough not to run alone at the end. Every program of the attention and merge kernels works it out
    from the same lengths, so their plans agree. Lengths outside [0, capacity] count as 0, as the kernels read
    them."""
    NC: tl.constexpr = 16  # candidates MIN_CHUNK << 0..15
    BLOCK_B: tl.constexpr = 64
    shifts = LOG_MIN_CHUNK + tl.arange(0, NC)
    cands = 1 << shifts
    # per candidate: the splits, the keys (the same sum for every candidate: kept per candidate, as the splits are,
    # which compiles to fewer registers than a scalar sum beside them), the sequences longer than the candidate
    splits = tl.zeros([NC], tl.int32)
    total = tl.zeros([NC], tl.int32)  # (exact: the lengths are at most the table's capacity)
    longer = tl.zeros([NC], tl.int32)
    for b0 in range(0, num_seqs, BLOCK_B):
        offs = b0 + tl.arange(0, BLOCK_B)
        lens = tl.load(seq_lens_ptr + offs, mask=offs < num_seqs, other=0)
        lens = tl.where((lens < 0) | (lens > capacity), 0, lens)[:, None]
        splits += tl.sum((lens + (cands[None, :] - 1)) >> shifts[None, :], 0)  # ceil(length / candidate)
        total += tl.sum(lens + 0 * cands[None, :], 0)
        longer += tl.sum((lens > cands[None, :]).to(tl.int32), 0)
    # the longest split: the candidate itself, or for candidates past the longest sequence the first of those
    # (less than twice that sequence: one split each, so all of them estimate the same)
    last = tl.minimum(cands, tl.min(tl.where(longer == 0, cands, 2147483647), 0))
    # the estimate times wave_splits, in int64: exact, so that the attention and merge kernels (compiled apart, each
    # free to fuse float operations its own way) cannot choose differently
    last = last.to(tl.int64) * wave_splits
    keys = tl.where(splits <= wave_splits, last, total.to(tl.int64) + last) + PROGRAM_KEYS * splits.to(tl.int64)
    return tl.min(tl.where(keys == tl.min(keys, 0), cands, 2147483647), 0)


@triton.jit
def find_sequence(cu_ptr, target, num_seqs, BLOCK_Q: tl.constexpr, BY_BLOCKS: tl.constexpr):
    """The last b in [0, num_seqs) with start(b) <= target (binary search; start is non-decreasing), where
    start(b) = cu[b] (token index) or, BY_BLOCKS, cu[b] // BLOCK_Q + b (index of b's first query block in the
    grid, which is sized T // BLOCK_Q + B, an upper bound of the total number of blocks, with no host sync)."""
    lo = tl.full([], 0, tl.int32)  # tensors, not Python ints: they are loop-carried and returned
    hi = tl.full([], 0, tl.int32) + num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(cu_ptr + mid)
        if BY_BLOCKS:
            start = start // BLOCK_Q + mid
        if start <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def cu_seqlens_violation(cu_ptr, num_seqs, num_tokens, BLOCK: tl.constexpr):
    """The first entry i of cu_seqlens_q ([num_seqs + 1]) at which it stops running non-decreasing from 0 to
    num_tokens (cu[0] != 0, cu[i] < cu[i-1], cu[i] > num_tokens, or cu[num_seqs] != num_tokens), or num_seqs + 1
    if it does not. Every program of a multi-token launch asks: num_seqs + 1 loads, once, before its loop."""
    first = tl.full([], 0, tl.int32) + num_seqs + 1  # a tensor: loop-carried
    for i0 in range(0, num_seqs + 1, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        valid = i <= num_seqs
        cur = tl.load(cu_ptr + i, mask=valid, other=0)
        prev = tl.load(cu_ptr + i - 1, mask=valid & (i > 0), other=0)
        bad = (cur < prev) | (cur > num_tokens) | ((i == 0) & (cur != 0)) | ((i == num_seqs) & (cur != num_tokens))
        first = tl.minimum(first, tl.min(tl.where(valid & bad, i, num_seqs + 1), 0))
    return first


def _bad_page_vote_asm(per_lane: int) -> str:
    """PTX: lane l of each warp reads page indices first + l + 32 i (i < per_lane) below `last` from the table row,
    and the warp votes whether any lies outside [0, num_pages): the same answer in every warp, with no shared
    memory and no barrier. $1: the row's address, $2: first, $3: last, $4: num_pages."""
    loads = "".join(f"""
        add.s32 %i, %i0, {32 * k};
        setp.lt.s32 %in, %i, $3;
        mul.wide.s32 %off, %i, 4;
        add.s64 %a, $1, %off;
        @%in ld.global.nc.u32 %pg, [%a];
        setp.ge.and.u32 %b, %pg, $4, %in;
        or.pred %any, %any, %b;""" for k in range(per_lane))
    return """{
        .reg .pred %in, %b, %any, %all;
        .reg .u32 %lane, %pg;
        .reg .s32 %i0, %i;
        .reg .s64 %off, %a;
        mov.u32 %lane, %laneid;
        add.s32 %i0, $2, %lane;
        setp.ne.u32 %any, 0, 0;""" + loads + """
        vote.sync.any.pred %all, %any, 0xffffffff;
        selp.s32 $0, 1, 0, %all;
        }"""


BAD_PAGE_VOTE = tl.constexpr(_bad_page_vote_asm(4))


@triton.jit
def check_pages(bt_row, lo, hi, num_pages, PAGE: tl.constexpr, ASM: tl.constexpr):
    """Whether a page index of the keys [lo, hi) (block table row bt_row, contiguous) lies outside [0, num_pages):
    int32 0 or 1, the same in every thread. One pass over the pages before a loop reads them, so that the loop
    needs no check of its own. ASM (GPU): each warp reads all of them and votes (BAD_PAGE_VOTE): no shared memory
    and no barrier, which a reduction across warps would take, and which cost the decode loop registers (sm_90,
    Triton 3.6: 168 -> 180-190 a thread, one program an SM fewer). Otherwise a vector load and its max."""
    first = lo // PAGE
    last = tl.where(hi > lo, (hi + PAGE - 1) // PAGE, first)  # pages [first, last)
    bad = tl.full([], 0, tl.int32)  # a tensor, not a Python int: loop-carried and returned
    if ASM:
        row = bt_row.to(tl.int64, bitcast=True)
        for p0 in tl.range(first, last, 128, num_stages=1):
            bad = bad | tl.inline_asm_elementwise(BAD_PAGE_VOTE, "=r,l,r,r,r", [row, p0, last, num_pages],
                                                  tl.int32, True, 1)
    else:
        for p0 in tl.range(first, last, 128, num_stages=1):
            p = p0 + tl.arange(0, 128)
            page = tl.load(bt_row + p, mask=p < last, other=0)
            # (a negative index is a huge unsigned one)
            bad = bad | tl.max((page.to(tl.uint32, bitcast=True) >= num_pages.to(tl.uint32)).to(tl.int32), 0)
    return bad


@triton.jit
def bad_page_rows(bt_row, lo, hi, num_pages, q_pos, q_hi, window_left, PAGE: tl.constexpr,
                  HAS_WINDOW: tl.constexpr):
    """For a split [lo, hi) known to hold a bad page: which rows (query positions q_pos, seeing keys up to q_hi)
    see a key of one, and a good page of the split to read in place of the bad ones (-1: none). A scalar walk over
    the pages: taken only then."""
    row_bad = q_pos != q_pos  # all false (and a tensor, loop-carried)
    good = tl.full([], -1, tl.int32)
    for p in tl.range(lo // PAGE, (hi + PAGE - 1) // PAGE, num_stages=1):
        page = tl.load(bt_row + p)
        if page.to(tl.uint32, bitcast=True) < num_pages.to(tl.uint32):
            good = page
        else:
            # the page's keys [p * PAGE, (p + 1) * PAGE); a row sees [q_pos - window_left, q_hi]
            sees = q_hi >= p * PAGE
            if HAS_WINDOW:
                sees = sees & (q_pos - window_left < (p + 1) * PAGE)
            row_bad = row_bad | sees
    return row_bad, good


@triton.jit
def f32_to_fp8_bits(x, MANT: tl.constexpr, BIAS: tl.constexpr):
    """fp32 (finite, already saturated to the format's max) -> fp8 bits (uint8), rounding to nearest even, in
    integer arithmetic. MANT/BIAS: 3/7 for e4m3fn, 2/15 for e5m2.

    Used instead of Triton's conversion under the interpreter (TRITON_INTERPRET=1), whose fp32 -> fp8 rounding
    drops the carry into the exponent (1.96 -> 1.0 instead of 2.0); on the GPU the hardware conversion
    (cvt.rn.satfinite) is used. Both are tested bit-exact against torch's conversion."""
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    # normal result: round the 23-bit mantissa to MANT bits (the carry runs into the exponent), then rebias
    SHIFT: tl.constexpr = 23 - MANT
    rounded = (mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT
    normal = rounded - ((127 - BIAS) << MANT)
    # subnormal result (|x| < 2^(1-BIAS)): |x| in units of the smallest subnormal, rounded to an integer, ties to
    # even (adding and subtracting 2^23 in fp32 does exactly that for values below 2^23)
    units = tl.minimum(tl.abs(x), 2.0 ** (1 - BIAS)) * (2.0 ** (BIAS - 1 + MANT))  # clamped: no int overflow
    sub = ((units + 8388608.0) - 8388608.0).to(tl.int32)
    is_sub = mag < ((128 - BIAS) << 23)  # below 2^(1-BIAS), the smallest normal
    return (tl.where(is_sub, sub, normal) | sign).to(tl.uint8)


@triton.jit
def to_fp8_bits(x, FP8_DTYPE: tl.constexpr, SOFT_FP8: tl.constexpr):
    """fp32 (finite values saturated to the format's max, or NaN) -> fp8 bits (uint8), round to nearest even: the
    hardware conversion, or integer code under the interpreter (see f32_to_fp8_bits). A NaN is stored as torch
    stores it in both formats, 0x7F with x's sign bit (the hardware's own NaN need not carry the sign)."""
    if SOFT_FP8:
        if FP8_DTYPE == tl.float8e4nv:
            bits = f32_to_fp8_bits(x, 3, 7)
        else:
            bits = f32_to_fp8_bits(x, 2, 15)
    else:
        bits = x.to(FP8_DTYPE).to(tl.uint8, bitcast=True)
    nan_bits = (((x.to(tl.int32, bitcast=True) >> 24) & 0x80) | 0x7F).to(tl.uint8)
    return tl.where(x != x, nan_bits, bits)


def _e2m1x4_asm(high: bool, mantissa_shift: int) -> str:
    """PTX that turns four packed bytes' low (or high) nibbles into four 16-bit floats: each byte goes to a 16-bit
    lane (prmt), then, two lanes at once, the nibble's magnitude bits move to the float's lowest exponent bits and
    top mantissa bit (bits 9..11 of fp16: mantissa_shift 9; bits 6..8 of bf16: 6) and its sign to bit 15."""
    mag, sign = ("0x00700070", "0x00800080") if high else ("0x00070007", "0x00080008")
    shift_mag, shift_sign = (mantissa_shift - 4, 8) if high else (mantissa_shift, 12)
    lanes = [f"""
        and.b32 u{i}, t{i}, {mag};
        shl.b32 u{i}, u{i}, {shift_mag};
        and.b32 t{i}, t{i}, {sign};
        shl.b32 t{i}, t{i}, {shift_sign};
        or.b32 ${i}, u{i}, t{i};""" for i in (0, 1)]
    return """{
        .reg .b32 t0, t1, u0, u1;
        prmt.b32 t0, $2, 0, 0x4140;
        prmt.b32 t1, $2, 0, 0x4342;""" + "".join(lanes) + "\n        }"


# constexpr globals: Triton passes a module-level tl.constexpr string into inline asm as it is
E2M1X4_F16_LOW, E2M1X4_F16_HIGH = tl.constexpr(_e2m1x4_asm(False, 9)), tl.constexpr(_e2m1x4_asm(True, 9))
E2M1X4_BF16_LOW, E2M1X4_BF16_HIGH = tl.constexpr(_e2m1x4_asm(False, 6)), tl.constexpr(_e2m1x4_asm(True, 6))


@triton.jit
def e2m1_nibbles(packed, BF16: tl.constexpr, ASM: tl.constexpr):
    """The low (even element) and high (odd element) nibbles of uint8 `packed`, e2m1 codes (sign bit 3, magnitude
    bits 0-2), as 16-bit floats times a power of two, exactly, by bit moves only (no table, no arithmetic): the
    magnitude bits become the float's lowest exponent bits and top mantissa bit, the sign its bit 15. fp16: value
    x 2^-14 (bits 9..11); BF16: value x 2^-126 (bits 6..8). e2m1's subnormal 0.5 lands on a float subnormal,
    which both keep. ASM (GPU only: the interpreter cannot run PTX): four bytes a 32-bit register, two 16-bit
    lanes at once, about 3 instructions a value instead of 6; checked by tests/test_triton.py on the GPU."""
    if ASM:
        # pack=4: bytes 0..3 of the input register are elements 0..3; outputs: elements 0,1 in $0, 2,3 in $1
        # (the PTX is named by a module-level constexpr in each call: Triton takes a string held in a local
        # variable for a value, not a constant)
        if BF16:
            even = tl.inline_asm_elementwise(E2M1X4_BF16_LOW, "=r,=r,r", [packed], tl.int16, True, 4)
            odd = tl.inline_asm_elementwise(E2M1X4_BF16_HIGH, "=r,=r,r", [packed], tl.int16, True, 4)
        else:
            even = tl.inline_asm_elementwise(E2M1X4_F16_LOW, "=r,=r,r", [packed], tl.int16, True, 4)
            odd = tl.inline_asm_elementwise(E2M1X4_F16_HIGH, "=r,=r,r", [packed], tl.int16, True, 4)
    else:
        SHIFT: tl.constexpr = 6 if BF16 else 9
        c = packed.to(tl.int16)
        even = ((c & 7) << SHIFT) | ((c & 8) << 12)
        odd = (((c >> 4) & 7) << SHIFT) | (((c >> 4) & 8) << 12)
    # (one return: Triton 3.6 refuses returns of different dtypes in constexpr branches)
    if BF16:
        even_f, odd_f = even.to(tl.bfloat16, bitcast=True), odd.to(tl.bfloat16, bitcast=True)
    else:
        even_f, odd_f = even.to(tl.float16, bitcast=True), odd.to(tl.float16, bitcast=True)
    return even_f, odd_f


@triton.jit
def opaque_one(x):
    """1.0 (fp32) from inline PTX, which Triton's layout passes cannot see through (ptxas folds a multiply by it
    away); `x` is any scalar, only there because inline asm needs an argument. GPU only."""
    return tl.inline_asm_elementwise(asm="mov.b32 $0, 0x3F800000;", constraints="=r,r", args=[x], dtype=tl.float32,
                                     is_pure=True, pack=1)


def _fp8_pair_asm(odd: bool, e4m3: bool) -> str:
    """PTX for two 16-bit words (two fp8 elements each, in one 32-bit register) -> their even (low byte) or odd
    (high byte) elements as two fp16: a byte permute gathers the two bytes, then e4m3 takes the packed conversion
    and e5m2, fp16's top byte, is placed as it is (low bytes zero)."""
    if e4m3:
        select = "0x3031" if odd else "0x2020"  # bytes 1,3 (or 0,2) into the low half
        return f"""{{
        .reg .b32 t;
        .reg .b16 lo, hi;
        prmt.b32 t, $1, 0, {select};
        mov.b32 {{lo, hi}}, t;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        }}"""
    select = "0x3414" if odd else "0x2404"  # each byte to the top of its 16-bit half, zero below
    return f"prmt.b32 $0, $1, 0, {select};"


FP8_PAIR_E4M3_EVEN = tl.constexpr(_fp8_pair_asm(False, True))
FP8_PAIR_E4M3_ODD = tl.constexpr(_fp8_pair_asm(True, True))
FP8_PAIR_E5M2_EVEN = tl.constexpr(_fp8_pair_asm(False, False))
FP8_PAIR_E5M2_ODD = tl.constexpr(_fp8_pair_asm(True, False))
