"""The ``epmoe`` command's own argument handling (the subcommands have their own tests)."""

from __future__ import annotations

import pytest

from epmoe import cli


def test_unknown_command_is_named_on_stderr(capsys):
    assert cli.main(["bogus"]) == 2
    out = capsys.readouterr()
    assert "epmoe: unknown command 'bogus'; allowed: ['info'," in out.err and out.out == ""
    assert cli.main(["--help"]) == 0 and "commands:" in capsys.readouterr().out


def test_unknown_benchmark_is_named(capsys):
    assert cli.main(["bench", "gemm"]) == 2
    assert "epmoe bench: unknown benchmark 'gemm'; allowed: ['experts', 'layer']" in capsys.readouterr().err
    assert cli.main(["bench", "--help"]) == 0 and "usage: epmoe bench" in capsys.readouterr().out


def test_info_has_help_and_refuses_unknown_options(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["info", "--help"])
    assert exc.value.code == 0 and "every backend x scheme and every dispatcher" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["info", "--json"])
    assert exc.value.code == 2 and "unrecognized arguments: --json" in capsys.readouterr().err


def test_info_says_what_the_dispatcher_rows_assume(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert cli.INFO_DISPATCH_NOTE in out
    assert out.index(cli.INFO_DISPATCH_NOTE) < out.index("dispatcher ")


def test_info_rows_cover_the_int32_accumulator_and_contiguous_only_backends(monkeypatch):
    import torch

    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb.CutlassBackend, "available", classmethod(lambda cls, device: (True, "machine ok")))
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    rows = {name: status for kind, name, status in cli.capability_rows(torch.device("cpu")) if kind == "backend"}
    assert rows["cutlass int8_channel_int32"] == "available (contiguous layout only)"
    assert rows["cutlass fp8_block"] == "available (contiguous layout only)"
    assert "accumulator='int32' only" in rows["cutlass int8_channel"]
    assert rows["torch int8_channel_int32"] == "available"
