"""benchmarks/int8_block_schedules.py without a GPU: the rows it asks the experts bench for, the
summary's ratios and targets on synthetic results, and a tiny CPU dry run end to end."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import int8_block_schedules as ibs
from epmoe.experts.cutlass_backend import INT8_BLOCK_SCHEDULES


def _row(backend, m, ms, error=None):
    return {"backend": backend, "m": m, "error": error, "ms": {} if ms is None else {"total_turns": ms}}


def test_every_schedule_is_a_row_with_cutlass_forced():
    argv = ibs.bench_argv(ibs.parse_args(["--out", "x.json"]), "b.json", INT8_BLOCK_SCHEDULES)
    extras = [argv[i + 1] for i, a in enumerate(argv) if a == "--extra"]
    assert extras[0].endswith("@int8_channel_int32?int8_kernel=cutlass")
    assert [e.split("schedule=")[1] for e in extras[1:]] == [f"{s}&int8_kernel=cutlass" for s in INT8_BLOCK_SCHEDULES]
    assert "--masked" not in argv and argv[argv.index("--turns") + 1] == "2"
    assert argv[argv.index("--backends") + 1] == "torch_bf16"  # lean by default: no Triton rows
    wide = ibs.bench_argv(ibs.parse_args(["--out", "x", "--masked", "--triton"]), "b", ["n256_quarters_i2f_s4"])
    assert "--masked" in wide and "triton_int8_block" in wide[wide.index("--backends") + 1]
    with pytest.raises(SystemExit):
        ibs.parse_args(["--out", "x", "--turns", "0"])


def test_summary_ratios_targets_and_fastest():
    rows = [_row("torch_bf16", 512, 10.0), _row("cutlass_int8_channel_int32_cutlass", 512, 5.0),
            _row("cutlass_int8_block_n256_quarters_i2f_s4_cutlass", 512, 7.0),
            _row("cutlass_int8_block_n256_quarters_run2_cutlass", 512, 5.5),
            _row("cutlass_int8_block_n256_quarters_run4_cutlass", 512, None, error="RuntimeError: boom"),
            _row("cutlass_int8_channel_int32_cutlass_masked", 512, 6.0),
            _row("cutlass_int8_block_n256_quarters_i2f_s4_cutlass_masked", 512, 6.6),
            _row("torch_bf16", 32, 4.0), _row("cutlass_int8_block_n256_quarters_i2f_s4_cutlass", 32, 2.0)]  # fmt: skip
    s = ibs.summarize(rows)
    big = s["512"]["block"]
    assert big["n256_quarters_i2f_s4"] == {"ms": 7.0, "speedup_vs_bf16": 10 / 7, "time_vs_channel": 1.4, "meets_targets": False}
    assert big["n256_quarters_run2"]["meets_targets"] is True and big["n256_quarters_run2"]["time_vs_channel"] == 1.1
    assert "n256_quarters_run4" not in big  # its row failed: no time
    assert big["n256_quarters_i2f_s4_masked"]["time_vs_channel"] == pytest.approx(1.1)
    assert s["512"]["fastest"] == {"contiguous": "n256_quarters_run2", "masked": "n256_quarters_i2f_s4"}
    assert s["32"]["block"]["n256_quarters_i2f_s4"]["meets_targets"] is None  # no target at 32 rows, no channel row
    text = ibs.table(s)
    assert "n256_quarters_run2" in text and "MET" in text and "not met" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU dry run")
def test_tiny_dry_run_writes_the_summary(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert ibs.main(["--tiny", "--turns", "1", "--out", str(out), "--commit", "abc"]) == 1  # CUTLASS rows fail on CPU
    report = json.loads(out.read_text())
    assert report["commit"] == "abc" and report["gpu"] is None and report["smoke"] == {}
    assert set(report["summary"]) == {"4"} and report["summary"]["4"]["ms"]["torch_bf16"] > 0
    assert f"wrote {out}" in capsys.readouterr().out


def test_winner_is_the_least_total_time_from_128_rows_over_complete_schedules():
    def entry(**ms):
        return {"block": {s: {"ms": v} for s, v in ms.items()}}

    summary = {"8": entry(n256_quarters_i2f_s4=1.0, n256_quarters_run2=9.0), "128": entry(n256_quarters_i2f_s4=2.0, n256_quarters_run2=1.9, n256_quarters_run4=1.0),
               "2048": entry(n256_quarters_i2f_s4=30.0, n256_quarters_run2=25.0)}  # n256_quarters_run4 lacks 2048: not a candidate
    best, table = ibs.winner(summary)
    assert best == "n256_quarters_run2" and table == {"128": {"n256_quarters_i2f_s4": 2.0, "n256_quarters_run2": 1.9, "n256_quarters_run4": 1.0},
                                             "2048": {"n256_quarters_i2f_s4": 30.0, "n256_quarters_run2": 25.0}}
    assert ibs.winner({"8": entry(n256_quarters_i2f_s4=1.0)})[0] is None
    report = {"summary": summary, "gpu": "NVIDIA H200", "date": "2026-12-02T06:00:00+00:00", "commit": "abc",
              "shapes": {"experts": 128, "hidden": 7168, "intermediate": 2048}, "torch": "2.11.0+cu130"}
    entry = ibs.schedule_entry(report)["NVIDIA H200"]
    assert entry["schedule"] == "n256_quarters_run2" and "commit abc" in entry["source"]
    assert ibs.schedule_entry({**report, "gpu": None}) is None


def _block_gemm(a, sa, b, sb, offsets, out=None, *, schedule, wrong=False):
    """The INT8 block kernel's contract, written out here (each 128-wide K block an exact integer
    sum, scaled by the row's and the weight block's scales), bf16 out; ``wrong`` takes the weight
    scale of the first N block for every column, as a kernel reading the wrong scale tile would."""
    offs = offsets.tolist()
    out = torch.zeros(a.shape[0], b.shape[1], dtype=torch.bfloat16)
    for x in range(b.shape[0]):
        lo, hi = offs[x], offs[x + 1]
        acc = torch.zeros(hi - lo, b.shape[1], dtype=torch.float64)
        for kb in range(a.shape[1] // 128):
            c = slice(kb * 128, (kb + 1) * 128)
            ws = sb[x, :1, kb].expand(b.shape[1] // 128) if wrong else sb[x, :, kb]
            acc += (a[lo:hi, c].double() @ b[x, :, c].double().t()) * sa[lo:hi, kb : kb + 1].double() * ws.double().repeat_interleave(128)
        out[lo:hi] = acc.to(torch.bfloat16)
    return out


def _masked_gemm(a, sa, b, sb, masked_m, out=None, *, schedule, wrong=False):
    e, m, k = a.shape
    offsets = torch.arange(e + 1, dtype=torch.int32) * m  # every slab whole: rows past masked_m unread
    return _block_gemm(a.reshape(e * m, k), sa.reshape(e * m, -1), b, sb, offsets, schedule=schedule, wrong=wrong).view(e, m, -1)


def test_smoke_check_measures_against_the_package_reference(monkeypatch):
    """The variants' smoke check on the host, around stand-ins of the kernels: a correct kernel is
    within the bound of the package's float64 reference, one that reads a wrong scale is not."""
    import functools

    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb, "int8_block_grouped_gemm", _block_gemm)
    monkeypatch.setattr(cb, "int8_block_masked_gemm", _masked_gemm)
    assert ibs.worst_error("n256_quarters_i2f_s4", "cpu") < 2.0**-8  # bf16 output rounding
    monkeypatch.setattr(cb, "int8_block_grouped_gemm", functools.partial(_block_gemm, wrong=True))
    assert ibs.worst_error("n256_quarters_i2f_s4", "cpu") > ibs.SMOKE_BOUND
    assert "worst_error(sys.argv[1])" in ibs.SMOKE  # the child process runs this very check
