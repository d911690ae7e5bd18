"""Writes the dispatch table for this GPU's arch: runs the benchmark grid for every attnops backend (or reads
benchmark JSON already made), and orders the backends of each case class (shape class / kv format / scale kind /
GQA group / head dim: dispatch.class_key) by the geometric mean of their time over the cases of that class that all of them served correctly.

Time is the CUDA-graph replay of the op (`graph_us`: kernel time, as a serving loop runs it) where a record has
it, else the eager op call (`median_us`, which includes the host's launch cost); one case compares like with like
(eager for all of its backends as soon as one lacks a graph time). Later files override earlier ones case by case.

    python -m attnops tune                                   # measure here, write attnops/tables/sm_XY.json
    python benchmarks/tune.py --from-json benchmarks/results/h200-grid-*.json --arch sm_90

With --from-json, runs where the flashinfer backend was not measured stand in the FlashInfer peers it calls:
decode -> tensor-core decode wrapper, verify -> fa2 paged prefill, prefill -> fa3 (the backend's own choice).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from attnops import dispatch  # noqa: E402

FLASHINFER_PEER_FOR = {"decode": "fi-decode-tensor-core", "verify": "fi-prefill-fa2", "prefill": "fi-prefill-fa3"}


def class_key(record) -> str:
    """The class key of a benchmark record, as dispatch looks it up (attnops.dispatch.class_key)."""
    fmt = record["kv_format"]
    scale = "none" if fmt in ("bf16", "fp16", "fp32") else ("block" if fmt in ("nvfp4", "mxfp4")
                                                             else record["scale_kind"])
    return dispatch.class_key(record["kind"], fmt, scale, record["num_q_heads"] // record["num_kv_heads"],
                              record["head_dim"])


def rank(cases) -> list:
    """Backends of a class, fastest first: by the geometric mean of their times over the cases every one of them
    served (else by their best time). `cases`: [backend -> us]."""
    names = sorted({n for t in cases for n in t})
    common = [t for t in cases if all(n in t for n in names)]

    def score(name):
        if common:
            return math.exp(sum(math.log(t[name]) for t in common) / len(common))
        return min(t[name] for t in cases if name in t)
    return sorted(names, key=score)


def build_table(records, backends) -> tuple[dict, list]:
    """(order per class; per-case check rows: the choice of the case's class against the fastest)."""
    measured = defaultdict(dict)  # case -> backend -> record
    keys = {}  # case -> class key
    for r in records:
        name = r["impl"] if r["impl_type"] == "backend" else None
        if name is None and "flashinfer" in backends and r["impl"] == FLASHINFER_PEER_FOR.get(r["kind"]):
            if not any(x["impl"] == "flashinfer" and x["case"] == r["case"] for x in records):
                name = "flashinfer"
        if name in backends and r.get("status") == "ok":
            measured[r["case"]][name] = r
            keys[r["case"]] = class_key(r)
    times = {}  # case -> backend -> us, one timing kind per case
    for case, per_backend in measured.items():
        field = "graph_us" if all("graph_us" in r for r in per_backend.values()) else "median_us"
        times[case] = {name: r[field] for name, r in per_backend.items()}
    by_class = defaultdict(list)
    for case, t in times.items():
        by_class[keys[case]].append(t)
    order = {key: rank(cases) for key, cases in sorted(by_class.items())}
    checks = []
    for case, t in sorted(times.items(), key=lambda item: keys[item[0]]):
        chosen = next(n for n in order[keys[case]] if n in t)
        checks.append(dict(case=case, cls=keys[case], chosen=chosen, chosen_us=t[chosen], fastest=min(t, key=t.get),
                           fastest_us=min(t.values()), slowdown=t[chosen] / min(t.values())))
    return order, checks


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attnops tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--from-json", nargs="*", help="benchmark JSON files to read instead of measuring")
    parser.add_argument("--arch", help="sm_XY (default: this GPU's)")
    parser.add_argument("--out", help="default: attnops/tables/<arch>.json")
    parser.add_argument("--backends", nargs="*", default=["flashinfer", "triton"])
    args, bench_args = parser.parse_known_args(argv)
    if args.from_json:
        records = [r for path in args.from_json for r in json.loads(Path(path).read_text())["records"]]
        sources = args.from_json
    else:
        import bench
        import torch
        result = bench.main(["--backends", *args.backends, "--peers", *bench_args])
        records, sources = result["records"], ["measured by python -m attnops tune"]
        args.arch = args.arch or "sm_%d%d" % torch.cuda.get_device_capability()
    if not args.arch:
        parser.error("--arch is needed with --from-json")
    order, checks = build_table(records, set(args.backends))
    out = Path(args.out or ROOT / "attnops" / "tables" / f"{args.arch}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(arch=args.arch, sources=sources, order=order, per_case=checks), indent=1))
    print(f"wrote {out}")
    for key, names in order.items():
        print(f"  {key:<40} {' > '.join(names)}")
    worst = sorted(checks, key=lambda c: -c["slowdown"])
    print("cases where the class's choice is not the fastest:")
    for c in worst:
        if c["slowdown"] > 1.0:
            print(f"  {c['case']:<44} chose {c['chosen']} {c['chosen_us']:.1f} us, fastest {c['fastest']} "
                  f"{c['fastest_us']:.1f} us ({(c['slowdown'] - 1) * 100:.1f}% slower)")


if __name__ == "__main__":
    main()
