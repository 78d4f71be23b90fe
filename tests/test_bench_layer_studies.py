"""benchmarks/layer_studies.py: its timings and report (the run itself needs two GPUs and DeepEP)."""

from __future__ import annotations

import argparse

import pytest

from benchmarks import layer_studies as studies
from epmoe import timing


class _Clock:
    """A host clock that advances only when a fake call says so (ms)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    c = _Clock()
    monkeypatch.setattr(timing, "_now_ms", c)
    barriers = []
    monkeypatch.setattr(timing, "barrier", lambda device: barriers.append(c.now))
    c.barriers = barriers
    return c


def test_sustained_windows_and_second_half_median(clock):
    slow = iter([1.0] * 3 * 2 + [3.0] * 3 * 2)  # scheme b: first two windows 1 ms/forward, then 3

    def fwd(ms):
        def run():
            clock.now += ms if ms else next(slow)
        return run

    got = studies._sustained({"a": fwd(1.0), "b": fwd(None)}, 3, 4, "cpu")
    assert got["a"]["window_ms"] == [1.0] * 4 and got["a"]["layer_ms"] == 1.0
    assert got["b"]["window_ms"] == [1.0, 1.0, 3.0, 3.0] and got["b"]["layer_ms"] == 3.0


def test_pipelined_pairs_run_back_to_back_with_per_call_medians(clock):
    """One barrier before the timed pairs and none between them; each call's own times; medians."""
    d_ms, c_ms = iter([9.0, 9.0, 1.0, 2.0, 3.0, 2.0]), iter([9.0, 9.0, 5.0, 4.0, 6.0, 4.0])  # 2 warm-up pairs
    seen = []

    def dispatch():
        clock.now += next(d_ms)
        return "handle"

    def combine(arg):
        seen.append(arg)
        clock.now += next(c_ms)

    got = studies.time_pipelined(dispatch, combine, 4, 2, "cpu", between=lambda h: (h, "y"))
    assert clock.barriers == [36.0]  # after the warm-up, before the timed pairs only
    assert got == {"dispatch_pipelined_ms": 2.0, "combine_pipelined_ms": 4.5}
    assert seen == [("handle", "y")] * 6


def test_isolated_pairs_meet_before_every_call_pair_and_skip_the_between(clock):
    def first():
        clock.now += 2.0
        return 1

    def between(r):
        clock.now += 100.0  # untimed
        return r + 1

    def second(arg):
        clock.now += 3.0
        return arg * 10

    times, r1, r2 = studies.time_pair(first, second, 3, 1, "cpu", between=between)
    assert len(clock.barriers) == 4 and (r1, r2) == (1, 20)
    assert times["dispatch_ms"] == 2.0 and times["combine_ms"] == 3.0
    assert times["dispatch_host_us"] >= 0 and times["combine_host_us"] >= 0


def test_overheads_are_layer_over_deepep_minus_one():
    raw = dict(dispatch_ms=0.2, combine_ms=0.25, dispatch_pipelined_ms=0.1, combine_pipelined_ms=0.5)
    ours = dict(dispatch_ms=0.21, combine_ms=0.25, dispatch_pipelined_ms=0.099, combine_pipelined_ms=0.51)
    got = studies._overheads(raw, ours)
    assert got == pytest.approx(dict(dispatch_overhead_pct=5.0, combine_overhead_pct=0.0,
                                     dispatch_pipelined_overhead_pct=-1.0, combine_pipelined_overhead_pct=2.0))


def _row(**extra):
    dc = dict(dispatch_ms=0.4, combine_ms=0.5, dispatch_host_us=30.0, combine_host_us=20.0,
              dispatch_pipelined_ms=0.2, combine_pipelined_ms=0.25)
    return dict(backend="triton", deepep_ms=dict(dc), layer_dc_ms=dict(dc, dispatch_pipelined_ms=0.202),
                dispatch_overhead_pct=0.0, combine_overhead_pct=0.0, dispatch_pipelined_overhead_pct=1.0,
                combine_pipelined_overhead_pct=0.0, **extra)  # fmt: skip


ARGS = argparse.Namespace(sustained=8, iters=20)


def _ranks(nosync, alt=None):
    ranks = []
    for rank in range(2):
        schemes = {}
        for scheme, ms in nosync.items():
            extra = {"no_host_sync": dict(layer_ms=ms[rank], sync_ms=ms[rank] + 1.0, rel_diff_vs_sync=0.0)}
            if alt and scheme == "bf16":
                extra["bf16_grouped_mm"] = alt[rank]
            schemes[scheme] = {"prefill": _row(**extra)}
        ranks.append({"rank": rank, "schemes": schemes})
    return ranks


def test_no_host_sync_ratio_is_slowest_rank_against_slowest_rank():
    s = studies._summary(_ranks({"bf16": (7.9, 8.1), "int8_channel": (4.8, 4.7)}), ARGS)
    assert s["ratios"]["int8_channel/prefill_no_host_sync"] == pytest.approx(8.1 / 4.8)
    table = studies._table(s)
    assert "prefill without host sync" in table
    assert ("pipelined (DeepEP's own method), int8_channel prefill, rank 0: dispatch DeepEP 0.2000 ms, layer "
            "0.2020 ms (+1.0%); combine DeepEP 0.2500 ms, layer 0.2500 ms (+0.0%)") in table


def test_grouped_mm_baseline_swaps_the_experts_pass():
    alt = [{"rows": 10, "backend_experts_ms": 6.0, "grouped_mm_experts_ms": 5.0, "rel_diff": 1e-3},
           {"rows": 11, "backend_experts_ms": 6.0, "grouped_mm_experts_ms": 5.5, "rel_diff": 1e-3}]  # fmt: skip
    s = studies._summary(_ranks({"bf16": (7.0, 7.2), "int8_channel": (4.0, 3.9)}, alt), ARGS)
    est = max(8.0 - 6.0 + 5.0, 8.2 - 6.0 + 5.5)  # the host-synced layer (sync_ms) with grouped_mm experts
    assert s["bf16_grouped_mm_prefill_layer_ms"] == pytest.approx(est)
    assert s["ratios"]["int8_channel/prefill_vs_bf16_grouped_mm"] == pytest.approx(est / 5.0)
    table = studies._table(s)
    assert "torch._grouped_mm 5.500 ms" in table and f"{est:.3f} ms" in table


def test_grouped_mm_error_is_reported_not_used():
    alt = [{"error": "RuntimeError('no kernel')"}, {"rows": 11, "backend_experts_ms": 6.0, "grouped_mm_experts_ms": 5.5, "rel_diff": 0.0}]
    s = studies._summary(_ranks({"bf16": (7.0, 7.2)}, alt), ARGS)
    assert "bf16_grouped_mm_prefill_layer_ms" not in s
    assert "no kernel" in studies._table(s)


def test_sustained_ratio_and_report():
    ranks = _ranks({"bf16": (7.0, 7.1), "int8_channel": (4.5, 4.4)})
    for r, (b, i) in zip(ranks, [(7.5, 4.6), (7.6, 4.5)]):
        r["sustained"] = {"prefill": {"bf16": {"layer_ms": b}, "int8_channel": {"layer_ms": i}}}
    s = studies._summary(ranks, ARGS)
    assert s["ratios"]["int8_channel/prefill_sustained"] == pytest.approx(7.6 / 4.6)
    assert "sustained throughput" in studies._table(s) and "int8_channel 4.600 ms (1.65x bf16)" in studies._table(s)
