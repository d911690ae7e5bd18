"""Generation over a PagedKVCache: batched prefill, fixed-shape decode steps, continuous batching, sampling.

    gen = Generator(model, cache, max_batch=8, max_seq_len=512, compile=True)
    gen.add_request("a", prompt_ids, max_new_tokens=64)             # joins at the next step
    while gen.has_work():
        new_tokens = gen.step()                                      # {req_id: [token, ...]} of this step

A step first prefills the requests admitted from the queue (one extend-form call over all of them: cu_seqlens_q
marks each prompt's rows), which gives each its first token, then runs one decode step over every running request.
A request finishes at max_new_tokens or its eos token and its pages go back to the cache before the next step.

The decode step (DecodeStep) runs at fixed shapes: the batch is padded up to a bucket size (1, 2, 4, 8, ...) with
padding rows (slot_mapping -1: the cache write skips them; seq_lens 0: attention gives them 0) and the block table
has a fixed width (the pages of max_seq_len), so the lengths and pages changing from step to step never change a
shape, and torch.compile(fullgraph=True, dynamic=False) compiles it once per bucket. The same fixed shapes are what
a CUDA graph needs: cuda_graphs=True hands the (compiled) step function to attnops.serving.graphs.DecodeGraphRunner, one
graph per bucket. (DecodeStep.buffers[bucket] and DecodeStep.launch(bucket) are the static inputs and the call to
replace for a graph helper of another shape.)
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import numbers
from dataclasses import dataclass, field
from typing import Callable

import torch

from ..cascade import PrefixPass, cascade_min_prefix_tokens
from ..invariance import batch_invariant as invariant_mode
from .batching import StaticCascadeInputs, StaticDecodeInputs, default_buckets
from .kv_cache import BatchMetadata, CascadeSplit, PagedKVCache, _positive_int


def _decode_step_fn(model: torch.nn.Module, cache: PagedKVCache) -> Callable[..., torch.Tensor]:
    """The decode step as a function of its tensor arguments only (what torch.compile and CUDA graphs take)."""

    def step(token_ids, positions, block_table, seq_lens, slot_mapping):
        meta = BatchMetadata(seq_ids=[], block_table=block_table, seq_lens=seq_lens, slot_mapping=slot_mapping,
                             cu_seqlens_q=None)
        return model(token_ids, positions, cache, meta)

    return step


def _cascade_step_fn(model: torch.nn.Module, cache: PagedKVCache) -> Callable[..., torch.Tensor]:
    """The decode step whose layers read a shared prefix once (cascade_attention), as a function of its tensor
    arguments only: StaticCascadeInputs' buffers."""

    def step(token_ids, positions, block_table, seq_lens, slot_mapping, prefix_block_table, prefix_seq_lens,
             prefix_cu_seqlens_q, prefix_tree_mask, suffix_block_table, suffix_seq_lens):
        split = CascadeSplit(block_table=suffix_block_table, seq_lens=suffix_seq_lens, prefix_tokens=0,
                             prefix_pages=[], host_seq_lens=[],
                             prefix_pass=PrefixPass(prefix_block_table, prefix_seq_lens, prefix_cu_seqlens_q,
                                                    prefix_tree_mask))
        meta = BatchMetadata(seq_ids=[], block_table=block_table, seq_lens=seq_lens, slot_mapping=slot_mapping,
                             cu_seqlens_q=None, cascade=split)
        return model(token_ids, positions, cache, meta)

    return step


class DecodeStep:
    """One decode step (one new token per sequence) at fixed shapes per batch-size bucket.

    `step_fn(token_ids, positions, block_table, seq_lens, slot_mapping) -> logits [N, vocab]` depends only on its
    tensor arguments, the model's parameters and the cache tensors (written in place), which is what both
    torch.compile and CUDA-graph capture need. compile=True wraps it in torch.compile(fullgraph=True,
    dynamic=False): one graph per bucket, never a recompilation for new lengths or pages; a dict adds or overrides
    torch.compile's keyword arguments (backend=, mode=, options=).
    """

    def __init__(self, model: torch.nn.Module, cache: PagedKVCache, *, max_batch: int, max_pages: int,
                 buckets: tuple[int, ...] | None = None, compile: bool | dict = False, cuda_graphs: bool = False,
                 cascade: bool = True):
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"DecodeStep: cache must be a PagedKVCache (got {type(cache).__name__})")
        _positive_int("DecodeStep", "max_batch", max_batch, 1)
        _positive_int("DecodeStep", "max_pages", max_pages, 1)
        if buckets is not None:
            if not isinstance(buckets, (list, tuple)) or not buckets:
                raise TypeError(f"DecodeStep: buckets must be a non-empty tuple of ints (got {buckets!r})")
            for bucket in buckets:
                _positive_int("DecodeStep", "buckets", bucket, 1)
        self.model, self.cache, self.max_pages = model, cache, max_pages
        self.cascade_steps = 0
        self.buckets = tuple(sorted(buckets or default_buckets(max_batch)))
        if self.buckets[-1] < max_batch:
            raise ValueError(f"DecodeStep: the largest bucket ({self.buckets[-1]}) is below max_batch ({max_batch})")
        # Static inputs per bucket, at their padding values; __call__ overwrites them in place each step.
        self.buffers = StaticDecodeInputs(self.buckets, max_pages, cache.device, owner="DecodeStep")
        # The step function closes over the model and the cache, not over self: a bound method or a lambda on self
        # here would make a reference cycle, and a dropped DecodeStep would hold its model and KV cache (GPU
        # memory, and under tensor parallelism the process group) until the cyclic garbage collector ran.
        step_fn = _decode_step_fn(model, cache)
        # dynamic=False: each bucket is its own static-shape graph (what a CUDA graph per bucket needs), instead of
        # dynamo turning the batch dimension symbolic when it sees a second bucket.
        if compile:
            options = {"fullgraph": True, "dynamic": False, **(compile if isinstance(compile, dict) else {})}
            step_fn = torch.compile(step_fn, **options)
        self.step_fn = step_fn
        # cuda_graphs=True: attnops.serving.graphs.DecodeGraphRunner captures step_fn once per bucket (on first use)
        # over these same static inputs and re-plans backends before each replay.
        self.graph_runner = None
        if cuda_graphs:
            from .graphs import DecodeGraphRunner
            self.graph_runner = DecodeGraphRunner(self.step_fn, cache, inputs=self.buffers)
        # cascade=True: a second step function (compiled, captured) for steps whose batch shares leading pages,
        # its own static inputs and graphs; used when attnops.cascade.cascade_pays
        self.cascade = None
        if cascade:
            buffers = StaticCascadeInputs(self.buckets, max_pages, cache.page_size, cache.device, owner="DecodeStep")
            fn = _cascade_step_fn(model, cache)
            if compile:
                fn = torch.compile(fn, **options)
            runner = None
            if cuda_graphs:
                from .graphs import DecodeGraphRunner
                runner = DecodeGraphRunner(fn, cache, inputs=buffers)
            self.cascade = (fn, buffers, runner)

    def launch(self, n: int) -> torch.Tensor:
        """Runs bucket n's step over self.buffers[n] and returns its logits [n, vocab]. The hook for CUDA graphs:
        an instance attribute `launch`, a callable that replays bucket n's graph captured over
        self.step_fn(**self.buffers[n]) and returns its static logits, may replace this method."""
        return self.step_fn(**self.buffers[n])

    def bucket_for(self, batch: int) -> int:
        return self.buffers.bucket_for(batch)

    @torch.no_grad()
    def __call__(self, seq_ids: list, token_ids: torch.Tensor) -> torch.Tensor:
        """Writes each sequence's token `token_ids[b]` at its next position and returns the logits [B, vocab]
        (a view of the bucket's output, valid until the next call)."""
        batch = len(seq_ids)
        self.bucket_for(batch)  # a batch too large fails before the cache is touched
        # (before the cache grows: a one-token tensor would broadcast over the batch, floats would be truncated)
        if not isinstance(token_ids, torch.Tensor) or token_ids.shape != (batch,) or token_ids.is_floating_point() \
                or token_ids.dtype in (torch.bool, torch.complex64, torch.complex128):
            got = (f"{str(token_ids.dtype).replace('torch.', '')} {list(token_ids.shape)}"
                   if isinstance(token_ids, torch.Tensor) else type(token_ids).__name__)
            raise ValueError(f"DecodeStep: token_ids must be an integer tensor [{batch}] (one token a sequence; got "
                             f"{got})")
        meta = self.cache.prepare(seq_ids, 1, decode=True, max_pages=self.max_pages)
        positions = meta.seq_lens.long() - 1  # each sequence's new token sits at its old length
        if self.cascade is not None:
            # only a split that pays is made
            least = cascade_min_prefix_tokens(batch)
            split = None if least is None else self.cache.cascade_split(
                meta, min_pages=-(-least // self.cache.page_size))
            if split is not None:
                fn, buffers, runner = self.cascade
                meta.cascade = split
                self.cascade_steps += 1
                if runner is not None:  # a re-planning backend plans the suffix pass from the suffix lengths
                    return runner(token_ids, positions, dataclasses.replace(meta, host_seq_lens=split.host_seq_lens))
                n, inputs = buffers.fill(token_ids, positions, meta)
                return fn(**inputs)[:batch]
        if self.graph_runner is not None:
            return self.graph_runner(token_ids, positions, meta)
        n, _ = self.buffers.fill(token_ids, positions, meta)
        return self.launch(n)[:batch]


@dataclass
class Request:
    req_id: object
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy
    eos_token_id: int | None = None
    output: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # each output token's log-probability under its logits
    finished: bool = False


def sample(logits: torch.Tensor, temperatures: list[float], generator: torch.Generator | None) -> torch.Tensor:
    """Greedy (argmax) for rows of temperature 0, else a draw from softmax(logits / temperature)."""
    greedy = logits.argmax(-1)
    if not any(t > 0 for t in temperatures):
        return greedy
    temps = torch.tensor(temperatures, dtype=torch.float32, device=logits.device)
    probs = torch.softmax(logits.float() / temps.clamp(min=1e-5)[:, None], dim=-1)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return torch.where(temps > 0, drawn, greedy)


def _model_vocab_size(model) -> int | None:
    """The vocabulary a model embeds: its config's vocab_size (a transformers model, attnops.hf.serving_model's
    ModelShape), else its input embedding's rows; None where it shows neither."""
    size = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int) and not isinstance(size, bool):
        return size
    embeddings = getattr(model, "get_input_embeddings", None)
    size = getattr(embeddings() if callable(embeddings) else None, "num_embeddings", None)
    return size if isinstance(size, int) else None


_NONE = object()


def _token_list(prompt) -> list[int]:
    """`prompt` as a list of Python ints, or a ValueError naming what it holds instead."""
    if hasattr(prompt, "tolist") and getattr(prompt, "ndim", 1) == 1:  # a tensor or array: its elements, at once
        prompt = prompt.tolist()
    if not isinstance(prompt, (list, tuple, range)) or not prompt:
        raise ValueError(f"Generator.add_request: prompt must be a non-empty list of token ids (got {prompt!r:.60})")
    # a bool (an int subclass), or a float that happens to be whole, is a caller's mistake, not a token id
    bad = next((t for t in prompt if isinstance(t, bool) or not isinstance(t, numbers.Integral)), _NONE)
    if bad is not _NONE:
        raise ValueError(f"Generator.add_request: prompt must hold integer token ids (got {bad!r}, a "
                         f"{type(bad).__name__})")
    return [int(t) for t in prompt]


class Generator:
    """Continuous batching over `cache` with `model`: forward(token_ids [T], positions [T], cache, meta) -> logits
    [T, vocab] for a step's T new tokens, e.g. a transformers decoder through attnops.hf.serving_model.

    max_batch: most requests decoded together; max_seq_len: longest prompt + max_new_tokens accepted (it fixes
    the block table's width); compile, cuda_graphs: see DecodeStep (prefill stays eager: its shapes change
    every call);
    prefix_sharing: a prompt that starts with full pages a running request already holds (the same tokens, page
    by page from the start: a system prompt, a few-shot header) shares those pages instead of storing and
    computing them again (PagedKVCache.share_prefix); `stats` counts the tokens reused;
    cascade: a decode step whose whole batch shares leading pages reads them once (attnops.cascade_attention in
    every layer; its own compiled function and CUDA graphs per bucket) when attnops.cascade.cascade_pays says it
    is worth it; `stats["cascade_steps"]` counts those steps;
    seed: the sampling generator's seed (temperature > 0 only);
    batch_invariant: a request's logits, so its greedy tokens, are bitwise the same whatever other requests are
    served beside it (and whenever it arrives): every step runs in attnops.batch_invariant() mode, the decode
    step always at one batch size (max_batch rows; the model's matrix products see the same shapes each step),
    each prompt is prefilled alone, and prefix sharing and cascade are off (both compute a row from other
    requests' work); a model with a `prepare_batch_invariant()` method (attnops.hf.serving_model's) is asked to
    make its own layers row-independent too (a mixture of experts: a token's experts computed apart from the
    others'). Costs: padding rows up to max_batch, a prefill call per request. A request recomputed after a failed
    step is the exception (its prompt and tokens prefilled together);
    vocab_size: the token ids a prompt may hold are [0, vocab_size) (default: the model's config.vocab_size, else
    its input embedding's num_embeddings, where it has either).

    One bad request never harms the others:
    - a request that can never be served is refused by `add_request` with a ValueError naming the argument: an
      empty prompt or one of non-integer tokens, a token id outside [0, vocab_size), a req_id already taken (by
      a queued, running, finished or failed request), max_new_tokens not an int >= 1, prompt + max_new_tokens
      beyond max_seq_len or needing more pages than the whole cache holds;
    - a request that fits the cache alone but not beside the running ones waits in the queue (first come, first
      served) until their pages come back; admission reserves each request's whole budget of pages, so a
      running request never runs out of pages (one that still does, the pages being held outside this
      Generator, goes back to wait while others run);
    - a request whose step still fails fails alone: a failing batched prefill is retried request by request, a
      failing decode step recomputes each of its requests alone (a prefill over its prompt and tokens so far,
      as vLLM's preemption by recomputation); a request whose own prefill fails leaves the Generator, its pages
      freed, and `failed[req_id]` holds the reason ("ExceptionType: message"). The others produce the tokens
      they would have produced without it (greedy decoding: a recomputation gives the same logits up to
      rounding).
    `finished` holds the finished requests (their `output`), `run()` returns their tokens, `failed` the reasons
    of the failed ones.
    """

    def __init__(self, model, cache: PagedKVCache, *, max_batch: int = 8, max_seq_len: int = 2048,
                 buckets: tuple[int, ...] | None = None, compile: bool | dict = False, cuda_graphs: bool = False,
                 prefix_sharing: bool | None = None, cascade: bool | None = None, seed: int = 0,
                 vocab_size: int | None = None, batch_invariant: bool = False):
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"Generator: batch_invariant must be a bool (got {type(batch_invariant).__name__})")
        if batch_invariant:
            for name, value in (("prefix_sharing", prefix_sharing), ("cascade", cascade)):
                if value:
                    raise ValueError(f"Generator: {name}=True computes a request's rows from other requests' work; "
                                     "it cannot be on with batch_invariant=True")
            if buckets is not None and tuple(buckets) != (max_batch,):
                raise ValueError(f"Generator: with batch_invariant=True the decode step runs at max_batch rows only "
                                 f"(buckets=({max_batch},) or None; got {tuple(buckets)})")
            buckets, prefix_sharing, cascade = (max_batch,), False, False
            prepare = getattr(model, "prepare_batch_invariant", None)
            if callable(prepare):  # (the model's own layers: attnops.hf's mixture-of-experts models)
                prepare()
        self.batch_invariant = batch_invariant
        prefix_sharing = True if prefix_sharing is None else prefix_sharing
        cascade = True if cascade is None else cascade
        self.model, self.cache = model, cache
        if vocab_size is not None and (isinstance(vocab_size, bool) or not isinstance(vocab_size, int)
                                       or vocab_size < 1):
            raise ValueError(f"Generator: vocab_size must be an int >= 1 (got {vocab_size!r})")
        self.vocab_size = vocab_size if vocab_size is not None else _model_vocab_size(model)
        self.prefix_sharing = prefix_sharing
        self.stats = dict(prompt_tokens=0, prefix_tokens_reused=0, peak_pages_in_use=0, cascade_steps=0)
        if not isinstance(cache, PagedKVCache):
            raise TypeError(f"Generator: cache must be a PagedKVCache (got {type(cache).__name__})")
        layers = getattr(getattr(model, "config", None), "num_hidden_layers", None)
        if isinstance(layers, int) and layers > cache.num_layers:  # (else every request failed on an IndexError)
            raise ValueError(f"Generator: the model has {layers} layers and the cache {cache.num_layers}: make the "
                             f"cache for the model (attnops.hf.paged_kv_cache)")
        _positive_int("Generator", "max_batch", max_batch, 1)
        _positive_int("Generator", "max_seq_len", max_seq_len, 1)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"Generator: seed must be an int (got {type(seed).__name__})")
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        max_pages = -(-max_seq_len // cache.page_size)
        self.decode = DecodeStep(model, cache, max_batch=max_batch, max_pages=max_pages, buckets=buckets,
                                 compile=compile, cuda_graphs=cuda_graphs, cascade=cascade)
        self.generator = torch.Generator(cache.device).manual_seed(seed)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[object, Request] = {}  # in admission order: the decode batch's row order
        self.finished: dict[object, Request] = {}
        self.failed: dict[object, str] = {}  # requests taken out of a step that failed for them, and why
        self._reserved_pages = 0  # pages the running requests may still claim, so admission never overcommits
        self._requeued = 0

    def add_request(self, req_id, prompt: list[int], max_new_tokens: int, *, temperature: float = 0.0,
                    eos_token_id: int | None = None) -> Request:
        """Queues a request; refuses (ValueError, naming the argument) one that could never be served. `prompt`:
        token ids (a list, tuple, or a 1-D integer tensor or array)."""
        try:
            hash(req_id)
        except TypeError:
            raise TypeError(f"Generator.add_request: req_id must be hashable (got {type(req_id).__name__})") from None
        # finished and failed ids stay taken too: their results are read by id (finished, failed, run())
        state = ("queued" if any(r.req_id == req_id for r in self.waiting) else "running" if req_id in self.running
                 else "finished" if req_id in self.finished else "failed" if req_id in self.failed else None)
        if state is not None:
            raise ValueError(f"Generator.add_request: req_id {req_id!r} is already taken (a {state} request)")
        prompt = _token_list(prompt)
        limit = self.vocab_size
        bad = next((t for t in prompt if t < 0 or (limit is not None and t >= limit)), None)
        if bad is not None:
            raise ValueError(f"Generator.add_request: prompt token {bad} is outside the vocabulary "
                             f"[0, {limit if limit is not None else 'vocab_size'})")
        # (numpy's integers and floats are numbers too: taken as Python's)
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, numbers.Integral) or max_new_tokens < 1:
            raise ValueError(f"Generator.add_request: max_new_tokens must be an int >= 1 (got {max_new_tokens!r})")
        if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
            raise ValueError(f"Generator.add_request: temperature must be a number (got {type(temperature).__name__})")
        if not 0 <= temperature < float("inf"):
            raise ValueError(f"Generator.add_request: temperature must be finite and >= 0 (got {temperature!r})")
        if eos_token_id is not None and (isinstance(eos_token_id, bool)
                                         or not isinstance(eos_token_id, numbers.Integral)):
            raise ValueError(f"Generator.add_request: eos_token_id must be an int or None (got {eos_token_id!r})")
        max_new_tokens, temperature = int(max_new_tokens), float(temperature)
        eos_token_id = None if eos_token_id is None else int(eos_token_id)
        if len(prompt) + max_new_tokens > self.max_seq_len:
            raise ValueError(f"Generator.add_request: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                             f"exceeds max_seq_len {self.max_seq_len}")
        req = Request(req_id, prompt, max_new_tokens, temperature, eos_token_id)
        if self._pages(req) > self.cache.num_pages:
            raise ValueError(f"Generator.add_request: prompt ({len(prompt)}) + max_new_tokens ({max_new_tokens}) "
                             f"need {self._pages(req)} pages; the whole cache has {self.cache.num_pages}")
        self.waiting.append(req)
        return req

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _pages(self, req: Request) -> int:
        return -(-(len(req.prompt) + req.max_new_tokens) // self.cache.page_size)

    def _admit(self) -> list[Request]:
        """First come, first served, while there is a batch row and the request's whole page budget is free."""
        admitted = []
        while (self.waiting and len(self.running) + len(admitted) < self.max_batch
               and self._reserved_pages + self._pages(self.waiting[0]) <= self.cache.num_pages):
            req = self.waiting.popleft()
            self._reserved_pages += self._pages(req)
            admitted.append(req)
        return admitted

    def _emit(self, reqs: list[Request], logits: torch.Tensor, new: dict) -> None:
        chosen = sample(logits, [r.temperature for r in reqs], self.generator)
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, chosen[:, None]).squeeze(1)
        # one copy to the host for both (token ids are exact in float64)
        for req, (token, logprob) in zip(reqs, torch.stack([chosen.double(), logprobs.double()], 1).tolist()):
            token = int(token)
            req.output.append(token)
            req.logprobs.append(logprob)
            new.setdefault(req.req_id, []).append(token)
            if len(req.output) >= req.max_new_tokens or token == req.eos_token_id:
                req.finished = True

    def _retire(self) -> None:
        for req_id in [r for r, req in self.running.items() if req.finished]:
            req = self.running.pop(req_id)
            self.cache.free(req_id)
            self._reserved_pages -= self._pages(req)
            self.finished[req_id] = req

    def _prefill_alone_if_failing(self, reqs: list[Request], new: dict) -> None:
        """Prefills `reqs` together; if that fails, takes them back out (their pages freed) and prefills each alone,
        so that only a request whose own prefill fails is dropped (into `failed`, with the reason). A request
        alone that finds the cache out of pages waits at the head of the queue instead while a request beside it
        runs (its pages come back when that one finishes)."""
        try:
            logits = self.prefill(reqs)
        except Exception as e:  # (any error of the model or the cache: the caller reads it in `failed`)
            for req in reqs:
                # only what prefill allocated: an id the cache already held (allocate refused it) is not ours
                if self.running.pop(req.req_id, None) is not None:
                    self.cache.free(req.req_id)
            if len(reqs) > 1:
                for req in reqs:
                    self._prefill_alone_if_failing([req], new)
                return
            req = reqs[0]
            self._reserved_pages -= self._pages(req)
            if isinstance(e, RuntimeError) and "out of pages" in str(e) and self.running:
                # (pages held outside this Generator: it waits, ahead of the queue, for ours to come back)
                self.waiting.insert(self._requeued, req)
                self._requeued += 1
                return
            self.failed[req.req_id] = f"{type(e).__name__}: {e}"
            return
        self._emit(reqs, logits, new)

    def _decode_or_recompute(self, batch: list[Request], new: dict) -> None:
        """One decode step over `batch`; if it fails, each request's pages are dropped and it is recomputed alone
        (prefilled over its prompt and its tokens so far, which gives the same next token), so that only a
        request whose own step fails is dropped."""
        last = torch.tensor([r.output[-1] for r in batch], dtype=torch.int64, device=self.cache.device)
        try:
            logits = self.decode([r.req_id for r in batch], last)
            self._emit(batch, logits, new)
        except Exception:  # (the cache may hold part of the step: every request of it starts over)
            # one at a time, the rest still running: a request short of pages then waits for theirs
            for req in batch:
                del self.running[req.req_id]
                self.cache.free(req.req_id)
                self._prefill_alone_if_failing([req], new)

    @torch.no_grad()
    def prefill(self, reqs: list[Request]) -> torch.Tensor:
        """One extend-form forward over all of `reqs`' tokens (the prompt, and the tokens generated so far of a
        request that starts over); returns each one's last-position logits."""
        ids = [r.req_id for r in reqs]
        seqs = [r.prompt + r.output for r in reqs]
        cached = []  # tokens already in the cache (shared pages), per request
        for r, seq in zip(reqs, seqs):
            self.cache.allocate(r.req_id)
            self.running[r.req_id] = r
            cached.append(self.cache.share_prefix(r.req_id, seq) if self.prefix_sharing else 0)
        lens = [len(seq) - c for seq, c in zip(seqs, cached)]
        meta = self.cache.prepare(ids, lens, decode=False)
        device = self.cache.device
        tokens = torch.tensor([t for seq, c in zip(seqs, cached) for t in seq[c:]], dtype=torch.int64,
                              device=device)
        positions = torch.cat([torch.arange(c, len(seq), device=device) for seq, c in zip(seqs, cached)])
        logits = self.model(tokens, positions, self.cache, meta)
        if self.prefix_sharing:
            for r in reqs:
                self.cache.index_prefix(r.req_id, r.prompt)
        fresh = [(r, c) for r, c in zip(reqs, cached) if not r.output]  # (a recomputed prompt counts once)
        self.stats["prompt_tokens"] += sum(len(r.prompt) for r, _ in fresh)
        self.stats["prefix_tokens_reused"] += sum(c for _, c in fresh)
        return logits[meta.cu_seqlens_q[1:].long() - 1]

    def step(self) -> dict:
        """Admits and prefills queued requests, then decodes one token for every running request; frees the
        pages of those that finished. Returns {req_id: [tokens generated this step]}."""
        new: dict = {}
        self._requeued = 0  # requests of this step sent back to wait, in their order, ahead of the queue
        with invariant_mode() if self.batch_invariant else contextlib.nullcontext():
            admitted = self._admit()
            if admitted:
                # (batch-invariant: each prompt alone, so its prefill's shapes are its own)
                for group in ([r] for r in admitted) if self.batch_invariant else [admitted]:
                    self._prefill_alone_if_failing(group, new)
                self._retire()
            batch = list(self.running.values())
            if batch:
                self._decode_or_recompute(batch, new)
                self.stats["peak_pages_in_use"] = max(self.stats["peak_pages_in_use"], self.cache.pages_in_use)
                self.stats["cascade_steps"] = self.decode.cascade_steps
                self._retire()
        return new

    def run(self) -> dict:
        """Steps until every request has finished; returns {req_id: generated tokens}."""
        while self.has_work():
            self.step()
        return {req_id: req.output for req_id, req in self.finished.items()}
