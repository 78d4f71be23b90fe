"""``epmoe bench experts`` without a GPU: the CPU refuses shapes it cannot hold; --turns on tiny shapes."""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.bench import experts


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_cpu_refuses_the_deepseek_shapes_before_allocating(capsys):
    assert experts.main(["--m", "8"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA device, and --experts 128 --hidden 7168 --intermediate 2048 --m 8 need ~" in err
    assert "--experts 4 --hidden 256 --intermediate 128 --m 8" in err


def test_negative_turns_are_refused(capsys):
    with pytest.raises(SystemExit):
        experts.parse_args(["--turns", "-1"])
    assert "--turns must be 0 (off) or a number of rounds; got -1" in capsys.readouterr().err


@pytest.mark.parametrize("m", [",", "0,8"])
def test_row_counts_are_checked(m, capsys):
    with pytest.raises(SystemExit):
        experts.parse_args(["--m", m])
    assert "--m needs one or more row counts >= 1" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_turns_time_every_whole_pass_again(tmp_path, capsys):
    """--turns: each backend's whole pass gets a second, interleaved timing next to the first."""
    out = tmp_path / "b.json"
    args = ["--experts", "2", "--hidden", "256", "--intermediate", "128", "--m", "4", "--backends",
            "torch_bf16", "--extra", "epmoe.experts.torch_backend:TorchBackend@int8_channel",
            "--rep-ms", "1", "--ceiling-size", "64", "--turns", "2", "--json", str(out)]  # fmt: skip
    assert experts.main(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert {r["backend"] for r in rows} == {"torch_bf16", "torch_int8_channel"}
    for r in rows:
        assert r["ms"]["total_turns"] > 0
        assert r["derived"]["total_turns"]["ms"] == r["ms"]["total_turns"]
    base = next(r for r in rows if r["backend"] == "torch_bf16")
    assert base["derived"]["total_turns"]["speedup_vs_bf16"] == 1.0
    assert "whole passes in turns (2 rounds)" in capsys.readouterr().out


def test_extra_takes_the_int32_accumulator_key():
    label, backend = experts.load_extra("epmoe.experts.torch_backend:TorchBackend@int8_channel_int32")
    assert label == "torch_int8_channel_int32"
    assert backend.scheme.name == "int8_channel" and backend.accumulator == "int32"
    label, backend = experts.load_extra("epmoe.experts.torch_backend:TorchBackend@int8_block")
    assert label == "torch_int8_block" and backend.accumulator == "fp32"


def test_a_backend_failing_in_turns_leaves_the_others(capsys):
    def boom():
        raise RuntimeError("out of memory")

    cases = [experts.Case("a", 4, "bf16"), experts.Case("b", 4, "int8")]
    passes = {"a": lambda: None, "b": boom}
    experts.time_in_turns(cases, passes, 3, lambda fn, graph: (fn(), 2.0)[1])
    assert cases[0].ms["total_turns"] == 2.0
    assert "total_turns" not in cases[1].ms
    assert "RuntimeError: out of memory" in capsys.readouterr().err


def test_cpu_runs_the_triton_rows_on_the_torch_backend(capsys):
    """Without a GPU the triton rows are timed on the torch experts backend (Triton's interpreter
    is for the tests), and the run says so; triton_bf16 has torch_bf16 for its BF16 pass."""
    backends, extra = experts.cpu_backends(
        ["torch_bf16", "triton_int8_channel_int32", "triton_bf16"], ["m:C@fp8_block"]
    )
    assert backends == ["torch_bf16"]
    assert extra == ["m:C@fp8_block", "epmoe.experts.torch_backend:TorchBackend@int8_channel_int32"]
    out = capsys.readouterr().out
    assert "triton_int8_channel_int32, triton_bf16 run on the torch experts backend instead" in out
    assert experts.cpu_backends(["torch_bf16"], []) == (["torch_bf16"], [])
    assert "instead" not in capsys.readouterr().out


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_cpu_run_of_a_triton_row_needs_no_interpreter(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    out = tmp_path / "b.json"
    args = ["--experts", "2", "--hidden", "256", "--intermediate", "128", "--m", "4", "--backends",
            "torch_bf16,triton_int8_block", "--rep-ms", "1", "--ceiling-size", "64", "--json", str(out)]  # fmt: skip
    assert experts.main(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["backend"] for r in rows] == ["torch_bf16", "torch_int8_block"]
    assert all(r["error"] is None and r["accuracy"] < 0.05 for r in rows)


def test_extra_takes_keyword_arguments_into_the_backend_and_label():
    """``?key=value&...`` builds the backend with those keyword arguments (the CUTLASS INT8 block
    kernel's schedules side by side in one run) and names the row after their values."""
    label, backend = experts.load_extra(
        "epmoe.experts.cutlass_backend:CutlassBackend@int8_block?schedule=n256_quarters_run2&int8_kernel=cutlass"
    )
    assert label == "cutlass_int8_block_n256_quarters_run2_cutlass"
    assert backend.schedule == "n256_quarters_run2" and backend.forced_int8_kernel == "cutlass"
    with pytest.raises(ValueError, match=r"'schedule' is not key=value"):
        experts.load_extra("epmoe.experts.cutlass_backend:CutlassBackend@int8_block?schedule")
    with pytest.raises(ValueError, match=r"int8_kernel='gpu'; allowed: \['auto', 'cutlass', 'triton'\]"):
        experts.load_extra("epmoe.experts.cutlass_backend:CutlassBackend@int8_block?int8_kernel=gpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback only")
def test_masked_times_the_masked_layout_of_the_backends_that_run_it(tmp_path, capsys):
    """--masked: each extra backend with the masked layout gets a ``_masked`` row (its run_masked
    on slabs of m rounded up to 128, masked_m = m), checked against the same float64 rows."""
    out = tmp_path / "b.json"
    args = ["--experts", "2", "--hidden", "256", "--intermediate", "128", "--m", "5", "--backends", "torch_bf16",
            "--extra", "epmoe.experts.torch_backend:TorchBackend@int8_block", "--masked", "--rep-ms", "1",
            "--ceiling-size", "64", "--turns", "1", "--json", str(out)]  # fmt: skip
    assert experts.main(args) == 0
    rows = {r["backend"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == {"torch_bf16", "torch_int8_block", "torch_int8_block_masked"}
    masked, contiguous = rows["torch_int8_block_masked"], rows["torch_int8_block"]
    assert masked["error"] is None and masked["ms"]["total_turns"] > 0
    assert masked["accuracy"] < 0.05 and abs(masked["accuracy"] - contiguous["accuracy"]) < 1e-3
    assert "m=5 torch_int8_block_masked ..." in capsys.readouterr().out
