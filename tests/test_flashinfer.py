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


def test_graph_page_metadata_equals_page_metadata_without_a_sync():
    """The replan of a captured graph builds FlashInfer's CSR layout from host lengths plus a device scatter; it
    must equal the eager (syncing) construction wherever FlashInfer reads: indptr, last_page_len, indices[:nnz]."""
    from attnops.backends.flashinfer import graph_page_metadata, page_metadata

    gen = torch.Generator().manual_seed(0)
    for page_size in (1, 16, 64):
        lens = torch.tensor([0, 1, 17, 64, 300, 0, 129], dtype=torch.int32)
        width = int((lens.max() + page_size - 1) // page_size) + 2
        table = torch.randperm(5000, generator=gen)[: len(lens) * width].view(len(lens), width).to(torch.int32)
        pages = (lens + page_size - 1) // page_size
        table[torch.arange(width)[None, :] >= pages[:, None]] = -1
        indptr, indices, last = page_metadata(table, lens, page_size)
        out = torch.full((table.numel() + 1,), -7, dtype=torch.int32)
        g_indptr, g_indices, g_last = graph_page_metadata(lens.tolist(), table, lens, page_size, out)
        assert torch.equal(g_indptr, indptr) and torch.equal(g_last, last)
        assert torch.equal(g_indices[: indices.shape[0]], indices) and g_indices.shape[0] == table.numel()


def test_wrapper_kind_sends_long_prefills_to_fa3_only_when_q_and_kv_types_match():
    from attnops.backends.flashinfer import wrapper_kind

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    assert wrapper_kind(True, 8, 8, (9, 0), bf16, bf16) == "decode"
    assert wrapper_kind(False, 2, 8, (9, 0), bf16, bf16) == "prefill-fa2"  # a verify block
    assert wrapper_kind(False, 2, 4096, (9, 0), bf16, bf16) == "prefill-fa3"
    assert wrapper_kind(False, 2, 4096, (9, 0), bf16, fp8) == "prefill-fa2"  # fa3 has no bf16 x e4m3 wgmma
    assert wrapper_kind(False, 2, 4096, (8, 0), bf16, bf16) == "prefill-fa2"


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
    from attnops.backends import flashinfer as fi_backend
    calls = []
    real = fi_backend.page_metadata
    monkeypatch.setattr(fi_backend, "page_metadata", lambda *a: calls.append(1) or real(*a))
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
    from attnops.backends.flashinfer import _same_step, _step_key

    table, lens = torch.zeros(2, 3, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    key = _step_key(table, lens, None)
    assert _same_step(key, table, lens, None)
    assert not _same_step(key, table, lens, torch.zeros(3, dtype=torch.int32))
    lens.add_(1)  # written in place: a new step
    assert not _same_step(key, table, lens, None)
    key = _step_key(table, lens, None)
    address = lens.data_ptr()
    del lens
    new_lens = torch.ones(2, dtype=torch.int32)  # may well land at the freed address, with version 0
    assert not _same_step(key, table, new_lens, None), (address == new_lens.data_ptr())
