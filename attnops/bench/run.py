"""The benchmark suite: every case of the grid, for every attnops backend that supports it and every peer, checked
against the reference before it is timed (a fast wrong kernel must not score).

    python -m attnops bench --json h200.json --plot h200.png
    python -m attnops bench --cpu                        # the small CPU grid (CI, CPU users)

Decode is reported as achieved TB/s (KV bytes read in the stored format with scales, plus q and out, over the
median time) and as a fraction of the GPU's datasheet HBM bandwidth (H200: 4.8 TB/s); every case also as TFLOP/s
(causal FLOPs) and as a fraction of a bf16 matmul measured in the same run. docs/bench.md is the protocol.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import fnmatch
import functools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

import attnops

from .. import formats
from ..backends import BACKENDS
from ..backends.reference import mla_attention_reference, paged_attention_reference
from ..checks import attention_call
from ..checks_mla import mla_call
from ..serving.spec import tree_mask_from_parents
from ..testing import random_mla_inputs, random_paged_inputs, relative_error
from . import grid as grid_module
from . import peers as peers_module
from . import require_matplotlib

HBM_TBPS = 4.8  # H200 datasheet: the ceiling where the GPU is not in HBM_TBPS_BY_GPU
# datasheet HBM bandwidth (TB/s) by a substring of torch.cuda.get_device_name, most specific first
HBM_TBPS_BY_GPU = (("H200", 4.8), ("H100 NVL", 3.9), ("H100 PCIe", 2.0), ("H100", 3.35), ("A100-SXM4-80GB", 2.04),
                   ("A100", 1.555))


@functools.lru_cache(maxsize=None)
def hbm_tbps(device) -> float:
    """The datasheet HBM bandwidth of `device`'s GPU (TB/s): the ceiling decode's bytes are measured against."""
    if torch.device(device).type != "cuda":
        return HBM_TBPS
    name = torch.cuda.get_device_name(device)
    return next((tbps for key, tbps in HBM_TBPS_BY_GPU if key in name), HBM_TBPS)
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 2e-2}  # vs the reference on the same stored cache


def case_bytes(case, q_dtype) -> int:
    """KV bytes read in the stored format (scales included), plus q read and out written. Latent attention: each
    token's latent row once (R + P values), q of R + P and out of R values a head."""
    tokens = sum(case.kv_lens)
    q_tokens = len(case.kv_lens) if case.q_lens is None else sum(case.q_lens)
    q_bytes = torch.finfo(q_dtype).bits // 8
    if case.latent:
        width = case.latent_dim + case.rope_dim
        if case.kv_format == formats.LATENT_FP8_FORMAT:  # (its scales and bf16 rotary part included)
            kv = tokens * formats.latent_fp8_row_bytes(case.latent_dim, case.rope_dim)
        else:
            kv = tokens * width * formats.FORMATS[case.kv_format].bytes_per_value()
        return int(kv + q_tokens * case.num_q_heads * (width + case.latent_dim) * q_bytes)
    kv = 2 * tokens * case.num_kv_heads * case.head_dim * formats.FORMATS[case.kv_format].bytes_per_value()
    qo = 2 * q_tokens * case.num_q_heads * case.head_dim * q_bytes
    return int(kv + qo)


def case_flops(case) -> float:
    """Causal attention FLOPs: 2 * Hq * (D_qk + D_v) * sum(q_len * kv_len - q_len^2 / 2) (D_qk = D_v = D; latent
    attention: R + P and R)."""
    q_lens = [1] * len(case.kv_lens) if case.q_lens is None else case.q_lens
    dims = 2 * case.latent_dim + case.rope_dim if case.latent else 2 * case.head_dim
    return 2.0 * case.num_q_heads * dims * sum(q * n - q * q / 2 for q, n in zip(q_lens, case.kv_lens))


def time_us(fn, device_type: str, rep_ms: int = 100) -> float:
    """Median time of fn() in microseconds: CUDA events through triton's do_bench on the GPU, host clock on the
    CPU (where it is synchronous)."""
    if device_type == "cuda":
        import triton
        return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3
    fn()
    times, deadline = [], time.perf_counter() + max(rep_ms, 200) / 1e3
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


GRAPH_CALLS = 10  # calls captured per graph: the replay's own launch is shared by ten


def graph_time_us(fn, rep_ms: int = 100, host_seq_lens=None) -> float:
    """Median GPU time of one fn() replayed from a CUDA graph, as a serving loop runs it: the host's launch cost
    (Python, the op layer, Triton's launcher, FlashInfer's run()) is out of the number, so it is the kernels'
    own time and the gaps between them. Raises if fn cannot be captured (host syncs, a plan inside capture).

    With `host_seq_lens` the capture is one that re-plans (attnops.capture.capturing, as attnops.serving.graphs captures a
    decode step), so dispatch chooses as it does in a served decode loop; the lengths never change between these
    replays, so none re-plans. Without, a plain capture (where the op passes over host-planned backends)."""
    import triton
    from attnops.capture import CaptureContext, capturing
    ctx = capturing(CaptureContext(len(host_seq_lens), host_seq_lens=list(host_seq_lens))) \
        if host_seq_lens is not None else contextlib.nullcontext()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with ctx:
        with torch.cuda.stream(side):  # warm-up off the capture: compiles, plans, allocator
            fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(GRAPH_CALLS):
                fn()
    us = triton.testing.do_bench(graph.replay, warmup=25, rep=rep_ms, return_mode="median") * 1e3 / GRAPH_CALLS
    del graph
    return us


def matmul_tflops(device) -> float:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / (time_us(lambda: a @ b, "cuda") * 1e-6) / 1e12


def make_args(case, device, q_dtype):
    if case.latent:  # (a model's true scale is not (R + P)^-0.5; any fixed one times the same work)
        return random_mla_inputs(case.kv_lens, case.q_lens, num_heads=case.num_q_heads, latent_dim=case.latent_dim,
                                 rope_dim=case.rope_dim, page_size=case.page_size, q_dtype=q_dtype,
                                 kv_format=case.kv_format if case.kv_format in ("fp8_e4m3", "fp8_ds_mla") else "auto",
                                 device=device,
                                 seed=sum(case.kv_lens) % 9973, spare_pages=0, table_padding=0,
                                 scale=(case.latent_dim + case.rope_dim) ** -0.5)
    args = random_paged_inputs(case.kv_lens, case.q_lens, num_q_heads=case.num_q_heads,
                               num_kv_heads=case.num_kv_heads, head_dim=case.head_dim, page_size=case.page_size,
                               kv_format=case.kv_format, q_dtype=q_dtype, scale_kind=case.scale_kind, device=device,
                               seed=sum(case.kv_lens) % 9973, table_padding=0)
    if case.sinks:
        args["sinks"] = torch.randn(case.num_q_heads, generator=torch.Generator().manual_seed(1)).to(device)
    if case.tree:
        args["tree_mask"] = tree_mask_from_parents([grid_module.tree_parents(n, case.tree) for n in case.q_lens],
                                                   device=device)
    return args


def reference_output(case, args):
    if case.latent:
        return mla_attention_reference(**args, compute_dtype=torch.float32)
    return paged_attention_reference(**args, compute_dtype=torch.float32)


def mla_backend_runner(backend, args):
    """backend_runner for a latent-attention case: mla_attention, and the backend's own call."""
    op_args = dict(args)
    out = torch.empty_like(args["q_nope"])
    call = mla_call(args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"], args["seq_lens"],
                    args["cu_seqlens_q"], args["scale"], args["kv_format"], args.get("kv_scale"), None, None, out)
    reasons = backend.unavailable() + backend.supports(call.case)
    if reasons:
        raise peers_module.Unsupported("; ".join(reasons))

    def op():
        with attnops.use_backend(backend.name):
            return torch.ops.attnops.mla_attention(**op_args)

    def bare():
        backend.mla_attention(call)
        return out
    return op, bare


def backend_runner(name, case, args):
    """(op call, bare backend call) for attnops backend `name`, or raise Unsupported with its reasons."""
    backend = BACKENDS[name]
    if case.latent:
        return mla_backend_runner(backend, args)
    op_args = dict(args)
    out = torch.empty_like(args["q"])
    call = attention_call(
        op_args["q"], op_args["k_cache"], op_args["v_cache"], op_args["block_table"], op_args["seq_lens"],
        op_args["cu_seqlens_q"], None, 0.0, -1, op_args["kv_format"], op_args.get("k_scale"), op_args.get("v_scale"),
        op_args.get("sinks"), op_args.get("tree_mask"), out)
    reasons = backend.unavailable() + backend.supports(call.case)
    if reasons:
        raise peers_module.Unsupported("; ".join(reasons))

    def op():
        with attnops.use_backend(name):
            return torch.ops.attnops.paged_attention(**op_args)

    def bare():
        backend.paged_attention(call)
        return out
    return op, bare


def auto_runner(args):
    """The op under automatic dispatch, and the backend it chooses in eager calls and in a re-planned capture."""
    op_args = dict(args)
    op = torch.ops.attnops.mla_attention if "q_nope" in args else torch.ops.attnops.paged_attention
    return (lambda: op(**op_args)), attnops.explain(**op_args).chosen


def git_commit() -> str:
    if os.environ.get("ATTNOPS_COMMIT"):  # set by the caller where the tree has no git history
        return os.environ["ATTNOPS_COMMIT"]
    here = Path(__file__).parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here).stdout.strip()
        # a tree whose tracked files differ from that commit ran something else: say so
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                 text=True, cwd=here).stdout.strip()
    except OSError:
        return "unknown"
    return (commit + "-modified" if changed else commit) if commit else "unknown"


def environment(device) -> dict:
    env = dict(commit=git_commit(), date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               python=platform.python_version(), torch=torch.__version__, device=str(device),
               hbm_ceiling_tbps=hbm_tbps(device), attnops=attnops.__version__)
    for module in ("triton", "flashinfer"):
        try:
            env[module] = __import__(module).__version__
        except Exception:  # not installed, or fails to import here
            env[module] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["arch"] = "sm_%d%d" % torch.cuda.get_device_capability(device)
    else:
        env["gpu"] = None
        env["cpu"] = platform.processor() or platform.machine()
        env["threads"] = torch.get_num_threads()
    return env


class Uncapturable(Exception):
    """A graph-only run's impl that no CUDA graph could capture: nothing of it was timed."""


def run_case(case, impls, device, q_dtype, timing_rep_ms, progress, graph_only=False) -> list:
    """Every impl of `impls` on one case: check, then time. Returns one record per impl. Backends and auto time
    a decode case's graph in a re-planned capture (as attnops.serving.graphs runs it), other cases' graphs through the
    backend's own call (`bare`: the kernels the op launches), auto's not at all (its choice is recorded)."""
    args = make_args(case, device, q_dtype)
    reference = reference_output(case, args)
    tolerance = TOLERANCE["fp32" if q_dtype == torch.float32 and case.kv_format == "fp32" else "bf16"]
    nbytes, flops = case_bytes(case, q_dtype), case_flops(case)
    records = []
    for impl_name, (impl_type, make) in impls.items():
        record = dict(case=case.name, **case.describe(), impl=impl_name, impl_type=impl_type, bytes=nbytes,
                      flops=flops, status="ok")
        try:
            if impl_type == "backend":
                op, bare = backend_runner(impl_name, case, args)
            elif impl_type == "auto":
                (op, record["chosen"]), bare = auto_runner(args), None
            else:
                op, bare = make(case, args), None
            out = op()
            err = relative_error(out, reference)
            record["rel_err"] = err
            if not err <= tolerance:  # NaN fails too
                record.update(status="wrong", reason=f"relative error {err:.3g} > {tolerance:g}: not timed")
            else:
                if not graph_only or device.type != "cuda":
                    record["median_us"] = time_us(op, device.type, timing_rep_ms)
                    if bare is not None:
                        record["bare_us"] = time_us(bare, device.type, timing_rep_ms)
                        record["dispatch_overhead_us"] = record["median_us"] - record["bare_us"]
                    if getattr(op, "gather", None) is not None:
                        record["gather_us"] = time_us(op.gather, device.type, timing_rep_ms)
                if device.type == "cuda" and (impl_type != "auto" or case.q_lens is None):
                    decode_op = impl_type != "peer" and case.q_lens is None
                    try:
                        record["graph_us"] = graph_time_us(
                            op if decode_op or bare is None else bare, timing_rep_ms,
                            host_seq_lens=case.kv_lens if decode_op else None)
                        record["graph_tbps"] = nbytes / record["graph_us"] / 1e6
                    except Exception as e:  # not capturable: the eager numbers stand alone
                        record["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                if "median_us" not in record and "graph_error" in record:  # (graph-only: nothing was timed)
                    raise Uncapturable(record["graph_error"])
                if "median_us" not in record:  # (graph-only; auto's own time on decode cases only: NaN otherwise)
                    record.update(median_us=record.get("graph_us", float("nan")), median_is_graph=True)
                seconds = record["median_us"] * 1e-6
                record["tbps"] = nbytes / seconds / 1e12
                record["gbps"] = record["tbps"] * 1e3
                record["frac_of_hbm"] = record["tbps"] / hbm_tbps(device)
                record["tflops"] = flops / seconds / 1e12
        except peers_module.Unsupported as e:
            record.update(status="unsupported", reason=str(e))
        except Uncapturable as e:
            record.update(status="uncapturable", reason=str(e))
        except Exception as e:  # a crash of one impl must not lose the run: record it
            record.update(status="error", reason=f"{type(e).__name__}: {e}"[:500])
        records.append(record)
        progress.update(1)
    for key, speedup in (("median_us", "speedup_vs_best_peer"), ("graph_us", "graph_speedup_vs_best_peer")):
        peer_times = [r[key] for r in records if r["impl_type"] == "peer" and key in r]
        for r in records:
            if key in r and peer_times:
                r[speedup] = min(peer_times) / r[key]
    del args, reference
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records


def print_table(records, file=sys.stdout, hbm_ceiling: float = HBM_TBPS) -> None:
    """One row per case and impl. `x peer`: the best peer's time over this impl's (above 1: faster than every
    peer), eager and graph; `op-bare`: the op's eager time minus the bare backend call's (dispatch and validation
    cost; on a loaded host it is noise and may come out negative)."""
    header = (f"{'case':<44} {'impl':<22} {'status':<11} {'us':>9} {'GB/s':>7} {'HBM%':>5} {'TFLOP/s':>8} "
              f"{'MMA%':>5} {'x peer':>7} {'op-bare':>8} {'graph us':>9} {'graph x peer':>12}")
    print(header, file=file)
    print("-" * len(header), file=file)
    for r in records:
        def fmt(key, spec, times=1):
            return format(r[key] * times, spec) if key in r else ""
        print(f"{r['case']:<44} {r['impl']:<22} {r['status']:<11} {fmt('median_us', '9.1f')} {fmt('gbps', '7.0f')} "
              f"{fmt('frac_of_hbm', '5.0f', 100)} {fmt('tflops', '8.1f')} {fmt('frac_of_matmul', '5.0f', 100):>5} "
              f"{fmt('speedup_vs_best_peer', '7.2f')} {fmt('dispatch_overhead_us', '8.1f')} "
              f"{fmt('graph_us', '9.1f')} {fmt('graph_speedup_vs_best_peer', '12.2f')}",
              file=file)
    print(f"HBM% (GPU): GB/s over its {hbm_ceiling} TB/s datasheet bandwidth; MMA% (GPU): TFLOP/s over a bf16 "
          "matmul of the same run. x peer: the best peer's time / this impl's (eager; graph: CUDA-graph replay). "
          "op-bare: eager op time minus the bare backend call (us).", file=file)
    if any(r.get("dispatch_overhead_us", 0) < 0 for r in records):
        print("note: some op-bare values are negative: the host was busy or the two timings are within noise; "
              "rerun on a quiet machine for overheads.", file=file)


def plot(result, path) -> None:
    """Bars: achieved TB/s per decode/verify case and impl from the CUDA-graph replay (kernel time) where it was
    measured, else eager; a black tick marks the eager op call (host launch cost included) where they differ.
    Prefill: TFLOP/s against the bf16 matmul of the same run (a panel only when the run has prefill cases)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [r for r in result["records"] if "tbps" in r]
    decode = [r for r in records if r["kind"] != "prefill"]
    prefill = [r for r in records if r["kind"] == "prefill"]
    cases = list(dict.fromkeys(r["case"] for r in decode))
    impls = list(dict.fromkeys(r["impl"] for r in records))
    panels = 2 if prefill else 1
    fig, axes = plt.subplots(panels, 1, figsize=(max(12, len(cases) * 0.45), 11 if prefill else 8),
                             gridspec_kw=dict(height_ratios=[3, 1] if prefill else [1]), squeeze=False)
    axes = axes[:, 0]
    width = 0.8 / max(1, len(impls))
    colors = {impl: plt.cm.tab10(i % 10) for i, impl in enumerate(impls)}
    for i, impl in enumerate(impls):
        mine = {r["case"]: r for r in decode if r["impl"] == impl}
        xs = [c for c in range(len(cases)) if cases[c] in mine]
        bars = [mine[cases[x]].get("graph_tbps", mine[cases[x]]["tbps"]) for x in xs]
        axes[0].bar([x + i * width for x in xs], bars, width, label=impl, color=colors[impl])
        eager = [(x + i * width, mine[cases[x]]["tbps"]) for x in xs if "graph_tbps" in mine[cases[x]]]
        if eager:
            axes[0].scatter(*zip(*eager), marker="_", color="black", s=40, zorder=3,
                            label="eager op call" if i == 0 else None)
    ceiling = result["environment"].get("hbm_ceiling_tbps", HBM_TBPS)
    axes[0].axhline(ceiling, color="red", linestyle="--", label=f"HBM ceiling {ceiling} TB/s")
    axes[0].set_xticks([x + 0.4 for x in range(len(cases))], cases, rotation=75, ha="right", fontsize=7)
    axes[0].set_ylabel("achieved TB/s (stored bytes; CUDA-graph replay)")
    axes[0].set_title(f"decode / verify: {result['environment'].get('gpu') or result['environment'].get('cpu')}, "
                      f"commit {result['environment']['commit'][:8]}")
    axes[0].legend(fontsize=7, ncol=3)
    if prefill:
        pcases = list(dict.fromkeys(r["case"] for r in prefill))
        for i, impl in enumerate(impls):
            by_case = {r["case"]: r["flops"] / (r.get("graph_us", r["median_us"]) * 1e6) for r in prefill
                       if r["impl"] == impl}
            xs = [c for c in range(len(pcases)) if pcases[c] in by_case]
            axes[1].bar([x + i * width for x in xs], [by_case[pcases[x]] for x in xs], width, color=colors[impl])
        if result["environment"].get("matmul_tflops"):
            axes[1].axhline(result["environment"]["matmul_tflops"], color="red", linestyle="--",
                            label="bf16 matmul (measured)")
            axes[1].legend(fontsize=7)
        axes[1].set_xticks([x + 0.4 for x in range(len(pcases))], pcases, fontsize=7)
        axes[1].set_ylabel("prefill TFLOP/s")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def select(items, patterns):
    if not patterns:
        return list(items)
    return [i for i in items if any(fnmatch.fnmatch(i, p) or p in i for p in patterns)]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m attnops bench", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="the small CPU grid, on the CPU")
    parser.add_argument("--grid", choices=sorted(grid_module.GRIDS), help="default: gpu, or cpu with --cpu")
    parser.add_argument("--cases", nargs="*", help="case names or globs (substring match too)")
    parser.add_argument("--groups", nargs="*", help="groups: decode-small, decode-large, verify, formats, heads...")
    parser.add_argument("--formats", nargs="*", help="kv formats: bf16 fp8_e4m3 nvfp4 ...")
    parser.add_argument("--backends", nargs="*", help="attnops backends (default: every one but reference)")
    parser.add_argument("--peers", nargs="*", help="peers (default: all for the device; --peers alone: none)")
    parser.add_argument("--rep-ms", type=int, default=100, help="timing budget per measurement (ms)")
    parser.add_argument("--auto", action="store_true",
                        help="also time the op under automatic dispatch (impl 'auto'; its choice is recorded)")
    parser.add_argument("--graph-only", action="store_true",
                        help="on a GPU, time CUDA-graph replays only (no eager op or bare-backend timings)")
    parser.add_argument("--json", help="write the records here")
    parser.add_argument("--plot", help="write a PNG here (matplotlib)")
    args = parser.parse_args(argv)
    require_matplotlib(args.plot)

    device = torch.device("cpu" if args.cpu or not torch.cuda.is_available() else "cuda")
    grid_name = args.grid or ("cpu" if device.type == "cpu" else "gpu")
    q_dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    cases = grid_module.GRIDS[grid_name]()
    cases = [c for c in cases if c.name in set(select([c.name for c in cases], args.cases))]
    if args.groups:
        cases = [c for c in cases if c.group in args.groups]
    if args.formats:
        cases = [c for c in cases if c.kv_format in args.formats]
    backend_names = args.backends if args.backends is not None else [n for n in BACKENDS if n != "reference"]
    unknown = set(backend_names) - set(BACKENDS)
    if unknown:
        parser.error(f"unknown backends {sorted(unknown)}; known: {sorted(BACKENDS)}")
    all_peers = peers_module.CPU_PEERS if device.type == "cpu" else peers_module.GPU_PEERS
    peer_names = args.peers if args.peers is not None else list(all_peers)
    impls = {n: ("backend", None) for n in backend_names}
    impls.update({n: ("peer", all_peers[n]) for n in peer_names})
    if args.auto:
        impls["auto"] = ("auto", None)

    env = environment(device)
    if device.type == "cuda":
        env["matmul_tflops"] = matmul_tflops(device)
    from tqdm import tqdm
    records = []
    with tqdm(total=len(cases) * len(impls), desc="attnops bench", unit="run", file=sys.stderr) as progress:
        for case in cases:
            progress.set_postfix_str(case.name)
            case_records = run_case(case, impls, device, q_dtype, args.rep_ms, progress, args.graph_only)
            for r in case_records:  # the tensor cores' ceiling beside the bytes' (frac_of_hbm)
                if "tflops" in r and env.get("matmul_tflops"):
                    r["frac_of_matmul"] = r["tflops"] / env["matmul_tflops"]
            records += case_records
            if args.json:  # after every case: a run stopped part-way keeps what it measured
                Path(args.json).parent.mkdir(parents=True, exist_ok=True)
                Path(args.json).write_text(json.dumps(dict(environment=env, records=records), indent=1, default=str))
    result = dict(environment=env, records=records)
    if args.plot:
        plot(result, args.plot)
    print_table(records, hbm_ceiling=env["hbm_ceiling_tbps"])
    return result


if __name__ == "__main__":
    main()
