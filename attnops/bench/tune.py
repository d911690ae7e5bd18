"""Writes the dispatch table for this GPU's arch: runs the models grid (attnops/bench/grid.py: the head shapes people
serve x every KV format x decode, verify, prefill and extend shapes, and latent attention's DeepSeek shards) for
every attnops backend and auto dispatch, or reads benchmark JSON already made, and fits the dispatch rules
(attnops/rules.py) to the times: one for paged attention, one for latent attention (its own backends).

Time is the CUDA-graph replay of the op (`graph_us`: kernel time, as a serving loop runs it) where every backend
of a case has one, else the eager op call (`median_us`). Later files override earlier ones case by case. The
table keeps, per case, the rule's choice against the fastest backend, and the same check for rules fitted
without each head shape in turn (how the rule does on a model it has never seen).

    python -m attnops tune                                  # measure here, write attnops/tables/sm_XY.json
    python -m attnops tune --from-json results.json --arch sm_90 --out table.json
"""
from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict
from pathlib import Path

from .. import formats, rules
import torch

from ..cases import MLACase, q_per_seq, shape_class
from ..dispatch import MLA_ORDER, STATIC_ORDER, TABLES, describe_attention
from . import require_matplotlib

FLASHINFER_PEER_FOR = {"decode": "fi-decode-tensor-core", "verify": "fi-prefill-fa2", "prefill": "fi-prefill-fa3"}


def flashinfer_peer(record) -> str | None:
    """The peer that stands for the flashinfer backend in a record's case (where the backend itself has no time)."""
    return "fi-mla" if record.get("latent_dim") else FLASHINFER_PEER_FOR.get(record["kind"])


def record_features(r) -> dict:
    """The rule's features of a benchmark record: rules.features of the case the op saw (one definition of them)."""
    fmt = r["kv_format"]
    decode = r["kind"] == "decode"
    batch = r.get("batch") or 1
    q_tokens = r.get("q_tokens", batch)
    if r.get("latent_dim"):
        return rules.features(MLACase(
            device_type="cpu", arch=None, q_dtype=torch.bfloat16, kv_format=fmt, latent_dim=r["latent_dim"],
            rope_dim=r["rope_dim"], num_heads=r["num_q_heads"], page_size=r.get("page_size", 64), decode=decode,
            shape_class=shape_class(decode, q_tokens, batch), batch=batch, max_kv_len=r.get("max_kv_len", 0)))
    case = describe_attention(
        device="cpu", arch=None, kv_format=fmt, head_dim=r["head_dim"], page_size=r.get("page_size", 16),
        num_q_heads=r["num_q_heads"], num_kv_heads=r["num_kv_heads"], decode=decode,
        scale_kind=r["scale_kind"] if formats.is_fp8(fmt) else formats.FORMATS[fmt].default_scale_kind,
        shape_class=shape_class(decode, q_tokens, batch), batch=batch, max_kv_len=r.get("max_kv_len", 0),
        q_per_seq=q_per_seq(decode, q_tokens, batch))
    return rules.features(case)


def head_shape(record) -> str:
    if record.get("latent_dim"):
        return f"{record['num_q_heads']}/{record['latent_dim']}+{record['rope_dim']}"
    return f"{record['num_q_heads']}/{record['num_kv_heads']}/{record['head_dim']}"


def collect(records, backends):
    """{case: (features, {backend: us}, head shape, auto's record or None)}, one timing kind per case."""
    measured, autos = defaultdict(dict), {}
    for r in records:
        if r.get("status") != "ok":
            continue
        if r["impl_type"] == "auto":
            autos[r["case"]] = r
            continue
        name = r["impl"] if r["impl_type"] == "backend" else None
        if name is None and "flashinfer" in backends and r["impl"] == flashinfer_peer(r):
            if not any(x["impl"] == "flashinfer" and x["case"] == r["case"] for x in records):
                name = "flashinfer"
        if name in backends:
            measured[r["case"]][name] = r
    cases = {}
    for case, per_backend in measured.items():
        field = "graph_us" if all("graph_us" in r for r in per_backend.values()) else "median_us"
        first = next(iter(per_backend.values()))
        times = {name: r[field] for name, r in per_backend.items() if math.isfinite(r.get(field, math.nan))}
        cases[case] = (record_features(first), times, head_shape(first), autos.get(case))
    return cases


def timed_formats(cases, names) -> dict:
    """{backend: the format families (formats.KVFormat.family) it has a time for}: dispatch puts a backend behind
    the timed ones on a format it was never timed on, whatever the rule's leaf says."""
    return {n: sorted({formats.family(f["kv_format"]) for f, t, _, _ in cases.values() if n in t})
            for n in names}


def check(rule, cases, names) -> list:
    """Per case timed on at least two backends of `names`: the rule's choice (the first of its leaf's order that
    has a time: one without declines the case, as dispatch would pass it over) against the fastest."""
    rows = []
    for case, (features, times, heads, _) in sorted(cases.items()):
        if sum(n in times for n in names) < 2:
            continue
        leaf, _ = rules.decide(rule, features)
        chosen = next(n for n in leaf["order"] if n in times)
        fastest = min(times, key=times.get)
        rows.append(dict(case=case, heads=heads, chosen=chosen, chosen_us=round(times[chosen], 2), fastest=fastest,
                         fastest_us=round(times[fastest], 2), slowdown=round(times[chosen] / times[fastest], 4)))
    return rows


def cross_validate(cases, names, lookahead: int = 1) -> list:
    """For each head shape: the rule fitted without it, checked on its cases."""
    rows = []
    for heads in sorted({c[2] for c in cases.values()}):
        train = [(f, t) for f, t, h, _ in cases.values() if h != heads]
        held_out = {k: c for k, c in cases.items() if c[2] == heads}
        if train and held_out:
            rows += check(rules.fit(train, names, lookahead=lookahead), held_out, names)
    return rows


def auto_rows(cases) -> list:
    """Auto dispatch as measured in the same run: its time (its own graph time for decode; the chosen backend's
    otherwise) against the fastest backend of the case."""
    rows = []
    for case, (_, times, heads, auto) in sorted(cases.items()):
        if auto is None or len(times) < 2:
            continue
        us = auto.get("graph_us") or times.get(auto.get("chosen"))
        if us is None:
            continue
        fastest = min(times, key=times.get)
        rows.append(dict(case=case, heads=heads, chosen=auto.get("chosen"), auto_us=round(us, 2), fastest=fastest,
                         fastest_us=round(times[fastest], 2), slowdown=round(us / times[fastest], 4)))
    return rows


def summary(rows, label) -> str:
    if not rows:
        return f"{label}: no case"
    worst = max(rows, key=lambda r: r["slowdown"])
    within = sum(1 for r in rows if r["slowdown"] <= rules.TOLERANCE)
    geo = math.exp(sum(math.log(r["slowdown"]) for r in rows) / len(rows))
    return (f"{label}: {within}/{len(rows)} cases within {round((rules.TOLERANCE - 1) * 100)}% of the fastest; "
            f"geometric-mean slowdown {geo:.4f}; worst {worst['case']} {worst['slowdown']:.3f}x")


def plot(per_case, held_out, autos, path, arch) -> None:
    """Each check's cases sorted by slowdown (chosen time / fastest time, same run): how many cases sit at 1.0,
    and how far the misses go."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for rows, label in ((per_case, "rule, on the cases it was fitted to"),
                        (held_out, "rule fitted without the case's head shape"),
                        (autos, "auto dispatch as timed (rule of the run's tree)")):
        if rows:
            values = sorted(r["slowdown"] for r in rows)
            ax.plot(range(1, len(values) + 1), values, marker=".", linewidth=1,
                    label=f"{label} ({sum(v <= rules.TOLERANCE for v in values)}/{len(values)} within 3%)")
    ax.axhline(rules.TOLERANCE, color="grey", linestyle="--", linewidth=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("cases, sorted")
    ax.set_ylabel("time of the chosen backend / fastest")
    ax.set_title(f"attnops dispatch on {arch}: chosen backend against the fastest, CUDA-graph times")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m attnops tune", description=__doc__.split("\n\n")[0],
                                     epilog="Other options go to the benchmark (python -m attnops bench --help).")
    parser.add_argument("--from-json", nargs="*", help="benchmark JSON files to read instead of measuring")
    parser.add_argument("--arch", help="sm_XY (default: this GPU's)")
    parser.add_argument("--out", help="the table dispatch reads (the rule and what it was fitted on); default: "
                                      "attnops/tables/<arch>.json")
    parser.add_argument("--checks-out", help="the rule's checks, case by case (on its own cases, held out by head "
                                             "shape, auto as timed); default: <arch>-rule-checks.json here")
    gpu_backends = [name for name in STATIC_ORDER["cuda"] if name != "reference"]  # (dispatch's list, one source)
    parser.add_argument("--backends", nargs="*", default=gpu_backends,
                        help=f"the backends to order (default: {' '.join(gpu_backends)})")
    parser.add_argument("--plot", help="a PNG of the checks: each case's time under the rule over its fastest")
    args, bench_args = parser.parse_known_args(argv)
    require_matplotlib(args.plot)
    if args.from_json:
        records = [r for path in args.from_json for r in json.loads(Path(path).read_text())["records"]]
        sources = args.from_json
    else:
        import torch
        if not torch.cuda.is_available():
            parser.error("measuring needs a CUDA GPU; on another machine, fit from benchmark JSON (--from-json)")
        from . import run as bench
        if "--grid" not in bench_args:
            bench_args += ["--grid", "models"]
        result = bench.main(["--backends", *args.backends, "--peers", "--auto", "--graph-only", *bench_args])
        records, sources = result["records"], ["measured by python -m attnops tune " + " ".join(bench_args)]
        args.arch = args.arch or "sm_%d%d" % torch.cuda.get_device_capability()
    if not args.arch:
        parser.error("--arch is needed with --from-json")
    names = list(args.backends)
    # paged attention's rule over `names`; latent attention's (when the records have its cases) over the backends
    # of `names` that serve it (dispatch.MLA_ORDER)
    table = dict(arch=args.arch, sources=sources, backends=names)
    evidence = dict(arch=args.arch, sources=sources, backends=names)
    fitted = []
    mla_names = [n for n in MLA_ORDER["cuda"] if n in names]
    for prefix, family, family_names in (("", False, names), ("mla_", True, mla_names)):
        cases = collect([r for r in records if bool(r.get("latent_dim")) == family], set(family_names))
        if family and not cases:
            continue
        # (latent attention's few cases afford two splits of look-ahead: its formats differ below a batch and a
        # head-count split)
        lookahead = 2 if family else 1
        rule = rules.fit([(f, t) for f, t, _, _ in cases.values()], family_names, lookahead=lookahead)
        checks = (check(rule, cases, family_names), cross_validate(cases, family_names, lookahead),
                  auto_rows(cases))
        # the package ships only what dispatch reads; the per-case evidence goes beside the benchmark results
        table.update({f"{prefix}timed_formats": timed_formats(cases, family_names), f"{prefix}rule": rule})
        if family:
            table["mla_backends"] = family_names
        evidence.update({f"{prefix}per_case": checks[0], f"{prefix}held_out_head_shapes": checks[1],
                         f"{prefix}auto_measured": checks[2]})
        fitted.append(("latent attention's rule" if family else "the rule", rule, checks))
    out = Path(args.out or TABLES / f"{args.arch}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(table, indent=1))
    checks_out = Path(args.checks_out or f"{args.arch}-rule-checks.json")
    checks_out.write_text(json.dumps(evidence, indent=1))
    print(f"wrote {out} and {checks_out}")
    for label, rule, (per_case, held_out, autos) in fitted:
        print(f"\n{label}:\n{rules.render(rule)}")
        print(summary(per_case, "the rule on the cases it was fitted to"))
        print(summary(held_out, "fitted without each head shape, on that head shape's cases"))
        print(summary(autos, "auto dispatch as timed in the runs read (with the rule installed when they ran)"))
        for kind, rows in (("rule", per_case), ("held out", held_out), ("auto", autos)):
            for r in rows:
                if r["slowdown"] > rules.TOLERANCE:
                    print(f"  {kind}: {r['case']:<48} chose {r['chosen']} ({r['slowdown']:.3f}x the fastest, "
                          f"{r['fastest']})")
    if args.plot:
        plot(*fitted[0][2], args.plot, args.arch)
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
