"""The package's boundaries (issue 21): what ``epmoe/`` may import, read from its sources with ``ast``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "epmoe"


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = parts[: len(parts) - node.level]
                base = ".".join([*up, base] if base else up)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_sources_are_found_and_relative_imports_resolved():
    assert len(SOURCES) > 40 and PACKAGE / "layer.py" in SOURCES
    assert "epmoe.routing" in _imports(PACKAGE / "layer.py")
    assert "epmoe.tensors.check_positive_int" in _imports(PACKAGE / "kernels" / "common.py")


def test_the_runtime_imports_no_benchmark_and_no_triton_interpreter():
    """benchmarks/ are scripts beside the package; Triton's interpreter is patched by the tests only."""
    bad = {}
    for path in SOURCES:
        names = {n for n in _imports(path) if n.split(".")[0] == "benchmarks" or n.startswith("triton.runtime.interpreter")}
        if names:
            bad[str(path.relative_to(PACKAGE))] = sorted(names)
    assert not bad


@pytest.mark.parametrize("seam, other", [("dispatch", "experts"), ("experts", "dispatch"), ("kernels", "dispatch"),
                                         ("kernels", "experts"), ("kernels", "layer"), ("kernels", "integrations")])
def test_seams_keep_their_layering(seam, other):
    """dispatch and experts never import each other; kernels import nothing above them."""
    for path in (PACKAGE / seam).rglob("*.py"):
        bad = {n for n in _imports(path) if n == f"epmoe.{other}" or n.startswith(f"epmoe.{other}.")}
        assert not bad, (path, bad)


def test_importing_the_layer_leaves_torch_dynamo_unimported():
    """``torch._dynamo`` costs about a second to import (every spawned rank and CLI call pays it);
    only the dispatchers and backends that need compiler decorators import it, when chosen."""
    import subprocess
    import sys

    code = ("import sys, epmoe, epmoe.layer, epmoe.linear; assert 'torch._dynamo' not in sys.modules, "
            "'imported torch._dynamo'; from epmoe.dispatch.deepep_dispatch import DeepEPNormalDispatcher; "
            "assert 'torch._dynamo' in sys.modules")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=PACKAGE.parent)
    assert done.returncode == 0, done.stderr[-2000:]
