"""One bad request never harms the others in the Generator: random batches of good requests with bad ones mixed in
(token ids outside the vocabulary, negative or non-integer tokens, prompts too long for max_seq_len or for the whole
cache, duplicate ids, budgets of zero, requests whose prefill fails, and a cache too small for everything at once);
every good request's tokens equal those of a run without the bad ones, every bad one is refused at add_request or
reported in `failed`, and no page leaks."""
from __future__ import annotations

import random

import pytest
import torch

import attnops
from attnops.serving.generate import Generator
from test_prefix_sharing import tiny_model

VOCAB = 128


def make_generator(model, num_pages=64, **options):
    cache = attnops.PagedKVCache(2, num_pages, 8, 2, 32, kv_format="fp32", shuffle_pages=True)
    return Generator(model, cache, max_batch=4, max_seq_len=64, buckets=(4,), **options), cache


class FailsForOnePrompt(torch.nn.Module):
    """The model, except that a prefill holding the token `poison` raises (a fault only that request has)."""

    def __init__(self, model, poison: int):
        super().__init__()
        self.model, self.poison, self.config = model, poison, model.config

    def forward(self, token_ids, positions, cache, meta):
        if token_ids.shape[0] > 1 and bool((token_ids == self.poison).any()):
            raise RuntimeError("this prompt breaks the model")
        return self.model(token_ids, positions, cache, meta)


def good_requests(rng: random.Random, count: int) -> dict:
    return {f"good{i}": ([rng.randrange(1, VOCAB - 1) for _ in range(rng.randint(1, 20))], rng.randint(1, 12))
            for i in range(count)}


BAD_KINDS = ["token past the vocabulary", "negative token", "float token", "empty prompt", "too long",
             "more pages than the cache", "zero budget", "duplicate id", "prefill fails"]


def bad_request(kind: str, rng: random.Random, taken: str):
    prompt = [rng.randrange(1, VOCAB - 1) for _ in range(5)]
    return {"token past the vocabulary": ("bad", prompt + [VOCAB], 4),
            "negative token": ("bad", [-1] + prompt, 4),
            "float token": ("bad", prompt + [2.0], 4),
            "empty prompt": ("bad", [], 4),
            "too long": ("bad", prompt * 12, 10),
            "more pages than the cache": ("bad", prompt * 8, 20),
            "zero budget": ("bad", prompt, 0),
            "duplicate id": (taken, prompt, 4),
            "prefill fails": ("bad", prompt + [VOCAB - 1], 4)}[kind]


@pytest.mark.parametrize("seed", range(4))
def test_good_requests_finish_as_if_the_bad_ones_were_not_there(seed):
    rng = random.Random(seed)
    model = FailsForOnePrompt(tiny_model(), poison=VOCAB - 1)
    good = good_requests(rng, rng.randint(2, 6))
    # a cache of 7 pages: each good request fits alone (at most 32 tokens: 4 pages), not all at once
    alone, cache = make_generator(model, num_pages=7)
    for req_id, (prompt, budget) in good.items():
        alone.add_request(req_id, prompt, budget)
    expected = alone.run()
    assert cache.free_pages == cache.num_pages

    mixed, cache = make_generator(model, num_pages=7)
    kinds = rng.sample(BAD_KINDS, rng.randint(2, 5))
    order = list(good.items()) + [None] * len(kinds)
    rng.shuffle(order)
    refused, bad_ids = [], []
    for item in order:
        if item is not None:
            mixed.add_request(item[0], *item[1])
            continue
        kind = kinds.pop()
        added = [k for k in good if any(r.req_id == k for r in mixed.waiting) or k in mixed.running
                 or k in mixed.finished]
        if kind == "duplicate id" and not added:
            kind = "zero budget"  # (nothing to duplicate yet)
        req_id, prompt, budget = bad_request(kind, rng, taken=added[0] if added else None)
        req_id = f"{req_id}-{kind}" if req_id == "bad" else req_id
        try:
            mixed.add_request(req_id, prompt, budget)
            bad_ids.append((req_id, kind))
        except ValueError as e:
            refused.append((kind, str(e)))
        if rng.random() < 0.5:
            mixed.step()
    outputs = mixed.run()
    assert {k: outputs[k] for k in good} == expected
    for req_id, kind in bad_ids:  # what add_request took: only a prefill that fails, which fails alone
        assert kind == "prefill fails", kind
        assert req_id in mixed.failed and "breaks the model" in mixed.failed[req_id]
    for kind, message in refused:
        assert kind != "prefill fails" and message.startswith("Generator.add_request:"), (kind, message)
    assert cache.free_pages == cache.num_pages


def test_a_token_past_the_vocabulary_is_refused_and_the_request_beside_it_finishes():
    model = tiny_model()
    gen, cache = make_generator(model)
    gen.add_request("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"prompt token 128 is outside the vocabulary \[0, 128\)"):
        gen.add_request("b", [5, VOCAB], 4)
    with pytest.raises(ValueError, match="prompt token -3"):
        gen.add_request("c", [-3, 5], 4)
    assert len(gen.run()["a"]) == 4 and cache.free_pages == cache.num_pages


def test_a_request_that_never_fits_is_refused_and_blocks_nobody():
    gen, cache = make_generator(tiny_model(), num_pages=4)
    with pytest.raises(ValueError, match="need 5 pages; the whole cache has 4"):
        gen.add_request("huge", list(range(1, 31)), 10)
    gen.add_request("small", [1, 2, 3], 3)
    assert len(gen.run()["small"]) == 3 and cache.free_pages == cache.num_pages


def test_a_prefill_that_fails_fails_alone_with_its_reason():
    gen, cache = make_generator(FailsForOnePrompt(tiny_model(), poison=7))
    gen.add_request("ok", [1, 2, 3], 3)
    gen.add_request("broken", [7, 8, 9], 3)
    outputs = gen.run()
    assert list(outputs) == ["ok"] and len(outputs["ok"]) == 3
    assert gen.failed == {"broken": "RuntimeError: this prompt breaks the model"}
    assert cache.free_pages == cache.num_pages
