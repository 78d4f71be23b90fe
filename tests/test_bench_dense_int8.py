"""benchmarks/bench_dense_int8.py dry-run on CPU (--device cpu --tiny): every variant runs, the
float64 checks come out right, the JSON, summary, table and plot are written. Times on CPU mean
nothing; the script's measuring needs the GPU."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks import bench_dense_int8 as bench


def test_plain_torch_int_mm_path_against_float64():
    """The user's plain-torch path (the baseline of the target) is right, padding included."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=g)
    wq = torch.randint(-127, 128, (24, 64), generator=g, dtype=torch.int8)
    ws = torch.rand(1, 24, generator=g) * 1e-2
    out = bench.int_mm_quant(x, wq.t(), ws)
    ref = bench.ref_codes(x, None) @ (wq.double() * ws.double().t()).t()
    assert float((out.double() - ref).norm() / ref.norm()) < 1e-5


def test_dry_run_writes_rows_for_every_variant(tmp_path, monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.delenv("SGLANG_CUTLASS_MOE", raising=False)
    out = tmp_path / "dense.json"
    assert bench.main(["--device", "cpu", "--tiny", "--m", "1", "7", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["gpu"] == "cpu (dry run)" and result["rows"]
    variants = {r["variant"] for r in result["rows"]}
    assert variants == {"bf16", "int_mm+quant", "int_mm", "epmoe auto", "epmoe triton", "epmoe triton block"}
    for r in result["rows"]:
        if r["variant"] == "int_mm":
            assert r["int_mm_exact"]
        else:
            assert r["rel_err_vs_fp64"] < (1e-2 if r["variant"] == "bf16" else 5e-2)
        if "max_err_vs_dequant" in r:
            assert r["max_err_vs_dequant"] < 1e-2  # bf16 output (the interpreter truncates): 2^-8
        if r["variant"] == "epmoe triton":
            assert r["path"] == "small-batch kernel" and r["config"]["block_n"] == 16
    assert set(result["summary"]) == variants - {"bf16"}
    assert "tiny_a" in bench.table(result)
    if importlib.util.find_spec("matplotlib") is not None:  # the plot extra
        bench.plot(result, str(tmp_path / "dense.png"))
        assert (tmp_path / "dense.png").stat().st_size > 0


def test_sweep_dry_run_writes_a_table_the_plan_reads(tmp_path):
    """benchmarks/sweep_dense_int8.py on CPU (--device cpu --tiny): every cell gets an entry that
    :mod:`epmoe.kernels.dense_configs` parses, each candidate's time lands in the report, and no
    candidate fails; a 65+ row cell has only tiled and 64/128-row unfused launches."""
    pytest.importorskip("triton")
    from benchmarks import sweep_dense_int8 as sweep
    from epmoe.kernels.dense_configs import parse_table

    out, report = tmp_path / "table.json", tmp_path / "report.json"
    args = ["--device", "cpu", "--tiny", "--m", "1", "80", "--modes", "int8_channel_int32", "--out", str(out),
            "--report", str(report)]  # fmt: skip
    assert sweep.main(args) == 0
    data = json.loads(out.read_text())
    assert data["failures"] == [] and data["skipped"] == []
    plans = parse_table(data)["int8_channel_int32"]
    assert set(plans) == {f"N={n},K={k}" for _, n, k in bench.TINY_SHAPES}
    for bounds, _ in plans.values():
        assert bounds == (1, 80)
    cells = json.loads(report.read_text())["measured"]["int8_channel_int32"]
    for shape, ms in cells.items():
        assert ms["1"]["default_us"] is not None and ms["1"]["tiled_us"] is not None
        big = [json.loads(key) for key in ms["80"]["all_us"] if key != "tiled"]
        assert big and all(c["block_m"] in (64, 128) and not c["fused"] for c in big)


def test_sweep_update_keeps_what_it_did_not_measure(tmp_path):
    """--update: a second run over one mode and one batch keeps the first run's other entries."""
    pytest.importorskip("triton")
    from benchmarks import sweep_dense_int8 as sweep

    out = tmp_path / "table.json"
    base = ["--device", "cpu", "--tiny", "--out", str(out)]
    assert sweep.main([*base, "--m", "1", "--modes", "int8_block_fp32"]) == 0
    first = json.loads(out.read_text())["configs"]
    assert sweep.main([*base, "--m", "80", "--modes", "int8_channel_int32", "--update"]) == 0
    data = json.loads(out.read_text())
    assert data["configs"]["int8_block_fp32"] == first["int8_block_fp32"]
    assert {s: set(c) for s, c in data["configs"]["int8_channel_int32"].items()} == {
        f"N={n},K={k}": {"80"} for _, n, k in bench.TINY_SHAPES}
    assert set(data["measured"]) == {"int8_block_fp32", "int8_channel_int32"} and "updated_from" in data
