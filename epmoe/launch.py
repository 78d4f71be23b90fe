"""Running a function on several local ranks: ``epmoe demo``, the benchmarks and the tests.

:func:`run_ranks` spawns one process per rank (``torch.multiprocessing``, spawn), hands each a free
TCP port for the process group, returns what every rank's function returned, raises
:class:`RankError` with the failing rank's traceback, and ends ranks that outlive ``timeout_s``.
:func:`init_process_group` is the matching set-up inside a rank (gloo on the CPU, NCCL with one
GPU per rank).
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import tempfile
import time
import traceback
from collections.abc import Callable

from .errors import RankError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(rank: int, world_size: int, port: int, device_type: str = "cpu",
                       timeout_s: float = 300.0, threads: int | None = 1):  # fmt: skip
    """Joins the default process group over TCP on 127.0.0.1:``port``.

    Args:
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, GPU ``rank``, bound with ``device_id``).
        timeout_s: how long a collective may wait for a peer.
        threads: CPU threads of this rank (``torch.set_num_threads``); ``None`` leaves torch's.

    Returns:
        The rank's device: ``cuda:<rank>`` or ``cpu``.
    """
    import torch
    import torch.distributed as dist

    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device_type={device_type!r}; allowed: 'cpu', 'cuda'")
    if threads is not None:
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(threads)
    extra = {}
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        extra["device_id"] = torch.device("cuda", rank)
    dist.init_process_group(
        "nccl" if device_type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
        world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s), **extra,
    )  # fmt: skip
    return torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")


def _entry(rank: int, fn: Callable, world_size: int, port: int, args: tuple, out_dir: str) -> None:
    try:
        result = ("ok", fn(rank, world_size, port, *args))
    except BaseException:  # noqa: BLE001 - the parent re-raises it with the rank named
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl.tmp"), "wb") as f:
        pickle.dump(result, f)
    os.replace(os.path.join(out_dir, f"rank{rank}.pkl.tmp"), os.path.join(out_dir, f"rank{rank}.pkl"))
    if result[0] == "error":
        raise SystemExit(1)


def run_ranks(fn: Callable, world_size: int, *args, timeout_s: float = 600.0, port: int | None = None) -> list:
    """Runs ``fn(rank, world_size, port, *args)`` in ``world_size`` spawned processes.

    Args:
        fn: a module-level function (spawn pickles it by name); what it returns must pickle
            (plain data or CPU tensors).
        world_size: number of ranks, >= 1.
        timeout_s: seconds all ranks together may take; ranks still running then are ended.
        port: the process group's TCP port; default: a free one.

    Returns:
        ``[result of rank 0, result of rank 1, ...]``; ``None`` for a rank that ended its process
        itself with exit code 0 (``os._exit(0)``) before returning.

    Raises:
        RankError: a rank raised (its traceback in the message; the other ranks are ended, since
            they may wait for it in a collective), or its process died with a non-zero code.
        TimeoutError: ranks still running after ``timeout_s`` (named in the message).
    """
    import torch.multiprocessing as mp

    if world_size < 1:
        raise ValueError(f"world_size={world_size}; must be >= 1")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s={timeout_s}; must be > 0")
    port = free_port() if port is None else port
    with tempfile.TemporaryDirectory(prefix="epmoe_ranks_") as out_dir:
        ctx = mp.start_processes(_entry, args=(fn, world_size, port, args, out_dir), nprocs=world_size,
                                 start_method="spawn", join=False)  # fmt: skip
        procs = ctx.processes
        deadline = time.monotonic() + timeout_s
        failure: str | None = None
        while any(p.is_alive() for p in procs):
            for rank, p in enumerate(procs):
                if not p.is_alive() and p.exitcode not in (0, None) and failure is None:
                    failure = _why(rank, p.exitcode, out_dir)
            if failure is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        running = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        if failure is None:
            failure = next((_why(r, p.exitcode, out_dir) for r, p in enumerate(procs) if p.exitcode not in (0, None)
                            and r not in running), None)  # fmt: skip
        if failure is not None:
            raise RankError(failure)
        if running:
            raise TimeoutError(f"ranks {running} of {world_size} did not finish within timeout_s={timeout_s}")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                results.append(None)  # the rank ended its process itself, with exit code 0
                continue
            with open(path, "rb") as f:
                results.append(pickle.load(f)[1])
        return results


def _why(rank: int, exitcode: int, out_dir: str) -> str:
    path = os.path.join(out_dir, f"rank{rank}.pkl")
    if os.path.exists(path):
        with open(path, "rb") as f:
            status, detail = pickle.load(f)
        if status == "error":
            return f"rank {rank} raised:\n{detail}"
    return f"rank {rank} exited with code {exitcode} before returning a result"
