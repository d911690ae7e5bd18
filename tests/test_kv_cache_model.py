"""PagedKVCache against a plain model of its sequences: random runs of allocate / write / fork / truncate /
keep_path / share_prefix / index_prefix / free (hypothesis' stateful testing) on fp32, fp8 and nvfp4 caches,
checked after every step: each sequence's stored keys and values decode to the tokens the model says it holds,
every page's reference count is the number of sequences holding it, no page leaks, and every page the prefix
index names holds the tokens it was indexed with. Also: the argument checks, and the reproducers of rewritten
pages handed out by the prefix index.

ATTNOPS_FUZZ_CASES scales the number of runs (as tests/test_fuzz.py)."""
from __future__ import annotations

import os

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,  # noqa: E402
                                 run_state_machine_as_test)

from attnops import formats  # noqa: E402
from attnops.serving.kv_cache import PagedKVCache  # noqa: E402

HEAD_DIM = 32
# runs of up to 30 steps (300: about 6 s on one core; 25 runs did not find a rewritten indexed page, 200 did)
RUNS = int(os.environ.get("ATTNOPS_FUZZ_CASES") or 600) // 2


def kv_of(tokens: list[int]) -> torch.Tensor:
    """[n, 2, 1, D]: K = the token id in every dim, V = minus it (small ints: fp8 keeps them exactly, nvfp4 within
    rounding of the block scale, which decoding rounds away)."""
    t = torch.tensor(tokens, dtype=torch.float32)[:, None, None, None]
    return torch.cat([t, -t], dim=1).expand(-1, 2, 1, HEAD_DIM).contiguous()


def write(cache: PagedKVCache, seq, tokens: list[int]):
    meta = cache.prepare([seq], [len(tokens)], decode=False)
    kv = kv_of(tokens)
    torch.ops.attnops.reshape_and_cache(kv[:, 0], kv[:, 1], slot_mapping=meta.slot_mapping, **cache.write_args(0))


def page_tokens(cache: PagedKVCache, page: int, count: int) -> list[tuple[int, int]]:
    """(K, V) of the first `count` slots of a page, decoded and rounded to ints."""
    fmt = cache.kv_format
    rows = cache.kv[0][page, :, :count]  # [2, count, 1, D or D/2]
    if cache.block_scales is not None:
        values = formats.dequantize(rows, fmt, cache.block_scales[0][page, :, :count])
    elif cache.k_scale is not None:
        values = formats.dequantize(rows, fmt, cache.k_scale)
    else:
        values = rows.float()
    values = values.mean(-1)[..., 0].round().to(torch.int64)  # [2, count]
    return list(zip(values[0].tolist(), values[1].tolist()))


def stored_tokens(cache: PagedKVCache, seq) -> list[int]:
    pages, n, size = cache._pages[seq], cache.seq_len(seq), cache.page_size
    pairs = [pair for i, page in enumerate(pages) for pair in page_tokens(cache, page, min(size, n - i * size))]
    assert all(v == -k for k, v in pairs), pairs  # V is minus K wherever a token is
    return [k for k, _ in pairs]


class CacheModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.tokens: dict[str, list[int]] = {}  # the model: each sequence's tokens
        self.indexed: dict[int, list[int]] = {}  # page -> the tokens it held when the index took it
        self.next_id = 0

    @initialize(kv_format=st.sampled_from(["fp32", "fp8_e4m3", "nvfp4"]), page_size=st.sampled_from([1, 2, 4]),
                num_pages=st.integers(6, 16))
    def make(self, kv_format, page_size, num_pages):
        self.cache = PagedKVCache(1, num_pages, page_size, 1, HEAD_DIM, kv_format=kv_format)

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    @precondition(lambda self: len(self.tokens) < 4)  # a few sequences with many steps each
    @rule(data=st.data())
    def allocate(self, data):
        seq = self.new_id()
        self.cache.allocate(seq)
        self.tokens[seq] = []
        self.write(data, data.draw(st.integers(0, 9)), seq)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.integers(1, 9))
    def write(self, data, count, seq=None):
        if seq is None:
            seq = data.draw(st.sampled_from(sorted(self.tokens)))
        if count == 0:
            return
        new = data.draw(st.lists(st.integers(1, 6), min_size=count, max_size=count))
        free = self.cache.free_pages
        try:
            write(self.cache, seq, new)
        except RuntimeError as e:  # out of pages: nothing changed
            assert "out of pages" in str(e) and self.cache.free_pages == free
            return
        self.tokens[seq] += new

    @precondition(lambda self: 0 < len(self.tokens) < 5)
    @rule(data=st.data())
    def fork(self, data):
        src = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tokens[src])))
        dst = self.new_id()
        self.cache.fork(src, dst, n)
        self.tokens[dst] = self.tokens[src][:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data, seq=None):
        if seq is None:
            seq = data.draw(st.sampled_from(sorted(self.tokens)))
        n = data.draw(st.integers(0, len(self.tokens[seq])))
        self.cache.truncate(seq, n)
        del self.tokens[seq][n:]

    @precondition(lambda self: any(self.tokens.values()))
    @rule(data=st.data(), count=st.integers(1, 4))
    def roll_back_and_write(self, data, count):
        """What a rejected draft does: the sequence ends earlier (often inside a full page) and goes on."""
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.tokens.items() if t)))
        self.truncate(data, seq)
        self.write(data, count, seq)

    @precondition(lambda self: any(self.tokens.values()))
    @rule(data=st.data())
    def keep_path(self, data):
        seq = data.draw(st.sampled_from(sorted(s for s, t in self.tokens.items() if t)))
        tokens = self.tokens[seq]
        start = data.draw(st.integers(0, len(tokens) - 1))
        path = sorted(data.draw(st.sets(st.integers(0, len(tokens) - start - 1), max_size=len(tokens) - start)))
        free = self.cache.free_pages
        try:
            self.cache.keep_path(seq, start, path)
        except RuntimeError as e:
            assert "out of pages" in str(e) and self.cache.free_pages == free
            return
        self.tokens[seq] = tokens[:start] + [tokens[start + i] for i in path]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def index_prefix(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        before = set(self.cache._key_of)
        self.cache.index_prefix(seq, self.tokens[seq])
        size = self.cache.page_size
        for i, page in enumerate(self.cache._pages[seq]):
            if page in self.cache._key_of and page not in before:
                self.indexed[page] = self.tokens[seq][i * size:(i + 1) * size]

    @precondition(lambda self: any(self.tokens.values()) and len(self.tokens) < 5)
    @rule(data=st.data())
    def share_prefix(self, data):
        """A new request whose prompt starts like a sequence's tokens (sometimes diverging)."""
        src = data.draw(st.sampled_from(sorted(s for s, t in self.tokens.items() if t)))
        prompt = self.tokens[src][:data.draw(st.integers(1, len(self.tokens[src])))]
        prompt += data.draw(st.lists(st.integers(1, 6), min_size=1, max_size=4))
        seq = self.new_id()
        self.cache.allocate(seq)
        shared = self.cache.share_prefix(seq, prompt)
        self.tokens[seq] = prompt[:shared]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.cache.free(seq)
        del self.tokens[seq]

    @invariant()
    def sequences_hold_their_tokens(self):
        if self.cache is None:
            return
        for seq, tokens in self.tokens.items():
            assert self.cache.seq_len(seq) == len(tokens)
            assert stored_tokens(self.cache, seq) == tokens, seq

    @invariant()
    def pages_are_counted_and_none_leaks(self):
        if self.cache is None:
            return
        holders = [0] * self.cache.num_pages
        for seq in self.tokens:
            pages = self.cache._pages[seq]
            assert len(pages) == -(-len(self.tokens[seq]) // self.cache.page_size)
            assert len(set(pages)) == len(pages)
            for page in pages:
                holders[page] += 1
        assert self.cache._refs == holders
        free = self.cache._free_pages
        assert len(set(free)) == len(free) and all(holders[p] == 0 for p in free)
        assert len(free) + sum(h > 0 for h in holders) == self.cache.num_pages

    @invariant()
    def the_index_names_only_pages_that_hold_its_tokens(self):
        if self.cache is None:
            return
        size = self.cache.page_size
        for page in self.cache._key_of:
            assert page_tokens(self.cache, page, size) == [(t, -t) for t in self.indexed[page]], page


def test_the_cache_keeps_its_model():
    run_state_machine_as_test(CacheModel, settings=settings(max_examples=RUNS, stateful_step_count=30,
                                                            deadline=None, database=None, derandomize=True))


# --------------------------------------------------------------------------------------------------------------
# the reproducers, and the argument checks


def test_a_page_rewritten_after_truncate_leaves_the_prefix_index():
    cache = PagedKVCache(1, 8, 4, 1, HEAD_DIM, kv_format="fp32")
    cache.allocate("a")
    write(cache, "a", [1, 2, 3, 4, 5])
    cache.index_prefix("a", [1, 2, 3, 4, 5])
    cache.truncate("a", 2)
    write(cache, "a", [6, 6])
    cache.allocate("c")
    shared = cache.share_prefix("c", [1, 2, 3, 4, 7])
    assert stored_tokens(cache, "c") == [1, 2, 3, 4][:shared]
    assert shared == 0


def test_a_page_forked_mid_page_then_rewritten_leaves_the_prefix_index():
    cache = PagedKVCache(1, 8, 4, 1, HEAD_DIM, kv_format="fp32")
    cache.allocate("a")
    write(cache, "a", [1, 2, 3, 4, 5])
    cache.index_prefix("a", [1, 2, 3, 4, 5])
    cache.fork("a", "b", 2)
    cache.free("a")  # page 0 is b's alone now, still indexed as [1, 2, 3, 4]
    write(cache, "b", [6, 6])
    cache.allocate("c")
    shared = cache.share_prefix("c", [1, 2, 3, 4, 7])
    assert stored_tokens(cache, "c") == [1, 2, 3, 4][:shared]
    assert shared == 0


@pytest.mark.parametrize("arguments,error,name", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_pages=-3), ValueError, "num_pages"),
    (dict(num_pages=0), ValueError, "num_pages"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=3), ValueError, "page_size"),
    (dict(page_size=512), ValueError, "page_size"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(head_dim=48), ValueError, "head_dim"),
    (dict(num_pages=4.0), TypeError, "num_pages"),
    (dict(kv_format="int4"), ValueError, "kv_format"),
])
def test_constructor_arguments_are_named(arguments, error, name):
    base = dict(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=HEAD_DIM)
    with pytest.raises(error, match=rf"PagedKVCache: {name}\b"):
        PagedKVCache(**{**base, **{k: v for k, v in arguments.items() if k in base}},
                     **{k: v for k, v in arguments.items() if k not in base})


def test_unknown_sequences_and_no_pages_are_errors_that_change_nothing():
    cache = PagedKVCache(1, 2, 2, 1, HEAD_DIM, kv_format="fp32")
    for call in (lambda: cache.prepare(["unknown"]), lambda: cache.free("unknown"),
                 lambda: cache.fork("unknown", "x"), lambda: cache.truncate("unknown", 0),
                 lambda: cache.seq_len("unknown"), lambda: cache.keep_path("unknown", 0, [])):
        with pytest.raises(ValueError, match="no sequence 'unknown'"):
            call()
    cache.allocate("a")
    write(cache, "a", [1, 2, 3])
    cache.fork("a", "b")  # both pages shared: keep_path must copy both, and there is no free page
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.keep_path("b", 0, [1, 2])
    assert cache.free_pages == 0 and cache._pages["b"] == cache._pages["a"] and cache.seq_len("b") == 3
    assert stored_tokens(cache, "b") == [1, 2, 3]
