"""Latent-attention (MLA) decode on the GPU: attnops' Triton kernel against FlashInfer's MLA wrapper (where
FlashInfer is installed) and the bandwidth ceiling, same data, same run.

    python benchmarks/mla_decode.py                      # DeepSeek's shape: R 512, P 64, heads 16 and 128
    python benchmarks/mla_decode.py --heads 8 16 32 64 128 --cases 1x32768 32x8192 128x4096 --json mla.json
    python benchmarks/mla_decode.py --sweep --json mla-sweep.json   # Triton's tiles and splits, each case
    python benchmarks/mla_decode.py --topk 2048 --cases 32x32768     # the sparse form: 2048 keys a row, listed

--sweep times the Triton launcher at every tile (BLOCK_H, BLOCK_N), warp count, stage count and split count of a
small grid beside the plan's own choice, and prints each case's best: what mla_plan's choices are fitted to.

Each case: a paged bf16 (or --kv-format fp8_e4m3, or fp8_ds_mla: DeepSeek's 656-byte rows) latent cache of random
rows in random page order, one query token a sequence; the output is checked against the float64 reference before
it is timed (CUDA-graph replay, median of triton.testing.do_bench). Achieved TB/s counts the latent rows read once
(R + P values a token in the stored format; fp8_ds_mla's rows whole, scales and bf16 rotary part included) plus q
and out; with --topk K, each row lists K distinct random positions of its sequence (in random order, as an
indexer's top-k comes) and the rows read are those K, plus the lists; the ceiling is the GPU's datasheet HBM
bandwidth (H200: 4.8 TB/s).
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch

from attnops import formats
from attnops.bench.run import hbm_tbps


def make_case(batch, kv_len, heads, latent, rope, page_size, kv_format, seed=0, topk=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    pages_each = -(-kv_len // page_size)
    num_pages = batch * pages_each
    table = torch.randperm(num_pages, generator=gen, device="cuda").view(batch, pages_each).to(torch.int32)
    rows = torch.randn(num_pages, page_size, latent + rope, generator=gen, device="cuda")
    kv_scale = None
    if kv_format == "fp8_e4m3":
        kv_scale = torch.tensor([0.25], device="cuda")
        kv = (rows / kv_scale).to(torch.float8_e4m3fn)
    elif kv_format == "fp8_ds_mla":
        kv = formats.quantize_latent_fp8(rows[..., :latent], rows[..., latent:])
    else:
        kv = rows.to(torch.bfloat16)
    q_nope = torch.randn(batch, heads, latent, generator=gen, device="cuda").to(torch.bfloat16)
    q_pe = torch.randn(batch, heads, rope, generator=gen, device="cuda").to(torch.bfloat16)
    seq_lens = torch.full((batch,), kv_len, dtype=torch.int32, device="cuda")
    topk_indices = None
    if topk:
        topk_indices = torch.stack([torch.randperm(kv_len, generator=gen, device="cuda")[:topk]
                                    for _ in range(batch)]).to(torch.int32)
    return dict(q_nope=q_nope, q_pe=q_pe, kv_cache=kv, block_table=table, seq_lens=seq_lens, kv_scale=kv_scale,
                topk_indices=topk_indices, kv_format="auto" if kv_format == "bf16" else kv_format)


def graph_time_us(fn) -> float:
    import triton
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return 1000 * triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def eager_time_us(fn) -> float:
    """Eager calls (a host-planned backend cannot run in a graph nobody re-plans): the op's first call plans the
    step, the timed calls reuse the plan as a model's other layers do."""
    import triton
    fn()
    torch.cuda.synchronize()
    return 1000 * triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def attnops_fn(case, scale, out, use_op, backend):
    import attnops
    from attnops.backends.triton.mla_launch import mla_launch
    if use_op:
        def op():
            with attnops.use_backend(None if backend == "auto" else backend):
                torch.ops.attnops.mla_attention.out(
                    case["q_nope"], case["q_pe"], case["kv_cache"], case["block_table"], case["seq_lens"], None,
                    scale=scale, kv_format=case["kv_format"], kv_scale=case["kv_scale"],
                    topk_indices=case["topk_indices"], out=out)
        return op
    return lambda: mla_launch(case["q_nope"], case["q_pe"], case["kv_cache"], case["block_table"], case["seq_lens"],
                              None, scale=scale, kv_format=case["kv_format"], kv_scale=case["kv_scale"], sinks=None,
                              tree_mask=None, out=out,
                              topk_indices=case["topk_indices"])


SWEEP = dict(BLOCK_H=(16, 32, 64), BLOCK_N=(16, 32, 64), num_warps=(4, 8), num_stages=(1, 2),
             split_factor=(0.5, 1, 2, 4))


def sweep_grid(items: list[str] | None) -> dict:
    """SWEEP, or the grid of --sweep-grid: KEY=V1,V2 ... (e.g. BLOCK_H=32,64 num_warps=8 split_factor=1,4)."""
    if not items:
        return SWEEP
    grid = dict(SWEEP)
    for item in items:
        key, _, values = item.partition("=")
        if key not in SWEEP:
            sys.exit(f"--sweep-grid: {key!r} is not one of {sorted(SWEEP)}")
        grid[key] = tuple(float(v) if key == "split_factor" else int(v) for v in values.split(","))
    return grid


def sweep_case(case, scale, out, budget_s, grid=SWEEP):
    """The launcher's time at each config of SWEEP (split_factor scales the plan's split count), the plan first;
    configs a GPU cannot hold (shared memory, registers) are skipped. Stops after budget_s seconds."""
    import itertools
    import time

    import triton
    from attnops.backends.triton.mla_launch import mla_launch, mla_plan
    batch, heads, latent = case["q_nope"].shape
    capacity = case["block_table"].shape[1] * case["kv_cache"].shape[1]
    if case["topk_indices"] is not None:  # (the sparse form's splits divide a row's entries)
        capacity = case["topk_indices"].shape[1]
    plan = mla_plan(batch, heads, capacity, latent, True)
    fmt = case["kv_format"]

    def timed(config):
        fn = lambda: mla_launch(case["q_nope"], case["q_pe"], case["kv_cache"], case["block_table"],  # noqa: E731
                                case["seq_lens"], None, scale=scale, kv_format=fmt, kv_scale=case["kv_scale"],
                                sinks=None, tree_mask=None, out=out, topk_indices=case["topk_indices"],
                                config=config)
        return graph_time_us(fn)

    rows = [dict(config="plan", us=timed(None), **{k: plan[k] for k in ("BLOCK_H", "BLOCK_N", "num_warps",
                                                                          "num_stages", "MAX_SPLITS")})]
    start = time.time()
    for values in itertools.product(*grid.values()):
        if time.time() - start > budget_s:
            break
        knobs = dict(zip(grid, values))
        factor = knobs.pop("split_factor")
        if knobs["BLOCK_H"] > max(16, triton.next_power_of_2(heads)):  # (rows of no head)
            continue
        base = mla_plan(batch, heads, capacity, latent, True, dict(BLOCK_H=knobs["BLOCK_H"],
                                                                   BLOCK_N=knobs["BLOCK_N"]))
        splits = max(1, round(base["MAX_SPLITS"] * factor))
        chunk = triton.cdiv(triton.cdiv(capacity, splits), knobs["BLOCK_N"]) * knobs["BLOCK_N"]
        try:
            us = timed({**knobs, "CHUNK": chunk})
        except Exception as e:  # (out of shared memory or registers: a config this GPU cannot run)
            rows.append(dict(**knobs, CHUNK=chunk, error=f"{type(e).__name__}"))
            continue
        rows.append(dict(**knobs, CHUNK=chunk, MAX_SPLITS=triton.cdiv(capacity, chunk), us=us))
    return rows


def flashinfer_fn(case, scale, out):
    """FlashInfer's BatchMLAPagedAttentionWrapper over the same cache (bf16 only), planned once (the plan is host
    work a serving loop does before its graph replays): the bench's `fi-mla` peer."""
    from attnops.bench.peers import flashinfer_mla_runner
    return flashinfer_mla_runner(case["q_nope"], case["q_pe"], case["kv_cache"], case["block_table"],
                                 case["seq_lens"], None, scale, out=out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", type=int, nargs="+", default=[16, 128], help="query heads (a TP shard's)")
    parser.add_argument("--cases", nargs="+", default=["1x32768", "32x8192", "128x4096"], help="BATCHxKV_LEN")
    parser.add_argument("--latent", type=int, default=512, help="R, the latent (compressed KV) width")
    parser.add_argument("--rope", type=int, default=64, help="P, the rotary part's width")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--kv-format", default="bf16", choices=["bf16", "fp8_e4m3", "fp8_ds_mla"])
    parser.add_argument("--backend", default="triton",
                        help="the attnops backend the op is pinned to (default triton; auto: dispatch's choice; "
                             "flashinfer: timed eagerly, a layer's call reusing its step's plan)")
    parser.add_argument("--timing", default="auto", choices=["auto", "graph", "eager"],
                        help="CUDA-graph replay or eager calls (auto: eager for flashinfer, whose host plan a graph "
                             "nobody re-plans cannot hold; graph otherwise)")
    parser.add_argument("--launch", action="store_true", help="time the kernel launcher, not the registered op")
    parser.add_argument("--sweep", action="store_true",
                        help="time Triton's launcher over a grid of tiles, warps, stages and splits per case")
    parser.add_argument("--sweep-budget", type=float, default=60, help="seconds of sweep per case (default 60)")
    parser.add_argument("--sweep-grid", nargs="+", help="narrow the sweep: KEY=V1,V2 ... over BLOCK_H, BLOCK_N, "
                                                        "num_warps, num_stages, split_factor (e.g. BLOCK_H=32,64 "
                                                        "split_factor=1,4)")
    parser.add_argument("--no-flashinfer", action="store_true", help="leave FlashInfer's wrapper out (e.g. under a "
                                                                          "profiler)")
    parser.add_argument("--topk", type=int, default=0, help="the sparse form: K listed positions a row (default 0: "
                        "every key)")
    parser.add_argument("--json", help="write the records here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("mla_decode.py needs a CUDA GPU")
    import attnops  # noqa: F401  (registers the ops)
    from attnops.backends.reference import mla_attention_reference
    records = []
    print(f"{'case':<28}{'attnops us':>12}{'TB/s':>8}{'of ceil':>9}{'TFLOP/s':>9}{'flashinfer us':>15}{'ratio':>8}")
    for heads in args.heads:
        for spec in args.cases:
            batch, kv_len = (int(x) for x in spec.split("x"))
            if args.topk > kv_len:
                sys.exit(f"--topk {args.topk} is more than {spec}'s {kv_len} keys")
            case = make_case(batch, kv_len, heads, args.latent, args.rope, args.page_size, args.kv_format,
                             topk=args.topk)
            scale = 1 / math.sqrt(192)  # DeepSeek's (qk_nope 128 + rope 64)^-0.5: not (R + P)^-0.5
            out = torch.empty_like(case["q_nope"])
            fn = attnops_fn(case, scale, out, not args.launch, args.backend)
            fn()
            # checked on the first two sequences (the float64 reference loops on the host)
            sub = slice(0, min(batch, 2))
            topk = case["topk_indices"]
            ref = mla_attention_reference(case["q_nope"][sub], case["q_pe"][sub], case["kv_cache"],
                                          case["block_table"][sub], case["seq_lens"][sub], scale=scale,
                                          kv_format=case["kv_format"], kv_scale=case["kv_scale"],
                                          topk_indices=None if topk is None else topk[sub])
            err = ((out[sub].double() - ref).norm() / ref.norm()).item()
            assert err < 2e-2, f"{spec} H{heads}: relative error {err:.3g}"
            timing = args.timing if args.timing != "auto" else "eager" if args.backend == "flashinfer" else "graph"
            ours = (eager_time_us if timing == "eager" else graph_time_us)(fn)
            row_bytes = case["kv_cache"].shape[-1] * case["kv_cache"].element_size()
            keys = args.topk or kv_len  # (a row's keys read)
            nbytes = batch * keys * row_bytes + 2 * out.numel() * 2 + \
                case["q_pe"].numel() * 2 + (0 if topk is None else topk.numel() * 4)
            tbs = nbytes / ours / 1e6
            tflops = 2 * batch * keys * heads * (2 * args.latent + args.rope) / ours / 1e6  # Q K^T and P V
            name = f"mla/{heads}/{spec}/{args.kv_format}" + (f"/top{args.topk}" if args.topk else "")
            record = dict(case=name, backend=args.backend, topk=args.topk,
                          timing=timing, heads=heads, batch=batch,
                          kv_len=kv_len, latent=args.latent, rope=args.rope, attnops_us=ours, tbs=tbs, tflops=tflops,
                          rel_error=err,
                          gpu=torch.cuda.get_device_name())
            if args.sweep:
                rows = sweep_case(case, scale, out, args.sweep_budget, sweep_grid(args.sweep_grid))
                timed_rows = sorted((r for r in rows if "us" in r), key=lambda r: r["us"])
                record["sweep"] = rows
                best = timed_rows[0]
                print(f"  sweep: plan {rows[0]['us']:.1f} us, best {best['us']:.1f} us at "
                      + ", ".join(f"{k}={v}" for k, v in best.items() if k not in ("us", "config")))
                for r in timed_rows[1:4]:
                    print(f"         {r['us']:.1f} us at " + ", ".join(f"{k}={v}" for k, v in r.items() if k != "us"))
            fi_text = f"{'-':>15}{'-':>8}"
            if args.kv_format == "bf16" and not args.no_flashinfer and not args.topk:
                try:
                    fi_out = torch.empty_like(out)
                    fi = flashinfer_fn(case, scale, fi_out)
                    fi()
                    fi_err = ((fi_out[sub].double() - ref).norm() / ref.norm()).item()
                    theirs = graph_time_us(fi)
                    record.update(flashinfer_us=theirs, flashinfer_rel_error=fi_err)
                    fi_text = f"{theirs:>15.1f}{theirs / ours:>8.2f}"
                except Exception as e:  # not installed, or no kernel for this shape
                    record["flashinfer"] = f"{type(e).__name__}: {e}"[:200]
            print(f"{record['case']:<28}{ours:>12.1f}{tbs:>8.2f}{tbs / hbm_tbps('cuda'):>9.2f}{tflops:>9.0f}{fi_text}")
            records.append(record)
            del case, out
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(records=records), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
