"""``python benchmarks/fp8.py --rounds``: the turns (the run itself needs a GPU and DeepGEMM)."""

from __future__ import annotations

import pytest

from benchmarks import fp8


def test_turns_rotate_and_take_medians(monkeypatch):
    calls = []
    times = iter([1.0, 5.0, 9.0, 5.0, 8.0, 2.0, 7.0, 3.0, 6.0])
    monkeypatch.setattr(fp8, "_time", lambda fn, rep_ms: (calls.append((fn(), rep_ms)), next(times))[1])
    got = fp8._turns({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, 20.0, 3)
    assert [c[0] for c in calls] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert all(c[1] == 20.0 for c in calls)  # each turn: one timing with --rep-ms
    assert got == {"a": 2.0, "b": 5.0, "c": 8.0}


@pytest.mark.parametrize("arg", ["--rounds=-1", "--rep-ms=0"])
def test_counts_are_checked(arg, capsys):
    with pytest.raises(SystemExit):
        fp8.main([arg])
    assert arg.split("=")[0] in capsys.readouterr().err
