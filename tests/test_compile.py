"""torch.compile(fullgraph=True) of a two-layer decode step (cache write + paged attention + linear layers) on the
CPU: no graph break, output equal to eager, no recompilation for new seq_lens / block_table values, and the cache
written in place by the compiled code (never a clone of the whole cache)."""
import torch
import torch._dynamo
import torch._dynamo.testing
from torch._inductor.utils import run_and_get_code

import attnops

NUM_LAYERS, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 32
HIDDEN = HEADS * HEAD_DIM


class DecodeStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM)
                                       for _ in range(NUM_LAYERS))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(NUM_LAYERS))

    def forward(self, x, caches, block_table, seq_lens, slot_mapping):
        for layer in range(NUM_LAYERS):
            k_cache, v_cache = caches[layer]
            q, k, v = self.qkv[layer](x).split([HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM], -1)
            torch.ops.attnops.reshape_and_cache(k.reshape(-1, KV_HEADS, HEAD_DIM), v.reshape(-1, KV_HEADS, HEAD_DIM),
                                                k_cache, v_cache, slot_mapping)
            o = torch.ops.attnops.paged_attention(q.reshape(-1, HEADS, HEAD_DIM), k_cache, v_cache, block_table,
                                                  seq_lens)
            x = x + self.proj[layer](o.reshape(-1, HIDDEN))
        return x


def make_cache(seed):
    torch.manual_seed(seed)
    cache = attnops.PagedKVCache(NUM_LAYERS, 64, 16, KV_HEADS, HEAD_DIM, kv_format="fp32", shuffle_pages=True,
                                 seed=seed)
    for layer in range(NUM_LAYERS):
        cache.kv[layer].normal_()
    return cache


def step_inputs(cache, seq_ids, prompt_lens):
    for s, n in zip(seq_ids, prompt_lens):
        cache.allocate(s)
        cache.prepare([s], n, decode=False)  # the prompt's slots (filled with random values above)
    meta = cache.prepare(seq_ids, 1, max_pages=8)
    caches = [(cache.kv[layer][:, 0], cache.kv[layer][:, 1]) for layer in range(NUM_LAYERS)]
    return torch.randn(len(seq_ids), HIDDEN), caches, meta.block_table, meta.seq_lens, meta.slot_mapping


@torch.no_grad()
def test_compiled_decode_step_no_graph_break_no_recompile():
    torch._dynamo.reset()
    model = DecodeStep()
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    torch._dynamo.utils.counters.clear()
    for step, lens in enumerate([[5, 40, 17], [90, 3, 64]]):  # new lengths and pages, same batch size
        eager_cache, compiled_cache = make_cache(step), make_cache(step)
        eager_inputs = step_inputs(eager_cache, ["a", "b", "c"], lens)
        compiled_inputs = step_inputs(compiled_cache, ["a", "b", "c"], lens)
        compiled_inputs = (eager_inputs[0],) + compiled_inputs[1:]
        expected = model(*eager_inputs)
        got = compiled(*compiled_inputs)
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        for layer in range(NUM_LAYERS):  # the compiled step wrote the same cache entries
            torch.testing.assert_close(compiled_cache.kv[layer], eager_cache.kv[layer], rtol=1e-6, atol=1e-6)
    assert counter.frame_count == 1, "a second step with new seq_lens/block_table values recompiled"
    assert not torch._dynamo.utils.counters["graph_break"], dict(torch._dynamo.utils.counters["graph_break"])


@torch.no_grad()
def test_compiled_cache_write_is_in_place():
    """Inductor must call reshape_and_cache on the cache itself: a functionalized clone + copy_ of the cache would
    cost a copy of a multi-GB pool every layer of every step."""
    torch._dynamo.reset()
    model = DecodeStep()
    cache = make_cache(0)
    inputs = step_inputs(cache, ["a", "b"], [7, 30])
    compiled = torch.compile(model, fullgraph=True)
    _, (code, *_) = run_and_get_code(compiled, *inputs)
    calls = [line for line in code.splitlines() if "torch.ops.attnops.reshape_and_cache.default(" in line]
    assert len(calls) == NUM_LAYERS, code
    for call in calls:  # the caches passed are views of the graph inputs themselves, not of a copy
        k_arg, v_arg = call.split("reinterpret_tensor(")[3:5]
        assert k_arg.startswith("arg") and v_arg.startswith("arg"), call
    assert "clone" not in code and "copy_" not in code, code
    allocations = [line for line in code.splitlines() if "= empty_strided" in line]
    for shape in (tuple(cache.kv[0].shape), tuple(cache.kv[0][:, 0].shape)):
        assert not any(f"{shape}" in line for line in allocations), "the compiled code allocates a cache-sized buffer"
