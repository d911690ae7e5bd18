"""Attention sinks and draft-tree masks (paged_attention's `sinks=` and `tree_mask=`): the reference against an
independent dense computation, every backend against the reference, validation, opcheck, torch.compile and CUDA
graphs, and the serving helpers (tree_mask_from_parents, PagedKVCache.keep_path)."""
from __future__ import annotations

import math
import random

import pytest
import torch

import attnops
from attnops import formats
from attnops.backends.reference import paged_attention_reference
from attnops.backends.triton.launch import launch as triton_launch
from attnops.testing import random_paged_inputs, relative_error

# --------------------------------------------------------------------------------------------------------------
# random cases


def random_case(rng: random.Random) -> dict:
    """A random case of the contract's grid: ragged lengths (empty and 1-token sequences included), decode or
    multi-token blocks, any page size, GQA/MQA/MHA, and each of sinks, tree mask, window and soft cap on or off."""
    batch = rng.randint(1, 4)
    decode = rng.random() < 0.3
    kv_lens = [rng.choice([0, 1, rng.randint(2, 90)]) for _ in range(batch)]
    q_lens = None if decode else [rng.randint(1, min(n, 9)) if n else 0 for n in kv_lens]
    heads = rng.choice([(4, 2), (8, 8), (4, 1), (8, 2)])
    case = dict(kv_lens=kv_lens, q_lens=q_lens, num_q_heads=heads[0], num_kv_heads=heads[1],
                head_dim=rng.choice([32, 64]), page_size=rng.choice([1, 4, 16]), seed=rng.randrange(1 << 30))
    options = dict(sinks=rng.random() < 0.6, tree=not decode and rng.random() < 0.6,
                   window_left=rng.choice([-1, -1, 0, 3, 20]), soft_cap=rng.choice([0.0, 0.0, 4.0]),
                   extra_cols=rng.randint(0, 3), tree_kind=rng.choice(["parents", "random"]))
    return dict(case=case, options=options)


def random_parents(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(-1, i) for i in range(n)]


def tree_mask_for(rng: random.Random, q_lens: list[int], extra_cols: int, kind: str) -> torch.Tensor:
    """A tree mask for the blocks q_lens: from random parents (a real draft tree), or any bool pattern (the
    contract does not ask for a tree)."""
    width = max(q_lens + [1]) + extra_cols
    if kind == "parents":
        return attnops.tree_mask_from_parents([random_parents(rng, n) for n in q_lens], width)
    return torch.rand(sum(q_lens), width, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < 0.5


def with_options(args: dict, options: dict, rng: random.Random) -> dict:
    """The op's keyword arguments for a case's options."""
    extra = dict(window_left=options["window_left"], soft_cap=options["soft_cap"])
    if options["sinks"]:
        extra["sinks"] = torch.randn(args["q"].shape[1], generator=torch.Generator().manual_seed(
            rng.randrange(1 << 30))) * 3
    if options["tree"]:
        cu = args["cu_seqlens_q"].tolist()
        extra["tree_mask"] = tree_mask_for(rng, [b - a for a, b in zip(cu, cu[1:])], options["extra_cols"],
                                           options["tree_kind"])
    return {**args, **extra}


# --------------------------------------------------------------------------------------------------------------
# an independent oracle: unpaged K and V, the contract's formulas, one row and head at a time


def dense_attention(q, keys, values, q_lens, *, scale, soft_cap, window_left, sinks, tree_mask):
    """q [T, Hq, D]; keys/values: per sequence [L, Hkv, D] float64; q_lens: rows per sequence (decode: 1 each).
    The contract, written out: row i of a block of n sees every key before the block and, without a tree mask,
    the block's keys up to its own position; with one, block key j iff tree_mask[row, j] (j < its width); the
    window by storage position; out = sum_j e^(x_j - m) v_j / (sum_j e^(x_j - m) + e^(s - m)), 0 if no key."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    num_q_heads = q.shape[1]
    row = 0
    for k, v, n in zip(keys, values, q_lens):
        length = k.shape[0]
        group = num_q_heads // k.shape[1]
        for i in range(n):
            pos = length - n + i
            seen = []
            for j in range(length):
                if j < length - n:
                    ok = True
                elif tree_mask is None:
                    ok = j <= pos
                else:
                    col = j - (length - n)
                    ok = col < tree_mask.shape[1] and bool(tree_mask[row, col])
                if ok and window_left >= 0:
                    ok = pos - j <= window_left
                if ok:
                    seen.append(j)
            for h in range(num_q_heads):
                if not seen:
                    continue
                x = torch.stack([(q[row, h].double() * k[j, h // group]).sum() * scale for j in seen])
                if 0 < soft_cap < math.inf:
                    x = soft_cap * torch.tanh(x / soft_cap)
                m = x.max()
                if sinks is not None:
                    m = torch.maximum(m, sinks[h].double())
                w = torch.exp(x - m)
                denom = w.sum() + (torch.exp(sinks[h].double() - m) if sinks is not None else 0.0)
                out[row, h] = (w[:, None] * torch.stack([v[j, h // group] for j in seen])).sum(0) / denom
            row += 1
    return out


def dense_case(case: dict, options: dict, rng: random.Random):
    """Unpaged float64 K/V per sequence, written into an fp32 paged cache by hand (pages in random order)."""
    gen = torch.Generator().manual_seed(case["seed"])
    hq, hkv, d, page = case["num_q_heads"], case["num_kv_heads"], case["head_dim"], case["page_size"]
    keys = [torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) for n in case["kv_lens"]]
    values = [torch.randn(n, hkv, d, generator=gen, dtype=torch.float64) for n in case["kv_lens"]]
    pages_needed = [-(-n // page) for n in case["kv_lens"]]
    num_pages = sum(pages_needed) + 2
    order = torch.randperm(num_pages, generator=gen).tolist()
    kv = torch.full((num_pages, 2, page, hkv, d), float("nan"))  # unwritten slots are never read
    table = torch.full((len(keys), max(pages_needed + [1]) + 1), -1, dtype=torch.int32)
    for b, (k, v) in enumerate(zip(keys, values)):
        for t in range(k.shape[0]):
            p = order.pop() if t % page == 0 else p
            table[b, t // page] = p
            kv[p, 0, t % page], kv[p, 1, t % page] = k[t].float(), v[t].float()
    q_lens = case["q_lens"] or [1] * len(keys)
    q = torch.randn(sum(q_lens), hq, d, generator=gen)
    cu = None if case["q_lens"] is None else torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)),
                                                          dtype=torch.int32)
    args = dict(q=q, k_cache=kv[:, 0], v_cache=kv[:, 1], block_table=table,
                seq_lens=torch.tensor(case["kv_lens"], dtype=torch.int32), cu_seqlens_q=cu)
    args = with_options(args, options, rng)
    # the oracle sees the keys as the cache holds them (fp32)
    expected = dense_attention(q, [k.float().double() for k in keys], [v.float().double() for v in values],
                               q_lens, scale=d ** -0.5, soft_cap=options["soft_cap"],
                               window_left=options["window_left"], sinks=args.get("sinks"),
                               tree_mask=args.get("tree_mask"))
    return args, expected


@pytest.mark.parametrize("chunk", range(4))
def test_reference_matches_an_independent_dense_computation(chunk):
    """200 random cases (4 chunks of 50) with sinks, tree masks, both, windows and soft cap."""
    seen = {"sinks": 0, "tree": 0, "both": 0, "window": 0, "soft_cap": 0}
    for i in range(50):
        rng = random.Random(1000 * chunk + i)
        spec = random_case(rng)
        args, expected = dense_case(spec["case"], spec["options"], rng)
        out = paged_attention_reference(**args, compute_dtype=torch.float64).double()
        assert torch.allclose(out, expected, rtol=1e-5, atol=1e-6), (chunk, i, spec)
        o = spec["options"]
        seen["sinks"] += o["sinks"]
        seen["tree"] += o["tree"]
        seen["both"] += o["sinks"] and o["tree"]
        seen["window"] += o["window_left"] >= 0
        seen["soft_cap"] += o["soft_cap"] > 0
    assert all(n >= 3 for n in seen.values()), seen  # the grid covers each option


# --------------------------------------------------------------------------------------------------------------
# every backend against the reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
# (backend, kv_format, q dtype): the CPU kernels' formats; Triton's under the interpreter (its bf16 loads are
# wrong there) or every format on a GPU
CPU_FORMATS = [("cpu", "fp32", torch.float32), ("cpu", "bf16", torch.bfloat16), ("cpu", "fp16", torch.float16),
               ("cpu", "fp8_e4m3", torch.float32)]
TRITON_FORMATS = [("triton", "fp32", torch.float32), ("triton", "fp16", torch.float16),
                  ("triton", "fp8_e4m3", torch.float16), ("triton", "nvfp4", torch.float16),
                  ("triton", "mxfp4", torch.float32)]
GPU_FORMATS = [("triton", "bf16", torch.bfloat16), ("triton", "fp8_e4m3", torch.bfloat16),
               ("triton", "nvfp4", torch.bfloat16), ("auto", "bf16", torch.bfloat16)]


def backend_cases(backend: str, kv_format: str, q_dtype, device: str, count: int, seed: int):
    for i in range(count):
        rng = random.Random(seed + i)
        spec = random_case(rng)
        case = {**spec["case"], "kv_format": kv_format, "q_dtype": q_dtype, "device": device}
        args = with_options(random_paged_inputs(**case), spec["options"], rng)
        for name in ("sinks", "tree_mask"):
            if name in args:
                args[name] = args[name].to(device)
        yield i, spec, args


def check_backend(backend, kv_format, q_dtype, device, count, seed, config=None):
    for i, spec, args in backend_cases(backend, kv_format, q_dtype, device, count, seed):
        ref = paged_attention_reference(**args, compute_dtype=torch.float64)
        if config is not None:  # Triton with a forced split plan: the merge kernel's sink path
            out = torch.empty_like(args["q"])
            fmt = formats.resolve_kv_format(args["kv_format"], args["k_cache"].dtype)
            triton_launch(**{k: args.get(k) for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens",
                                                      "cu_seqlens_q", "k_scale", "v_scale", "sinks", "tree_mask")},
                          scale=args["q"].shape[-1] ** -0.5, soft_cap=args["soft_cap"],
                          window_left=args["window_left"], kv_format=fmt, out=out, config=config)
        elif backend == "auto":
            out = torch.ops.attnops.paged_attention(**args)
        else:
            with attnops.use_backend(backend):
                out = torch.ops.attnops.paged_attention(**args)
        if ref.numel() == 0 or ref.abs().max() == 0:  # no query rows, or every row sees no key
            assert out.numel() == 0 or out.abs().max() == 0, (i, spec)
        else:
            err = relative_error(out, ref)
            assert err < TOLERANCE[q_dtype], (i, spec, err)


@pytest.mark.parametrize("backend,kv_format,q_dtype", CPU_FORMATS)
def test_cpu_kernels_match_the_reference(backend, kv_format, q_dtype):
    check_backend(backend, kv_format, q_dtype, "cpu", count=40, seed=7)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run; the GPU run is below")
@pytest.mark.parametrize("backend,kv_format,q_dtype", TRITON_FORMATS)
def test_triton_matches_the_reference_in_the_interpreter(backend, kv_format, q_dtype):
    check_backend(backend, kv_format, q_dtype, "cpu", count=12, seed=11)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run; the GPU run is below")
def test_triton_split_merge_honours_sinks_and_tree_masks_in_the_interpreter():
    check_backend("triton", "fp16", torch.float16, "cpu", count=6, seed=13,
                  config=dict(MAX_SPLITS=5, CHUNK=16, BLOCK_N=16))


@pytest.mark.gpu
@pytest.mark.parametrize("backend,kv_format,q_dtype", GPU_FORMATS)
def test_gpu_matches_the_reference(backend, kv_format, q_dtype):
    check_backend(backend, kv_format, q_dtype, "cuda", count=40, seed=17)


@pytest.mark.gpu
def test_gpu_split_merge_honours_sinks_and_tree_masks():
    check_backend("triton", "bf16", torch.bfloat16, "cuda", count=40, seed=19,
                  config=dict(MAX_SPLITS=7, CHUNK=16, BLOCK_N=16))


@pytest.mark.gpu
def test_flashinfer_declines_and_auto_takes_triton():
    args = random_paged_inputs([300, 40], [4, 2], num_q_heads=32, num_kv_heads=8, head_dim=128, kv_format="bf16",
                               q_dtype=torch.bfloat16, device="cuda")
    sinks = torch.zeros(32, device="cuda")
    tree = attnops.tree_mask_from_parents([[-1, 0, 0, 1], [-1, 0]], device="cuda")
    for extra in (dict(sinks=sinks), dict(tree_mask=tree)):
        explanation = attnops.explain(**args, **extra)
        assert explanation.chosen == "triton", explanation
        if "flashinfer" in explanation.rejected:
            assert any(("sinks" in r or "tree_mask" in r) for r in explanation.rejected["flashinfer"])


def test_sinks_change_the_answer_and_a_sink_of_minus_infinity_does_not():
    """A test that could fail: sinks must reach the output (and -inf is the same as none)."""
    args = random_paged_inputs([30, 7], [3, 2], num_q_heads=4, num_kv_heads=2)
    plain = torch.ops.attnops.paged_attention(**args)
    for backend in ("reference", "cpu"):
        with attnops.use_backend(backend):
            big = torch.ops.attnops.paged_attention(**args, sinks=torch.full((4,), 5.0))
            none = torch.ops.attnops.paged_attention(**args, sinks=torch.full((4,), -math.inf))
        assert relative_error(big, plain) > 0.1
        torch.testing.assert_close(none, plain)
        # with a sink the weights sum to less than one: the output shrinks towards 0
        assert big.norm() < plain.norm()


ROWS_WITHOUT_KEYS = [
    ([0, 30], None),  # decode of an empty sequence
    ([2, 9], [5, 3]),  # extend blocks with more queries than keys: their first rows sit before position 0
]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("config", [None, dict(MAX_SPLITS=3, CHUNK=16, BLOCK_N=16)], ids=["one-split", "splits"])
def test_a_row_that_sees_no_key_is_zero_whatever_its_sink(device, backend, config):
    """A sink of -inf is no sink, also on a row with no key: 0 and an LSE of -inf (not -inf - -inf = NaN); a
    finite sink gives 0 and the sink as LSE."""
    if device == "cuda" and backend != "triton":
        pytest.skip("the C++ kernels run on the CPU, and the reference is checked there")
    if config is not None and backend != "triton":
        pytest.skip("a forced split plan is Triton's")
    dtype = torch.float16 if device == "cpu" else torch.bfloat16
    for kv_lens, q_lens in ROWS_WITHOUT_KEYS:
        args = random_paged_inputs(kv_lens, q_lens, num_q_heads=4, num_kv_heads=2, q_dtype=dtype, device=device,
                                   kv_format="fp16" if dtype == torch.float16 else "bf16")
        empty = [0] if q_lens is None else [0, 1, 2]  # the rows that see no key (positions -1 and before)
        for sink in (-math.inf, 1.5):
            sinks = torch.full((4,), sink, device=device)
            if config is None:
                with attnops.use_backend(backend):
                    out, lse = torch.ops.attnops.paged_attention_with_lse(**args, sinks=sinks)
            else:
                out, lse = torch.empty_like(args["q"]), torch.empty(args["q"].shape[:2], device=device)
                triton_launch(**{k: args.get(k) for k in ("q", "k_cache", "v_cache", "block_table", "seq_lens",
                                                          "cu_seqlens_q", "k_scale", "v_scale")},
                              sinks=sinks, scale=args["q"].shape[-1] ** -0.5, soft_cap=0.0, window_left=-1,
                              kv_format=formats.resolve_kv_format("auto", args["k_cache"].dtype),
                              out=out, lse=lse, config=config)
            assert not out.isnan().any(), (kv_lens, sink)
            assert out[empty].abs().max() == 0, (kv_lens, sink)
            assert (lse[empty] == sink).all(), (kv_lens, sink, lse[empty])
            ref = paged_attention_reference(**args, sinks=sinks, compute_dtype=torch.float64)
            assert relative_error(out, ref) < TOLERANCE[dtype]


# --------------------------------------------------------------------------------------------------------------
# validation, opcheck, compile, graphs


def _verify_args():
    return random_paged_inputs([20, 9], [4, 3], num_q_heads=4, num_kv_heads=2)


@pytest.mark.parametrize("extra,error,words", [
    (dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks must be float32"),
    (dict(sinks=torch.zeros(2)), ValueError, "sinks must be [num_q_heads] = [4]"),
    (dict(sinks=torch.zeros(1, 4)), ValueError, "sinks must be [num_q_heads]"),
    (dict(sinks=0.5), TypeError, "sinks must be a tensor"),
    (dict(tree_mask=torch.ones(7, 4, dtype=torch.int32)), TypeError, "tree_mask must be bool"),
    (dict(tree_mask=torch.ones(6, 4, dtype=torch.bool)), ValueError, "tree_mask must be [num_query_rows, Q] = [7"),
    (dict(tree_mask=torch.ones(7, dtype=torch.bool)), ValueError, "tree_mask must be"),
    (dict(tree_mask=torch.ones(4, 7, dtype=torch.bool).t()), ValueError, "contiguous in its last dimension"),
])
def test_bad_sinks_and_tree_masks_are_named(extra, error, words):
    with pytest.raises(error, match=words.replace("[", r"\[").replace("]", r"\]")):
        attnops.paged_attention(**_verify_args(), **extra)


def test_a_tree_mask_with_decode_is_an_error():
    args = random_paged_inputs([20, 9], num_q_heads=4, num_kv_heads=2)
    with pytest.raises(ValueError, match="tree_mask needs cu_seqlens_q"):
        torch.ops.attnops.paged_attention(**args, tree_mask=torch.ones(2, 1, dtype=torch.bool))


def test_a_tree_mask_narrower_than_a_block_is_an_error_when_checked(monkeypatch):
    args = _verify_args()
    narrow = torch.ones(7, 3, dtype=torch.bool)
    torch.ops.attnops.paged_attention(**args, tree_mask=narrow)  # unchecked: columns past 3 are not visible
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match="tree_mask has 3 columns but the longest query block has 4"):
        torch.ops.attnops.paged_attention(**args, tree_mask=narrow)


@pytest.mark.parametrize("given", ["sinks", "tree_mask", "both"])
def test_opcheck_with_sinks_and_tree_mask(given):
    args = _verify_args()
    q, k, v, table, lens, cu = (args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens",
                                                      "cu_seqlens_q"))
    kwargs = dict(args, window_left=5, soft_cap=3.0)
    if given in ("sinks", "both"):
        kwargs["sinks"] = torch.randn(4)
    if given in ("tree_mask", "both"):
        kwargs["tree_mask"] = attnops.tree_mask_from_parents([[-1, 0, 0, 2], [-1, 0, 1]])
    torch.library.opcheck(torch.ops.attnops.paged_attention.default, (q, k, v, table, lens, cu), kwargs)
    out = torch.empty_like(q)
    torch.library.opcheck(torch.ops.attnops.paged_attention.out, (q, k, v, table, lens, cu), {**kwargs, "out": out})


def test_compiles_fullgraph_with_sinks_and_tree_mask():
    args = _verify_args()
    sinks = torch.randn(4)
    tree = attnops.tree_mask_from_parents([[-1, 0, 0, 2], [-1, 0, 1]])

    def step(q, tree_mask, sinks):
        return torch.ops.attnops.paged_attention(**{**args, "q": q}, sinks=sinks, tree_mask=tree_mask) * 2

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    torch.testing.assert_close(compiled(args["q"], tree, sinks), step(args["q"], tree, sinks))
    # a new mask and new sinks: same graph, new answer
    tree2 = attnops.tree_mask_from_parents([[-1, -1, 1, 1], [-1, 0, 0]])
    torch.testing.assert_close(compiled(args["q"], tree2, -sinks), step(args["q"], tree2, -sinks))
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1


@pytest.mark.gpu
def test_cuda_graph_replays_a_new_tree_mask_each_step():
    """One captured verify step; each replay gets a new draft tree (and sinks) copied into the graph's mask."""
    args = random_paged_inputs([500, 70, 33], [16, 16, 16], num_q_heads=32, num_kv_heads=8, head_dim=128,
                               kv_format="bf16", q_dtype=torch.bfloat16, device="cuda")
    rng = random.Random(3)
    mask = torch.zeros(48, 16, dtype=torch.bool, device="cuda")
    sinks = torch.zeros(32, device="cuda")
    out = torch.empty_like(args["q"])
    run = lambda: torch.ops.attnops.paged_attention.out(**args, sinks=sinks, tree_mask=mask, out=out)  # noqa: E731
    mask.copy_(attnops.tree_mask_from_parents([random_parents(rng, 16) for _ in range(3)]))
    run()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    for step in range(5):
        mask.copy_(attnops.tree_mask_from_parents([random_parents(rng, 16) for _ in range(3)]))
        sinks.copy_(torch.randn(32) * step)
        graph.replay()
        ref = paged_attention_reference(**args, sinks=sinks, tree_mask=mask, compute_dtype=torch.float64)
        assert relative_error(out, ref) < 1e-2, step


# --------------------------------------------------------------------------------------------------------------
# serving helpers


def test_tree_mask_from_parents():
    mask = attnops.tree_mask_from_parents([[-1, 0, 0, 1], [-1, -1]], width=5)
    assert mask.tolist() == [
        [True, False, False, False, False],
        [True, True, False, False, False],
        [True, False, True, False, False],
        [True, True, False, True, False],
        [True, False, False, False, False],
        [False, True, False, False, False],
    ]
    # a chain is the causal rule
    chain = attnops.tree_mask_from_parents([[-1, 0, 1, 2]])
    assert torch.equal(chain, torch.ones(4, 4, dtype=torch.bool).tril())
    with pytest.raises(ValueError, match="parent is -1"):
        attnops.tree_mask_from_parents([[-1, 2, 0]])
    with pytest.raises(ValueError, match="more than width"):
        attnops.tree_mask_from_parents([[-1, 0, 0]], width=2)


def test_a_chain_tree_equals_causal_verify():
    args = random_paged_inputs([40, 12], [5, 3], num_q_heads=4, num_kv_heads=2)
    chain = attnops.tree_mask_from_parents([[-1, 0, 1, 2, 3], [-1, 0, 1]])
    for backend in ("reference", "cpu"):
        with attnops.use_backend(backend):
            torch.testing.assert_close(torch.ops.attnops.paged_attention(**args, tree_mask=chain),
                                       torch.ops.attnops.paged_attention(**args))


@pytest.mark.parametrize("kv_format", ["fp32", "fp8_e4m3", "nvfp4"])
def test_keep_path_keeps_the_accepted_tokens_and_drops_the_rest(kv_format):
    """Verify a draft tree, keep one root-to-leaf path: the cache then holds exactly what writing only that path
    would have written, and attention over it agrees."""
    cache = attnops.PagedKVCache(1, 16, 4, 2, 64, kv_format=kv_format, shuffle_pages=True)
    plain = attnops.PagedKVCache(1, 16, 4, 2, 64, kv_format=kv_format, shuffle_pages=True, seed=1)
    prefix, tree = torch.randn(10, 2, 2, 64), torch.randn(7, 2, 2, 64)  # [tokens, K/V, heads, dim]
    path = [0, 2, 5]
    for c, tokens in ((cache, torch.cat([prefix, tree])), (plain, torch.cat([prefix, tree[path]]))):
        c.allocate("s")
        meta = c.prepare(["s"], [tokens.shape[0]], decode=False)
        torch.ops.attnops.reshape_and_cache(tokens[:, 0], tokens[:, 1], slot_mapping=meta.slot_mapping,
                                            **c.write_args(0))
    free_before = cache.free_pages
    cache.keep_path("s", 10, path)
    assert cache.seq_len("s") == 13 and cache.free_pages == free_before + 1  # 17 tokens -> 13: one page back
    q = torch.randn(1, 4, 64)
    outs = []
    for c in (cache, plain):
        meta = c.prepare(["s"], 1)
        torch.ops.attnops.reshape_and_cache(tree[6:, 0], tree[6:, 1], slot_mapping=meta.slot_mapping,
                                            **c.write_args(0))
        outs.append(torch.ops.attnops.paged_attention(q, block_table=meta.block_table, seq_lens=meta.seq_lens,
                                                      **c.attention_args(0)))
    torch.testing.assert_close(outs[0], outs[1])
    with pytest.raises(ValueError, match="increasing"):
        cache.keep_path("s", 10, [1, 0])
