"""torch.library.opcheck (all its default tests: schema, autograd registration, fake tensor, AOT dispatch) on
both ops over sample inputs spanning modes, dtypes, formats, page sizes and an empty sequence."""
import pytest
import torch

import attnops
from attnops.backends.reference import reshape_and_cache_reference
from attnops.testing import random_paged_inputs

SAMPLES = {
    "decode-fp32-page1": dict(kv_lens=[5, 17, 3], page_size=1),
    "decode-bf16-page16": dict(kv_lens=[40, 1, 70], kv_format="bf16", q_dtype=torch.bfloat16),
    "decode-fp16-page256-gqa4": dict(kv_lens=[300, 20], kv_format="fp16", q_dtype=torch.float16, page_size=256,
                                     num_q_heads=8, num_kv_heads=2),
    "decode-empty-sequence": dict(kv_lens=[0, 33, 0, 2]),
    "verify-4-bf16": dict(kv_lens=[50, 64], q_lens=[4, 4], kv_format="bf16", q_dtype=torch.bfloat16),
    "prefill-fp32-page16": dict(kv_lens=[20, 35], q_lens=[20, 35]),
    "extend-fp16": dict(kv_lens=[90, 40, 0], q_lens=[10, 40, 0], kv_format="fp16", q_dtype=torch.float16),
    "decode-fp8-e4m3-per-tensor": dict(kv_lens=[30, 60], kv_format="fp8_e4m3"),
    "decode-fp8-e5m2-per-head": dict(kv_lens=[30, 60], kv_format="fp8_e5m2", scale_kind="per_head"),
    "verify-fp8-per-head-bf16": dict(kv_lens=[30, 60], q_lens=[3, 8], kv_format="fp8_e4m3",
                                     scale_kind="per_head", q_dtype=torch.bfloat16),
    "decode-nvfp4": dict(kv_lens=[19, 64], kv_format="nvfp4", q_dtype=torch.float16),
    "extend-mxfp4-mqa": dict(kv_lens=[50, 12], q_lens=[7, 12], kv_format="mxfp4", num_q_heads=4, num_kv_heads=1),
    "decode-head-dim-128-page-64": dict(kv_lens=[100, 130], head_dim=128, page_size=64),
}
pytestmark = pytest.mark.usefixtures("fp8_comparable")  # conftest.py: opcheck on fp8 tensors


OPTIONS = {"plain": {}, "window-softcap": dict(window_left=7, soft_cap=5.0, scale=0.2)}


@pytest.mark.parametrize("options", OPTIONS)
@pytest.mark.parametrize("sample", SAMPLES)
def test_opcheck_paged_attention(sample, options):
    args = random_paged_inputs(**SAMPLES[sample], seed=len(sample))
    q, k, v, table, lens, cu = (args.pop(n) for n in ("q", "k_cache", "v_cache", "block_table", "seq_lens",
                                                      "cu_seqlens_q"))
    kwargs = {**args, **OPTIONS[options]}
    torch.library.opcheck(torch.ops.attnops.paged_attention.default, (q, k, v, table, lens, cu), kwargs)
    out = torch.full_like(q, float("nan"))
    torch.library.opcheck(torch.ops.attnops.paged_attention.out, (q, k, v, table, lens, cu), {**kwargs, "out": out})
    # opcheck works on copies: call both overloads once more and check that out= writes what the functional returns
    torch.ops.attnops.paged_attention.out(q, k, v, table, lens, cu, **kwargs, out=out)
    torch.testing.assert_close(out, torch.ops.attnops.paged_attention(q, k, v, table, lens, cu, **kwargs))


CACHE_WRITES = {
    "fp32-page1": dict(kv_format="fp32", page_size=1),
    "bf16-page16": dict(kv_format="bf16", src_dtype=torch.bfloat16),
    "fp16-page256": dict(kv_format="fp16", page_size=256, src_dtype=torch.float16),
    "fp8-e4m3-per-tensor": dict(kv_format="fp8_e4m3"),
    "fp8-e5m2-per-head": dict(kv_format="fp8_e5m2", per_head=True, src_dtype=torch.float16),
    "nvfp4": dict(kv_format="nvfp4"),
    "mxfp4": dict(kv_format="mxfp4", src_dtype=torch.float16),
}


@pytest.mark.parametrize("sample", CACHE_WRITES)
def test_opcheck_reshape_and_cache(sample):
    spec = dict(CACHE_WRITES[sample])
    src_dtype, per_head = spec.pop("src_dtype", torch.float32), spec.pop("per_head", False)
    page_size = spec.pop("page_size", 16)
    scale = torch.tensor([0.5, 0.25]) if per_head else torch.tensor(0.5)
    cache = attnops.PagedKVCache(1, 16, page_size, 2, 64, k_scale=scale, v_scale=scale * 2, shuffle_pages=True,
                                 **spec)
    for seq, n in (("a", 9), ("b", 3)):
        cache.allocate(seq)
    meta = cache.prepare(["a", "b"], [9, 3], decode=False)
    slots = meta.slot_mapping.clone()
    slots[[1, 7]] = -1  # padding slots are skipped
    key = torch.randn(12, 2, 64).to(src_dtype)
    value = torch.randn(12, 2, 64).to(src_dtype)
    before = cache.kv[0].clone()
    kwargs = cache.write_args(0)
    k_cache, v_cache = kwargs.pop("k_cache"), kwargs.pop("v_cache")
    torch.library.opcheck(torch.ops.attnops.reshape_and_cache.default, (key, value, k_cache, v_cache, slots), kwargs)
    # opcheck works on copies: write for real, and check against the reference writing into copies
    expected = {name: t.clone() for name, t in kwargs.items() if isinstance(t, torch.Tensor)}
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    reshape_and_cache_reference(key, value, expected_k, expected_v, slots, kv_format=kwargs["kv_format"],
                                **{n: t for n, t in expected.items()})
    torch.ops.attnops.reshape_and_cache(key, value, k_cache, v_cache, slots, **kwargs)
    assert not torch.equal(before.view(torch.uint8), cache.kv[0].view(torch.uint8))  # real writes happened
    for got, want in [(k_cache, expected_k), (v_cache, expected_v)] + [(kwargs[n], t) for n, t in expected.items()]:
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
