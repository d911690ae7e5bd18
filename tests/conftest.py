"""Test set-up. Without a GPU, Triton kernels run in its interpreter (TRITON_INTERPRET=1), which must be set
before triton (and so attnops) is imported. Tests marked `gpu` are skipped where CUDA is unavailable.

Also the tiny transformers models the tests serve through attnops.hf (`from conftest import make_config, build`):
the families are attnops.hf's (none without transformers, so that test files without it still run)."""
import copy
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

os.environ.pop("ATTNOPS_BACKEND", None)  # tests pin backends themselves
os.environ.pop("ATTNOPS_CHECK", None)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fp8_comparable(monkeypatch):
    """opcheck's test_schema detects mutation with torch.allclose, which has no fp8 kernel on the CPU
    ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). Compare fp8 tensors bit for bit instead:
    stricter than allclose, and the check still runs."""
    allclose = torch.allclose
    fp8 = (torch.float8_e4m3fn, torch.float8_e5m2)

    def allclose_with_fp8(lhs, rhs, *args, **kwargs):
        if lhs.dtype in fp8 and rhs.dtype in fp8:
            return torch.equal(lhs.view(torch.uint8), rhs.view(torch.uint8))
        return allclose(lhs, rhs, *args, **kwargs)

    monkeypatch.setattr(torch, "allclose", allclose_with_fp8)


# Tiny random transformers decoders, one config per family. head_dim 32 (Triton serves it too: 32/64/128/256). A
# wide init (0.2, not transformers' 0.02) gives clear gaps between the top logits, so greedy choices are the
# model's, not rounding's, and vary.
TINY_HF = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=32, max_position_embeddings=512, initializer_range=0.2,
               bos_token_id=None, eos_token_id=None, pad_token_id=0)  # no eos: every run makes all its tokens
# each family of attnops.hf.families (so that a family added there is tested here), with the overrides that make its
# attention features show at the tiny size
HF_TEST_OVERRIDES = {
    "qwen2": dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),  # layer 1 slides
    "qwen3": {},  # qk-norm (transformers' code, before attention)
    "mistral": dict(sliding_window=8),
    # untied: a tied Gemma-2 this small repeats one token
    "gemma2": dict(sliding_window=8, attn_logit_softcapping=5.0, final_logit_softcapping=5.0,
                   query_pre_attn_scalar=24, tie_word_embeddings=False),
    "phi3": dict(sliding_window=8, head_dim=96),  # head dim 96: a padded tile (Triton) and the CPU kernels' own
    "gpt-oss": dict(sliding_window=8, num_local_experts=4, num_experts_per_tok=2, intermediate_size=128,
                    max_position_embeddings=131072),  # yarn's factor 32 x 4096
}


def _hf_families():
    """{family: (model_type, overrides)} for every family attnops.hf serves; {} without transformers."""
    try:
        from attnops.hf.families import FAMILIES
    except ImportError:
        return {}
    unknown = set(HF_TEST_OVERRIDES) - set(FAMILIES)
    assert not unknown, f"HF_TEST_OVERRIDES names families attnops.hf does not have: {unknown}"
    return {name: (spec.model_type, HF_TEST_OVERRIDES.get(name, {})) for name, spec in FAMILIES.items()}


HF_FAMILIES = _hf_families()


def make_config(family, **overrides):
    """transformers' config of a tiny `family` model (TINY_HF, the family's overrides, then `overrides`)."""
    import transformers
    model_type, extra = HF_FAMILIES[family]
    return transformers.AutoConfig.for_model(model_type, **{**TINY_HF, **extra, **overrides})


def build(config, implementation, state=None):
    """A model of `config` in eval mode with attn_implementation `implementation` ("eager", "attnops", ...), with
    the weights `state` if given (else random)."""
    import transformers
    # from_config sets the implementation on the config it is given: each model gets its own copy
    model = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=implementation)
    if state is not None:
        model.load_state_dict(state)
    return model.eval().requires_grad_(False)


# The CPU kernels' instruction-set copies: the process picks one at first use, so each runs in a subprocess with
# ATEN_CPU_CAPABILITY set; the copies exist as `isa` (attnops' name) for a `capability` (ATen's).
ISA_PARAMS = [("default", "default"), ("avx2", "avx2"), ("avx512", "avx512")]


def run_with_cpu_isa(script: str, capability: str, isa: str) -> str:
    """Runs `script` (Python source whose first printed line is "isa <the copy in use>") under ATen's
    `capability`: skips where this CPU lacks it, fails unless the script succeeds on copy `isa`; its output."""
    expected = {"default": True, "avx2": torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"),
                "avx512": torch.backends.cpu.get_cpu_capability() == "AVX512"}
    if not expected[isa]:
        pytest.skip(f"this CPU has no {isa}")
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    print(result.stdout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines()[0] == f"isa {isa}"
    return result.stdout
