"""The op under captures it does not drive: a plain `torch.cuda.graph` and `torch.compile(mode="reduce-overhead")`
(cudagraph trees), each replayed with new lengths (0 among them), re-drawn block tables and new queries written
into the same tensors, as a serving loop does. Every replay equals the float64 reference, under auto dispatch
and under each pinned backend; a pinned backend whose replay would be stale (it plans on the host) is an error
at capture time that names the way that works. Where FlashInfer serves eagerly, today's main replayed its
capture-time plan and returned garbage (relative error ~1)."""
import pytest
import torch

import attnops
from attnops.backends import BACKENDS
from attnops.backends.reference import paged_attention_reference
from attnops.testing import random_paged_inputs, relative_error

HEADS = [(32, 8, 64), (32, 8, 128), (32, 32, 128), (64, 8, 128)]
FORMATS = ["bf16", "fp8_e4m3", "nvfp4", "mxfp4"]
BACKEND_CHOICES = [None, "triton", "flashinfer"]
REPLAYS = 6
TOLERANCE = 2e-2


def _inputs(heads, kv_format):
    hq, hkv, d = heads
    # 40 pages of 16 per row: room for lengths up to 640; 400 pages in the cache to re-draw tables from
    args = random_paged_inputs([333, 17, 600, 64], num_q_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=16,
                               kv_format=kv_format, q_dtype=torch.bfloat16, device="cuda", spare_pages=300,
                               table_padding=0, seed=hq * d)
    width = 40
    table = torch.full((4, width), -1, dtype=torch.int32, device="cuda")
    table[:, : args["block_table"].shape[1]] = args["block_table"]
    args["block_table"] = table
    return args


def _redraw(args, gen, replay):
    """New lengths (one 0 on every replay, in turn), new tables over the whole cache, new queries: written into
    the tensors the graph holds."""
    num_pages = args["k_cache"].shape[0]
    lengths = torch.randint(1, 641, (4,), generator=gen)
    lengths[replay % 4] = 0
    pages = torch.randperm(num_pages, generator=gen)[: 4 * 40].view(4, 40).to(torch.int32)
    args["seq_lens"].copy_(lengths)
    args["block_table"].copy_(pages)
    args["q"].copy_(torch.randn(args["q"].shape, generator=gen).to(torch.bfloat16))


def _expected(args):
    return paged_attention_reference(**args, compute_dtype=torch.float64).double()


def _compiled_reduce_overhead(args):
    """paged_attention of `args` under torch.compile(mode="reduce-overhead"), taking q, the table and the lengths
    (what a step changes) as inputs; the rest fixed."""
    static = {k: v for k, v in args.items() if k not in ("q", "block_table", "seq_lens")}

    def attend(q, block_table, seq_lens):
        return torch.ops.attnops.paged_attention(q, block_table=block_table, seq_lens=seq_lens, **static) * 1.0

    torch._dynamo.reset()
    return torch.compile(attend, mode="reduce-overhead", fullgraph=True)


def _skip_unservable(backend, args):
    if backend is None:
        return
    explanation = attnops.explain(**args, capture_state="none")
    if backend in explanation.rejected or explanation.chosen is None:
        pytest.skip(f"{backend} does not serve this case even eagerly: {explanation.rejected.get(backend)}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKEND_CHOICES)
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "-".join(map(str, h)))
def test_plain_cuda_graph_replays_right_or_refuses_at_capture(heads, kv_format, backend):
    args = _inputs(heads, kv_format)
    out = torch.empty_like(args["q"])
    gen = torch.Generator().manual_seed(7)
    with attnops.use_backend(backend):
        _skip_unservable(backend, args)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the user's warm-up: eager, so auto may choose a host-planned backend here
            torch.ops.attnops.paged_attention.out(**args, out=out)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        if backend is not None and BACKENDS[backend].plans_on_host:
            with pytest.raises(ValueError, match="(?s)cannot serve.*nobody re-plans.*DecodeGraphRunner"):
                with torch.cuda.graph(graph):
                    torch.ops.attnops.paged_attention.out(**args, out=out)
            return
        with torch.cuda.graph(graph):
            torch.ops.attnops.paged_attention.out(**args, out=out)
    for replay in range(REPLAYS):
        _redraw(args, gen, replay)
        graph.replay()
        torch.cuda.synchronize()
        err = relative_error(out, _expected(args))
        assert err < TOLERANCE, f"replay {replay}: relative error {err:.3g}"
        assert out[replay % 4].abs().max().item() == 0  # the empty sequence's row


@pytest.mark.gpu
@pytest.mark.parametrize("backend", BACKEND_CHOICES)
@pytest.mark.parametrize("kv_format", FORMATS)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "-".join(map(str, h)))
def test_compile_reduce_overhead_replays_right_or_refuses(heads, kv_format, backend):
    args = _inputs(heads, kv_format)
    compiled = _compiled_reduce_overhead(args)
    gen = torch.Generator().manual_seed(11)
    with attnops.use_backend(backend):
        _skip_unservable(backend, args)
        if backend is not None and BACKENDS[backend].plans_on_host:
            with pytest.raises(Exception, match="(?s)cannot serve.*nobody re-plans.*DecodeGraphRunner"):
                for _ in range(3):
                    compiled(args["q"], args["block_table"], args["seq_lens"])
            return
        for replay in range(REPLAYS + 2):  # the first calls warm up and record, the rest replay
            _redraw(args, gen, replay)
            out = compiled(args["q"].clone(), args["block_table"].clone(), args["seq_lens"].clone())
            torch.cuda.synchronize()
            err = relative_error(out, _expected(args))
            assert err < TOLERANCE, f"call {replay}: relative error {err:.3g}"


@pytest.mark.gpu
def test_the_error_buffer_made_in_a_cudagraph_trees_warm_up_lies_outside_the_graph_pool(monkeypatch):
    """A process whose first attnops call is a compiled step's warm-up allocates the error buffer there; the
    warm-up sends every allocation of its thread to the graph's pool, and a tensor of that pool which is not an
    output makes cudagraph trees refuse the step ("not tracked as outputs") and would be recycled by it."""
    from attnops import errors

    monkeypatch.setattr(errors, "_buffers", {})  # (as in a fresh process)
    args = _inputs((32, 8, 128), "bf16")
    compiled = _compiled_reduce_overhead(args)
    gen = torch.Generator().manual_seed(5)
    with attnops.use_backend("triton"):
        for replay in range(4):
            _redraw(args, gen, replay)
            out = compiled(args["q"].clone(), args["block_table"].clone(), args["seq_lens"].clone())
            torch.cuda.synchronize()
            assert relative_error(out, _expected(args)) < TOLERANCE, replay
    assert errors._buffers  # (the premise: the warm-up made it)
