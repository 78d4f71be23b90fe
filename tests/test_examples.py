import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_deepseek_block_example_runs():
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "examples", "deepseek_moe_block.py")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "finite: True" in out.stdout


def test_cli_info_lists_every_backend_and_dispatcher(capsys):
    # In this process: `python -m epmoe.cli` as a command is run by tests/test_cli.py (demo -v and
    # the --help of every command), so a subprocess here only paid for a second torch import.
    from epmoe import cli

    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "triton", "deepgemm", "cutlass", "local", "all_to_all", "deepep_normal", "deepep_low_latency"):
        assert name in out
    assert "backend    torch int8_channel" in out and "available" in out
