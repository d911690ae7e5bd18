"""paged_attention_with_lse: each row's log-sum-exp beside paged_attention's output. The reference's LSE against an
independent dense computation; every backend's LSE against the reference's (and its output equal to its own
paged_attention's) over the contract's grid: decode and multi-token, empty sequences and rows that see no key,
sinks, tree masks, windows, soft cap, quantized caches, bad indices; two calls over a split of the keys merged by
merge_attention_states equal one call over all of them; opcheck, torch.compile and validation. Triton runs in its
interpreter on the CPU (tests/conftest.py), bf16 and FlashInfer only on a GPU."""
from __future__ import annotations

import pytest
import torch
import torch._dynamo.testing

import attnops
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference
from attnops.checks import check_paged_attention
from attnops.testing import random_paged_inputs

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
F16 = torch.float16
# |lse - reference| <= TOLERANCE * (1 + |reference|), by q dtype: fp16 dots round the scores
TOLERANCE = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
NEG_INF = float("-inf")


def sinks_for(num_q_heads: int, seed: int) -> torch.Tensor:
    return torch.randn(num_q_heads, generator=torch.Generator().manual_seed(seed)) * 3


def full_tree(cu_seqlens_q: torch.Tensor, extra_cols: int = 0, seed: int = 0) -> torch.Tensor:
    """A random bool tree mask [T, longest block + extra_cols]."""
    cu = cu_seqlens_q.tolist()
    width = max([b - a for a, b in zip(cu, cu[1:])] + [1]) + extra_cols
    return torch.rand(cu[-1], width, generator=torch.Generator().manual_seed(seed)) < 0.6


# (name, random_paged_inputs arguments, options; "sinks"/"tree" as True are drawn per case). Small: Triton runs them
# in the interpreter. Lengths past the interpreter's CHUNK of 128 keys split, so its merge kernel writes LSE too.
CASES = [
    ("decode-empty-split", dict(kv_lens=[37, 0, 300, 1]), {}),
    ("decode-sinks-empty-split", dict(kv_lens=[0, 200, 5]), dict(sinks=True)),
    ("decode-window-softcap-mqa", dict(kv_lens=[150, 3, 0], num_q_heads=4, num_kv_heads=1, page_size=1),
     dict(window_left=20, soft_cap=4.0, scale=0.3)),
    ("multi-window0-more-queries-than-keys", dict(kv_lens=[3, 40, 0], q_lens=[5, 6, 0]), dict(window_left=0)),
    ("multi-sinks-tree-softcap", dict(kv_lens=[30, 9, 140], q_lens=[4, 9, 6]),
     dict(sinks=True, tree=True, soft_cap=3.0)),
    ("prefill-window-fp16", dict(kv_lens=[33, 20], q_lens=[33, 8], kv_format="fp16", q_dtype=F16),
     dict(window_left=7)),
    ("decode-fp8-per-head-fp16q", dict(kv_lens=[60, 130], kv_format="fp8_e4m3", scale_kind="per_head",
                                       q_dtype=F16), {}),
    ("multi-nvfp4-sinks", dict(kv_lens=[40, 7], q_lens=[3, 2], kv_format="nvfp4", q_dtype=F16), dict(sinks=True)),
    ("decode-mxfp4", dict(kv_lens=[70, 0, 20], kv_format="mxfp4"), {}),
]


def case_args(inputs: dict, options: dict, seed: int, device: str = "cpu") -> tuple[dict, dict]:
    args = random_paged_inputs(**inputs, seed=seed, device=device)
    options = dict(options)
    if options.get("sinks") is True:
        options["sinks"] = sinks_for(args["q"].shape[1], seed).to(device)
    if options.pop("tree", False):
        options["tree_mask"] = full_tree(args["cu_seqlens_q"], 2, seed).to(device)
    return args, options


def serving(backend: str, case) -> bool:
    b = BACKENDS[backend]
    return not (b.unavailable() or b.supports(case))


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where the other is NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def run_with_lse(backend: str, args: dict, options: dict):
    """The .out overload into poisoned buffers, pinned to `backend`; also the functional overload and plain
    paged_attention, which must agree with it exactly."""
    q = args["q"]
    out = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), device=q.device)
    with attnops.use_backend(backend):
        attnops.paged_attention_with_lse(**args, **options, out=out, lse=lse)
        functional_out, functional_lse = attnops.paged_attention_with_lse(**args, **options)
        plain = attnops.paged_attention(**args, **options)
    assert same(out, functional_out) and same(lse, functional_lse)
    assert same(out, plain), "out differs from paged_attention's"
    return out, lse


def assert_lse_close(lse: torch.Tensor, ref: torch.Tensor, tolerance: float):
    lse, ref = lse.double().cpu(), ref.double().cpu()
    assert torch.equal(lse.isnan(), ref.isnan()), "NaN rows differ"
    assert torch.equal(lse == NEG_INF, ref == NEG_INF), "-inf rows (no key) differ"
    finite = ref.isfinite()
    err = ((lse - ref).abs() / (1 + ref.abs()))[finite]
    assert err.numel() == 0 or err.max() <= tolerance, f"lse error {err.max():.3g} > {tolerance}"


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("name,inputs,options", CASES, ids=[c[0] for c in CASES])
def test_lse_matches_reference(backend, name, inputs, options):
    args, options = case_args(inputs, options, seed=len(name))
    case = check_paged_attention(**{**dict(scale=None, soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None,
                                           v_scale=None), **args, **options})
    if not serving(backend, case):
        reasons = BACKENDS[backend].unavailable() + BACKENDS[backend].supports(case)
        pytest.skip(f"{backend} does not serve {name}: {reasons}")
    ref_out, ref_lse = paged_attention_reference(**args, **options, return_lse=True)
    out, lse = run_with_lse(backend, args, options)
    assert_lse_close(lse, ref_lse, TOLERANCE[args["q"].dtype])
    assert not (ref_lse == NEG_INF).all() and not ref_lse.isnan().any()  # the case has keys, and no bad index
    no_key = ref_lse == (NEG_INF if "sinks" not in options else options["sinks"].double()[None, :])
    assert (out[no_key] == 0).all()  # a row that sees no key: out 0, lse -inf (the sink's logit with sinks)
    if name.startswith(("decode-empty", "decode-sinks-empty", "multi-window0")):
        assert no_key.any()  # the grid has such rows


def dense_lse(args: dict, *, scale: float, soft_cap: float = 0.0, window_left: int = -1, sinks=None) -> torch.Tensor:
    """The contract's LSE, written out over a dense masked score matrix (fp32 cache, no tree mask), float64: per
    sequence, K gathered slot by slot from the block table, scores [n, Hq, L] with the causal and window mask as
    -inf, logsumexp over the keys and the sink."""
    q, k_cache, table = args["q"].double(), args["k_cache"].double(), args["block_table"]
    lens = args["seq_lens"].tolist()
    cu = args["cu_seqlens_q"].tolist() if args["cu_seqlens_q"] is not None else list(range(len(lens) + 1))
    page_size, group = k_cache.shape[1], q.shape[1] // k_cache.shape[2]
    result = torch.empty(q.shape[:2], dtype=torch.float64)
    for b, length in enumerate(lens):
        rows = q[cu[b]:cu[b + 1]]
        n = rows.shape[0]
        if n == 0:
            continue
        keys = torch.stack([k_cache[table[b, j // page_size], j % page_size] for j in range(length)]) \
            if length else k_cache.new_zeros(0, k_cache.shape[2], k_cache.shape[3])
        keys = keys.repeat_interleave(group, 1)  # [L, Hq, D]
        scores = torch.einsum("nhd,lhd->nhl", rows, keys) * scale
        if soft_cap:
            scores = soft_cap * torch.tanh(scores / soft_cap)
        pos = torch.arange(length - n, length)[:, None, None]
        key = torch.arange(length)[None, None, :]
        seen = (key <= pos) & ((key >= pos - window_left) if window_left >= 0 else True)
        scores = scores.masked_fill(~seen, NEG_INF)
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[None, :, None].expand(n, -1, 1)], -1)
        result[cu[b]:cu[b + 1]] = torch.logsumexp(scores, -1)
    return result


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_reference_lse_against_a_dense_logsumexp(decode, with_sinks):
    args = random_paged_inputs([45, 0, 17, 1, 64], None if decode else [6, 0, 17, 1, 3], num_q_heads=6,
                               num_kv_heads=2, page_size=4, seed=3)
    options = dict(scale=0.4, soft_cap=5.0, window_left=10)
    if with_sinks:
        options["sinks"] = sinks_for(6, 1)
    for opts in (options, dict(scale=0.2)):
        _, lse = paged_attention_reference(**args, **opts, return_lse=True)
        expected = dense_lse(args, **opts)
        assert torch.equal(lse == NEG_INF, expected == NEG_INF)
        torch.testing.assert_close(lse, expected, rtol=1e-12, atol=1e-12)
        if decode:  # the empty sequence's row: -inf, or with sinks the sink's term alone
            empty = opts["sinks"].double() if "sinks" in opts else torch.full((6,), NEG_INF, dtype=torch.float64)
            torch.testing.assert_close(lse[1], empty)


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_bad_indices_give_nan_lse(backend):
    """The rows the bad-index rules make NaN have NaN LSE; the other rows are exact."""
    args = random_paged_inputs([40, 30, 50, 9], [3, 2, 4, 1], page_size=16, seed=5)
    args["seq_lens"][1] = 10_000  # past the table's capacity: every row of sequence 1
    args["block_table"][2, 1] = 1 << 20  # a page outside the cache: the rows of sequence 2 that see keys 16..31
    ref_out, ref_lse = paged_attention_reference(**args, return_lse=True)
    assert ref_lse.isnan().any() and not ref_lse.isnan().all()
    out, lse = run_with_lse(backend, args, {})
    assert torch.equal(out.isnan().all(-1), ref_lse.isnan())
    assert_lse_close(lse, ref_lse, TOLERANCE[torch.float32])
    attnops.take_errors()
    # a bad cu_seqlens_q: every row
    args["seq_lens"][1] = 30
    args["cu_seqlens_q"] = torch.tensor([0, 3, 2, 9, 10], dtype=torch.int32)
    _, lse = run_with_lse(backend, args, {})
    assert lse.isnan().all()
    assert "cu_seqlens_q" in attnops.take_errors()


def split_keys(args: dict, prefix: int, decode: bool):
    """The inputs of two calls over disjoint keys of each sequence: the first `prefix` keys (whole pages) and the
    rest, laid out as sequences of their own. The query rows sit at the end of the suffix, causal there (as in the
    call over all keys), and see the whole prefix: in decode by being its last position, in a multi-token block by
    a tree mask of all ones (which makes the prefix's last n keys visible to every row of its block)."""
    page_size = args["k_cache"].shape[1]
    assert prefix % page_size == 0 and (args["seq_lens"] >= prefix).all()
    first = dict(args, block_table=args["block_table"][:, : prefix // page_size].contiguous(),
                 seq_lens=torch.full_like(args["seq_lens"], prefix))
    rest = dict(args, block_table=args["block_table"][:, prefix // page_size:].contiguous(),
                seq_lens=args["seq_lens"] - prefix)
    first_options = {}
    if not decode:
        cu = args["cu_seqlens_q"].tolist()
        first_options["tree_mask"] = torch.ones(cu[-1], max(b - a for a, b in zip(cu, cu[1:])), dtype=torch.bool,
                                                device=args["q"].device)
    return first, first_options, rest


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("decode", [True, False], ids=["decode", "multi"])
def test_merging_two_calls_over_split_keys_equals_one_call(backend, decode):
    """The use case: a shared prefix (or one device's share of the keys) and each sequence's own keys, attended
    separately and merged with merge_attention_states, give the call over all keys: out and LSE. The sinks join
    one side only."""
    prefix = 32
    lens, q_lens = [32 + 9, 32 + 20, 32 + 160, 32], [3, 1, 5, 0]
    args = random_paged_inputs(lens, None if decode else q_lens, num_q_heads=4, num_kv_heads=2, page_size=16,
                               seed=7)
    if decode:
        args["seq_lens"][3] = 32  # a sequence with no key after the prefix: its suffix side is empty
    sinks = sinks_for(4, 2)
    first, first_options, rest = split_keys(args, prefix, decode)
    out_a, lse_a = run_with_lse(backend, first, dict(first_options, sinks=sinks))
    out_b, lse_b = run_with_lse(backend, rest, {})
    out, lse = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    expected_out, expected_lse = paged_attention_reference(**args, sinks=sinks, return_lse=True)
    assert_lse_close(lse, expected_lse, 1e-5)
    torch.testing.assert_close(out, expected_out.float(), rtol=1e-5, atol=1e-5)
    if decode:
        assert (lse_b[3] == NEG_INF).all()


# ------------------------------------------------------------------------------------------------------------
# opcheck, torch.compile, validation

SAMPLES = {
    "decode-fp32-empty": dict(kv_lens=[5, 0, 17]),
    "verify-fp16-page64": dict(kv_lens=[50, 64], q_lens=[4, 4], kv_format="fp16", q_dtype=F16, page_size=64),
    "extend-fp8-per-head": dict(kv_lens=[30, 60, 0], q_lens=[3, 8, 0], kv_format="fp8_e5m2", scale_kind="per_head"),
    "decode-nvfp4": dict(kv_lens=[19, 64], kv_format="nvfp4", q_dtype=F16),
}


@pytest.mark.usefixtures("fp8_comparable")
@pytest.mark.parametrize("with_sinks", [False, True], ids=["plain", "sinks-window"])
@pytest.mark.parametrize("sample", SAMPLES)
def test_opcheck(sample, with_sinks):
    args = random_paged_inputs(**SAMPLES[sample], seed=len(sample))
    q, k, v, table, lens, cu = (args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens",
                                                      "cu_seqlens_q"))
    kwargs = dict(args, **(dict(sinks=sinks_for(q.shape[1], 0), window_left=9, soft_cap=3.0) if with_sinks else {}))
    torch.library.opcheck(torch.ops.attnops.paged_attention_with_lse.default, (q, k, v, table, lens, cu), kwargs)
    out, lse = torch.full_like(q, float("nan")), torch.full(q.shape[:2], float("nan"))
    torch.library.opcheck(torch.ops.attnops.paged_attention_with_lse.out, (q, k, v, table, lens, cu),
                          dict(kwargs, out=out, lse=lse))
    # opcheck works on copies: write for real, and check the .out overload against the functional one
    torch.ops.attnops.paged_attention_with_lse.out(q, k, v, table, lens, cu, **kwargs, out=out, lse=lse)
    expected_out, expected_lse = torch.ops.attnops.paged_attention_with_lse(q, k, v, table, lens, cu, **kwargs)
    assert torch.equal(out, expected_out) and torch.equal(lse, expected_lse)
    assert not lse.isnan().any()


@torch.no_grad()
def test_compiled_split_attention_and_merge_no_graph_break():
    """A compiled function that attends a shared prefix and each sequence's own keys and merges them: one graph,
    no break, the eager result."""
    args = random_paged_inputs([16 + 5, 16 + 30], None, page_size=16, seed=11)
    first, _, rest = split_keys(args, 16, decode=True)

    def attend(q, k_cache, v_cache, prefix_table, prefix_lens, table, lens):
        out_a, lse_a = torch.ops.attnops.paged_attention_with_lse(q, k_cache, v_cache, prefix_table, prefix_lens)
        out_b, lse_b = attnops.paged_attention_with_lse(q, k_cache, v_cache, table, lens)
        out, lse = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
        return out * 2, lse + 1

    inputs = (args["q"], args["k_cache"], args["v_cache"], first["block_table"], first["seq_lens"],
              rest["block_table"], rest["seq_lens"])
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    torch._dynamo.utils.counters.clear()
    got = torch.compile(attend, backend=counter, fullgraph=True)(*inputs)
    expected = attend(*inputs)
    torch.testing.assert_close(got, expected)
    assert counter.frame_count == 1
    assert not torch._dynamo.utils.counters["graph_break"]
    full_out, full_lse = attnops.paged_attention_with_lse(**args)
    torch.testing.assert_close(got, (full_out * 2, full_lse + 1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad_lse,error", [
    (lambda q: torch.empty(q.shape[:2], dtype=torch.float64), TypeError),
    (lambda q: torch.empty(q.shape[:2], dtype=torch.bfloat16), TypeError),
    (lambda q: torch.empty(q.shape[0], q.shape[1] + 1), ValueError),
    (lambda q: torch.empty(q.shape), ValueError),
    (lambda q: torch.empty(q.shape[:2], device="meta"), ValueError),
], ids=["float64", "bfloat16", "heads", "3d", "device"])
def test_bad_lse_is_an_error_naming_it(bad_lse, error):
    args = random_paged_inputs([9, 4], seed=1)
    lse = bad_lse(args["q"])
    out = torch.empty_like(args["q"])
    positional = [args[n] for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens", "cu_seqlens_q")]
    for call in (lambda: attnops.paged_attention_with_lse(**args, out=out, lse=lse),
                 lambda: torch.ops.attnops.paged_attention_with_lse.out(*positional, out=out, lse=lse)):
        with pytest.raises(error, match="paged_attention_with_lse: lse"):
            call()


def test_out_and_lse_come_together():
    args = random_paged_inputs([9, 4], seed=1)
    with pytest.raises(ValueError, match="both out and lse"):
        attnops.paged_attention_with_lse(**args, out=torch.empty_like(args["q"]))
    with pytest.raises(ValueError, match="both out and lse"):
        attnops.paged_attention_with_lse(**args, lse=torch.empty(2, args["q"].shape[1]))


def test_non_contiguous_out_and_lse_are_written():
    args = random_paged_inputs([40, 200, 0], seed=4)
    q = args["q"]
    out = torch.full((q.shape[2], q.shape[0], q.shape[1]), float("nan")).permute(1, 2, 0)  # strided last dim
    lse = torch.full((q.shape[1], q.shape[0]), float("nan")).t()  # transposed
    _, ref_lse = paged_attention_reference(**args, return_lse=True)
    for backend in ("reference", "cpu", "triton"):
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        with attnops.use_backend(backend):
            attnops.paged_attention_with_lse(**args, out=out, lse=lse)
        assert_lse_close(lse, ref_lse, 1e-5)
        assert not out.isnan().any()


# ------------------------------------------------------------------------------------------------------------
# GPU only

@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "flashinfer"])
@pytest.mark.parametrize("name,inputs,options", CASES[:7], ids=[c[0] for c in CASES[:7]])
def test_lse_gpu_bf16(backend, name, inputs, options):
    """Triton in bf16, and FlashInfer (its run() gives base-2 LSEs; the rows it sets after run() get -inf/NaN),
    against the reference; cases a backend declines (FlashInfer: sinks, trees, per-head scales) are skipped."""
    inputs = dict(inputs, q_dtype=torch.bfloat16)
    if inputs.get("kv_format", "fp32") in ("fp32", "fp16"):
        inputs["kv_format"] = "bf16"
    args, options = case_args(inputs, options, seed=len(name), device=DEVICE)
    case = check_paged_attention(**{**dict(scale=None, soft_cap=0.0, window_left=-1, kv_format="auto", k_scale=None,
                                           v_scale=None), **args, **options})
    if not serving(backend, case):
        pytest.skip(f"{backend} does not serve {name}")
    _, ref_lse = paged_attention_reference(**args, **options, return_lse=True)
    _, lse = run_with_lse(backend, args, options)
    assert_lse_close(lse, ref_lse, TOLERANCE[torch.bfloat16])


@pytest.mark.gpu
def test_flashinfer_bad_indices_and_empty_rows_gpu():
    if BACKENDS["flashinfer"].unavailable():
        pytest.skip("; ".join(BACKENDS["flashinfer"].unavailable()))
    args = random_paged_inputs([40, 0, 50, 9], kv_format="bf16", q_dtype=torch.bfloat16, device=DEVICE, seed=5)
    args["block_table"][2, 1] = 1 << 20
    _, ref_lse = paged_attention_reference(**args, return_lse=True)
    _, lse = run_with_lse("flashinfer", args, {})
    assert_lse_close(lse, ref_lse, TOLERANCE[torch.bfloat16])
    assert lse[2].isnan().all() and (lse[1] == NEG_INF).all()
    attnops.take_errors()
