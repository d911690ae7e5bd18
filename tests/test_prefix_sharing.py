"""Shared pages in PagedKVCache: reference counts, fork, copy on write, the prefix index, and a Generator whose
requests share a prompt prefix (serving a tiny transformers Llama through attnops.hf) producing the same tokens as
one that stores every prompt on its own."""
from __future__ import annotations

import pytest
import torch

import attnops
from attnops.serving.generate import Generator
from conftest import build, make_config


def write(cache, seq, tokens_kv):
    meta = cache.prepare([seq], [tokens_kv.shape[0]], decode=False)
    torch.ops.attnops.reshape_and_cache(tokens_kv[:, 0], tokens_kv[:, 1], slot_mapping=meta.slot_mapping,
                                        **cache.write_args(0))
    return meta


def stored(cache, seq):
    """The sequence's K and V as stored, in token order: [n, 2, Hkv, D]."""
    pages = cache._pages[seq]
    n = cache.seq_len(seq)
    return torch.stack([cache.kv[0][pages[t // cache.page_size], :, t % cache.page_size] for t in range(n)])


@pytest.mark.parametrize("kv_format", ["fp32", "fp8_e4m3", "nvfp4"])
def test_fork_shares_pages_and_copies_a_partial_page_on_write(kv_format):
    cache = attnops.PagedKVCache(1, 12, 4, 2, 64, kv_format=kv_format)
    cache.allocate("a")
    write(cache, "a", torch.randn(10, 2, 2, 64))  # pages: 4 + 4 + 2 tokens
    used = cache.pages_in_use
    a_before = stored(cache, "a").clone()
    cache.fork("a", "b")
    assert cache.pages_in_use == used and cache._pages["b"] == cache._pages["a"]  # nothing copied yet
    assert [cache._refs[p] for p in cache._pages["a"]] == [2, 2, 2]
    write(cache, "b", torch.randn(1, 2, 2, 64))  # b writes into the shared partial page: it gets a copy
    assert cache.pages_in_use == used + 1
    assert cache._pages["b"][:2] == cache._pages["a"][:2] and cache._pages["b"][2] != cache._pages["a"][2]
    assert torch.equal(stored(cache, "a").view(torch.uint8), a_before.view(torch.uint8))  # a is untouched
    assert torch.equal(stored(cache, "b")[:10].view(torch.uint8), a_before.view(torch.uint8))
    if cache.block_scales is not None:  # 4-bit: the block scales of the copied page came along
        pa, pb = cache._pages["a"][2], cache._pages["b"][2]
        assert torch.equal(cache.block_scales[0][pa, :, :2].view(torch.uint8),
                           cache.block_scales[0][pb, :, :2].view(torch.uint8))
    write(cache, "a", torch.randn(3, 2, 2, 64))  # a's partial page is its own again: written in place
    assert cache.pages_in_use == used + 2  # a's 3rd page filled, a 4th page taken
    cache.free("a")
    assert [cache._refs[p] for p in cache._pages["b"]] == [1, 1, 1]
    cache.free("b")
    assert cache.pages_in_use == 0 and cache.free_pages == 12


def test_fork_of_a_prefix_and_truncate_release_by_count():
    cache = attnops.PagedKVCache(1, 8, 4, 1, 32, kv_format="fp32")
    cache.allocate("a")
    write(cache, "a", torch.randn(12, 2, 1, 32))
    cache.fork("a", "b", num_tokens=5)  # two pages, the second partial
    assert cache.seq_len("b") == 5 and len(cache._pages["b"]) == 2
    cache.truncate("a", 3)  # a lets go of its last two pages: one was shared with b
    assert cache.pages_in_use == 2
    with pytest.raises(ValueError, match="num_tokens"):
        cache.fork("a", "c", num_tokens=4)


def test_prefix_index_shares_full_pages_only_and_forgets_freed_pages():
    cache = attnops.PagedKVCache(1, 16, 4, 1, 32, kv_format="fp32")
    prompt = list(range(11))
    cache.allocate("a")
    assert cache.share_prefix("a", prompt) == 0
    write(cache, "a", torch.randn(11, 2, 1, 32))
    cache.index_prefix("a", prompt)  # two full pages indexed
    cache.allocate("b")
    assert cache.share_prefix("b", prompt[:9] + [99, 98]) == 8
    assert cache._pages["b"] == cache._pages["a"][:2]
    cache.allocate("c")
    assert cache.share_prefix("c", [5] + prompt[1:]) == 0  # a different first page: nothing shared
    cache.allocate("d")
    assert cache.share_prefix("d", prompt[:8]) == 4  # the last token is always computed
    cache.free("a"), cache.free("b"), cache.free("d")
    cache.allocate("e")
    assert cache.share_prefix("e", prompt) == 0  # freed pages left the index


def token_kv(tokens: list[int]) -> torch.Tensor:
    """[n, 2, 1, 64]: K = V = the token id in every dimension."""
    return torch.tensor(tokens, dtype=torch.float32)[:, None, None, None].expand(-1, 2, 1, 64)


def test_a_page_written_again_after_truncate_leaves_the_prefix_index():
    cache = attnops.PagedKVCache(1, 8, 4, 1, 64, kv_format="fp32")
    cache.allocate("a")
    write(cache, "a", token_kv([1, 2, 3, 4, 5]))
    cache.index_prefix("a", [1, 2, 3, 4, 5])
    cache.truncate("a", 2)
    write(cache, "a", token_kv([9, 9]))  # into the indexed page, which now holds 1, 2, 9, 9
    cache.allocate("c")
    shared = cache.share_prefix("c", [1, 2, 3, 4, 7])
    assert (stored(cache, "c")[:, 0, 0, 0].tolist() if shared else []) == [1, 2, 3, 4][:shared]
    assert shared == 0


@pytest.mark.parametrize("free_source", [True, False])
def test_a_page_forked_mid_page_keeps_its_index_entry_only_while_it_holds_the_tokens(free_source):
    cache = attnops.PagedKVCache(1, 8, 4, 1, 64, kv_format="fp32")
    cache.allocate("a")
    write(cache, "a", token_kv([1, 2, 3, 4, 5]))
    cache.index_prefix("a", [1, 2, 3, 4, 5])
    cache.fork("a", "b", 2)
    if free_source:
        cache.free("a")  # b alone holds the indexed page: its write goes into it
    write(cache, "b", token_kv([9, 9]))  # else b writes into a copy, and the indexed page is a's, unchanged
    cache.allocate("c")
    shared = cache.share_prefix("c", [1, 2, 3, 4, 7])
    assert (stored(cache, "c")[:, 0, 0, 0].tolist() if shared else []) == [1, 2, 3, 4][:shared]
    assert shared == (0 if free_source else 4)

def tiny_model():
    """A tiny Llama (transformers' modeling code, head_dim 32) served through attnops.hf, with decisive logits."""
    pytest.importorskip("transformers")
    import attnops.hf
    torch.manual_seed(0)
    model = build(make_config("llama", vocab_size=128), attnops.hf.ATTN_IMPLEMENTATION)
    for name, p in model.named_parameters():
        p.data.fill_(1.0) if "norm" in name else p.data.normal_(0, 0.3)
    return attnops.hf.serving_model(model)


def generate(model, kv_format, sharing, staggered, cascade=False, device="cpu", **options):
    """Eight requests on one 40-token system prompt; staggered: one admitted per step, so each finds the earlier
    ones' pages in the prefix index (requests admitted in the same step do not share: the index is filled after
    their prefill)."""
    system = [int(t) for t in torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(1))]
    cache = attnops.PagedKVCache(2, 64, 8, 2, 32, kv_format=kv_format, shuffle_pages=True, device=device)
    gen = Generator(model, cache, max_batch=8, max_seq_len=80, buckets=(8,), prefix_sharing=sharing,
                    cascade=cascade, **options)
    for i in range(8):
        gen.add_request(i, system + [i + 1, 2 * i + 3], max_new_tokens=12)
        if staggered:
            gen.step()
    return gen.run(), dict(gen.stats)


@pytest.mark.parametrize("kv_format", ["fp32", "fp8_e4m3"])
def test_generation_with_shared_prefixes_gives_the_same_tokens(kv_format):
    model = tiny_model()
    plain, plain_stats = generate(model, kv_format, sharing=False, staggered=True)
    shared, shared_stats = generate(model, kv_format, sharing=True, staggered=True)
    together, together_stats = generate(model, kv_format, sharing=True, staggered=False)
    assert shared == plain == together
    assert plain_stats["prefix_tokens_reused"] == together_stats["prefix_tokens_reused"] == 0
    assert shared_stats["prefix_tokens_reused"] == 7 * 40  # five full pages of 8, for each request after the first
    assert shared_stats["peak_pages_in_use"] < plain_stats["peak_pages_in_use"]


@pytest.mark.parametrize("kv_format,compile", [("fp32", False), ("fp8_e4m3", False), ("fp32", True)],
                         ids=["fp32", "fp8_e4m3", "fp32-compiled"])
def test_cascade_decode_steps_give_the_same_tokens(kv_format, compile, monkeypatch):
    """With the shared prompt read once per step (cascade_attention; its threshold lowered to this tiny model),
    the tokens are those of plain decode steps; compiled: the cascade step compiles whole (fullgraph), once."""
    import attnops.cascade
    monkeypatch.setattr(attnops.cascade, "CASCADE_MIN_SAVED_TOKENS", 8)
    model = tiny_model()
    plain, plain_stats = generate(model, kv_format, sharing=True, staggered=True)
    torch._dynamo.reset()
    from torch._dynamo.testing import CompileCounterWithBackend
    options = dict(compile={"backend": CompileCounterWithBackend("inductor")}) if compile \
        else {}
    cascade, cascade_stats = generate(model, kv_format, sharing=True, staggered=True, cascade=True, **options)
    assert plain_stats["cascade_steps"] == 0 and cascade_stats["cascade_steps"] >= 8
    assert cascade == plain
    if compile:
        assert options["compile"]["backend"].frame_count == 2  # the plain step and the cascade step, bucket 8


def record_cascade_splits(monkeypatch) -> list:
    """Every PagedKVCache.cascade_split result from now on (None where no split was made), in a list."""
    made = []
    original = attnops.PagedKVCache.cascade_split

    def spy(self, meta, min_pages=1):
        split = original(self, meta, min_pages)
        made.append(split)
        return split

    monkeypatch.setattr(attnops.PagedKVCache, "cascade_split", spy)
    return made


def test_no_cascade_split_is_made_where_it_does_not_pay(monkeypatch):
    """At the H200's threshold this tiny model's 40-token prompt never pays: the Generator makes no split (whose
    prefix pass would be copied to the device every step) and runs plain steps."""
    made = record_cascade_splits(monkeypatch)
    tokens, stats = generate(tiny_model(), "fp32", sharing=True, staggered=True, cascade=True)
    assert stats["cascade_steps"] == 0 and made and all(split is None for split in made)
    assert tokens == generate(tiny_model(), "fp32", sharing=True, staggered=True)[0]


def test_cascade_steps_copy_only_the_prefix_pages(monkeypatch):
    """A cascade step writes its split into the step's static inputs from the host's page list: the split's own
    device copy of the prefix pass (made on first use of `prefix`) is never made."""
    import attnops.cascade
    monkeypatch.setattr(attnops.cascade, "CASCADE_MIN_SAVED_TOKENS", 8)
    made = record_cascade_splits(monkeypatch)
    tokens, stats = generate(tiny_model(), "fp32", sharing=True, staggered=True, cascade=True)
    splits = [split for split in made if split is not None]
    assert stats["cascade_steps"] == len(splits) >= 8
    assert all(split.prefix_pass is None for split in splits)
    prefix = splits[0].prefix  # made when asked for: the pages, the length and the rows of the step
    assert prefix.block_table[0, :len(splits[0].prefix_pages)].tolist() == splits[0].prefix_pages
    assert prefix.seq_lens.tolist() == [splits[0].prefix_tokens + splits[0].block_table.shape[0]]


@pytest.mark.gpu
def test_cascade_steps_in_cuda_graphs_give_the_same_tokens_on_gpu(monkeypatch):
    """Compiled and graph-replayed cascade steps (their own graph per bucket) against plain graph-replayed steps."""
    import attnops.cascade
    monkeypatch.setattr(attnops.cascade, "CASCADE_MIN_SAVED_TOKENS", 8)
    model = tiny_model().cuda()
    runs = {}
    for cascade in (False, True):
        torch._dynamo.reset()
        runs[cascade], stats = generate(model, "fp32", sharing=True, staggered=True, cascade=cascade,
                                        device="cuda", compile=True, cuda_graphs=True)
        assert (stats["cascade_steps"] >= 8) == cascade
    assert runs[True] == runs[False]


def test_static_cascade_inputs_fill_and_pad():
    """The cascade step's static inputs (what its CUDA graphs read): a batch's split written at the bucket's
    shapes, padding rows empty, the prefix pass sized for the bucket's rows; pad() leaves no prefix."""
    from attnops.serving.batching import StaticCascadeInputs
    cache = attnops.PagedKVCache(1, 32, 8, 2, 32)
    cache.allocate("p")
    cache.prepare(["p"], 20, decode=False)  # two full pages and a partial one
    for i in range(3):
        cache.fork("p", i, 16)
    cache.prepare([0, 1, 2], [3, 9, 1], decode=False)
    meta = cache.prepare([0, 1, 2], 1, decode=True, max_pages=6)
    split = cache.cascade_split(meta)
    assert split.prefix_tokens == 16 and split.host_seq_lens == [4, 10, 2]
    meta.cascade = split
    inputs = StaticCascadeInputs((4,), 6, 8, "cpu")
    bucket, buf = inputs.fill(torch.zeros(3, dtype=torch.long), meta.seq_lens.long() - 1, meta)
    assert bucket == 4
    assert buf["prefix_block_table"].shape == (1, 7)  # 6 pages of prefix room + one for the bucket's 4 rows
    prefix_table = buf["prefix_block_table"][0]
    assert prefix_table[:2].tolist() == split.prefix_pages and not prefix_table[2:].any()
    assert buf["prefix_seq_lens"].tolist() == [16 + 4] and buf["prefix_cu_seqlens_q"].tolist() == [0, 4]
    assert buf["suffix_seq_lens"].tolist() == [4, 10, 2, 0]
    assert torch.equal(buf["suffix_block_table"][:3, :4], meta.block_table[:, 2:])
    assert (buf["suffix_block_table"][3] == -1).all() and (buf["suffix_block_table"][:3, 4:] == -1).all()
    padded = inputs.pad(4)
    assert padded["prefix_seq_lens"].tolist() == [4] and not padded["suffix_seq_lens"].any()
    assert (padded["slot_mapping"] == -1).all() and (padded["suffix_block_table"] == -1).all()
