"""Where a Triton decode's time goes, by leaving stages out (the device's METHOD.md: no hardware counters needed).

    python benchmarks/decode_breakdown.py                          # 1 x 32768 bf16 (GPU)
    python benchmarks/decode_breakdown.py --cases 1x32768 128x4096 --formats bf16 fp8_e4m3 --json breakdown.json

Per case and format, CUDA-graph medians (ten calls a graph, as `python -m attnops bench` times the op) of:
  op          the attention kernel and, where the sequence is split, the merge kernel (decode.launch)
  attention   the attention kernel alone (the merge launch left out; its output is then not the answer)
  merge       op - attention: the merge kernel and the gap before it
  read        a plain Triton kernel reading the same bytes of the cache pool, contiguously, with as many
              programs as the attention kernel: the DRAM read rate this much parallelism reaches
  read-chip   the same with 4 programs an SM: what the bytes cost at full occupancy
  read-best   the fastest plain read of those bytes over 1-16 programs an SM, 4 or 8 warps, 2-8K words a load
              step: no kernel that reads the bytes once can beat it by much
  launch      an empty kernel: the floor of one launch inside a graph
For 1 x 32768 (bar: 1.3x FlashInfer) the op's distance to `read-chip` is what ramp-up, tail and merge cost.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnops import formats  # noqa: E402
from attnops.backends.triton import heuristics as theur, launch as tlaunch  # noqa: E402
from attnops.bench.run import graph_time_us  # noqa: E402
from triton_tuning import DECODE_CASES, HKV, Runner, kv_bytes, make_inputs  # noqa: E402


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
def _empty_kernel(sink_ptr):
    pass


class _NoMerge:
    """Stands in for decode.merge_splits_kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def attention_programs(runner: Runner, fmt: str) -> int:
    """Programs of the heuristic's attention grid that have work: KV heads x sequences x splits (about: the
    device lengthens splits past MAX_SPLITS)."""
    a = runner.args
    cfg = theur.heuristic_config(a["q"].device, True, a["seq_lens"].numel(), a["q"].shape[0], a["q"].shape[1],
                                   HKV, a["q"].shape[2], a["k_cache"].shape[1],
                                   a["block_table"].shape[1] * a["k_cache"].shape[1], fmt, a["q"].dtype)
    splits = [min(cfg["MAX_SPLITS"], max(1, -(-int(n) // cfg["CHUNK"]))) for n in a["seq_lens"].tolist()]
    return HKV * sum(splits)


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


def breakdown(case: str, fmt: str) -> dict:
    runner = Runner(make_inputs(DECODE_CASES[case], None, fmt), fmt)
    nbytes = kv_bytes(runner.args, fmt)
    op_us = runner.time(None)  # checked against the reference first
    if op_us is None:
        raise RuntimeError(f"{case} {fmt}: the op failed or gave a wrong answer")
    row = dict(case=case, fmt=fmt, bytes=nbytes, programs=attention_programs(runner, fmt), op=op_us)
    saved = tlaunch.merge_splits_kernel
    tlaunch.merge_splits_kernel = _NoMerge()
    try:
        row["attention"] = graph_time_us(lambda: runner.call(None))
    finally:
        tlaunch.merge_splits_kernel = saved
    row["merge"] = row["op"] - row["attention"]
    del runner
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
    parser.add_argument("--json", help="write the rows here")
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("decode_breakdown.py times GPU kernels: it needs a CUDA GPU")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    stages = ("op", "attention", "merge", "read", "read-chip", "read-best", "launch")
    print(f"{'case':>10} {'format':>9} {'programs':>8} " + " ".join(f"{s:>10}" for s in stages) + "  (us; TB/s)")
    rows = []
    for case in opts.cases:
        for fmt in opts.formats:
            row = breakdown(case, fmt)
            rows.append(row)
            tbps = {s: row["bytes"] / row[s] / 1e6 for s in ("op", "attention", "read", "read-chip", "read-best")}
            print(f"{case:>10} {fmt:>9} {row['programs']:>8} " + " ".join(f"{row[s]:>10.1f}" for s in stages))
            print(f"{'':>29} " + " ".join(f"{tbps[s]:>10.2f}" if s in tbps else f"{'':>10}" for s in stages),
                  flush=True)
    if opts.json:
        Path(opts.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
