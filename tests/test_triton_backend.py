"""The triton experts backend against the torch reference backend, both layouts, all schemes.

Runs under Triton's interpreter on CPU (fp16 / fp32 activations: the interpreter truncates bf16)
and compiled on a GPU.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from epmoe.experts.base import ExpertWeights  # noqa: E402
from epmoe.experts.torch_backend import TorchBackend  # noqa: E402
from epmoe.experts.triton_backend import TritonBackend  # noqa: E402
from epmoe.layouts import _to_contiguous_kernels, to_contiguous, to_masked  # noqa: E402
from epmoe.quant.reference import quantize_rows, quantize_weight  # noqa: E402
from epmoe.quant.schemes import get_scheme  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
E, H, I = 4, 256, 128

SCHEME_ACC = [("int8_channel", "fp32"), ("int8_channel", "int32"), ("int8_block", "fp32"), ("bf16", "fp32")]


def _weights(name: str) -> ExpertWeights:
    g = torch.Generator().manual_seed(0)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    scheme = get_scheme(name)
    if not scheme.quantized:
        return ExpertWeights(scheme, w13.half().to(DEVICE), w2.half().to(DEVICE))
    q13, s13 = quantize_weight(w13, scheme)
    q2, s2 = quantize_weight(w2, scheme)
    return ExpertWeights(scheme, q13.to(DEVICE), q2.to(DEVICE), s13.to(DEVICE), s2.to(DEVICE))


def _routings():
    g = torch.Generator().manual_seed(1)
    uneven = torch.randint(0, E, (13, 2), generator=g)
    uneven[:, 0] = 2  # one expert gets every token
    uneven[3, 1] = -1  # a slot owned by another rank
    uneven[uneven == 1] = 3  # expert 1 gets nothing
    one_expert = torch.full((7, 2), -1)
    one_expert[:, 0] = 0
    return {"uneven": uneven, "one_expert": one_expert, "no_tokens": torch.full((5, 2), -1)}


ROUTINGS = _routings()


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    if ref.numel() == 0:
        return 0.0
    return float((out.double() - ref.double()).abs().mean() / ref.double().abs().mean().clamp(min=1e-12))


def _x(r: int) -> torch.Tensor:
    return torch.randn(r, H, generator=torch.Generator().manual_seed(r)).half()


@pytest.mark.parametrize("scheme,acc", SCHEME_ACC)
@pytest.mark.parametrize("routing", list(ROUTINGS))
@pytest.mark.parametrize("align", [1, 8])
def test_contiguous_matches_torch_backend(scheme, acc, routing, align):
    ids = ROUTINGS[routing]
    x = _x(ids.shape[0])
    batch = to_contiguous(x.to(DEVICE), None, ids.to(DEVICE), E, alignment=align)
    weights = _weights(scheme)
    backend = TritonBackend(get_scheme(scheme), accumulator=acc)
    out = backend.run_contiguous(batch, backend.prepare_weights(weights), torch.float32)
    ref = TorchBackend(get_scheme(scheme)).run_contiguous(batch, weights, torch.float32)
    valid = (batch.m_indices >= 0).cpu()
    assert out.shape == (batch.x.shape[0], H) and out.dtype == torch.float32
    got, want = out.cpu()[valid], ref.cpu()[valid]
    assert torch.isfinite(got).all()
    # fp32 intermediates: only fp32 summation order differs, plus rare requantization flips.
    assert _rel_err(got, want) < 2e-3


@pytest.mark.parametrize("scheme,acc", SCHEME_ACC)
@pytest.mark.parametrize(
    "routing,align,fmt,hint",
    [("uneven", 1, None, 6), ("uneven", 1, None, 1), ("uneven", 1, "native", 6), ("uneven", 1, "fp8_groups", 6),
     ("uneven", 8, None, 6), ("no_tokens", 1, None, 6)],
)
def test_contiguous_with_device_sizes_matches_exact_batch(scheme, acc, routing, align, fmt, hint):
    """A batch whose segment sizes stayed on the device (spare rows past the last segment, here
    poisoned with NaN / extreme codes) gives the exact batch's outputs on every used row: float,
    native INT8 and requantized FP8 inputs, padded segments, no local slot at all; with a hint of
    one row per expert the row-wise kernels loop over the rows past it."""
    ids = ROUTINGS[routing]
    x = _x(ids.shape[0])
    xs = None
    sch = get_scheme(scheme)
    if fmt == "native":
        if not sch.quantized:
            pytest.skip("bf16 has no quantized native format")
        x, xs = quantize_rows(x.float(), torch.int8, 127.0, None if sch.act_granularity == "token" else 128)
    elif fmt == "fp8_groups":
        x, xs = quantize_rows(x.float(), torch.float8_e4m3fn, 448.0, 128)
    xs = None if xs is None else xs.to(DEVICE)
    weights = _weights(scheme)
    backend = TritonBackend(sch, accumulator=acc)
    prepared = backend.prepare_weights(weights)
    exact = to_contiguous(x.to(DEVICE), xs, ids.to(DEVICE), E, align)
    spare = _to_contiguous_kernels(x.to(DEVICE), xs, ids.to(DEVICE), E, align, None, expected_m=hint)
    m = exact.x.shape[0]
    assert spare.x.shape[0] > m
    if spare.x.dtype == torch.float8_e4m3fn:
        spare.x[m:] = torch.tensor(448.0).to(torch.float8_e4m3fn)
    else:
        spare.x[m:] = float("nan") if spare.x.is_floating_point() else -128
    if spare.x_scale is not None:
        spare.x_scale[m:] = float("nan")
    want = backend.run_contiguous(exact, prepared, torch.float32)
    got = backend.run_contiguous(spare, prepared, torch.float32)
    assert got.shape == (spare.x.shape[0], H)
    used = (exact.m_indices >= 0).cpu()
    assert torch.equal(got[:m].cpu()[used], want.cpu()[used])


@pytest.mark.parametrize("scheme,acc", SCHEME_ACC)
@pytest.mark.parametrize("routing", ["uneven", "one_expert"])
@pytest.mark.parametrize("hint", [None, 1, 0, np.int64(2)], ids=["own_hint", "hint_1", "hint_0", "hint_np"])
def test_masked_matches_torch_backend(scheme, acc, routing, hint):
    """``hint_1``: kernels sized for one row per expert loop over the rest; a hint of 0 or a
    NumPy integer is taken as a hint (at least 1), as the masked GEMMs always did."""
    ids = ROUTINGS[routing]
    x = _x(ids.shape[0])
    batch, _ = to_masked(x.to(DEVICE), None, ids.to(DEVICE), E, capacity=24)
    if hint is not None:
        batch = dataclasses.replace(batch, expected_m=hint)
    weights = _weights(scheme)
    backend = TritonBackend(get_scheme(scheme), accumulator=acc)
    out = backend.run_masked(batch, backend.prepare_weights(weights), torch.float16)
    ref = TorchBackend(get_scheme(scheme)).run_masked(batch, weights, torch.float32)
    assert out.shape == (E, 24, H) and out.dtype == torch.float16
    for e, n in enumerate(batch.masked_m.tolist()):
        got = out[e, :n].cpu()
        assert torch.isfinite(got).all()
        # fp16 intermediate and output: rounding of GEMM1's output moves a few codes.
        assert _rel_err(got, ref[e, :n].cpu()) < 1e-2


@pytest.mark.parametrize("scheme", ["int8_channel", "int8_block", "bf16"])
@pytest.mark.parametrize("fmt", ["native", "fp8_groups", "int8_token"])
def test_quantized_inputs(scheme, fmt):
    """Inputs already in the scheme's format pass through; other formats are requantized."""
    ids = ROUTINGS["uneven"]
    x = _x(ids.shape[0]).float()
    sch = get_scheme(scheme)
    if fmt == "native":
        if not sch.quantized:
            pytest.skip("bf16 has no quantized native format")
        group = None if sch.act_granularity == "token" else 128
        xq, xs = quantize_rows(x, torch.int8, 127.0, group)
    elif fmt == "fp8_groups":
        xq, xs = quantize_rows(x, torch.float8_e4m3fn, 448.0, 128)
    else:
        xq, xs = quantize_rows(x, torch.int8, 127.0)
    batch = to_contiguous(xq.to(DEVICE), xs.to(DEVICE), ids.to(DEVICE), E)
    weights = _weights(scheme)
    backend = TritonBackend(sch)
    out = backend.run_contiguous(batch, backend.prepare_weights(weights), torch.float32).cpu()
    ref = TorchBackend(sch).run_contiguous(batch, weights, torch.float32).cpu()
    # Requantization flips a code where exp() or the dequantized FP8 value differs from torch's
    # by an ulp at a rounding boundary; each flip moves one element by amax/127: a few in 1e-3.
    assert _rel_err(out, ref) < 5e-3


def test_available_and_supports(monkeypatch):
    ok, reason = TritonBackend.available(DEVICE)
    assert ok, reason
    if DEVICE.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        ok, reason = TritonBackend.available(torch.device("cpu"))
        assert not ok and "TRITON_INTERPRET=1" in reason
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    ok, reason = TritonBackend.supports(get_scheme("int8_block"), "masked", DEVICE, 200, 128)
    assert not ok and "multiples of 128" in reason
    ok, reason = TritonBackend.supports(get_scheme("fp8_block"), "contiguous", DEVICE, 256, 128)
    assert not ok and "fp8_block" in reason
    assert TritonBackend.supports(get_scheme("int8_channel"), "masked", DEVICE, 200, 72)[0]
    assert TritonBackend(get_scheme("int8_block")).alignment == 1


def test_weight_errors():
    backend = TritonBackend(get_scheme("int8_channel"))
    w = _weights("int8_block")
    with pytest.raises(ValueError, match="quant="):
        backend.prepare_weights(w)
    bad = ExpertWeights(get_scheme("int8_channel"), w.w13, w.w2, None, None)
    with pytest.raises(ValueError, match="w13_scale"):
        backend.prepare_weights(bad)
    with pytest.raises(ValueError, match="accumulator"):
        TritonBackend(get_scheme("int8_block"), accumulator="int32")


@pytest.mark.parametrize("scheme,acc", SCHEME_ACC)
@pytest.mark.parametrize("hint", [None, 6], ids=["host_sized", "device_sized"])
def test_padding_rows_never_reach_the_output(scheme, acc, hint):
    """The scatter leaves padding rows unwritten (no memset): whatever they hold, NaN included,
    must stay in the padding's own output rows. The same batch with NaN and with zeros in its
    padding (and its spare rows) gives bit-identical combined outputs, by the torch gather and
    the Triton one, while the backend's padding output rows do turn non-finite (the poison
    went through the experts pass)."""
    from epmoe.kernels import permute
    from epmoe.layouts import gather_weighted

    ids = ROUTINGS["uneven"]
    x = _x(ids.shape[0])
    w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5))
    backend = TritonBackend(get_scheme(scheme), accumulator=acc)
    prepared = backend.prepare_weights(_weights(scheme))
    batch = _to_contiguous_kernels(x.to(DEVICE), None, ids.to(DEVICE), E, 8, None, expected_m=hint)
    pad = batch.m_indices < 0
    assert pad[: int(batch.expert_offsets[-1])].any()  # padding inside the segments, not only spare rows
    outs = []
    for fill in (0.0, float("nan")):
        x_rows = batch.x.clone()
        x_rows[pad] = fill
        outs.append(backend.run_contiguous(dataclasses.replace(batch, x=x_rows), prepared, torch.float32))
    used = int(batch.expert_offsets[-1])
    assert not torch.isfinite(outs[1][:used][pad[:used]]).any()
    for gather in (gather_weighted, permute.gather_weighted):
        clean, poisoned = (gather(o, batch.slot_pos, w.to(DEVICE), torch.float32).cpu() for o in outs)
        assert torch.isfinite(poisoned).all() and torch.equal(poisoned, clean)
