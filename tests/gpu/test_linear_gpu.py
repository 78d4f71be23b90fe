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

from benchmarks.bench_dense_int8 import ref_codes  # noqa: E402  (plain torch; the repository root is on sys.path)

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


# ------------------------------------------------------------------ the small-batch kernel
def _ref_weight(w: torch.Tensor, ws: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme == "int8_channel":
        return w.double() * ws.double()
    full = ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w.double() * full[: w.shape[0], : w.shape[1]]


SMALL_CASES = [("int8_channel", "int32", 1000), ("int8_channel", "fp32", 1000), ("int8_block", "fp32", 1024)]


UNVERIFIED_ROWS = pytest.mark.xfail(
    reason="on the H200 (2026-12-02) 16 to 64 rows exceeded this bound because ref_codes formed its "
    "scales as amax * fp32(1/127) on CUDA (torch's division by a Python number), an ulp off the "
    "kernels' scale for ~4% of rows/groups, moving near-tie codes; ref_codes is fixed and "
    "test_ref_codes_are_the_quantizers_codes checks it: drop this mark (and raise SMALL_M_MAX) once "
    "these rows pass on the GPU", strict=False)
SMALL_ROWS = [1, 7, 8, *(pytest.param(m, marks=UNVERIFIED_ROWS) for m in (16, 33, 64))]


def test_ref_codes_are_the_quantizers_codes():
    """The premise of the per-element test below: on CUDA, ``ref_codes`` forms the scales and codes
    of the quantizer kernels bit for bit. Row i's amax (every 1x128 group's too) is the i-th bf16
    value in [2, 4); six of them (2.234375, 2.25, 2.734375, 3.234375, 3.25, 3.734375) get a scale an
    ulp off when divided by a Python 127.0, which CUDA turns into a multiplication by fp32(1/127)."""
    from epmoe.kernels.quantize import per_group_quant, per_token_quant_int8

    g = torch.Generator(device=DEV).manual_seed(0)
    amax = (2.0 + torch.arange(128, device=DEV) / 64.0).to(torch.bfloat16)
    x = (torch.rand(128, 1024, device=DEV, generator=g) * 2 - 1).to(torch.bfloat16) * amax[:, None]
    x[:, ::128] = amax[:, None]
    q, s = per_token_quant_int8(x)
    assert torch.equal(ref_codes(x, None), q.double() * s.double())
    q, s = per_group_quant(x, 128, torch.int8)
    deq = (q.double().reshape(128, 8, 128) * s.double().unsqueeze(-1)).reshape(128, 1024)
    assert torch.equal(ref_codes(x, 128), deq)


@pytest.mark.parametrize("scheme,acc,k", SMALL_CASES, ids=["channel-int32", "channel-fp32", "block"])
@pytest.mark.parametrize("m", SMALL_ROWS)
@pytest.mark.parametrize("fused", [None, True, False], ids=["default", "fused", "unfused"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_small_batch_kernel_every_element(scheme, acc, k, m, fused, dtype):
    """Every output element within one output rounding (2^-8 relative) plus the fp32 epilogue /
    accumulation error (2^-17 of the sum of |terms|) of the float64 product of the dequantized
    operands; the activation codes come from the rule in plain torch (``ref_codes``), not the
    kernel."""
    from epmoe.kernels.dense_int8 import dense_int8_small_m, small_m_config

    n = 584  # not a multiple of any N tile: masked stores; K=1000 (channel): masked K steps
    g = torch.Generator(device=DEV).manual_seed(m)
    w = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8, generator=g)
    shape = (n, 1) if scheme == "int8_channel" else (-(-n // 128), k // 128)
    ws = torch.rand(shape, device=DEV, generator=g) * 1e-3 + 1e-4
    bias = torch.randn(n, device=DEV, generator=g) if m % 2 else None
    x = (torch.randn(m, k, device=DEV, generator=g) * 2).to(dtype)
    x[0, 5] = 40.0  # an outlier sets row 0's scale
    cfg = None
    if fused is not None:
        cfg = small_m_config(m, n, k, scheme, torch.cuda.get_device_properties(DEV).multi_processor_count, fused)
    out = dense_int8_small_m(x, w, ws, bias, scheme=scheme, accumulator=acc, config=cfg)
    assert out.dtype == dtype and out.shape == (m, n)
    xd = ref_codes(x, None if scheme == "int8_channel" else 128)
    wd = _ref_weight(w, ws, scheme)
    ref = xd @ wd.t()
    mag = xd.abs() @ wd.abs().t()
    if bias is not None:
        ref, mag = ref + bias.double(), mag + bias.double().abs()
    err = (out.double() - ref).abs()
    bound = 2.0**-8 * ref.abs() + 2.0**-17 * mag
    assert bool((err <= bound).all()), f"worst excess {float((err - bound).max()):.3g}"


@pytest.mark.parametrize("backend,scheme,acc", CASES, ids=["-".join(c) for c in CASES])
def test_small_batch_forward_is_graph_capturable(backend, scheme, acc, monkeypatch):
    """The decode path (16 rows) replays in a CUDA graph and equals its eager result."""
    mod, _ = _module(backend, scheme, acc, 1024, 576, True, monkeypatch)
    x = torch.randn(16, 1024, device=DEV, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = mod(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mod(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = mod(x)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, eager, rtol=0, atol=0)
