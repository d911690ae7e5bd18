"""Every bad input is rejected before any kernel runs, with the right exception type and a message naming the
argument. Data-dependent checks run only under ATTNOPS_CHECK=1."""
import pytest
import torch

import attnops
from attnops.testing import random_paged_inputs


def good_attention_args(**overrides):
    args = random_paged_inputs([10, 33], [2, 3], num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16)
    args.update(overrides)
    return args


def fp8_args(**overrides):
    args = random_paged_inputs([10, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, kv_format="fp8_e4m3")
    args.update(overrides)
    return args


def nvfp4_args(**overrides):
    args = random_paged_inputs([10, 33], num_q_heads=4, num_kv_heads=2, head_dim=64, kv_format="nvfp4")
    args.update(overrides)
    return args


def caches(shape, dtype=torch.float32, **kw):
    kv = torch.randn(shape[0], 2, *shape[1:]).to(dtype)
    return dict(k_cache=kv[:, 0], v_cache=kv[:, 1], **kw)


A = good_attention_args()
BAD_ATTENTION = {
    "q int": (TypeError, "q", lambda: good_attention_args(q=A["q"].to(torch.int32))),
    "q rank": (ValueError, "q", lambda: good_attention_args(q=A["q"].flatten(1))),
    "block_table int64": (TypeError, "block_table", lambda: good_attention_args(block_table=A["block_table"].long())),
    "block_table rank": (ValueError, "block_table", lambda: good_attention_args(block_table=A["block_table"][0])),
    "seq_lens float": (TypeError, "seq_lens", lambda: good_attention_args(seq_lens=A["seq_lens"].float())),
    "B mismatch": (ValueError, "seq_lens", lambda: good_attention_args(seq_lens=A["seq_lens"][:1])),
    "cu_seqlens_q length": (ValueError, "cu_seqlens_q", lambda: good_attention_args(
        cu_seqlens_q=A["cu_seqlens_q"][:2])),
    "cu_seqlens_q int64": (TypeError, "cu_seqlens_q", lambda: good_attention_args(
        cu_seqlens_q=A["cu_seqlens_q"].long())),
    "decode T != B": (ValueError, "cu_seqlens_q", lambda: good_attention_args(cu_seqlens_q=None)),
    "heads not a multiple": (ValueError, "num_q_heads", lambda: good_attention_args(q=torch.randn(5, 3, 64))),
    "head_dim mismatch": (ValueError, "head_dim", lambda: good_attention_args(q=torch.randn(5, 4, 32))),
    "no KV heads": (ValueError, "num_kv_heads", lambda: good_attention_args(**caches((8, 16, 0, 64)))),
    "no query heads": (ValueError, "num_q_heads", lambda: good_attention_args(q=torch.randn(5, 0, 64))),
    "unsupported head_dim": (ValueError, "head_dim", lambda: good_attention_args(
        q=torch.randn(5, 4, 72), **caches((8, 16, 2, 72)))),
    "head_dim past 512": (ValueError, "head_dim", lambda: good_attention_args(
        q=torch.randn(5, 4, 528), **caches((8, 16, 2, 528)))),
    "page_size not power of two": (ValueError, "page_size", lambda: good_attention_args(**caches((8, 12, 2, 64)))),
    "page_size too large": (ValueError, "page_size", lambda: good_attention_args(**caches((2, 512, 2, 64)))),
    "caches differ in shape": (ValueError, "v_cache", lambda: good_attention_args(
        v_cache=torch.randn(9, 16, 2, 64))),
    "caches differ in strides": (ValueError, "v_cache", lambda: good_attention_args(
        v_cache=A["v_cache"].contiguous())),
    "caches differ in dtype": (ValueError, "v_cache", lambda: good_attention_args(v_cache=A["v_cache"].double())),
    "cache rank": (ValueError, "k_cache", lambda: good_attention_args(k_cache=A["k_cache"][0],
                                                                      v_cache=A["v_cache"][0])),
    "cache int": (TypeError, "k_cache", lambda: good_attention_args(**caches((8, 16, 2, 64), torch.int32))),
    "unknown kv_format": (ValueError, "kv_format", lambda: good_attention_args(kv_format="int4")),
    "device mismatch": (ValueError, "block_table", lambda: good_attention_args(
        block_table=A["block_table"].to("meta"))),
    "fp8 k_scale missing": (ValueError, "k_scale", lambda: fp8_args(k_scale=None)),
    "fp8 v_scale missing": (ValueError, "v_scale", lambda: fp8_args(v_scale=None)),
    "fp8 scale shape": (ValueError, "k_scale", lambda: fp8_args(k_scale=torch.ones(3))),
    "fp8 scale dtype": (TypeError, "k_scale", lambda: fp8_args(k_scale=torch.ones((), dtype=torch.float16))),
    "scale for a bf16 cache": (ValueError, "k_scale", lambda: good_attention_args(k_scale=torch.ones(()))),
    "nvfp4 scale missing": (ValueError, "k_scale", lambda: nvfp4_args(k_scale=None)),
    "nvfp4 scale shape": (ValueError, "v_scale", lambda: nvfp4_args(v_scale=nvfp4_args()["v_scale"][..., :2])),
    "nvfp4 scale dtype": (TypeError, "k_scale", lambda: nvfp4_args(k_scale=nvfp4_args()["k_scale"].float())),
    "4-bit last dim not D/2": (ValueError, "k_cache", lambda: nvfp4_args(
        **caches((8, 16, 2, 64), torch.uint8), kv_format="nvfp4")),
    "4-bit format on a float cache": (TypeError, "k_cache", lambda: good_attention_args(kv_format="mxfp4")),
    "negative soft_cap": (ValueError, "soft_cap", lambda: good_attention_args(soft_cap=-1.0)),
    "NaN soft_cap": (ValueError, "soft_cap", lambda: good_attention_args(soft_cap=float("nan"))),
    "infinite scale": (ValueError, "scale", lambda: good_attention_args(scale=float("inf"))),
    "NaN scale": (ValueError, "scale", lambda: good_attention_args(scale=float("nan"))),
    "bad window_left": (ValueError, "window_left", lambda: good_attention_args(window_left=-5)),
}


@pytest.mark.parametrize("name", BAD_ATTENTION)
def test_bad_attention_input(name):
    error, argument, make = BAD_ATTENTION[name]
    args = make()
    with pytest.raises(error, match=rf"attnops\.paged_attention: .*\b{argument}\b"):
        torch.ops.attnops.paged_attention(**args)
    # the same error at trace time: the fake validates too
    with pytest.raises(error, match=rf"\b{argument}\b"), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        torch.ops.attnops.paged_attention(**args)


def test_bad_out():
    args = good_attention_args()
    with pytest.raises(ValueError, match=r"\bout\b"):
        attnops.paged_attention(**args, out=torch.empty(1, 4, 64))


def test_outputs_that_overlap_an_input_or_each_other_are_named():
    """An out or lse sharing memory with an input or with each other (or with itself, expanded) was written while
    it was read and gave a wrong answer with no error."""
    args = good_attention_args()
    q = args["q"]
    with pytest.raises(ValueError, match=r"paged_attention: out must not share memory with k_cache"):
        k_cache = args["k_cache"].clone()
        torch.ops.attnops.paged_attention.out(**{**args, "k_cache": k_cache,
                                                 "v_cache": args["v_cache"].clone()},
                                              out=k_cache.view(-1)[:q.numel()].view(q.shape))
    with pytest.raises(ValueError, match=r"out must not share memory with q"):
        torch.ops.attnops.paged_attention.out(**args, out=q)
    with pytest.raises(ValueError, match=r"out must not overlap itself"):
        torch.ops.attnops.paged_attention.out(**args, out=torch.zeros(1, *q.shape[1:]).expand(q.shape))
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match=r"paged_attention_with_lse: out must not share memory with lse"):
        torch.ops.attnops.paged_attention_with_lse.out(**args, out=out, lse=out.view(-1)[:q.shape[0] * q.shape[1]]
                                                       .view(q.shape[:2]))
    with pytest.raises(ValueError, match=r"lse must not share memory with q"):
        lse = q.view(-1)[:q.shape[0] * q.shape[1]].view(q.shape[:2])
        torch.ops.attnops.paged_attention_with_lse.out(**args, out=out, lse=lse)
    lse = torch.empty(q.shape[:2])
    torch.ops.attnops.paged_attention_with_lse.out(**args, out=out, lse=lse)  # apart: fine
    # merge_attention_states: out may be out_a or out_b itself (elementwise), never a part of another
    out_a, out_b, lse_a, lse_b = out.clone(), torch.randn_like(out), lse.clone(), torch.randn_like(lse)
    want = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b)
    got = attnops.merge_attention_states(out_a, lse_a, out_b, lse_b, out=out_a, lse=lse_b)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    with pytest.raises(ValueError, match=r"merge_attention_states: out must not share memory with lse"):
        merged = torch.empty_like(out)
        attnops.merge_attention_states(out_a, lse_a, out_b, lse_b, out=merged,
                                       lse=merged.view(-1)[:lse.numel()].view(lse.shape))
    storage = torch.randn(out.numel() + 1)
    shifted_b, out_b = storage[1:].view(out.shape), storage[:-1].view(out.shape)  # one element apart
    with pytest.raises(ValueError, match=r"merge_attention_states: out must not share memory with out_b"):
        attnops.merge_attention_states(out_a, lse_a, out_b, lse_b, out=shifted_b, lse=torch.empty_like(lse))


@pytest.mark.parametrize("change,argument", [
    (dict(kv_format=None), "kv_format"), (dict(soft_cap=None), "soft_cap"), (dict(window_left=2.0), "window_left"),
    (dict(scale="0.1"), "scale"), (dict(block_table=[[0, 1]]), "block_table"), (dict(tree_mask=[[True]]), "tree_mask"),
    (dict(q=[[0.0]]), "q")])
def test_the_wrappers_name_an_argument_of_the_wrong_type(change, argument):
    """(the dispatcher's schema mismatch is a RuntimeError)"""
    with pytest.raises(TypeError, match=rf"attnops\.paged_attention: {argument} must be"):
        attnops.paged_attention(**good_attention_args(**change))
    with pytest.raises(TypeError, match=r"attnops\.merge_attention_states: out_a must be a Tensor"):
        attnops.merge_attention_states([1.0], torch.zeros(1, 1), torch.zeros(1, 1, 16), torch.zeros(1, 1))


def good_write_args(kv_format="fp32", **overrides):
    cache = attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format=kv_format)
    args = dict(key=torch.randn(6, 2, 64), value=torch.randn(6, 2, 64), slot_mapping=torch.arange(6),
                **cache.write_args(0))
    args.update(overrides)
    return args


BAD_WRITES = {
    "key int": (TypeError, "key", lambda: good_write_args(key=torch.ones(6, 2, 64, dtype=torch.int32))),
    "value shape": (ValueError, "value", lambda: good_write_args(value=torch.randn(6, 2, 32))),
    "key heads": (ValueError, "key", lambda: good_write_args(key=torch.randn(6, 4, 64), value=torch.randn(6, 4, 64))),
    "slot_mapping int32": (TypeError, "slot_mapping", lambda: good_write_args(
        slot_mapping=torch.arange(6, dtype=torch.int32))),
    "slot_mapping length": (ValueError, "slot_mapping", lambda: good_write_args(slot_mapping=torch.arange(5))),
    "fp8 scale missing": (ValueError, "k_scale", lambda: good_write_args("fp8_e4m3", k_scale=None)),
    "fp8 given block scales": (ValueError, "k_block_scale", lambda: good_write_args(
        "fp8_e4m3", k_block_scale=torch.ones(4, 16, 2, 4))),
    "nvfp4 block scale missing": (ValueError, "v_block_scale", lambda: good_write_args("nvfp4", v_block_scale=None)),
    "mxfp4 block scale shape": (ValueError, "k_block_scale", lambda: good_write_args(
        "mxfp4", k_block_scale=torch.zeros(4, 16, 2, 4, dtype=torch.uint8))),
    "caches differ": (ValueError, "v_cache", lambda: good_write_args(v_cache=torch.randn(4, 16, 2, 64))),
    "no KV heads": (ValueError, "num_kv_heads", lambda: good_write_args(  # was a SIGFPE in the C++ kernel
        key=torch.randn(6, 0, 64), value=torch.randn(6, 0, 64), **caches((4, 16, 0, 64)))),
}


@pytest.mark.parametrize("name", BAD_WRITES)
def test_bad_cache_write(name):
    error, argument, make = BAD_WRITES[name]
    args = make()
    before = args["k_cache"].clone()
    with pytest.raises(error, match=rf"attnops\.reshape_and_cache: .*\b{argument}\b"):
        torch.ops.attnops.reshape_and_cache(**args)
    assert torch.equal(before.view(torch.uint8), args["k_cache"].view(torch.uint8))  # nothing written


VALUE_CHECKS = {
    "page index out of range": ("block_table", lambda a: a["block_table"].__setitem__((0, 0), 10_000)),
    "seq_len above capacity": ("seq_lens", lambda a: a["seq_lens"].__setitem__(1, 10_000)),
    "cu_seqlens_q decreasing": ("cu_seqlens_q", lambda a: a["cu_seqlens_q"].copy_(torch.tensor([0, 4, 3]))),
    "more queries than keys": ("seq_lens", lambda a: a["seq_lens"].__setitem__(0, 1)),
}


@pytest.mark.parametrize("name", VALUE_CHECKS)
def test_value_checks_only_under_attnops_check(name, monkeypatch):
    argument, corrupt = VALUE_CHECKS[name]
    args = good_attention_args()
    corrupt(args)
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match=rf"attnops\.paged_attention: .*\b{argument}\b"):
        torch.ops.attnops.paged_attention(**args)


def test_value_checks_are_off_by_default_and_read_no_data():
    """Without ATTNOPS_CHECK the op never syncs the host for validation: the checks see meta tensors fine."""
    args = {k: (v.to("meta") if isinstance(v, torch.Tensor) else v) for k, v in good_attention_args().items()}
    case = attnops.explain(**args).case
    assert case.device_type == "meta" and not case.decode


def test_slot_mapping_range_checked_under_attnops_check(monkeypatch):
    args = good_write_args(slot_mapping=torch.tensor([0, 1, 2, 3, 4, 64]))
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match="slot_mapping"):
        torch.ops.attnops.reshape_and_cache(**args)


def test_soft_cap_inf_means_no_cap():
    args = good_attention_args()
    torch.testing.assert_close(torch.ops.attnops.paged_attention(**args, soft_cap=float("inf")),
                               torch.ops.attnops.paged_attention(**args))
    assert not attnops.explain(**args, soft_cap=float("inf")).case.soft_cap


def test_python_float_scales_get_a_message_that_says_to_pass_a_tensor():
    args = fp8_args()
    with pytest.raises(TypeError, match=r"attnops\.paged_attention: k_scale must be a tensor .*torch\.tensor"):
        attnops.paged_attention(**{**args, "k_scale": 0.5})
    write = good_write_args("fp8_e4m3")
    with pytest.raises(TypeError, match=r"attnops\.reshape_and_cache: v_scale must be a tensor"):
        attnops.reshape_and_cache(**{**write, "v_scale": 1.0})


@pytest.mark.parametrize("bad", [0.0, -1.0, float("inf"), float("nan")])
def test_fp8_scales_must_be_finite_and_positive_under_attnops_check(bad, monkeypatch):
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    args = fp8_args(k_scale=torch.tensor(bad))
    with pytest.raises(ValueError, match=r"attnops\.paged_attention: k_scale must be finite and > 0"):
        torch.ops.attnops.paged_attention(**args)
    write = good_write_args("fp8_e4m3", v_scale=torch.tensor(bad))
    with pytest.raises(ValueError, match=r"attnops\.reshape_and_cache: v_scale must be finite and > 0"):
        torch.ops.attnops.reshape_and_cache(**write)


def test_slots_below_minus_one_are_bad_indices_not_padding(monkeypatch):
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match="slot_mapping"):
        torch.ops.attnops.reshape_and_cache(**good_write_args(slot_mapping=torch.tensor([0, 1, -2, 3, 4, 5])))


@pytest.mark.parametrize("backend", ["reference", "cpu", "triton"])
def test_bad_slots_write_nothing_and_are_recorded(backend):
    """Without ATTNOPS_CHECK: a slot below -1 or past the cache writes nothing for its token, the others are
    written, and take_errors names slot_mapping at the first bad token, then is empty."""
    import os
    if backend == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    device = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"
    cache = attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="fp32", device=device)
    key = torch.randn(6, 2, 64, device=device)
    slots = torch.tensor([3, -2, 7, 64, -1, 9], device=device)
    attnops.take_errors()
    before = cache.kv[0].clone()
    with attnops.use_backend(backend):
        attnops.reshape_and_cache(key, -key, slot_mapping=slots, **cache.write_args(0))
    expected = before.clone()
    for t in (0, 2, 5):
        slot = slots[t].item()
        expected[slot // 16, 0, slot % 16], expected[slot // 16, 1, slot % 16] = key[t], -key[t]
    assert torch.equal(cache.kv[0], expected)
    assert attnops.take_errors() == {"slot_mapping": 1}
    assert attnops.take_errors() == {}


def test_take_errors_names_each_argument_at_its_first_position():
    args = good_attention_args()
    attnops.take_errors()
    args["block_table"][1, 0] = -3
    torch.ops.attnops.paged_attention(**args)
    args["block_table"][1, 0] = 0
    args["seq_lens"][0] = 10_000
    out = torch.ops.attnops.paged_attention(**args)  # records pile up until taken
    assert out[:2].isnan().all() and not out[2:].isnan().any()  # sequence 0: query rows 0 and 1
    assert attnops.take_errors() == {"block_table": 1, "seq_lens": 0}
    args["cu_seqlens_q"][1] = 99
    assert torch.ops.attnops.paged_attention(**args).isnan().all()
    assert attnops.take_errors(args["q"].device) == {"cu_seqlens_q": 1} and attnops.take_errors() == {}
