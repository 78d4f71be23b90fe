import math

import pytest
import torch

from epmoe.quant import (
    dequantize_rows,
    dequantize_weight,
    get_scheme,
    quantize_rows,
    quantize_weight,
)
from reference import fake_quant, fake_quant_weight


@pytest.mark.parametrize("kind,qdtype,qmax", [("int8", torch.int8, 127.0), ("fp8", torch.float8_e4m3fn, 448.0)])
@pytest.mark.parametrize("group", [None, 128])
def test_rows_match_independent_float64(kind, qdtype, qmax, group):
    torch.manual_seed(1)
    x = torch.randn(67, 384) * torch.logspace(-3, 2, 67).unsqueeze(1)
    q, s = quantize_rows(x, qdtype, qmax, group)
    assert q.dtype == qdtype and s.dtype == torch.float32
    assert s.shape == (67, 1 if group is None else 3)
    got = dequantize_rows(q, s).double()
    ref = fake_quant(x, kind, group)
    # fp32 division vs float64 division may flip a value sitting exactly on a rounding boundary.
    mismatch = (got - ref).abs() > 1e-6 * ref.abs().clamp(min=1e-12)
    assert mismatch.float().mean() < 1e-3


def test_int8_rounding_rule_is_half_to_even():
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -2.5, -0.5, 126.5, -127.0]])
    q, s = quantize_rows(x, torch.int8, 127.0)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, -2, 0, 126, -127]]


def test_int8_round_trip_bound():
    torch.manual_seed(2)
    x = torch.randn(50, 256)
    q, s = quantize_rows(x, torch.int8, 127.0, 128)
    err = (dequantize_rows(q, s) - x).abs().reshape(50, 2, 128)
    # Round to nearest: at most half a step (scale) per element, plus fp32 slack.
    assert (err <= s.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all()


def test_fp8_round_trip_bound():
    torch.manual_seed(3)
    x = torch.randn(50, 256)
    q, s = quantize_rows(x, torch.float8_e4m3fn, 448.0, 128)
    y = dequantize_rows(q, s)
    # e4m3: 3 mantissa bits -> relative error <= 2^-4 for normals; subnormals (below 2^-6 * scale)
    # have absolute error <= 2^-10 * scale.
    bound = torch.maximum(x.abs() * 2**-4, s.repeat_interleave(128, 1) * 2**-10)
    assert ((y - x).abs() <= bound * (1 + 1e-5)).all()


def test_zero_rows_get_finite_scale_and_zero_codes():
    x = torch.zeros(3, 256)
    for qdtype, qmax in ((torch.int8, 127.0), (torch.float8_e4m3fn, 448.0)):
        q, s = quantize_rows(x, qdtype, qmax, 128)
        assert torch.isfinite(s).all() and (s > 0).all()
        assert (q.float() == 0).all()


def test_nan_and_inf_stay_in_their_row():
    x = torch.randn(4, 256)
    x[1, 7] = float("nan")
    x[2, 200] = float("inf")
    for group in (None, 128):
        q, s = quantize_rows(x, torch.int8, 127.0, group)
        y = dequantize_rows(q, s)
        assert not torch.isfinite(y[1]).all() and not torch.isfinite(y[2]).all()
        assert torch.isfinite(y[[0, 3]]).all()


@pytest.mark.parametrize("scheme", ["int8_channel", "int8_block", "fp8_block"])
def test_weight_quantization_matches_independent(scheme):
    torch.manual_seed(4)
    w = torch.randn(3, 256, 384) * 0.05
    s = get_scheme(scheme)
    q, scale = quantize_weight(w, s)
    assert scale.shape == s.weight_scale_shape(3, 256, 384)
    kind = "int8" if s.qdtype == torch.int8 else "fp8"
    ref = fake_quant_weight(w, kind, s.weight_granularity)
    got = dequantize_weight(q, scale).double()
    mismatch = (got - ref).abs() > 1e-6 * ref.abs().clamp(min=1e-12)
    assert mismatch.float().mean() < 1e-3
    rel = ((got - w.double()).norm() / w.double().norm()).item()
    assert rel < (0.01 if kind == "int8" else 0.04)


def test_block_weights_with_ragged_edges():
    w = torch.randn(2, 200, 130)
    q, scale = quantize_weight(w, get_scheme("int8_block"))
    assert scale.shape == (2, 2, 2) and q.shape == w.shape
    assert (dequantize_weight(q, scale) - w).abs().max() <= scale.max() * 0.5 * (1 + 1e-5)


def test_bad_inputs():
    with pytest.raises(ValueError, match="group_size=100 must divide the last dimension 256"):
        quantize_rows(torch.randn(2, 256), torch.int8, 127.0, 100)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        quantize_rows(torch.ones(2, 128, dtype=torch.int32), torch.int8, 127.0)
    with pytest.raises(ValueError, match=r"w must be \[E, N, K\]"):
        quantize_weight(torch.randn(4, 4), get_scheme("int8_channel"))
    with pytest.raises(ValueError, match="quant='int4' is not a known scheme"):
        get_scheme("int4")
    with pytest.raises(ValueError, match="fits neither channel"):
        dequantize_weight(torch.ones(1, 256, 256, dtype=torch.int8), torch.ones(1, 3, 3))
