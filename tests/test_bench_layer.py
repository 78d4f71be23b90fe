"""The report side of ``epmoe bench layer`` (the run itself needs two GPUs and DeepEP)."""

from __future__ import annotations

import argparse

import pytest

from epmoe.bench import layer as bench_layer


def _row(layer_ms):
    return dict(backend="triton", layer_ms=layer_ms, phases_ms={"dispatch": 0.4, "gemm1": 1.0})


def _ranks():
    return [{"rank": rank, "schemes": {"bf16": {"prefill": _row(bf16_ms)}, "int8_channel": {"prefill": _row(int8_ms)}}}
            for rank, (bf16_ms, int8_ms) in enumerate([(8.0, 5.0), (8.2, 4.9)])]  # fmt: skip


ARGS = argparse.Namespace(prefill_tokens=4096, decode_tokens=128, iters=20, warmup=3, rounds=5, backend="auto",
                          num_sms=None)  # fmt: skip


def test_ratio_is_slowest_rank_against_slowest_rank():
    s = bench_layer._summary(_ranks(), ARGS)
    assert s["ratios"]["int8_channel/prefill"] == pytest.approx(8.2 / 5.0)
    assert "int8_channel" in bench_layer._table(s)


def test_device_is_the_ranks_gpus_not_the_launchers_gpu_0(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: f"GPU {torch.device(d).index}")
    assert bench_layer.device_name(torch.device("cuda", 1)) == "GPU 1"
    assert bench_layer.device_name(torch.device("cpu")) is None
    ranks = _ranks()
    for r in ranks:
        r["device"] = "NVIDIA H200"
    assert bench_layer._summary(ranks, ARGS)["config"]["device"] == "NVIDIA H200"
    ranks[1]["device"] = "NVIDIA H100 80GB HBM3"
    got = bench_layer._summary(ranks, ARGS)["config"]["device"]
    assert got == "rank 0: NVIDIA H200; rank 1: NVIDIA H100 80GB HBM3"
    ranks[1]["device"] = None  # a rank that recorded no name
    assert bench_layer._summary(ranks, ARGS)["config"]["device"] == "rank 0: NVIDIA H200; rank 1: unknown"
    assert bench_layer._summary(_ranks(), ARGS)["config"]["device"] is None  # results without names


def test_interleaved_ratio_is_slowest_rank_against_slowest_rank():
    ranks = _ranks()
    for r, (b, i) in zip(ranks, [(7.0, 4.5), (7.1, 4.4)]):
        r["interleaved"] = {"prefill": {"bf16": {"layer_ms": b, "rounds_ms": [b]}, "int8_channel": {"layer_ms": i, "rounds_ms": [i]}}}
    s = bench_layer._summary(ranks, ARGS)
    assert s["ratios"]["int8_channel/prefill_interleaved"] == pytest.approx(7.1 / 4.5)
    table = bench_layer._table(s)
    assert "interleaved throughput" in table and "int8_channel 4.500 ms (1.58x bf16)" in table


def test_interleaved_turns_rotate_and_take_medians(monkeypatch):
    from epmoe import timing

    calls = []
    times = iter([1.0, 5.0, 2.0, 4.0, 3.0, 6.0])
    monkeypatch.setattr(timing, "collective_ms", lambda fn, *a: (calls.append(fn()), next(times))[1])
    got = bench_layer.interleaved({"a": lambda: "a", "b": lambda: "b"}, 10, 1, 3, None)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert got["a"]["rounds_ms"] == [1.0, 4.0, 3.0] and got["a"]["layer_ms"] == 3.0
    assert got["b"]["layer_ms"] == 5.0


@pytest.mark.parametrize("arg", ["--iters=0", "--warmup=-1", "--rounds=-1", "--prefill-tokens=0", "--decode-tokens=0",
                                 "--num-sms=63"])
def test_counts_are_checked(arg, capsys):
    with pytest.raises(SystemExit):
        bench_layer._parse([arg])
    assert arg.split("=")[0] in capsys.readouterr().err


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


def test_experts_is_stacked_only_without_its_stages():
    """The experts range holds GEMM1..GEMM2 where the backend places them: counted once."""
    staged = {"dispatch": 0.4, "experts": 3.0, "gemm1": 2.0, "gemm2": 1.0, "combine": 0.3}
    whole = {"dispatch": 0.4, "experts": 3.0, "combine": 0.3}
    rank = {"schemes": {"triton": {"prefill": {"phases_ms": staged}}, "deepgemm": {"prefill": {"phases_ms": whole}}}}
    _, segments = bench_layer._stacked_phases(rank, "prefill")
    experts = next(vals for p, vals, _, _ in segments if p == "experts")
    assert experts == [0.0, 3.0]
    tops = [b[-1] + v[-1] for _, v, b, _ in segments]
    assert tops[-1] == pytest.approx(3.7)


@pytest.mark.parametrize("world, normal, low_latency", [(2, (1, 1), (6, 2)), (4, (3, 1), (7, 1)), (8, (4, 0), (8, 0))])
def test_bytes_sent_counts_rows_per_destination_rank(world, normal, low_latency):
    """One token's 8 experts seen from rank 1 (remote rows, local rows): normal mode sends one row
    per destination rank, low-latency one per expert. At 4 ranks they sit on ranks 0, 1, 2, 3
    and four more on 0; at 8 on ranks 0, 2, 4, 6 (none local); at 2 six on rank 0."""
    import torch

    ids = torch.tensor([[0, 65, 130, 195, 1, 2, 3, 4]])
    for mode, (remote, local) in (("normal", normal), ("low_latency", low_latency)):
        got = bench_layer.bytes_sent(ids, 1, 100, mode, world)
        assert (got["rows_remote"], got["rows_local"]) == (remote, local), (world, mode, got)
        assert got["combine_remote"] == remote * bench_layer.H * 2
