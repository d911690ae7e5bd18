"""Sweeps the Triton backend's tunables on the GPU and prints the best configuration per case, in one run.

    python benchmarks/triton_tuning.py                       # BENCH.md's decode cases, bf16/fp8/nvfp4/mxfp4,
                                                             # plus verify and prefill (bf16); ~8 minutes; --budget stops it in time
    python benchmarks/triton_tuning.py --quick               # fewer tile configurations
    python benchmarks/triton_tuning.py --formats bf16 fp8_e4m3 --cases 1x32768 128x4096 --json tune.json
    python benchmarks/triton_tuning.py --compare maxnreg=168  # A/B: the heuristic with and without a tunable set,
                                                             # every format and case, no sweep
    python benchmarks/triton_tuning.py --compare BOUNDS=0 --no-extend --rounds 5   # what the index bounds cost

Stages (compiles are the expensive part, so constexpr tunables are searched on few cases, runtime ones on all):
1. per format, tile configurations (BLOCK_N, num_warps, num_stages; SCALE_BCAST for 4-bit, FP4_ASM off; V_DEQUANT_FIRST flipped for quantized caches; fp8 read as bytes instead of 16-bit pairs) on
   two representative decode cases (128 x 4096: bandwidth; 1 x 32768: splits), keeping the best by the sum of the
   two times;
2. per case, with that tile configuration, the split plan (CHUNK keys per program; MAX_SPLITS follows): runtime
   arguments, no recompiles; "none" = one program per sequence;
3. verify (4 and 8 tokens, 32 x 4096) and prefill (8 x 4096; 2048 new tokens on a 46,000 prefix), bf16: BLOCK_Q,
   BLOCK_N, num_warps, num_stages.
Every configuration's output is compared with the reference before it is timed: a wrong config never wins.
Times are CUDA-graph replays (attnops.bench.run.graph_time_us): the kernels' own time, without the host's
launch cost, which on a 50 us decode would otherwise decide the ranking.
Decode is reported as achieved TB/s (KV bytes as stored, scales included, + q + out over the median time);
prefill as TFLOP/s of causal FLOPs. The heuristic's own choice is timed too, so the gain of tuning is visible.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnops import formats  # noqa: E402
from attnops.backends.reference import paged_attention_reference  # noqa: E402
from attnops.backends.triton import heuristics as theur, launch as tlaunch  # noqa: E402
from attnops.testing import random_paged_inputs, relative_error  # noqa: E402
from attnops.bench.run import graph_time_us  # noqa: E402
from attnops.bench.grid import ragged_lengths  # noqa: E402  (the benchmark suite's: the same ragged batches)

HQ, HKV, D, PAGE = 32, 8, 128, 16
DEV, Q_DTYPE, PLAIN = "cuda", torch.bfloat16, "bf16"  # module globals so that a smoke run can shrink them
DECODE_CASES = {
    "1x32768": [32768], "4x8192": [8192] * 4, "32x4096": [4096] * 32, "64x2048": [2048] * 64,
    "128x4096": [4096] * 128, "256x8192": [8192] * 256, "64x32768": [32768] * 64,
    "ragged64": ragged_lengths(64, seed=64), "ragged256": ragged_lengths(256, seed=256),
}
DEFAULT_CASES = tuple(DECODE_CASES)  # the benchmark grid's decode cases
DECODE_CASES["64x1024"] = [1024] * 64  # cascade's suffix pass: opt in with --cases
DECODE_CASES["32x8192"] = [8192] * 32  # the fp8 bar's case: opt in with --cases
# ragged batches whose longest sequence is 8192 keys (a table of that capacity), where one split a sequence leaves
# the longest alone at the end: opt in with --cases
DECODE_CASES["ragged32x8k"] = ragged_lengths(32, seed=32, high=8192)
DECODE_CASES["31x512+8192"] = [512] * 31 + [8192]
# uniform batches whose splits overrun one wave (FILL_WAVES): 64 x 8192 at 4 KV heads, 16 x 65536 at 2
DECODE_CASES["64x8192"] = [8192] * 64
DECODE_CASES["16x65536"] = [65536] * 16
TILE_CASES = ("128x4096", "1x32768")
# None: one split per sequence. 1536 and 3072 split 4096 and 8192 keys in three and 8192 in six: a split count that
# is no power of two fills an SM count's waves differently (256 programs x 3 on 132 SMs x 3)
CHUNKS = (128, 256, 512, 1024, 1536, 2048, 3072, 4096, 8192, None)


# verify and prefill cases, bf16: name -> (KV lengths, query lengths)
EXTEND_CASES = {
    "verify4 32x4096": ([4096] * 32, [4] * 32),
    "verify8 32x4096": ([4096] * 32, [8] * 32),
    "prefill 8x4096": ([4096] * 8, [4096] * 8),
    "chunked 2048 on 46000": ([48048], [2048]),
    # draft trees (the bar: within 1.3x of decode) and cascade's prefix pass (64 rows against a
    # 32K prefix, seeing none of their own block): opt in with --extend-cases
    "verify16 32x4096": ([4096] * 32, [16] * 32),
    "tree16 32x4096": ([4096] * 32, [16] * 32),
    "prefix64 1x32768": ([32768 + 64], [64]),
    # verify of a few long sequences (their blocks do not fill the SMs unsplit): opt in
    "verify8 4x16384": ([16384] * 4, [8] * 4),
}
DEFAULT_EXTEND_CASES = ("verify4 32x4096", "verify8 32x4096", "prefill 8x4096", "chunked 2048 on 46000")


def tree_mask_of(name, q_lens, device):
    """The tree mask an extend case runs with: a complete binary draft tree ("tree"), rows that see none of
    their own block ("prefix"), or None (causal)."""
    from attnops.bench.grid import tree_parents
    from attnops.serving.spec import tree_mask_from_parents
    if name.startswith("tree"):
        return tree_mask_from_parents([tree_parents(n, 2) for n in q_lens], device=device)
    if name.startswith("prefix"):
        return torch.zeros(sum(q_lens), max(q_lens), dtype=torch.bool, device=device)
    return None


def make_inputs(kv_lens, q_lens, fmt, seed=0):
    """Random paged inputs built on the GPU: pages in random order (attnops.testing, as the benchmark suite)."""
    return random_paged_inputs(kv_lens, q_lens, num_q_heads=HQ, num_kv_heads=HKV, head_dim=D, page_size=PAGE,
                               kv_format=fmt, q_dtype=Q_DTYPE, device=DEV, seed=seed, spare_pages=8,
                               table_padding=0)


def per_head_variant(args):
    """fp8 with per-head scales (a different scale stride: its own specialization)."""
    args = dict(args)
    args.update(k_scale=torch.rand(HKV, device=DEV) + 0.25, v_scale=torch.rand(HKV, device=DEV) + 0.25)
    return args


def kv_bytes(args, fmt):
    tokens = int(args["seq_lens"].sum())
    total = 2 * tokens * HKV * D * formats.FORMATS[fmt].bytes_per_value()
    return total + 2 * args["q"].numel() * args["q"].element_size()


def causal_flops(kv_lens, q_lens):
    return sum(4 * HQ * D * (q * k - q * q / 2) for q, k in zip(q_lens, kv_lens))


class Runner:
    def __init__(self, args, fmt):
        self.args, self.fmt = args, fmt
        self.out = torch.empty_like(args["q"])
        a = args
        self.ref = paged_attention_reference(a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"],
                                             a["cu_seqlens_q"], kv_format=a["kv_format"], k_scale=a.get("k_scale"),
                                             v_scale=a.get("v_scale"), tree_mask=a.get("tree_mask"),
                                             compute_dtype=torch.float32)

    def call(self, config):
        a = self.args
        tlaunch.launch(a["q"], a["k_cache"], a["v_cache"], a["block_table"], a["seq_lens"], a["cu_seqlens_q"],
                       scale=D ** -0.5, soft_cap=0.0, window_left=-1,
                       kv_format=formats.resolve_kv_format(a["kv_format"], a["k_cache"].dtype),
                       k_scale=a.get("k_scale"), v_scale=a.get("v_scale"), tree_mask=a.get("tree_mask"),
                       out=self.out, config=config)

    def time(self, config):
        """Median microseconds, or None when the config fails to compile/run or gives a wrong answer."""
        try:
            self.out.fill_(float("nan"))
            self.call(config)
            torch.cuda.synchronize()
            err = relative_error(self.out, self.ref)
            if not err < 2e-2:
                print(f"    wrong output (rel. err {err:.3g}) with {config}", flush=True)
                return None
            return graph_time_us(lambda: self.call(config))
        except Exception as e:  # a config that does not compile (too many registers, shared memory...)
            print(f"    failed with {config}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            return None


def parse_overrides(items, option):
    """['KEY=VALUE', ...] -> {KEY: int(VALUE)}, KEYs from the kernel's CONFIG_KEYS."""
    config = {}
    for item in items:
        key, _, value = item.partition("=")
        if key not in theur.CONFIG_KEYS:
            raise SystemExit(f"{option}: unknown tunable {key!r}; known: {theur.CONFIG_KEYS}")
        config[key] = int(value)
    return config


def parse_tile(text):
    """'N,W,S[,KEY=VALUE...]' -> a config dict (values as ints)."""
    n, w, st, *extra = text.split(",")
    return dict(BLOCK_N=int(n), num_warps=int(w), num_stages=int(st), **parse_overrides(extra, "--tiles"))


def compare(opts, overrides, records, t0):
    """--compare: per format and case, the heuristic's configuration (A) against it with `overrides` (B), timed
    alternately (A B A B A B) so that clock drift hits both; prints the medians and B's speed-up."""
    print(f"=== the heuristic (A) against the heuristic with {overrides} (B): CUDA-graph medians of "
          f"{opts.rounds} alternating rounds", flush=True)
    ratios = []
    cases = [(name, DECODE_CASES[name], None, fmt) for fmt in opts.formats for name in opts.cases]
    if not opts.no_extend:
        cases += [(name, *EXTEND_CASES[name], opts.extend_format) for name in opts.extend_cases]
    for name, kv_lens, q_lens, fmt in cases:
        if time.time() - t0 > opts.budget:
            print("budget spent: skipping the remaining cases")
            break
        args = make_inputs(kv_lens, q_lens, fmt)
        if q_lens is not None:
            args["tree_mask"] = tree_mask_of(name, q_lens, DEV)
        runner = Runner(args, fmt)
        a, b = [], []
        for _ in range(opts.rounds):
            a.append(runner.time(None))
            b.append(runner.time(overrides))
        if None in a or None in b:
            print(f"  {name:>22} {fmt:>9}: failed (A {a}, B {b})", flush=True)
            continue
        a_us, b_us = sorted(a)[len(a) // 2], sorted(b)[len(b) // 2]
        print(f"  {name:>22} {fmt:>9}: A {a_us:9.1f} us  B {b_us:9.1f} us  B is x{a_us / b_us:.3f}", flush=True)
        records.append(dict(stage="compare", case=name, fmt=fmt, overrides=overrides, a_us=a, b_us=b))
        ratios.append(a_us / b_us)
        del runner
        torch.cuda.empty_cache()
    if ratios:
        geomean = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
        print(f"  {'all ' + str(len(ratios)) + ' cases':>32}: B is x{geomean:.4f} (geometric mean), from "
              f"x{min(ratios):.3f} to x{max(ratios):.3f}", flush=True)


def format_variants(fmt, tiles):
    """The variants of each tile configuration worth trying for a format."""
    candidates = []
    if formats.is_fp8(fmt) or formats.is_fp4(fmt):  # V converted in its load's layout (ldmatrix.trans) or not:
        # the setting the heuristic does not take (it takes it for mxfp4 only)
        candidates += [dict(t, V_DEQUANT_FIRST=fmt != "mxfp4") for t in tiles]
    if formats.is_fp8(fmt):  # K and V read as bytes (the fp8 path before FP8_V_PAIRS/FP8_K_PAIRS), V pairs only
        candidates += [dict(t, FP8_V_PAIRS=False, FP8_K_PAIRS=False) for t in tiles[:2]]
        candidates += [dict(t, FP8_K_PAIRS=False) for t in tiles[:2]]
    if formats.is_fp4(fmt):  # block scales loaded per value instead of once and repeated in registers
        candidates += [dict(t, SCALE_BCAST=False) for t in tiles]
    # register caps: 3 (168) or 4 (128) resident 4-warp programs per SM instead of 2, against spills
    if formats.is_fp8(fmt) or formats.is_fp4(fmt):  # (bf16 needs 128 already)
        candidates += [dict(t, maxnreg=r) for t in tiles if t["num_warps"] == 4 for r in (168, 128)]
    if formats.is_fp4(fmt):  # the default is the inline-PTX nibble decode (4 values per register): try without
        candidates += [dict(t, FP4_ASM=False) for t in tiles]
    return candidates


def split_config(chunk, capacity):
    if chunk is None:
        return dict(CHUNK=capacity, MAX_SPLITS=1)
    return dict(CHUNK=chunk, MAX_SPLITS=max(1, min(-(-capacity // chunk), 256)))


def write_json(path, best_rows, records):
    if path:
        Path(path).write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), best=best_rows, records=records),
                                         indent=1, default=str))


def main():
    global HQ, HKV, D
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="*", default=["bf16", "fp8_e4m3", "nvfp4", "mxfp4"],
                        help="decode formats to tune (none: only verify/prefill)")
    parser.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES), choices=list(DECODE_CASES))
    parser.add_argument("--quick", action="store_true", help="fewer tile configurations")
    parser.add_argument("--tiles", nargs="+", metavar="N,W,S[,KEY=VALUE...]",
                        help="tile configurations to try, as BLOCK_N,num_warps,num_stages and any other tunable of "
                             "the kernel's CONFIG_KEYS, e.g. 128,4,3,HEADS_INNER=1 (default: a grid)")
    parser.add_argument("--exact", action="store_true",
                        help="stage 1 tries the --tiles exactly, without adding the per-format variants")
    parser.add_argument("--tile-cases", nargs="+", default=list(TILE_CASES), choices=list(DECODE_CASES),
                        help=f"decode cases stage 1 ranks tiles on (default: {' '.join(TILE_CASES)})")
    parser.add_argument("--shape", nargs=3, type=int, metavar=("HQ", "HKV", "D"), default=(HQ, HKV, D),
                        help="query heads, KV heads, head dim (default 32 8 128)")
    parser.add_argument("--no-extend", action="store_true", help="skip verify/prefill")
    parser.add_argument("--extend-cases", nargs="+", default=list(DEFAULT_EXTEND_CASES), choices=list(EXTEND_CASES),
                        metavar="CASE", help=f"verify/prefill cases, of {list(EXTEND_CASES)} (default: "
                                             f"{list(DEFAULT_EXTEND_CASES)}; tree16 runs a binary draft tree, "
                                             "prefix64 cascade's prefix pass)")
    parser.add_argument("--extend-format", default=PLAIN, choices=list(formats.KV_FORMATS),
                        help="the KV format of the verify/prefill cases (default bf16)")
    parser.add_argument("--extend-tiles", nargs="+", metavar="N,W,S[,KEY=VALUE...]",
                        help="verify/prefill configurations to try instead of the grid, as for --tiles, e.g. "
                             "128,8,2,BLOCK_Q=32,HEADS_INNER=1 (the heuristic's own choice is always timed)")
    parser.add_argument("--compare", nargs="+", metavar="KEY=VALUE",
                        help="no sweep: per format and case (and verify/prefill unless --no-extend), the heuristic "
                             "against the heuristic with these tunables set, e.g. maxnreg=168")
    parser.add_argument("--rounds", type=int, default=3,
                        help="--compare: alternating A/B timings per case; the medians are compared")
    parser.add_argument("--budget", type=float, default=540, help="seconds; later stages are skipped past it")
    parser.add_argument("--json", help="write all measurements here")
    opts = parser.parse_args()
    overrides = parse_overrides(opts.compare, "--compare") if opts.compare else None
    assert torch.cuda.is_available(), "the tuning script runs on a GPU"
    HQ, HKV, D = opts.shape
    t0 = time.time()
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    records = []
    best_rows = []
    if overrides:
        compare(opts, overrides, records, t0)
        write_json(opts.json, best_rows, records)
        return

    if opts.tiles:
        tiles = [parse_tile(t) for t in opts.tiles]
    elif opts.quick:
        tiles = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
                 ((64, 4, 3), (128, 4, 3), (64, 8, 3), (128, 8, 3), (64, 4, 4), (128, 8, 2))]
    else:
        tiles = [dict(BLOCK_N=n, num_warps=w, num_stages=s) for n, w, s in
                 itertools.product((32, 64, 128), (4, 8), (2, 3, 4))]

    for fmt in opts.formats:
        if time.time() - t0 > opts.budget:
            print(f"budget spent: skipping {fmt}")
            break
        print(f"\n=== {fmt}: stage 1, tile configurations on {opts.tile_cases}", flush=True)
        runners = {name: Runner(make_inputs(DECODE_CASES[name], None, fmt), fmt) for name in opts.tile_cases}
        candidates = list(tiles) if opts.exact else list(tiles) + format_variants(fmt, tiles)
        scored = []
        for tile in candidates:
            times = {name: r.time(tile) for name, r in runners.items()}
            if any(t is None for t in times.values()):
                continue
            scored.append((sum(times.values()), tile, times))
            records.append(dict(stage="tile", fmt=fmt, config=tile, us=times))
        scored.sort(key=lambda x: x[0])
        for total, tile, times in scored if opts.exact else scored[:5]:
            print(f"  {tile}: " + ", ".join(f"{k} {v:.1f} us" for k, v in times.items()))
        best_tile = scored[0][1] if scored else {}
        del runners
        torch.cuda.empty_cache()

        print(f"=== {fmt}: stage 2, split plan per case with {best_tile}", flush=True)
        for name in opts.cases:
            if time.time() - t0 > opts.budget:
                print("budget spent: skipping the remaining cases")
                break
            args = make_inputs(DECODE_CASES[name], None, fmt)
            runner = Runner(args, fmt)
            capacity = args["block_table"].shape[1] * PAGE
            nbytes = kv_bytes(args, fmt)
            heuristic_us = runner.time(None)
            results = []
            for chunk in CHUNKS:
                cfg = dict(best_tile, **split_config(chunk, capacity))
                us = runner.time(cfg)
                if us is not None:
                    results.append((us, chunk, cfg))
                    records.append(dict(stage="split", fmt=fmt, case=name, config=cfg, us=us,
                                        tbps=nbytes / us / 1e6))
            if fmt == "fp8_e4m3":  # per-head scales: check that the other specialization is as fast
                ph = Runner(per_head_variant(args), fmt)
                best_chunk = min(results)[1] if results else 2048
                us = ph.time(dict(best_tile, **split_config(best_chunk, capacity)))
                if us is not None:
                    print(f"  {name} per-head scales: {us:.1f} us, {nbytes / us / 1e6:.2f} TB/s")
                del ph
            if results:
                us, chunk, cfg = min(results, key=lambda x: x[0])
                line = (f"  {name:>10} {fmt:>9} {HQ}/{HKV}/{D}: best CHUNK={chunk} {us:8.1f} us {nbytes / us / 1e6:5.2f} TB/s"
                        f" | heuristic {heuristic_us or float('nan'):8.1f} us"
                        f" | all: " + " ".join(f"{c}:{u:.0f}" for u, c, _ in results))
                print(line, flush=True)
                best_rows.append(dict(case=name, fmt=fmt, us=us, tbps=nbytes / us / 1e6, config=cfg,
                                      heuristic_us=heuristic_us))
            del runner, args
            torch.cuda.empty_cache()

    if not opts.no_extend and time.time() - t0 < opts.budget:
        print(f"\n=== {opts.extend_format} verify / prefill: BLOCK_Q, BLOCK_N, num_warps, num_stages", flush=True)
        for name in opts.extend_cases:
            kv_lens, q_lens = EXTEND_CASES[name]
            if time.time() - t0 > opts.budget:
                print("budget spent: skipping the remaining extend cases")
                break
            args = make_inputs(kv_lens, q_lens, opts.extend_format)
            args["tree_mask"] = tree_mask_of(name, q_lens, DEV)
            runner = Runner(args, opts.extend_format)
            prefill = q_lens[0] > 16
            capacity = args["block_table"].shape[1] * PAGE
            if opts.extend_tiles:
                space = [parse_tile(t) for t in opts.extend_tiles]
            elif name.startswith("prefix"):  # one long sequence: the split plan matters as much as the tile
                space = [dict(BLOCK_Q=bq, BLOCK_N=n, num_warps=w, num_stages=s, **split_config(c, capacity))
                         for bq, n, w, s, c in itertools.product((16, 32), (64, 128), (4, 8), (2, 3),
                                                                 (512, 1024, 2048, 4096, 8192))]
            elif prefill:
                space = [dict(BLOCK_Q=bq, BLOCK_N=n, num_warps=w, num_stages=s) for bq, n, w, s in
                         itertools.product((16, 32), (32, 64, 128), (4, 8), (2, 3))]
            else:
                space = [dict(BLOCK_Q=q_lens[0], BLOCK_N=n, num_warps=w, num_stages=s, **split_config(c, capacity))
                         for n, w, s, c in itertools.product((32, 64, 128), (4, 8), (2, 3), (512, 1024, 2048, None))]
            heuristic_us = runner.time(None)
            results = []
            for cfg in space:
                us = runner.time(cfg)
                if us is not None:
                    results.append((us, cfg))
                    records.append(dict(stage="extend", case=name, config=cfg, us=us))
                    if opts.extend_tiles:
                        print(f"    {name:>22} {us:9.1f} us {cfg}", flush=True)
            if not results:
                continue
            us, cfg = min(results, key=lambda x: x[0])
            if prefill:
                tflops = causal_flops(kv_lens, q_lens) / us / 1e6
                metric = f"{tflops:6.1f} TFLOP/s"
            else:
                metric = f"{kv_bytes(args, opts.extend_format) / us / 1e6:5.2f} TB/s"
            print(f"  {name:>22}: best {us:8.1f} us {metric} {cfg} | heuristic {heuristic_us or float('nan'):.1f} us",
                  flush=True)
            best_rows.append(dict(case=name, fmt=opts.extend_format, us=us, config=cfg, heuristic_us=heuristic_us))
            del runner, args
            torch.cuda.empty_cache()

    print("\n=== best per case")
    for row in best_rows:
        gain = (row["heuristic_us"] / row["us"]) if row.get("heuristic_us") else float("nan")
        print(f"  {row['case']:>22} {row['fmt']:>9}: {row['us']:9.1f} us  "
              f"{(str(round(row['tbps'], 2)) + ' TB/s') if 'tbps' in row else '':>10}  x{gain:.2f} over the "
              f"heuristic  {row['config']}")
    print(f"total {time.time() - t0:.0f} s")
    write_json(opts.json, best_rows, records)


if __name__ == "__main__":
    main()
