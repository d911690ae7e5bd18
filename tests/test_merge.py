"""merge_attention_states: the exact softmax merge of two partial attention results, against one softmax over the
union of the keys (float64, CPU), with empty sides; the Triton kernel (interpreter or GPU); validation; opcheck;
torch.compile."""
from __future__ import annotations

import random

import pytest
import torch

import attnops
from attnops.backends.triton.merge_states import merge_states


def partial(q, k, v, keys):
    """Attention of q [T, H, D] over the keys in the index list `keys` (per row), and its natural-log LSE; a row
    with no keys: output 0 (what the kernels write), lse -inf."""
    num_tokens, num_heads, _ = q.shape
    out = torch.zeros_like(q)
    lse = torch.full((num_tokens, num_heads), float("-inf"), dtype=q.dtype)
    for t, idx in enumerate(keys):
        if not idx:
            continue
        s = torch.einsum("hd,khd->hk", q[t], k[idx])
        lse[t] = torch.logsumexp(s, -1)
        out[t] = torch.einsum("hk,khd->hd", torch.softmax(s, -1), v[idx])
    return out, lse


@pytest.mark.parametrize("seed", range(20))
def test_merge_is_exact_against_one_softmax_over_the_union(seed):
    rng = random.Random(seed)
    num_tokens, num_heads, head_dim, num_keys = rng.randint(1, 6), rng.choice([1, 4]), 32, rng.randint(0, 40)
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen, dtype=torch.float64)
    k = torch.randn(max(num_keys, 1), num_heads, head_dim, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(max(num_keys, 1), num_heads, head_dim, generator=gen, dtype=torch.float64)
    split_a, split_b, union = [], [], []
    for _ in range(num_tokens):  # random disjoint splits per row, empty sides included
        keys = list(range(num_keys))
        rng.shuffle(keys)
        cut = rng.choice([0, len(keys), rng.randint(0, len(keys))])
        split_a.append(sorted(keys[:cut]))
        split_b.append(sorted(keys[cut:]))
        union.append(sorted(keys))
    out_a, lse_a = partial(q, k, v, split_a)
    out_b, lse_b = partial(q, k, v, split_b)
    expected, expected_lse = partial(q, k, v, union)
    out, lse = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-12, atol=1e-12)
    # the .out overload, in place into out_a
    a, la = out_a.clone(), lse_a.clone()
    attnops.merge_attention_states(a, la, out_b, lse_b, out=a, lse=la)
    torch.testing.assert_close(a, expected, rtol=1e-12, atol=1e-12)


def test_empty_sides_and_nan():
    out_a = torch.randn(3, 2, 32)
    out_b = torch.randn(3, 2, 32)
    ninf = float("-inf")
    lse_a = torch.tensor([[ninf, 1.0], [ninf, ninf], [float("nan"), 0.0]])
    lse_b = torch.tensor([[2.0, ninf], [ninf, ninf], [0.0, 0.0]])
    out, lse = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out[0, 0], out_b[0, 0])  # an empty side leaves the other unchanged
    torch.testing.assert_close(out[0, 1], out_a[0, 1])
    assert lse[0].tolist() == [2.0, 1.0]
    assert (out[1] == 0).all() and (lse[1] == ninf).all()  # both empty
    assert out[2, 0].isnan().all() and lse[2, 0].isnan()  # a NaN reaches its row only
    torch.testing.assert_close(out[2, 1], (out_a[2, 1] + out_b[2, 1]) / 2)


# (T, H, D): all heads in one program; latent attention's 128 heads of 512 (blocks of 8 heads); head dims that are
# not powers of two (padded and masked)
@pytest.mark.parametrize("shape", [(7, 6, 64), (3, 128, 512), (5, 9, 80), (4, 3, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernel_matches_the_reference(dtype, shape):
    from attnops.backends.reference import merge_attention_states_reference
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter off the GPU
    gen = torch.Generator().manual_seed(0)
    out_a, out_b = (torch.randn(*shape, generator=gen).to(dtype).to(device) for _ in range(2))
    lse_a, lse_b = (torch.randn(*shape[:2], generator=gen).to(device) * 3 for _ in range(2))
    lse_a[0, 0] = lse_b[1, 1] = float("-inf")
    lse_a[2, 2] = lse_b[2, 2] = float("-inf")
    out, lse = torch.full_like(out_a, float("nan")), torch.empty_like(lse_a)
    merge_states(out_a, lse_a, out_b, lse_b, out, lse)
    expected, expected_lse = torch.empty(shape, dtype=torch.float64), torch.empty(shape[:2], dtype=torch.float64)
    merge_attention_states_reference(out_a.cpu().double(), lse_a.cpu().double(), out_b.cpu().double(),
                                     lse_b.cpu().double(), expected, expected_lse)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.cpu().double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.cpu().double(), expected_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_the_op_on_a_gpu_runs_the_kernel_and_captures():
    out_a, out_b = torch.randn(2, 5, 8, 128, device="cuda", dtype=torch.bfloat16)
    lse_a, lse_b = torch.randn(2, 5, 8, device="cuda")
    out, lse = torch.empty_like(out_a), torch.empty_like(lse_a)
    graph = torch.cuda.CUDAGraph()
    attnops.merge_attention_states(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    with torch.cuda.graph(graph):
        attnops.merge_attention_states(out_a, lse_a, out_b, lse_b, out=out, lse=lse)
    lse_b.fill_(float("-inf"))
    graph.replay()
    torch.testing.assert_close(out, out_a)
    torch.testing.assert_close(lse, lse_a)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(out_b=torch.zeros(3, 2, 16)), ValueError, "out_b must be"),
    (dict(lse_a=torch.zeros(3, 2, dtype=torch.float16)), TypeError, "lse_a must be float32"),
    (dict(lse_b=torch.zeros(2, 3)), ValueError, "lse_b must be"),
    (dict(out_a=torch.zeros(3, 2, 24), out_b=torch.zeros(3, 2, 24)), ValueError, "head_dim"),
    (dict(out_a=torch.zeros(3, 2, 32, dtype=torch.int32)), TypeError, "out_a must be"),
])
def test_bad_arguments_are_named(kwargs, error, words):
    args = dict(out_a=torch.zeros(3, 2, 32), lse_a=torch.zeros(3, 2), out_b=torch.zeros(3, 2, 32),
                lse_b=torch.zeros(3, 2))
    args.update(kwargs)
    with pytest.raises(error, match=words):
        attnops.merge_attention_states(**args)


def test_opcheck_and_compile():
    out_a, out_b = torch.randn(2, 4, 3, 64)
    lse_a, lse_b = torch.randn(2, 4, 3)
    lse_b[1, 2] = float("-inf")
    torch.library.opcheck(torch.ops.attnops.merge_attention_states.default, (out_a, lse_a, out_b, lse_b))
    torch.library.opcheck(torch.ops.attnops.merge_attention_states.out, (out_a, lse_a, out_b, lse_b),
                          dict(out=torch.empty_like(out_a), lse=torch.empty_like(lse_a)))

    def f(a, la, b, lb):
        out, lse = torch.ops.attnops.merge_attention_states(a, la, b, lb)
        return out * 2, lse + 1

    compiled = torch.compile(f, fullgraph=True)
    expected = f(out_a, lse_a, out_b, lse_b)
    got = compiled(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(got, expected)
