"""The benchmark suite's CPU mode on a tiny grid: the JSON has its schema, and a backend that is fast but wrong is
reported as wrong, never timed."""
import json

import torch

from attnops.backends import BACKENDS
from attnops.backends.reference import ReferenceBackend
from attnops.bench import run as bench


class WrongOnPurpose(ReferenceBackend):
    name = "wrong-on-purpose"

    def paged_attention(self, *args, out, **kwargs):
        super().paged_attention(*args, out=out, **kwargs)
        out.mul_(1.1)  # 10% off: far outside the tolerance


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
