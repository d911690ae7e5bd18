"""Dispatch: explain names the chosen backend and every passed-over one with reasons; ATTNOPS_BACKEND and
use_backend pin a backend, and a pinned backend that cannot serve a case is an error naming why."""
import pytest
import torch

import attnops
from attnops import dispatch
from attnops.backends import BACKENDS
from attnops.backends.base import Backend
from attnops.testing import random_paged_inputs


class DeclinesEverything(Backend):
    name = "declines"

    def supports(self, case):
        return ["declines every case, for this test"]


@pytest.fixture
def declining_backend(monkeypatch):
    monkeypatch.setitem(BACKENDS, "declines", DeclinesEverything())
    dispatch._select_cached.cache_clear()
    yield
    dispatch._select_cached.cache_clear()


def test_explain_from_tensors_and_from_a_description():
    args = random_paged_inputs([5, 9], num_q_heads=4, num_kv_heads=2)
    from_tensors = attnops.explain(**args)
    assert from_tensors.chosen in BACKENDS
    assert from_tensors.case.decode and from_tensors.case.kv_format == "fp32"
    described = attnops.explain(device="cpu", q_dtype=torch.float32, kv_format="fp32", head_dim=64, num_q_heads=4,
                                num_kv_heads=2)
    assert described.chosen == from_tensors.chosen
    assert "chosen:" in str(described)


def test_backends_passed_over_are_listed_with_reasons(monkeypatch, declining_backend):
    monkeypatch.setitem(dispatch.STATIC_ORDER, "cpu", ("declines",) + dispatch.STATIC_ORDER["cpu"])
    explanation = attnops.explain(device="cpu")
    assert explanation.rejected["declines"] == ["declines every case, for this test"]
    assert explanation.chosen not in (None, "declines")
    assert "passed over declines: declines every case" in str(explanation)


def test_use_backend_pins_and_errors_when_it_cannot_serve(declining_backend):
    args = random_paged_inputs([5, 9])
    with attnops.use_backend("reference"):
        assert attnops.explain(**args).chosen == "reference"
        out = torch.ops.attnops.paged_attention(**args)
    with attnops.use_backend("declines"):
        with pytest.raises(ValueError, match="declines every case"):
            torch.ops.attnops.paged_attention(**args)
    torch.testing.assert_close(torch.ops.attnops.paged_attention(**args), out)


def test_attnops_backend_environment_variable(monkeypatch, declining_backend):
    args = random_paged_inputs([5, 9])
    monkeypatch.setenv("ATTNOPS_BACKEND", "declines")
    with pytest.raises(ValueError, match="pinned backend 'declines' cannot serve"):
        torch.ops.attnops.paged_attention(**args)
    monkeypatch.setenv("ATTNOPS_BACKEND", "reference")
    assert attnops.explain(**args).chosen == "reference"
    monkeypatch.setenv("ATTNOPS_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="unknown backend 'no-such-backend'"):
        torch.ops.attnops.paged_attention(**args)


def test_unknown_backend_in_use_backend():
    with pytest.raises(ValueError, match="unknown backend"):
        with attnops.use_backend("nope"):
            pass


def test_dispatch_reads_no_tensor_data():
    """The case (and so the choice) comes from shapes, dtypes and flags: meta tensors give the same answer."""
    args = random_paged_inputs([5, 9], [2, 3])
    meta = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    real, fake = attnops.explain(**args).case, attnops.explain(**meta).case
    assert {**real.__dict__, "device_type": None} == {**fake.__dict__, "device_type": None}


def test_measured_table_orders_backends_for_its_arch():
    """The shipped sm_90 table (benchmarks/tune.py over the committed H200 runs) puts its measured order first."""
    table = dispatch.arch_table((9, 0))
    assert table, "attnops/tables/sm_90.json is missing from the package"
    bf16 = dispatch.describe_attention(device="cpu", q_dtype=torch.bfloat16, kv_format="bf16", arch=(9, 0))
    bf16 = dispatch.AttentionCase(**{**bf16.__dict__, "device_type": "cuda"})
    measured = table[dispatch.table_key(bf16)]
    assert dispatch.policy(bf16)[: len(measured)] == tuple(measured)
    assert dispatch.policy(bf16)[-1] == "reference"
    per_head = dispatch.AttentionCase(**{**bf16.__dict__, "kv_format": "fp8_e4m3", "scale_kind": "per_head"})
    assert dispatch.policy(per_head)[0] == "triton"
    unmeasured = dispatch.AttentionCase(**{**bf16.__dict__, "arch": (12, 0)})
    assert dispatch.policy(unmeasured) == dispatch.STATIC_ORDER["cuda"]


def test_tune_orders_by_geometric_mean_and_reports_misses(monkeypatch):
    sys_path = __import__("sys").path
    sys_path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent / "benchmarks"))
    import tune

    def rec(case, impl, us, kind="decode", heads=(32, 8, 128)):
        return dict(case=case, impl=impl, impl_type="backend", kind=kind, kv_format="bf16", scale_kind="per_tensor",
                    num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2], status="ok", median_us=us)
    records = [rec("a", "triton", 100), rec("a", "flashinfer", 50), rec("b", "triton", 100),
               rec("b", "flashinfer", 120), rec("c", "flashinfer", 10, "verify"),
               rec("mha", "triton", 10, heads=(32, 32, 128)), rec("mha", "flashinfer", 30, heads=(32, 32, 128))]
    order, checks = tune.build_table(records, {"triton", "flashinfer"})
    assert order == {"decode/bf16/none/g4/d128": ["flashinfer", "triton"], "decode/bf16/none/g1/d128": [
        "triton", "flashinfer"], "verify/bf16/none/g4/d128": ["flashinfer"]}
    miss = [c for c in checks if c["slowdown"] > 1]
    assert [(c["case"], round(c["slowdown"], 2)) for c in miss] == [("b", 1.2)]
    # dispatch looks the case's class up; a head shape the table did not measure gets the static order
    monkeypatch.setattr(dispatch, "arch_table", lambda arch: order)
    case = dispatch.describe_attention(device="cpu", q_dtype=torch.bfloat16, kv_format="bf16", arch=(9, 0))
    case = dispatch.AttentionCase(**{**case.__dict__, "device_type": "cuda"})
    assert dispatch.table_key(case) == "decode/bf16/none/g4/d128"
    assert dispatch.policy(case) == ("flashinfer", "triton", "reference")
    mha = dispatch.AttentionCase(**{**case.__dict__, "num_kv_heads": 32})
    assert dispatch.policy(mha) == ("triton", "flashinfer", "reference")
    d64 = dispatch.AttentionCase(**{**case.__dict__, "head_dim": 64})
    assert dispatch.table_key(d64) is None and dispatch.policy(d64) == dispatch.STATIC_ORDER["cuda"]
    fp8 = dispatch.AttentionCase(**{**case.__dict__, "kv_format": "fp8_e4m3", "scale_kind": "per_tensor"})
    assert dispatch.table_key(fp8) is None and dispatch.policy(fp8) == dispatch.STATIC_ORDER["cuda"]


def test_pinning_an_attention_only_backend_leaves_cache_writes_to_the_policy(monkeypatch, declining_backend):
    monkeypatch.setattr(DeclinesEverything, "writes_cache", False, raising=False)
    cache = attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="fp32")
    cache.allocate("a")
    meta = cache.prepare(["a"], 3, decode=False)
    key = torch.randn(3, 2, 64)
    with attnops.use_backend("declines"):
        attnops.reshape_and_cache(key, key, slot_mapping=meta.slot_mapping, **cache.write_args(0))
        explanation = attnops.explain(key=key, value=key, slot_mapping=meta.slot_mapping, **cache.write_args(0))
    assert explanation.chosen not in (None, "declines") and explanation.pinned is None
    torch.testing.assert_close(cache.kv[0][:, 0].flatten(0, 1)[meta.slot_mapping], key)
