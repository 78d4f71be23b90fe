"""The small-batch W8A8 INT8 dense kernel (epmoe.kernels.dense_int8) under the interpreter,
against float64 references that quantize the activations on their own (test_linear's
``ref_quant_rows``), fused and unfused, both schemes, both accumulators, with and without bias."""

from __future__ import annotations

import pytest
import torch

from epmoe.kernels.dense_int8 import SmallMConfig, dense_int8_small_m, small_m_config
from test_linear import ref_quant_rows  # tests/ is on sys.path (conftest)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# fp32 output; a rare activation code on the other side of a rounding boundary between the fp32
# quantizer and the float64 one (~1e-4 of the norm): far below the ~1e-2 of quantization itself.
TIGHT = 1e-3
CASES = [("int8_channel", "int32"), ("int8_channel", "fp32"), ("int8_block", "fp32")]


def _weights(n, k, scheme, gen):
    w = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    shape = (n, 1) if scheme == "int8_channel" else (-(-n // 128), k // 128)
    ws = torch.rand(shape, generator=gen) * 1e-2 + 1e-3
    return w, ws


def _ref(x, w, ws, bias, scheme):
    if scheme == "int8_channel":
        wf = w.double() * ws.double()
        xq = ref_quant_rows(x, None)
    else:
        full = ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)[: w.shape[0], : w.shape[1]]
        wf = w.double() * full
        xq = ref_quant_rows(x, 128)
    out = xq @ wf.t()
    return out if bias is None else out + bias.double()


def _rel(a, b):
    return float((a.double().cpu() - b).norm() / b.norm())


@pytest.mark.parametrize("scheme,acc", CASES, ids=["channel-int32", "channel-fp32", "block"])
@pytest.mark.parametrize("m", [1, 7, 128, 1000])
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_small_m_kernel_against_float64(scheme, acc, m, fused):
    gen = torch.Generator().manual_seed(m)
    n, k = 40, 256  # N not a multiple of the tile: masked stores; K two block steps
    w, ws = _weights(n, k, scheme, gen)
    x = torch.randn(m, k, generator=gen)
    x[0, 3] = 9.0  # an outlier sets row 0's scale
    bias = torch.randn(n, generator=gen) if m % 2 else None
    cfg = SmallMConfig(16 if m <= 16 else 64, 16, 128, 4, 2, fused)
    out = dense_int8_small_m(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), None if bias is None else bias.to(DEVICE),
                             scheme=scheme, accumulator=acc, config=cfg)  # fmt: skip
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert _rel(out, _ref(x, w, ws, bias, scheme)) <= TIGHT


@pytest.mark.parametrize("scheme,acc", CASES, ids=["channel-int32", "channel-fp32", "block"])
def test_fused_equals_quantize_then_gemm(scheme, acc):
    """The fused kernel forms the very codes of the quantizer kernel: equal outputs (int32: the
    same exact sum; fp32: the same K steps)."""
    gen = torch.Generator().manual_seed(5)
    n, k = 24, 384
    w, ws = _weights(n, k, scheme, gen)
    x = (torch.randn(3, k, generator=gen) * 3).to(DEVICE)
    args = (w.to(DEVICE), ws.to(DEVICE))
    fused = dense_int8_small_m(x, *args, scheme=scheme, accumulator=acc, config=SmallMConfig(16, 16, 128, 4, 2, True))
    plain = dense_int8_small_m(x, *args, scheme=scheme, accumulator=acc, config=SmallMConfig(16, 16, 128, 4, 2, False))
    torch.testing.assert_close(fused, plain, rtol=0, atol=0)


def test_uneven_k_and_fp16_output():
    """Channel K not a multiple of the K tile (masked K loads), fp16 in and out, default config."""
    gen = torch.Generator().manual_seed(2)
    n, k = 33, 200
    w, ws = _weights(n, k, "int8_channel", gen)
    x = torch.randn(5, k, generator=gen).half()
    out = dense_int8_small_m(x.to(DEVICE), w.to(DEVICE), ws.to(DEVICE), scheme="int8_channel", accumulator="int32")
    assert out.dtype == torch.float16
    assert _rel(out, _ref(x.float(), w, ws, None, "int8_channel")) <= 2e-3


def test_refusals():
    w = torch.zeros(16, 128, dtype=torch.int8, device=DEVICE)
    ws = torch.ones(16, 1, device=DEVICE)
    x = torch.zeros(2, 128, device=DEVICE)
    with pytest.raises(ValueError, match="scheme="):
        dense_int8_small_m(x, w, ws, scheme="fp8", accumulator="fp32")
    with pytest.raises(ValueError, match="accumulator='int32'"):
        dense_int8_small_m(x, w, torch.ones(1, 1, device=DEVICE), scheme="int8_block", accumulator="int32")
    with pytest.raises(ValueError, match="weight:"):
        dense_int8_small_m(torch.zeros(2, 64, device=DEVICE), w, ws, scheme="int8_channel", accumulator="int32")
    with pytest.raises(ValueError, match="x_scale"):
        dense_int8_small_m(x.to(torch.int8), w, ws, scheme="int8_channel", accumulator="int32")
    with pytest.raises(ValueError, match="fused"):
        dense_int8_small_m(x.to(torch.int8), w, ws, scheme="int8_channel", accumulator="int32",
                           x_scale=torch.ones(2, 1, device=DEVICE), config=SmallMConfig(16, 16, 128, 4, 2, True))  # fmt: skip


def test_config_rule():
    """Narrow N tiles until two programs per SM; fused only while the activations a program
    reads stay within its weight bytes; the block scheme steps one scale block."""
    sms = 132
    kv_a = small_m_config(1, 576, 7168, "int8_channel", sms)
    assert kv_a.block_n == 16 and kv_a.fused and kv_a.block_k == 256 and kv_a.num_stages == 5
    assert small_m_config(16, 576, 7168, "int8_channel", sms)[2:5] == (512, 4, 4)  # 16 KB stages
    assert small_m_config(16, 576, 7168, "int8_channel", sms).fused is False
    wide = small_m_config(16, 36864, 7168, "int8_channel", sms)
    assert wide.block_n == 128 and wide.fused
    assert small_m_config(64, 36864, 7168, "int8_channel", sms).fused is False
    assert small_m_config(4, 1536, 7168, "int8_block", sms).block_k == 128
    for m in (1, 16, 64):
        for n, k in ((1536, 7168), (24576, 1536), (7168, 18432)):
            cfg = small_m_config(m, n, k, "int8_channel", sms)
            stage = cfg.block_m * cfg.block_k * (2 if cfg.fused else 1) + cfg.block_n * cfg.block_k
            assert cfg.num_stages * stage <= 72 * 1024  # three programs fit on one SM
