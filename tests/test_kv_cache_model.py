"""PagedKVCache against a plain model of its sequences: random runs of allocate / write / fork / truncate /
keep_path / share_prefix / index_prefix / free, and calls that must fail (hypothesis' stateful testing), on fp32,
fp8 and nvfp4 caches of one or two layers and KV heads, checked after every step: every position of every sequence
holds, in every layer, head and dimension, exactly the keys and values of the token the model says is there; every
page's reference count is the number of sequences holding it and no page leaks; every page the prefix index names
holds the tokens it was indexed with; and a call that fails changes nothing. Also: the argument checks.

ATTNOPS_FUZZ_CASES sets the number of runs (as in tests/test_fuzz.py)."""
from __future__ import annotations

import copy
import os
import re

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import settings, strategies as st  # noqa: E402
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,  # noqa: E402
                                 run_state_machine_as_test)

from attnops import formats  # noqa: E402
from attnops.checks import HEAD_DIMS  # noqa: E402
from attnops.serving.kv_cache import PagedKVCache  # noqa: E402

HEAD_DIM = min(HEAD_DIMS)
# runs of up to 30 steps: 300 take about 10 s on one core (a run of 25 did not find a rewritten indexed page, 200 did)
RUNS = int(os.environ.get("ATTNOPS_FUZZ_CASES") or 300)
TOKENS = range(1, 7)
# token t's keys are E2M1_VALUES[t] and its values minus that, with a 6 (e2m1's largest) opening each 16-value
# block: every nvfp4 block scale is 1 and every value is exact in fp8 e4m3 and in e2m1, so a read compares exactly
VALUE_OF = {t: formats.E2M1_VALUES[t] for t in TOKENS}
TOKEN_OF = {v: t for t, v in VALUE_OF.items()}


def kv_rows(tokens: list[int], layer: int, num_kv_heads: int) -> torch.Tensor:
    """[n, 2 (K, V), Hkv, D] of `tokens` in `layer`: dimension 1 holds layer + 1 and dimension 2 head + 1, so that
    keys written into the wrong layer or head do not read as the right ones."""
    values = torch.tensor([VALUE_OF[t] for t in tokens], dtype=torch.float32)
    rows = torch.stack([values, -values], dim=1)[:, :, None, None].repeat(1, 1, num_kv_heads, HEAD_DIM)
    rows[..., 0::16] = formats.E2M1_MAX
    rows[..., 1] = layer + 1
    rows[..., 2] = torch.arange(1, num_kv_heads + 1, dtype=torch.float32)
    return rows


def write(cache: PagedKVCache, seqs: list, tokens: list[list[int]]) -> None:
    """One step writing `tokens[i]` after the end of `seqs[i]`, in every layer."""
    meta = cache.prepare(seqs, [len(t) for t in tokens], decode=False)
    flat = [t for run in tokens for t in run]
    for layer in range(cache.num_layers):
        kv = kv_rows(flat, layer, cache.num_kv_heads)
        torch.ops.attnops.reshape_and_cache(kv[:, 0], kv[:, 1], slot_mapping=meta.slot_mapping,
                                            **cache.write_args(layer))


def decoded(cache: PagedKVCache, layer: int, pages: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The stored K and V of (page, slot) pairs as float32 [n, 2, Hkv, D]."""
    rows = cache.kv[layer][pages, :, slots]
    if cache.block_scales is not None:
        return formats.dequantize(rows, cache.kv_format, cache.block_scales[layer][pages, :, slots])
    return formats.dequantize(rows, cache.kv_format, cache.k_scale)


def read_tokens(cache: PagedKVCache, pages: list[int], slots: list[int]) -> list[int]:
    """The tokens stored at these slots, read from layer 0's keys; fails unless every layer's K and V there are
    exactly those tokens' rows."""
    pages, slots = torch.tensor(pages, dtype=torch.long), torch.tensor(slots, dtype=torch.long)
    tokens = [TOKEN_OF.get(v) for v in decoded(cache, 0, pages, slots)[:, 0, 0, 3].tolist()]
    assert None not in tokens, f"slots that hold no token: {tokens}"
    for layer in range(cache.num_layers):
        assert torch.equal(decoded(cache, layer, pages, slots), kv_rows(tokens, layer, cache.num_kv_heads)), \
            f"layer {layer}: not the keys and values of {tokens}"
    return tokens


def stored_tokens(cache: PagedKVCache, seq) -> list[int]:
    n, size = cache.seq_len(seq), cache.page_size
    if not n:
        return []
    return read_tokens(cache, [cache._pages[seq][p // size] for p in range(n)], [p % size for p in range(n)])


def snapshot(cache: PagedKVCache) -> tuple:
    """Everything a failed call must leave as it was."""
    books = copy.deepcopy((cache._pages, cache._lengths, cache._refs, cache._free_pages, cache._indexed,
                           cache._key_of, cache._content_of, cache._row, cache._free_rows))
    tensors = [t.clone() for t in cache.kv + (cache.block_scales or [])] + [cache._table.clone()]
    return books, tensors


def assert_unchanged(cache: PagedKVCache, before: tuple) -> None:
    books, tensors = snapshot(cache)
    assert books == before[0]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(tensors, before[1]))


class CacheModel(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = None
        self.tokens: dict[str, list[int]] = {}  # the model: each sequence's tokens
        self.indexed: dict[int, list[int]] = {}  # page -> the tokens it held when the index took it
        self.next_id = 0

    @initialize(kv_format=st.sampled_from(["fp32", "fp8_e4m3", "nvfp4"]), num_layers=st.integers(1, 2),
                page_size=st.sampled_from([1, 2, 4]), num_kv_heads=st.integers(1, 2), num_pages=st.integers(6, 20))
    def make(self, kv_format, num_layers, page_size, num_kv_heads, num_pages):
        self.cache = PagedKVCache(num_layers, num_pages, page_size, num_kv_heads, HEAD_DIM, kv_format=kv_format)

    def new_id(self) -> str:
        self.next_id += 1
        return f"s{self.next_id}"

    def some(self, data, nonempty=False) -> str:
        return data.draw(st.sampled_from(sorted(s for s, t in self.tokens.items() if t or not nonempty)))

    def fails(self, call, error=RuntimeError, match="out of pages") -> bool:
        """Runs call(); if it raises `error` (an exception type or a tuple of them) with a message that `match`
        (a regular expression) finds, checks that it changed nothing and returns True."""
        before = snapshot(self.cache)
        try:
            call()
        except error as e:
            assert re.search(match, str(e)), e
            assert_unchanged(self.cache, before)
            return True
        return False

    def write_tokens(self, data, seqs: list, counts: list[int]) -> None:
        new = [data.draw(st.lists(st.sampled_from(TOKENS), min_size=n, max_size=n)) for n in counts]
        if not self.fails(lambda: write(self.cache, seqs, new)):
            for seq, run in zip(seqs, new):
                self.tokens[seq] += run

    @precondition(lambda self: len(self.tokens) < 4)  # a few sequences with many steps each
    @rule(data=st.data(), count=st.integers(0, 9))
    def allocate(self, data, count):
        seq = self.new_id()
        self.cache.allocate(seq)
        self.tokens[seq] = []
        if count:
            self.write_tokens(data, [seq], [count])

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), count=st.one_of(st.integers(1, 6), st.integers(17, 20)))  # > 16: prepare's long runs
    def write(self, data, count):
        self.write_tokens(data, [self.some(data)], [count])

    @precondition(lambda self: len(self.tokens) > 1)
    @rule(data=st.data())
    def write_batch(self, data):
        seqs = data.draw(st.lists(st.sampled_from(sorted(self.tokens)), min_size=2, unique=True))
        self.write_tokens(data, seqs, data.draw(st.lists(st.integers(0, 3), min_size=len(seqs), max_size=len(seqs))))

    @precondition(lambda self: 0 < len(self.tokens) < 5)
    @rule(data=st.data())
    def fork(self, data):
        src = self.some(data)
        n = data.draw(st.integers(0, len(self.tokens[src])))
        dst = self.new_id()
        self.cache.fork(src, dst, n)
        self.tokens[dst] = self.tokens[src][:n]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        seq = self.some(data)
        n = data.draw(st.integers(0, len(self.tokens[seq])))
        self.cache.truncate(seq, n)
        del self.tokens[seq][n:]

    @precondition(lambda self: any(self.tokens.values()))
    @rule(data=st.data(), count=st.integers(1, 4))
    def roll_back_and_write(self, data, count):
        """What a rejected draft does: the sequence ends earlier (often inside a full page) and goes on."""
        seq = self.some(data, nonempty=True)
        n = data.draw(st.integers(0, len(self.tokens[seq]) - 1))
        self.cache.truncate(seq, n)
        del self.tokens[seq][n:]
        self.write_tokens(data, [seq], [count])

    @precondition(lambda self: any(self.tokens.values()))
    @rule(data=st.data())
    def keep_path(self, data):
        seq = self.some(data, nonempty=True)
        tokens = self.tokens[seq]
        start = data.draw(st.integers(0, len(tokens) - 1))
        path = sorted(data.draw(st.sets(st.integers(0, len(tokens) - start - 1))))
        if not self.fails(lambda: self.cache.keep_path(seq, start, path)):
            self.tokens[seq] = tokens[:start] + [tokens[start + i] for i in path]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def index_prefix(self, data):
        seq = self.some(data)
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
        src = self.some(data, nonempty=True)
        prompt = self.tokens[src][:data.draw(st.integers(1, len(self.tokens[src])))]
        prompt += data.draw(st.lists(st.sampled_from(TOKENS), min_size=1, max_size=4))
        seq = self.new_id()
        self.cache.allocate(seq)
        shared = self.cache.share_prefix(seq, prompt)
        assert shared < len(prompt) and shared % self.cache.page_size == 0
        self.tokens[seq] = prompt[:shared]  # the invariants read them back from the shared pages

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = self.some(data)
        self.cache.free(seq)
        del self.tokens[seq]

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), kind=st.integers(0, 6))
    def bad_call(self, data, kind):
        """A call that must raise, and change nothing."""
        seq, cache = self.some(data), self.cache
        n = len(self.tokens[seq])
        call, error, match = {
            0: (lambda: cache.prepare(["unknown"]), ValueError, "no sequence 'unknown'"),
            1: (lambda: cache.truncate(seq, n + 1), ValueError, "length"),
            2: (lambda: cache.fork(seq, "forked", n + 1), ValueError, "num_tokens"),
            3: (lambda: cache.fork(seq, "forked", float(n)), TypeError, "num_tokens"),
            4: (lambda: cache.prepare([seq], 1, max_pages=n // cache.page_size), (ValueError, RuntimeError),
                "max_pages|out of pages"),
            5: (lambda: cache.prepare([seq, seq], 1), ValueError, "distinct"),
            6: (lambda: cache.keep_path(seq, n, [0]), ValueError, "path"),
        }[kind]
        assert self.fails(call, error, match)

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
        assert self.cache.free_pages + sum(h > 0 for h in holders) == self.cache.num_pages

    @invariant()
    def the_index_names_only_pages_that_hold_its_tokens(self):
        if self.cache is None:
            return
        cache, size = self.cache, self.cache.page_size
        assert {page: key for key, page in cache._indexed.items()} == cache._key_of
        assert set(cache._content_of) == set(cache._key_of)
        for page in cache._key_of:
            assert cache._refs[page] > 0  # a freed page left the index
            assert read_tokens(cache, [page] * size, list(range(size))) == self.indexed[page], page


def test_the_cache_keeps_its_model():
    run_state_machine_as_test(CacheModel, settings=settings(max_examples=RUNS, stateful_step_count=30,
                                                            deadline=None, database=None, derandomize=True))


@pytest.mark.parametrize("arguments,error,name", [
    (dict(num_layers=0), ValueError, "num_layers"),
    (dict(num_pages=-3), ValueError, "num_pages"),
    (dict(num_pages=0), ValueError, "num_pages"),
    (dict(page_size=0), ValueError, "page_size"),
    (dict(page_size=3), ValueError, "page_size"),
    (dict(page_size=512), ValueError, "page_size"),
    (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
    (dict(head_dim=72), ValueError, "head_dim"),
    (dict(head_dim=528), ValueError, "head_dim"),
    (dict(num_pages=4.0), TypeError, "num_pages"),
    (dict(num_layers=True), TypeError, "num_layers"),
    (dict(kv_format="int4"), ValueError, "kv_format"),
])
def test_constructor_arguments_are_named(arguments, error, name):
    base = dict(num_layers=1, num_pages=8, page_size=4, num_kv_heads=1, head_dim=HEAD_DIM)
    with pytest.raises(error, match=rf"PagedKVCache: {name}\b"):
        PagedKVCache(**{**base, **arguments})


def test_unknown_sequences_and_no_pages_are_errors_that_change_nothing():
    cache = PagedKVCache(1, 3, 2, 1, HEAD_DIM, kv_format="fp32")
    for method, call in (("prepare", lambda: cache.prepare(["unknown"])), ("free", lambda: cache.free("unknown")),
                         ("fork", lambda: cache.fork("unknown", "x")),
                         ("truncate", lambda: cache.truncate("unknown", 0)),
                         ("seq_len", lambda: cache.seq_len("unknown")),
                         ("keep_path", lambda: cache.keep_path("unknown", 0, [])),
                         ("share_prefix", lambda: cache.share_prefix("unknown", [1, 2])),
                         ("index_prefix", lambda: cache.index_prefix("unknown", [1, 2]))):
        with pytest.raises(ValueError, match=rf"PagedKVCache.{method}: no sequence 'unknown'"):
            call()
    cache.allocate("a")
    write(cache, ["a"], [[1, 2, 3, 4]])
    cache.fork("a", "b")  # both pages shared: keep_path must copy both, and one page is free
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="out of pages"):
        cache.keep_path("b", 0, [1, 2, 3])
    assert_unchanged(cache, before)
    assert stored_tokens(cache, "b") == [1, 2, 3, 4]
