"""Dispatch: explain names the chosen backend and every passed-over one with reasons; ATTNOPS_BACKEND and
use_backend pin a backend, and a pinned backend that cannot serve a case is an error naming why."""
import json
from pathlib import Path

import pytest
import torch

import attnops
import attnops.rules
from attnops import capture, dispatch
from attnops.backends import BACKENDS
from attnops.backends.base import Backend
from attnops.testing import random_paged_inputs

ROOT = Path(__file__).resolve().parents[1]  # (the table's sources are paths from here)


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


def _cuda_case(**fields):
    """A CUDA AttentionCase on sm_90 described on a machine that may have no GPU."""
    case = dispatch.describe_attention(device="cpu", q_dtype=torch.bfloat16, kv_format="bf16", arch=(9, 0))
    return dispatch.AttentionCase(**{**case.__dict__, "device_type": "cuda", **fields})


def test_measured_rule_orders_backends_for_its_arch_and_the_nearest():
    """The shipped sm_90 table (attnops/bench/tune.py over the H200 models grids) holds a fitted rule; dispatch follows
    it on sm_90, and on an arch with no table follows the nearest measured one, never a fixed habit."""
    table = dispatch.arch_table((9, 0))
    assert table.get("rule"), "attnops/tables/sm_90.json (with its rule) is missing from the package"
    bf16 = _cuda_case()
    leaf, path, arch = dispatch.rule_leaf(bf16)
    assert arch == (9, 0) and dispatch.policy(bf16)[: len(leaf["order"])] == tuple(leaf["order"])
    assert dispatch.policy(bf16)[-1] == "reference"
    per_head = _cuda_case(kv_format="fp8_e4m3", scale_kind="per_head")
    assert set(dispatch.policy(per_head)) == set(dispatch.STATIC_ORDER["cuda"])
    blackwell = _cuda_case(arch=(12, 0))
    assert dispatch.rule_arch((12, 0)) == (9, 0) and dispatch.rule_leaf(blackwell)[2] == (9, 0)
    text = str(dispatch._explain_case(blackwell, None))
    assert "rule measured on sm_90, the nearest measured arch (none for sm_120)" in text
    assert dispatch.policy(dispatch.AttentionCase(**{**bf16.__dict__, "device_type": "cpu", "arch": None})) == \
        dispatch.STATIC_ORDER["cpu"]


def _tune():
    from attnops.bench import tune
    return tune


def _record(case, impl, us, kind="decode", heads=(32, 8, 128), fmt="bf16", batch=32, max_kv_len=8192):
    return dict(case=case, impl=impl, impl_type="backend", kind=kind, kv_format=fmt, scale_kind="per_tensor",
                num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=heads[2], status="ok", graph_us=us,
                batch=batch, q_tokens=batch if kind == "decode" else 8 * batch, max_kv_len=max_kv_len)


def test_rule_fits_the_measured_choices_and_generalises_by_features(monkeypatch):
    """tune fits a tree that makes every measured choice (where the backends differ by more than noise), and a
    case it never measured (another head shape, another batch) follows the questions the data asked."""
    tune = _tune()
    records = []
    for heads in ((32, 8, 128), (64, 8, 128), (28, 4, 128)):
        for batch in (1, 32, 128):
            # fp8: triton always 30% faster; bf16: flashinfer faster at batch >= 32, triton at batch 1
            records += [_record(f"{heads}/fp8/{batch}", "triton", 70, heads=heads, fmt="fp8_e4m3", batch=batch),
                        _record(f"{heads}/fp8/{batch}", "flashinfer", 100, heads=heads, fmt="fp8_e4m3", batch=batch),
                        _record(f"{heads}/bf16/{batch}", "triton", 100 if batch > 1 else 50, heads=heads, batch=batch),
                        _record(f"{heads}/bf16/{batch}", "flashinfer", 80, heads=heads, batch=batch)]
        records += [_record(f"{heads}/verify", "triton", 100, "verify", heads=heads),
                    _record(f"{heads}/verify", "flashinfer", 60, "verify", heads=heads)]
    names = ["flashinfer", "triton"]
    cases = tune.collect(records, set(names))
    rule = attnops.rules.fit([(f, t) for f, t, _, _ in cases.values()], names)
    assert all(row["slowdown"] == 1.0 for row in tune.check(rule, cases, names))
    assert all(row["slowdown"] == 1.0 for row in tune.cross_validate(cases, names))
    monkeypatch.setattr(dispatch, "arch_table", lambda arch: {"rule": rule})
    monkeypatch.setattr(dispatch, "rule_arch", lambda arch: (9, 0))
    # unmeasured head shapes and batches
    assert dispatch.policy(_cuda_case(num_q_heads=16, num_kv_heads=1, kv_format="fp8_e4m3",
                                      scale_kind="per_tensor", batch=64))[0] == "triton"
    assert dispatch.policy(_cuda_case(num_q_heads=40, num_kv_heads=8, batch=64))[0] == "flashinfer"
    assert dispatch.policy(_cuda_case(num_q_heads=40, num_kv_heads=8, batch=2))[0] == "triton"
    assert dispatch.policy(_cuda_case(shape_class="verify", decode=False, batch=16))[0] == "flashinfer"
    text = str(dispatch._explain_case(_cuda_case(kv_format="fp8_e4m3", scale_kind="per_tensor"), None))
    assert "auto: rule measured on sm_90" in text and "kv_format" in text
    assert "triton within 3% of the fastest in 9" in text and "flashinfer 1.43x its time" in text


def test_a_backend_never_timed_on_a_format_is_tried_after_the_timed_ones(monkeypatch):
    """A rule's leaf fitted on one format says nothing of a backend's speed on another: the table records which
    formats (fp8's two as one family) each backend was timed on, and dispatch tries the untimed ones last, so a
    backend that learns a format is not chosen before the table is refitted with its times."""
    tune = _tune()
    records = []
    for batch in (1, 32, 128):  # cuda timed on nvfp4 only, fastest there; triton and flashinfer on fp8 and bf16
        records += [_record(f"nvfp4/{batch}", "cuda", 50, fmt="nvfp4", batch=batch),
                    _record(f"nvfp4/{batch}", "triton", 100, fmt="nvfp4", batch=batch),
                    _record(f"fp8/{batch}", "triton", 70, fmt="fp8_e4m3", batch=batch),
                    _record(f"fp8/{batch}", "flashinfer", 100, fmt="fp8_e4m3", batch=batch),
                    _record(f"bf16/{batch}", "flashinfer", 80, batch=batch),
                    _record(f"bf16/{batch}", "triton", 100, batch=batch)]
    names = ["flashinfer", "triton", "cuda"]
    cases = tune.collect(records, set(names))
    timed = tune.timed_formats(cases, names)
    assert timed == {"flashinfer": ["bf16", "fp8"], "triton": ["bf16", "fp8", "nvfp4"], "cuda": ["nvfp4"]}
    # one leaf for every format, cuda first (as a leaf fitted on nvfp4 would order a format it never saw)
    rule = {"order": ["cuda", "triton", "flashinfer"], "cases": 9, "right": 3, "slower": [None, None]}
    table = {"rule": rule, "timed_formats": timed}
    monkeypatch.setattr(dispatch, "arch_table", lambda arch: table)
    monkeypatch.setattr(dispatch, "rule_arch", lambda arch: (9, 0))
    fp8 = dict(kv_format="fp8_e5m2", scale_kind="per_tensor")  # (never timed itself: e4m3 stands for it)
    assert dispatch.policy(_cuda_case(**fp8)) == ("triton", "flashinfer", "cuda", "reference")
    assert dispatch.policy(_cuda_case(kv_format="nvfp4", scale_kind="block")) == (
        "cuda", "triton", "flashinfer", "reference")
    assert dispatch.policy(_cuda_case(kv_format="fp16")) == ("cuda", "triton", "flashinfer", "reference")  # no one
    text = dispatch._explain_case(_cuda_case(**fp8), None).rule_text()
    assert text.endswith("never timed on fp8, so tried after the timed: cuda"), text
    table.pop("timed_formats")  # a table written before the record: the leaf's order as it is
    assert dispatch.policy(_cuda_case(**fp8))[0] == "cuda"


def test_verify_rows_reach_the_rule_from_the_op_shapes(monkeypatch):
    """The query rows a (sequence, KV head) brings, group x query tokens a sequence (from the shapes: T / B rounded
    up), are a feature: verify of 4 and of 8 tokens on the same heads can go to different backends, as measured."""
    tune = _tune()
    records = []
    for heads in ((32, 8, 128), (28, 4, 128), (16, 1, 128)):
        for q in (4, 8):
            group = heads[0] // heads[1]
            fast, slow = ("cuda", "triton") if group * q <= 32 else ("triton", "cuda")
            for impl, us in ((fast, 60), (slow, 100)):
                r = _record(f"{heads}/verify{q}", impl, us, "verify", heads=heads, fmt="nvfp4")
                records.append({**r, "q_tokens": q * r["batch"]})
    names = ["triton", "cuda"]
    cases = tune.collect(records, set(names))
    rule = attnops.rules.fit([(f, t) for f, t, _, _ in cases.values()], names)
    assert all(row["slowdown"] == 1.0 for row in tune.check(rule, cases, names))
    monkeypatch.setattr(dispatch, "arch_table", lambda arch: {"rule": rule})
    monkeypatch.setattr(dispatch, "rule_arch", lambda arch: (9, 0))
    for q_per_seq, first in ((2, "cuda"), (4, "cuda"), (8, "triton"), (16, "triton")):  # group 7: rows 14 .. 112
        # the op's own shapes: 3 sequences of q_per_seq tokens, one of them a token short (T / B rounds up)
        batch, tokens = 3, 3 * q_per_seq - 1
        q = torch.empty(tokens, 28, 128, device="meta", dtype=torch.bfloat16)
        case = attnops.checks.check_paged_attention(
            q, torch.empty(64, 16, 4, 64, device="meta", dtype=torch.uint8),
            torch.empty(64, 16, 4, 64, device="meta", dtype=torch.uint8),
            torch.empty(batch, 4, device="meta", dtype=torch.int32), torch.empty(batch, device="meta", dtype=torch.int32),
            torch.empty(batch + 1, device="meta", dtype=torch.int32), scale=None, soft_cap=0.0, window_left=-1,
            kv_format="nvfp4", k_scale=torch.empty(64, 16, 4, 8, device="meta", dtype=torch.float8_e4m3fn),
            v_scale=torch.empty(64, 16, 4, 8, device="meta", dtype=torch.float8_e4m3fn), sinks=None, tree_mask=None)
        assert case.shape_class == "verify" and case.q_per_seq == q_per_seq
        assert attnops.rules.features(case)["rows"] == 7 * q_per_seq
        gpu_case = dispatch.AttentionCase(**{**case.__dict__, "device_type": "cuda", "arch": (9, 0)})
        assert dispatch.policy(gpu_case)[0] == first, (q_per_seq, rule)


def test_tune_checks_a_backend_that_declines_some_cases_as_dispatch_would():
    """4-bit cases timed on triton and cuda (FlashInfer has no 4-bit kernels), bf16 on flashinfer and triton: the
    fitted rule is right on every case, and check() counts the first backend of a leaf that has a time."""
    tune = _tune()
    records = []
    for batch in (1, 32, 128):
        records += [_record(f"nvfp4/{batch}", "triton", 100, fmt="nvfp4", batch=batch),
                    _record(f"nvfp4/{batch}", "cuda", 55, fmt="nvfp4", batch=batch),
                    _record(f"bf16/{batch}", "triton", 100, batch=batch),
                    _record(f"bf16/{batch}", "flashinfer", 80, batch=batch)]
    names = ["flashinfer", "triton", "cuda"]
    cases = tune.collect(records, set(names))
    rule = attnops.rules.fit([(f, t) for f, t, _, _ in cases.values()], names)
    rows = tune.check(rule, cases, names)
    assert len(rows) == 6 and all(row["slowdown"] == 1.0 for row in rows)
    assert {row["chosen"] for row in rows if "nvfp4" in row["case"]} == {"cuda"}
    # a rule that puts a declining backend first: check() takes the next one that has a time
    leaf = {"order": ["flashinfer", "triton", "cuda"], "cases": 6, "right": 3, "slower": [None, None]}
    rows = tune.check(leaf, cases, names)
    assert {row["chosen"] for row in rows if "nvfp4" in row["case"]} == {"triton"}
    assert max(row["slowdown"] for row in rows) == pytest.approx(100 / 55, rel=1e-3)


def test_rule_fit_needs_cases_timed_on_some_backend():
    with pytest.raises(ValueError, match="no case was timed on any backend"):
        attnops.rules.fit([({"kv_format": "bf16"}, {"cpu": 1.0})], ["flashinfer", "triton"])


class PlansOnHost(Backend):
    name = "plans"
    plans_on_host = True

    def supports(self, case):
        return []


def test_capture_state_passes_over_host_planned_backends(monkeypatch):
    """Inside a capture nobody re-plans, auto never picks a backend that plans on the host, and a pinned one is
    an error naming the way that works; eager and re-planned captures keep it. The three states are cached
    apart."""
    monkeypatch.setitem(BACKENDS, "plans", PlansOnHost())
    monkeypatch.setitem(dispatch.STATIC_ORDER, "cpu", ("plans", "cpu", "reference"))
    dispatch._select_cached.cache_clear()
    try:
        case = dispatch.describe_attention(device="cpu")
        assert dispatch._select_cached(case, None, capture.NONE).name == "plans"
        assert dispatch._select_cached(case, None, capture.REPLANNED).name == "plans"
        assert dispatch._select_cached(case, None, capture.FOREIGN).name == "cpu"
        assert dispatch._select_cached(case, None, capture.NONE).name == "plans"
        with pytest.raises(ValueError, match="(?s)pinned backend .plans. cannot serve.*attnops.serving.graphs.DecodeGraphRunner"):
            dispatch._select_cached(case, "plans", capture.FOREIGN)
        foreign = attnops.explain(device="cpu", capture_state="foreign")
        assert foreign.chosen == "cpu" and "nobody re-plans" in str(foreign)
        assert "passed over plans: inside a CUDA graph capture" in str(foreign)
        with pytest.raises(ValueError, match="capture_state must be one of"):
            attnops.explain(device="cpu", capture_state="sometimes")
    finally:
        dispatch._select_cached.cache_clear()


def test_capture_state_reads_the_runners_context_and_the_stream():
    assert capture.capture_state(torch.device("cpu")) == capture.NONE
    with capture.capturing(capture.CaptureContext(1)):
        assert capture.current_capture() is not None
        assert capture.capture_state(torch.device("cpu")) == capture.NONE  # CPU calls are never captured
    assert capture.current_capture() is None


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


def test_tune_ships_the_rule_and_writes_its_checks_beside_it(tmp_path):
    """The table in the package holds what dispatch reads (the rule, the timed formats); the case-by-case checks
    go to a file of their own."""
    tune = _tune()
    records = []
    for batch in (1, 32):
        records += [_record(f"bf16/{batch}", "triton", 100 if batch > 1 else 50, batch=batch),
                    _record(f"bf16/{batch}", "flashinfer", 80, batch=batch)]
    source = tmp_path / "records.json"
    source.write_text(json.dumps({"records": records}))
    table, checks = tmp_path / "sm_90.json", tmp_path / "checks.json"
    tune.main(["--from-json", str(source), "--arch", "sm_90", "--backends", "flashinfer", "triton",
               "--out", str(table), "--checks-out", str(checks)])
    shipped = json.loads(table.read_text())
    assert set(shipped) == {"arch", "sources", "backends", "timed_formats", "rule"}
    assert {"per_case", "held_out_head_shapes", "auto_measured"} <= set(json.loads(checks.read_text()))
    # the shipped sm_90 table: the same keys, and latent attention's (its records had latent cases)
    assert set(dispatch.arch_table((9, 0))) == set(shipped) | {"mla_rule", "mla_timed_formats", "mla_backends"}


def test_latent_rule_with_two_splits_of_look_ahead_fits_every_shipped_case():
    """The shipped table's latent-attention records (bf16, fp8 e4m3 and DeepSeek's layout, where Triton wins only
    fp8 e4m3's single sequences at 8-16 heads: a batch, a format and a head-count question deep) are fitted within
    3% of the fastest in every case with two splits of look-ahead; one split's greedy tree leaves that leaf to
    cuda, which is 1.09-1.12x slower there. The shipped rule is the two-split one."""
    tune = _tune()
    table = dispatch.arch_table((9, 0))
    records = [r for path in table["sources"] for r in json.loads((ROOT / path).read_text())["records"]
               if r.get("latent_dim")]
    names = table["mla_backends"]
    cases = tune.collect(records, set(names))
    samples = [(f, t) for f, t, _, _ in cases.values()]
    assert any(f["kv_format"] == "fp8_ds_mla" for f, _ in samples)
    fitted = {look: attnops.rules.fit(samples, names, lookahead=look) for look in (1, 2)}
    worst = {look: max(r["slowdown"] for r in tune.check(rule, cases, names)) for look, rule in fitted.items()}
    assert worst[2] <= attnops.rules.TOLERANCE < worst[1], worst
    assert fitted[2] == table["mla_rule"]


def test_tune_fits_latent_attention_its_own_rule_and_dispatch_follows_it(tmp_path, monkeypatch):
    """Records of latent-attention cases (the models grid's DeepSeek shards) get a rule of their own over the
    backends that serve them, in the same table; dispatch orders an MLA case by it (and explain says so), and by
    MLA_ORDER where the table has none."""
    from attnops.cases import MLACase
    tune = _tune()
    records = []
    for heads in (16, 32, 128):
        for batch in (1, 32, 128):
            case = f"mla/{heads}/{batch}"
            mla = dict(latent_dim=512, rope_dim=64, page_size=64)
            # triton faster with few heads (16), FlashInfer from 32 heads up
            records += [{**_record(case, "triton", 50 if heads <= 16 else 300, heads=(heads, 1, 512), batch=batch),
                         **mla},
                        {**_record(case, "flashinfer", 60, heads=(heads, 1, 512), batch=batch), **mla},
                        {**_record(case, "cpu", 10, heads=(heads, 1, 512), batch=batch), **mla}]
    records += [_record("bf16/32", "triton", 100), _record("bf16/32", "flashinfer", 80)]
    source = tmp_path / "records.json"
    source.write_text(json.dumps({"records": records}))
    table_path = tmp_path / "sm_90.json"
    tune.main(["--from-json", str(source), "--arch", "sm_90", "--backends", "flashinfer", "cpu", "triton",
               "--out", str(table_path), "--checks-out", str(tmp_path / "checks.json")])
    table = json.loads(table_path.read_text())
    assert table["mla_backends"] == ["flashinfer", "triton"]  # (cpu's time is ignored: no MLA on a GPU)
    assert "mla_per_case" in json.loads((tmp_path / "checks.json").read_text())
    monkeypatch.setattr(dispatch, "arch_table", lambda arch: table if arch == (9, 0) else {})
    monkeypatch.setattr(dispatch, "rule_arch", lambda arch: (9, 0))

    def order(heads):
        case = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16", latent_dim=512,
                       rope_dim=64, num_heads=heads, page_size=64, decode=True, batch=8, max_kv_len=8192)
        return dispatch.policy(case), dispatch.Explanation(case, None).rule_text()
    few, text = order(8)
    assert few[:2] == ("triton", "flashinfer") and few[-1] == "reference"
    assert "rule measured on sm_90" in text and "group" in text
    assert order(64)[0][:2] == ("flashinfer", "triton")
    monkeypatch.setattr(dispatch, "arch_table", lambda arch: {k: v for k, v in table.items() if "mla" not in k})
    assert order(8)[0] == dispatch.MLA_ORDER["cuda"] and order(8)[1] is None
