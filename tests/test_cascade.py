"""cascade_attention: a shared prefix read once and merged with each sequence's own keys, against the float64
reference over the same keys laid out as one sequence each (full-page and partial prefixes, empty prefixes and
suffixes, decode and multi-token, sinks, soft cap, every format the backend serves); validation; torch.compile;
the Generator's use of it (same tokens as without)."""
from __future__ import annotations

import random

import pytest
import torch

import attnops
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference
from attnops.cascade import (cascade_attention, cascade_min_prefix_tokens, cascade_pays, host_prefix_pass, prefix_pass,
                             shared_prefix_pages)
from attnops.testing import random_paged_inputs, relative_error


def shared_case(prefix_len, suffix_lens, q_lens=None, *, page_size=16, kv_format="fp32", q_dtype=torch.float32,
                num_q_heads=4, num_kv_heads=2, head_dim=32, seed=0, device="cpu"):
    """(cascade arguments, the same keys as one sequence each: paged_attention arguments). The prefix is
    sequence 0 of a random paged cache, the suffixes the others; the combined cache copies each sequence's
    stored tokens (and block scales) prefix first."""
    base = random_paged_inputs([prefix_len] + list(suffix_lens), page_size=page_size, kv_format=kv_format,
                               num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                               q_dtype=q_dtype, seed=seed, device=device)
    table = base["block_table"]
    prefix_pages = -(-prefix_len // page_size)
    prefix_table = table[0, :max(prefix_pages, 1)].clone()
    suffix_table, suffix_lens_t = table[1:].clone(), base["seq_lens"][1:].clone()
    gen = torch.Generator().manual_seed(seed + 1)
    batch = len(suffix_lens)
    if q_lens is None:
        num_tokens, cu = batch, None
    else:
        cu = torch.tensor([0] + list(q_lens), dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
        num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen).to(q_dtype).to(device)

    def tokens(cache, pages, n):  # stored rows of a sequence's first n tokens
        return cache[pages.long()].flatten(0, 1)[:n]

    fourbit = kv_format in ("nvfp4", "mxfp4")
    combined = {}
    for name, scale_name in (("k_cache", "k_scale"), ("v_cache", "v_scale")):
        rows, scale_rows = [], []
        for b in range(batch):
            seq = [tokens(base[name], prefix_table, prefix_len), tokens(base[name], suffix_table[b], suffix_lens[b])]
            rows.append(torch.cat(seq))
            if fourbit:
                scale_rows.append(torch.cat([tokens(base[scale_name], prefix_table, prefix_len),
                                             tokens(base[scale_name], suffix_table[b], suffix_lens[b])]))
        combined[name], combined[scale_name] = rows, scale_rows
    width = max(-(-(prefix_len + n) // page_size) for n in suffix_lens) or 1
    k_pages, v_pages, ks_pages, vs_pages, full_table = [], [], [], [], torch.full((batch, width), -1, dtype=torch.int32)

    def paged(rows_b):
        pad = (-rows_b.shape[0]) % page_size
        rows_b = torch.cat([rows_b, rows_b.new_zeros((pad,) + rows_b.shape[1:])])
        return rows_b.view(-1, page_size, *rows_b.shape[1:])

    for b in range(batch):
        start = sum(p.shape[0] for p in k_pages)
        k_pages.append(paged(combined["k_cache"][b]))
        v_pages.append(paged(combined["v_cache"][b]))
        if fourbit:
            ks_pages.append(paged(combined["k_scale"][b]))
            vs_pages.append(paged(combined["v_scale"][b]))
        full_table[b, :k_pages[-1].shape[0]] = torch.arange(start, start + k_pages[-1].shape[0])
    full = dict(q=q, k_cache=torch.cat(k_pages), v_cache=torch.cat(v_pages), block_table=full_table.to(device),
                seq_lens=(suffix_lens_t + prefix_len), cu_seqlens_q=cu, kv_format=base["kv_format"])
    if fourbit:
        full.update(k_scale=torch.cat(ks_pages), v_scale=torch.cat(vs_pages))
    elif "k_scale" in base:
        full.update(k_scale=base["k_scale"], v_scale=base["v_scale"])
    cascade = dict(q=q, k_cache=base["k_cache"], v_cache=base["v_cache"], prefix_table=prefix_table,
                   prefix_len=torch.tensor([prefix_len], dtype=torch.int32, device=device),
                   block_table=suffix_table, seq_lens=suffix_lens_t, cu_seqlens_q=cu, kv_format=base["kv_format"])
    for key in ("k_scale", "v_scale"):
        if key in base:
            cascade[key] = base[key]
    return cascade, full


def backends_here():
    return [name for name in ("reference", "cpu", "triton") if not BACKENDS[name].unavailable()]


CASES = [  # prefix, suffixes, q_lens
    (64, [5, 17, 1, 40], None),  # full pages
    (45, [3, 16, 30], None),  # a partial last page
    (0, [9, 2], None),  # no prefix
    (96, [1, 1, 1, 1, 1, 1], None),  # every suffix just the new token
    (32, [6, 12, 4], [2, 5, 4]),  # multi-token (verify-like)
    (50, [20, 7], [20, 3]),  # a prefill after a shared prefix
]


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_equals_attention_over_the_whole_sequence(backend, case):
    if BACKENDS[backend].unavailable():
        pytest.skip("; ".join(BACKENDS[backend].unavailable()))
    prefix, suffixes, q_lens = CASES[case]
    cascade, full = shared_case(prefix, suffixes, q_lens, seed=case)
    with attnops.use_backend(backend):
        got = cascade_attention(**cascade)
    want = paged_attention_reference(**full, compute_dtype=torch.float64)
    assert relative_error(got, want) < 1e-5


@pytest.mark.parametrize("kv_format,q_dtype,tol", [("fp16", torch.float16, 2e-3), ("fp8_e4m3", torch.float16, 2e-3),
                                                   ("nvfp4", torch.float16, 2e-3), ("mxfp4", torch.float32, 1e-5)])
def test_formats_sinks_and_soft_cap(kv_format, q_dtype, tol):
    rng = random.Random(kv_format)
    for backend in backends_here():
        prefix = rng.choice([16, 40, 64])
        cascade, full = shared_case(prefix, [rng.randint(1, 30) for _ in range(3)], page_size=16, kv_format=kv_format,
                                    q_dtype=q_dtype, head_dim=64, seed=rng.randint(0, 99))
        sinks = torch.randn(cascade["q"].shape[1]) * 2
        with attnops.use_backend(backend):
            try:
                got = cascade_attention(**cascade, sinks=sinks, soft_cap=5.0)
            except ValueError as e:  # the pinned backend does not serve this format: nothing to compare
                assert "this case" in str(e)
                continue
        want = paged_attention_reference(**full, sinks=sinks, soft_cap=5.0, compute_dtype=torch.float64)
        assert relative_error(got, want) < tol, backend


@pytest.mark.parametrize("prefix_len", [0, 16, 45, 64])
def test_a_prefix_pass_made_once_a_step_gives_the_same(prefix_len):
    """The prefix pass's inputs made on the host from the page list (once a step, PagedKVCache.cascade_split) equal
    those made on the device, and cascade_attention given them equals the call that makes its own."""
    cascade, full = shared_case(prefix_len, [5, 17, 2], seed=prefix_len)
    page_size = cascade["k_cache"].shape[1]
    device_made = prefix_pass(cascade["prefix_table"], cascade["prefix_len"], page_size, 3)
    host_made = host_prefix_pass(cascade["prefix_table"].tolist(), prefix_len, page_size, 3, "cpu")
    for name, got, want in zip(device_made._fields[:4], host_made, device_made):
        assert torch.equal(got, want), name
    assert host_made.bad is None and not device_made.bad.any()
    with attnops.use_backend("reference"):
        given = cascade_attention(**{**cascade, "prefix_table": None, "prefix_len": None}, prefix=host_made)
    assert relative_error(given, paged_attention_reference(**full, compute_dtype=torch.float64)) < 1e-5


def test_bad_arguments_name_themselves():
    cascade, _ = shared_case(32, [3, 4])
    with pytest.raises(ValueError, match="prefix_len"):
        cascade_attention(**{**cascade, "prefix_len": 32})
    with pytest.raises(ValueError, match="prefix_table"):
        cascade_attention(**{**cascade, "prefix_table": cascade["prefix_table"].long()})
    with pytest.raises(ValueError, match="sinks"):
        cascade_attention(**cascade, sinks=torch.zeros(3))
    # what cascade_attention reads itself is checked before it is read (was a ZeroDivisionError, AttributeErrors)
    empty_pages = cascade["k_cache"][:, :0]
    with pytest.raises(ValueError, match="k_cache.*page_size"):
        cascade_attention(**{**cascade, "k_cache": empty_pages, "v_cache": empty_pages})
    with pytest.raises(TypeError, match="k_cache must be a Tensor"):
        cascade_attention(**{**cascade, "k_cache": None})
    with pytest.raises(TypeError, match="q must be a Tensor"):
        cascade_attention(**{**cascade, "q": [[0.0]]})
    with pytest.raises(ValueError, match="q must be"):
        cascade_attention(**{**cascade, "q": cascade["q"][0]})


BAD_PREFIXES = {  # (prefix_table, prefix_len) of a two-page prefix of 32 tokens -> the argument recorded, position
    "length past the table": (lambda t: t, 40, ("prefix_len", 0)),
    "negative length": (lambda t: t, -1, ("prefix_len", 0)),
    "empty table, a length": (lambda t: t[:0], 5, ("prefix_len", 0)),
    "page past the cache": (lambda t: torch.tensor([t[0], 10_000], dtype=torch.int32), 32, ("prefix_table", 1)),
    "negative page": (lambda t: torch.tensor([-1, t[1]], dtype=torch.int32), 20, ("prefix_table", 0)),
}


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
@pytest.mark.parametrize("bad", BAD_PREFIXES)
def test_a_bad_prefix_follows_the_bad_index_rules(backend, bad, monkeypatch):
    """A prefix length outside its table or a prefix page outside the cache reads no page of the prefix (never
    page 0 in its place), makes every row NaN, and is recorded under its own name; ATTNOPS_CHECK=1 raises."""
    if BACKENDS[backend].unavailable():
        pytest.skip("; ".join(BACKENDS[backend].unavailable()))
    cascade, _ = shared_case(32, [3, 4, 9])
    make_table, length, (argument, position) = BAD_PREFIXES[bad]
    args = {**cascade, "prefix_table": make_table(cascade["prefix_table"]).to(torch.int32),
            "prefix_len": torch.tensor([length], dtype=torch.int32)}
    attnops.take_errors()
    with attnops.use_backend(backend):
        out = cascade_attention(**args)
    assert out.isnan().all()
    assert attnops.take_errors() == {argument: position}
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match=rf"cascade_attention: {argument}\b"):
        cascade_attention(**args)


def test_a_batch_of_no_query_rows_gives_an_empty_result():
    cascade, _ = shared_case(32, [3, 4], q_lens=[1, 1])
    q = cascade["q"][:0]
    with attnops.use_backend("reference"):
        out = cascade_attention(**{**cascade, "q": q, "cu_seqlens_q": torch.zeros(3, dtype=torch.int32)})
    assert out.shape == q.shape


def test_compiles_without_a_graph_break():
    cascade, full = shared_case(48, [5, 9, 2])
    torch._dynamo.reset()
    compiled = torch.compile(cascade_attention, fullgraph=True)
    with attnops.use_backend("cpu" if not BACKENDS["cpu"].unavailable() else "reference"):
        got = compiled(**cascade)
    assert relative_error(got, paged_attention_reference(**full, compute_dtype=torch.float64)) < 1e-5


def test_shared_prefix_pages_and_when_it_pays():
    tables = [[4, 7, 9, 1], [4, 7, 9, 3], [4, 7, 9, 2]]
    assert shared_prefix_pages(tables, [60, 64, 40], 16) == 2  # the third's own keys start in its third page
    assert shared_prefix_pages(tables, [60, 64, 49], 16) == 3
    assert shared_prefix_pages([[4, 7], [5, 7]], [32, 32], 16) == 0
    assert shared_prefix_pages([[4, 7]], [17], 16) == 1  # one sequence: its first page (the rule decides)
    assert not cascade_pays(1, 10 ** 6) and cascade_pays(64, 32768) and not cascade_pays(4, 256)
    # the fewest prefix tokens that pay, for a serving loop that makes no split below it
    assert cascade_min_prefix_tokens(1) is None
    for batch in (2, 3, 7, 64, 300):
        least = cascade_min_prefix_tokens(batch)
        assert cascade_pays(batch, least) and not cascade_pays(batch, least - 1)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_gpu_bf16_in_a_cuda_graph(kv_format):
    cascade, full = shared_case(1000, [100, 37, 1, 513], page_size=16, kv_format=kv_format, q_dtype=torch.bfloat16,
                                num_q_heads=32, num_kv_heads=8, head_dim=128, device="cuda")
    want = paged_attention_reference(**full, compute_dtype=torch.float64)
    eager = cascade_attention(**cascade)
    assert relative_error(eager, want) < 2e-2
    for _ in range(2):  # warm up (Triton compiles) before capture
        cascade_attention(**cascade)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = cascade_attention(**cascade)
    cascade["q"].mul_(-1)  # new data in the captured tensors, replayed without capture
    graph.replay()
    full["q"] = cascade["q"]
    assert relative_error(static, paged_attention_reference(**full, compute_dtype=torch.float64)) < 2e-2


def test_the_prefix_helpers_name_a_bad_page_size():
    """A page size of 0 was a ZeroDivisionError from inside."""
    from attnops.cascade import host_prefix_pass, prefix_pass, shared_prefix_pages
    for bad in (0, 3, 2.0):
        with pytest.raises(ValueError, match="page_size must be a power of two"):
            prefix_pass(torch.zeros(2, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), bad, 1)
        with pytest.raises(ValueError, match="page_size must be a power of two"):
            host_prefix_pass([0, 1], 4, bad, 1, "cpu")
        with pytest.raises(ValueError, match="page_size must be a power of two"):
            shared_prefix_pages([[0, 1]], [5], bad)
