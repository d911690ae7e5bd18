"""Where a decode's time goes, by leaving stages out (no hardware counters needed), and what merely reading its
bytes costs: the limit a kernel that reads the cache once is measured against.

    python benchmarks/decode_breakdown.py                          # 1 x 32768 bf16, the Triton decode (GPU)
    python benchmarks/decode_breakdown.py --cases 1x32768 128x4096 --formats bf16 fp8_e4m3 --json breakdown.json
    python benchmarks/decode_breakdown.py --backend cuda --cases 128x4096 64x32768 --formats nvfp4 mxfp4 fp8_e4m3

Per case and format, CUDA-graph medians (ten calls a graph, as `python -m attnops bench` times the op) of:
  op          the backend's decode as the op runs it: Triton's attention kernel and, where the sequence is split,
              its merge kernel (decode.launch); or the `cuda` backend's call (--backend cuda)
  attention   the attention kernel alone (the merge launch left out; its output is then not the answer; Triton)
  merge       op - attention: the merge kernel and the gap before it (Triton)
  read-paged  a plain Triton kernel reading exactly the bytes the decode reads, where they lie: one program a
              (KV head, sequence, split) as the backend plans them, 128 keys a step through the block table, each
              key's K and V rows of its head (and their block-scale rows): what the cache's layout and the
              backend's grid allow with no compute at all
  read        a plain Triton kernel reading the same number of bytes of the cache pool, contiguously, with as many
              programs as the attention kernel: the DRAM read rate this much parallelism reaches
  read-chip   the same with 4 programs an SM: what the bytes cost at full occupancy
  read-best   the fastest plain read of those bytes over 1-16 programs an SM, 4 or 8 warps, 2-8K words a load
              step: no kernel that reads the bytes once can beat it by much
  launch      an empty kernel: the floor of one launch inside a graph
For 1 x 32768 (bar: 1.3x FlashInfer) the op's distance to `read-chip` is what ramp-up, tail and merge cost.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import attnops  # noqa: E402
from attnops import formats  # noqa: E402
from attnops.backends import cuda as cuda_backend  # noqa: E402
from attnops.backends.triton import heuristics as theur, launch as tlaunch  # noqa: E402
from attnops.bench.run import graph_time_us  # noqa: E402
from attnops.cases import AttentionCase  # noqa: E402
from attnops.env import device_arch  # noqa: E402
from attnops.testing import relative_error  # noqa: E402
from triton_tuning import D, DECODE_CASES, HKV, Runner, kv_bytes, make_inputs  # noqa: E402

PAGED_READ_KEYS = 128  # keys a step of the paged read (the cuda kernel's tile; Triton's decode tiles are 64-128)


@triton.jit
def _read_kernel(src_ptr, sink_ptr, n_words, WORDS_PER_PROGRAM, BLOCK: tl.constexpr):
    """Sums WORDS_PER_PROGRAM int32 words from this program's span (so that the loads are not dead code)."""
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * WORDS_PER_PROGRAM
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(0, WORDS_PER_PROGRAM, BLOCK):
        idx = start + i + offs
        acc ^= tl.load(src_ptr + idx, mask=idx < n_words, other=0)
    tl.store(sink_ptr + pid, tl.sum(acc, 0))


@triton.jit
def _paged_read_kernel(k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, seq_lens_ptr, sink_ptr, table_stride, chunk,
                       split_align, page_stride, token_stride, head_stride, s_page_stride, s_token_stride,
                       s_head_stride, PAGE: tl.constexpr, ROW: tl.constexpr, SCALE_ROW: tl.constexpr,
                       HAS_SCALES: tl.constexpr, BY_LENGTH: tl.constexpr, BLOCK_N: tl.constexpr):
    """XORs the bytes of K's and V's rows of KV head program_id(0) for the keys of split program_id(2) of sequence
    program_id(1) (and their scale rows), read through the block table; stores the result (so that no load is dead
    code, and so that a test can check which bytes were read). Strides in bytes. A split is `chunk` keys; with
    BY_LENGTH, as Triton's decode plans it: ceil(n / chunk) splits of a sequence of n keys, at most the grid's,
    sharing its keys in split_align multiples."""
    head, seq, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(seq_lens_ptr + seq)
    split_len = chunk
    if BY_LENGTH:
        n_splits = tl.minimum(tl.cdiv(n, chunk), tl.num_programs(2))
        split_len = tl.cdiv(tl.cdiv(n, tl.maximum(n_splits, 1)), split_align) * split_align
    hi = tl.minimum(n, (split + 1) * split_len)
    keys = tl.arange(0, BLOCK_N)
    cols = tl.arange(0, ROW)
    acc = tl.zeros([BLOCK_N, ROW], dtype=tl.int32)
    s_cols = tl.arange(0, SCALE_ROW)
    s_acc = tl.zeros([BLOCK_N, SCALE_ROW], dtype=tl.int32)
    for start in range(split * split_len, hi, BLOCK_N):
        key = start + keys
        live = key < hi
        page = tl.load(table_ptr + seq.to(tl.int64) * table_stride + key // PAGE, mask=live, other=0).to(tl.int64)
        row = page * page_stride + (key % PAGE) * token_stride + head * head_stride
        offs = row[:, None] + cols[None, :]
        acc ^= tl.load(k_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
        acc ^= tl.load(v_ptr + offs, mask=live[:, None], other=0).to(tl.int32)
        if HAS_SCALES:
            s_row = page * s_page_stride + (key % PAGE) * s_token_stride + head * s_head_stride
            s_offs = s_row[:, None] + s_cols[None, :]
            s_acc ^= tl.load(ks_ptr + s_offs, mask=live[:, None], other=0).to(tl.int32)
            s_acc ^= tl.load(vs_ptr + s_offs, mask=live[:, None], other=0).to(tl.int32)
    pid = (seq * tl.num_programs(0) + head) * tl.num_programs(2) + split
    tl.store(sink_ptr + pid, tl.xor_sum(tl.xor_sum(acc, 1), 0) ^ tl.xor_sum(tl.xor_sum(s_acc, 1), 0))


def paged_read(args: dict, splits: int, chunk: int, split_align: int = 0,
               sink: torch.Tensor | None = None) -> torch.Tensor:
    """Launches _paged_read_kernel over the cache of `args` (random_paged_inputs' keywords), `splits` programs a
    (sequence, KV head) of `chunk` keys each, or with `split_align` as Triton's decode splits (see the kernel);
    returns the sink: one int32 a program, in (sequence, head, split) order."""
    k, v, table, seq_lens = args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"]
    num_pages, page_size, num_heads, _ = k.shape
    k_bytes, v_bytes = k.view(torch.uint8), v.view(torch.uint8)  # (bf16: the last dim's bytes)
    assert k_bytes.stride() == v_bytes.stride() and k_bytes.stride(-1) == 1
    ks, vs = args.get("k_scale"), args.get("v_scale")
    has_scales = ks is not None and ks.dim() == 4  # 4-bit block scales, paged like the cache (fp8's are 1-8 floats)
    if has_scales:
        ks, vs = ks.view(torch.uint8), vs.view(torch.uint8)
        assert ks.stride() == vs.stride() and ks.stride(-1) == 1
        s_strides, scale_row = ks.stride()[:3], ks.shape[-1]
    else:
        ks, vs, s_strides, scale_row = k_bytes, v_bytes, (0, 0, 0), 1
    batch = seq_lens.numel()
    if sink is None:
        sink = torch.empty(batch * num_heads * splits, dtype=torch.int32, device=k.device)
    _paged_read_kernel[(num_heads, batch, splits)](
        k_bytes, v_bytes, ks, vs, table, seq_lens, sink, table.stride(0), chunk, max(split_align, 1),
        *k_bytes.stride()[:3], *s_strides, PAGE=page_size, ROW=k_bytes.shape[-1], SCALE_ROW=scale_row,
        HAS_SCALES=has_scales, BY_LENGTH=split_align > 0, BLOCK_N=PAGED_READ_KEYS, num_warps=4)
    return sink


def backend_plan(backend: str, args: dict, fmt: str) -> tuple[int, int, int]:
    """(splits, keys a split, split_align) of `backend`'s decode of this case, for paged_read: the cuda backend's
    plan (fixed splits from shapes); Triton's (its heuristic's MAX_SPLITS and CHUNK, each sequence's splits decided
    from its length, in BLOCK_N multiples)."""
    table, seq_lens, k, q = args["block_table"], args["seq_lens"], args["k_cache"], args["q"]
    capacity = table.shape[1] * k.shape[1]
    if backend == "cuda":
        return (*cuda_backend.plan_splits(k.device.index or 0, seq_lens.numel(), HKV, capacity), 0)
    case = AttentionCase.of_shapes(device_type=q.device.type, arch=device_arch(q.device), q_dtype=q.dtype,
                                   kv_format=fmt, head_dim=q.shape[2], page_size=k.shape[1], num_q_heads=q.shape[1],
                                   num_kv_heads=HKV, batch=seq_lens.numel(), num_tokens=q.shape[0],
                                   max_kv_len=capacity, decode=True)
    cfg = theur.heuristic_config(case, q.shape[0], q.device)
    return cfg["MAX_SPLITS"], cfg["CHUNK"], cfg["BLOCK_N"]


@triton.jit
def _empty_kernel(sink_ptr):
    pass


class _NoMerge:
    """Stands in for decode.merge_splits_kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def programs_with_work(seq_lens: torch.Tensor, splits: int, chunk: int) -> int:
    """Programs of the plan's attention grid that have work: KV heads x the sum over sequences of their splits of
    `chunk` keys (at least one, at most `splits`; about, for Triton: its device lengthens splits past MAX_SPLITS)."""
    return HKV * sum(min(splits, max(1, -(-int(n) // chunk))) for n in seq_lens.tolist())


def read_time_us(nbytes: int, programs: int, block: int = 2048, num_warps: int = 8) -> float:
    words = int(nbytes) // 4  # (4-bit formats count their scales' bytes as a float)
    src = torch.empty(words, dtype=torch.int32, device="cuda").random_()
    sink = torch.empty(programs, dtype=torch.int32, device="cuda")
    per_program = -(-words // programs)
    return graph_time_us(lambda: _read_kernel[(programs,)](src, sink, words, per_program, BLOCK=block,
                                                           num_warps=num_warps))


def best_read_us(nbytes: int, sms: int) -> float:
    return min(read_time_us(nbytes, per_sm * sms, block, warps)
               for per_sm in (1, 2, 4, 8, 16) for warps in (4, 8) for block in (2048, 8192))


def cuda_op_time_us(runner: Runner) -> float:
    """The `cuda` backend's decode as the op runs it (pinned), checked against the reference first."""
    a = runner.args
    call = functools.partial(attnops.paged_attention, a["q"], a["k_cache"], a["v_cache"], a["block_table"],
                             a["seq_lens"], scale=D ** -0.5, kv_format=a["kv_format"], k_scale=a.get("k_scale"),
                             v_scale=a.get("v_scale"), out=runner.out)
    with attnops.use_backend("cuda"):
        runner.out.fill_(float("nan"))
        call()
        err = relative_error(runner.out, runner.ref)
        if not err < 2e-2:
            raise RuntimeError(f"the cuda backend's output is wrong (relative error {err:.3g})")
        return graph_time_us(call)


def breakdown(case: str, fmt: str, backend: str) -> dict:
    runner = Runner(make_inputs(DECODE_CASES[case], None, fmt), fmt)
    nbytes = kv_bytes(runner.args, fmt)
    splits, chunk, split_align = backend_plan(backend, runner.args, fmt)
    if backend == "cuda":
        op_us = cuda_op_time_us(runner)
    else:
        op_us = runner.time(None)  # checked against the reference first
        if op_us is None:
            raise RuntimeError(f"{case} {fmt}: the op failed or gave a wrong answer")
    row = dict(case=case, fmt=fmt, backend=backend, bytes=nbytes, op=op_us,
               programs=programs_with_work(runner.args["seq_lens"], splits, chunk))
    if backend == "triton":
        saved = tlaunch.merge_splits_kernel
        tlaunch.merge_splits_kernel = _NoMerge()
        try:
            row["attention"] = graph_time_us(lambda: runner.call(None))
        finally:
            tlaunch.merge_splits_kernel = saved
        row["merge"] = row["op"] - row["attention"]
    sink = paged_read(runner.args, splits, chunk, split_align)
    row["read-paged"] = graph_time_us(lambda: paged_read(runner.args, splits, chunk, split_align, sink))
    del runner, sink
    torch.cuda.empty_cache()
    row["read"] = read_time_us(nbytes, row["programs"])
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    row["read-chip"] = read_time_us(nbytes, 4 * sms)
    row["read-best"] = best_read_us(nbytes, sms)
    sink = torch.empty(1, dtype=torch.int32, device="cuda")
    row["launch"] = graph_time_us(lambda: _empty_kernel[(1,)](sink))
    return row


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["1x32768"], choices=sorted(DECODE_CASES))
    parser.add_argument("--formats", nargs="+", default=["bf16"],
                        choices=[f for f in formats.KV_FORMATS if f != "fp32"])
    parser.add_argument("--backend", choices=("triton", "cuda"), default="triton",
                        help="whose decode is the op (cuda: the KV formats it serves; its merge is in its call, so no "
                             "attention/merge columns)")
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_breakdown.py times GPU kernels: it needs a CUDA GPU")
    if opts.backend == "cuda" and not cuda_backend.built():
        sys.exit("--backend cuda: this build of attnops has no CUDA kernels (build it where nvcc is found)")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"backend {opts.backend}")
    stages = ("op", "attention", "merge", "read-paged", "read", "read-chip", "read-best", "launch")
    rate_stages = ("op", "attention", "read-paged", "read", "read-chip", "read-best")
    print(f"{'case':>10} {'format':>9} {'programs':>8} " + " ".join(f"{s:>10}" for s in stages) + "  (us; TB/s)")
    rows = []
    for case in opts.cases:
        for fmt in opts.formats:
            row = breakdown(case, fmt, opts.backend)
            rows.append(row)
            tbps = {s: row["bytes"] / row[s] / 1e6 for s in rate_stages if s in row}
            print(f"{case:>10} {fmt:>9} {row['programs']:>8} "
                  + " ".join(f"{row[s]:>10.1f}" if s in row else f"{'-':>10}" for s in stages))
            print(f"{'':>29} " + " ".join(f"{tbps[s]:>10.2f}" if s in tbps else f"{'':>10}" for s in stages),
                  flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
