"""The package's layers only point down: every import inside attnops goes to a module of its own layer or a lower
one (read from the source, so an import inside a function counts too). A new module must be given a layer here.
docs/design.md draws the same map."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "attnops"

# lowest first; a module belongs to the longest prefix listed
LAYERS = [
    ("attnops._C", "attnops.env", "attnops.formats", "attnops.cases", "attnops.capture",
     "attnops.errors", "attnops.invariance"),  # contract and helpers
    ("attnops.rules", "attnops.checks", "attnops.checks_mla", "attnops.testing"),  # the dispatch rule, validation,
    # test inputs
    ("attnops.backends",),  # kernels behind the Backend interface: they see cases, never checks or dispatch
    ("attnops.dispatch",),  # which backend serves a case
    ("attnops.ops", "attnops.cascade"),  # the torch.library registrations; cascade attention composed of them
    ("attnops.serving",),  # the serving kit: cache, graphs, generation, demo
    ("attnops.hf",),  # transformers models through the ops and the serving kit, and their tensor parallelism
    ("attnops.cli", "attnops.__main__", "attnops.bench", "attnops"),  # the facade, the command line, benchmarks
]


def layer_of(module: str) -> int:
    best = None
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    if best is None:
        raise AssertionError(f"{module} has no layer: add it to tests/test_layers.py's LAYERS")
    return best[0]


def modules():
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        yield name, path, parts[-1] == "__init__"


def imports(name: str, path: Path, is_package: bool):
    package = name if is_package else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "attnops":
                    yield node.lineno, alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "attnops":
                continue
            for alias in node.names:  # `from . import formats` imports the module attnops.formats
                candidate = f"{target}.{alias.name}"
                where = ROOT.parent / Path(*candidate.split("."))
                is_module = where.with_suffix(".py").exists() or where.is_dir() or \
                    any(where.parent.glob(where.name + ".*.so")) or candidate == "attnops._C"  # (before a build)
                yield node.lineno, candidate if is_module else target


@pytest.mark.parametrize("name,path,is_package", list(modules()), ids=lambda v: v if isinstance(v, str) else "")
def test_imports_point_down(name, path, is_package):
    own = layer_of(name)
    upward = [f"line {line}: {target} (layer {layer_of(target)} above {own})"
              for line, target in imports(name, path, is_package) if layer_of(target) > own]
    assert not upward, f"{name} imports up a layer: " + "; ".join(upward)


def test_the_walk_sees_upward_imports(tmp_path):
    """The checker itself: a backend importing dispatch, or checks importing the serving kit, is flagged."""
    assert layer_of("attnops.dispatch") > layer_of("attnops.backends.triton.launch")
    assert layer_of("attnops.serving.graphs") > layer_of("attnops.checks")
    fake = tmp_path / "x.py"
    fake.write_text("from ...dispatch import select_backend\nfrom ...serving import graphs\nimport attnops.ops\n"
                    "from .common import FMT_CODE\n")
    found = [t for _, t in imports("attnops.backends.triton.x", fake, False)]
    assert found == ["attnops.dispatch", "attnops.serving.graphs", "attnops.ops", "attnops.backends.triton.common"]
    own = layer_of("attnops.backends.triton.x")
    assert [layer_of(t) > own for t in found] == [True, True, True, False]
