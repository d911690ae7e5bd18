"""The CMake build for C++ users: configure and build the op library and the programs of csrc/examples, then run
them. schema_check lists the op schemas; cpu_paged_attention writes a paged cache with attnops::reshape_and_cache
and runs attnops::paged_attention on CPU tensors through the dispatcher (served by the library's own C++ CPU
kernels: the CMake build defines ATTNOPS_STANDALONE), checking the results against ATen.

The build directory (build/cmake-test, or $ATTNOPS_CMAKE_BUILD_DIR) is kept between runs, so a re-run only
recompiles what changed; a first build takes a minute or two on two cores.
"""
from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILD_DIR = os.environ.get("ATTNOPS_CMAKE_BUILD_DIR", os.path.join(ROOT, "build", "cmake-test"))

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed")]


def run(cmd, **kwargs):
    result = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
    assert result.returncode == 0, f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout[-4000:]}\n" \
                                   f"{result.stderr[-4000:]}"
    return result.stdout


@pytest.fixture(scope="module")
def cmake_build():
    os.makedirs(BUILD_DIR, exist_ok=True)
    run(["cmake", "-S", ROOT, "-B", BUILD_DIR, f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
         "-DCMAKE_BUILD_TYPE=Release"], timeout=600)
    run(["cmake", "--build", BUILD_DIR, "-j", str(os.cpu_count() or 2)], timeout=1800)
    return BUILD_DIR


def test_schema_check(cmake_build):
    out = run([os.path.join(cmake_build, "attnops_schema_check")], timeout=120)
    for name in ("attnops::paged_attention(", "attnops::paged_attention.out(", "attnops::paged_attention_with_lse(",
                 "attnops::paged_attention_with_lse.out(", "attnops::reshape_and_cache("):
        assert name in out


def test_cpp_program_calls_paged_attention_on_cpu(cmake_build):
    out = run([os.path.join(cmake_build, "attnops_cpu_paged_attention")], timeout=120)
    print(out)
    assert "FAIL" not in out and out.strip().endswith("PASSED")
    assert out.count("ok:") == 5  # every check ran
