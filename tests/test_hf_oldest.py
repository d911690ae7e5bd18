"""attnops.hf on the oldest transformers pyproject.toml allows: the environment installs the newest, so this runs
tests/test_hf.py once more in a subprocess, with the oldest version installed (from the package index, with its own
dependencies) into a temporary directory ahead of the environment's packages."""
from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("transformers")
from packaging.requirements import Requirement  # noqa: E402  (transformers depends on packaging)

ROOT = Path(__file__).resolve().parents[1]


def oldest_supported() -> str:
    """The lower bound of the `hf` extra's transformers requirement (">=X")."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    (req,) = [Requirement(r) for r in extras["hf"] if Requirement(r).name == "transformers"]
    (lower,) = [s.version for s in req.specifier if s.operator == ">="]
    return lower


def test_oldest_supported_transformers_is_the_hf_extras_lower_bound():
    assert oldest_supported() == "5.17"


@pytest.mark.skipif(os.environ.get("ATTNOPS_TEST_OLDEST_TRANSFORMERS") == "0",
                    reason="ATTNOPS_TEST_OLDEST_TRANSFORMERS=0 (no package index here)")
def test_hf_suite_passes_on_the_oldest_supported_transformers(tmp_path):
    import transformers
    from packaging.version import Version
    oldest = oldest_supported()
    if Version(transformers.__version__) == Version(oldest):
        pytest.skip(f"the environment has transformers {oldest}: tests/test_hf.py runs on it already")
    site = tmp_path / "site"
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check",
                          "--target", str(site), f"transformers=={oldest}.*"],
                         capture_output=True, text=True, timeout=1200)
    assert pip.returncode == 0, f"installing transformers {oldest} failed (set ATTNOPS_TEST_OLDEST_TRANSFORMERS=0 " \
                                f"where no package index is reachable):\n{pip.stderr[-3000:]}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))}
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert Version(version.stdout.strip()).release[:2] == Version(oldest).release[:2], version
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_hf.py"],
                         capture_output=True, text=True, env=env, cwd=ROOT, timeout=3000)
    assert run.returncode == 0, f"tests/test_hf.py on transformers {oldest}:\n{run.stdout[-6000:]}\n{run.stderr[-2000:]}"
    assert " passed" in run.stdout.splitlines()[-1], run.stdout[-2000:]
