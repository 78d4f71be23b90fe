"""benchmarks/experts_phases.py without a GPU: its arguments, its refusal to run without CUDA,
and the phases of real (tiny, CPU) passes in turns."""

from __future__ import annotations

import pytest
import torch

from benchmarks import experts_phases as xp


def test_defaults():
    args = xp.parse_args(["--out", "x.json"])
    assert args.m == [512, 2048] and args.rounds == 3 and args.extra == list(xp.DEFAULT_EXTRA)
    assert xp.parse_args(["--out", "x.json", "--extra", "a:B"]).extra == ["a:B"]


@pytest.mark.parametrize("argv, said", [
    (["--m", "512,x"], "--m='512,x'"),
    (["--m", "0"], "--m='0'"),
    (["--rounds", "0"], "--rounds must be >= 1; got 0"),
    (["--iters", "0"], "--iters must be >= 1; got 0"),
    (["--experts", "0"], "--experts must be >= 1; got 0"),
    (["--rep-ms", "0"], "--rep-ms must be > 0; got 0.0"),
    (["--rep-ms", "nan"], "--rep-ms must be > 0; got nan"),
    (["--m", "512,,2048"], "--m='512,,2048'"),
    (["--extra", "a:B", "--extra", "a:B"], "--extra 'a:B' is given more than once"),
])  # fmt: skip
def test_bad_arguments_are_refused_by_name(argv, said, capsys):
    with pytest.raises(SystemExit):
        xp.parse_args(["--out", "x.json", *argv])
    assert said in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without CUDA")
def test_refuses_without_cuda(tmp_path, capsys):
    assert xp.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_medians_of_rounds_and_of_per_round_dicts():
    assert xp.medians({"a": [3.0, 1.0, 2.0]}) == {"a": 2.0}
    got = xp.medians({"a": [{"gemm1": 1.0, "gemm2": 4.0}, {"gemm1": 3.0, "gemm2": 2.0}, {"gemm1": 2.0}]})
    assert got == {"a": {"gemm1": 2.0, "gemm2": 2.0}}
    # a phase missing from the first round still counts (0 where a round lacks it)
    got = xp.medians({"a": [{"gemm1": 1.0}, {"gemm1": 3.0, "activation": 5.0}, {"gemm1": 2.0, "activation": 4.0}]})
    assert got == {"a": {"gemm1": 2.0, "activation": 4.0}}


def test_time_passes_reports_each_backends_phases_in_turns():
    """Two real passes (the Triton backend, INT8 channel and block, tiny sizes on the CPU): every
    backend gets its phases (host time on a CPU) and a whole-pass time per round."""
    from epmoe.bench.experts import backend_pass, build_problem, load_extra, uniform_batch

    cpu = torch.device("cpu")
    problem = build_problem(2, 256, 128, cpu, torch.float32)
    batch = uniform_batch(problem, 4, cpu, torch.float32, seed=0)
    backends = [load_extra(f"epmoe.experts.triton_backend:TritonBackend@{s}") for s in ("int8_channel", "int8_block")]
    passes = {label: backend_pass(problem, be, 4, batch, {}, 0, 0)[0] for label, be in backends}
    args = xp.parse_args(["--out", "x.json", "--rounds", "2", "--iters", "1", "--rep-ms", "1"])
    got = xp.time_passes(passes, args, cpu)
    assert set(got["phases_ms"]) == set(passes) == set(got["total_ms"])
    for label in passes:
        assert {"quantize", "gemm1", "gemm2"} <= set(got["phases_ms"][label]), got["phases_ms"][label]
        assert len(got["total_rounds_ms"][label]) == 2 and got["total_ms"][label] > 0
