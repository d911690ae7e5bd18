"""The command line: `python -m attnops info` and `python -m attnops demo` run and say what they should."""
import subprocess
import sys

import torch


def run(*args):
    result = subprocess.run([sys.executable, "-m", "attnops", *args], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_info_lists_backends_and_choices():
    out = run("info")
    assert "backends:" in out and "reference" in out
    assert "nvfp4 decode" in out and "->" in out
    replay = [line for line in out.splitlines() if "FlashInfer calls replayed from C++" in line]
    assert len(replay) == 1
    if not torch.cuda.is_available():  # a CPU torch never builds the C++ CUDA kernel
        assert "not in this build" in replay[0]


def test_demo_runs_a_decode_loop():
    out = run("demo", "--batch", "2", "--prompt-len", "8", "--steps", "4")
    assert "tokens/s" in out and "backend: prefill ->" in out


def test_help_answers():
    out = run("--help")
    assert "info" in out and "demo" in out and "serve-bench" in out
    out = run("serve-bench", "--help")
    assert "--batches" in out and "transformers" in out


def test_warmup_builds_each_mode():
    out = run("warmup", "--dtype", "fp32", "--kv-format", "fp32", "--head-dim", "64", "--num-q-heads", "8",
              "--num-kv-heads", "2")
    for mode in ("prefill", "verify", "decode"):
        assert f"{mode}" in out
