"""benchmarks/int8_block_gemms.py without a GPU: its arguments (every refusal names the value and
what is allowed) and its refusal to run without CUDA."""

from __future__ import annotations

import pytest
import torch

from benchmarks import int8_block_gemms as ibg
from epmoe.experts.cutlass_backend import INT8_BLOCK_SCHEDULES


def test_defaults_are_every_variant():
    args = ibg.parse_args(["--out", "x.json"])
    assert args.variants == list(INT8_BLOCK_SCHEDULES) and "n256_quarters_run4" in args.variants
    assert args.ms == [512, 2048] and args.rounds == 3


@pytest.mark.parametrize("argv, said", [
    (["--variants", "n256_quarters,fast"], "allowed are names of"),
    (["--variants", ""], "allowed are names of"),
    (["--rounds", "0"], "--rounds must be >= 1; got 0"),
    (["--m", "512,x"], "--m='512,x'"),
    (["--m", "0"], "--m='0'"),
    (["--m", "512,100"], "--m='512,100': comma-separated multiples of 128"),
    (["--experts", "0"], "--experts must be >= 1; got 0"),
])  # fmt: skip
def test_bad_arguments_are_refused_by_name(argv, said, capsys):
    with pytest.raises(SystemExit):
        ibg.parse_args(["--out", "x.json", *argv])
    assert said in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal without CUDA")
def test_refuses_without_cuda(tmp_path, capsys):
    assert ibg.main(["--out", str(tmp_path / "x.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.json").exists()


def test_time_gemm_times_every_kernel_in_turns_on_its_shape():
    """One GEMM's rows with a stand-in extension (CPU timing): every variant and the channel
    kernel, each called with the GEMM's operands (A MN-major scales for the block kernel), a time
    per round."""
    calls = []

    class Ext:
        def int8_block_contiguous_gemm(self, out, a, a_scale, b, b_scale, offsets, raster, swizzle, variant, pdl):
            calls.append(("block", variant, tuple(a.shape), tuple(b.shape), a_scale.stride()))

        def int8_contiguous_gemm(self, out, a, a_scale, b, b_scale, offsets, raster, swizzle, pdl):
            calls.append(("channel", None, tuple(a.shape), tuple(b.shape), a_scale.stride()))

    args = ibg.parse_args(["--out", "x.json", "--m", "128", "--experts", "2", "--rounds", "2",
                           "--variants", "n256_quarters_run4,n256_quarters_i2f_s4"])  # fmt: skip
    rows = ibg.time_gemm(Ext(), args, 128, "gemm2", torch.Generator().manual_seed(0))
    assert [r["kernel"] for r in rows] == ["n256_quarters_run4", "n256_quarters_i2f_s4", "channel"]
    assert all(len(r["rounds_ms"]) == 2 and r["n"] == 7168 and r["k"] == 2048 for r in rows)
    blocks = {c[1] for c in calls if c[0] == "block"}
    assert blocks == {INT8_BLOCK_SCHEDULES.index("n256_quarters_run4"), INT8_BLOCK_SCHEDULES.index("n256_quarters_i2f_s4")}
    assert all(c[2] == (256, 2048) and c[3] == (2, 7168, 2048) for c in calls)
    assert all(c[4] == (1, 256) for c in calls if c[0] == "block")  # MN-major, as the pass hands them


def test_time_gemm_times_the_fused_gemm1_and_the_activation(monkeypatch):
    """GEMM1's rows add the fused builds of the variants that have one (``<variant>+silu``, int8
    codes [M, N/2] and MN-major scales out) and the activation kernel the others need after them."""
    calls = []

    class Ext:
        def int8_block_contiguous_gemm(self, out, a, a_scale, b, b_scale, offsets, raster, swizzle, variant, pdl):
            calls.append(("block", variant))

        def int8_block_silu_gemm(self, q, q_scale, a, a_scale, b, b_scale, offsets, raster, swizzle, variant, pdl):
            calls.append(("silu", variant, tuple(q.shape), q.dtype, q_scale.stride()))

        def int8_contiguous_gemm(self, out, a, a_scale, b, b_scale, offsets, raster, swizzle, pdl):
            calls.append(("channel", None))

    monkeypatch.setattr("epmoe.kernels.activation.silu_and_mul_quant", lambda *a, **k: calls.append(("act", a[1:4], k)))
    args = ibg.parse_args(["--out", "x.json", "--m", "128", "--experts", "1", "--rounds", "1",
                           "--variants", "n256_quarters_run4,n256_quarters_i2f_s4"])  # fmt: skip
    rows = ibg.time_gemm(Ext(), args, 128, "gemm1", torch.Generator().manual_seed(0))
    assert [r["kernel"] for r in rows] == ["n256_quarters_run4", "n256_quarters_i2f_s4", "channel",
                                           "n256_quarters_run4+silu", ibg.ACTIVATION]  # fmt: skip
    assert ("silu", INT8_BLOCK_SCHEDULES.index("n256_quarters_run4"), (128, 2048), torch.int8, (1, 128)) in calls
    assert ("act", ("group", 128, torch.int8), {"scale_mn_major": True}) in calls
    act = rows[-1]
    assert act["TOPS"] is None and act["frac_peak_datasheet"] is None and rows[0]["TOPS"] > 0
