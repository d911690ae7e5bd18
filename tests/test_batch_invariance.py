"""Batch-invariant mode (attnops.batch_invariant, attnops/invariance.py): a row's output and LSE are bitwise the same
whatever else is in the call. Each test puts a random target sequence, alone, then inside random batches (other
sequences of random count, lengths and contents before and after it, its pages elsewhere in a bigger cache, a wider
block table) and compares its rows bit for bit; and checks that dispatch takes only backends that declare the case
invariant, says why it passed the others over, and refuses a pinned one that is not."""
from __future__ import annotations

import dataclasses
import random
import threading

import pytest
import torch

import attnops
from attnops import dispatch, formats, invariance
from attnops.testing import random_paged_inputs

GPU = torch.cuda.is_available()
DEFAULT_THREADS = torch.get_num_threads()


def sequence(rng: random.Random, gen: torch.Generator, *, decode: bool, page_size: int, latent: bool,
             heads: int, dim: int, rope: int, dtype, kv_format: str | None = None) -> dict:
    """One sequence's own data: its pages (random values; kv_format nvfp4 or mxfp4: random packed values and block
    scales; fp8_ds_mla: latent rows in DeepSeek's fp8 layout), its query rows and its length."""
    # (over 1024 keys: more splits than the default plan's cap in the interpreter, where it lengthens them)
    kv_len = rng.choice([1, rng.randint(2, 40), rng.randint(40, 200), rng.randint(1025, 1500)])
    q_len = 1 if decode else rng.randint(1, min(kv_len, 5))
    pages = -(-kv_len // page_size)
    if latent:
        rows = torch.randn(pages, page_size, dim + rope, generator=gen)
        cache = {"kv_cache": formats.quantize_latent_fp8(rows[..., :dim], rows[..., dim:])
                 if kv_format == formats.LATENT_FP8_FORMAT else rows.to(dtype)}
        q = {"q_nope": torch.randn(q_len, heads, dim, generator=gen).to(dtype),
             "q_pe": torch.randn(q_len, heads, rope, generator=gen).to(dtype)}
    else:
        kv_heads = max(1, heads // 2)
        if kv_format is None:
            cache = {name: torch.randn(pages, page_size, kv_heads, dim, generator=gen).to(dtype)
                     for name in ("k_cache", "v_cache")}
        else:
            args = random_paged_inputs([kv_len], num_q_heads=heads, num_kv_heads=kv_heads, head_dim=dim,
                                       page_size=page_size, kv_format=kv_format, seed=rng.randrange(1 << 30),
                                       spare_pages=0, table_padding=0)
            order = args["block_table"][0, :pages].long()  # (its pages in table order)
            cache = {name: args[name][order] for name in ("k_cache", "v_cache", "k_scale", "v_scale")}
        q = {"q": torch.randn(q_len, heads, dim, generator=gen).to(dtype)}
    return dict(cache=cache, q=q, kv_len=kv_len, q_len=q_len, pages=pages)


def assemble(seqs, *, decode: bool, extra_width: int, spare_pages: int, gen: torch.Generator, device) -> dict:
    """The call's arguments for `seqs` in this order: their pages at random places of one cache (spare pages
    random), a block table `extra_width` pages wider than needed (garbage past each sequence's pages)."""
    total = sum(s["pages"] for s in seqs) + spare_pages
    order = torch.randperm(total, generator=gen)
    width = max(s["pages"] for s in seqs) + extra_width
    table = torch.randint(-1, total, (len(seqs), width), generator=gen, dtype=torch.int32)
    caches = {name: torch.randn((total,) + t.shape[1:], generator=gen).to(t.dtype) if t.is_floating_point()
              else torch.randint(0, 256, (total,) + t.shape[1:], generator=gen).to(t.dtype)
              for name, t in seqs[0]["cache"].items()}
    start = 0
    for b, s in enumerate(seqs):
        where = order[start:start + s["pages"]]
        table[b, :s["pages"]] = where.to(torch.int32)
        for name, pages in s["cache"].items():
            caches[name][where] = pages
        start += s["pages"]
    args = {name: t.to(device) for name, t in caches.items()}
    args.update({name: torch.cat([s["q"][name] for s in seqs]).to(device) for name in seqs[0]["q"]})
    args.update(block_table=table.to(device), seq_lens=torch.tensor([s["kv_len"] for s in seqs],
                                                                    dtype=torch.int32, device=device))
    if not decode:
        cu = torch.tensor([0] + [s["q_len"] for s in seqs]).cumsum(0).to(torch.int32)
        args["cu_seqlens_q"] = cu.to(device)
    return args


def target_rows(args, seqs, position):
    start = sum(s["q_len"] for s in seqs[:position])
    return slice(start, start + seqs[position]["q_len"])


def check_invariant(backend: str, *, latent: bool, device: str, dtype, trials: int, seed: int,
                    threads: tuple[int, ...] = (), kv_format: str | None = None, latent_row: tuple | None = None,
                    heads: tuple[int, ...] = (1, 4, 8), page_sizes: tuple[int, ...] = (1, 4, 16),
                    decode_only: bool = False) -> None:
    """`threads`: torch's thread counts to draw from for each call (the C++ CPU kernels' work follows them).
    kv_format: a 4-bit cache ("nvfp4", "mxfp4"), DeepSeek's fp8 latent layout ("fp8_ds_mla"; R 128 unless
    latent_row says), else the cache's dtype. latent_row: (R, P) of latent rows (default: R 64 or 128, P 16);
    heads, page_sizes: what each trial draws from; decode_only: no query blocks."""
    rng = random.Random(seed)
    default_threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(seed)
    op = torch.ops.attnops.mla_attention_with_lse if latent else torch.ops.attnops.paged_attention_with_lse
    for trial in range(trials):
        decode = decode_only or rng.random() < 0.5
        dim, rope = latent_row or (rng.choice([64, 128]) if latent or kv_format else rng.choice([32, 64]), 16)
        dim = 128 if kv_format == formats.LATENT_FP8_FORMAT and latent_row is None else dim
        shape = dict(decode=decode, page_size=rng.choice(page_sizes), latent=latent, heads=rng.choice(heads),
                     dim=dim, rope=rope, dtype=dtype, kv_format=kv_format)
        target = sequence(rng, gen, **shape)
        extra = dict(scale=0.11) if kv_format is None else dict(scale=0.11, kv_format=kv_format)
        with attnops.batch_invariant(), attnops.use_backend(backend):
            alone = assemble([target], decode=decode, extra_width=0, spare_pages=0, gen=gen, device=device)
            want_out, want_lse = op(**alone, **extra)
            for _ in range(3):
                others = [sequence(rng, gen, **shape) for _ in range(rng.randint(1, 5))]
                position = rng.randint(0, len(others))
                seqs = others[:position] + [target] + others[position:]
                args = assemble(seqs, decode=decode, extra_width=rng.randint(0, 12), spare_pages=rng.randint(0, 4),
                                gen=gen, device=device)
                if threads:
                    torch.set_num_threads(rng.choice(threads))
                try:
                    out, lse = op(**args, **extra)
                finally:
                    torch.set_num_threads(default_threads)
                rows = target_rows(args, seqs, position)
                assert torch.equal(out[rows], want_out), (backend, trial, position)
                assert torch.equal(lse[rows], want_lse), (backend, trial, position)


@pytest.mark.parametrize("latent", [False, True], ids=["paged", "latent"])
def test_reference_is_invariant(latent):
    check_invariant("reference", latent=latent, device="cpu", dtype=torch.float32, trials=6, seed=1)


@pytest.mark.parametrize("latent", [False, True], ids=["paged", "latent"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_kernels_are_invariant_whatever_the_thread_count(dtype, latent):
    """The C++ kernels: the batches are also run on 1 to 6 threads (the target alone on torch's default)."""
    check_invariant("cpu", latent=latent, device="cpu", dtype=dtype, trials=8, seed=4, threads=(1, 2, 3, 6))


def test_cpu_kernels_outside_the_mode_split_by_the_threads():
    """Without the mode the split of a long sequence follows the thread count, so its last bits move: what the
    mode is for (else the test above shows nothing)."""
    args = random_paged_inputs([30000], num_q_heads=4, num_kv_heads=1, head_dim=64, seed=5)
    outs = []
    for threads in (1, 6):
        torch.set_num_threads(threads)
        try:
            with attnops.use_backend("cpu"):
                outs.append(torch.ops.attnops.paged_attention(**args))
        finally:
            torch.set_num_threads(DEFAULT_THREADS)
    assert not torch.equal(*outs)
    torch.testing.assert_close(*outs)


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU run is below")
@pytest.mark.parametrize("latent", [False, True], ids=["paged", "latent"])
def test_triton_is_invariant_in_the_interpreter(latent):
    # (latent attention's rows are wide and its splits in the interpreter short: fewer trials keep it under 40 s)
    check_invariant("triton", latent=latent, device="cpu", dtype=torch.float16, trials=3 if latent else 5, seed=2)


def test_latent_fp8_layout_is_invariant_on_the_cpu_and_in_the_interpreter():
    """DeepSeek's fp8 latent layout (fp8_ds_mla): the C++ kernels on 1 to 6 threads, and Triton's interpreter."""
    check_invariant("cpu", latent=True, device="cpu", dtype=torch.bfloat16, trials=5, seed=6, threads=(1, 2, 3, 6),
                    kv_format="fp8_ds_mla")
    if not GPU:
        check_invariant("triton", latent=True, device="cpu", dtype=torch.float16, trials=2, seed=7,
                        kv_format="fp8_ds_mla")


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU run is below")
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
def test_triton_4bit_is_invariant_in_the_interpreter(kv_format):
    check_invariant("triton", latent=False, device="cpu", dtype=torch.float16, trials=2, seed=5,
                    kv_format=kv_format)


@pytest.mark.gpu
@pytest.mark.parametrize("latent", [False, True], ids=["paged", "latent"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_is_invariant_on_the_gpu(dtype, latent):
    check_invariant("triton", latent=latent, device="cuda", dtype=dtype, trials=20, seed=3)


@pytest.mark.gpu
def test_triton_latent_fp8_layout_is_invariant_on_the_gpu():
    check_invariant("triton", latent=True, device="cuda", dtype=torch.bfloat16, trials=10, seed=8,
                    kv_format="fp8_ds_mla", latent_row=(512, 64), heads=(16, 128))


@pytest.mark.gpu
@pytest.mark.parametrize("kv_format", ["nvfp4", "mxfp4"])
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_4bit_caches_are_invariant_on_the_gpu(backend, kv_format):
    check_invariant(backend, latent=False, device="cuda", dtype=torch.bfloat16, trials=20, seed=5,
                    kv_format=kv_format)


@pytest.mark.gpu
def test_cuda_latent_attention_is_invariant_on_the_gpu(monkeypatch):
    """The cuda backend's latent-attention kernel in the mode (splits of cuda_mla.INVARIANT_CHUNK keys), DeepSeek's
    rows, in each of its forms; verify too, its tokens packed into a block's rows or not; DeepSeek's fp8 layout."""
    from attnops.backends import cuda_mla
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("needs an sm_90 GPU")
    for variant in cuda_mla.VARIANTS:
        monkeypatch.setenv(cuda_mla.VARIANT_ENV, variant)
        check_invariant("cuda", latent=True, device="cuda", dtype=torch.bfloat16, trials=6, seed=7,
                        latent_row=(512, 64), heads=(1, 16, 64, 100, 128), page_sizes=(16, 64), decode_only=True)
    # verify, each token a block and a sequence's tokens packed into a block's rows
    monkeypatch.delenv(cuda_mla.VARIANT_ENV)
    for pack in ("0", "1"):
        monkeypatch.setenv(cuda_mla.PACK_ENV, pack)
        check_invariant("cuda", latent=True, device="cuda", dtype=torch.bfloat16, trials=6, seed=8,
                        latent_row=(512, 64), heads=(1, 8, 16, 32), page_sizes=(16, 64))
    # DeepSeek's fp8 layout, everywhere the kernel reads it (the keys form at up to 16 heads, cp.async above)
    monkeypatch.setenv(cuda_mla.DS_ENV, "1")
    check_invariant("cuda", latent=True, device="cuda", dtype=torch.bfloat16, trials=6, seed=9,
                    kv_format="fp8_ds_mla", latent_row=(512, 64), heads=(1, 16, 128), page_sizes=(16, 64))


def test_triton_split_size_in_the_mode_is_fixed_or_the_one_asked_for(monkeypatch):
    """Triton's keys a split in the mode on a GPU: one size for decode and one for calls of query blocks, or
    ATTNOPS_TRITON_INVARIANT_CHUNK's for both (to time another), a multiple of 128 else a ValueError naming it."""
    from attnops.backends.triton import heuristics
    monkeypatch.delenv(heuristics.INVARIANT_CHUNK_ENV, raising=False)
    assert heuristics.invariant_chunk(True) == heuristics.INVARIANT_DECODE_CHUNK
    assert heuristics.invariant_chunk(False) == heuristics.INVARIANT_BLOCK_CHUNK
    for chunk in (heuristics.INVARIANT_DECODE_CHUNK, heuristics.INVARIANT_BLOCK_CHUNK):
        assert chunk % 128 == 0
    monkeypatch.setenv(heuristics.INVARIANT_CHUNK_ENV, "1536")
    assert heuristics.invariant_chunk(True) == heuristics.invariant_chunk(False) == 1536
    for bad in ("0", "100", "1000", "x", "-128"):
        monkeypatch.setenv(heuristics.INVARIANT_CHUNK_ENV, bad)
        with pytest.raises(ValueError, match=heuristics.INVARIANT_CHUNK_ENV):
            heuristics.invariant_chunk(True)


def test_cuda_latent_attention_plan_in_the_mode_depends_on_no_batch():
    """Its invariant plan: a fixed key count a split from each sequence's start, the splits covering the table, at
    least two; the default plan follows the batch; the backend serves latent attention in the mode."""
    from attnops.backends import cuda_mla
    from attnops.backends.cuda import CudaBackend
    from attnops.cases import MLACase
    assert len({cuda_mla.plan(tokens, 16, 32768, 132, False)[1] for tokens in (1, 4, 32, 128)}) > 1
    for capacity in (16, 2048, 2049, 8192, 1 << 17):
        splits, chunk = invariance.fixed_splits(capacity, cuda_mla.INVARIANT_CHUNK)
        assert chunk == cuda_mla.INVARIANT_CHUNK and chunk % cuda_mla.TILE == 0
        assert splits == max(2, -(-capacity // chunk)) and (splits - 1) * chunk < max(capacity, chunk + 1)
    case = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16", latent_dim=512,
                   rope_dim=64, num_heads=16, page_size=64, decode=True, batch=4, max_kv_len=8192)
    assert CudaBackend().invariance_reasons(case) == []


def test_cuda_plan_in_the_mode_depends_on_no_batch(monkeypatch):
    """The CUDA kernels' split plan (an H200's 132 SMs, asked without a GPU): outside the mode a sequence's split
    follows the batch; inside it, a fixed key count a split from the sequence's start, the splits covering the
    table (at least two: one path, the merge's, for every width)."""
    from attnops.backends import cuda as cuda_backend
    monkeypatch.setattr(cuda_backend, "sm_count", lambda device: 132)
    chunks = {cuda_backend.plan_splits(0, batch, 8, 32768)[1] for batch in (1, 4, 32, 128)}
    assert len(chunks) > 1, "the default plan follows the batch (else this test shows nothing)"
    for capacity in (16, 2048, 2049, 8192, 1 << 17):
        splits, chunk = invariance.fixed_splits(capacity, cuda_backend.INVARIANT_CHUNK)
        assert chunk == cuda_backend.INVARIANT_CHUNK and chunk % cuda_backend.TILE == 0
        assert splits == max(2, -(-capacity // chunk)), (capacity, splits)


@pytest.mark.gpu
@pytest.mark.parametrize("backend, latent, kv_format", [("triton", False, None), ("triton", True, None),
                                                        ("cuda", False, "nvfp4")], ids=["paged", "latent", "cuda"])
def test_gpu_backends_are_invariant_in_captures_and_compiled(backend, latent, kv_format):
    """A target's rows alone, eager, against the same rows in random batches replayed from a CUDA graph the user
    captured and from torch.compile(mode="reduce-overhead")'s graphs: bit for bit."""
    rng = random.Random(9)
    gen = torch.Generator().manual_seed(9)
    op = torch.ops.attnops.mla_attention_with_lse if latent else torch.ops.attnops.paged_attention_with_lse
    extra = dict(scale=0.11) if kv_format is None else dict(scale=0.11, kv_format=kv_format)
    for trial in range(4):
        decode = trial % 2 == 0
        shape = dict(decode=decode, page_size=16, latent=latent, heads=8, dim=128 if latent or kv_format else 64,
                     rope=16, dtype=torch.bfloat16, kv_format=kv_format)
        target = sequence(rng, gen, **shape)
        others = [sequence(rng, gen, **shape) for _ in range(rng.randint(1, 5))]
        position = rng.randint(0, len(others))
        seqs = others[:position] + [target] + others[position:]
        with attnops.batch_invariant(), attnops.use_backend(backend):
            want_out, want_lse = op(**assemble([target], decode=decode, extra_width=0, spare_pages=0, gen=gen,
                                               device="cuda"), **extra)
            args = assemble(seqs, decode=decode, extra_width=rng.randint(0, 12), spare_pages=2, gen=gen,
                            device="cuda")
            rows = target_rows(args, seqs, position)
            op(**args, **extra)  # (compiled before the capture)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, lse = op(**args, **extra)
            graph.replay()
            assert torch.equal(out[rows], want_out) and torch.equal(lse[rows], want_lse), (trial, "graph")
            torch._dynamo.reset()  # (each trial's call is a new graph: no recompile limit across trials)
            compiled = torch.compile(lambda a: op(**a, **extra), mode="reduce-overhead", fullgraph=True)
            for _ in range(3):  # (recorded, then replayed)
                out, lse = (t.clone() for t in compiled(args))
            assert torch.equal(out[rows], want_out) and torch.equal(lse[rows], want_lse), (trial, "compiled")


@pytest.fixture
def cpu_not_invariant(monkeypatch):
    """The cpu backend as one that is not invariant (every CPU backend is): what dispatch does with such a one."""
    from attnops.backends import BACKENDS
    monkeypatch.setattr(BACKENDS["cpu"], "invariance_reasons", lambda case: ["splits by the batch (a stand-in)"])
    dispatch._select_cached.cache_clear()
    yield
    dispatch._select_cached.cache_clear()


def test_dispatch_takes_only_invariant_backends_and_says_why(cpu_not_invariant):
    case = dispatch.describe_attention(device="cpu", kv_format="fp32", q_dtype=torch.float32)
    assert dispatch.explain_case(case).chosen == "cpu"
    with attnops.batch_invariant():
        explanation = dispatch.explain_case(case)
        assert explanation.chosen == "reference"
        assert any("splits by the batch" in r for r in explanation.rejected["cpu"])
        assert "mode: batch-invariant" in str(explanation)
        with attnops.batch_invariant(False):  # an inner block turns it off
            assert dispatch.explain_case(case).chosen == "cpu"


def test_which_backends_are_invariant():
    from attnops.backends import BACKENDS
    from attnops.cases import MLACase
    case = dispatch.describe_attention(device="cpu", kv_format="fp32", q_dtype=torch.float32)
    with attnops.batch_invariant():
        assert dispatch.explain_case(case).chosen == "cpu"
    gpu = dispatch.describe_attention(device="cpu", kv_format="bf16")
    gpu = type(gpu)(**{**gpu.__dict__, "device_type": "cuda", "arch": (9, 0)})
    assert BACKENDS["triton"].invariance_reasons(gpu) == []
    assert BACKENDS["flashinfer"].invariance_reasons(gpu)
    assert BACKENDS["cuda"].invariance_reasons(dataclasses.replace(gpu, kv_format="nvfp4")) == []
    mla = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16", latent_dim=512,
                  rope_dim=64, num_heads=16, page_size=64, decode=True)
    assert BACKENDS["triton"].invariance_reasons(mla) == []
    assert BACKENDS["flashinfer"].invariance_reasons(mla)
    assert BACKENDS["cpu"].invariance_reasons(mla) == []


def test_a_pinned_backend_that_is_not_invariant_is_refused(monkeypatch, cpu_not_invariant):
    args = random_paged_inputs([9, 20], num_q_heads=4, num_kv_heads=2, head_dim=32)
    with attnops.batch_invariant(), attnops.use_backend("cpu"):
        with pytest.raises(ValueError, match="splits by the batch"):
            torch.ops.attnops.paged_attention(**args)
    monkeypatch.setenv("ATTNOPS_BATCH_INVARIANT", "1")
    assert invariance.enabled()
    with attnops.use_backend("cpu"), pytest.raises(ValueError, match="batch-invariant"):
        torch.ops.attnops.paged_attention(**args)
    with attnops.batch_invariant(False), attnops.use_backend("cpu"):
        torch.ops.attnops.paged_attention(**args)


def test_the_mode_is_thread_local_and_checks_its_argument():
    seen = []
    with attnops.batch_invariant():
        thread = threading.Thread(target=lambda: seen.append(invariance.enabled()))
        thread.start()
        thread.join()
        assert invariance.enabled()
    assert seen == [False] and not invariance.enabled()
    with pytest.raises(TypeError, match="enabled"):
        with attnops.batch_invariant("yes"):
            pass


def test_triton_gpu_plan_in_the_mode_depends_on_no_batch(monkeypatch):
    """The GPU's heuristic (an H200's 132 SMs, sm_90, asked here without a GPU): outside the mode the tiles and
    splits follow the batch; inside it every knob that shapes a row's sums is the same for any batch, token count
    and table width (MAX_SPLITS only grows with the table: the splits past a sequence's length are empty)."""
    from attnops.backends.triton import heuristics
    monkeypatch.setattr(heuristics, "_num_sms", lambda device: 132)
    monkeypatch.setattr(heuristics, "_capability", lambda device: 9)
    monkeypatch.setattr(heuristics, "_shared_memory_per_block", lambda device: 227 * 1024)
    heuristics.heuristic_config.cache_clear()
    base = dispatch.describe_attention(device="cpu", kv_format="bf16")
    cuda = torch.device("cuda")
    calls = []
    for decode in (True, False):
        for batch, capacity, tokens in ((1, 32768, 4), (32, 8192, 128), (128, 4096, 700), (3, 1 << 17, 9)):
            case = type(base)(**{**base.__dict__, "device_type": "cuda", "arch": (9, 0), "decode": decode,
                                 "batch": batch, "max_kv_len": capacity,
                                 "shape_class": "decode" if decode else "verify"})
            calls.append((decode, case, batch if decode else tokens))
    try:
        for decode in (True, False):
            default = {str({k: v for k, v in heuristics.heuristic_config(case, tokens, cuda).items()
                            if k != "MAX_SPLITS"}) for d, case, tokens in calls if d == decode}
            assert len(default) > 1, "the default plan follows the batch (else this test shows nothing)"
            with attnops.batch_invariant():
                chosen = [heuristics.heuristic_config(case, tokens, cuda) for d, case, tokens in calls if d == decode]
            knobs = {str({k: v for k, v in c.items() if k != "MAX_SPLITS"}) for c in chosen}
            assert len(knobs) == 1, knobs
            assert all(c["MAX_SPLITS"] * c["CHUNK"] >= case.max_kv_len and c["MAX_SPLITS"] >= 2
                       for c, (_, case, _) in zip(chosen, [x for x in calls if x[0] == decode]))
    finally:
        heuristics.heuristic_config.cache_clear()


def serve_target(model, schedule, threads: int, device: str = "cpu", **options) -> tuple[list[int], list[float]]:
    """Serves `schedule` [(step it arrives, req_id, prompt, max_new_tokens)] with Generator(batch_invariant=True)
    on `threads` threads (the model's device: fp32 KV on the CPU, bf16 on a GPU; `options` for the Generator);
    returns the request "target"'s tokens and their log-probabilities."""
    from attnops.serving.generate import Generator
    kv = attnops.hf.paged_kv_cache(model.config, num_pages=160, page_size=16,
                                   kv_format="fp32" if device == "cpu" else "bf16", device=device)
    gen = Generator(attnops.hf.serving_model(model), kv, max_batch=3, max_seq_len=720, batch_invariant=True,
                    **options)
    torch.set_num_threads(threads)
    try:
        step = 0
        while step <= max(at for at, *_ in schedule) or gen.has_work():
            for at, req_id, prompt, n in schedule:
                if at == step:
                    gen.add_request(req_id, prompt, n)
            gen.step()
            step += 1
    finally:
        torch.set_num_threads(DEFAULT_THREADS)
    assert not gen.failed
    return gen.finished["target"].output, gen.finished["target"].logprobs


@pytest.mark.parametrize("family", ["llama", "deepseek_v3", "deepseek_v32"])
def test_generator_serves_a_request_the_same_whatever_is_beside_it(family):
    """Greedy tokens and their log-probabilities (so the logits' bits) of a request served alone, then among
    random others that arrive before, with and after it (some waiting for a row: max_batch 3), on 1-6 threads
    (alone and among others on the same count: torch's own matrix products need not give the same bits on
    another thread count, on some CPUs). Its prompt is long enough (700 tokens) that the CPU kernels outside the
    mode would split it by the threads. DeepSeek: latent attention on a LatentKVCache, and a mixture of experts
    (the Generator has it compute a token's experts apart from the others'); V3.2: its indexer's picks (scored
    against every sequence's table of keys in the step) and the sparse form."""
    pytest.importorskip("transformers")
    import attnops.hf
    from attnops.hf import families
    from conftest import build, make_config
    torch.manual_seed(0)
    model = (families.load(family, tiny=True, dtype=torch.float32) if family in families.MLA_FAMILIES else
             build(make_config(family), attnops.hf.ATTN_IMPLEMENTATION))
    rng = random.Random(6)
    target = [rng.randrange(1, 256) for _ in range(700)]
    alone = {}
    for trial in range(4):
        others = [(rng.randint(0, 6), i, [rng.randrange(1, 256) for _ in range(rng.randint(3, 20))],
                   rng.randint(2, 14)) for i in range(rng.randint(1, 5))]
        schedule = others + [(rng.randint(0, 4), "target", target, 12)]
        threads = rng.choice([1, 2, 3, 6])
        if threads not in alone:
            alone[threads] = serve_target(model, [(0, "target", target, 12)], threads=threads)
            assert len(alone[threads][0]) == 12 and len(set(alone[threads][0])) > 1
        assert serve_target(model, schedule, threads=threads) == alone[threads], (trial, threads, schedule)


def test_a_batch_invariant_generator_has_a_mixture_of_experts_compute_each_token_apart():
    """transformers groups a mixture of experts' tokens by expert (grouped_mm): a token's matrix products then take
    their shapes from the other tokens' routing. A batch-invariant Generator has attnops.hf's model compute them a
    (token, expert) pair at a time; a model without experts is left as it is."""
    pytest.importorskip("transformers")
    import attnops.hf
    from attnops.hf import families
    from attnops.serving.generate import Generator
    from conftest import build, make_config
    deepseek = attnops.hf.serving_model(families.load("deepseek_v3", tiny=True, dtype=torch.float32))
    assert deepseek.hf.config._experts_implementation != "batched_mm"
    Generator(deepseek, deepseek.make_kv_cache(8, kv_format="fp32"), max_batch=2, max_seq_len=64)
    assert deepseek.hf.config._experts_implementation != "batched_mm"  # (only in the mode)
    Generator(deepseek, deepseek.make_kv_cache(8, kv_format="fp32"), max_batch=2, max_seq_len=64,
              batch_invariant=True)
    assert deepseek.hf.config._experts_implementation == "batched_mm"
    llama = attnops.hf.serving_model(build(make_config("llama"), attnops.hf.ATTN_IMPLEMENTATION))
    before = llama.hf.config._experts_implementation
    llama.prepare_batch_invariant()
    assert llama.hf.config._experts_implementation == before


@pytest.mark.gpu
def test_generator_serves_a_request_the_same_on_the_gpu_in_our_graphs():
    """The same on a GPU in bf16, each decode step replayed from the Generator's own CUDA graphs (re-planned before
    each replay; only invariant backends chosen)."""
    pytest.importorskip("transformers")
    import attnops.hf
    from conftest import build, make_config
    torch.manual_seed(0)
    model = build(make_config("llama"), attnops.hf.ATTN_IMPLEMENTATION).to("cuda", torch.bfloat16)
    rng = random.Random(7)
    target = [rng.randrange(1, 256) for _ in range(700)]
    serve = lambda schedule: serve_target(model, schedule, DEFAULT_THREADS, "cuda", cuda_graphs=True)  # noqa: E731
    want = serve([(0, "target", target, 12)])
    assert len(want[0]) == 12
    for trial in range(3):
        others = [(rng.randint(0, 6), i, [rng.randrange(1, 256) for _ in range(rng.randint(3, 600))],
                   rng.randint(2, 14)) for i in range(rng.randint(1, 5))]
        schedule = others + [(rng.randint(0, 4), "target", target, 12)]
        assert serve(schedule) == want, (trial, schedule)


def test_generator_batch_invariant_checks_its_arguments():
    from attnops.serving.generate import Generator
    kv = attnops.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=32, num_pages=4, page_size=4, device="cpu")
    model = lambda *args: None  # noqa: E731  (never called)
    with pytest.raises(TypeError, match="batch_invariant must be a bool"):
        Generator(model, kv, batch_invariant=1)
    for bad in (dict(cascade=True), dict(prefix_sharing=True)):
        with pytest.raises(ValueError, match=f"{next(iter(bad))}=True"):
            Generator(model, kv, batch_invariant=True, **bad)
    with pytest.raises(ValueError, match="max_batch rows only"):
        Generator(model, kv, max_batch=4, buckets=(1, 2, 4), batch_invariant=True)
    gen = Generator(model, kv, max_batch=4, batch_invariant=True, cascade=False)
    assert gen.decode.buckets == (4,) and not gen.prefix_sharing and gen.decode.cascade is None
