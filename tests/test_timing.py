"""epmoe.timing: the kernel and collective timers, turns, and the phase ranges of the real forward."""

from __future__ import annotations

import pytest
import torch

from epmoe import timing


def test_kernel_ms_on_cpu_is_a_wall_clock_median(monkeypatch):
    ticks = iter([0.0, 5.0, 10.0, 12.0, 20.0, 29.0])  # three calls: 5, 2, 9 ms
    monkeypatch.setattr(timing, "_now_ms", lambda: next(ticks))
    calls = []
    assert timing.kernel_ms(lambda: calls.append(1), device="cpu") == 5.0
    assert len(calls) == 4  # one warm-up call, three timed


def test_collective_ms_is_the_mean_over_a_fixed_count(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "_now_ms", lambda: now[0])
    monkeypatch.setattr(timing, "barrier", lambda device: pytest.fail("no barrier for local work"))
    steps = iter([100.0, 1.0, 2.0, 6.0])  # one warm-up call, then three timed

    def fn():
        now[0] += next(steps)

    assert timing.collective_ms(fn, 3, 1, "cpu", collective=False) == 3.0
    with pytest.raises(ValueError, match="iters must be >= 1 and warmup >= 0; got iters=0"):
        timing.collective_ms(fn, 0, 0, "cpu")


def test_marked_pieces_skip_unnamed_work(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(timing, "_now_ms", lambda: now[0])
    barriers = []
    monkeypatch.setattr(timing, "barrier", lambda device: barriers.append(now[0]))

    def step(mark):
        now[0] += 1.0
        mark("a")
        now[0] += 50.0
        mark(None)
        now[0] += 2.0
        mark("b")

    got = timing.marked_ms(step, 2, 1, "cpu")
    assert got["a"] == [1.0, 1.0] and got["b"] == [2.0, 2.0] and len(barriers) == 3
    assert set(got) == {"a", "b", "a_host_us", "b_host_us"}
    barriers.clear()
    timing.marked_ms(step, 2, 1, "cpu", barrier_each=False)
    assert len(barriers) == 1


def test_in_turns_rotates_the_order():
    order = []
    got = timing.in_turns({"a": "a", "b": "b", "c": "c"}, 3, lambda fn: (order.append(fn), len(order))[1])
    assert order == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert got == {"a": [1, 6, 8], "b": [2, 4, 9], "c": [3, 5, 7]}


def test_phase_is_a_no_op_without_a_profiler():
    assert timing.phase("epmoe.x") is timing.phase("epmoe.y")  # one shared null context
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        assert isinstance(timing.phase("epmoe.x"), torch.profiler.record_function)


def test_profile_phases_reads_the_ranges_of_the_real_forward():
    from epmoe.layer import DeepEPMoELayer

    layer = DeepEPMoELayer(8, 2, 64, 32, quant="bf16", backend="torch", device="cpu", params_dtype=torch.float32)
    x, logits = torch.randn(5, 64), torch.randn(5, 8)
    got = timing.profile_phases(lambda: layer(x, logits), 2, 1, "cpu", collective=False)
    assert {"route", "dispatch", "scatter", "experts", "gather", "combine"} <= set(got), got
    assert all(v >= 0 for v in got.values())
    assert set(timing.profile_phases(lambda: layer(x, logits), 1, 0, "cpu", collective=False, names=("route",))) == {"route"}


def _evt(name, device, start, end, *, span_of=None, stream=7, device_us=0.0, id=0):
    """A FunctionEvent-like record: a host range (``device="cpu"``, its ``id``), a GPU-side span of
    the host range whose id is ``span_of``, or a piece of device work."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    dev = DeviceType.CPU if device == "cpu" else DeviceType.CUDA
    return SimpleNamespace(name=name, id=span_of if span_of is not None else id, device_type=dev,
                           is_user_annotation=span_of is not None, device_index=0, device_resource_id=stream,
                           thread=1, time_range=Interval(start, end), device_time_total=device_us,
                           cpu_time_total=end - start)  # fmt: skip


def _forward(t0, g0):
    """One forward as the profiler records it: ``experts`` (host 0-9) holds ``quantize`` (a Triton
    kernel the host range does not link) and ``gemm1`` (a linked kernel), and launches a copy of
    its own before them and one after, so its GPU-side span holds its children's work."""
    return [
        _evt("epmoe.experts", "cpu", t0, t0 + 9, id=t0 + 1, device_us=30.0),
        _evt("epmoe.quantize", "cpu", t0 + 1, t0 + 5, id=t0 + 2),
        _evt("epmoe.gemm1", "cpu", t0 + 5, t0 + 8, id=t0 + 3, device_us=30.0),
        _evt("epmoe.experts", "cuda", g0, g0 + 90, span_of=t0 + 1),
        _evt("epmoe.quantize", "cuda", g0 + 5, g0 + 45, span_of=t0 + 2),
        _evt("epmoe.gemm1", "cuda", g0 + 50, g0 + 80, span_of=t0 + 3),
        _evt("copy", "cuda", g0, g0 + 2),
        _evt("group_quant_kernel", "cuda", g0 + 5, g0 + 17),
        _evt("group_quant_kernel", "cuda", g0 + 35, g0 + 45),  # the 18 us between the two are no work
        _evt("gemm_kernel", "cuda", g0 + 50, g0 + 80),
        _evt("copy", "cuda", g0 + 88, g0 + 90),
        _evt("comm_kernel", "cuda", g0 + 10, g0 + 40, stream=9),  # another stream, inside the window
        _evt("other_kernel", "cuda", g0 + 95, g0 + 99),  # in no range
    ]


def test_range_device_us_counts_work_the_host_range_does_not_link():
    events = _forward(0, 100) + _forward(20, 300)  # two forwards: instances add up
    got = timing.range_device_us(events, cuda=True)
    assert got == {"epmoe.quantize": 44.0, "epmoe.gemm1": 60.0, "epmoe.experts": 2 * (4 + 22 + 30)}, got
    # A range that launches nothing itself has no span: it gets the work of the ranges inside it.
    bare = [e for e in _forward(0, 100) if e.name != "copy" and not (e.name == "epmoe.experts" and e.is_user_annotation)]
    assert timing.range_device_us(bare, cuda=True)["epmoe.experts"] == 22.0 + 30.0
    # The host-linked count wins where it sees more: a span-less range, or a host range missing.
    no_spans = [e for e in events if not e.is_user_annotation]
    assert timing.range_device_us(no_spans, cuda=True) == {"epmoe.quantize": 0.0, "epmoe.gemm1": 60.0,
                                                           "epmoe.experts": 60.0}  # fmt: skip
    orphan = [e for e in _forward(0, 100) if not (e.name == "epmoe.experts" and e.device_type.name == "CPU")]
    assert timing.range_device_us(orphan, cuda=True) == {"epmoe.quantize": 22.0, "epmoe.gemm1": 30.0,
                                                         "epmoe.experts": 4.0}  # fmt: skip
    # Without CUDA: the host ranges' own time.
    assert timing.range_device_us(events, cuda=False) == {"epmoe.experts": 18, "epmoe.quantize": 8, "epmoe.gemm1": 6}
