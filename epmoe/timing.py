"""How this project times things: one module for the benchmarks and the studies under ``benchmarks/``.

* Kernels (work local to one GPU): :func:`kernel_ms`, the median of ``triton.testing.do_bench``
  (``do_bench_cudagraph`` inside a CUDA graph); on a CPU a wall-clock median (the CPU tests).
* Collectives (anything that talks to other ranks): :func:`collective_ms` and :func:`marked_ms`,
  CUDA events over a **fixed** number of iterations, the same on every rank. ``do_bench`` picks
  its repetition count per process, so ranks disagree and DeepEP stops with "CPU recv timeout":
  never time a collective with it.
* :func:`in_turns`: implementations compared in rotated turns, the fair comparison under a GPU's
  power cap.
* :func:`phase` ranges (``torch.profiler.record_function``, only while a profiler runs) placed in
  the layer's forward and the experts backends, and :func:`profile_phases`, the device time of
  each range over a fixed number of real forwards.
"""

from __future__ import annotations

import bisect
import contextlib
import statistics
import time
from collections.abc import Callable, Sequence

import torch

PHASE_PREFIX = "epmoe."
"""Prefix of every profiler range the package places (``epmoe.dispatch``, ``epmoe.gemm1``, ...)."""

_NO_RANGE = contextlib.nullcontext()


def phase(name: str):
    """A ``torch.profiler.record_function`` range named ``name`` while a profiler runs, else a
    shared no-op context: an ungated range costs ~7 us of host time per call on the CPU, which
    eager decode would pay once per phase and forward. Not placed under ``torch.compile``."""
    # is_compiling() first: dynamo folds it and never meets the profiler query (a graph break).
    if not torch.compiler.is_compiling() and torch._C._autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return _NO_RANGE


def _now_ms() -> float:
    return time.perf_counter() * 1e3


class _Clock:
    """Timestamps on ``device``: CUDA events recorded on the current stream, or the host clock."""

    def __init__(self, device: torch.device | str | None):
        self.cuda = torch.device(device).type == "cuda" if device is not None else False

    def stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return _now_ms()

    def elapsed(self, a, b) -> float:
        return a.elapsed_time(b) if self.cuda else b - a

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()


def barrier(device: torch.device | str | None) -> None:
    """All ranks of the default group meet, and this rank's GPU is idle afterwards (an
    all-reduce rather than ``dist.barrier``: with NCCL that one may pick a device of its own)."""
    import torch.distributed as dist

    t = torch.ones(1, device=device)
    dist.all_reduce(t)
    _Clock(device).sync()


def kernel_ms(fn: Callable[[], object], *, rep_ms: float = 200.0, warmup_ms: float = 25.0,
              graph: bool = False, device: torch.device | str | None = None) -> float:  # fmt: skip
    """Median ms of one ``fn()`` for work local to this GPU: ``triton.testing.do_bench`` (its own
    repetition count: never for a collective), inside a CUDA graph when ``graph`` (small
    batches, where launch overhead would hide the kernels). ``device`` defaults to CUDA when
    available; on a CPU, the median wall-clock time of three calls after one warm-up call."""
    cuda = torch.cuda.is_available() if device is None else torch.device(device).type == "cuda"
    if not cuda:
        fn()
        samples = []
        for _ in range(3):
            t = _now_ms()
            fn()
            samples.append(_now_ms() - t)
        return statistics.median(samples)
    import triton.testing as tt

    if graph:
        fn()
        torch.cuda.synchronize()
        # do_bench_cudagraph replays its graph ten times; a quarter of the budget is plenty.
        return float(tt.do_bench_cudagraph(fn, rep=max(20.0, rep_ms / 4), return_mode="median"))
    return float(tt.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def collective_ms(fn: Callable[[], object], iters: int, warmup: int, device: torch.device | str | None,
                  *, collective: bool = True) -> float:  # fmt: skip
    """Mean ms of ``fn()`` over ``iters`` back-to-back calls after ``warmup`` untimed ones: a
    fixed count, the same on every rank, with an event before the first call and after the
    last. ``collective``: all ranks meet (:func:`barrier`) before the timed calls; ``False`` for
    work local to this rank, so that a rank whose ``fn`` fails does not leave a peer waiting."""
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    clock = _Clock(device)
    for _ in range(warmup):
        fn()
    if collective:
        barrier(device)
    else:
        clock.sync()
    a = clock.stamp()
    for _ in range(iters):
        fn()
    b = clock.stamp()
    clock.sync()
    return clock.elapsed(a, b) / iters


def marked_ms(step: Callable[[Callable[[str | None], None]], object], iters: int, warmup: int,
              device: torch.device | str | None, *, barrier_each: bool = True) -> dict[str, list[float]]:  # fmt: skip
    """Per-piece samples of a step that marks its own pieces, over a fixed count of iterations.

    Args:
        step: called once per iteration as ``step(mark)``; ``mark(name)`` ends the piece timed
            since the previous mark (or the start of the iteration) and names it ``name``;
            ``mark(None)`` starts a new piece without naming the one before (untimed work).
        iters: timed iterations (the same on every rank); ``warmup``: untimed ones before.
        device: where the events are recorded (CUDA events; host clock on a CPU).
        barrier_each: all ranks meet before every iteration, so each piece starts on an idle
            GPU (host time before the first launch counts in full); ``False``: one barrier
            before the timed iterations and none between them, the host running ahead where it
            can (how DeepEP's own tests time their calls).

    Returns:
        ``{name: [ms per timed iteration]}`` and ``{name + "_host_us": [...]}``, the host time
        from the start of each piece to its mark.
    """
    if iters < 1 or warmup < 0:
        raise ValueError(f"iters must be >= 1 and warmup >= 0; got iters={iters}, warmup={warmup}")
    clock = _Clock(device)
    marks: list[list[tuple[str | None, object, float]]] = []
    for i in range(warmup + iters):
        if barrier_each or i == warmup:
            barrier(device)
        row = [(None, clock.stamp(), time.perf_counter())]

        def mark(name: str | None, row=row) -> None:
            row.append((name, clock.stamp(), time.perf_counter()))

        step(mark)
        if i >= warmup:
            marks.append(row)
    clock.sync()
    out: dict[str, list[float]] = {}
    for row in marks:
        for (_, a, ha), (name, b, hb) in zip(row, row[1:]):
            if name is not None:
                out.setdefault(name, []).append(clock.elapsed(a, b))
                out.setdefault(f"{name}_host_us", []).append((hb - ha) * 1e6)
    return out


def in_turns(fns: dict, rounds: int, measure: Callable[[Callable], float]) -> dict[str, list[float]]:
    """Per key of ``fns``, ``measure(fn)`` once per round; within a round the functions take
    turns in an order rotated every round (with a round count that is not a multiple of their
    number some lead one round more, which a median absorbs).

    Under sustained load an H200 runs at its power cap, so a kernel's clock depends on what ran
    before it, and one timed after a long run of another pays for that one's heat. In turns each
    meets the GPU in the same state on average."""
    names = list(fns)
    samples: dict = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            samples[n].append(measure(fns[n]))
    return samples


def profile_phases(fn: Callable[[], object], iters: int, warmup: int, device: torch.device | str | None,
                   *, collective: bool = True, names: Sequence[str] | None = None) -> dict[str, float]:  # fmt: skip
    """Mean device ms per call of every :func:`phase` range inside ``fn()`` (the real forward),
    from a ``torch.profiler`` trace of ``iters`` calls after ``warmup`` untimed ones (a fixed
    count: ``fn`` may be a collective).

    A range's device time is the time of the GPU work launched inside it (kernels, copies,
    memsets; a collective kernel's wait for a slower peer included; see :func:`range_device_us`);
    on a CPU, its host time. Ranges nest (``epmoe.experts`` holds ``epmoe.gemm1`` ...): each is
    reported on its own.

    Returns:
        ``{range name without the "epmoe." prefix: ms}``, restricted to ``names`` when given.
    """
    from torch.profiler import ProfilerActivity, profile

    cuda = device is not None and torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if collective:
        barrier(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        _Clock(device).sync()
    totals = {name[len(PHASE_PREFIX):]: us / 1e3 / iters for name, us in range_device_us(prof.events(), cuda).items()}
    if names is not None:
        totals = {k: v for k, v in totals.items() if k in names}
    return totals


def range_device_us(events, cuda: bool) -> dict[str, float]:
    """Microseconds of device work per :func:`phase` range name, summed over its instances, from
    a profiler's events (``FunctionEvent``-like: ``name``, ``id``, ``device_type``,
    ``is_user_annotation``, ``device_index``, ``device_resource_id``, ``time_range``, host ranges
    also ``thread``, ``device_time_total`` and ``cpu_time_total``).

    With ``cuda``, the larger of two counts, each of which can miss work the other sees:
    * the work the profiler links to the host-side range and the ranges inside it (kernels whose
      launch it recorded there: it misses launches it does not record, e.g. Triton's through the
      driver API);
    * the work inside the GPU-side spans of the range and of the ranges nested in it on the host
      (the profiler gives each range instance a span per stream, from the first piece of work
      launched directly in it to the last; stream order puts nothing launched outside it in
      between, and the span's own length would count the gaps too). A span whose host range is
      not in ``events`` counts for its own name only.
    Without ``cuda``, the host ranges' own time.
    """
    ranges = [e for e in events if e.name.startswith(PHASE_PREFIX) and e.device_type == torch.autograd.DeviceType.CPU]
    if not cuda:
        return _sum_by_name((r.name, r.cpu_time_total) for r in ranges)
    linked = _sum_by_name((r.name, r.device_time_total) for r in ranges)
    spanned = _nested_span_us(ranges, _span_work_us(events))
    return {name: max(linked.get(name, 0.0), spanned.get(name, 0.0)) for name in linked.keys() | spanned.keys()}


def _sum_by_name(pairs) -> dict[str, float]:
    out: dict[str, float] = {}
    for name, us in pairs:
        out[name] = out.get(name, 0.0) + us
    return out


def _span_work_us(events) -> list[tuple[object, str, float]]:
    """``(id, name, us)`` of every GPU-side span of a :func:`phase` range: the device work (not
    annotations) on its stream that lies inside it and inside no span nested in it (a range's
    span can hold its children's: it runs from its own first piece of work to its last)."""
    spans: dict[tuple, list] = {}
    work: dict[tuple, list] = {}
    for evt in events:
        if evt.device_type == torch.autograd.DeviceType.CPU:
            continue
        stream = (evt.device_index, evt.device_resource_id)
        if not evt.is_user_annotation:
            work.setdefault(stream, []).append(evt.time_range)
        elif evt.name.startswith(PHASE_PREFIX):
            spans.setdefault(stream, []).append(evt)
    own: dict[int, float] = {}
    for stream, stream_spans in spans.items():
        stream_spans.sort(key=lambda e: e.time_range.start)
        starts = [e.time_range.start for e in stream_spans]
        for piece in work.get(stream, []):
            # The innermost span holding the piece: on one stream spans nest or follow each
            # other, so it is the holding span that starts last.
            for k in range(bisect.bisect_right(starts, piece.start) - 1, -1, -1):
                if stream_spans[k].time_range.end >= piece.end:
                    own[id(stream_spans[k])] = own.get(id(stream_spans[k]), 0.0) + piece.elapsed_us()
                    break
    return [(e.id, e.name, own.get(id(e), 0.0)) for stream_spans in spans.values() for e in stream_spans]


def _nested_span_us(ranges, spans) -> dict[str, float]:
    """Per range name, the span work (``_span_work_us``) of its host instances and of the host
    ranges nested in them (same thread, inside its time); a span no host range claims (by id)
    counts for its own name."""
    own: dict[object, float] = {}
    for span_id, _, us in spans:
        own[span_id] = own.get(span_id, 0.0) + us
    claimed = {r.id for r in ranges}
    totals = _sum_by_name((name, us) for span_id, name, us in spans if span_id not in claimed)
    by_thread: dict[object, list] = {}
    for r in ranges:
        by_thread.setdefault(r.thread, []).append(r)
    for thread_ranges in by_thread.values():
        open_ranges: list = []  # the ranges holding the current one, outermost first
        for r in sorted(thread_ranges, key=lambda r: (r.time_range.start, -r.time_range.end)):
            while open_ranges and open_ranges[-1].time_range.end <= r.time_range.start:
                open_ranges.pop()
            open_ranges.append(r)
            for holder in open_ranges:
                totals[holder.name] = totals.get(holder.name, 0.0) + own.get(r.id, 0.0)
    return totals
