"""Latent attention's sparse form (mla_attention's topk_indices: each query row attends only to the key positions
it lists, as DeepSeek-V3.2's indexer picks them): the reference against an independent computation over each row's
listed keys, the Triton kernel against the reference on random ragged batches (decode, extend, draft trees, sinks,
fp8, forced splits, repeated and padded entries; the interpreter here, bf16 on a GPU), the dense form as the sparse
one listing every key, the C++ CPU kernels (each row a sequence of its own listed keys), the bad-index rule,
validation, dispatch, opcheck, torch.compile, batch-invariant mode and CUDA graphs."""
from __future__ import annotations

import math
import random

import pytest
import torch

import attnops
from attnops.backends.reference import mla_attention_reference
from attnops.testing import relative_error
from test_mla import check_launch, mla_inputs

GPU = torch.cuda.is_available()


def row_positions(args) -> list[tuple[int, int, int]]:
    """(sequence, sequence length, position) of every query row."""
    lengths = args["seq_lens"].tolist()
    cu = args.get("cu_seqlens_q")
    starts = list(range(len(lengths) + 1)) if cu is None else cu.tolist()
    rows = []
    for b, n in enumerate(lengths):
        q_len = starts[b + 1] - starts[b]
        rows += [(b, n, n - q_len + i) for i in range(q_len)]
    return rows


def random_topk(args, k: int, gen: torch.Generator, *, beyond=True) -> torch.Tensor:
    """int32 [T, k]: each row's entries drawn from its sequence's positions (repeats and -1 among them; with
    `beyond`, positions after the row's own too, which it must not see)."""
    rows = []
    for _, n, pos in row_positions(args):
        top = (n if beyond else pos + 1)
        entries = torch.randint(-1, max(top, 1), (k,), generator=gen) if top > 0 else torch.full((k,), -1)
        rows.append(entries)
    return torch.stack(rows).to(torch.int32) if rows else torch.zeros(0, k, dtype=torch.int32)


def dense_sparse_mla(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale, kv_format="auto",
                     kv_scale=None, sinks=None, tree_mask=None, topk_indices):
    """The contract written out: each row's softmax over the keys of its list it may see, one term an entry,
    float64 (no bad indices)."""
    latent = q_nope.shape[2]
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    rows = kv_cache.double() * (kv_scale.double() if kv_scale is not None else 1.0)
    page = kv_cache.shape[1]
    args = dict(seq_lens=seq_lens, cu_seqlens_q=cu_seqlens_q)
    first_row = {}
    for t, (b, n, pos) in enumerate(row_positions(args)):
        first_row.setdefault(b, t)
        q_len = n - pos + (t - first_row[b])  # (rows of a sequence are its last q_len positions)
        block_start = n - q_len
        keys = []
        for p in topk_indices[t].tolist():
            if p < 0:
                continue
            if tree_mask is None:
                seen = p <= pos
            else:
                col = p - block_start
                seen = col < 0 or (col < tree_mask.shape[1] and bool(tree_mask[t, col]))
            if seen:
                keys.append(rows[block_table[b, p // page].long(), p % page])
        scores = [] if not keys else (torch.cat([q_nope[t], q_pe[t]], -1).double() @ torch.stack(keys).T) * scale
        if not keys:
            continue
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], -1)
        probs = torch.softmax(scores, -1)[:, :len(keys)]
        out[t] = probs @ torch.stack(keys)[:, :latent]
    return out


CASES = [  # kv_lens, q_lens, heads, latent, rope, page_size, k
    ([5, 0, 40, 17], None, 16, 64, 16, 4, 8),
    ([33, 1, 70], None, 3, 128, 32, 16, 40),
    ([9, 30, 3], [3, 5, 3], 20, 192, 48, 8, 6),
    ([2, 9], [5, 3], 8, 64, 64, 1, 3),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_reference_matches_an_independent_computation(case, tree):
    kv_lens, q_lens, heads, latent, rope, page, k = CASES[case]
    if tree and q_lens is None:
        pytest.skip("a tree mask is for query blocks")
    args = mla_inputs(kv_lens, q_lens, heads=heads, latent=latent, rope=rope, page_size=page, dtype=torch.float32,
                      seed=case)
    gen = torch.Generator().manual_seed(case)
    args["topk_indices"] = random_topk(args, k, gen)
    if tree:
        args["tree_mask"] = torch.rand(args["q_nope"].shape[0], max(q_lens) + 1, generator=gen) < 0.5
    sinks = torch.randn(heads, generator=gen)
    attnops.take_errors()
    got = mla_attention_reference(**args, sinks=sinks, compute_dtype=torch.float64)
    assert relative_error(got, dense_sparse_mla(**args, sinks=sinks)) < 1e-5
    assert attnops.take_errors() == {}


def every_key(args) -> torch.Tensor:
    """Each row listing every position of its sequence (then -1)."""
    width = max(args["seq_lens"].tolist() + [1])
    rows = [torch.cat([torch.arange(n), torch.full((width - n,), -1)]) for _, n, _ in row_positions(args)]
    return torch.stack(rows).to(torch.int32)


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_listing_every_key_is_the_dense_form(backend):
    args = mla_inputs([30, 0, 9, 17], [4, 0, 2, 1], heads=4, dtype=torch.float32, seed=5)
    sinks = torch.randn(4)
    with attnops.use_backend(backend):
        dense, dense_lse = torch.ops.attnops.mla_attention_with_lse(**args, sinks=sinks)
        sparse, sparse_lse = torch.ops.attnops.mla_attention_with_lse(**args, sinks=sinks,
                                                                      topk_indices=every_key(args))
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sparse_lse, dense_lse, atol=1e-5, rtol=1e-5)


def random_spec(rng: random.Random) -> dict:
    batch = rng.randint(1, 4)
    decode = rng.random() < 0.5
    kv_lens = [rng.choice([0, 1, rng.randint(2, 90)]) for _ in range(batch)]
    q_lens = None if decode else [rng.randint(0, min(n, 5)) if n else rng.randint(0, 2) for n in kv_lens]
    return dict(kv_lens=kv_lens, q_lens=q_lens, heads=rng.choice([1, 4, 16, 20]), latent=rng.choice([64, 128]),
                rope=rng.choice([16, 32, 64]), page_size=rng.choice([1, 4, 16]), seed=rng.randrange(1 << 30),
                kv_format=rng.choice(["auto", "auto", "fp8_e4m3"]), sinks=rng.random() < 0.4,
                tree=not decode and rng.random() < 0.5, k=rng.choice([1, 7, 16, 50]),
                config=rng.choice([None, dict(CHUNK=16, BLOCK_N=16)]))  # forced splits of the entries


def spec_inputs(spec, device, dtype):
    args = mla_inputs(spec["kv_lens"], spec["q_lens"], heads=spec["heads"], latent=spec["latent"],
                      rope=spec["rope"], page_size=spec["page_size"], dtype=dtype, kv_format=spec["kv_format"],
                      seed=spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    args["topk_indices"] = random_topk(args, spec["k"], gen)
    if spec["sinks"]:
        args["sinks"] = torch.randn(spec["heads"], generator=gen) * 2
    if spec["tree"]:
        args["tree_mask"] = torch.rand(args["q_nope"].shape[0], max(spec["q_lens"]) + 1, generator=gen) < 0.5
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def check_triton(spec, device, dtype):
    check_launch(spec_inputs(spec, device, dtype), spec, device, dtype)


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU run is below")
@pytest.mark.parametrize("seed", range(3))
def test_triton_matches_the_reference_in_the_interpreter(seed):
    rng = random.Random(seed)
    for _ in range(6):
        check_triton(random_spec(rng), "cpu", rng.choice([torch.float16, torch.float32]))


@pytest.mark.parametrize("seed", range(4))
def test_cpu_matches_the_float64_reference_on_random_batches(seed):
    """The C++ CPU kernels (each row a sequence of its own listed keys) against the reference: the random batches
    above, fp32/bf16/fp16 queries, bad indices among them."""
    rng = random.Random(50 + seed)
    for _ in range(8):
        spec = random_spec(rng)
        dtype = rng.choice([torch.float32, torch.bfloat16, torch.float16])
        args = spec_inputs(spec, "cpu", dtype)
        if rng.random() < 0.3 and args["topk_indices"].numel():  # a bad entry, or a bad page a row sees
            if rng.random() < 0.5:
                args["topk_indices"].view(-1)[rng.randrange(args["topk_indices"].numel())] = 10_000
            else:
                args["block_table"].view(-1)[rng.randrange(args["block_table"].numel())] = 999
        attnops.take_errors()
        with attnops.use_backend("cpu"):
            out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
        got_errors = attnops.take_errors()
        ref, ref_lse = mla_attention_reference(**args, return_lse=True)
        assert got_errors == attnops.take_errors(), spec
        if ref.numel():
            assert torch.equal(out.isnan(), ref.isnan()), spec
            assert relative_error(out.nan_to_num(), ref.nan_to_num()) < (1e-5 if dtype == torch.float32 else 1e-2)
            torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3, equal_nan=True,
                                       msg=lambda m: f"{spec}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_triton_matches_the_reference_on_the_gpu(seed):
    rng = random.Random(200 + seed)
    for _ in range(30):
        check_triton(random_spec(rng), "cuda", rng.choice([torch.bfloat16, torch.float16]))


@pytest.mark.gpu
def test_gpu_deepseek_shapes_through_the_op():
    """R 512, P 64, 2048 entries a row (DeepSeek-V3.2's top-k) at 16 and 128 heads, decode and verify, bf16 and
    fp8, through the op (auto picks a backend that serves the form)."""
    for heads in (16, 128):
        for q_lens, kv_format in ((None, "auto"), ([2, 2, 2], "auto"), (None, "fp8_e4m3")):
            args = mla_inputs([700, 5000, 129], q_lens, heads=heads, latent=512, rope=64, page_size=64,
                              dtype=torch.bfloat16, kv_format=kv_format, seed=heads)
            args["topk_indices"] = random_topk(args, 2048, torch.Generator().manual_seed(heads), beyond=False)
            args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
            assert attnops.explain(**args).chosen == "triton"
            out = torch.ops.attnops.mla_attention(**args)
            assert relative_error(out, mla_attention_reference(**args)) < 1e-2, (heads, q_lens, kv_format)


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_a_listed_position_outside_its_sequence_poisons_its_row(backend, monkeypatch):
    args = mla_inputs([10, 7, 12], [3, 2, 1], heads=4)
    topk = random_topk(args, 5, torch.Generator().manual_seed(0))
    topk[3, 2] = 7  # sequence 1 (7 keys): position 7 is past its end
    topk[5, 0] = -2  # sequence 2's row
    args["topk_indices"] = topk
    attnops.take_errors()
    with attnops.use_backend(backend):
        out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
    assert attnops.take_errors() == {"topk_indices": 3}
    bad = torch.tensor([False, False, False, True, False, True])
    assert out[bad].isnan().all() and lse[bad].isnan().all()
    assert not out[~bad].isnan().any() and not lse[~bad].isnan().any()
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match=r"attnops\.mla_attention: topk_indices\[3, 2\] = 7 is outside"):
        torch.ops.attnops.mla_attention(**args)


BAD = {
    "int64": (TypeError, lambda a: dict(a, topk_indices=a["topk_indices"].long())),
    "one dimension": (ValueError, lambda a: dict(a, topk_indices=a["topk_indices"][:, 0].contiguous())),
    "rows": (ValueError, lambda a: dict(a, topk_indices=a["topk_indices"][:-1])),
    "no entries": (ValueError, lambda a: dict(a, topk_indices=a["topk_indices"][:, :0])),
    "strided": (ValueError, lambda a: dict(a, topk_indices=a["topk_indices"].repeat(1, 2)[:, ::2])),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_topk_indices_are_named_before_any_kernel_runs(name):
    error, change = BAD[name]
    args = mla_inputs([10, 7], [3, 2], heads=4)
    args["topk_indices"] = random_topk(args, 4, torch.Generator().manual_seed(1))
    args = change(args)
    with pytest.raises(error, match=r"attnops\.mla_attention: .*\btopk_indices\b"):
        torch.ops.attnops.mla_attention(**args)
    with pytest.raises(error, match=r"\btopk_indices\b"), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        torch.ops.attnops.mla_attention(**args)


def test_dispatch_sends_the_sparse_form_to_the_backends_that_serve_it():
    args = mla_inputs([10, 7], None, heads=4)
    args["topk_indices"] = random_topk(args, 4, torch.Generator().manual_seed(2))
    explanation = attnops.explain(**args)
    assert explanation.chosen == "cpu"
    assert explanation.case.topk == 4
    from attnops.backends import cuda_mla, flashinfer_mla
    case = explanation.case
    assert any("sparse form" in r for r in flashinfer_mla.reasons(case))
    assert any("sparse form" in r for r in cuda_mla.reasons(case)) or not cuda_mla.served_formats()


def test_opcheck_and_compile():
    args = mla_inputs([10, 7], [3, 2], heads=4)
    topk = random_topk(args, 6, torch.Generator().manual_seed(3))
    pos = (args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"], args["seq_lens"])
    kwargs = dict(cu_seqlens_q=args["cu_seqlens_q"], scale=args["scale"], topk_indices=topk)
    with attnops.use_backend("reference"):
        torch.library.opcheck(torch.ops.attnops.mla_attention.default, pos, kwargs)
        torch.library.opcheck(torch.ops.attnops.mla_attention_with_lse.default, pos, kwargs)
        torch.library.opcheck(torch.ops.attnops.mla_attention.out, pos,
                              dict(kwargs, out=torch.empty_like(args["q_nope"])))
        torch.library.opcheck(torch.ops.attnops.mla_attention_with_lse.out, pos,
                              dict(kwargs, out=torch.empty_like(args["q_nope"]),
                                   lse=torch.empty(args["q_nope"].shape[:2])))
    torch._dynamo.reset()

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, topk_indices):
        return attnops.mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, scale=0.2,
                                     topk_indices=topk_indices) * 2

    got = torch.compile(step, fullgraph=True)(*pos, args["cu_seqlens_q"], topk)
    want = 2 * mla_attention_reference(**dict(args, scale=0.2), topk_indices=topk)
    assert relative_error(got, want) < 1e-2


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_batch_invariant_a_row_is_the_same_bits_in_any_batch(backend):
    """Inside the mode: a target sequence's row, alone and among others (before and after it), with its list
    padded by -1 entries to a wider K, gives the same bits."""
    gen = torch.Generator().manual_seed(4)
    target = mla_inputs([90], None, heads=4, seed=9)
    target["topk_indices"] = random_topk(target, 40, gen, beyond=False)
    others = mla_inputs([70, 3, 120], None, heads=4, seed=10, spare_pages=0)

    def batch_with(first: bool, width: int) -> dict:
        """The target among the others, its pages after theirs, every list padded to `width` entries."""
        cache = torch.cat([others["kv_cache"], target["kv_cache"]])
        shift = others["kv_cache"].shape[0]
        t_table = target["block_table"] + shift
        o_table = others["block_table"]
        cols = max(t_table.shape[1], o_table.shape[1])
        pad = lambda t: torch.nn.functional.pad(t, (0, cols - t.shape[1]), value=0)  # noqa: E731
        tables = [pad(t_table), pad(o_table)] if first else [pad(o_table), pad(t_table)]
        lens = [target["seq_lens"], others["seq_lens"]] if first else [others["seq_lens"], target["seq_lens"]]
        o_topk = random_topk(others, width, gen, beyond=False)
        t_topk = torch.nn.functional.pad(target["topk_indices"], (0, width - 40), value=-1)
        topk = [t_topk, o_topk] if first else [o_topk, t_topk]
        q = [target["q_nope"], others["q_nope"]] if first else [others["q_nope"], target["q_nope"]]
        qp = [target["q_pe"], others["q_pe"]] if first else [others["q_pe"], target["q_pe"]]
        return dict(q_nope=torch.cat(q), q_pe=torch.cat(qp), kv_cache=cache, block_table=torch.cat(tables),
                    seq_lens=torch.cat(lens), scale=target["scale"], topk_indices=torch.cat(topk))

    with attnops.use_backend(backend), attnops.batch_invariant():
        alone, alone_lse = torch.ops.attnops.mla_attention_with_lse(**target)
        for first, width, row in ((True, 40, 0), (False, 40, 3), (False, 100, 3), (True, 70, 0)):
            args = batch_with(first, width)
            out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
            assert torch.equal(out[row], alone[0]) and torch.equal(lse[row], alone_lse[0]), (first, width)


@pytest.mark.gpu
def test_a_user_cuda_graph_replays_new_lengths_lists_and_tables():
    args = mla_inputs([300, 40, 1000], None, heads=16, latent=512, rope=64, page_size=16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(5)
    args["topk_indices"] = random_topk(args, 256, gen, beyond=False)
    args = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    out = torch.empty_like(args["q_nope"])
    with attnops.use_backend("triton"):
        torch.ops.attnops.mla_attention.out(**args, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.attnops.mla_attention.out(**args, out=out)
    for lengths in ([900, 30, 250], [0, 1, 1000]):
        args["seq_lens"].copy_(torch.tensor(lengths))
        args["block_table"].copy_(args["block_table"].flip(0))
        host = {k: (v.cpu() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        args["topk_indices"].copy_(random_topk(host, 256, gen, beyond=False))
        graph.replay()
        assert relative_error(out, mla_attention_reference(**args)) < 1e-2, lengths


@pytest.mark.gpu
def test_compiled_with_cuda_graphs():
    args = mla_inputs([300, 40], [2, 1], heads=16, latent=512, rope=64, page_size=16, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(6)
    torch._dynamo.reset()

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q, topk_indices):
        return torch.ops.attnops.mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q,
                                               scale=0.1, topk_indices=topk_indices)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    names = ["q_nope", "q_pe", "kv_cache", "block_table", "seq_lens", "cu_seqlens_q", "topk_indices"]
    with attnops.use_backend("triton"):
        for lengths in ([300, 40], [12, 25], [299, 1]):
            args["seq_lens"] = torch.tensor(lengths, dtype=torch.int32)
            args["topk_indices"] = random_topk(args, 64, gen)
            dev = {k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
            got = compiled(*(dev[n] for n in names))
            want = mla_attention_reference(**dict(dev, scale=0.1))
            assert relative_error(got, want) < 1e-2, lengths
    assert math.isfinite(float(got.float().abs().max()))
