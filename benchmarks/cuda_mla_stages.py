"""Where the cuda backend's latent-attention decode (csrc/cuda/mla_decode_sm90.cuh) spends a tile: its time per
64-key tile with one split a block, as the number of blocks running at once grows, at 64 and 128 heads (two head
blocks of a token read the same latent rows), each with the kernel's stages left out in turn:

    python benchmarks/cuda_mla_stages.py --json stages.json

- all: the kernel as the op runs it;
- no-loads: the first two tiles' rows only, reused (the MMAs, softmax and waits alone);
- loads-only: the tiles' copies and their waits alone (no MMA, no softmax).
ATTNOPS_CUDA_MLA_VARIANT picks the kernel's form (cp.async, tma, ...; the forms after tma run all stages only;
keys serves 16 heads or fewer: `--heads 16`).
Per-tile time flat as the blocks grow: a block is bound by its own chain of work, not by a bandwidth the blocks
share; a stage whose leaving out takes most of the time away is what binds it.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from mla_decode import graph_time_us, make_case  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kv-len", type=int, default=8192, help="keys a sequence (one split: all of them a block)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 33, 66, 132],
                        help="sequences (one block each at 64 heads or fewer; at 128, those up to half the most)")
    parser.add_argument("--heads", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--kv-format", default="bf16", choices=["bf16", "fp8_e4m3"])
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("cuda_mla_stages.py needs a CUDA GPU")
    from attnops import errors as attnops_errors  # (importing attnops registers the ops)
    from attnops.backends.cuda_mla import VARIANTS, kernel_variant
    records = []
    print(f"{'heads':>6}{'tokens':>8}{'blocks':>8}{'stages':>12}{'us':>10}{'us/tile':>10}{'TB/s':>8}")
    runs = [(h, t) for h in args.heads for t in args.tokens if h <= 64 or 2 * t <= max(args.tokens)]
    for heads, tokens in runs:
        variant = kernel_variant(args.kv_format, 64, heads, args.kv_len)  # (a split a block; the variable's form)
        stages = {"all": 0, "no-loads": 1, "loads-only": 2}  # (csrc/cuda/mla_decode_sm90.cuh: kAllStages ...)
        if VARIANTS[variant] not in ("cp.async", "tma"):
            stages = {"all": 0}
        case = make_case(tokens, args.kv_len, heads, 512, 64, 64, args.kv_format)
        out = torch.empty_like(case["q_nope"])
        errors = attnops_errors.buffer(torch.device("cuda"))
        tiles = math.ceil(args.kv_len / 64)
        for name, code in stages.items():
            def op(code=code):
                torch.ops.attnops.mla_decode_sm90(case["q_nope"], case["q_pe"], case["kv_cache"], case["kv_scale"],
                                                  case["block_table"], case["seq_lens"], None, out, None, out, out,
                                                  errors, 0.07, 1, tiles * 64, code, variant)
            us = graph_time_us(op)
            tbs = tokens * args.kv_len * 576 * case["kv_cache"].element_size() / us / 1e6
            record = dict(heads=heads, tokens=tokens, blocks=tokens * math.ceil(heads / 64), stages=name,
                          variant=VARIANTS[variant], us=us,
                          us_per_tile=us / tiles, tbs=tbs, kv_len=args.kv_len, kv_format=args.kv_format,
                          gpu=torch.cuda.get_device_name())
            records.append(record)
            print(f"{heads:>6}{tokens:>8}{record['blocks']:>8}{name:>12}{us:>10.1f}{us / tiles:>10.3f}{tbs:>8.2f}")
        del case, out
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
