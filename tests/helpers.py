"""Shared test fixtures: synthetic expert weights; multi-process launching is epmoe.launch."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from epmoe.quant import dequantize_weight, get_scheme, quantize_weight

SCHEME_NAMES = ("bf16", "int8_channel", "int8_block", "fp8_block")

GPU_WORLD_ENV = "EPMOE_TEST_GPUS"
"""Ranks of the multi-GPU EP tests (tests/gpu/test_ep_nccl.py, test_deepep.py); default 2.
``benchmarks/ep_scaling.py --gpus N`` runs them with it set to N."""


def gpu_world_size() -> int:
    """The multi-GPU EP tests' rank count from ``EPMOE_TEST_GPUS`` (an integer >= 2; default 2)."""
    raw = os.environ.get(GPU_WORLD_ENV, "2")
    try:
        world = int(raw)
    except ValueError:
        world = 0
    if world < 2:
        raise ValueError(f"{GPU_WORLD_ENV}={raw!r}; allowed: an integer >= 2 (ranks, one GPU each)")
    return world


def deepep_gpu_marks(world: int) -> list:
    """The marks of the multi-GPU DeepEP tests: ``gpu`` and ``multigpu``, skipped unless ``world``
    CUDA GPUs are present and ``deep_ep`` imports (with the reason)."""
    import pytest

    try:
        import deep_ep  # noqa: F401

        reason = ""
    except Exception as exc:  # noqa: BLE001 - any import failure means skip
        reason = f"deep_ep is not importable ({exc})"
    enough = torch.cuda.is_available() and torch.cuda.device_count() >= world
    return [
        pytest.mark.gpu, pytest.mark.multigpu,
        pytest.mark.skipif(not enough, reason=f"needs {world} CUDA GPUs"),
        pytest.mark.skipif(bool(reason), reason=reason or "deep_ep present"),
    ]  # fmt: skip


def make_weights(num_experts: int, hidden: int, inter: int, scheme: str, seed: int = 0):
    """Random global weights for ``scheme``.

    Returns ``(stored, dequantized)``: ``stored = (w13, w2, w13_scale, w2_scale)`` as the layer
    loads them, ``dequantized = (w13, w2)`` float32 for the float64 reference.
    """
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    s = get_scheme(scheme)
    if not s.quantized:
        return (w13, w2, None, None), (w13, w2)
    q13, s13 = quantize_weight(w13, s)
    q2, s2 = quantize_weight(w2, s)
    return (q13, q2, s13, s2), (dequantize_weight(q13, s13), dequantize_weight(q2, s2))


class RankRows:
    """One rank's results, JSON lines in ``{out_path}.{rank}``: :meth:`emit` adds the rank to a row
    and flushes it at once (a rank that exits or hangs leaves what it wrote; :func:`read_rank_rows`)."""

    def __init__(self, out_path: str, rank: int) -> None:
        self.rank = rank
        self.file = open(f"{out_path}.{rank}", "w")

    def emit(self, row: dict) -> None:
        row["rank"] = self.rank
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


def read_rank_rows(out: str, world: int) -> list[dict]:
    """Every row the ranks ``0 .. world - 1`` wrote with :class:`RankRows` (a missing file: none)."""
    rows = []
    for r in range(world):
        if os.path.exists(f"{out}.{r}"):
            with open(f"{out}.{r}") as f:
                rows += [json.loads(line) for line in f]
    return rows


def session_shared_dir(tmp_path_factory, name: str) -> Path:
    """A directory ``name`` that every process of this pytest session gets, new each session.

    pytest-xdist gives each worker the basetemp ``<session basetemp>/popen-<worker id>``, so the
    directory is made beside those, one for all workers. Without xdist (or with a layout other
    than that one) it is this process's own ``tmp_path_factory.mktemp(name)``."""
    base = tmp_path_factory.getbasetemp()
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and base.name == f"popen-{worker}":
        shared = base.parent / name
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp(name)


def decide_once(record: Path, decide: Callable[[], bool]) -> bool:
    """``decide()`` as the first caller of the session answered it, kept in the file ``record``.

    Later callers (other xdist workers) get that answer even when what ``decide`` looks at has
    changed since, e.g. because the first caller built something there. Each caller writes its
    answer to a file of its own and links it to ``record``: the link fails when ``record`` exists,
    so the first answer wins and no caller reads a half-written file."""
    if not record.is_file():
        mine = record.with_name(f"{record.name}.{os.getpid()}")
        mine.write_text("yes" if decide() else "no")
        try:
            os.link(mine, record)
        except FileExistsError:
            pass
        finally:
            mine.unlink()
    return record.read_text() == "yes"
