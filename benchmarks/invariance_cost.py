"""The cost of batch-invariant mode, from `python -m attnops bench` JSON files of the same run: those timed in the
default mode, then `--`, then those timed with ATTNOPS_BATCH_INVARIANT=1. Per case (and backend) the best time of
each mode over its files (rounds), the ratio invariant / default, and the geometric mean and worst ratio per
backend (the bars: <= 1.05 geometric mean, <= 1.10 every case).

    python benchmarks/invariance_cost.py out/invariance-0-*.json -- out/invariance-1-*.json

Any other same-run A/B of two settings reads the same way, named by --labels (the second's time over the first's):

    python benchmarks/invariance_cost.py --labels one-token-a-block packed out/pack-0-*.json -- out/pack-1-*.json
"""
from __future__ import annotations

import argparse
import json
import math
import sys


DEFAULT_LABELS = ["default", "invariant"]
GEOMEAN_BAR, CASE_BAR = 1.05, 1.10  # the mode's cost: at most 5% geometric mean, 10% on every case


def best_times(paths: list[str]) -> dict:
    """(case, impl) -> the best CUDA-graph time (else the eager median) over the files, attnops backends only."""
    best: dict = {}
    for path in paths:
        with open(path) as f:
            for r in json.load(f)["records"]:
                if r.get("impl_type") != "backend" or r.get("status") != "ok":
                    continue
                us = r.get("graph_us", r.get("median_us"))
                if us is None or not us == us:
                    continue
                key = (r["case"], r["impl"])
                best[key] = min(us, best.get(key, math.inf))
    return best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="+", help="default-mode JSON files, --, invariant-mode JSON files")
    parser.add_argument("--labels", nargs=2, default=list(DEFAULT_LABELS), metavar=("A", "B"),
                        help="the two settings' names (default: default invariant)")
    raw = sys.argv[1:] if argv is None else list(argv)
    labels = parser.parse_args(raw).labels  # (--help; argparse drops the --, so the files are split from raw below)
    if "--labels" in raw:
        at = raw.index("--labels")
        raw = raw[:at] + raw[at + 3:]
    if "--" not in raw:
        parser.error(f"separate the {labels[0]} files from the {labels[1]} files with --")
    split = raw.index("--")
    default, invariant = best_times(raw[:split]), best_times(raw[split + 1:])
    common = sorted(set(default) & set(invariant))
    if not common:
        parser.error("no case timed in both settings")
    print(f"{'case':<48}{'impl':<10}{labels[0] + ' us':>16}{labels[1] + ' us':>16}{'ratio':>8}")
    ratios: dict = {}
    for case, impl in common:
        ratio = invariant[(case, impl)] / default[(case, impl)]
        ratios.setdefault(impl, []).append(ratio)
        print(f"{case:<48}{impl:<10}{default[(case, impl)]:>16.1f}{invariant[(case, impl)]:>16.1f}{ratio:>8.3f}")
    for impl, values in ratios.items():
        geomean = math.exp(sum(math.log(v) for v in values) / len(values))
        print(f"{impl}: {len(values)} cases, geometric mean {geomean:.3f}, worst {max(values):.3f}")
        if labels == DEFAULT_LABELS:  # batch-invariant mode's cost: say how it stands against its bars
            past = sum(v > CASE_BAR for v in values)
            print(f"  bars (geometric mean <= {GEOMEAN_BAR}, every case <= {CASE_BAR}): geometric mean "
                  f"{'met' if geomean <= GEOMEAN_BAR else 'missed'}, {past} of {len(values)} cases past {CASE_BAR}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
