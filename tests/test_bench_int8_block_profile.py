"""benchmarks/int8_block_profile.py without a GPU: its arguments, the ncu CSV summaries and the
nvidia-smi samples it reads, and its refusal to launch without CUDA."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from benchmarks import int8_block_profile as ibp


@pytest.mark.parametrize("argv, said", [
    (["launch", "--kernels", "channel,fast"], "allowed are names of"),
    (["launch", "--kernels", "n256_quarters_run2+silu", "--gemm", "gemm2"], "the fused builds (+silu) are GEMM1 only"),
    (["launch", "--m", "100"], "--m must be a positive multiple of 128"),
    (["launch", "--experts", "0"], "--experts must be >= 1; got 0"),
    (["launch", "--iters", "0"], "--iters must be >= 1; got 0"),
    (["sustain", "--seconds", "0"], "--seconds must be > 0; got 0.0"),
    (["summarize", "--out", "x.json"], "at least one --details or --sass"),
    (["summarize", "--out", "x.json", "--details", "a.csv"], "--details='a.csv': expected NAME=CSV"),
    (["summarize", "--out", "x.json", "--details", "a="], "--details='a=': expected NAME=CSV"),
    (["summarize", "--out", "x.json", "--sass", "a=/no/such.csv"], "--sass='a=/no/such.csv': no such file '/no/such.csv'"),
])  # fmt: skip
def test_bad_arguments_are_refused_by_name(argv, said, capsys):
    with pytest.raises(SystemExit):
        ibp.parse_args(argv)
    assert said in capsys.readouterr().err


def test_kernel_names_are_the_variants_the_fused_builds_and_channel():
    args = ibp.parse_args(["launch", "--kernels", "n256_quarters_run4+silu,channel,n256_quarters_i2f_s4"])
    assert args.kernels == ["n256_quarters_run4+silu", "channel", "n256_quarters_i2f_s4"]
    assert "n256_quarters_run2+silu" in ibp.kernel_names() and "n256_quarters_i2f_s4+silu" not in ibp.kernel_names()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without CUDA")
@pytest.mark.parametrize("command", ["launch", "sustain"])
def test_refuses_without_cuda(command, capsys):
    assert ibp.main([command]) == 2
    assert f"{command} needs a CUDA GPU" in capsys.readouterr().err


def test_summarize_refuses_a_name_given_twice(tmp_path, capsys):
    (tmp_path / "d.csv").write_text("x")
    with pytest.raises(SystemExit):
        ibp.parse_args(["summarize", "--out", "x.json", "--details", f"a={tmp_path / 'd.csv'}", "--details", f"a={tmp_path / 'd.csv'}"])
    assert "'a' is given twice" in capsys.readouterr().err


def _details_csv(path, rows):
    cols = ["ID", "Kernel Name", "Section Name", "Metric Name", "Metric Unit", "Metric Value", "Rule Name",
            "Rule Type", "Rule Description"]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(cols)
        for kernel_id, name, unit, value, rule, text in rows:
            w.writerow([kernel_id, "k", "s", name, unit, value, rule, "", text])


def _sass_csv(path, rows):
    header = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Instructions Executed",
              "stall_dispatch", "stall_selected", "stall_dispatch (Not Issued)"]  # fmt: skip
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Kernel Name", "k"])
        w.writerow(header)
        for r in rows:
            w.writerow(r)


def test_summarize_keeps_the_named_metrics_stalls_and_mix(tmp_path):
    _details_csv(tmp_path / "d.csv", [
        ("0", "SM Frequency", "Ghz", "1.73", "", ""), ("0", "Issue Slots Busy", "%", "51.53", "", ""),
        ("0", "Executed Instructions", "inst", "1,455,074,381", "", ""), ("0", "Other", "%", "1", "", ""),
        ("0", "", "", "", "HighPipeUtilization", "Tensor is the highest-utilized pipeline (66.5%)"),
        ("0", "", "", "", "Other Rule", "x"),
        ("1", "SM Frequency", "Ghz", "9.99", "", ""), ("1", "Duration", "ms", "5", "", ""),  # a second kernel: not read
    ])  # fmt: skip
    _sass_csv(tmp_path / "s.csv", [
        ["0x0", "      FFMA R1, R2, R3, R1", "30", "100", "20", "10", "5"],
        ["0x10", "      @P0 I2FP.F32.S32 R2, R4", "10", "100", "0", "10", "0"],
        ["0x20", "      IGMMA.64x64x32.S8.S8 R24, gdesc[UR4], R24", "60", "50", "40", "20", "0"],
    ])  # fmt: skip
    out = tmp_path / "p.json"
    assert ibp.main(["summarize", "--details", f"run4={tmp_path / 'd.csv'}", "--sass", f"run4={tmp_path / 's.csv'}",
                     "--out", str(out)]) == 0  # fmt: skip
    k = json.loads(out.read_text())["kernels"]["run4"]
    assert k["details"] == {"SM Frequency": {"value": 1.73, "unit": "Ghz"}, "Issue Slots Busy": {"value": 51.53, "unit": "%"},
                            "Executed Instructions": {"value": 1455074381.0, "unit": "inst"},
                            "rules": {"HighPipeUtilization": "Tensor is the highest-utilized pipeline (66.5%)"}}  # fmt: skip
    s = k["sass"]
    assert s["samples"] == 100
    assert s["stall_fraction"] == {"dispatch": 0.6, "selected": 0.4}  # the Not Issued columns are not summed in
    assert s["named_stall_total"] == 1.0
    assert s["samples_fraction_by_opcode"] == {"IGMMA": 0.6, "FFMA": 0.3, "I2FP": 0.1}
    assert s["executed_instructions"] == 250 and s["executed_fraction_by_opcode"]["FFMA"] == 0.4


def test_summarize_refuses_files_that_are_not_ncu_pages(tmp_path):
    (tmp_path / "x.csv").write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="not an ncu --page details"):
        ibp.details_summary(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="not an ncu --page source"):
        ibp.sass_summary(tmp_path / "x.csv")
    _sass_csv(tmp_path / "two.csv", [["Kernel Name", "k2"]])
    with pytest.raises(ValueError, match="2 kernels in one source page"):
        ibp.sass_summary(tmp_path / "two.csv")


def test_smi_samples_skip_lines_that_are_not_numbers():
    clocks, power, reasons = ibp.smi_samples(["clocks.sm, power.draw, reasons", "1455, 692.5, 0x0000000000000004",
                                              "[N/A], [N/A], [N/A]", "1665, 691.9, 0x0000000000000004", "junk"])  # fmt: skip
    assert clocks == [1455.0, 1665.0] and power == [692.5, 691.9] and reasons == "0x0000000000000004"
