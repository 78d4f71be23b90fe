"""The commit a benchmark records: the checkout's HEAD, marked when the tree measured differs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import provenance  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root, *args):
    return subprocess.run(["git", *args], cwd=root, check=True, capture_output=True, text=True).stdout.strip()


def test_git_commit_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "a.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "a")
    head = _git(tmp_path, "rev-parse", "HEAD")
    monkeypatch.setattr(provenance, "ROOT", tmp_path)
    assert provenance.git_commit() == head
    (tmp_path / "a.py").write_text("x = 2\n")  # what a copied working tree over an old checkout looks like
    assert provenance.git_commit() == head + "-dirty"
    assert provenance.git_commit("abc1234") == "abc1234"  # --commit wins
    monkeypatch.setattr(provenance, "ROOT", tmp_path / "missing")
    assert provenance.git_commit(fallback=None) is None
