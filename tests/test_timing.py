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


def _evt(name, device, start, end, *, annotation=False, stream=7, device_us=0.0):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import Interval

    dev = DeviceType.CPU if device == "cpu" else DeviceType.CUDA
    return SimpleNamespace(name=name, device_type=dev, is_user_annotation=annotation, device_index=0,
                           device_resource_id=stream, time_range=Interval(start, end),
                           device_time_total=device_us, cpu_time_total=end - start)  # fmt: skip


def test_range_device_us_counts_work_the_host_range_does_not_link():
    events = [
        # host ranges: quantize linked no kernel (a Triton launch), gemm1 linked its 30 us
        _evt("epmoe.quantize", "cpu", 0, 5, device_us=0.0),
        _evt("epmoe.gemm1", "cpu", 5, 9, device_us=30.0),
        _evt("epmoe.experts", "cpu", 0, 9, device_us=30.0),
        # GPU-side spans on stream 7 (experts holds both), and the work
        _evt("epmoe.quantize", "cuda", 100, 140, annotation=True),
        _evt("epmoe.gemm1", "cuda", 150, 180, annotation=True),
        _evt("epmoe.experts", "cuda", 100, 180, annotation=True),
        _evt("group_quant_kernel", "cuda", 100, 112),
        _evt("group_quant_kernel", "cuda", 130, 140),  # a gap of 18 us between the two is not work
        _evt("gemm_kernel", "cuda", 150, 180),
        _evt("comm_kernel", "cuda", 105, 135, stream=9),  # another stream, inside the time window
        _evt("other_kernel", "cuda", 185, 190),  # after every span
    ]
    got = timing.range_device_us(events, cuda=True)
    assert got == {"epmoe.quantize": 22.0, "epmoe.gemm1": 30.0, "epmoe.experts": 52.0}, got
    # work the host range links but no span covers (its stream has none) still counts
    got = timing.range_device_us(events[:3], cuda=True)
    assert got == {"epmoe.quantize": 0.0, "epmoe.gemm1": 30.0, "epmoe.experts": 30.0}, got
    # without CUDA: the host ranges' own time
    assert timing.range_device_us(events, cuda=False) == {"epmoe.quantize": 5, "epmoe.gemm1": 4, "epmoe.experts": 9}
