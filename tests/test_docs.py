"""The user docs (README.md, docs/*.md) stay true to the code and free of lab-notebook references.

* no run numbers, session numbers or commit hashes (the project's rule for user docs);
* every ``epmoe`` import, dotted name and ``module:Class`` they mention resolves;
* every relative link and every repository path they name exists;
* the Python blocks marked ``# runs as is on a CPU`` run.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHIVED = {"docs/archive.md"}
"""At most one archived page may keep its history (none does today)."""
PAGES = sorted(
    p for p in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")] if p.relative_to(ROOT).as_posix() not in ARCHIVED
)
RUN_OR_SESSION = re.compile(r"\b[Rr]uns? [0-9]{1,3}\b|\b[Ss]ession [0-9]{1,2}\b")
COMMIT = re.compile(r"(?<![\w./-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/-])")
FROM_IMPORT = re.compile(r"^[\s#]*from (epmoe[\w.]*) import \(?([\w, ]+)\)?\s*$", re.M)
DOTTED = re.compile(r"`(epmoe(?:\.\w+)+)`")
MODULE_CLASS = re.compile(r"\b(epmoe(?:\.\w+)+):(\w+)")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
REPO_PATH = re.compile(r"(?<![\w./-])((?:epmoe|docs|benchmarks|examples|tests)/[\w./-]*\w)")
NOT_SHIPPED = {"epmoe/configs/int8_crossover.json"}
"""Files the docs name that a GPU run writes (benchmarks/int8_crossover.py) and that ship once measured."""
RUNNABLE = re.compile(r"```python\n(# runs as is on a CPU\n.*?)```", re.S)


def _ids(pages):
    return [p.relative_to(ROOT).as_posix() for p in pages]


def _resolve(dotted: str) -> None:
    """Import ``dotted`` as a module, or as an attribute path below the longest importable prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as e:
            if e.name is not None and not dotted.startswith(e.name):
                raise  # a third-party import inside the module failed: a real error
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return
    raise ModuleNotFoundError(dotted)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_no_run_session_or_commit_references(page):
    text = page.read_text()
    assert not RUN_OR_SESSION.findall(text), RUN_OR_SESSION.findall(text)
    assert not COMMIT.findall(text), COMMIT.findall(text)


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_epmoe_names_resolve(page):
    text = page.read_text()
    for module, names in FROM_IMPORT.findall(text):
        mod = importlib.import_module(module)
        for name in (n.strip() for n in names.split(",") if n.strip()):
            assert hasattr(mod, name) or importlib.util.find_spec(f"{module}.{name}"), f"from {module} import {name}"
    for dotted in DOTTED.findall(text):
        _resolve(dotted)
    for module, name in MODULE_CLASS.findall(text):
        assert hasattr(importlib.import_module(module), name), f"{module}:{name}"


@pytest.mark.parametrize("page", PAGES, ids=_ids(PAGES))
def test_links_and_paths_exist(page):
    text = page.read_text()
    for target in LINK.findall(text):
        if "://" not in target:
            assert (page.parent / target).exists(), f"link {target}"
    for m in REPO_PATH.finditer(text):
        path, glob = m.group(1), text[m.end() : m.end() + 1] in ("*", "{")
        if not glob and "<" not in path and path not in NOT_SHIPPED and not path.startswith("benchmarks/results/TBD"):
            assert (ROOT / path).exists(), f"path {path}"


def test_runnable_blocks_run():
    blocks = [(p, b) for p in PAGES for b in RUNNABLE.findall(p.read_text())]
    assert blocks, "docs/getting-started.md keeps one runnable example"
    for page, block in blocks:
        exec(compile(block, str(page), "exec"), {"__name__": "__docs__"})


def test_no_merge_conflict_markers():
    """A merge left its markers in a committed page once; no text file of the tree may carry them."""
    suffixes = {".md", ".py", ".json", ".cu", ".cuh", ".cpp", ".toml", ".txt", ".cfg"}
    marker = re.compile(r"^(<{7} |={7}$|>{7} )", re.M)
    found = [
        str(p.relative_to(ROOT))
        for top in ("README.md", "CHANGELOG.md", "docs", "benchmarks", "epmoe", "examples", "tests")
        for p in ([ROOT / top] if (ROOT / top).is_file() else sorted((ROOT / top).rglob("*")))
        if p.suffix in suffixes and p.is_file() and marker.search(p.read_text(errors="replace"))
    ]
    assert not found, f"merge conflict markers in {found}"
