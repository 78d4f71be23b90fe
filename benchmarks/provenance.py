"""The commit a benchmark records in its JSON."""

from __future__ import annotations

import datetime
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def git_commit(given: str | None = None, fallback: str | None = "unknown") -> str | None:
    """``given`` (a ``--commit`` argument), else this checkout's ``git rev-parse HEAD`` (with
    ``-dirty`` appended when its tracked files differ from it: the tree measured is not that
    commit, as on a machine that received a copy of a working tree over an older checkout), else
    ``fallback`` (no git, or not a checkout)."""
    if given:
        return given
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT,
                              check=True).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return fallback
    return head + "-dirty" if git_dirty() else head


def git_dirty() -> bool | None:
    """Whether this checkout's tracked files differ from its HEAD; ``None`` without git."""
    try:
        return bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                   text=True, cwd=ROOT, check=True, timeout=30).stdout.strip())  # fmt: skip
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return None


def run_record(script: str, argv: list[str] | None, commit: str | None = None) -> dict:
    """What every result JSON of ``script`` (``benchmarks/<name>.py``) starts with: the date (UTC),
    the commit (:func:`git_commit`), the GPU, torch's version and the command as given (``argv``,
    else this process's arguments)."""
    import torch

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(commit),
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "torch": torch.__version__,
        "command": " ".join(["python", script, *(argv if argv is not None else sys.argv[1:])]),
    }
