"""Byte progress of a conversion on stderr: tqdm when installed, else a plain line."""

from __future__ import annotations

import math
import sys
import time


class Progress:
    """Byte progress over the source shards: tqdm when installed, else a plain stderr line."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.monotonic()
        self.bar = None
        self.desc = ""
        if enabled:
            try:
                from tqdm.auto import tqdm  # optional dependency
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, file=sys.stderr)

    def shard(self, i: int, n: int, name: str) -> None:
        self.desc = f"[{i}/{n}] {name}"
        if self.bar is not None:
            self.bar.set_description(self.desc)
        elif self.enabled:
            self._line(force=True)

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self.bar is not None:
            self.bar.update(nbytes)
        elif self.enabled and time.monotonic() - self.last >= 1.0:
            self._line()

    def _line(self, force: bool = False) -> None:
        self.last = now = time.monotonic()
        rate = self.done / max(now - self.start, 1e-9)
        eta = (self.total - self.done) / rate if rate > 0 and self.done else float("nan")
        pct = 100.0 * self.done / max(self.total, 1)
        end = "\r" if sys.stderr.isatty() and not force else "\n"
        sys.stderr.write(
            f"convert {self.desc}: {pct:5.1f}% {fmt_bytes(self.done)}/{fmt_bytes(self.total)} "
            f"{fmt_bytes(rate)}/s ETA {fmt_secs(eta)}{end}"
        )
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            self.desc = "done"
            self._line(force=True)


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024:
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def fmt_secs(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    return f"{int(s // 60)}m{int(s % 60):02d}s"

