"""Latent attention (mla_attention, mla_attention_with_lse, mla_cache_write): the reference against an independent
dense computation, the Triton kernels against the reference on random ragged batches (decode, extend, verify with
draft trees, sinks, fp8, forced splits; in the interpreter here, bf16 on a GPU), the C++ CPU kernels against the
float64 reference (the same batches in fp32/bf16/fp16 with fp32/bf16/fp16/fp8 caches, DeepSeek's R 512 P 64, thread
counts, every instruction-set copy, NaN), validation, the bad-index rules, opcheck, torch.compile and CUDA graphs."""
from __future__ import annotations

import math
import os
import random
import sys
import textwrap

import pytest
import torch

import attnops
from attnops.backends import BACKENDS
from attnops.backends.reference import mla_attention_reference, mla_cache_write_reference
from attnops.backends.triton.mla_launch import mla_cache_write, mla_launch
from attnops.testing import random_mla_inputs, relative_error
from conftest import ISA_PARAMS, run_with_cpu_isa

GPU = torch.cuda.is_available()


def mla_inputs(kv_lens, q_lens=None, *, heads=4, latent=64, rope=16, page_size=4, dtype=torch.float16,
               kv_format="auto", device="cpu", seed=0, spare_pages=2):
    """Keyword arguments of mla_attention (attnops.testing.random_mla_inputs, generated on the CPU: the same data
    on every device)."""
    args = random_mla_inputs(kv_lens, q_lens, num_heads=heads, latent_dim=latent, rope_dim=rope, page_size=page_size,
                             q_dtype=dtype, kv_format=kv_format, seed=seed, spare_pages=spare_pages)
    return {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}


def dense_mla(q_nope, q_pe, kv_cache, block_table, seq_lens, cu_seqlens_q=None, *, scale, kv_format="auto",
              kv_scale=None, sinks=None, tree_mask=None):
    """The contract written out, one sequence at a time over its gathered rows, float64."""
    latent = q_nope.shape[2]
    out = torch.zeros(q_nope.shape, dtype=torch.float64)
    rows = kv_cache.double() * (kv_scale.double() if kv_scale is not None else 1.0)
    starts = list(range(len(seq_lens) + 1)) if cu_seqlens_q is None else cu_seqlens_q.tolist()
    page_size = kv_cache.shape[1]
    for b, n in enumerate(seq_lens.tolist()):
        seq = rows[block_table[b, :-(-n // page_size)].long()].flatten(0, 1)[:n]  # [n, R + P]
        for i, t in enumerate(range(starts[b], starts[b + 1])):
            q_len = starts[b + 1] - starts[b]
            pos = n - q_len + i
            visible = torch.arange(n) <= pos
            if tree_mask is not None:
                block = torch.arange(n) >= n - q_len
                cols = (torch.arange(n) - (n - q_len)).clamp(min=0)
                seen = torch.tensor([bool(tree_mask[t, c]) if c < tree_mask.shape[1] else False
                                     for c in cols.tolist()])
                visible = ~block | seen
            scores = (torch.cat([q_nope[t], q_pe[t]], -1).double() @ seq.T) * scale  # [H, n]
            scores = scores.masked_fill(~visible, -math.inf)
            if sinks is not None:
                scores = torch.cat([scores, sinks.double()[:, None]], -1)
            if not visible.any():
                continue
            probs = torch.softmax(scores, -1)[:, :n]
            out[t] = probs @ seq[:, :latent]
    return out


CASES = [  # kv_lens, q_lens, heads, latent, rope, page_size
    ([5, 0, 40, 17], None, 16, 64, 16, 4),
    ([33, 1, 70], None, 3, 128, 32, 16),
    ([9, 30, 3], [3, 5, 3], 20, 192, 48, 8),
    ([2, 9], [5, 3], 8, 64, 64, 1),  # more queries than keys: the first rows see nothing
    ([64, 16], [4, 16], 5, 256, 16, 32),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_reference_matches_an_independent_dense_computation(case):
    kv_lens, q_lens, heads, latent, rope, page = CASES[case]
    args = mla_inputs(kv_lens, q_lens, heads=heads, latent=latent, rope=rope, page_size=page, dtype=torch.float32,
                      seed=case)
    sinks = torch.randn(heads)
    got = mla_attention_reference(**args, sinks=sinks, compute_dtype=torch.float64)
    assert relative_error(got, dense_mla(**args, sinks=sinks)) < 1e-5


def random_spec(rng: random.Random) -> dict:
    batch = rng.randint(1, 4)
    decode = rng.random() < 0.4
    kv_lens = [rng.choice([0, 1, rng.randint(2, 80)]) for _ in range(batch)]
    q_lens = None if decode else [rng.randint(0, min(n, 6)) if n else rng.randint(0, 2) for n in kv_lens]
    heads, latent = rng.choice([1, 4, 16, 20]), rng.choice([64, 128, 192, 256])
    return dict(kv_lens=kv_lens, q_lens=q_lens, heads=heads, latent=latent,
                rope=rng.choice([16, 32, 64]), page_size=rng.choice([1, 4, 16]), seed=rng.randrange(1 << 30),
                kv_format=rng.choice(["auto", "auto", "fp8_e4m3"] + ["fp8_ds_mla"] * (latent % 128 == 0)),
                sinks=rng.random() < 0.4,
                tree=not decode and rng.random() < 0.5,
                config=rng.choice([None, None, dict(CHUNK=16, BLOCK_N=16)]))  # forced splits


def spec_inputs(spec, device, dtype):
    """mla_attention's keyword arguments for a random_spec: mla_inputs, and the spec's sinks and tree mask."""
    args = mla_inputs(spec["kv_lens"], spec["q_lens"], heads=spec["heads"], latent=spec["latent"],
                      rope=spec["rope"], page_size=spec["page_size"], dtype=dtype, kv_format=spec["kv_format"],
                      device=device, seed=spec["seed"])
    gen = torch.Generator().manual_seed(spec["seed"])
    if spec["sinks"]:
        args["sinks"] = (torch.randn(spec["heads"], generator=gen) * 2).to(device)
    if spec["tree"]:
        args["tree_mask"] = (torch.rand(args["q_nope"].shape[0], max(spec["q_lens"]) + 1, generator=gen)
                             < 0.5).to(device)
    return args


# the LSE's tolerance over DeepSeek's fp8 layout (fp8_ds_mla): Triton widens its values to q's dtype before the
# products (as FlashMLA's kernels do), each rounded to fp16's 11 or bf16's 8 significant bits; that rounding alone
# moves an LSE of these random batches by up to 0.025 in bf16
DS_LSE_ATOL = {torch.float32: 2e-3, torch.float16: 1e-2, torch.bfloat16: 4e-2}


def check_triton(spec, device, dtype):
    check_launch(spec_inputs(spec, device, dtype), spec, device, dtype,
                 DS_LSE_ATOL[dtype] if spec["kv_format"] == "fp8_ds_mla" else 2e-3)


def check_launch(args, spec, device, dtype, lse_atol=2e-3):
    """mla_launch on mla_attention's arguments `args` (spec["config"]: its tiles and splits) against the float64
    reference, the output and the LSE (within lse_atol, and 1e-3 relative)."""
    out = torch.full_like(args["q_nope"], float("nan"))
    lse = torch.full(args["q_nope"].shape[:2], float("nan"), device=device)
    launch_args = {k: v for k, v in args.items() if k not in ("sinks", "tree_mask", "kv_scale")}
    mla_launch(**launch_args, kv_scale=args.get("kv_scale"), sinks=args.get("sinks"),
               tree_mask=args.get("tree_mask"), out=out, lse=lse, config=spec["config"])
    ref, ref_lse = mla_attention_reference(**args, return_lse=True)
    if ref.numel():
        assert relative_error(out, ref) < (1e-5 if dtype == torch.float32 else 1e-2), spec
        torch.testing.assert_close(lse, ref_lse.float().to(device), atol=lse_atol, rtol=1e-3, equal_nan=True,
                                   msg=lambda m: f"{spec}: {m}")


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU run is below")
@pytest.mark.parametrize("seed", range(3))
def test_triton_matches_the_reference_in_the_interpreter(seed):
    rng = random.Random(seed)
    for _ in range(8):
        check_triton(random_spec(rng), "cpu", rng.choice([torch.float16, torch.float32]))


@pytest.mark.skipif(GPU, reason="the interpreter's run; the GPU runs many splits in its random batches")
def test_triton_merges_many_splits():
    """More splits than the merge reads at once (it takes them SPLIT_BLOCK at a time): 19 and 11 splits of 16 keys,
    a sequence shorter than one split, sinks and the LSE."""
    spec = dict(kv_lens=[300, 5, 170], q_lens=None, heads=4, latent=64, rope=16, page_size=4, seed=3,
                kv_format="auto", sinks=True, tree=False, config=dict(CHUNK=16, BLOCK_N=16))
    check_triton(spec, "cpu", torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(4))
def test_triton_matches_the_reference_on_the_gpu(seed):
    rng = random.Random(100 + seed)
    for _ in range(40):
        check_triton(random_spec(rng), "cuda", rng.choice([torch.bfloat16, torch.float16]))


@pytest.mark.gpu
def test_gpu_deepseek_shapes_through_the_op():
    """R 512, P 64 at every tensor-parallel head count, decode and verify, bf16 and fp8, through the op."""
    for heads in (8, 16, 32, 64, 128):
        for q_lens, kv_format in ((None, "auto"), ([4, 4, 4], "auto"), (None, "fp8_e4m3")):
            args = mla_inputs([700, 3000, 129], q_lens, heads=heads, latent=512, rope=64, page_size=64,
                              dtype=torch.bfloat16, kv_format=kv_format, device="cuda", seed=heads)
            with attnops.use_backend("triton"):
                assert attnops.explain(**args).chosen == "triton"
                out = torch.ops.attnops.mla_attention(**args)
            assert relative_error(out, mla_attention_reference(**args)) < 1e-2, (heads, q_lens, kv_format)


def flashinfer_importable() -> bool:
    try:
        import flashinfer  # noqa: F401
    except Exception:
        return False
    return True


class FakeMLAWrapper:
    """FlashInfer's BatchMLAPagedAttentionWrapper as its documentation states it, computed in float64 on the CPU from
    the CSR metadata it is planned with: checks what attnops hands it (page layout, lengths, query rows, causal
    offset, layouts, LSE base), whatever device runs the test. Rows that see no key get 123 (FlashInfer leaves
    them undefined), so the backend's row fix is tested too."""

    plans = 0

    def __init__(self, workspace, backend="auto"):
        assert backend == "auto"

    def plan(self, *, metadata, num_heads, head_dim_ckv, head_dim_kpe, page_size, causal, sm_scale, q_data_type,
             kv_data_type, query_layout, kv_cache_layout, lse_mode):
        assert (query_layout, kv_cache_layout, lse_mode) == ("split", "packed", "base2")
        FakeMLAWrapper.plans += 1
        self.meta, self.causal, self.scale, self.dims = metadata, causal, sm_scale, (head_dim_ckv, head_dim_kpe)
        self.page_size = page_size

    def run(self, *, query, kv_cache, out, lse, return_lse):
        q_nope, q_pe = query
        latent = self.dims[0]
        qo, kv_indptr, kv_indices, kv_lens = (t.tolist() for t in (self.meta.qo_indptr, self.meta.kv_indptr,
                                                                   self.meta.kv_indices, self.meta.kv_len_arr))
        assert len(qo) == len(kv_indptr) == len(kv_lens) + 1 and kv_indptr[-1] == len(kv_indices)
        for b, n in enumerate(kv_lens):
            pages = kv_indices[kv_indptr[b]:kv_indptr[b + 1]]
            assert len(pages) == -(-n // self.page_size) and all(0 <= p < kv_cache.shape[0] for p in pages)
            rows = kv_cache[pages].double().flatten(0, 1)[:n]
            q_len = qo[b + 1] - qo[b]
            for i, t in enumerate(range(qo[b], qo[b + 1])):
                seen = n - q_len + i + 1 if self.causal else n
                if seen <= 0:
                    out[t], lse[t] = 123.0, 123.0
                    continue
                scores = torch.cat([q_nope[t], q_pe[t]], -1).double() @ rows[:seen].T * self.scale
                out[t] = (torch.softmax(scores, -1) @ rows[:seen, :latent]).to(out.dtype)
                lse[t] = torch.logsumexp(scores, -1) / math.log(2)
        return out, lse


def test_flashinfer_mla_plumbing_against_a_model_of_its_wrapper(monkeypatch):
    """flashinfer_mla.py's page layout, row fixes, LSE and per-step plans, with FlashInfer's wrapper replaced by
    FakeMLAWrapper (the GPU test below runs the real one): ragged decode and extend, an empty sequence, more
    queries than keys, a bad length, a bad page, a bad cu_seqlens_q."""
    import types
    from attnops.backends import flashinfer_mla
    from attnops.checks_mla import mla_call
    fake = types.SimpleNamespace(mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=FakeMLAWrapper,
                                                           MLAPlanMetadata=types.SimpleNamespace(csr=lambda *a:
        types.SimpleNamespace(**dict(zip(("qo_indptr", "kv_indptr", "kv_indices", "kv_len_arr"), a))))))
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    flashinfer_mla._plans.cache_clear()
    cases = [([40, 0, 9, 17], None, {}), ([12, 5, 30], [3, 7, 2], {}), ([9, 8, 20], [1, 1, 4], {"seq_lens": 1}),
             ([9, 30, 20], [2, 2, 2], {"block_table": 1}), ([9, 30], [2, 2], {"cu_seqlens_q": 1})]
    for kv_lens, q_lens, bad in cases:
        args = mla_inputs(kv_lens, q_lens, heads=3, latent=64, rope=16, page_size=4, dtype=torch.float32, seed=5)
        if "seq_lens" in bad:
            args["seq_lens"][1] = 10 ** 6
        if "block_table" in bad:
            args["block_table"][1, 2] = 999
        if "cu_seqlens_q" in bad:
            args["cu_seqlens_q"][1] = 5  # past the last row
        attnops.take_errors()
        ref, ref_lse = mla_attention_reference(**args, return_lse=True)
        before = FakeMLAWrapper.plans
        for layer in range(2):  # one plan a step, whatever the layers
            out = torch.full_like(args["q_nope"], float("nan"))
            lse = torch.full(args["q_nope"].shape[:2], float("nan"))
            flashinfer_mla.mla_attention(mla_call(**{**dict(sinks=None, tree_mask=None, kv_scale=None), **args},
                                                  out=out, lse=lse))
            torch.testing.assert_close(out, ref.float(), atol=1e-5, rtol=1e-5, equal_nan=True)
            torch.testing.assert_close(lse, ref_lse.float(), atol=1e-5, rtol=1e-5, equal_nan=True)
        assert FakeMLAWrapper.plans - before == (0 if bad.get("cu_seqlens_q") else 1)
        assert attnops.take_errors() == bad, (kv_lens, q_lens)
    flashinfer_mla._plans.cache_clear()


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_importable(), reason="FlashInfer is not installed")
def test_flashinfer_matches_the_reference_through_the_op():
    """FlashInfer's MLA wrapper behind the op (flashinfer_mla.py) on random ragged batches at DeepSeek's R 512, P 64:
    decode and extend, empty sequences, more queries than keys, bad lengths and pages, LSE, a plan reused by the
    step's second call (another layer) and replanned when the lengths change in place."""
    rng = random.Random(7)
    for trial in range(24):
        batch = rng.randint(1, 6)
        decode = trial % 2 == 0
        kv_lens = [rng.choice([0, 1, rng.randint(2, 300), rng.randint(300, 3000)]) for _ in range(batch)]
        q_lens = None if decode else [rng.randint(0, min(n, 8)) if n else 0 for n in kv_lens]
        if not decode and trial % 4 == 1:
            q_lens[0] = kv_lens[0] + 2  # more queries than keys: the first rows see none
        heads = rng.choice([8, 16, 64, 128])
        dtype = rng.choice([torch.bfloat16, torch.float16])
        args = mla_inputs(kv_lens, q_lens, heads=heads, latent=512, rope=64, page_size=rng.choice([1, 16, 64]),
                          dtype=dtype, device="cuda", seed=trial)
        if trial % 6 == 5:
            args["seq_lens"][0] = 10 ** 6  # a bad length: its rows NaN
        attnops.take_errors()
        with attnops.use_backend("flashinfer"):
            assert attnops.explain(**args).chosen == "flashinfer"
            for layer in range(2):  # the second call reuses the step's plan
                out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
                ref, ref_lse = mla_attention_reference(**args, return_lse=True)
                assert torch.equal(out.isnan(), ref.isnan()), (trial, layer)
                if ref.numel():
                    valid = ~ref.isnan()
                    assert relative_error(out[valid], ref[valid]) < 1e-2, (trial, layer)
                    torch.testing.assert_close(lse, ref_lse.float(), atol=2e-3, rtol=1e-3, equal_nan=True)
        want_errors = {"seq_lens": 0} if trial % 6 == 5 and (decode or q_lens[0]) else {}
        assert attnops.take_errors() == want_errors, trial
        if any(kv_lens):  # the same tensors rewritten in place: a new step, planned again
            args["seq_lens"].copy_(torch.tensor([n // 2 for n in kv_lens]))
            if q_lens is None or all(q <= n // 2 for q, n in zip(q_lens, kv_lens)):
                with attnops.use_backend("flashinfer"):
                    out = torch.ops.attnops.mla_attention(**args)
                ref = mla_attention_reference(**args)
                valid = ~ref.isnan()
                assert torch.equal(out.isnan(), ref.isnan()), trial
                assert relative_error(out[valid], ref[valid]) < 1e-2, trial


@pytest.mark.gpu
@pytest.mark.skipif(not flashinfer_importable(), reason="FlashInfer is not installed")
def test_flashinfer_is_passed_over_inside_a_capture():
    args = mla_inputs([300, 40], None, heads=16, latent=512, rope=64, page_size=16, dtype=torch.bfloat16,
                      device="cuda")
    graph = torch.cuda.CUDAGraph()
    out = torch.empty_like(args["q_nope"])
    torch.ops.attnops.mla_attention.out(**args, out=out)
    with torch.cuda.graph(graph):
        chosen = attnops.explain(**args).chosen
        torch.ops.attnops.mla_attention.out(**args, out=out)
    # a plan-free backend (which one is the rule's: Triton for two sequences of 16 heads on sm_90)
    assert chosen in ("cuda", "triton")
    graph.replay()
    assert relative_error(out, mla_attention_reference(**args)) < 1e-2


# ------------------------------------------------------------------------------------------------------------
# the C++ CPU kernels (csrc/cpu/mla_attention.cpp: paged attention's inner loops over the latent rows)

# relative error against the float64 result: fp32 accumulation, then (bf16, fp16) the output's own rounding
CPU_TOLERANCE = {torch.float32: 2e-6, torch.float16: 5e-4, torch.bfloat16: 3e-3}


def run_cpu(args):
    """(out, lse) of mla_attention_with_lse.out with the cpu backend pinned, into outputs poisoned with NaN."""
    out = torch.full_like(args["q_nope"], float("nan"))
    lse = torch.full(args["q_nope"].shape[:2], float("nan"))
    with attnops.use_backend("cpu"):
        torch.ops.attnops.mla_attention_with_lse.out(**args, out=out, lse=lse)
    return out, lse


def check_cpu(args, what="") -> float:
    """The cpu backend against the reference fed the same (stored) cache with q in float64, so that the reference's
    output is not rounded to q's dtype; returns the relative error."""
    out, lse = run_cpu(args)
    exact = {**args, "q_nope": args["q_nope"].double(), "q_pe": args["q_pe"].double()}
    ref, ref_lse = mla_attention_reference(**exact, return_lse=True)
    assert out.dtype == args["q_nope"].dtype and not out.isnan().any() and not lse.isnan().any(), what
    torch.testing.assert_close(lse, ref_lse.float(), rtol=1e-5, atol=1e-5, msg=lambda m: f"{what}: {m}")
    unseen = (ref == 0).all(-1)  # rows that see no key: exactly 0
    assert (out[unseen] == 0).all(), what
    err = relative_error(out, ref) if ref.abs().sum() > 0 else 0.0
    assert err < CPU_TOLERANCE[args["q_nope"].dtype], f"{what}: relative error {err:.3g}"
    return err


def random_cpu_spec(rng: random.Random) -> tuple[dict, torch.dtype]:
    """random_spec's ragged batches, with R up to 512, pages up to 64 and up to 128 heads, and a q dtype."""
    spec = random_spec(rng)
    latents = [128, 256, 512] if spec["kv_format"] == "fp8_ds_mla" else [64, 128, 192, 256, 512]
    spec.update(latent=rng.choice(latents), page_size=rng.choice([1, 4, 16, 64]),
                heads=rng.choice([1, 4, 16, 20, 128]))
    # (no tree for a batch without query rows: torch gives the empty [0, Q] mask a stride the checks refuse)
    spec["tree"] = spec["tree"] and sum(spec["q_lens"]) > 0
    return spec, rng.choice([torch.float32, torch.bfloat16, torch.float16])


@pytest.mark.parametrize("seed", range(4))
def test_cpu_matches_the_float64_reference_on_random_batches(seed):
    rng = random.Random(1000 + seed)
    for i in range(10):
        spec, dtype = random_cpu_spec(rng)
        what = f"case {i}: {dtype} {spec}"
        print(f"{what}: err={check_cpu(spec_inputs(spec, 'cpu', dtype), what):.2e}")


@pytest.mark.parametrize("dtype,kv_format", [(torch.bfloat16, "auto"), (torch.float16, "auto"),
                                             (torch.float32, "auto"), (torch.bfloat16, "fp8_e4m3")])
def test_cpu_deepseek_shapes(dtype, kv_format):
    """R 512, P 64, pages of 64: decode over 16 heads, and a verify of draft trees with sinks over 128."""
    for heads, q_lens in ((16, None), (128, [4, 1, 4])):
        args = mla_inputs([300, 700, 129], q_lens, heads=heads, latent=512, rope=64, page_size=64, dtype=dtype,
                          kv_format=kv_format, seed=heads)
        if q_lens is not None:
            gen = torch.Generator().manual_seed(heads)
            args["sinks"] = torch.randn(heads, generator=gen)
            args["tree_mask"] = torch.rand(sum(q_lens), 4, generator=gen) < 0.5
            args["tree_mask"][:, 0] = True  # each draft sees the root
        check_cpu(args, f"heads={heads} q_lens={q_lens}")


def test_cpu_thread_count_changes_nothing_but_rounding():
    """One long sequence: with more threads its keys are split into pieces merged by log-sum-exp (paged attention's
    splits); the answer moves by rounding only."""
    previous = torch.get_num_threads()
    try:
        for q_lens in (None, [5]):
            args = mla_inputs([3000], q_lens, heads=16, latent=512, rope=64, page_size=16, dtype=torch.float32,
                              seed=7)
            if q_lens is not None:
                args["sinks"] = torch.randn(16)
                args["tree_mask"] = torch.rand(5, 5, generator=torch.Generator().manual_seed(7)) < 0.5
            results = {}
            for threads in (1, 2, 8):
                torch.set_num_threads(threads)
                results[threads] = run_cpu(args)
                check_cpu(args, f"threads={threads} q_lens={q_lens}")
            for threads in (2, 8):
                assert relative_error(results[threads][0], results[1][0]) < 1e-6, (threads, q_lens)
                torch.testing.assert_close(results[threads][1], results[1][1], rtol=1e-6, atol=1e-6)
    finally:
        torch.set_num_threads(previous)


ISA_SCRIPT = textwrap.dedent("""
    import random, sys
    sys.path.insert(0, {tests!r})
    from attnops.backends import BACKENDS
    import test_mla as t
    print("isa", BACKENDS["cpu"].isa())
    rng = random.Random({seed})
    for i in range(8):
        spec, dtype = t.random_cpu_spec(rng)
        print(f"case {{i}} err={{t.check_cpu(t.spec_inputs(spec, 'cpu', dtype), str(spec)):.2e}}")
""")


@pytest.mark.parametrize("capability,isa", ISA_PARAMS)
def test_cpu_every_instruction_set(capability, isa):
    """Each compiled copy of the inner loops (the process picks one at first use, so each runs in a subprocess):
    their vectors are 8 or 16 floats, and R + P (80, 208, ...) is a whole number of either."""
    run_with_cpu_isa(ISA_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__)), seed=len(isa)),
                     capability, isa)


@pytest.mark.parametrize("q_lens", [None, [3, 2]], ids=["decode", "extend"])
@pytest.mark.parametrize("where,position", [("q_nope", 0), ("q_pe", 0), ("c", 0), ("c", 20), ("r", 20), ("r", 39),
                                            ("c", 39)])
def test_cpu_nan_reaches_the_same_rows_as_the_reference(q_lens, where, position, request):
    """A NaN in q, in a key's rotary part, or in a c part every row of the sequence sees, reaches exactly the rows
    that read it; the c part is also the value, so a NaN there that only the last query sees meets the other rows'
    masked weight 0 (docs/design.md: as paged attention's V)."""
    if where == "c" and q_lens is not None and position == 39:
        request.applymarker(pytest.mark.xfail(strict=True, reason="0 x NaN in the kernel's P @ V, as documented"))
    args = mla_inputs([40, 33], q_lens, heads=4, latent=64, rope=16, page_size=4, dtype=torch.float32, seed=1)
    page = args["block_table"][0, position // 4].item()
    if where in ("q_nope", "q_pe"):
        args[where][0, 1, 0] = float("nan")
    else:
        args["kv_cache"][page, position % 4, 3 + (64 if where == "r" else 0)] = float("nan")
    with attnops.use_backend("cpu"):
        out = torch.ops.attnops.mla_attention(**args)
    ref = mla_attention_reference(**args)
    assert torch.equal(out.isnan(), ref.isnan())
    torch.testing.assert_close(out[~ref.isnan()], ref[~ref.isnan()], rtol=1e-5, atol=1e-6)


def test_cpu_kernel_checks_shapes_when_called_directly():
    """The internal op checks what it reads (a C++ caller bypasses attnops' validation): a ValueError, not a read
    out of bounds."""
    args = mla_inputs([10, 7], None, heads=4)
    out = torch.empty_like(args["q_nope"])
    op = torch.ops.attnops.cpu_mla_attention
    call = (args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"], args["seq_lens"], None,
            args["scale"], None, None, None, out)
    op(*call)
    assert relative_error(out, mla_attention_reference(**args)) < 1e-3
    with pytest.raises(ValueError, match="kv_cache"):
        op(*call[:2], args["kv_cache"][..., :72], *call[3:])
    with pytest.raises(ValueError, match="seq_lens"):
        op(*call[:4], args["seq_lens"][:1], *call[5:])
    with pytest.raises(ValueError, match="kv_scale"):
        op(*call[:7], torch.ones(1), *call[8:])
    with pytest.raises(ValueError, match="kv_c"):
        torch.ops.attnops.cpu_mla_cache_write(torch.randn(2, 64), torch.randn(3, 16), torch.zeros(2, 4, 80),
                                              torch.tensor([0, 1]), None)


# ------------------------------------------------------------------------------------------------------------
# the ops: auto dispatch, the cache write, validation, bad indices, opcheck, compile, graphs


def test_the_op_on_the_cpu_is_the_cpu_kernel_and_pins_work():
    args = mla_inputs([20, 7], [3, 2], heads=4)
    want = mla_attention_reference(**args)
    assert attnops.explain(**args).chosen == "cpu"
    assert relative_error(torch.ops.attnops.mla_attention(**args), want) < 1e-2
    for backend in ("reference", "triton", "cpu"):
        with attnops.use_backend(backend):
            assert relative_error(torch.ops.attnops.mla_attention(**args), want) < 1e-2, backend
    with attnops.use_backend("flashinfer"), pytest.raises(ValueError, match="latent"):
        torch.ops.attnops.mla_attention(**args)
    out, lse = torch.ops.attnops.mla_attention_with_lse(**args)
    assert relative_error(out, want) < 1e-2 and lse.shape == (5, 4)


def test_explain_answers_for_latent_attention():
    args = mla_inputs([20, 7], [3, 2], heads=4)
    explanation = attnops.explain(**args)
    assert explanation.chosen == "cpu" and "latent_dim=64" in str(explanation)
    with attnops.use_backend("cuda"):
        rejected = attnops.explain(**args).rejected
        assert list(rejected) == ["cuda"] and "no CUDA GPU" in rejected["cuda"]
    write = attnops.explain(kv_c=torch.randn(3, 64).half(), k_pe=torch.randn(3, 16).half(),
                            kv_cache=torch.zeros(2, 4, 80, dtype=torch.half), slot_mapping=torch.arange(3))
    assert write.chosen == "cpu"


def test_flashinfer_declines_what_its_mla_kernels_are_not_built_for():
    from attnops.backends import flashinfer_mla
    from attnops.cases import MLACase
    case = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16", latent_dim=512,
                   rope_dim=64, num_heads=128, page_size=64, decode=True)
    assert flashinfer_mla.reasons(case) == []
    for change, words in [(dict(latent_dim=256), "R 256, P 64"), (dict(rope_dim=32), "R 512, P 32"),
                          (dict(kv_format="fp16"), "in q's dtype"), (dict(kv_format="fp8_e4m3"), "fp8_e4m3"),
                          (dict(q_dtype=torch.float32, kv_format="fp32"), "dtype"), (dict(sinks=True), "sinks"),
                          (dict(tree_mask=True), "tree_mask"), (dict(device_type="cpu", arch=None), "cuda"),
                          (dict(arch=(7, 5)), "sm_75")]:
        found = flashinfer_mla.reasons(MLACase(**{**case.__dict__, **change}))
        assert any(words in r for r in found), (change, found)


def test_only_latent_backends_serve_it_in_the_static_order_or_the_measured_rules(monkeypatch):
    from attnops import dispatch
    from attnops.cases import MLACase
    from attnops.dispatch import policy, reasons_against
    from attnops.backends import BACKENDS, Backend
    case = MLACase(device_type="cuda", arch=(9, 0), q_dtype=torch.bfloat16, kv_format="bf16", latent_dim=512,
                   rope_dim=64, num_heads=16, page_size=64, decode=True)
    with monkeypatch.context() as m:  # an arch without a measured latent-attention rule: the static order
        m.setattr(dispatch, "arch_table", lambda arch: {})
        assert policy(case) == ("flashinfer", "cuda", "triton", "reference")
    # sm_90's rule, fitted on graph-replayed times: FlashInfer's MLA plans on the host, so a decode graph passes it
    # over and the rule puts it last for decode
    assert policy(case)[2:] == ("flashinfer", "reference") and set(policy(case)[:2]) == {"cuda", "triton"}

    class PagedOnly(Backend):
        name = "paged-only"
    assert reasons_against(PagedOnly(), case) == ["has no latent-attention (MLA) kernels"]
    assert BACKENDS["flashinfer"].serves_mla  # (Triton serves what it declines: fp8 here)
    assert any("fp8_e4m3" in r for r in reasons_against(BACKENDS["flashinfer"], MLACase(**{**case.__dict__,
                                                                                        "kv_format": "fp8_e4m3"})))
    assert reasons_against(BACKENDS["cpu"], case) == ["runs on cpu, not cuda"]
    # on the CPU the C++ kernels come first, as for paged attention
    cpu_case = MLACase(**{**case.__dict__, "device_type": "cpu", "arch": None})
    assert policy(cpu_case) == ("cpu", "reference")
    assert reasons_against(BACKENDS["cpu"], cpu_case) == []


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
@pytest.mark.parametrize("kv_format", ["auto", "fp8_e4m3"])
def test_cache_write_quantizes_as_formats_does_and_skips_bad_slots(backend, kv_format):
    """mla_cache_write through each backend writes each row as attnops.formats quantizes it; padding and a bad
    slot write nothing (the bad one is recorded), and the attention op reads the rows back."""
    page_size, latent, rope = 4, 64, 32
    dtype = torch.float32 if kv_format == "auto" else torch.float16
    cache = torch.zeros(6, page_size, latent + rope, dtype=torch.float8_e4m3fn if kv_format != "auto" else dtype)
    kv_scale = torch.tensor([0.25]) if kv_format != "auto" else None
    kv_c, k_pe = torch.randn(10, latent).to(dtype), torch.randn(10, rope).to(dtype)
    slots = torch.tensor([8, 9, 10, 11, 12, 13, -1, 99, 0, 1])
    attnops.take_errors()
    with attnops.use_backend(backend):
        torch.ops.attnops.mla_cache_write(kv_c, k_pe, cache, slots, kv_format=kv_format, kv_scale=kv_scale)
    assert attnops.take_errors() == {"slot_mapping": 7}
    expected = torch.zeros_like(cache)
    mla_cache_write_reference(kv_c, k_pe, expected, slots, kv_format=kv_format, kv_scale=kv_scale)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache.view(torch.uint8)[[1, 4, 5]].eq(0).all()  # pages no good slot names are untouched
    rows = dict(q_nope=torch.randn(1, 2, latent).to(dtype), q_pe=torch.randn(1, 2, rope).to(dtype),
                block_table=torch.tensor([[2, 3]], dtype=torch.int32), seq_lens=torch.tensor([6], dtype=torch.int32),
                scale=0.2, kv_format=kv_format, kv_scale=kv_scale)
    with attnops.use_backend(backend):
        got = torch.ops.attnops.mla_attention(kv_cache=cache, **rows)
    # the rows at slots 8..13 as the cache holds them (fp8: dequantized), against what the write was given
    written = expected.flatten(0, 1)[8:14].double() * (kv_scale.double() if kv_scale is not None else 1.0)
    assert relative_error(written, torch.cat([kv_c[:6], k_pe[:6]], -1).double()) < (1e-7 if kv_format == "auto"
                                                                                    else 0.05)
    probs = torch.softmax(torch.cat([rows["q_nope"][0], rows["q_pe"][0]], -1).double() @ written.T * 0.2, -1)
    assert relative_error(got[0], probs @ written[:, :latent]) < (1e-5 if kv_format == "auto" else 2e-3)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_cache_write_into_a_strided_cache(backend):
    """A page-strided latent cache (every other page of a larger one) and a row-strided one are caches like any
    other (the reference wrote through a flat view, which they do not have)."""
    kv_c, k_pe = torch.randn(5, 64), torch.randn(5, 16)
    slots = torch.tensor([0, 5, 9, -1, 14])
    for cache in (torch.zeros(8, 4, 80)[::2], torch.zeros(4, 2, 4, 80)[:, 0]):
        expected = torch.zeros(cache.shape)
        expected.view(-1, 80)[slots[slots >= 0]] = torch.cat([kv_c, k_pe], -1)[slots >= 0]
        with attnops.use_backend(backend):
            torch.ops.attnops.mla_cache_write(kv_c, k_pe, cache, slots)
        assert torch.equal(cache, expected)


BAD = {
    "q_nope int": (TypeError, "q_nope", lambda a: dict(a, q_nope=a["q_nope"].int())),
    "q_pe rows": (ValueError, "q_pe", lambda a: dict(a, q_pe=a["q_pe"][:1])),
    "latent not a multiple of 64": (ValueError, "R", lambda a: dict(a, q_nope=torch.randn(5, 4, 48).half())),
    "rope too wide": (ValueError, "P", lambda a: dict(a, q_pe=torch.randn(5, 4, 80).half(),
                                                      kv_cache=torch.zeros(9, 4, 144, dtype=torch.half))),
    "cache width": (ValueError, "kv_cache", lambda a: dict(a, kv_cache=a["kv_cache"][..., :70])),
    "cache dtype": (TypeError, "kv_cache", lambda a: dict(a, kv_cache=a["kv_cache"].float())),
    "page size": (ValueError, "page_size", lambda a: dict(a, kv_cache=torch.zeros(9, 3, 80, dtype=torch.half))),
    "fp8 without scale": (ValueError, "kv_scale", lambda a: dict(a, kv_format="fp8_e4m3",
                                                                 kv_cache=a["kv_cache"].to(torch.float8_e4m3fn))),
    "scale for a plain cache": (ValueError, "kv_scale", lambda a: dict(a, kv_scale=torch.ones(1))),
    "unknown format": (ValueError, "kv_format", lambda a: dict(a, kv_format="nvfp4")),
    "no scale": (ValueError, "scale", lambda a: dict(a, scale=float("nan"))),
    "table dtype": (TypeError, "block_table", lambda a: dict(a, block_table=a["block_table"].long())),
    "seq_lens length": (ValueError, "seq_lens", lambda a: dict(a, seq_lens=a["seq_lens"][:1])),
    "cu_seqlens_q length": (ValueError, "cu_seqlens_q", lambda a: dict(a, cu_seqlens_q=a["cu_seqlens_q"][:2])),
    "sinks shape": (ValueError, "sinks", lambda a: dict(a, sinks=torch.zeros(3))),
    "tree_mask dtype": (TypeError, "tree_mask", lambda a: dict(a, tree_mask=torch.ones(5, 3, dtype=torch.int32))),
    "too many heads": (ValueError, "num_heads", lambda a: dict(a, q_nope=torch.randn(5, 129, 64).half(),
                                                               q_pe=torch.randn(5, 129, 16).half())),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_named_before_any_kernel_runs(name):
    error, argument, change = BAD[name]
    args = change(mla_inputs([10, 7], [3, 2], heads=4))
    with pytest.raises(error, match=rf"attnops\.mla_attention: .*\b{argument}\b"):
        torch.ops.attnops.mla_attention(**args)
    with pytest.raises(error, match=rf"\b{argument}\b"), torch._subclasses.FakeTensorMode(allow_non_fake_inputs=True):
        torch.ops.attnops.mla_attention(**args)


def test_outputs_that_overlap_an_input_or_each_other_are_named():
    args = mla_inputs([10, 7], [3, 2], heads=4)
    q = args["q_nope"]
    rows = q.shape[0] * q.shape[1]
    shared = torch.empty(q.numel(), dtype=q.dtype)  # out, and lse (float32) over its first bytes
    with pytest.raises(ValueError, match=r"mla_attention_with_lse: out must not share memory with lse"):
        torch.ops.attnops.mla_attention_with_lse.out(**args, out=shared.view(q.shape),
                                                     lse=shared.view(torch.float32)[:rows].view(q.shape[:2]))
    with pytest.raises(ValueError, match=r"mla_attention: out must not share memory with q_nope"):
        torch.ops.attnops.mla_attention.out(**args, out=q)
    with pytest.raises(ValueError, match=r"out must not overlap itself"):
        torch.ops.attnops.mla_attention.out(**args, out=torch.zeros(1, *q.shape[1:], dtype=q.dtype).expand(q.shape))


@pytest.mark.parametrize("backend", ["reference", "triton", "cpu"])
def test_bad_indices_follow_paged_attentions_rules(backend, monkeypatch):
    args = mla_inputs([10, 7, 12], [3, 2, 1], heads=4)
    args["seq_lens"][1] = 10_000  # sequence 1: NaN, nothing read
    args["block_table"][2, 1] = 999  # sequence 2's second page: its row sees it
    attnops.take_errors()
    with attnops.use_backend(backend):
        out = torch.ops.attnops.mla_attention(**args)
    assert attnops.take_errors() == {"seq_lens": 1, "block_table": 2}
    assert out[3:].isnan().all() and not out[:3].isnan().any()
    monkeypatch.setenv("ATTNOPS_CHECK", "1")
    with pytest.raises(ValueError, match=r"attnops\.mla_attention: seq_lens"):
        torch.ops.attnops.mla_attention(**args)


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_opcheck(backend, fp8_comparable):
    with attnops.use_backend(backend):
        for kv_format in ("auto", "fp8_e4m3"):
            args = mla_inputs([10, 7], [3, 2], heads=4, kv_format=kv_format)
            sinks = torch.randn(4)
            for extra in ({}, dict(sinks=sinks), dict(tree_mask=torch.rand(5, 3) < 0.5)):
                kwargs = {k: v for k, v in dict(args, **extra).items() if k not in ("q_nope", "q_pe", "kv_cache",
                                                                                     "block_table", "seq_lens")}
                pos = (args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"], args["seq_lens"])
                torch.library.opcheck(torch.ops.attnops.mla_attention.default, pos, kwargs)
                torch.library.opcheck(torch.ops.attnops.mla_attention_with_lse.default, pos, kwargs)
                torch.library.opcheck(torch.ops.attnops.mla_attention.out, pos,
                                      dict(kwargs, out=torch.empty_like(args["q_nope"])))
                torch.library.opcheck(torch.ops.attnops.mla_attention_with_lse.out, pos,
                                      dict(kwargs, out=torch.empty_like(args["q_nope"]),
                                           lse=torch.empty(args["q_nope"].shape[:2])))
        cache = torch.zeros(4, 4, 80, dtype=torch.float16)
        torch.library.opcheck(torch.ops.attnops.mla_cache_write.default,
                              (torch.randn(3, 64).half(), torch.randn(3, 16).half(), cache, torch.tensor([0, 5, -1])))
        cache = torch.zeros(4, 4, 80, dtype=torch.float8_e4m3fn)
        torch.library.opcheck(torch.ops.attnops.mla_cache_write.default,
                              (torch.randn(3, 64), torch.randn(3, 16), cache, torch.tensor([0, 5, -1])),
                              dict(kv_format="fp8_e4m3", kv_scale=torch.tensor([0.5])))


def test_compiles_fullgraph():
    args = mla_inputs([10, 7], None, heads=4)
    torch._dynamo.reset()

    def step(q_nope, q_pe, kv_cache, block_table, seq_lens):
        out = torch.ops.attnops.mla_attention(q_nope, q_pe, kv_cache, block_table, seq_lens, scale=0.13)
        return out * 2

    compiled = torch.compile(step, fullgraph=True)
    got = compiled(args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"], args["seq_lens"])
    assert relative_error(got, 2 * mla_attention_reference(**args)) < 1e-2


def check_user_graph_replays(backend: str, args: dict) -> None:
    """`backend`'s mla_attention.out captured in a plain torch.cuda.graph on args of three sequences (300, 40 and
    1000 keys), replayed with new lengths and the table's rows swapped, against the reference each time."""
    out = torch.empty_like(args["q_nope"])
    with attnops.use_backend(backend):
        torch.ops.attnops.mla_attention.out(**args, out=out)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.ops.attnops.mla_attention.out(**args, out=out)
    # each replay within the pages its rows now hold (the first flips the rows of 1000 and 300 keys)
    for lengths in ([900, 30, 250], [0, 1, 1000]):
        args["seq_lens"].copy_(torch.tensor(lengths))
        args["block_table"].copy_(args["block_table"].flip(0))
        graph.replay()
        assert relative_error(out, mla_attention_reference(**args)) < 1e-2, lengths


def check_reduce_overhead(backend: str, args: dict) -> None:
    """A step calling mla_attention under torch.compile(mode="reduce-overhead") with `backend` pinned, on args of
    two sequences (300 and 40 keys; with cu_seqlens_q, several query tokens a sequence), over new lengths, against
    the reference; the last makes the second sequence as short as its query tokens allow (1 key in decode)."""
    torch._dynamo.reset()
    scale = args["scale"]
    names = ["q_nope", "q_pe", "kv_cache", "block_table", "seq_lens"]
    shortest = 1
    if args.get("cu_seqlens_q") is not None:
        names.append("cu_seqlens_q")
        shortest = max(1, int(args["cu_seqlens_q"][2] - args["cu_seqlens_q"][1]))

    formats_ = dict(kv_format=args.get("kv_format", "auto"), kv_scale=args.get("kv_scale"))

    def step(*tensors):  # (mla_attention's positional order: names')
        return torch.ops.attnops.mla_attention(*tensors, scale=scale, **formats_)

    compiled = torch.compile(step, fullgraph=True, mode="reduce-overhead")
    with attnops.use_backend(backend):
        for lengths in ([300, 40], [12, 25], [299, shortest]):
            args["seq_lens"].copy_(torch.tensor(lengths))
            got = compiled(*(args[name] for name in names))
            assert relative_error(got, mla_attention_reference(**args)) < 1e-2, lengths


@pytest.mark.gpu
def test_a_user_cuda_graph_replays_new_lengths_and_tables():
    check_user_graph_replays("triton", mla_inputs([300, 40, 1000], None, heads=16, latent=512, rope=64, page_size=16,
                                                  dtype=torch.bfloat16, device="cuda"))


@pytest.mark.gpu
def test_compiled_with_cuda_graphs():
    check_reduce_overhead("triton", mla_inputs([300, 40], None, heads=16, latent=512, rope=64, page_size=16,
                                               dtype=torch.bfloat16, device="cuda"))


def test_triton_cache_write_is_the_references_bit_for_bit_with_nan_and_inf():
    for kv_format, dtype in (("auto", torch.float16), ("fp8_e4m3", torch.float32)):
        kv_c, k_pe = torch.randn(7, 128) * 3, torch.randn(7, 32) * 3
        kv_c[0, 0], kv_c[1, 1], k_pe[2, 0] = float("nan"), float("inf"), 1e6
        kv_c, k_pe = kv_c.to(dtype), k_pe.to(dtype)
        cache_dtype = torch.float8_e4m3fn if kv_format != "auto" else dtype
        a, b = torch.zeros(4, 4, 160, dtype=cache_dtype), torch.zeros(4, 4, 160, dtype=cache_dtype)
        slots = torch.tensor([0, 5, -1, 15, 16, -7, 3])
        scale = torch.tensor([0.7]) if kv_format != "auto" else None
        mla_cache_write(kv_c, k_pe, a, slots, kv_format=kv_format, kv_scale=scale)
        mla_cache_write_reference(kv_c, k_pe, b, slots, kv_format=kv_format, kv_scale=scale)
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), kv_format
    attnops.take_errors()
