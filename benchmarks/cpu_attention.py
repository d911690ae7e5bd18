"""CPU decode benchmark: attnops' C++ kernel against what a CPU user would do without it.

    python benchmarks/cpu_attention.py                    # writes benchmarks/results/cpu_attention.json
    python benchmarks/cpu_attention.py --reps 30 --check  # exit 1 unless attnops beats gather+SDPA everywhere

Cases: decode, 8 x 2048 and 1 x 16384 tokens, Hq/Hkv/D = 32/8/128, fp32 and bf16 (q and cache), page_size 16,
pages in random order (as a real allocator leaves them). Compared, all through the public op or plain torch:
- attnops: `torch.ops.attnops.paged_attention` with the CPU backend (and the bare kernel, for the dispatch cost);
- gather+SDPA: the sequence's pages gathered into a dense K/V, then F.scaled_dot_product_attention. The gather is
  timed with it: on the CPU nothing else is paged, so it is what a user would pay. Two ways are timed and the bar
  is the faster one: "gqa" (dense [B, Hkv, L, D] copies, enable_gqa=True, as attnops/bench/peers.py does) and
  "rows" (the group's query heads as a query block of a [B, Hkv, G, D] q, against the gathered pages without a
  further copy);
- the reference backend (plain PyTorch, one sequence at a time): few repetitions, it is slow.

Each output is checked against the float64 reference before anything is timed. Timings are medians over rounds in
which every implementation runs once in turn, so that load from other processes on a shared machine falls on all of
them alike. All use torch.get_num_threads() threads.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import attnops  # noqa: E402
from attnops.backends import BACKENDS  # noqa: E402
from attnops.backends.reference import paged_attention_reference  # noqa: E402
from attnops.testing import random_paged_inputs, relative_error  # noqa: E402

CASES = [(8, 2048), (1, 16384)]  # (batch, kv_len)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
HEADS = dict(num_q_heads=32, num_kv_heads=8, head_dim=128)
PAGE_SIZE = 16
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def git_commit() -> str:
    if os.environ.get("ATTNOPS_COMMIT"):
        return os.environ["ATTNOPS_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).parent).stdout.strip()
        # "-dirty" when what is measured differs from the commit (other files may change in a shared tree)
        measured = ["csrc/cpu", "attnops/backends/cpu.py", "benchmarks/cpu_attention.py"]
        dirty = subprocess.run(["git", "status", "--porcelain", "--", *measured], capture_output=True, text=True,
                               cwd=Path(__file__).parent.parent).stdout.strip()
        return (out or "unknown") + ("-dirty" if dirty else "")
    except OSError:
        return "unknown"


def cpu_info() -> dict:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return dict(model=model, logical_cpus=os.cpu_count(), threads=torch.get_num_threads(),
                aten_capability=torch.backends.cpu.get_cpu_capability(), attnops_isa=BACKENDS["cpu"].isa())


# ----------------------------------------------------------------------------------------------------------------
# the implementations: each make_* returns a function of no arguments that returns the [B, Hq, D] output


def make_attnops(args):
    def run():
        with attnops.use_backend("cpu"):
            return torch.ops.attnops.paged_attention(**args)
    return run


def make_attnops_bare(args):
    """The C++ kernel called directly (no validation, no dispatch): the difference to make_attnops is overhead."""
    out = torch.empty_like(args["q"])
    kernel = torch.ops.attnops.cpu_paged_attention.default
    scale = args["q"].shape[-1] ** -0.5

    def run():
        kernel(args["q"], args["k_cache"], args["v_cache"], args["block_table"], args["seq_lens"], None, scale, 0.0,
               -1, None, None, out)
        return out
    return run


def make_reference(args):
    def run():
        with attnops.use_backend("reference"):
            return torch.ops.attnops.paged_attention(**args)
    return run


def gathered_pages(args, length):
    """K and V of every sequence, gathered from their pages: [B, L, Hkv, D] each (a copy)."""
    pages = args["block_table"][:, : -(-length // PAGE_SIZE)].long()
    k = args["k_cache"][pages].flatten(1, 2)[:, :length]
    v = args["v_cache"][pages].flatten(1, 2)[:, :length]
    return k, v


def make_sdpa_gqa(args, length):
    """Gather into dense [B, Hkv, L, D] K/V, then SDPA with enable_gqa (what attnops/bench/peers.py times)."""
    q = args["q"]

    def run():
        k, v = gathered_pages(args, length)
        k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, enable_gqa=True)  # [B, Hq, 1, D]
        return o.squeeze(2)
    return run


def make_sdpa_rows(args, length):
    """Gather, then SDPA with the group's query heads as the query rows of a [B, Hkv, G, D] q (no mask is needed:
    every head sees every key in decode), on the gathered pages as they are (a strided view, no second copy)."""
    q = args["q"]
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = args["k_cache"].shape[2]

    def run():
        k, v = gathered_pages(args, length)
        qg = q.view(batch, num_kv_heads, num_q_heads // num_kv_heads, head_dim)
        o = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2))
        return o.reshape(batch, num_q_heads, head_dim)
    return run


def time_round_robin(impls: dict, rounds: int) -> dict:
    """Median seconds of each impl, over `rounds` rounds that run every impl once in turn (after one warm-up). The
    order rotates from round to round, so that no impl always runs right after the one that leaves the caches
    (and the allocator) in the state it likes best."""
    names = list(impls)
    times = {name: [] for name in names}
    for fn in impls.values():
        fn()
    for i in range(rounds):
        for name in names[i % len(names):] + names[: i % len(names)]:
            start = time.perf_counter()
            impls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run_case(batch, length, dtype_name, reps, reference_reps) -> dict:
    dtype = DTYPES[dtype_name]
    args = random_paged_inputs([length] * batch, **HEADS, page_size=PAGE_SIZE, kv_format=dtype_name, q_dtype=dtype,
                               seed=batch * length, spare_pages=0, table_padding=0)
    args.pop("kv_format")
    impls = dict(attnops=make_attnops(args), attnops_bare=make_attnops_bare(args),
                 sdpa_gqa=make_sdpa_gqa(args, length), sdpa_rows=make_sdpa_rows(args, length))

    # correctness first: a fast wrong answer must not score
    expected = paged_attention_reference(**{**args, "q": args["q"].double()}, compute_dtype=torch.float64)
    errors = {name: relative_error(fn(), expected) for name, fn in impls.items()}
    for name, err in errors.items():
        limit = TOLERANCE[dtype_name] if name.startswith("attnops") else 2e-2
        if not err < limit:
            raise SystemExit(f"{name} on {batch}x{length} {dtype_name}: relative error {err:.3g} >= {limit}")

    seconds = time_round_robin(impls, reps)
    seconds["reference"] = time_round_robin(dict(reference=make_reference(args)), reference_reps)["reference"]
    kv_bytes = 2 * batch * length * HEADS["num_kv_heads"] * HEADS["head_dim"] * torch.finfo(dtype).bits // 8
    best_sdpa = min(seconds["sdpa_gqa"], seconds["sdpa_rows"])
    return dict(case=f"{batch}x{length}", batch=batch, kv_len=length, dtype=dtype_name, page_size=PAGE_SIZE, **HEADS,
                ms={k: round(v * 1e3, 4) for k, v in seconds.items()}, kv_bytes=kv_bytes,
                attnops_gbps=round(kv_bytes / seconds["attnops"] / 1e9, 2),
                speedup_vs_gather_sdpa=round(best_sdpa / seconds["attnops"], 2),
                speedup_vs_reference=round(seconds["reference"] / seconds["attnops"], 2),
                relative_error={k: float(f"{v:.3g}") for k, v in errors.items()},
                reps=reps, reference_reps=reference_reps)


def print_table(records):
    header = (f"{'case':>9} {'dtype':>5} | {'attnops':>9} {'(bare)':>8} {'GB/s':>6} | {'gather+SDPA':>11} "
              f"{'(gqa)':>8} {'(rows)':>8} | {'reference':>9} | {'vs SDPA':>7} {'vs ref':>7}")
    print(header)
    print("-" * len(header))
    for r in records:
        ms = r["ms"]
        best = min(ms["sdpa_gqa"], ms["sdpa_rows"])
        print(f"{r['case']:>9} {r['dtype']:>5} | {ms['attnops']:>7.2f}ms {ms['attnops_bare']:>6.2f}ms "
              f"{r['attnops_gbps']:>6.1f} | {best:>9.2f}ms {ms['sdpa_gqa']:>6.1f}ms {ms['sdpa_rows']:>6.1f}ms | "
              f"{ms['reference']:>7.1f}ms | {r['speedup_vs_gather_sdpa']:>6.1f}x {r['speedup_vs_reference']:>6.1f}x")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=20, help="timed rounds of attnops and gather+SDPA")
    parser.add_argument("--reference-reps", type=int, default=3, help="timed runs of the (slow) reference backend")
    parser.add_argument("--json", default=str(Path(__file__).parent / "results" / "cpu_attention.json"))
    parser.add_argument("--check", action="store_true", help="exit 1 unless attnops beats gather+SDPA everywhere")
    opts = parser.parse_args(argv)

    env = dict(commit=git_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, attnops=attnops.__version__,
               cpu=cpu_info(), command=" ".join([Path(sys.argv[0]).name] + sys.argv[1:]))
    print(f"attnops CPU decode benchmark: {env['cpu']['model']}, {env['cpu']['threads']} threads, "
          f"kernels {env['cpu']['attnops_isa']}, torch {env['torch']}, commit {env['commit']}")
    records = []
    for batch, length in CASES:
        for dtype_name in DTYPES:
            records.append(run_case(batch, length, dtype_name, opts.reps, opts.reference_reps))
            print(f"  {batch}x{length} {dtype_name}: attnops {records[-1]['ms']['attnops']:.2f} ms", flush=True)
    print()
    print_table(records)
    met = all(r["speedup_vs_gather_sdpa"] >= 1.0 for r in records)
    print(f"\nbar (attnops at least as fast as the faster gather+SDPA in every case): {'met' if met else 'NOT met'}")
    os.makedirs(os.path.dirname(opts.json) or ".", exist_ok=True)
    with open(opts.json, "w") as f:
        json.dump(dict(env=env, bar_met=met, records=records), f, indent=1)
    print(f"wrote {opts.json}")
    return 0 if met or not opts.check else 1


if __name__ == "__main__":
    sys.exit(main())
