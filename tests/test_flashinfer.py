"""The FlashInfer backend against the float64 reference (GPU only), its declines, and the
plan-once-per-step rule."""
import pytest
import torch

import attnops
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference
from attnops.testing import random_paged_inputs, relative_error

gpu = pytest.mark.gpu


def test_declines_what_it_cannot_serve_with_reasons():
    backend = BACKENDS["flashinfer"]
    for kv_format, scale_kind, expected in (("nvfp4", None, "4-bit"), ("mxfp4", None, "4-bit"),
                                            ("fp8_e4m3", "per_head", "per-head")):
        case = attnops.dispatch.describe_attention(device="cpu", q_dtype=torch.bfloat16, kv_format=kv_format,
                                                   **({"scale_kind": scale_kind} if scale_kind else {}))
        reasons = " ".join(backend.supports(case))
        assert expected in reasons and "cuda" in reasons
    if not torch.cuda.is_available():
        assert "no CUDA GPU" in " ".join(backend.unavailable())


MODES = {"decode": None, "verify": [4, 1, 8, 3], "extend": [9, 1, 0, 30]}


@gpu
@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("heads", [(32, 8), (8, 8)])
@pytest.mark.parametrize("kv_format", ["bf16", "fp16", "fp8_e4m3"])
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(mode, kv_format, heads, page_size):
    if kv_format == "fp16" and mode != "decode":
        pytest.skip("fp16 KV: decode only, to bound FlashInfer's JIT builds (15-100 s each)")
    if BACKENDS["flashinfer"].unavailable():
        pytest.skip("; ".join(BACKENDS["flashinfer"].unavailable()))
    q_dtype = torch.float16 if kv_format == "fp16" else torch.bfloat16
    args = random_paged_inputs([300, 1, 45, 1000] if mode != "decode" else [300, 0, 45, 1000, 1, 17],
                               MODES[mode], num_q_heads=heads[0], num_kv_heads=heads[1], head_dim=128,
                               page_size=page_size, kv_format=kv_format, q_dtype=q_dtype, device="cuda",
                               seed=page_size + heads[0])
    ref = paged_attention_reference(**args, compute_dtype=torch.float64)
    out = torch.full_like(args["q"], float("nan"))
    with attnops.use_backend("flashinfer"):
        attnops.paged_attention(**args, out=out)
    assert not out.isnan().any()
    assert relative_error(out, ref) < 2e-2
    if mode == "decode":  # the empty sequence's row is 0, not garbage
        assert out[1].abs().max() == 0


@pytest.mark.parametrize("window_left", [-1, 40])
def test_decode_page_layout_kernel_equals_the_torch_layout(window_left):
    """The decode layout in one launch (attnops/backends/pages.py: eager decode steps and every replan of a captured
    graph) equals checked_pages + page_metadata wherever FlashInfer reads (indptr, last_page_len, indices[:nnz]),
    sets the same rows, records the same errors; the host's indptr and last_page_len of a graph's replan equal the
    device's. Page sizes 1, 16, 64; lengths 0, bad pages, bad lengths."""
    import os
    from attnops.backends.flashinfer_steps import checked_pages, host_page_metadata, page_metadata
    from attnops.backends.pages import decode_page_layout

    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and not under the Triton interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(0)
    for page_size in (1, 16, 64):
        lens = torch.tensor([0, 1, 17, 64, 300, 0, 129, 5000, -3], dtype=torch.int32)
        width = 300 // page_size + 3
        num_pages = 5000
        table = torch.randperm(num_pages, generator=gen)[: len(lens) * width].view(len(lens), width).to(torch.int32)
        table[2, 0] = -1
        table[4, (300 - 1) // page_size] = num_pages  # the last page of sequence 4
        table[6, 0] = 2 ** 31 - 1  # before a window of 40 at position 128 when pages are small
        table, lens = table.to(device), lens.to(device)
        attnops.take_errors()
        want_lens, want_table, want_nan = checked_pages(table, lens, page_size, num_pages, window_left)
        want = page_metadata(want_table, want_lens, page_size)
        want_errors = attnops.take_errors()
        b = len(lens)
        indptr, indices = torch.empty(b + 1, dtype=torch.int32, device=device), torch.full(
            (table.numel(),), -7, dtype=torch.int32, device=device)
        last, fix = torch.empty(b, dtype=torch.int32, device=device), torch.empty(b, dtype=torch.bool, device=device)
        values = torch.empty(b, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device)
        decode_page_layout(table, lens, page_size, num_pages, window_left, indptr, indices, last, fix, values)
        assert attnops.take_errors() == want_errors and want_errors
        assert torch.equal(indptr, want[0]) and torch.equal(last, want[2])
        assert torch.equal(indices[: want[1].numel()], want[1])
        assert torch.equal(fix, want_nan | (lens == 0)) and torch.equal(values.isnan(), want_nan)
        host_indptr, host_last = host_page_metadata(lens.tolist(), page_size, width * page_size)
        assert torch.equal(host_indptr, indptr.cpu()) and torch.equal(host_last, last.cpu())


@pytest.mark.parametrize("q_lens,window_left", [(None, -1), (None, 20), ([3, 0, 20, 1], -1), ([3, 0, 20, 1], 15)],
                         ids=["decode", "decode-window", "extend", "extend-window"])
def test_checked_pages_follow_the_rules(q_lens, window_left):
    """FlashInfer's page layout made safe on the device (no GPU needed: torch ops only): bad lengths become 0, bad
    pages page 0, and the rows it marks NaN and the errors it records are the reference's."""
    from attnops.backends.flashinfer_steps import checked_pages, page_metadata

    args = random_paged_inputs([130, 0, 300, 37], q_lens, num_q_heads=4, num_kv_heads=2, head_dim=64,
                               page_size=16, seed=3)
    args["block_table"][2, 16] = -1  # keys 256..271 of sequence 2
    args["block_table"][0, 2] = 10 ** 6  # keys 32..47 of sequence 0
    args["seq_lens"][3] = 10 ** 4  # past the table
    num_pages = args["k_cache"].shape[0]
    attnops.take_errors()
    ref = paged_attention_reference(**args, window_left=window_left)
    expected = attnops.take_errors()
    lens, table, nan_rows = checked_pages(args["block_table"], args["seq_lens"], 16, num_pages, window_left,
                                          args["cu_seqlens_q"], args["q"].shape[0])
    assert attnops.take_errors() == expected and expected
    assert torch.equal(nan_rows, ref.isnan().any(-1).any(-1))
    assert lens.tolist()[3] == 0  # (entries past each length are garbage, as before: FlashInfer reads none)
    indptr, indices, last = page_metadata(table, lens, 16)  # what FlashInfer reads: all inside the cache
    assert ((indices >= 0) & (indices < num_pages)).all() and indptr[-1] == indices.numel()


def test_wrapper_kind_sends_long_prefills_to_fa3_only_when_q_and_kv_types_match():
    from attnops.backends.flashinfer import wrapper_kind

    from attnops.cases import AttentionCase

    def kind(decode, batch, num_tokens, arch, kv_format):
        return wrapper_kind(AttentionCase.of_shapes(
            device_type="cuda", arch=arch, q_dtype=torch.bfloat16, kv_format=kv_format, head_dim=128, page_size=16,
            num_q_heads=32, num_kv_heads=8, batch=batch, num_tokens=num_tokens, max_kv_len=8192, decode=decode))

    assert kind(True, 8, 8, (9, 0), "bf16") == "decode"
    assert kind(False, 2, 8, (9, 0), "bf16") == "prefill-fa2"  # a verify block
    assert kind(False, 2, 4096, (9, 0), "bf16") == "prefill-fa3"
    assert kind(False, 2, 4096, (9, 0), "fp8_e4m3") == "prefill-fa2"  # fa3 has no bf16 x e4m3 wgmma
    assert kind(False, 2, 4096, (8, 0), "bf16") == "prefill-fa2"


@gpu
@pytest.mark.parametrize("kv_format", ["bf16", "fp8_e4m3"])
def test_prefill_long_goes_to_fa3_and_matches(kv_format):
    """A long prefill (fa3 on sm_90 for bf16; fa2 for fp8 KV, which fa3 cannot pair with a bf16 q)."""
    if BACKENDS["flashinfer"].unavailable():
        pytest.skip("; ".join(BACKENDS["flashinfer"].unavailable()))
    args = random_paged_inputs([2048, 700], [2048, 600], num_q_heads=32, num_kv_heads=8, head_dim=128,
                               kv_format=kv_format, q_dtype=torch.bfloat16, device="cuda", seed=3)
    with attnops.use_backend("flashinfer"):
        out = attnops.paged_attention(**args)
    assert relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)) < 2e-2


@gpu
def test_plans_once_per_step_and_replans_for_a_new_step(monkeypatch):
    if BACKENDS["flashinfer"].unavailable():
        pytest.skip("; ".join(BACKENDS["flashinfer"].unavailable()))
    from attnops.backends import pages  # a decode plan lays out its pages in one launch of this
    calls = []
    real = pages.decode_page_layout
    monkeypatch.setattr(pages, "decode_page_layout", lambda *a: calls.append(1) or real(*a))
    args = random_paged_inputs([100, 37], num_q_heads=32, num_kv_heads=8, head_dim=128, kv_format="bf16",
                               q_dtype=torch.bfloat16, device="cuda")
    with attnops.use_backend("flashinfer"):
        first = [attnops.paged_attention(**args) for _ in range(4)]  # four layers of one step: one plan
        assert len(calls) == 1
        args["seq_lens"][0] = 50  # written in place: a new step, planned again, and the answer changes
        second = attnops.paged_attention(**args)
    assert len(calls) == 2
    assert relative_error(second, paged_attention_reference(**args, compute_dtype=torch.float64)) < 2e-2
    assert not torch.equal(first[0][0], second[0])


@gpu
@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_replay_serves_the_later_calls_of_a_step_and_matches_reference(mode, monkeypatch):
    """The C++ replay of FlashInfer's kernel call (csrc/cuda/flashinfer_replay.cpp): armed on a step's first call,
    it serves the step's other layers (their own q, caches and out swapped in), never a new step, a new pin, a call
    with other shapes, or a call under ATTNOPS_CHECK=1."""
    from attnops.backends import flashinfer_replay
    if BACKENDS["flashinfer"].unavailable():
        pytest.skip("; ".join(BACKENDS["flashinfer"].unavailable()))
    if not flashinfer_replay.enabled():
        pytest.skip("this build has no C++ CUDA kernel (build with FlashInfer's tvm-ffi installed)")
    lens, q_lens = [300, 45, 1000, 17], (None if mode == "decode" else [4, 1, 8, 3])
    layers = [random_paged_inputs(lens, q_lens, num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                                  kv_format="bf16", q_dtype=torch.bfloat16, device="cuda", seed=seed)
              for seed in range(3)]
    step = {name: layers[0][name] for name in ("block_table", "seq_lens", "cu_seqlens_q")}  # shared by the layers

    def check_layers(expected_hits):
        before = flashinfer_replay.stats()["hits"]
        for i, layer in enumerate(layers + layers):
            args = {**layer, **step}
            out = attnops.paged_attention(**args) if i % 2 else attnops.paged_attention(
                **args, out=torch.full_like(args["q"], float("nan")))
            assert relative_error(out, paged_attention_reference(**args, compute_dtype=torch.float64)) < 2e-2
        assert flashinfer_replay.stats()["hits"] - before == expected_hits
        assert flashinfer_replay.stats()["errors"] == 0

    with attnops.use_backend("flashinfer"):
        check_layers(5)  # the first call plans and arms; the other five (both overloads) replay
        step["seq_lens"].add_(1)  # written in place: a new step, re-planned in Python, then replayed again
        check_layers(5)
        bad_out = torch.empty_like(layers[0]["q"], dtype=torch.float16)
        with pytest.raises(ValueError, match="out must be"):  # another signature: validated in Python
            attnops.paged_attention(**{**layers[0], **step}, out=bad_out)
        monkeypatch.setenv("ATTNOPS_CHECK", "1")  # data checks on: no replay skips them
        check_layers(0)
        monkeypatch.delenv("ATTNOPS_CHECK")
    with attnops.use_backend("triton"):  # a new pin drops every replay: these calls run Triton
        check_layers(0)


def test_step_key_matches_only_the_same_unmodified_tensors():
    """A plan is reused only for the very tensors it was made from, unwritten since: not for a new tensor that
    happens to reuse a freed one's address, nor after an in-place update."""
    from attnops.backends.flashinfer_steps import same_step, step_key

    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    key = step_key(table, lens, None)
    assert same_step(key, table, lens, None)
    assert not same_step(key, table, lens, torch.zeros(3, dtype=torch.int32))
    lens.add_(1)  # written in place: a new step
    assert not same_step(key, table, lens, None)
    key = step_key(table, lens, None)
    address = lens.data_ptr()
    del lens
    new_lens = torch.ones(2, dtype=torch.int32)  # may well land at the freed address, with version 0
    assert not same_step(key, table, new_lens, None), (address == new_lens.data_ptr())
