"""The report side of ``epmoe bench layer`` (the run itself needs two GPUs and DeepEP)."""

from __future__ import annotations

import argparse

import pytest

from epmoe.bench import layer as bench_layer


def _row(layer_ms, **extra):
    return dict(backend="triton", layer_ms=layer_ms, phases_ms={"dispatch": 0.4, "gemm1": 1.0},
                deepep_ms={"dispatch_ms": 0.4, "combine_ms": 0.5}, layer_dc_ms={"dispatch_ms": 0.41, "combine_ms": 0.5},
                dispatch_overhead_pct=2.5, combine_overhead_pct=0.0, **extra)  # fmt: skip


def _ranks(alt):
    ranks = []
    for rank, (bf16_ms, int8_ms) in enumerate([(8.0, 5.0), (8.2, 4.9)]):
        extra = {"bf16_grouped_mm": alt[rank]} if alt else {}
        ranks.append({"rank": rank, "schemes": {"bf16": {"prefill": _row(bf16_ms, **extra)},
                                                "int8_channel": {"prefill": _row(int8_ms)}}})  # fmt: skip
    return ranks


ARGS = argparse.Namespace(prefill_tokens=4096, decode_tokens=128, iters=20, warmup=3, rounds=5, sustained=8,
                          backend="auto", num_sms=None)  # fmt: skip


def test_ratio_is_slowest_rank_against_slowest_rank():
    s = bench_layer._summary(_ranks(None), ARGS)
    assert s["ratios"]["int8_channel/prefill"] == pytest.approx(8.2 / 5.0)
    assert "bf16_grouped_mm_prefill_layer_ms" not in s
    assert "int8_channel" in bench_layer._table(s)


def test_grouped_mm_baseline_swaps_the_experts_pass():
    alt = [{"rows": 10, "backend_experts_ms": 6.0, "grouped_mm_experts_ms": 5.0, "rel_diff": 1e-3},
           {"rows": 11, "backend_experts_ms": 6.0, "grouped_mm_experts_ms": 5.5, "rel_diff": 1e-3}]  # fmt: skip
    s = bench_layer._summary(_ranks(alt), ARGS)
    est = max(8.0 - 6.0 + 5.0, 8.2 - 6.0 + 5.5)
    assert s["bf16_grouped_mm_prefill_layer_ms"] == pytest.approx(est)
    assert s["ratios"]["int8_channel/prefill_vs_bf16_grouped_mm"] == pytest.approx(est / 5.0)
    table = bench_layer._table(s)
    assert "torch._grouped_mm 5.500 ms" in table and f"{est:.3f} ms" in table


def test_grouped_mm_error_is_reported_not_used():
    alt = [{"error": "RuntimeError('no kernel')"}, {"rows": 11, "backend_experts_ms": 6.0, "grouped_mm_experts_ms": 5.5, "rel_diff": 0.0}]
    s = bench_layer._summary(_ranks(alt), ARGS)
    assert "bf16_grouped_mm_prefill_layer_ms" not in s
    assert "no kernel" in bench_layer._table(s)


def test_interleaved_ratio_is_slowest_rank_against_slowest_rank():
    ranks = _ranks(None)
    for r, (b, i) in zip(ranks, [(7.0, 4.5), (7.1, 4.4)]):
        r["interleaved"] = {"prefill": {"bf16": {"layer_ms": b, "rounds_ms": [b]}, "int8_channel": {"layer_ms": i, "rounds_ms": [i]}}}
        r["sustained"] = {"prefill": {"bf16": {"layer_ms": b + 0.5}, "int8_channel": {"layer_ms": i + 0.1}}}
    s = bench_layer._summary(ranks, ARGS)
    assert s["ratios"]["int8_channel/prefill_interleaved"] == pytest.approx(7.1 / 4.5)
    assert s["ratios"]["int8_channel/prefill_sustained"] == pytest.approx(7.6 / 4.6)
    table = bench_layer._table(s)
    assert "interleaved throughput" in table and "int8_channel 4.500 ms (1.58x bf16)" in table
    assert "sustained throughput" in table and "int8_channel 4.600 ms (1.65x bf16)" in table


def test_interleaved_turns_rotate_and_take_medians(monkeypatch):
    calls = []
    times = iter([1.0, 5.0, 2.0, 4.0, 3.0, 6.0])
    monkeypatch.setattr(bench_layer, "_time_loop", lambda fn, *a: (calls.append(fn()), next(times))[1])
    got = bench_layer._interleaved({"a": lambda: "a", "b": lambda: "b"}, 10, 1, 3, None)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert got["a"]["rounds_ms"] == [1.0, 4.0, 3.0] and got["a"]["layer_ms"] == 3.0
    assert got["b"]["layer_ms"] == 5.0


class _FakeEvent:
    """A CUDA event stand-in whose clock is a counter of forwards run (1 ms each, 2 ms for 'b')."""

    now = 0.0

    def __init__(self, enable_timing=False):
        self.t = None

    def record(self):
        self.t = _FakeEvent.now

    def elapsed_time(self, other):
        return other.t - self.t


def test_sustained_windows_and_second_half_median(monkeypatch):
    monkeypatch.setattr(bench_layer.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(bench_layer.torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(bench_layer, "_barrier", lambda device: None)
    slow = iter([1.0] * 3 * 2 + [3.0] * 3 * 2)  # scheme b: first two windows 1 ms/forward, then 3

    def fwd(ms):
        def run():
            _FakeEvent.now += ms if ms else next(slow)
        return run

    got = bench_layer._sustained({"a": fwd(1.0), "b": fwd(None)}, 3, 4, "cpu")
    assert got["a"]["window_ms"] == [1.0] * 4 and got["a"]["layer_ms"] == 1.0
    assert got["b"]["window_ms"] == [1.0, 1.0, 3.0, 3.0] and got["b"]["layer_ms"] == 3.0


def test_pipelined_pairs_run_back_to_back_with_per_call_medians(monkeypatch):
    """One barrier before the timed pairs and none between them; each call's own events; medians."""
    monkeypatch.setattr(bench_layer.torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(bench_layer.torch.cuda, "synchronize", lambda *a: None)
    barriers = []
    monkeypatch.setattr(bench_layer, "_barrier", lambda device: barriers.append(_FakeEvent.now))
    d_ms, c_ms = iter([9.0, 9.0, 1.0, 2.0, 3.0, 2.0]), iter([9.0, 9.0, 5.0, 4.0, 6.0, 4.0])  # 2 warm-up pairs
    seen = []

    def dispatch():
        _FakeEvent.now += next(d_ms)
        return "handle"

    def combine(arg):
        seen.append(arg)
        _FakeEvent.now += next(c_ms)

    _FakeEvent.now = 0.0
    got = bench_layer._time_pipelined(dispatch, combine, 4, 2, "cpu", between=lambda h: (h, "y"))
    assert barriers == [36.0]  # after the warm-up, before the timed pairs only
    assert got == {"dispatch_pipelined_ms": 2.0, "combine_pipelined_ms": 4.5}
    assert seen == [("handle", "y")] * 6


def test_overheads_are_layer_over_deepep_minus_one():
    raw = dict(dispatch_ms=0.2, combine_ms=0.25, dispatch_pipelined_ms=0.1, combine_pipelined_ms=0.5)
    ours = dict(dispatch_ms=0.21, combine_ms=0.25, dispatch_pipelined_ms=0.099, combine_pipelined_ms=0.51)
    got = bench_layer._overheads(raw, ours)
    assert got == pytest.approx(dict(dispatch_overhead_pct=5.0, combine_overhead_pct=0.0,
                                     dispatch_pipelined_overhead_pct=-1.0, combine_pipelined_overhead_pct=2.0))


def test_pipelined_overheads_are_reported():
    s = bench_layer._summary(_ranks(None), ARGS)
    row = s["ranks"][0]["schemes"]["int8_channel"]["prefill"]
    row["deepep_ms"].update(dispatch_pipelined_ms=0.2, combine_pipelined_ms=0.25)
    row["layer_dc_ms"].update(dispatch_pipelined_ms=0.202, combine_pipelined_ms=0.25)
    row.update(dispatch_pipelined_overhead_pct=1.0, combine_pipelined_overhead_pct=0.0)
    table = bench_layer._table(s)
    assert ("pipelined (DeepEP's own method), int8_channel prefill, rank 0: dispatch DeepEP 0.2000 ms, layer "
            "0.2020 ms (+1.0%); combine DeepEP 0.2500 ms, layer 0.2500 ms (+0.0%)") in table


@pytest.mark.parametrize("arg", ["--iters=0", "--warmup=-1", "--rounds=-1", "--sustained=-1", "--prefill-tokens=0", "--decode-tokens=0",
                                 "--num-sms=63"])
def test_counts_are_checked(arg, capsys):
    with pytest.raises(SystemExit):
        bench_layer._parse([arg])
    assert arg.split("=")[0] in capsys.readouterr().err


def test_no_host_sync_ratio_is_slowest_rank_against_slowest_rank():
    ranks = _ranks(None)
    times = {"bf16": (7.9, 8.1), "int8_channel": (4.8, 4.7)}
    for r in ranks:
        for scheme, ms in times.items():
            r["schemes"][scheme]["prefill"]["no_host_sync"] = dict(
                layer_ms=ms[r["rank"]], sync_ms=9.0, rel_diff_vs_sync=0.0
            )
    s = bench_layer._summary(ranks, ARGS)
    assert s["ratios"]["int8_channel/prefill_no_host_sync"] == pytest.approx(8.1 / 4.8)
    assert "prefill without host sync" in bench_layer._table(s)


def test_plot_segments_keep_one_color_per_phase_across_panels():
    """Decode has no scatter or gather: its GEMM1 must still be drawn in prefill's GEMM1 color,
    the one the legend names, and the segments must stack in the layer's order."""
    prefill = {"quantize": 0.2, "dispatch": 0.4, "scatter": 0.3, "gemm1": 2.0, "gemm2": 1.2, "gather": 0.2,
               "combine": 0.3}
    decode = {"quantize": 0.03, "dispatch": 0.1, "gemm1": 1.0, "gemm2": 0.5, "combine": 0.05}
    rank = {"schemes": {s: {"prefill": {"phases_ms": prefill, "layer_ms": 4.5, "tokens": 4096},
                            "decode": {"phases_ms": decode, "layer_ms": 1.6, "tokens": 128}}
                        for s in ("bf16", "int8_channel")}}  # fmt: skip
    colors = {}
    for phase, times in (("prefill", prefill), ("decode", decode)):
        names, segments = bench_layer._stacked_phases(rank, phase)
        assert names == ["bf16", "int8_channel"]
        assert [p for p, *_ in segments] == [p for p in bench_layer.PHASES if p in times]
        for p, vals, bottom, color in segments:
            assert colors.setdefault(p, color) == color, f"{p} changes color between panels"
            assert vals == [times[p]] * 2
        tops = [b[0] + v[0] for _, v, b, _ in segments]
        assert tops[-1] == pytest.approx(sum(times.values()))
    assert len(set(colors.values())) == len(colors)
