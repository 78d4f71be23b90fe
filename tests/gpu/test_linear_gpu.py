"""Int8Linear / Int8MLP compiled on the GPU (triton; cutlass with SGLANG_CUTLASS_MOE=1 where it
can run) against float64 references that quantize the activations on their own."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from epmoe.experts.select import BackendUnavailableError  # noqa: E402
from epmoe.linear import Int8Linear, Int8MLP  # noqa: E402
from test_linear import ref_linear, ref_mlp, rel  # noqa: E402  (tests/ is on sys.path: conftest)

DEV = torch.device("cuda")
CASES = [("triton", "int8_channel", "int32"), ("triton", "int8_channel", "fp32"),
         ("triton", "int8_block", "fp32"), ("cutlass", "int8_channel", "int32")]  # fmt: skip
# bf16 output rounding (2^-9 relative per element) and rare activation codes on the other side of
# a rounding boundary; the quantization itself is ~1e-2.
TIGHT = 4e-3


def _module(backend, scheme, acc, k, n, bias, monkeypatch):
    if backend == "cutlass":
        monkeypatch.setenv("SGLANG_CUTLASS_MOE", "1")
    lin = torch.nn.Linear(k, n, bias=bias, device=DEV)
    try:
        return Int8Linear.from_float(lin, scheme=scheme, accumulator=acc, backend=backend), lin
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize("backend,scheme,acc", CASES, ids=["-".join(c) for c in CASES])
@pytest.mark.parametrize("m", [1, 7, 128, 1000, 4097])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_linear_against_float64(backend, scheme, acc, m, bias, monkeypatch):
    mod, lin = _module(backend, scheme, acc, 1024, 576, bias, monkeypatch)
    assert mod.backend_name == backend
    g = torch.Generator(device=DEV).manual_seed(m)
    for dtype in (torch.bfloat16, torch.float16):
        x = torch.randn(m, 1024, device=DEV, generator=g).to(dtype)
        with torch.no_grad():
            y = mod(x)
        assert y.dtype == dtype and y.shape == (m, 576)
        assert rel(y, ref_linear(mod, x)) <= TIGHT
        assert rel(y, x.double() @ lin.weight.double().t() + (0 if lin.bias is None else lin.bias.double())) <= 3e-2


@pytest.mark.parametrize("backend,scheme,acc", CASES, ids=["-".join(c) for c in CASES])
@pytest.mark.parametrize("m", [1, 300])
def test_mlp_against_float64(backend, scheme, acc, m, monkeypatch):
    if backend == "cutlass":
        monkeypatch.setenv("SGLANG_CUTLASS_MOE", "1")
    h, i = 1024, 256
    lins = [torch.nn.Linear(a, b, bias=False, device=DEV) for a, b in ((h, i), (h, i), (i, h))]
    try:
        mlp = Int8MLP.from_float(*lins, scheme=scheme, accumulator=acc, backend=backend)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        y = mlp(x)
    assert y.dtype == torch.bfloat16 and y.shape == (m, h)
    assert rel(y, ref_mlp(mlp, x)) <= 1e-2
