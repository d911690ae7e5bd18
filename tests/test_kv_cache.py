"""PagedKVCache: the allocator and the metadata it builds for a batch."""
import pytest
import torch

import attnops


def test_prepare_builds_consistent_metadata():
    cache = attnops.PagedKVCache(1, 10, 4, 2, 32, kv_format="fp16")
    for s in ("a", "b"):
        cache.allocate(s)
    prefill = cache.prepare(["a", "b"], [6, 3], decode=False)
    assert prefill.cu_seqlens_q.tolist() == [0, 6, 9]
    assert prefill.seq_lens.tolist() == [6, 3]
    table = prefill.block_table.tolist()
    pages_a, pages_b = table[0][:2], table[1][:1]
    assert table[1][1] == -1 and len(set(pages_a + pages_b)) == 3
    expected = [pages_a[t // 4] * 4 + t % 4 for t in range(6)] + [pages_b[0] * 4 + t for t in range(3)]
    assert prefill.slot_mapping.tolist() == expected
    decode = cache.prepare(["a", "b"])  # one token each: decode, no cu_seqlens_q
    assert decode.cu_seqlens_q is None and decode.seq_lens.tolist() == [7, 4]
    assert decode.slot_mapping.tolist() == [pages_a[1] * 4 + 2, pages_b[0] * 4 + 3]
    assert decode.block_table.dtype == torch.int32 and decode.slot_mapping.dtype == torch.int64


def test_free_returns_pages_and_out_of_pages_is_an_error():
    cache = attnops.PagedKVCache(1, 3, 4, 1, 32)
    cache.allocate("a")
    cache.prepare(["a"], 12, decode=False)
    assert cache.free_pages == 0
    cache.allocate("b")
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.prepare(["b"], 1)
    cache.free("a")
    assert cache.free_pages == 3
    assert cache.prepare(["b"], 1, max_pages=5).block_table.shape == (1, 5)


def test_formats_carry_their_scales():
    fp8 = attnops.PagedKVCache(2, 4, 16, 2, 64, kv_format="fp8_e4m3", k_scale=0.5)
    assert fp8.attention_args(1)["k_scale"].item() == 0.5 and fp8.kv[0].dtype == torch.float8_e4m3fn
    nvfp4 = attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="nvfp4")
    args = nvfp4.attention_args(0)
    assert args["kv_format"] == "nvfp4" and args["k_cache"].shape == (4, 16, 2, 32)
    assert args["k_scale"].shape == (4, 16, 2, 4) and args["k_scale"].dtype == torch.float8_e4m3fn
    assert set(nvfp4.write_args(0)) == {"k_cache", "v_cache", "kv_format", "k_block_scale", "v_block_scale"}
    with pytest.raises(ValueError, match="kv_format"):
        attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="int8")


def test_block_table_matches_the_allocator_as_the_host_table_grows():
    """More sequences than the host table's first rows and more pages than its first columns; freed rows reused."""
    cache = attnops.PagedKVCache(1, 2000, 2, 1, 32, shuffle_pages=True)
    seqs = list(range(20))
    for s in seqs:
        cache.allocate(s)
    meta = cache.prepare(seqs, [3 + 11 * s for s in seqs], decode=False)  # up to 212 tokens: 106 pages
    # short runs (<= 16 tokens) and long ones interleave: slots in order, each token at page[t // 2], t % 2
    assert meta.slot_mapping.tolist() == [cache._pages[s][t // 2] * 2 + t % 2 for s in seqs for t in range(3 + 11 * s)]
    cache.free(3)
    cache.allocate("new")
    seqs = [s for s in seqs if s != 3] + ["new"]
    meta = cache.prepare(seqs, [1] * len(seqs))
    for row, s in zip(meta.block_table.tolist(), seqs):
        pages = cache._pages[s]
        assert row[: len(pages)] == pages and all(p == -1 for p in row[len(pages):])
    lengths = meta.seq_lens.tolist()
    expected_slots = [cache._pages[s][(n - 1) // 2] * 2 + (n - 1) % 2 for s, n in zip(seqs, lengths)]
    assert meta.slot_mapping.tolist() == expected_slots


def test_layers_of_their_own_shape_and_shared_layers():
    """One KV head count and head dim a layer (Gemma-4's sliding and full layers), and KV-shared layers whose
    tensors are an earlier layer's: copy on write copies each held tensor once, and bad layouts are errors."""
    cache = attnops.PagedKVCache(4, 4, 4, [2, 1, 2, 1], [32, 64, 32, 64], kv_format="nvfp4",
                                 shared_layers={2: 0, 3: 1})
    assert [tuple(t.shape[-2:]) for t in cache.kv] == [(2, 16), (1, 32)] * 2
    assert cache.kv[2] is cache.kv[0] and cache.block_scales[3] is cache.block_scales[1]
    cache.allocate("a")
    cache.prepare(["a"], 2, decode=False)
    for t in cache.kv + cache.block_scales:
        t.view(torch.uint8).fill_(7)
    cache.fork("a", "b")  # the partial last page is shared, then written by "b": copied
    meta = cache.prepare(["b"], 1)
    page = meta.block_table[0, 0].item()
    assert all(bool((t[page].view(torch.uint8) == 7).all()) for t in cache.kv + cache.block_scales)
    with pytest.raises(ValueError, match="num_kv_heads must be an int or one a layer"):
        attnops.PagedKVCache(4, 4, 4, [2, 1], 32)
    with pytest.raises(ValueError, match="head_dim"):
        attnops.PagedKVCache(2, 4, 4, 2, [32, 40])
    with pytest.raises(ValueError, match="cannot read layer 0"):
        attnops.PagedKVCache(2, 4, 4, [2, 1], 32, shared_layers={1: 0})
    with pytest.raises(ValueError, match="an earlier layer"):
        attnops.PagedKVCache(2, 4, 4, 2, 32, shared_layers={0: 1})
    with pytest.raises(ValueError, match="which reads another"):
        attnops.PagedKVCache(3, 4, 4, 2, 32, shared_layers={1: 0, 2: 1})


def test_fp8_scales_must_be_finite_and_positive():
    """A scale of 0 stored every key as the format's largest value (attention near uniform, a wrong answer); inf
    or NaN made every output NaN. Refused where the cache is made, naming the scale."""
    from attnops.hf import PagedCache
    from attnops.serving.kv_cache import LatentKVCache
    for bad in (0.0, -1.0, float("inf"), float("nan"), torch.tensor([1.0, 0.0])):
        with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
            attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="fp8_e4m3", k_scale=bad)
        with pytest.raises(ValueError, match="v_scale must be finite and > 0"):
            attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="fp8_e5m2", v_scale=bad)
        with pytest.raises(ValueError, match="kv_scale must be finite and > 0"):
            LatentKVCache(1, 4, 16, 64, 16, kv_format="fp8_e4m3", kv_scale=bad)
    with pytest.raises(TypeError, match="k_scale must be a float"):
        attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="fp8_e4m3", k_scale="x")
    with pytest.raises(ValueError, match="kv_scale must be one value"):
        LatentKVCache(1, 4, 16, 64, 16, kv_format="fp8_e4m3", kv_scale=torch.ones(2))
    config = pytest.importorskip("transformers").LlamaConfig(hidden_size=64, num_attention_heads=2,
                                                               num_key_value_heads=1, num_hidden_layers=1)
    with pytest.raises(ValueError, match="k_scale must be finite and > 0"):
        PagedCache(config, max_cache_len=32, kv_format="fp8_e4m3", k_scale=0.0)


def test_a_call_that_fails_on_a_bad_argument_changes_nothing():
    """max_pages of the wrong type failed after pages were taken and the length grown; a path of floats or bools
    was truncated to indices and the keys and values moved."""
    cache = attnops.PagedKVCache(1, 8, 4, 1, 32)
    cache.allocate("a")
    with pytest.raises(TypeError, match="max_pages"):
        cache.prepare(["a"], 3, max_pages=2.5)
    assert cache.seq_len("a") == 0 and cache.free_pages == 8
    cache.prepare(["a"], 6, decode=False)
    before = cache.kv[0].clone()
    for path in ([0.5, 2], [True, 3], torch.tensor([0, 2])):
        with pytest.raises(TypeError, match="path must be a list of ints"):
            cache.keep_path("a", 2, path)
    assert cache.seq_len("a") == 6 and torch.equal(cache.kv[0], before)


@pytest.mark.parametrize("kv_format", ["fp32", "fp8_e4m3"])
def test_keep_path_moves_a_latent_caches_rows_and_indexer_keys(kv_format):
    """A latent cache's rows (and a sparse model's indexer keys) are a token a row: keep_path moves them as the
    per-head caches' keys and values (it indexed them as those, [pages, 2, page_size, ...])."""
    from attnops.serving.kv_cache import LatentKVCache
    cache = LatentKVCache(2, 8, 4, 64, 16, kv_format=kv_format, index_dim=32)
    cache.allocate("a")
    cache.prepare(["a"], 11, decode=False)
    for layer in range(2):
        cache.kv[layer].copy_(torch.randn(cache.kv[layer].shape).to(cache.kv[layer].dtype))
        cache.index_keys[layer].copy_(torch.randn(cache.index_keys[layer].shape))

    def rows(storage):  # the sequence's tokens in order
        table = torch.tensor(cache._pages["a"])
        flat = storage.view(torch.uint8) if storage.element_size() == 1 else storage
        return flat[table].flatten(0, 1)[:cache.seq_len("a")].clone()

    before = [(rows(cache.kv[i]), rows(cache.index_keys[i])) for i in range(2)]
    cache.keep_path("a", 3, [1, 4, 6])  # block of 8 tokens from position 3: keep its 2nd, 5th and 7th
    assert cache.seq_len("a") == 6
    for i in range(2):
        for got, old in zip((rows(cache.kv[i]), rows(cache.index_keys[i])), before[i]):
            assert torch.equal(got, old[[0, 1, 2, 4, 7, 9]])


def test_the_prefix_index_shares_only_pages_of_the_same_tokens():
    """Page keys are hashes: hash(-1) == hash(-2), and ids 2^61 - 1 apart hash alike. A page is shared only when
    its tokens (and the page before it) are the ones asked for."""
    cache = attnops.PagedKVCache(1, 16, 4, 1, 32)
    for seq, tokens, other in (("a", [-1] * 4, [-2] * 4 + [7]), ("c", [5, 6, 7, 8], [2 ** 61 + 4, 6, 7, 8, 9])):
        cache.allocate(seq)
        cache.prepare([seq], len(tokens), decode=False)
        cache.index_prefix(seq, tokens)
        cache.allocate(seq + "2")
        assert cache.share_prefix(seq + "2", other) == 0
        cache.allocate(seq + "3")
        assert cache.share_prefix(seq + "3", tokens + [1]) == 4  # the same tokens still share
