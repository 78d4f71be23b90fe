"""What every rank of a group must agree on, and waiting on a collective with a deadline.

* :func:`wait` bounds the host's wait on one collective by ``timeout_s``: a peer that died raises
  :class:`CollectiveError` (the backend reports the broken connection), a peer that never joins
  :class:`CollectiveTimeoutError`, each naming the collective, instead of a hang.
* :func:`check_agreement` compares a small record of named fields over the group in one
  collective (an all-gather of a fixed-size byte row) and raises on every rank, naming the first
  field that differs and each rank's value. The layer runs it once, at its first forward, with
  everything the ranks' wire formats and sizes depend on.
* :func:`first_difference` names the first differing field of per-rank records: the layer's
  fingerprint and the per-batch header the all-to-all dispatcher exchanges with its counts.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from ..errors import CollectiveError, CollectiveTimeoutError, RankMismatchError


def wait(work, what: str, *, who: str, rank: int, world: int, timeout_s: float) -> None:
    """Wait for ``work`` (an ``async_op=True`` handle) at most ``timeout_s`` seconds.

    Args:
        work: the collective's handle.
        what: the collective's name in errors (e.g. ``"dispatch counts"``).
        who: the component waiting (e.g. ``"all_to_all dispatcher"``).
        rank, world: this rank and the group size, for the error.
        timeout_s: seconds.
    """
    start = time.monotonic()
    where = f"collective '{what}' on rank {rank} of {world}"
    try:
        while not work.is_completed():
            waited = time.monotonic() - start
            if waited > timeout_s:
                raise CollectiveTimeoutError(
                    f"{who}: {where} did not complete within timeout_s={timeout_s:g}; a peer rank "
                    "died or did not call the layer for this batch"
                )
            # Spin for the first 2 ms (collectives usually finish by then), then yield the CPU.
            if waited > 2e-3:
                time.sleep(1e-4)
        work.wait()
    except CollectiveError:
        raise
    except RuntimeError as exc:  # the backend's own failure, e.g. a peer's closed connection
        raise CollectiveError(f"{who}: {where} failed: {exc}") from exc


FINGERPRINT_BYTES = 2048
"""Fixed size of the all-gathered row: every rank sends the same number of bytes whatever its
values, so the comparison itself cannot fail on a size mismatch."""


def _encode(fields: dict[str, str]) -> torch.Tensor:
    data = json.dumps(fields).encode()
    if len(data) > FINGERPRINT_BYTES - 4:
        # Every value is a short name or number: no argument can get here; the cap keeps the row fixed.
        data = json.dumps({k: v[:48] for k, v in fields.items()}).encode()[: FINGERPRINT_BYTES - 4]
    row = torch.zeros(FINGERPRINT_BYTES, dtype=torch.uint8)
    row[:4] = torch.tensor(list(len(data).to_bytes(4, "little")), dtype=torch.uint8)
    row[4 : 4 + len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return row


def _decode(row: torch.Tensor) -> dict[str, str] | None:
    raw = bytes(row.tolist())
    n = int.from_bytes(raw[:4], "little")
    try:
        return json.loads(raw[4 : 4 + n].decode())
    except (UnicodeDecodeError, json.JSONDecodeError):  # a truncated record (never for real fields)
        return None


def first_difference(records: list[dict[str, str] | None]) -> str | None:
    """The message for the first field (in the first rank's order) whose values differ between
    ``records`` (one per rank), or ``None`` when all agree."""
    names = list(dict.fromkeys(k for r in records if r is not None for k in r))
    for name in names:
        values = [None if r is None else r.get(name) for r in records]
        if len(set(values)) > 1:
            each = ", ".join(f"rank {i}: {v if v is not None else '<missing>'}" for i, v in enumerate(values))
            return f"the ranks disagree on {name} ({each})"
    return None


def check_agreement(
    fields: dict[str, str], *, what: str, group, device: torch.device, rank: int, world: int, timeout_s: float
) -> None:
    """Raise :class:`RankMismatchError` on every rank when ``fields`` differ between the ranks.

    One all-gather of :data:`FINGERPRINT_BYTES` bytes per rank, waited on at most ``timeout_s``
    (a missing peer raises :class:`CollectiveTimeoutError` naming ``what``).

    Args:
        fields: ``name -> value`` (strings), in the order the error should look at them.
        what: the collective's name in errors.
        group: the process group (``None``: the default one).
        device: where the collective's tensors live (CUDA for NCCL, CPU for gloo).
        rank, world: this rank and the group size.
        timeout_s: seconds.
    """
    mine = _encode(fields).to(device)
    rows = [torch.empty_like(mine) for _ in range(world)]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    wait(work, what, who="DeepEPMoELayer", rank=rank, world=world, timeout_s=timeout_s)
    problem = first_difference([_decode(r.cpu()) for r in rows])
    if problem is not None:
        raise RankMismatchError(
            f"{what}: {problem}; every rank of the group must build this layer with the same "
            "arguments (raised on every rank)"
        )
