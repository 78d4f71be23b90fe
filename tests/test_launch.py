"""epmoe.launch: per-rank results, the failing rank's traceback, the timeout."""

from __future__ import annotations

import os
import time

import pytest

from epmoe import launch


def _sum_ranks(rank, world, port, scale):
    import torch
    import torch.distributed as dist

    launch.init_process_group(rank, world, port, "cpu", timeout_s=60)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    dist.destroy_process_group()
    return {"rank": rank, "world": world, "sum": float(t) * scale}


def _rank1_raises(rank, world, port):
    if rank == 1:
        raise ValueError("rank one refuses")
    time.sleep(60)  # as if waiting for rank 1 in a collective: the launcher must end it


def _sleeps(rank, world, port):
    if rank == 0:
        time.sleep(60)


def _exits_quietly(rank, world, port):
    os._exit(0)


def test_results_come_back_per_rank():
    got = launch.run_ranks(_sum_ranks, 2, 10.0, timeout_s=120)
    assert got == [{"rank": 0, "world": 2, "sum": 30.0}, {"rank": 1, "world": 2, "sum": 30.0}]


def test_the_failing_ranks_traceback_is_raised_and_the_others_ended():
    start = time.monotonic()
    with pytest.raises(launch.RankError, match="rank 1 raised") as info:
        launch.run_ranks(_rank1_raises, 2, timeout_s=120)
    assert "ValueError: rank one refuses" in str(info.value) and "_rank1_raises" in str(info.value)
    assert time.monotonic() - start < 50


def test_ranks_past_the_timeout_are_ended_and_named():
    with pytest.raises(TimeoutError, match=r"ranks \[0\] of 2 did not finish within timeout_s=8"):
        launch.run_ranks(_sleeps, 2, timeout_s=8)


def test_a_rank_that_ends_its_process_itself_returns_none():
    assert launch.run_ranks(_exits_quietly, 1) == [None]


@pytest.mark.parametrize("kw, message", [(dict(world_size=0), "world_size=0"), (dict(world_size=1, timeout_s=0), "timeout_s=0")])
def test_bad_arguments_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        launch.run_ranks(_sleeps, **kw)
