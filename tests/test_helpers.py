"""The test helpers that decide where the GPU tests build: one directory and one answer per pytest
session, whatever the number of xdist workers (tests/gpu/test_fp8_backends.py's CUTLASS build)."""

from __future__ import annotations

from helpers import decide_once, session_shared_dir


class FakeFactory:
    """``tmp_path_factory`` with a given basetemp; records the names it was asked to ``mktemp``."""

    def __init__(self, base):
        self.base, self.made = base, []

    def getbasetemp(self):
        return self.base

    def mktemp(self, name):
        self.made.append(name)
        path = self.base / f"{name}0"
        path.mkdir(parents=True)
        return path


def test_xdist_workers_share_one_directory(tmp_path, monkeypatch):
    got = []
    for worker in ("gw0", "gw1", "gw2"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        factory = FakeFactory(tmp_path / f"popen-{worker}")
        got.append(session_shared_dir(factory, "epmoe-cache-fresh"))
        assert factory.made == []
    assert got == [tmp_path / "epmoe-cache-fresh"] * 3
    assert got[0].is_dir()


def test_without_xdist_the_directory_is_this_process_own(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    factory = FakeFactory(tmp_path / "pytest-7")
    assert session_shared_dir(factory, "c") == tmp_path / "pytest-7" / "c0"
    # A worker whose basetemp is not xdist's popen-<id> (a remote node): the parent may be shared
    # with other sessions, so it gets its own directory too.
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw0")
    factory = FakeFactory(tmp_path / "pytest-8")
    assert session_shared_dir(factory, "c") == tmp_path / "pytest-8" / "c0"
    assert factory.made == ["c"]


def test_the_first_answer_holds_for_every_later_caller(tmp_path):
    record = tmp_path / "decision"
    assert decide_once(record, lambda: True) is True
    # The condition changed (the first worker built in the cache it looked at): later workers
    # still get the first answer and do not ask again.
    assert decide_once(record, lambda: 1 / 0) is True
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decision"]
    other = tmp_path / "other"
    assert decide_once(other, lambda: False) is False
    assert decide_once(other, lambda: True) is False


def test_a_caller_that_loses_the_race_takes_the_winner_answer(tmp_path):
    record = tmp_path / "decision"

    def decide():
        record.write_text("no")  # another worker linked its answer while this one was deciding
        return True

    assert decide_once(record, decide) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decision"]
