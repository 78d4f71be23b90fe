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


def test_cli_info_lists_every_backend_and_dispatcher():
    out = subprocess.run(
        [sys.executable, "-m", "epmoe.cli", "info"], capture_output=True, text=True, timeout=300, cwd=ROOT
    )
    assert out.returncode == 0, out.stderr
    for name in ("torch", "triton", "deepgemm", "cutlass", "local", "all_to_all", "deepep_normal", "deepep_low_latency"):
        assert name in out.stdout
    assert "backend    torch int8_channel" in out.stdout and "available" in out.stdout
