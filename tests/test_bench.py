"""The benchmark suite's CPU mode on a tiny grid: the JSON has its schema, and a backend that is fast but wrong is
reported as wrong, never timed."""
import json

import pytest
import torch

from attnops.backends import BACKENDS
from attnops.backends.reference import ReferenceBackend
from attnops.bench import run as bench


class WrongOnPurpose(ReferenceBackend):
    name = "wrong-on-purpose"

    def paged_attention(self, call):
        super().paged_attention(call)
        call.out.mul_(1.1)  # 10% off: far outside the tolerance


def test_cpu_mode_schema_and_correctness_gate(tmp_path, monkeypatch):
    monkeypatch.setitem(BACKENDS, "wrong-on-purpose", WrongOnPurpose())
    path = tmp_path / "bench.json"
    bench.main(["--cpu", "--cases", "cpu-decode/4x512/fp32", "cpu-verify/2x512/q4/fp32", "--backends",
                "reference", "wrong-on-purpose", "--rep-ms", "20", "--json", str(path), "--plot",
                str(tmp_path / "bench.png")])
    result = json.loads(path.read_text())
    env = result["environment"]
    for key in ("commit", "torch", "device", "date", "hbm_ceiling_tbps"):
        assert key in env
    records = result["records"]
    assert {r["case"] for r in records} == {"cpu-decode/4x512/fp32", "cpu-verify/2x512/q4/fp32"}
    assert {r["impl"] for r in records} == {"reference", "wrong-on-purpose", "gather+sdpa"}
    for r in records:
        for key in ("case", "impl", "impl_type", "status", "kind", "batch", "kv_tokens", "bytes", "flops"):
            assert key in r, key
        if r["impl"] == "wrong-on-purpose":
            assert r["status"] == "wrong" and "median_us" not in r and r["rel_err"] > 0.05
        else:
            assert r["status"] == "ok", r
            assert r["median_us"] > 0 and r["tbps"] == r["bytes"] / (r["median_us"] * 1e-6) / 1e12
            assert r["rel_err"] < 1e-4
            assert r["speedup_vs_best_peer"] > 0
    reference = [r for r in records if r["impl"] == "reference"]
    assert all("dispatch_overhead_us" in r for r in reference)
    assert (tmp_path / "bench.png").stat().st_size > 0
    assert torch.isfinite(torch.tensor([r["median_us"] for r in reference])).all()


def test_spec_grid_cases_carry_sinks_and_tree_masks_to_the_kernels():
    from attnops.backends.reference import paged_attention_reference
    from attnops.bench import grid
    from attnops.bench import peers
    from attnops.testing import relative_error
    cases = grid.spec_grid()
    assert any(c.sinks for c in cases) and {c.tree for c in cases} >= {2, 3, 4}
    assert {tuple(c.q_lens or ()) for c in cases if c.tree} == {(16,) * 32, (64,) * 32}
    small = grid.Case("tiny-tree", "spec-tree", [70, 40], [9, 5], num_q_heads=8, num_kv_heads=2, head_dim=64,
                      kv_format="fp32", sinks=True, tree=3)
    args = bench.make_args(small, torch.device("cpu"), torch.float32)
    assert args["tree_mask"].shape == (14, 9) and args["sinks"].shape == (8,)
    op, bare = bench.backend_runner("cpu", small, args)
    expected = paged_attention_reference(**args)
    assert relative_error(op(), expected) < 1e-5 and relative_error(bare(), expected) < 1e-5
    plain = {k: v for k, v in args.items() if k not in ("sinks", "tree_mask")}
    assert relative_error(paged_attention_reference(**plain), expected) > 1e-2  # they were applied
    try:
        peers.sdpa_on_gathered(small, args)
        raise AssertionError("a peer timed a case without its sinks and tree mask")
    except peers.Unsupported:
        pass


def test_serve_bench_reads_result_files_older_than_its_model_code_retirement(tmp_path):
    """Result files from before attnops/serving/model.py was retired hold its records (model_code "attnops", or
    no model_code, family or kv_format at all in the oldest): they are labelled, plotted and left out of the
    summary, which compares transformers' modeling code through attnops with transformers' own paths only."""
    from attnops.bench import serve
    point = dict(family="llama", batch=32, context=1024, kv_format="bf16")
    records = [dict(point, model_code="transformers", mode="compiled+graphs", tokens_per_s=300.0, error=None),
               dict(point, model_code="attnops", mode="compiled+graphs", tokens_per_s=310.0, error=None),
               dict(point, model_code="transformers", mode="transformers", tokens_per_s=100.0, error=None),
               dict(mode="compiled", batch=32, context=1024, tokens_per_s=200.0, error=None)]  # the oldest form
    assert [serve.label(r) for r in records] == ["compiled+graphs bf16", "compiled+graphs model.py bf16",
                                                 "transformers (sdpa, static cache)", "compiled"]
    (line,) = serve.summary(records)
    assert line["mode"] == "compiled+graphs" and line["tokens_per_s"] == 300.0
    assert line["vs_transformers"] == 3.0 and "vs_model_py" not in line
    result = dict(records=records, environment=dict(gpu="test", commit="0" * 40), dtype="bf16")
    serve.plot(result, tmp_path / "old.png")
    assert (tmp_path / "old.png").stat().st_size > 1000


def _xor_of_bytes(*tensors) -> int:
    import numpy as np
    data = np.concatenate([t.contiguous().view(torch.uint8).reshape(-1).numpy() for t in tensors])
    return int(np.bitwise_xor.reduce(data)) if data.size else 0


def test_decode_breakdown_paged_read_reads_exactly_the_bytes_a_decode_reads():
    """benchmarks/decode_breakdown.py's paged read (the limit a decode is compared with) XORs the K and V rows (and
    4-bit scale rows) of each program's keys: checked program by program against the bytes the block table points
    at, for fixed splits (the cuda backend's plan) and splits by length (Triton's), on ragged lengths with 0 and 1."""
    import importlib.util
    import math
    from pathlib import Path
    from attnops.testing import random_paged_inputs
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "decode_breakdown.py"
    spec = importlib.util.spec_from_file_location("decode_breakdown", path)
    breakdown = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(breakdown)
    lens = [0, 1, 300, 37]
    cases = (("fp16", 64, 16, (3, 128, 0)), ("fp8_e4m3", 128, 8, (4, 64, 32)), ("nvfp4", 64, 16, (4, 64, 32)),
             ("mxfp4", 128, 32, (2, 256, 0)))  # (format, head dim, page size, (splits, chunk, split_align))
    for fmt, head_dim, page, (splits, chunk, align) in cases:
        args = random_paged_inputs(lens, num_q_heads=4, num_kv_heads=2, head_dim=head_dim, page_size=page,
                                   kv_format=fmt, q_dtype=torch.float16, seed=len(fmt))
        tensors = [args["k_cache"], args["v_cache"]]
        if fmt in ("nvfp4", "mxfp4"):
            tensors += [args["k_scale"], args["v_scale"]]
        table = args["block_table"].long()
        sink = breakdown.paged_read(args, splits, chunk, align).view(len(lens), 2, splits)
        for b, n in enumerate(lens):
            if align:  # Triton's plan: ceil(n / chunk) splits (at most the grid's) of equal aligned length
                used = max(1, min(math.ceil(n / chunk), splits))
                split_len = math.ceil(math.ceil(n / used) / align) * align
            else:
                split_len = chunk
            for h in range(2):
                for s in range(splits):
                    keys = torch.arange(s * split_len, max(s * split_len, min(n, (s + 1) * split_len)))
                    pages, offsets = table[b, keys // page], keys % page
                    expected = _xor_of_bytes(*(t[pages, offsets, h] for t in tensors))
                    assert int(sink[b, h, s]) == expected, (fmt, b, h, s)


def test_a_plot_without_matplotlib_fails_before_anything_runs(monkeypatch):
    """--plot needs matplotlib: said at once, not after a grid that ran for minutes."""
    import builtins
    import attnops.bench.run as run
    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name == "matplotlib" or name.startswith("matplotlib."):
            raise ImportError("no matplotlib here")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    with pytest.raises(SystemExit, match="needs matplotlib"):
        run.main(["--cpu", "--plot", "x.png"])


def test_same_run_ratios_of_two_settings(tmp_path, capsys):
    """benchmarks/invariance_cost.py: each case's best time in each setting over its files (rounds), the second's
    over the first's, and the geometric mean; --labels names the settings."""
    import importlib.util
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks",
                        "invariance_cost.py")
    spec = importlib.util.spec_from_file_location("invariance_cost", path)
    cost = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cost)
    files = []
    for name, times in (("a1", (10.0, 20.0)), ("a2", (12.0, 18.0)), ("b1", (11.0, 36.0))):
        records = [dict(case=case, impl="cuda", impl_type="backend", status="ok", graph_us=us)
                   for case, us in zip(("x", "y"), times)]
        records.append(dict(case="x", impl="flashinfer", impl_type="peer", status="ok", graph_us=1.0))
        files.append(str(tmp_path / f"{name}.json"))
        with open(files[-1], "w") as f:
            json.dump({"records": records}, f)
    assert cost.main(["--labels", "one", "two", files[0], files[1], "--", files[2]]) == 0
    out = capsys.readouterr().out
    assert "one us" in out and "two us" in out and "flashinfer" not in out
    assert "cuda: 2 cases, geometric mean 1.483, worst 2.000" in out  # (x: 11 / 10, y: 36 / 18)
    assert "bars" not in out  # (named settings: an A/B, not the mode's cost)
    assert cost.main([files[0], files[1], "--", files[2]]) == 0
    assert "bars (geometric mean <= 1.05, every case <= 1.1): geometric mean missed, 1 of 2 cases past 1.1" in (
        capsys.readouterr().out)
    with pytest.raises(SystemExit):
        cost.main([files[0], files[2]])  # (no --)
