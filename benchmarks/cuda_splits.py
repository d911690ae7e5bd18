"""How the `cuda` backend's decode time depends on how it splits each sequence's keys: every case timed at each
split count its plan could choose, beside the plan's own choice, in one run. The data for its split plan
(attnops/backends/cuda.py plan_splits): where the plan is slower than the best count, by how much, and how the
blocks' waves (blocks / (blocks an SM holds x SMs)) line up with it.

    python benchmarks/cuda_splits.py                                   # nvfp4 and fp8_e4m3, 32/8/128, four cases
    python benchmarks/cuda_splits.py --formats fp8_e4m3 --shapes 32/8/128 32/8/64 16/1/128 --cases 32x8192 128x4096
    python benchmarks/cuda_splits.py --splits 1 2 3 4 6 8 --json splits.json
    python benchmarks/cuda_splits.py --tokens 4 --cases 32x4096        # verify 4 tokens

Times are CUDA-graph medians of the op (`attnops.paged_attention` pinned to the cuda backend: its attention and
merge kernels), each split count's output checked against the reference before it is timed. Decode (one query
token a sequence), or verify with --tokens N (N query tokens a sequence, causal, the 16-row kernel); page size 16,
bf16 queries, random pages.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attnops  # noqa: E402
from attnops.backends import cuda as cuda_backend  # noqa: E402
from attnops.backends.reference import paged_attention_reference  # noqa: E402
from attnops.bench.grid import ragged_lengths  # noqa: E402
from attnops.bench.run import graph_time_us  # noqa: E402
from attnops.testing import random_paged_inputs, relative_error  # noqa: E402

CASES = {"128x4096": [4096] * 128, "32x8192": [8192] * 32, "64x32768": [32768] * 64, "1x32768": [32768],
         "4x8192": [8192] * 4, "32x4096": [4096] * 32, "256x8192": [8192] * 256,
         "ragged64": ragged_lengths(64, seed=64)}
DEFAULT_CASES = ("128x4096", "32x8192", "64x32768", "4x8192")
SPLIT_COUNTS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 24, 32, 48, 64)
PAGE = 16


def parse_shape(text: str) -> tuple[int, int, int]:
    try:
        hq, hkv, d = (int(x) for x in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: a head shape is HQ/HKV/D, e.g. 32/8/128") from None
    if hq % hkv or d not in cuda_backend.HEAD_DIMS:
        raise argparse.ArgumentTypeError(f"{text!r}: HQ must be a multiple of HKV and D one of "
                                         f"{cuda_backend.HEAD_DIMS}")
    return hq, hkv, d


class PlanSpy:
    """Stands in for cuda_backend.plan_splits: records the plan's choice, or returns a forced one."""

    def __init__(self):
        self.real, self.forced, self.seen = cuda_backend.plan_splits, None, []

    def __call__(self, *args, **kwargs):
        plan = self.real(*args, **kwargs) if self.forced is None else self.forced
        self.seen.append(plan)
        return plan


def resident_blocks(fmt: str, group: int, head_dim: int, decode: bool):
    """Blocks an SM of the variant this call launches, where this build can say (None where it cannot)."""
    query = getattr(cuda_backend, "resident_blocks", None)
    if query is None:
        return None
    return query(0, fmt, head_dim, PAGE, cuda_backend.wide_rows(decode, group))


def sweep(fmt: str, shape: tuple[int, int, int], case: str, tokens: int, counts, spy: PlanSpy) -> dict:
    hq, hkv, d = shape
    lens = CASES[case]
    q_lens = None if tokens == 1 else [tokens] * len(lens)
    args = random_paged_inputs(lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=PAGE,
                               kv_format=fmt, q_dtype=torch.bfloat16, device="cuda", seed=1, spare_pages=8,
                               table_padding=0)
    ref = paged_attention_reference(**args, compute_dtype=torch.float32)
    out = torch.empty_like(args["q"])

    def call():
        attnops.paged_attention(**args, out=out)

    tiles = math.ceil(args["block_table"].shape[1] * PAGE / cuda_backend.TILE)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    resident = resident_blocks(fmt, hq // hkv, d, tokens == 1)
    record = dict(format=fmt, heads=f"{hq}/{hkv}/{d}", case=case, tokens=tokens, tiles=tiles, sms=sms,
                  resident=resident, times={}, errors={})
    plans = {}
    for count in counts:  # each count's shortest whole-tile split length; counts past the tiles collapse
        chunk_tiles = math.ceil(tiles / count)
        plans.setdefault(math.ceil(tiles / chunk_tiles), chunk_tiles * cuda_backend.TILE)
    spy.forced, spy.seen = None, []
    plans_to_time = [("plan", None)] + [(str(s), (s, chunk)) for s, chunk in sorted(plans.items())]
    for label, forced in plans_to_time:
        spy.forced = forced
        out.fill_(float("nan"))
        call()
        if label == "plan" and spy.seen:
            record["plan"] = list(spy.seen[-1])
        err = relative_error(out, ref)
        if not err < 2e-2:
            record["errors"][label] = err
            continue
        record["times"][label] = graph_time_us(call)
    spy.forced = None
    timed = {int(k): v for k, v in record["times"].items() if k != "plan"}
    if timed:
        best = min(timed, key=timed.get)
        record["best"] = [best, plans[best]]
        record["plan_over_best"] = record["times"].get("plan", math.nan) / timed[best]
    if resident:
        work = len(lens) * hkv
        record["waves"] = {str(s): work * s / (resident * sms) for s in plans}
    return record


def summary(r: dict) -> str:
    """One line a case: the plan's splits and time, the best count and the plan's time over it, the curve."""
    curve = " ".join(f"{k}:{v:.1f}" for k, v in r["times"].items() if k != "plan")
    line = (f"{r['format']:>9} {r['heads']:>9} {r['case']:>9} q{r['tokens']}  plan {r.get('plan', ['?'])[0]} splits "
            f"{r['times'].get('plan', math.nan):.1f} us, best {r.get('best', ['?'])[0]} "
            f"(plan/best x{r.get('plan_over_best', math.nan):.3f}), {r['resident']} blocks an SM | {curve}")
    return line + (f" | wrong: {r['errors']}" if r["errors"] else "")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", choices=cuda_backend.KV_FORMATS,
                        default=[f for f in ("nvfp4", "fp8_e4m3") if f in cuda_backend.KV_FORMATS],
                        help="KV formats (those this build's cuda backend serves)")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=[(32, 8, 128)], metavar="HQ/HKV/D",
                        help="head shapes, e.g. 32/8/128 32/8/64")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=sorted(CASES),
                        help="batch x keys of each sequence (ragged64: 64 log-uniform lengths, 256 to 64K)")
    parser.add_argument("--tokens", type=int, default=1,
                        help="query tokens a sequence: 1 decode (default), 2-16 verify (causal)")
    parser.add_argument("--splits", nargs="+", type=int, default=list(SPLIT_COUNTS),
                        help="split counts to time (each as even as whole 128-key tiles allow)")
    parser.add_argument("--json", help="write the records here")
    opts = parser.parse_args(argv)
    if not 1 <= opts.tokens <= 16:
        parser.error("--tokens: 1 (decode) to 16 (the cuda backend's verify)")
    if any(s < 1 or s > cuda_backend.MAX_SPLITS for s in opts.splits):
        parser.error(f"--splits: counts from 1 to {cuda_backend.MAX_SPLITS}")
    if not torch.cuda.is_available():
        sys.exit("cuda_splits.py times the cuda backend's kernels: it needs a CUDA GPU")
    if not cuda_backend.built():
        sys.exit("this build of attnops has no CUDA kernels (build it where torch has CUDA and nvcc is found)")
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    spy = PlanSpy()
    cuda_backend.plan_splits = spy
    records = []
    try:
        with attnops.use_backend("cuda"):
            for shape in opts.shapes:
                for fmt in opts.formats:
                    for case in opts.cases:
                        r = sweep(fmt, shape, case, opts.tokens, opts.splits, spy)
                        records.append(r)
                        print(summary(r), flush=True)
    finally:
        cuda_backend.plan_splits = spy.real
    if opts.json:
        Path(opts.json).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), records=records), indent=1))


if __name__ == "__main__":
    main()
