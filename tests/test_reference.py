"""The reference backend (the oracle of every other test) against dense scaled_dot_product_attention on pages
gathered and dequantized independently here, on 200 seeded random ragged cases."""
import logging
import random

import pytest
import torch
import torch.nn.functional as F

import attnops
from attnops.backends.reference import paged_attention_reference
from attnops.testing import random_paged_inputs, relative_error

log = logging.getLogger(__name__)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


def dense_sequence(cache, scale, table_row, length, kv_format):
    """Token t of the sequence is at page table_row[t // P], offset t % P; dequantized here, in float64, without
    attnops.formats, so that the comparison checks the reference's paging and its format code both."""
    page_size = cache.shape[1]
    positions = torch.arange(length)
    pages = table_row[positions // page_size].long()
    stored = cache[pages, positions % page_size]  # [L, Hkv, D or D/2]
    if kv_format in ("nvfp4", "mxfp4"):
        block = 16 if kv_format == "nvfp4" else 32
        nibbles = torch.stack((stored & 15, stored >> 4), -1).flatten(-2).long()
        values = torch.tensor(E2M1, dtype=torch.float64)[nibbles]
        s = scale[pages, positions % page_size].double()
        s = s if kv_format == "nvfp4" else 2.0 ** (s - 127)
        return values * s.repeat_interleave(block, -1)
    values = stored.double()
    if scale is not None:
        values = values * (scale.double() if scale.numel() > 1 else scale.double().reshape(())).reshape(-1, 1)
    return values


def dense_attention(args, scale=None, window_left=-1):
    q, seq_lens, cu = args["q"], args["seq_lens"].tolist(), args["cu_seqlens_q"]
    fmt = args["kv_format"] if args["kv_format"] != "auto" else {
        torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8"}.get(args["k_cache"].dtype, "plain")
    starts = list(range(len(seq_lens) + 1)) if cu is None else cu.tolist()
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b, length in enumerate(seq_lens):
        n = starts[b + 1] - starts[b]
        if n == 0 or length == 0:
            continue
        row = args["block_table"][b]
        k = dense_sequence(args["k_cache"], args.get("k_scale"), row, length, fmt)
        v = dense_sequence(args["v_cache"], args.get("v_scale"), row, length, fmt)
        query = q[starts[b]:starts[b + 1]].double().transpose(0, 1)  # [Hq, n, D]
        qpos = torch.arange(length - n, length)[:, None]
        kpos = torch.arange(length)[None, :]
        mask = kpos <= qpos
        if window_left >= 0:
            mask &= qpos - kpos <= window_left
        o = F.scaled_dot_product_attention(query, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                           scale=scale, enable_gqa=True)
        out[starts[b]:starts[b + 1]] = o.transpose(0, 1)
    return out


def random_case(rng: random.Random):
    num_kv_heads = rng.choice([1, 2, 4])
    mode = rng.choice(["decode", "verify", "prefill", "extend"])
    batch = rng.randint(1, 5)
    kv_lens, q_lens = [], []
    for _ in range(batch):
        length = rng.choice([0, 1, rng.randint(1, 40), rng.randint(40, 300)])
        if mode == "decode":
            length = max(length, 0)
            q_len = 1 if length > 0 else 0
        elif mode == "verify":
            length = max(length, 16)
            q_len = rng.randint(2, 16)
        elif mode == "prefill":
            q_len = length
        else:
            q_len = rng.randint(0, length)
        kv_lens.append(length)
        q_lens.append(q_len)
    if mode == "decode":  # decode is one query token per sequence; an empty sequence still has its row
        q_lens = None
    return dict(
        kv_lens=kv_lens, q_lens=q_lens, num_kv_heads=num_kv_heads,
        num_q_heads=num_kv_heads * rng.choice([1, 2, 4]), head_dim=rng.choice([32, 64, 128]),
        page_size=rng.choice([1, 2, 16, 64, 256]),
        kv_format=rng.choice(["fp32", "fp16", "bf16", "fp8_e4m3", "fp8_e5m2", "nvfp4", "mxfp4"]),
        q_dtype=rng.choice([torch.float32, torch.float16]), scale_kind=rng.choice(["per_tensor", "per_head"]),
        seed=rng.randint(0, 2**31)), dict(window_left=rng.choice([-1, -1, 0, rng.randint(1, 64)]),
                                          scale=rng.choice([None, 0.1]))


@pytest.mark.parametrize("case_index", range(200))
def test_reference_matches_dense_sdpa(case_index):
    shape, options = random_case(random.Random(1000 + case_index))
    args = random_paged_inputs(**shape)
    log.info("case %d: %s %s", case_index, shape, options)
    out = paged_attention_reference(**args, **options, compute_dtype=torch.float64)
    ref = dense_attention(args, **options)
    assert out.dtype == args["q"].dtype
    assert torch.isfinite(out).all()
    # the reference computes in float64 and rounds once to q's dtype: the gap is that rounding alone
    if ref.count_nonzero() == 0:  # only empty sequences (or no query rows): every row must be exactly 0
        assert torch.equal(out.double(), ref)
        return
    tolerance = torch.finfo(args["q"].dtype).eps
    err = relative_error(out, ref)
    log.info("case %d: relative error %.3g", case_index, err)
    assert err <= tolerance, f"case {case_index} {shape} {options}: relative error {err}"


def test_soft_cap_matches_dense_formula():
    args = random_paged_inputs([37, 5, 130], [3, 5, 1], num_q_heads=4, num_kv_heads=2, seed=7)
    cap, scale = 2.0, 0.3
    out = paged_attention_reference(**args, scale=scale, soft_cap=cap, compute_dtype=torch.float64)
    starts = args["cu_seqlens_q"].tolist()
    for b, length in enumerate(args["seq_lens"].tolist()):
        k = dense_sequence(args["k_cache"], None, args["block_table"][b], length, "plain").repeat_interleave(2, 1)
        v = dense_sequence(args["v_cache"], None, args["block_table"][b], length, "plain").repeat_interleave(2, 1)
        for i, row in enumerate(range(starts[b], starts[b + 1])):
            position = length - (starts[b + 1] - starts[b]) + i
            s = torch.einsum("hd,khd->hk", args["q"][row].double(), k[: position + 1]) * scale
            p = torch.softmax(cap * torch.tanh(s / cap), -1)
            expected = torch.einsum("hk,khd->hd", p, v[: position + 1])
            torch.testing.assert_close(out[row].double(), expected, rtol=1e-6, atol=1e-6)


def test_empty_sequence_rows_are_zero_not_nan():
    args = random_paged_inputs([0, 9, 0], num_q_heads=2, num_kv_heads=2)
    out = paged_attention_reference(**args)
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[1].abs().sum() > 0


def test_reference_drops_bad_slots_whole_and_records_them():
    """A slot below -1 or past the cache writes nothing for its token (K and V never disagree), the other tokens
    are written, and the error buffer names slot_mapping at the first bad token."""
    from attnops.backends.reference import reshape_and_cache_reference
    cache = attnops.PagedKVCache(1, 4, 16, 2, 64, kv_format="fp32")
    k_cache, v_cache = cache.write_args(0)["k_cache"], cache.write_args(0)["v_cache"]
    key = torch.randn(3, 2, 64)
    attnops.take_errors()
    for slots, bad_token in (([0, 1, 64], 2), ([5, -2, 1], 1)):
        before = cache.kv[0].clone()
        reshape_and_cache_reference(key, -key, k_cache, v_cache, torch.tensor(slots))
        expected = before.clone()
        for t, slot in enumerate(slots):
            if t != bad_token:
                expected[slot // 16, 0, slot % 16], expected[slot // 16, 1, slot % 16] = key[t], -key[t]
        assert torch.equal(cache.kv[0], expected)
        assert attnops.take_errors() == {"slot_mapping": bad_token}


def test_reference_pages_outside_the_cache_make_the_rows_that_see_them_nan():
    args = random_paged_inputs([40, 7], [3, 2], page_size=16)
    attnops.take_errors()
    args["block_table"][0, 1] = -1  # keys 16..31 of sequence 0, which its 3 queries (positions 37..39) see
    out = paged_attention_reference(**args)
    assert out.isnan().all(-1).all(-1).tolist() == [True, True, True, False, False]
    assert attnops.take_errors() == {"block_table": 0}
    out = paged_attention_reference(**args, window_left=5)  # the window starts at key 32: the page is not seen
    assert not out.isnan().any() and attnops.take_errors() == {}


def test_nan_reaches_exactly_the_rows_that_read_it():
    """NaN in q, K or V propagates to the rows that read it and to no other (as SDPA does); an empty row is 0."""
    args = random_paged_inputs([40, 33, 0], [3, 2, 0], num_q_heads=4, num_kv_heads=2, head_dim=64, seed=1)
    page = args["block_table"][0, 39 // 16].item()
    v_nan = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    v_nan["v_cache"][page, 39 % 16, 0, 5] = float("nan")  # key 39 of sequence 0, KV head 0: only query 39 sees it
    assert paged_attention_reference(**v_nan).isnan().any(-1).nonzero().tolist() == [[2, 0], [2, 1]]
    k_nan = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    k_nan["k_cache"][page, 39 % 16, 1, 0] = float("nan")  # K of KV head 1: heads 2 and 3 of query 39
    assert paged_attention_reference(**k_nan).isnan().any(-1).nonzero().tolist() == [[2, 2], [2, 3]]
    q_nan = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
    q_nan["q"][4, 1, 0] = float("nan")
    assert paged_attention_reference(**q_nan).isnan().any(-1).nonzero().tolist() == [[4, 1]]
