"""The command line: `python -m attnops info` and `python -m attnops demo` run and say what they should."""
import re
import subprocess
import sys

import torch


import pytest

SUBCOMMANDS = ("info", "demo", "warmup", "bench", "serve-bench", "tune")


def run(*args, ok=True, cwd=None):
    result = subprocess.run([sys.executable, "-m", "attnops", *args], capture_output=True, text=True, timeout=300,
                            cwd=cwd)
    if ok:
        assert result.returncode == 0, result.stderr
        return result.stdout
    return result


@pytest.mark.parametrize("command", SUBCOMMANDS)
def test_every_subcommand_answers_help(command):
    out = run(command, "--help")
    assert out.startswith(f"usage: python -m attnops {command}"), out[:200]
    # every option says what it is for: its help follows on the same line (after a gap) or the next one
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.rstrip().endswith(("options:", "arguments:")))
    silent = []
    for i, line in enumerate(lines[start + 1:], start + 1):
        if not line.startswith("  -"):
            continue
        described = re.search(r"\S\s{2,}\S", line.strip()) or (
            i + 1 < len(lines) and lines[i + 1].startswith(" " * 8) and not lines[i + 1].strip().startswith("-"))
        if not described:
            silent.append(line.strip())
    assert not silent, f"options without help in `{command} --help`: {silent}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of GPU-only commands")
def test_gpu_only_commands_refuse_in_one_line_on_a_cpu():
    result = run("tune", ok=False)
    assert result.returncode != 0
    message = result.stderr.strip().splitlines()[-1]
    assert "needs a CUDA GPU" in message and "--from-json" in message
    assert "Traceback" not in result.stderr


def test_bench_runs_the_cpu_grid_outside_a_source_checkout(tmp_path):
    out = run("bench", "--cpu", "--cases", "cpu-decode/4x512/fp32", "--rep-ms", "20", "--auto", cwd=tmp_path)
    assert "cpu-decode/4x512/fp32" in out and "x peer" in out and "auto" in out


def test_info_lists_backends_and_choices():
    out = run("info")
    assert "backends:" in out and "reference" in out
    assert "nvfp4 decode" in out and "->" in out
    replay = [line for line in out.splitlines() if "FlashInfer calls replayed from C++" in line]
    assert len(replay) == 1
    if not torch.cuda.is_available():  # a CPU torch never builds the C++ CUDA kernel
        assert "not in this build" in replay[0]


def test_demo_runs_a_decode_loop_and_prints_only_its_own_lines():
    """With no --model: a random Llama (tiny on a CPU) in transformers' modeling code, served through attnops."""
    result = run("demo", "--batch", "2", "--prompt-len", "8", "--steps", "4", ok=False)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "llama (transformers' modeling code)" in out, out
    assert "tokens/s" in out and "backend: prefill ->" in out
    assert re.search(r"step time: attention [\d.]+ ms \(\d+%\), rest", out), out
    assert "USDT" not in result.stderr + out  # the profiler's native trace lines


def test_demo_without_transformers_says_which_extra_to_install():
    """The demo serves transformers' modeling code: without transformers (the base install) it says so in a line."""
    code = "import sys; sys.modules['transformers'] = None; from attnops import cli; cli.main(['demo'])"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "pip install 'attnops[hf]'" in result.stderr, result.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's refusal")
def test_demo_refuses_cuda_graphs_on_a_cpu_in_one_line():
    result = run("demo", "--modes", "compiled+graphs", ok=False)
    assert result.returncode != 0
    assert result.stderr.strip().count("\n") == 0 and "needs a CUDA device" in result.stderr, result.stderr


def test_help_answers():
    out = run("--help")
    assert "info" in out and "demo" in out and "serve-bench" in out
    out = run("serve-bench", "--help")
    assert "--batches" in out and "transformers" in out


def test_warmup_builds_each_mode():
    out = run("warmup", "--dtype", "fp32", "--kv-format", "fp32", "--head-dim", "64", "--num-q-heads", "8",
              "--num-kv-heads", "2")
    for mode in ("prefill", "verify", "decode"):
        assert f"8/2/64 {mode}" in out


def test_warmup_takes_every_layer_shape_of_a_config(tmp_path):
    """--config: each distinct (KV heads, head dim) of the model's layers (Gemma-4's sliding and full layers)."""
    transformers = pytest.importorskip("transformers")
    if "gemma4_text" not in transformers.CONFIG_MAPPING:
        pytest.skip("this transformers has no Gemma-4")
    transformers.AutoConfig.for_model(
        "gemma4_text", num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        global_head_dim=64, num_global_key_value_heads=1, attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"],
        hidden_size=64).save_pretrained(tmp_path)
    out = run("warmup", "--dtype", "fp32", "--kv-format", "fp32", "--config", str(tmp_path / "config.json"))
    assert "4/2/32 decode" in out and "4/1/64 decode" in out, out


def test_warmup_of_a_latent_attention_config_warms_mla_attention(tmp_path):
    """A DeepSeek config: mla_attention and mla_cache_write at its heads and latent row, not paged attention."""
    transformers = pytest.importorskip("transformers")
    transformers.AutoConfig.for_model(
        "deepseek_v3", num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, q_lora_rank=None, hidden_size=64).save_pretrained(tmp_path)
    out = run("warmup", "--dtype", "fp32", "--kv-format", "fp32", "--config", str(tmp_path))
    for mode in ("prefill", "verify", "decode"):
        assert f"MLA 4/64+16 {mode}" in out, out
    assert "4/4/" not in out


def test_warmup_of_a_sparse_latent_attention_config_warms_the_sparse_form(tmp_path):
    """A DeepSeek-V3.2 config: mla_attention's sparse form (its own kernel variant) at the indexer's top-k."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "DeepseekV32Config"):
        pytest.skip("this transformers has no DeepSeek-V3.2")
    transformers.AutoConfig.for_model(
        "deepseek_v32", num_hidden_layers=1, num_attention_heads=4, kv_lora_rank=64, qk_rope_head_dim=16,
        qk_nope_head_dim=32, v_head_dim=32, hidden_size=64, index_topk=32, index_n_heads=2,
        index_head_dim=32).save_pretrained(tmp_path)
    out = run("warmup", "--dtype", "fp32", "--kv-format", "fp32", "--config", str(tmp_path))
    for mode in ("prefill", "verify", "decode"):
        assert f"MLA 4/64+16 top-32 {mode:<8} -> cpu" in out, out
