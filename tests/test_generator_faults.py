"""One bad request never harms the others in the Generator: random batches of good requests with bad ones mixed in
(token ids outside the vocabulary, negative or non-integer tokens, prompts too long for max_seq_len or for the whole
cache, duplicate ids, budgets of zero, requests whose prefill or decode step fails, and a cache too small for
everything at once); every good request's tokens equal those of a run without the bad ones, every bad one is
refused at add_request or reported in `failed`, and no page leaks."""
from __future__ import annotations

import random

import pytest
import torch

import attnops
from attnops.serving.generate import Generator
from test_prefix_sharing import tiny_model

VOCAB = 128
POISON = VOCAB - 1  # a prompt starting with it breaks its prefill; good prompts never hold it
BREAKING_POSITION = 26  # a step writing this position breaks; good requests stay below it (at most 24 tokens)


class Faulty(torch.nn.Module):
    """The model, with two faults only a bad request has: a prefill of a prompt that starts with POISON raises,
    and so does any step that writes BREAKING_POSITION."""

    def __init__(self, model):
        super().__init__()
        self.model, self.config = model, model.config

    def forward(self, token_ids, positions, cache, meta):
        if meta.cu_seqlens_q is not None and bool(((positions == 0) & (token_ids == POISON)).any()):
            raise RuntimeError("this prompt breaks the model")
        if bool((positions == BREAKING_POSITION).any()):
            raise RuntimeError("this position breaks the model")
        return self.model(token_ids, positions, cache, meta)


@pytest.fixture(scope="module")
def model():
    return Faulty(tiny_model())


def make_generator(model, num_pages=64, **options):
    cache = attnops.PagedKVCache(2, num_pages, 8, 2, 32, kv_format="fp32", shuffle_pages=True)
    return Generator(model, cache, max_batch=4, max_seq_len=64, buckets=(4,), **options), cache


def served_alone(model, requests: dict, num_pages=64) -> dict:
    gen, cache = make_generator(model, num_pages)
    for req_id, (prompt, budget) in requests.items():
        gen.add_request(req_id, prompt, budget)
    outputs = gen.run()
    assert not gen.failed and cache.free_pages == cache.num_pages
    return outputs


def good_requests(rng: random.Random, count: int) -> dict:
    return {f"good{i}": ([rng.randrange(1, POISON) for _ in range(rng.randint(1, 12))], rng.randint(1, 12))
            for i in range(count)}


REFUSED = ["token past the vocabulary", "negative token", "float token", "empty prompt", "too long",
           "more pages than the cache", "zero budget", "duplicate id"]
FAILING = {"prefill fails": "this prompt breaks the model", "decode fails": "this position breaks the model"}


def bad_request(kind: str, rng: random.Random, taken: str):
    prompt = [rng.randrange(1, POISON) for _ in range(5)]
    return {"token past the vocabulary": ("bad", prompt + [VOCAB], 4),
            "negative token": ("bad", [-1] + prompt, 4),
            "float token": ("bad", prompt + [2.0], 4),
            "empty prompt": ("bad", [], 4),
            "too long": ("bad", prompt * 12, 10),
            "more pages than the cache": ("bad", prompt * 8, 20),
            "zero budget": ("bad", prompt, 0),
            "duplicate id": (taken, prompt, 4),
            "prefill fails": ("bad", [POISON] + prompt, 4),
            "decode fails": ("bad", [rng.randrange(1, POISON) for _ in range(24)], 8)}[kind]  # its 3rd step


@pytest.mark.parametrize("seed", range(5))
def test_good_requests_finish_as_if_the_bad_ones_were_not_there(model, seed):
    rng = random.Random(seed)
    good = good_requests(rng, rng.randint(2, 6))
    # a cache of 7 pages: each request fits alone (a good one at most 24 tokens: 3 pages; the one whose decode
    # fails 4), not all at once
    expected = served_alone(model, good, num_pages=7)

    mixed, cache = make_generator(model, num_pages=7)
    kinds = rng.sample(REFUSED, rng.randint(1, 4)) + rng.sample(sorted(FAILING), rng.randint(1, 2))
    order = list(good.items()) + [None] * len(kinds)
    rng.shuffle(order)
    rng.shuffle(kinds)
    refused, taken = [], {}
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
            taken[req_id] = kind
        except ValueError as e:
            refused.append((kind, str(e)))
        if rng.random() < 0.5:
            mixed.step()
    outputs = mixed.run()
    assert {k: outputs[k] for k in good} == expected
    # what add_request took fails alone, with its reason; the rest was refused
    assert {req_id: FAILING[kind] for req_id, kind in taken.items()} == {
        req_id: reason.removeprefix("RuntimeError: ") for req_id, reason in mixed.failed.items()}
    assert refused and all(kind in REFUSED and message.startswith("Generator.add_request:")
                           for kind, message in refused), refused
    assert cache.free_pages == cache.num_pages


def test_a_token_past_the_vocabulary_is_refused_and_the_request_beside_it_finishes(model):
    gen, cache = make_generator(model)
    gen.add_request("a", [1, 2, 3], 4)
    with pytest.raises(ValueError, match=r"prompt token 128 is outside the vocabulary \[0, 128\)"):
        gen.add_request("b", [5, VOCAB], 4)
    with pytest.raises(ValueError, match="prompt token -3"):
        gen.add_request("c", [-3, 5], 4)
    assert gen.run() == served_alone(model, {"a": ([1, 2, 3], 4)})
    assert cache.free_pages == cache.num_pages


def test_a_request_that_never_fits_is_refused_and_blocks_nobody(model):
    gen, cache = make_generator(model, num_pages=4)
    with pytest.raises(ValueError, match="need 5 pages; the whole cache has 4"):
        gen.add_request("huge", list(range(1, 31)), 10)
    with pytest.raises(ValueError, match="exceeds max_seq_len 64"):
        gen.add_request("long", list(range(1, 31)), 40)
    gen.add_request("small", [1, 2, 3], 3)
    gen.add_request("second", [4, 5], 5)
    assert gen.run() == served_alone(model, {"small": ([1, 2, 3], 3), "second": ([4, 5], 5)})
    assert cache.free_pages == cache.num_pages


@pytest.mark.parametrize("fault", sorted(FAILING))
def test_a_step_that_fails_fails_alone_with_its_reason(model, fault):
    gen, cache = make_generator(model)
    good = {"ok": ([1, 2, 3], 12), "also ok": ([9, 8, 7, 6], 10)}
    gen.add_request("ok", *good["ok"])
    gen.add_request("broken", *bad_request(fault, random.Random(0), None)[1:])
    gen.add_request("also ok", *good["also ok"])
    assert gen.run() == served_alone(model, good)
    assert gen.failed == {"broken": f"RuntimeError: {FAILING[fault]}"}
    assert cache.free_pages == cache.num_pages
    with pytest.raises(ValueError, match="req_id 'broken' is already taken"):
        gen.add_request("broken", [1], 1)


def test_a_request_short_of_pages_held_outside_waits_or_fails_alone(model):
    # reservations count the whole cache; pages another user holds can still leave a prefill short
    gen, cache = make_generator(model, num_pages=8)
    cache.allocate("outside")
    cache.prepare(["outside"], [16], decode=False)  # 2 of the 8 pages
    good = {"a": (list(range(1, 18)), 7), "b": (list(range(30, 55)), 2)}  # 3 pages and 4: not both beside it
    for req_id, (prompt, budget) in good.items():
        gen.add_request(req_id, prompt, budget)
    assert gen.run() == served_alone(model, good) and not gen.failed
    assert cache.free_pages == 6
    cache.prepare(["outside"], [24], decode=False)  # 5 pages: "c" can never fit while they are held
    gen.add_request("c", list(range(1, 27)), 4)
    assert gen.run() == served_alone(model, good) and "out of pages" in gen.failed["c"]
    cache.free("outside")
    assert cache.free_pages == cache.num_pages


def test_add_request_names_what_it_refuses(model):
    gen, _ = make_generator(model)
    gen.add_request("a", torch.tensor([1, 2, 3]), 2)  # a 1-D integer tensor is a prompt too
    for args, message in [(("a", [1], 2), "req_id 'a' is already taken \\(a queued request\\)"),
                          (("b", [], 2), "prompt must be a non-empty list of token ids"),
                          (("b", "abc", 2), "prompt must be a non-empty list"),
                          (("b", [1, True], 2), "prompt must hold integer token ids \\(got True, a bool\\)"),
                          (("b", torch.tensor([1.0]), 2), "prompt must hold integer token ids"),
                          (("b", [1], 0), "max_new_tokens must be an int >= 1 \\(got 0\\)"),
                          (("b", [1], 2.0), "max_new_tokens must be an int >= 1")]:
        with pytest.raises(ValueError, match="^Generator.add_request: " + message):
            gen.add_request(*args)
    with pytest.raises(ValueError, match="temperature must be finite"):
        gen.add_request("b", [1], 2, temperature=float("nan"))
    with pytest.raises(ValueError, match="eos_token_id must be an int or None"):
        gen.add_request("b", [1], 2, eos_token_id=[2])
    assert len(gen.waiting) == 1 and gen.vocab_size == VOCAB


def test_the_generator_and_its_decode_step_name_a_bad_size_before_anything_runs(model):
    """A batch of 0 would admit nothing and spin forever; a float length or bucket would fail every decode step
    and fall back to recomputing the sequences through prefill, unseen; a missing cache or a seed of the wrong
    type failed deep inside."""
    cache = attnops.PagedKVCache(2, 16, 8, 2, 32, kv_format="fp32")
    for options, error, name in [(dict(max_batch=0), ValueError, "max_batch"),
                                 (dict(max_batch=-1), ValueError, "max_batch"),
                                 (dict(max_batch="4"), TypeError, "max_batch"),
                                 (dict(max_seq_len=64.0), TypeError, "max_seq_len"),
                                 (dict(max_seq_len=None), TypeError, "max_seq_len"),
                                 (dict(buckets=(2.0, 4)), TypeError, "buckets"),
                                 (dict(buckets=()), TypeError, "buckets"),
                                 (dict(seed=1.5), TypeError, "seed")]:
        with pytest.raises(error, match=name):
            Generator(model, cache, **{**dict(max_batch=4, max_seq_len=64), **options})
    with pytest.raises(TypeError, match="cache must be a PagedKVCache"):
        Generator(model, None, max_batch=4, max_seq_len=64)
    with pytest.raises(ValueError, match="the model has 2 layers and the cache 1"):
        Generator(model, attnops.PagedKVCache(1, 16, 8, 2, 32, kv_format="fp32"), max_batch=4, max_seq_len=64)


def test_a_decode_step_refuses_token_ids_that_are_not_one_integer_a_sequence(model):
    """A one-token tensor broadcast over the batch (every sequence given the same token) and floats were truncated,
    with no error; a failed call grew the sequences. Refused before the cache changes."""
    from attnops.serving.generate import DecodeStep
    cache = attnops.PagedKVCache(2, 16, 8, 2, 32, kv_format="fp32")
    step = DecodeStep(model, cache, max_batch=4, max_pages=4, buckets=(4,), cascade=False)
    for seq, prompt in (("a", [5, 6, 7]), ("b", [8, 9, 10, 11])):
        cache.allocate(seq)
        cache.prepare([seq], len(prompt))
    lengths = [cache.seq_len(s) for s in ("a", "b")]
    for token_ids in (torch.tensor([9]), torch.tensor(9), torch.tensor([9.9, 12.9]), [9, 12],
                      torch.tensor([True, False]), torch.tensor([[9], [12]])):
        with pytest.raises(ValueError, match="token_ids must be an integer tensor \\[2\\]"):
            step(["a", "b"], token_ids)
    assert [cache.seq_len(s) for s in ("a", "b")] == lengths
    assert step(["a", "b"], torch.tensor([9, 12])).shape[0] == 2
    assert [cache.seq_len(s) for s in ("a", "b")] == [n + 1 for n in lengths]


def test_add_request_takes_numpy_numbers(model):
    """numpy integers for the budget and eos and a numpy float temperature (as a prompt of numpy ids already was),
    and a string temperature is named as such."""
    import numpy as np
    gen, _ = make_generator(model)
    req = gen.add_request("a", [1, 2, 3], np.int64(2), temperature=np.float32(0.5), eos_token_id=np.int32(7))
    assert (req.max_new_tokens, req.temperature, req.eos_token_id) == (2, 0.5, 7)
    assert type(req.max_new_tokens) is int and type(req.temperature) is float and type(req.eos_token_id) is int
    with pytest.raises(ValueError, match="temperature must be a number \\(got str\\)"):
        gen.add_request("b", [1], 2, temperature="0.5")
