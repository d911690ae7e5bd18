"""CUDA graphs: a several-layer decode step (cache write + attention) captured once at batch 32 and replayed
for different batches (lengths changed, sequences swapped, padding rows), equal to eager every time."""
import pytest
import torch

import attnops
from attnops.backends import BACKENDS
from attnops.serving.graphs import DecodeGraphRunner

LAYERS, HQ, HKV, D = 3, 16, 4, 128


def make_step(cache, weights):
    def step(token_ids, positions, block_table, seq_lens, slot_mapping):
        x = weights["embed"][token_ids]
        for layer in range(LAYERS):
            k = (x @ weights["wk"][layer]).view(-1, HKV, D)
            v = (x @ weights["wv"][layer]).view(-1, HKV, D)
            q = (x @ weights["wq"][layer]).view(-1, HQ, D)
            torch.ops.attnops.reshape_and_cache(k, v, slot_mapping=slot_mapping, **cache.write_args(layer))
            o = torch.ops.attnops.paged_attention(q, block_table=block_table, seq_lens=seq_lens,
                                                  **cache.attention_args(layer))
            x = x + o.reshape(-1, HQ * D) @ weights["wo"][layer]
        return x
    return step


@pytest.mark.gpu
@pytest.mark.parametrize("backend", [None, "triton", "flashinfer"])
def test_graph_replay_equals_eager(backend):
    if backend and (BACKENDS[backend].unavailable()):
        pytest.skip("; ".join(BACKENDS[backend].unavailable()))
    torch.manual_seed(0)
    dev, dt, hidden = "cuda", torch.bfloat16, HQ * D
    weights = dict(embed=torch.randn(1000, hidden, device=dev, dtype=dt) * 0.1,
                   wq=torch.randn(LAYERS, hidden, HQ * D, device=dev, dtype=dt) * 0.02,
                   wk=torch.randn(LAYERS, hidden, HKV * D, device=dev, dtype=dt) * 0.02,
                   wv=torch.randn(LAYERS, hidden, HKV * D, device=dev, dtype=dt) * 0.02,
                   wo=torch.randn(LAYERS, HQ * D, hidden, device=dev, dtype=dt) * 0.02)
    caches = [attnops.PagedKVCache(LAYERS, 2048, 16, HKV, D, kv_format="bf16", device=dev, shuffle_pages=True)
              for _ in range(2)]  # one for the graph, one for eager: both see the same writes
    for layer in range(LAYERS):  # the same random contents in both (the prompts' keys and values)
        contents = torch.randn_like(caches[0].kv[layer], dtype=torch.float32).to(dt)
        for c in caches:
            c.kv[layer].copy_(contents)
    graph_step, eager_step = make_step(caches[0], weights), make_step(caches[1], weights)
    runner = DecodeGraphRunner(graph_step, caches[0], buckets=(32,), max_pages=64)
    gen = torch.Generator().manual_seed(1)
    live = {}
    with attnops.use_backend(backend):
        for step_index in range(6):
            # requests join (with a random prompt already cached) and leave; batch size changes under 32
            for seq in list(live):
                if torch.rand(1, generator=gen).item() < 0.3:
                    del live[seq]
                    for c in caches:
                        c.free(seq)
            while len(live) < int(torch.randint(5, 31, (1,), generator=gen)):
                seq = f"s{step_index}-{len(live)}"
                length = int(torch.randint(1, 900, (1,), generator=gen))
                live[seq] = length
                for c in caches:
                    c.allocate(seq)
                    c.prepare([seq], length, decode=False)
            seqs = list(live)[::-1] if step_index % 2 else list(live)  # swapped order on odd steps
            metas = [c.prepare(seqs) for c in caches]
            tokens = torch.randint(0, 1000, (len(seqs),), generator=gen).to(dev)
            positions = metas[1].seq_lens.long() - 1
            got = runner(tokens, positions, metas[0]).clone()
            expected = eager_step(tokens, positions, metas[1].block_table, metas[1].seq_lens, metas[1].slot_mapping)
            torch.testing.assert_close(got, expected, rtol=2e-2, atol=2e-2)
            for seq in seqs:
                live[seq] += 1
    assert list(runner.graphs) == [32]
