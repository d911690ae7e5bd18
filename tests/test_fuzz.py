"""Seeded fuzzing of both ops on every backend available: random valid cases plus random corruptions, each
checked against docs/design.md's rules ("Bad indices", "Special values").

Each case draws a paged-attention call and a cache write (shapes, format, lengths, windows, soft cap, the page
table in random order with garbage past each sequence's pages), then corrupts them at random:
- an index out of range or negative: a page index inside a sequence's length (-1, below -1, num_pages, 2^31 - 1),
  a length past the table's capacity or negative, cu_seqlens_q out of order or past the rows, a slot below -1 or
  past the cache;
- NaN or Inf in a float input: a query, a key, a value (in the cache; for fp8 its NaN/Inf bytes, for nvfp4 a NaN
  block scale), an fp8 scale (NaN), a new key or value to write.
Checked, for each call:
- no crash, and nothing read or written outside a tensor: every tensor lies inside a larger buffer filled with a
  sentinel (NaN bytes around float tensors, 0x7F around index tensors: a stray read shows up as a NaN or as a bad
  index that was not there), and the bytes around each must be untouched; inputs are unchanged;
- the documented result, per (row, head), from an oracle written from the rules here (not from a backend): NaN
  where it must be (a row that sees a bad page's key, a row of a bad length, every row of a bad cu_seqlens_q, a row
  that reads a NaN), exactly 0 for a row that sees no key, else the float64 reference on the same data, within
  the dtype's tolerance (rows that read an Inf, and rows beside a NaN value in a kernel tile, are not compared);
- the cache after a write: bit for bit what attnops.formats gives (NaN payloads aside for plain formats), slots
  -1 and bad slots untouched;
- attnops.take_errors(): exactly the arguments (and first positions) the oracle found bad;
- with ATTNOPS_CHECK=1 (a quarter of the corrupted cases): a ValueError naming the argument before anything runs,
  and nothing written.

CPU (CI): reference, cpu and triton (under TRITON_INTERPRET=1: fp16/fp32 q, fp16/fp32/fp8/4-bit caches) at a
CPU-sized count. GPU (marked gpu): triton, flashinfer (the configurations `python -m attnops warmup` builds: bf16 q,
bf16 and fp8 per-tensor caches, head dims 64 and 128, no window or soft cap) and auto dispatch, over a fixed set of
shape families so that Triton and FlashInfer compile each once.

Environment: ATTNOPS_FUZZ_CASES (cases per backend, default CPU-sized), ATTNOPS_FUZZ_SEED (default 20),
ATTNOPS_FUZZ_GUARD=0 (each tensor its own allocation, for compute-sanitizer), ATTNOPS_FUZZ_ONLY=backend:index (one
case). A failure prints its backend, index and case, and the variable that reruns it alone.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random

import pytest
import torch

import attnops
from attnops import formats
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference
from attnops.testing import random_paged_inputs

CUDA = torch.cuda.is_available()
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
SEED = int(os.environ.get("ATTNOPS_FUZZ_SEED", "20"))
GUARDS = os.environ.get("ATTNOPS_FUZZ_GUARD", "1") != "0"
ONLY = os.environ.get("ATTNOPS_FUZZ_ONLY")
# cases per backend by default: CPU-sized where the CI runs them (the Triton interpreter takes about half a second a
# call), 1000 where a GPU does
DEFAULT_CASES = {"reference": 200, "cpu": 300, "triton": 1000 if CUDA else 120, "flashinfer": 1000, "auto": 1000,
                 "cuda": 1000}
CHUNK = 20  # cases a test item runs
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 3e-2}
BAD_PAGES = (-1, -2, -(2 ** 31), None, 2 ** 31 - 1)  # None: num_pages (one past the last)
FLOAT_SENTINEL, INDEX_SENTINEL = 0xFF, 0x7F

gpu = pytest.mark.gpu
# the interpreter's numpy warns about the NaN and Inf arithmetic the cases are made of
pytestmark = pytest.mark.filterwarnings(
    "ignore:(invalid value|overflow|divide by zero) encountered|All-NaN slice:RuntimeWarning")


def case_count(backend: str) -> int:
    value = os.environ.get("ATTNOPS_FUZZ_CASES")
    return int(value) if value else DEFAULT_CASES[backend]


# ----------------------------------------------------------------------------------------------------------------
# Cases


@dataclasses.dataclass
class Case:
    backend: str
    index: int
    device: str
    mode: str  # decode, verify, extend
    kv_format: str
    scale_kind: str
    q_dtype: torch.dtype
    src_dtype: torch.dtype  # new keys/values of the cache write
    head_dim: int
    num_q_heads: int
    num_kv_heads: int
    page_size: int
    kv_lens: list
    q_lens: list | None
    window_left: int
    soft_cap: float
    fused: bool  # K and V as views of one [pages, 2, ...] tensor
    spare_pages: int
    table_padding: int
    corruptions: list = dataclasses.field(default_factory=list)  # attention: (kind, details...)
    write_corruptions: list = dataclasses.field(default_factory=list)
    checked: bool = False  # run under ATTNOPS_CHECK=1

    def describe(self) -> str:
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        for name in ("q_dtype", "src_dtype"):
            fields[name] = str(fields[name]).replace("torch.", "")
        return ", ".join(f"{k}={v}" for k, v in fields.items())


# Shape families on the GPU: (mode, kv_format, scale_kind, head_dim, heads, page_size, window, soft_cap, q per seq),
# so that each compiles once. (bf16 q everywhere on the GPU but fp32 families for Triton.)
TRITON_GPU_FAMILIES = [
    ("decode", "bf16", "per_tensor", 128, (8, 2), 16, False, False, 1),
    ("decode", "fp8_e4m3", "per_tensor", 128, (8, 2), 16, False, False, 1),
    ("decode", "fp8_e4m3", "per_head", 64, (4, 4), 1, True, False, 1),
    ("decode", "nvfp4", "per_tensor", 128, (8, 2), 64, False, True, 1),
    ("decode", "mxfp4", "per_tensor", 128, (8, 1), 16, True, False, 1),
    ("decode", "fp16", "per_tensor", 64, (4, 2), 256, False, False, 1),
    ("verify", "bf16", "per_tensor", 128, (8, 2), 16, False, False, 4),
    ("verify", "fp8_e5m2", "per_head", 128, (8, 2), 16, True, False, 4),
    ("verify", "nvfp4", "per_tensor", 64, (4, 1), 16, False, False, 4),
    ("extend", "bf16", "per_tensor", 128, (8, 2), 16, True, True, 32),
    ("extend", "fp8_e4m3", "per_tensor", 64, (4, 2), 4, False, False, 16),
    ("extend", "mxfp4", "per_tensor", 128, (8, 2), 16, False, False, 32),
    ("decode", "fp32", "per_tensor", 64, (4, 2), 16, True, True, 1),  # fp32 q
    # head dims between powers of two: decode in two tiles (160, 192), verify in a padded one (96)
    ("decode", "bf16", "per_tensor", 160, (8, 2), 16, False, False, 1),
    ("decode", "fp8_e4m3", "per_head", 192, (4, 2), 16, True, False, 1),
    ("decode", "nvfp4", "per_tensor", 160, (8, 2), 16, False, True, 1),
    ("verify", "bf16", "per_tensor", 96, (8, 2), 16, False, False, 4),
    # wide heads' decode tiles: 512's 32 keys in 8 warps (bf16, fp8 with a window), fp8 at 256 under 128 registers
    ("decode", "bf16", "per_tensor", 512, (8, 2), 16, False, False, 1),
    ("decode", "fp8_e4m3", "per_head", 512, (4, 1), 16, True, True, 1),
    ("decode", "fp8_e4m3", "per_tensor", 256, (8, 4), 16, False, False, 1),
    # head dim 256 with a 16-bit cache: decode in 64-key tiles of 8 warps, 64-row query tiles in 4 warps
    ("decode", "bf16", "per_tensor", 256, (8, 2), 16, True, True, 1),
    ("extend", "bf16", "per_tensor", 256, (4, 1), 16, False, False, 32),
]
FLASHINFER_FAMILIES = [
    ("decode", "bf16", "per_tensor", 128, (8, 2), 16, False, False, 1),
    ("decode", "fp8_e4m3", "per_tensor", 128, (8, 2), 16, False, False, 1),
    ("decode", "bf16", "per_tensor", 64, (8, 2), 1, False, False, 1),
    ("verify", "bf16", "per_tensor", 128, (8, 2), 16, False, False, 4),
    ("verify", "fp8_e4m3", "per_tensor", 128, (8, 2), 16, False, False, 4),
    ("extend", "bf16", "per_tensor", 128, (8, 2), 16, False, False, 32),
    ("extend", "fp8_e4m3", "per_tensor", 64, (4, 2), 16, False, False, 32),
]
AUTO_FAMILIES = FLASHINFER_FAMILIES + [
    ("decode", "fp8_e4m3", "per_head", 128, (8, 2), 16, False, False, 1),
    ("decode", "nvfp4", "per_tensor", 128, (8, 2), 16, False, False, 1),
    ("verify", "mxfp4", "per_tensor", 128, (8, 2), 16, False, False, 4),
]
CUDA_FAMILIES = [  # what the CUDA kernels serve: 4-bit decode and verify, windows, soft cap
    ("decode", "nvfp4", "per_tensor", 128, (8, 2), 16, False, False, 1),
    ("decode", "nvfp4", "per_tensor", 64, (16, 1), 1, True, False, 1),
    ("decode", "mxfp4", "per_tensor", 128, (4, 4), 256, False, True, 1),
    ("verify", "nvfp4", "per_tensor", 128, (8, 2), 16, True, True, 4),
    ("verify", "mxfp4", "per_tensor", 128, (4, 1), 32, True, False, 2),
    ("verify", "nvfp4", "per_tensor", 64, (8, 1), 8, False, False, 3),
    ("decode", "nvfp4", "per_tensor", 256, (8, 4), 16, True, False, 1),
    ("verify", "mxfp4", "per_tensor", 256, (8, 4), 16, False, True, 2),
    ("decode", "mxfp4", "per_tensor", 64, (8, 1), 16, True, True, 1),
    ("verify", "mxfp4", "per_tensor", 64, (16, 2), 4, False, False, 3),
]
GPU_FAMILIES = {"triton": TRITON_GPU_FAMILIES, "flashinfer": FLASHINFER_FAMILIES, "auto": AUTO_FAMILIES,
                "cuda": CUDA_FAMILIES}

# What each CPU-side backend serves: kv formats, q dtypes, head dims
CPU_SIDE = {
    "reference": (formats.KV_FORMATS, (torch.float32, torch.float16, torch.bfloat16), (32, 64)),
    "cpu": (("fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2"), (torch.float32, torch.float16, torch.bfloat16),
            (32, 64)),
    # the interpreter cannot load bf16
    "triton": (("fp32", "fp16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"), (torch.float32, torch.float16),
               (32, 64, 96)),
}


def draw_lengths(rng: random.Random, mode: str, batch: int, q_per_seq: int, max_kv: int):
    """KV lengths and query lengths (None: decode). Multi-token modes use B x q_per_seq query rows in all, so that
    the Triton query block (from T / B) is one per family; every sequence has at least as many keys as queries."""
    if mode == "decode":
        return [rng.choice([0, 1, rng.randint(1, max_kv), rng.randint(1, max_kv)]) for _ in range(batch)], None
    total = batch * q_per_seq
    if mode == "verify":
        q_lens = [q_per_seq] * batch
    else:
        cuts = sorted(rng.randint(0, total) for _ in range(batch - 1))
        q_lens = [b - a for a, b in zip([0] + cuts, cuts + [total])]
    kv_lens = [q + rng.choice([0, rng.randint(0, max_kv), rng.randint(0, max_kv)]) for q in q_lens]
    return kv_lens, q_lens


def make_case(backend: str, index: int) -> Case:
    rng = random.Random(f"{SEED}:{backend}:{index}")
    device = "cuda" if backend in ("flashinfer", "auto", "cuda") or (backend == "triton" and CUDA) else "cpu"
    if device == "cuda":
        family = GPU_FAMILIES[backend][index % len(GPU_FAMILIES[backend])]
        mode, kv_format, scale_kind, head_dim, (hq, hkv), page_size, window, soft_cap, q_per_seq = family
        q_dtype = torch.float32 if kv_format == "fp32" else torch.bfloat16
        src_dtype = torch.bfloat16
        batch, max_kv = rng.randint(1, 6), rng.choice([40, 300, 3000])
    else:
        kv_formats, q_dtypes, head_dims = CPU_SIDE[backend]
        mode = rng.choice(["decode", "decode", "verify", "extend"])
        kv_format = rng.choice(kv_formats)
        scale_kind = rng.choice(["per_tensor", "per_head"])
        q_dtype = rng.choice(q_dtypes)
        src_dtype = rng.choice(q_dtypes)
        head_dim = rng.choice(head_dims)
        hkv = rng.choice([1, 2])
        hq = hkv * rng.choice([1, 2, 4])
        page_size = rng.choice([1, 4, 16])
        window, soft_cap = rng.random() < 0.3, rng.random() < 0.2
        q_per_seq = {"decode": 1, "verify": rng.randint(1, 4), "extend": rng.randint(1, 12)}[mode]
        batch, max_kv = rng.randint(1, 3), 70 if backend == "triton" else 150
    kv_lens, q_lens = draw_lengths(rng, mode, batch, q_per_seq, max_kv)
    return Case(backend, index, device, mode, kv_format, scale_kind, q_dtype, src_dtype, head_dim, hq, hkv,
                page_size, kv_lens, q_lens, window_left=rng.randint(0, 60) if window else -1,
                soft_cap=5.0 if soft_cap else 0.0, fused=rng.random() < 0.5, spare_pages=rng.randint(0, 3),
                table_padding=rng.randint(0, 2))


# ----------------------------------------------------------------------------------------------------------------
# Tensors inside guard regions


class Arena:
    """Allocates each tensor inside a larger buffer of sentinel bytes and checks afterwards that the bytes around
    every one are untouched (a write outside a tensor). With GUARDS off, each tensor is its own allocation."""

    def __init__(self, device):
        self.device = device
        self.buffers = []  # (name, buffer, offset, nbytes, sentinel)

    def place(self, name: str, values: torch.Tensor, guard: int = 256) -> torch.Tensor:
        values = values.to(self.device).contiguous()
        if not GUARDS:
            return values.clone()
        sentinel = INDEX_SENTINEL if not (values.dtype.is_floating_point or values.dtype == torch.uint8) \
            else FLOAT_SENTINEL
        guard = -(-guard // 256) * 256  # keeps the view 256-byte aligned, as an allocation is
        nbytes = values.numel() * values.element_size()
        buffer = torch.full((2 * guard + nbytes,), sentinel, dtype=torch.uint8, device=self.device)
        view = buffer[guard:guard + nbytes].view(values.dtype).view(values.shape)
        view.copy_(values)
        self.buffers.append((name, buffer, guard, nbytes, sentinel))
        return view

    def check(self) -> None:
        for name, buffer, guard, nbytes, sentinel in self.buffers:
            around = torch.cat([buffer[:guard], buffer[guard + nbytes:]])
            touched = (around != sentinel).nonzero().flatten()
            assert touched.numel() == 0, f"{touched.numel()} bytes written around {name}"


# ----------------------------------------------------------------------------------------------------------------
# Inputs


def nan_bytes(fmt: str) -> tuple[int, int]:
    """A stored NaN and a stored Inf (or the largest value where the format has no Inf) for an 8-bit format."""
    return (0x7F, 0x7E) if fmt == "fp8_e4m3" else (0x7F, 0x7C)


def build(case: Case, rng: random.Random) -> dict:
    """The paged_attention arguments (guarded) and what the oracle needs, corrupted as the case draws."""
    dev = case.device
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    fmt = formats.FORMATS[case.kv_format]
    page, hkv, d = case.page_size, case.num_kv_heads, case.head_dim
    pages_needed = [-(-n // page) for n in case.kv_lens]
    num_pages = sum(pages_needed) + case.spare_pages
    width = max(pages_needed + [1]) + case.table_padding
    order = torch.randperm(num_pages, generator=gen)
    # past each sequence's pages: garbage (-1 or any index), never read
    table = torch.where(torch.rand(len(case.kv_lens), width, generator=gen) < 0.5, -1,
                        torch.randint(-5, num_pages + 5, (len(case.kv_lens), width), generator=gen))
    start = 0
    for b, n in enumerate(pages_needed):
        table[b, :n] = order[start:start + n]
        start += n
    stored = fmt.stored_head_dim(d)
    shape = (num_pages, page, hkv, stored)
    if fmt.scale == "block":
        kv = torch.randint(0, 256, (2, *shape), generator=gen, dtype=torch.uint8)
        scale_shape = fmt.block_scale_shape(shape, d)
        if case.kv_format == "nvfp4":
            scales = (torch.rand(2, *scale_shape, generator=gen) * 0.3 + 0.02).to(torch.float8_e4m3fn)
        else:
            scales = torch.randint(122, 126, (2, *scale_shape), generator=gen, dtype=torch.uint8)
    else:
        values = torch.randn(2, *shape, generator=gen)
        scales = None
        if formats.is_fp8(case.kv_format):
            n = hkv if case.scale_kind == "per_head" else 1
            scales = (torch.rand(2, n, generator=gen) * 0.5 + 0.25).reshape((2,) if n == 1 else (2, n))
            kv = torch.stack([formats.quantize_fp8(values[i], scales[i], case.kv_format) for i in (0, 1)])
        else:
            kv = values.to(fmt.storage_dtype)
    if case.q_lens is None:
        cu, num_tokens = None, len(case.kv_lens)
    else:
        cu = torch.zeros(len(case.kv_lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(case.q_lens, dtype=torch.int32), 0)
        num_tokens = int(cu[-1])
    q = (torch.randn(num_tokens, case.num_q_heads, d, generator=gen)).to(case.q_dtype)
    seq_lens = torch.tensor(case.kv_lens, dtype=torch.int32)
    return dict(fmt=fmt, q=q, kv=kv, scales=scales, table=table.to(torch.int32), seq_lens=seq_lens, cu=cu,
                num_pages=num_pages, width=width, num_tokens=num_tokens, gen=gen)


def corrupt_attention(case: Case, inp: dict, rng: random.Random) -> None:
    """Draws the case's attention corruptions and applies them to the host tensors in `inp`."""
    if rng.random() < 0.4:
        return
    kinds = ["page", "page", "seq_len", "q_nan", "k_nan", "v_nan", "k_inf", "v_inf"]
    if case.q_lens is not None:
        kinds += ["cu", "cu"]
    if inp["scales"] is not None and formats.is_fp8(case.kv_format):
        kinds += ["scale_nan"]
    if case.kv_format == "nvfp4":
        kinds += ["block_scale_nan"]
    for kind in rng.sample(kinds, rng.choice([1, 1, 2])):
        table, lens, page = inp["table"], inp["seq_lens"], case.page_size
        used = [(b, j) for b, n in enumerate(case.kv_lens) for j in range(-(-n // page))]
        if kind == "page" and used:
            b, j = rng.choice(used)
            value = rng.choice(BAD_PAGES)
            table[b, j] = inp["num_pages"] if value is None else value
            case.corruptions.append(("page", b, j, int(table[b, j])))
        elif kind == "seq_len":
            b = rng.randrange(len(case.kv_lens))
            lens[b] = rng.choice([inp["width"] * page + rng.randint(1, 3), -rng.randint(1, 5), 2 ** 31 - 1])
            case.corruptions.append(("seq_len", b, int(lens[b])))
        elif kind == "cu":  # always out of order or past the rows (an edit that keeps it valid is no corruption)
            cu, num_tokens = inp["cu"], inp["num_tokens"]
            i = rng.randrange(len(cu))
            if i == len(cu) - 1:
                cu[i] = rng.choice([num_tokens + rng.randint(1, 5), num_tokens - rng.randint(1, 5), -1])
            else:
                cu[i] = rng.choice([int(cu[i + 1]) + rng.randint(1, 5), num_tokens + 7, 2 ** 31 - 1,
                                    -1 if i == 0 or int(cu[i - 1]) >= 0 else num_tokens + 1])
            case.corruptions.append(("cu", i, int(cu[i])))
        elif kind == "q_nan" and inp["num_tokens"]:
            t, h = rng.randrange(inp["num_tokens"]), rng.randrange(case.num_q_heads)
            inp["q"][t, h, rng.randrange(case.head_dim)] = float("nan")
            case.corruptions.append(("q_nan", t, h))
        elif kind in ("k_nan", "v_nan", "k_inf", "v_inf", "block_scale_nan") and inp["num_pages"]:
            which = 0 if kind[0] == "k" else (rng.randrange(2) if kind == "block_scale_nan" else 1)
            if formats.is_fp4(case.kv_format) and kind != "block_scale_nan":
                continue  # e2m1 holds no NaN or Inf: through its block scale instead
            if formats.is_fp4(case.kv_format) or (kind.endswith("inf") and case.kv_format == "fp8_e4m3"):
                if kind != "block_scale_nan":
                    continue  # (e4m3fn has no Inf)
            p, s, h = rng.randrange(inp["num_pages"]), rng.randrange(page), rng.randrange(case.num_kv_heads)
            if used and rng.random() < 0.8:  # mostly where a sequence reads
                b, j = rng.choice(used)
                p, s = int(inp["table"][b, j]) % inp["num_pages"], rng.randrange(page)
            if kind == "block_scale_nan":
                inp["scales"].view(torch.uint8)[which, p, s, h, rng.randrange(inp["scales"].shape[-1])] = 0x7F
            elif formats.is_fp8(case.kv_format):
                nan, inf = nan_bytes(case.kv_format)
                inp["kv"].view(torch.uint8)[which, p, s, h, rng.randrange(case.head_dim)] = \
                    nan if kind.endswith("nan") else inf
            else:
                inp["kv"][which, p, s, h, rng.randrange(case.head_dim)] = \
                    float("nan") if kind.endswith("nan") else rng.choice([float("inf"), -float("inf")])
            case.corruptions.append((kind if kind != "block_scale_nan" else ("k_nan", "v_nan")[which], p, s, h))
        elif kind == "scale_nan":  # k_scale or v_scale, one head's (per head) or the tensor's
            which = rng.randrange(2)
            head = rng.randrange(inp["scales"][which].numel())
            inp["scales"][which].view(-1)[head] = float("nan")
            case.corruptions.append(("scale_nan", which, head if inp["scales"][which].numel() > 1 else None))


# ----------------------------------------------------------------------------------------------------------------
# The oracle: docs/design.md's rules, written out per (row, head)

NAN, ZERO, VALUE, ANY = "nan", "zero", "value", "any"


def cu_violation(starts: list, num_tokens: int):
    for i, s in enumerate(starts):
        if s > num_tokens or (i == 0 and s != 0) or (i and s < starts[i - 1]) or (i == len(starts) - 1
                                                                                 and s != num_tokens):
            return i
    return None


def oracle(case: Case, inp: dict):
    """(status [T][Hq] of NAN/ZERO/VALUE/ANY, flags the call must record, whether ATTNOPS_CHECK=1 must raise)."""
    table, lens, page = inp["table"].tolist(), inp["seq_lens"].tolist(), case.page_size
    num_pages, num_tokens, hq = inp["num_pages"], inp["num_tokens"], case.num_q_heads
    group = hq // case.num_kv_heads
    capacity = inp["width"] * page
    status = [[VALUE] * hq for _ in range(num_tokens)]
    flags: dict = {}
    starts = list(range(len(lens) + 1)) if inp["cu"] is None else inp["cu"].tolist()
    bad_cu = cu_violation(starts, num_tokens) if inp["cu"] is not None else None
    scale_nan = [(c[1], c[2]) for c in case.corruptions if c[0] == "scale_nan"]
    # what ATTNOPS_CHECK=1 rejects: fp8 scales not finite, lengths past the table, any page inside a length
    # outside the cache (seen or not), cu_seqlens_q out of order, more queries than keys
    check_raises = bool(scale_nan) or bad_cu is not None or any(n < 0 or n > capacity for n in lens) or any(
        not 0 <= table[b][j] < num_pages for b, n in enumerate(lens) if 0 <= n <= capacity
        for j in range(-(-n // page))) or any(starts[b + 1] - starts[b] > n for b, n in enumerate(lens))
    if bad_cu is not None:
        return [[NAN] * hq for _ in range(num_tokens)], {"cu_seqlens_q": bad_cu}, check_raises
    # the non-finite values the case put in the cache, by physical (page, slot, kv head)
    special = {}
    # FlashInfer's e4m3 kernels (auto may pick them) read a stored NaN byte as a finite value (docs/design.md)
    nan_read_finite = case.backend in ("flashinfer", "auto") and case.kv_format == "fp8_e4m3"
    for c in case.corruptions:
        if c[0] in ("k_nan", "v_nan", "k_inf", "v_inf"):
            kind = c[0].replace("nan", "inf") if nan_read_finite else c[0]
            special.setdefault((c[1], c[2]), []).append((c[3], kind))
    q_nan = {(c[1], c[2]) for c in case.corruptions if c[0] == "q_nan"}
    for b, n in enumerate(lens):
        rows = range(starts[b], starts[b + 1])
        if not rows:
            continue  # no row: nothing of the sequence is read
        if not 0 <= n <= capacity:
            flags.setdefault("seq_lens", b)
            for t in rows:
                status[t] = [NAN] * hq
            continue
        bad_before = [0]  # bad pages among the first j
        for j in range(-(-n // page)):
            bad_before.append(bad_before[-1] + (not 0 <= table[b][j] < num_pages))
        # the sequence's keys holding a non-finite value: (position, kv head, kind)
        marked = [(j, kvh, kind) for j in range(n) for kvh, kind in special.get((table[b][j // page], j % page), [])]
        value_heads = {kvh for _, kvh, kind in marked if kind in ("v_nan", "v_inf")}
        for i, t in enumerate(rows):
            pos = n - len(rows) + i
            lo = max(0, pos - case.window_left) if case.window_left >= 0 else 0
            if pos < 0:
                status[t] = [ZERO] * hq  # sees no key
                continue
            if bad_before[pos // page + 1] > bad_before[lo // page]:
                flags.setdefault("block_table", b)
                status[t] = [NAN] * hq
                continue
            for h in range(hq):
                kvh = h // group
                kinds = {kind for j, kh, kind in marked if kh == kvh and lo <= j <= pos}
                if (t, h) in q_nan or kinds & {"k_nan", "v_nan"} or any(
                        head in (None, kvh) for _, head in scale_nan):
                    status[t][h] = NAN
                elif kinds or kvh in value_heads:
                    # an Inf read (any value); or a NaN/Inf value it does not read, which meets its zero weight in
                    # a kernel's P @ V tile (0 x NaN: docs/design.md)
                    status[t][h] = ANY
    return status, flags, check_raises


# ----------------------------------------------------------------------------------------------------------------
# Running one case


@contextlib.contextmanager
def values_checked(on: bool):
    old = os.environ.get("ATTNOPS_CHECK")
    if on:
        os.environ["ATTNOPS_CHECK"] = "1"
    try:
        yield
    finally:
        if on:
            if old is None:
                os.environ.pop("ATTNOPS_CHECK", None)
            else:
                os.environ["ATTNOPS_CHECK"] = old


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def pin(backend: str):
    return attnops.use_backend(None if backend == "auto" else backend)


def run_attention(case: Case, rng: random.Random) -> None:
    inp = build(case, rng)
    corrupt_attention(case, inp, rng)
    index_corrupted = any(c[0] in ("page", "seq_len", "cu") for c in case.corruptions)
    case.checked = index_corrupted and rng.random() < 0.25
    arena = Arena(case.device)
    dev_kv = inp["kv"]
    page_bytes = math.prod(dev_kv.shape[2:]) * dev_kv.element_size()  # guards of a page: a page past the end
    if case.fused:
        kv = arena.place("kv cache", dev_kv.transpose(0, 1).contiguous(), guard=2 * page_bytes)
        k_cache, v_cache = kv[:, 0], kv[:, 1]
    else:
        k_cache = arena.place("k_cache", dev_kv[0], guard=page_bytes)
        v_cache = arena.place("v_cache", dev_kv[1], guard=page_bytes)
    args = dict(q=arena.place("q", inp["q"]), k_cache=k_cache, v_cache=v_cache,
                block_table=arena.place("block_table", inp["table"]), seq_lens=arena.place("seq_lens", inp["seq_lens"]),
                cu_seqlens_q=None if inp["cu"] is None else arena.place("cu_seqlens_q", inp["cu"]),
                kv_format=case.kv_format if formats.is_fp4(case.kv_format) else "auto",
                window_left=case.window_left, soft_cap=case.soft_cap)
    if inp["scales"] is not None:
        args.update(k_scale=arena.place("k_scale", inp["scales"][0]), v_scale=arena.place("v_scale", inp["scales"][1]))
    out = arena.place("out", torch.full(inp["q"].shape, float("nan"), dtype=case.q_dtype))
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    status, flags, check_raises = oracle(case, inp)

    attnops.take_errors()
    poisoned = out.clone()
    if case.checked:
        with values_checked(True), pin(case.backend):
            if check_raises:
                names = {"page": "block_table", "seq_len": "seq_lens", "cu": "cu_seqlens_q",
                         "scale_nan": "[kv]_scale"}
                pattern = "|".join(names[c[0]] for c in case.corruptions if c[0] in names)
                with pytest.raises(ValueError, match=rf"attnops\.paged_attention: .*({pattern})"):
                    attnops.paged_attention(**args, out=out)
                assert torch.equal(out.view(torch.uint8), poisoned.view(torch.uint8)), "out written before the error"
                assert attnops.take_errors() == {}
                arena.check()
                return
    with pin(case.backend):
        attnops.paged_attention(**args, out=out)
    got_flags = attnops.take_errors()
    arena.check()
    for name, tensor in before.items():
        assert same_bytes(tensor, args[name]), f"input {name} changed"
    assert got_flags == flags, f"error flags {got_flags}, expected {flags}"

    # values: the float64 reference on the same data, lengths and pages made good (rows compared do not see the
    # corrupted indices, so their values do not depend on them)
    good = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    table = good["block_table"].clone()
    table[(table < 0) | (table >= inp["num_pages"])] = 0
    lens = good["seq_lens"].clone()
    lens[(lens < 0) | (lens > inp["width"] * case.page_size)] = 0
    good.update(block_table=table, seq_lens=lens)
    if not status:
        return
    ref = paged_attention_reference(**good, compute_dtype=torch.float64).double()
    got = out.cpu().double()
    codes = torch.tensor([[{NAN: 0, ZERO: 1, VALUE: 2, ANY: 3}[w] for w in row] for row in status])
    nan_rows = got.isnan().any(-1)
    missing = ((codes == 0) & ~nan_rows).nonzero()
    assert missing.numel() == 0, f"(row, head) {missing[:4].tolist()}: expected NaN, got values"
    nonzero = ((codes == 1) & (got != 0).any(-1)).nonzero()
    assert nonzero.numel() == 0, f"(row, head) {nonzero[:4].tolist()}: expected exactly 0"
    err = (got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp(min=1e-6)
    tolerance = TOLERANCE[case.q_dtype]
    wrong = ((codes == 2) & ~(err < tolerance)).nonzero()  # (NaN fails too)
    assert wrong.numel() == 0, (f"(row, head) {wrong[:4].tolist()}: relative error "
                                f"{[round(err[t, h].item(), 6) for t, h in wrong[:4].tolist()]} >= {tolerance}")


def run_write(case: Case, rng: random.Random) -> None:
    """A cache write of a few tokens, with its own corruptions (bad slots, NaN/Inf in key or value)."""
    gen = torch.Generator().manual_seed(rng.randrange(2 ** 31))
    fmt = formats.FORMATS[case.kv_format]
    num_pages, page, hkv, d = rng.randint(1, 4), case.page_size, case.num_kv_heads, case.head_dim
    num_slots = num_pages * page
    num_tokens = rng.randint(1, min(8, num_slots + 2))
    slots = torch.randperm(num_slots + 2, generator=gen)[:num_tokens] - 1  # -1 (padding) among them, sometimes
    slots[slots >= num_slots] = -1
    key = torch.randn(num_tokens, hkv, d, generator=gen) * 2
    value = torch.randn(num_tokens, hkv, d, generator=gen)
    if rng.random() < 0.5:
        for x in (key, value):
            for _ in range(rng.randint(1, 4)):
                x[rng.randrange(num_tokens), rng.randrange(hkv), rng.randrange(d)] = rng.choice(
                    [float("nan"), float("inf"), -float("inf")])
        case.write_corruptions.append("non-finite values")
    bad_tokens = []
    if rng.random() < 0.4:
        t = rng.randrange(num_tokens)
        slots[t] = rng.choice([-2, -(2 ** 40), num_slots, num_slots + rng.randint(1, 100), 2 ** 40])
        bad_tokens.append(t)
        case.write_corruptions.append(("slot", t, int(slots[t])))
    key, value = key.to(case.src_dtype), value.to(case.src_dtype)
    stored = fmt.stored_head_dim(d)
    kv = torch.randint(0, 256, (2, num_pages, page, hkv, stored * fmt.storage_dtype.itemsize), generator=gen,
                       dtype=torch.uint8).view(fmt.storage_dtype)
    if not (fmt.storage_dtype.itemsize == 1):
        kv = torch.randn(2, num_pages, page, hkv, stored, generator=gen).to(fmt.storage_dtype)
    kwargs = dict(kv_format=case.kv_format if formats.is_fp4(case.kv_format) else "auto")
    block_scales = None
    if formats.is_fp8(case.kv_format):
        n = hkv if case.scale_kind == "per_head" else 1
        scales = (torch.rand(2, n, generator=gen) + 0.05).reshape((2,) if n == 1 else (2, n))
        kwargs.update(k_scale=scales[0], v_scale=scales[1])
    if formats.is_fp4(case.kv_format):
        block_scales = torch.randint(0, 256, (2, num_pages, page, hkv, d // fmt.block), generator=gen,
                                     dtype=torch.uint8).view(fmt.scale_dtype)

    arena = Arena(case.device)
    k_cache = arena.place("k_cache", kv[0], guard=page * hkv * stored * fmt.storage_dtype.itemsize)
    v_cache = arena.place("v_cache", kv[1], guard=page * hkv * stored * fmt.storage_dtype.itemsize)
    if block_scales is not None:
        kwargs.update(k_block_scale=arena.place("k_block_scale", block_scales[0]),
                      v_block_scale=arena.place("v_block_scale", block_scales[1]))
    for name in ("k_scale", "v_scale"):
        if name in kwargs:
            kwargs[name] = arena.place(name, kwargs[name])
    key_d, value_d = arena.place("key", key), arena.place("value", value)
    slots_d = arena.place("slot_mapping", slots)

    # expected: attnops.formats token by token, on the device the backend runs on (a NaN's sign after a division
    # is the device's), bad slots and -1 untouched
    expected = [k_cache.clone(), v_cache.clone()]
    expected_scales = None if block_scales is None else [kwargs["k_block_scale"].clone(),
                                                         kwargs["v_block_scale"].clone()]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0 or slot >= num_slots:
            continue
        for i, (src, scale_name) in enumerate(((key_d, "k_scale"), (value_d, "v_scale"))):
            q, bs = formats.quantize(src[t:t + 1], case.kv_format, kwargs.get(scale_name), fmt.storage_dtype)
            expected[i][slot // page, slot % page] = q[0]
            if bs is not None:
                expected_scales[i][slot // page, slot % page] = bs[0]
    flags = {"slot_mapping": bad_tokens[0]} if bad_tokens else {}

    attnops.take_errors()
    before = [k_cache.clone(), v_cache.clone()]
    if bad_tokens and rng.random() < 0.25:
        with values_checked(True), pin(case.backend), pytest.raises(
                ValueError, match=r"attnops\.reshape_and_cache: .*slot_mapping"):
            attnops.reshape_and_cache(key_d, value_d, k_cache, v_cache, slots_d, **kwargs)
        assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(before, (k_cache, v_cache)))
        arena.check()
        return
    with pin(case.backend):
        attnops.reshape_and_cache(key_d, value_d, k_cache, v_cache, slots_d, **kwargs)
    assert attnops.take_errors() == flags
    arena.check()

    def same(a, b):
        if a.element_size() == 1:
            return a.view(torch.uint8) == b.view(torch.uint8)
        return (a.view(torch.int16 if a.element_size() == 2 else torch.int32) ==
                b.view(torch.int16 if b.element_size() == 2 else torch.int32)) | (a.isnan() & b.isnan())

    for name, got, want in (("k_cache", k_cache, expected[0]), ("v_cache", v_cache, expected[1])):
        wrong = (~same(got, want)).nonzero()
        assert wrong.numel() == 0, f"{name}: {wrong.shape[0]} elements differ from attnops.formats, first {wrong[:3]}"
    if expected_scales is not None:
        for name, want in zip(("k_block_scale", "v_block_scale"), expected_scales):
            wrong = (~same(kwargs[name], want)).nonzero()
            assert wrong.numel() == 0, f"{name}: {wrong.shape[0]} scales differ from attnops.formats"


def run_cases(backend: str, first: int, count: int) -> None:
    if ONLY:
        name, _, index = ONLY.partition(":")
        if name != backend or not first <= int(index) < first + count:
            pytest.skip("ATTNOPS_FUZZ_ONLY selects another case")
        first, count = int(index), 1
    for index in range(first, first + count):
        case = make_case(backend, index)
        rng = random.Random(f"{SEED}:{backend}:{index}:data")
        try:
            run_attention(case, rng)
            run_write(case, rng)
        except Exception as e:
            raise AssertionError(f"fuzz case {backend}:{index} (rerun alone: ATTNOPS_FUZZ_SEED={SEED} "
                                 f"ATTNOPS_FUZZ_ONLY={backend}:{index}) failed: {type(e).__name__}: {e}\n"
                                 f"case: {case.describe()}") from e


def chunks(backend: str, gpu_only: bool = False):
    if gpu_only and not CUDA:  # one item to skip, not one a chunk
        return [pytest.param(backend, 0, 0, id=backend)]
    return [pytest.param(backend, first, min(CHUNK, case_count(backend) - first), id=f"{backend}-{first}")
            for first in range(0, case_count(backend), CHUNK)]


def available(backend: str) -> list[str]:
    return BACKENDS[backend].unavailable() if backend != "auto" else []


@pytest.mark.parametrize("backend,first,count",
                         chunks("reference") + chunks("cpu") + (chunks("triton") if not CUDA else []))
def test_fuzz(backend, first, count):
    if backend == "triton" and not INTERPRETED:
        pytest.skip("Triton runs on the GPU where there is one (test_fuzz_gpu), else under TRITON_INTERPRET=1")
    if available(backend):
        pytest.skip("; ".join(available(backend)))
    run_cases(backend, first, count)


@gpu
@pytest.mark.parametrize("backend,first,count",
                         chunks("triton", True) + chunks("flashinfer", True) + chunks("auto", True)
                         + chunks("cuda", True))
def test_fuzz_gpu(backend, first, count):
    if available(backend):
        pytest.skip("; ".join(available(backend)))
    run_cases(backend, first, count)


def test_the_oracle_catches_a_wrong_backend(monkeypatch):
    """The checks can fail: a backend that ignores a bad page (reads page 0 and records nothing) is caught."""
    from attnops.backends import reference

    original = reference.paged_attention_reference

    def careless(*args, **kwargs):
        args = list(args)
        table = args[3].clone()
        table[(table < 0) | (table >= args[1].shape[0])] = 0
        args[3] = table
        return original(*args, **kwargs)

    monkeypatch.setattr(reference, "paged_attention_reference", careless)
    failures = 0
    for index in range(40):
        case = make_case("reference", index)
        rng = random.Random(f"{SEED}:reference:{index}:data")
        try:
            run_attention(case, rng)
        except AssertionError:
            failures += 1
    assert failures > 0


def test_guard_regions_catch_a_stray_write():
    arena = Arena("cpu")
    view = arena.place("x", torch.zeros(4, 8))
    arena.check()
    torch.as_strided(view, (1,), (1,), view.storage_offset() + view.numel()).fill_(1.0)  # just past its end
    with pytest.raises(AssertionError, match="written around x"):
        arena.check()


def test_the_oracle_follows_the_rules():
    """A few hand-made cases: a window that does not reach a bad page, a bad length, a bad cu_seqlens_q."""
    case = make_case("reference", 0)
    case.q_lens, case.kv_lens, case.page_size, case.window_left = [2, 1], [20, 5], 4, 3
    inp = dict(table=torch.tensor([[0, 1, 9, 2, 3], [4, 5, 6, 7, 8]], dtype=torch.int32),
               seq_lens=torch.tensor([20, 5], dtype=torch.int32), cu=torch.tensor([0, 2, 3], dtype=torch.int32),
               num_pages=9, num_tokens=3, width=5)
    case.corruptions = []
    status, flags, check_raises = oracle(case, inp)
    # page 2 of sequence 0 (keys 8..11) is bad; its queries sit at 18 and 19 and see 15..19: not the bad page
    assert flags == {} and check_raises and all(w == VALUE for row in status for w in row)
    case.window_left = -1
    status, flags, _ = oracle(case, inp)
    assert flags == {"block_table": 0} and status[0][0] == NAN and status[2][0] == VALUE
    inp["seq_lens"][1] = 21
    status, flags, _ = oracle(case, inp)
    assert flags == {"block_table": 0, "seq_lens": 1} and status[2][0] == NAN
    inp["cu"][1] = 4
    status, flags, _ = oracle(case, inp)
    assert flags == {"cu_seqlens_q": 1} and all(w == NAN for row in status for w in row)  # 4 > 3 rows


@gpu
def test_the_error_buffer_records_in_a_captured_graph():
    """A CUDA graph holds the buffer's address: each replay of a captured Triton call records into it, and
    take_errors reads and clears it between replays."""
    args = random_paged_inputs([100, 37, 300], num_q_heads=8, num_kv_heads=2, head_dim=128, kv_format="bf16",
                               q_dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(args["q"])
    with attnops.use_backend("triton"):
        attnops.paged_attention(**args, out=out)  # warm-up: compiles and allocates the buffer
        torch.cuda.synchronize()
        attnops.take_errors()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            attnops.paged_attention(**args, out=out)
    graph.replay()
    assert attnops.take_errors() == {} and not out.isnan().any()
    good = args["block_table"][1, 1].item()
    args["block_table"][1, 1] = -1  # a page sequence 1 (37 tokens) reads
    graph.replay()
    assert out[1].isnan().all() and not out[0].isnan().any() and not out[2].isnan().any()
    assert attnops.take_errors() == {"block_table": 1}
    args["block_table"][1, 1] = good
    graph.replay()
    assert attnops.take_errors() == {} and not out.isnan().any()


def test_the_fuzz_covers_every_backend():
    """The backend registry is the one list: a backend added to attnops.backends.BACKENDS fails here until the fuzz
    has its cases."""
    assert set(DEFAULT_CASES) - {"auto"} == set(BACKENDS)
