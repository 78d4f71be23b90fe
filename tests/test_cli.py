"""The ``epmoe`` command line: subcommands, exit codes, --version, --help without torch, info --json, -v."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import epmoe
from epmoe import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = (["info"], ["demo"], ["bench"], ["bench", "experts"], ["bench", "layer"], ["convert"], ["make-checkpoint"],
            ["fidelity"])


def _epmoe(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "epmoe.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)  # fmt: skip


def test_version_is_the_installed_metadata(capsys):
    from importlib import metadata

    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"epmoe {metadata.version('epmoe')}" == f"epmoe {epmoe.__version__}"


def test_no_command_prints_usage_and_exits_2(capsys):
    assert cli.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: epmoe") and "a command is required" in err
    assert cli.main(["bench"]) == 2 and "a benchmark is required" in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [(["bogus"], "'bogus'"), (["bench", "gemm"], "'gemm'"), (["info", "--nope"], "--nope")])
def test_unknown_commands_and_options_exit_2_naming_them(argv, named, capsys):
    assert cli.main(argv) == 2
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("argv, named", [
    (["--groups", "3"], "--groups=3; allowed: a divisor of --experts=32"),
    (["--topk-groups", "5"], "--topk-groups=5; allowed: 1 to --groups=4"),
    (["--top-k", "20", "--topk-groups", "2"], "--top-k=20; allowed: at most the 16 experts of --topk-groups=2"),
    (["--groups", "0"], "--groups=0 must be >= 1"),
])  # fmt: skip
def test_demo_routing_flags_are_checked_by_their_names(argv, named, capsys):
    # An argument error, not a 'skipped' row of every scheme.
    assert cli.main(["demo", "--experts", "32", *argv]) == 2
    assert named in capsys.readouterr().err


def test_help_of_every_command_exits_0_without_importing_torch():
    """One subprocess: every --help parses, shows defaults, and leaves torch unimported."""
    code = (
        "import sys\n"
        "from epmoe import cli\n"
        f"for argv in {[[*c, '--help'] for c in [[], *COMMANDS]]!r}:\n"
        "    assert cli.main(argv) == 0, argv\n"
        "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))[:5]\n"
        "print('ok')\n"
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-2000:]
    assert "(default: 2)" in out.stdout and "--log-level {DEBUG,INFO,WARNING,ERROR}" in out.stdout


def test_every_option_has_help_text():
    parser = cli.build_parser()
    todo = [parser]
    while todo:
        p = todo.pop()
        for action in p._actions:
            if action.choices and isinstance(action.choices, dict):  # subparsers
                todo.extend(action.choices.values())
            elif action.option_strings:
                assert action.help, f"{p.prog} {action.option_strings} has no help text"


def test_info_json_has_one_entry_per_backend_x_scheme_and_dispatcher(capsys):
    from epmoe.dispatch.select import DISPATCHERS
    from epmoe.experts.select import BACKENDS
    from epmoe.quant.schemes import SCHEMES

    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    keys = [*SCHEMES, "int8_channel_int32"]
    assert sorted((b["backend"], b["scheme"]) for b in report["backends"]) == sorted((n, k) for n in BACKENDS for k in keys)
    assert [d["dispatcher"] for d in report["dispatchers"]] == list(DISPATCHERS)
    assert report["epmoe"] == epmoe.__version__ and report["dispatcher_note"] == cli.INFO_DISPATCH_NOTE
    torch_bf16 = next(b for b in report["backends"] if (b["backend"], b["scheme"]) == ("torch", "bf16"))
    assert torch_bf16["available"] is True and torch_bf16["status"] == "available"


def test_info_says_what_the_dispatcher_rows_assume(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert cli.INFO_DISPATCH_NOTE in out
    assert out.index(cli.INFO_DISPATCH_NOTE) < out.index("dispatcher ")


def test_demo_verbose_shows_the_reason_of_every_choice():
    out = _epmoe("demo", "-v", "--schemes", "bf16", "--experts", "8", "--top-k", "2", "--groups", "2",
                 "--topk-groups", "1", "--hidden", "64", "--intermediate", "32", "--tokens", "8", "--iters", "1")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    for rank in (0, 1):
        assert f"epmoe: rank {rank}: dispatcher 'all_to_all' chosen" in out.stderr
        assert f"epmoe: rank {rank}: dispatcher 'deepep_normal' refused: " in out.stderr
        assert f"epmoe: rank {rank}: experts backend 'torch' chosen" in out.stderr
    # Without -v: no reasons. One rank is enough (its 'local' dispatcher is chosen at INFO too) and
    # spawns, imports and runs half of what two would.
    quiet = _epmoe("demo", "--ranks", "1", "--schemes", "bf16", "--experts", "8", "--top-k", "2", "--groups", "2",
                   "--topk-groups", "1", "--hidden", "64", "--intermediate", "32", "--tokens", "8", "--iters", "1")  # fmt: skip
    assert quiet.returncode == 0 and "chosen" not in quiet.stderr


def test_plot_without_matplotlib_names_the_extra(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    assert cli.main(["bench", "experts", "--plot", "x.png"]) == 2
    assert "--plot x.png needs matplotlib, which is not installed: pip install 'epmoe[plot]'" in capsys.readouterr().err


def test_info_rows_cover_the_int32_accumulator_and_contiguous_only_backends(monkeypatch):
    import torch

    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb.CutlassBackend, "available", classmethod(lambda cls, device: (True, "machine ok")))
    monkeypatch.setattr(cb, "own_kernel_missing", lambda: None)
    rows = {name: status for kind, name, status in cli.capability_rows(torch.device("cpu")) if kind == "backend"}
    assert rows["cutlass int8_channel_int32"] == rows["cutlass int8_block"] == "available"  # masked too
    assert rows["cutlass fp8_block"] == "available (contiguous layout only)"
    rules = {name: status for kind, name, status in cli.capability_rows(torch.device("cpu")) if kind == "int8 rule"}
    name = cb.int8_block_schedule(torch.device("cpu"))
    assert rules["cutlass int8_block schedule"].startswith(f"{name} (128 x {cb.INT8_BLOCK_TILE_N[name]} tiles; "
                                                           "$EPMOE_INT8_BLOCK_SCHEDULE")  # fmt: skip
    monkeypatch.setenv(cb.INT8_BLOCK_SCHEDULE_ENV, "fastest")
    rules = {name: status for kind, name, status in cli.capability_rows(torch.device("cpu")) if kind == "int8 rule"}
    assert "EPMOE_INT8_BLOCK_SCHEDULE (from the environment)='fastest'; allowed" in rules["cutlass int8_block schedule"]
    assert "accumulator='int32' only" in rows["cutlass int8_channel"]
    assert rows["torch int8_channel_int32"] == "available"
