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
from epmoe.quant.reference import dequantize_rows  # noqa: E402
from test_linear import ref_linear, ref_mlp, ref_weight, rel  # noqa: E402  (tests/ is on sys.path: conftest)

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
@pytest.mark.parametrize("m", [1, 7, 33, 64, 128, 1000, 4097])
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
    with torch.random.fork_rng(devices=[DEV]):  # the same layers and rows whichever tests ran before
        torch.manual_seed(m)
        lins = [torch.nn.Linear(a, b, bias=False, device=DEV) for a, b in ((h, i), (h, i), (i, h))]
        x = torch.randn(m, h, device=DEV, dtype=torch.bfloat16)
    try:
        mlp = Int8MLP.from_float(*lins, scheme=scheme, accumulator=acc, backend=backend)
    except BackendUnavailableError as exc:
        pytest.skip(str(exc))
    down = mlp.down_proj
    with torch.no_grad():
        y = mlp(x)
        gate_up = mlp.gate_up_proj(x)
        q, s = down._impl.silu_quantize(gate_up, scheme)
    assert y.dtype == torch.bfloat16 and y.shape == (m, h)
    # Each stage within bf16 output rounding of float64: GEMM1, and the down projection of the
    # forward's own intermediate codes (the forward is exactly these stages).
    assert rel(gate_up, ref_linear(mlp.gate_up_proj, x)) <= TIGHT
    codes = dequantize_rows(q.cpu(), s.cpu(), torch.float64)
    assert rel(y, codes @ ref_weight(down).t()) <= TIGHT
    # End to end against float64 throughout: the reference quantizes with float64 scales where the
    # kernels follow the rule's fp32 ones, and bf16 inputs often sit exactly on a rounding tie, so
    # a few activation codes differ by one, GEMM1's outputs with them, and the intermediate's
    # requantization moves more codes -- ~1e-2 of the output at one row in rare draws (1.15e-2
    # seen on an H200 with unseeded layers); a wrong activation or scale is O(1).
    assert rel(y, ref_mlp(mlp, x)) <= 2e-2


# ------------------------------------------------------------------ the small-batch kernel
def _ref_weight(w: torch.Tensor, ws: torch.Tensor, scheme: str) -> torch.Tensor:
    if scheme == "int8_channel":
        return w.double() * ws.double()
    full = ws.double().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w.double() * full[: w.shape[0], : w.shape[1]]


SMALL_CASES = [("int8_channel", "int32", 1000), ("int8_channel", "fp32", 1000), ("int8_block", "fp32", 1024)]


# On the H200 (2026-12-02) only these failed this test: the channel scheme's fused quantization
# forced onto 64-row tiles (33 and 64 rows, bf16 inputs; fp16, the default and unfused launches,
# and the block scheme passed). Likely cause, from the sm_90 PTX: with K = 1000 the weight tile
# is written to shared memory by plain stores, and in the fused 64-row (wgmma) kernel Triton 3.6
# emits the shared-memory proxy fence after the barrier instead of before it, so the wgmma may
# read another warp's stores stale (the unfused kernel has fence, then barrier; 16/32-row tiles
# use mma.sync, which needs no fence; K = 1024 goes through cp.async). The default rule and the
# sweep never fuse the channel scheme on tiles of more than 32 rows;
# test_fused_equals_unfused_bit_for_bit below checks the fence hypothesis (K = 1000 vs 1024).
FUSED_TALL = pytest.mark.xfail(
    reason="channel fused on 64-row tiles: outputs beyond the bound on the H200 (bf16, 33/64 rows); "
    "never chosen by the rule or the sweep", strict=False)
SMALL_ROWS = [1, 7, 8, 16, 33, 64]
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


def _small_inputs(m, n, k, scheme, dtype):
    g = torch.Generator(device=DEV).manual_seed(m)
    w = torch.randint(-127, 128, (n, k), device=DEV, dtype=torch.int8, generator=g)
    shape = (n, 1) if scheme == "int8_channel" else (-(-n // 128), k // 128)
    ws = torch.rand(shape, device=DEV, generator=g) * 1e-3 + 1e-4
    bias = torch.randn(n, device=DEV, generator=g) if m % 2 else None
    x = (torch.randn(m, k, device=DEV, generator=g) * 2).to(dtype)
    x[0, 5] = 40.0  # an outlier sets row 0's scale
    return x, w, ws, bias


def _sms():
    return torch.cuda.get_device_properties(DEV).multi_processor_count


LAUNCHES = ["default", "fused", "unfused", "split", "split-fused", "tall"]


@pytest.mark.parametrize("scheme,acc,k", SMALL_CASES, ids=["channel-int32", "channel-fp32", "block"])
@pytest.mark.parametrize("m", SMALL_ROWS)
@pytest.mark.parametrize("launch", LAUNCHES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_small_batch_kernel_every_element(scheme, acc, k, m, launch, dtype, request):
    """Every output element within one output rounding (2^-8 relative) plus the fp32 epilogue /
    accumulation error (2^-17 of the sum of |terms|) of the float64 product of the dequantized
    operands; the activation codes come from the rule in plain torch (``ref_codes``), not the
    kernel. Launches: the rule's, forced fused / unfused, K split in three (the last share short)
    unfused and fused, and unfused 128-row tiles split in two (the sweep's large-batch kind)."""
    from epmoe.kernels.dense_int8 import dense_int8_small_m, small_m_config

    n = 584  # not a multiple of any N tile: masked stores; K=1000 (channel): masked K steps
    x, w, ws, bias = _small_inputs(m, n, k, scheme, dtype)
    fused = {"fused": True, "unfused": False, "split": False, "split-fused": True, "tall": False}.get(launch)
    kw = {"split": {"split_k": 3}, "split-fused": {"split_k": 3}, "tall": {"block_m": 128, "split_k": 2}}.get(launch, {})
    cfg = None if launch == "default" else small_m_config(m, n, k, scheme, _sms(), fused, **kw)
    if cfg is not None and cfg.fused and scheme == "int8_channel" and cfg.block_m > 32:
        request.applymarker(FUSED_TALL)
    out = dense_int8_small_m(x, w, ws, bias, scheme=scheme, accumulator=acc, config=cfg)
    _check_every_element(out, x, w, ws, bias, scheme)


@pytest.mark.parametrize("scheme,acc,k", SMALL_CASES, ids=["channel-int32", "channel-fp32", "block"])
@pytest.mark.parametrize("m", [300, 1000])
@pytest.mark.parametrize("tile", [(64, 1), (128, 3)], ids=["64-rows", "128-rows-groups-of-3"])
def test_large_batch_launch_every_element(scheme, acc, k, m, tile):
    """The launches the sweep times at larger batches (unfused 64/128-row tiles, K split in two,
    row tiles in groups, the last group short), every element as above (bf16)."""
    from epmoe.kernels.dense_int8 import dense_int8_small_m, small_m_config

    n = 584
    x, w, ws, bias = _small_inputs(m, n, k, scheme, torch.bfloat16)
    cfg = small_m_config(m, n, k, scheme, _sms(), False, block_m=tile[0], split_k=2, group_m=tile[1])
    out = dense_int8_small_m(x, w, ws, bias, scheme=scheme, accumulator=acc, config=cfg)
    _check_every_element(out, x, w, ws, bias, scheme)


def _check_every_element(out, x, w, ws, bias, scheme):
    assert out.dtype == x.dtype and out.shape == (x.shape[0], w.shape[0])
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


@pytest.mark.parametrize("k", [1000, 1024], ids=["k1000", "k1024"])
@pytest.mark.parametrize("m", [16, 33, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_equals_unfused_bit_for_bit(m, dtype, k):
    """Diagnostic of the FUSED_TALL failures: the fused channel quantization forms the quantizer
    kernel's codes, so fused and unfused launches of one tile shape must agree bit for bit (they
    do under the interpreter). Fails with where they differ: how many elements and rows, and the
    largest difference in units of the unfused output's row maximum. K = 1000 (rows not 16-byte
    aligned: the weight tile reaches shared memory by plain stores, and Triton 3.6 puts the
    proxy fence of the fused 64-row kernel after the barrier, not before it as in the unfused
    kernel) against K = 1024 (cp.async, no such fence)."""
    from epmoe.kernels.dense_int8 import dense_int8_small_m, small_m_config

    n = 584
    x, w, ws, _ = _small_inputs(m, n, k, "int8_channel", dtype)
    outs = {}
    for fused in (True, False):
        cfg = small_m_config(m, n, k, "int8_channel", _sms(), fused, block_m=64)
        outs[fused] = dense_int8_small_m(x, w, ws, scheme="int8_channel", accumulator="int32", config=cfg,
                                         out_dtype=torch.float32)  # fmt: skip
    diff = (outs[True] - outs[False]).abs()
    bad = diff > 0
    rows = sorted({int(r) for r in bad.nonzero()[:, 0].tolist()})
    scale = outs[False].abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert not bool(bad.any()), (
        f"{int(bad.sum())} elements differ in rows {rows[:20]} (of {m}); max diff "
        f"{float((diff / scale).max()):.3g} of the row max; fused config {cfg._replace(fused=True)}")


# ------------------------------------------------------------------ the large-batch kernels of the plan
def _cutlass_walks():
    from epmoe.kernels.configs import CUTLASS_DENSE_KERNELS
    from epmoe.kernels.dense_configs import SWIZZLES, CutlassLaunch

    return [CutlassLaunch(along_n, s, kernel) for kernel in CUTLASS_DENSE_KERNELS for along_n in (True, False)
            for s in SWIZZLES]  # fmt: skip


def test_cutlass_walks_agree_bit_for_bit(monkeypatch):
    """Every walk of the CUTLASS INT8 kernels the sweep times (cooperative and pingpong, along N /
    M, swizzle 1-8), through the grouped op (cooperative only) and the dense op the layer calls,
    gives the grouped default walk's output bit for bit (a tile's sums do not depend on when it
    runs, on the block table or on the tile's shape), and that output is within one bf16 rounding
    plus the fp32 epilogue's error of the float64 product per element. 1000 rows (8 row blocks,
    the last short) x 2176 outputs (8.5 N tiles of 256, 17 of 128)."""
    mod, _ = _module("cutlass", "int8_channel", "int32", 1024, 2176, False, monkeypatch)
    if mod._impl.impl != "epmoe":
        pytest.skip("sgl-kernel's int8_scaled_mm runs; the walks are the project's kernel's")
    from epmoe.experts.cutlass_backend import int8_dense_gemm, int8_grouped_gemm

    m, n, k = 1000, 2176, 1024
    x, w, ws, _ = _small_inputs(m, n, k, "int8_channel", torch.bfloat16)
    q, s = mod._impl.quantize(x, "int8_channel")
    offsets = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=DEV)
    first = int8_grouped_gemm(q, s, w[None], ws[None], offsets)[:m]
    _check_every_element(first, x, w, ws, None, "int8_channel")
    for walk in _cutlass_walks():
        kw = dict(raster_along_n=walk.raster_along_n, max_swizzle=walk.max_swizzle)
        if walk.kernel == "cooperative":  # the grouped op's only kernel
            assert torch.equal(int8_grouped_gemm(q, s, w[None], ws[None], offsets, **kw)[:m], first), walk
        # The dense op (no offsets, no block table): the same sums over the same rows.
        assert torch.equal(int8_dense_gemm(q, s, w, ws, **walk._asdict())[:m], first), walk


def _needs_project_cutlass():
    """Skips unless the project's CUTLASS kernels build here (its headers and an SM90 GPU)."""
    from epmoe.experts.cutlass_backend import find_cutlass_include

    if torch.cuda.get_device_capability(DEV)[0] != 9 or find_cutlass_include() is None:
        pytest.skip("needs CUTLASS headers (nvidia-cutlass / EPMOE_CUTLASS_DIR) on an SM90 GPU")


@pytest.mark.parametrize("n,k", [(576, 1536), (2056, 2048), (7168, 512)], ids=["q_b-K", "N-odd", "short-K"])
@pytest.mark.parametrize("m", [128, 256, 384, 1024, 3200])
def test_dense_kernels_every_element_and_identical(m, n, k):
    """The dense op's two kernels (cooperative, 128 x 256 tiles; pingpong, 128 x 128) on fresh random
    int8 operands and scales, with three walks each: every element within one bf16 rounding of the
    float64 product of the same operands (the int32 K sum is exact; two fp32 products and the bf16
    rounding remain), and every output identical bit for bit to the first. Identical because each
    output element is the same exact int32 sum through the same epilogue arithmetic (times the
    channel scale, then the row scale, in fp32; one bf16 rounding) whichever tile holds it and
    whichever warpgroup stores it: a differing bit is a tile computed wrong, skipped or stored
    twice, not rounding. N = 2056 and 576 are multiples of neither tile width (576: 2.25 tiles of
    256, 4.5 of 128); M from one row block to 25. With 3 or 25 row blocks a swizzle rounds the
    scheduler's M blocks up past the rows: tiles it skips, over which the pingpong kernel's
    producer and its two consumers must still walk the same tiles (else a consumer waits for a
    tile the producer never loads)."""
    _needs_project_cutlass()
    from epmoe.experts.cutlass_backend import int8_dense_gemm
    from epmoe.kernels.configs import CUTLASS_DENSE_KERNELS

    g = torch.Generator(device=DEV).manual_seed(m * 7 + n + k)
    a = torch.randint(-127, 128, (m, k), dtype=torch.int8, device=DEV, generator=g)
    b = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=DEV, generator=g)
    sa = torch.rand(m, 1, device=DEV, generator=g) + 0.5
    sb = (torch.rand(n, 1, device=DEV, generator=g) + 0.5) / (127.0 * 127.0 * k**0.5)
    ref = (a.double() @ b.double().t()) * sa.double() * sb.double().t()
    first = None
    for kernel in CUTLASS_DENSE_KERNELS:
        for along_n, swizzle in ((True, 1), (False, 4), (True, 2)):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            int8_dense_gemm(a, sa, b, sb, out, raster_along_n=along_n, max_swizzle=swizzle, kernel=kernel)
            what = (kernel, along_n, swizzle)
            err = (out.double() - ref).abs()  # NaN (an element never written) fails the bound
            excess = (err - ref.abs() * 2.0**-8 * (1 + 1e-5)).nan_to_num(float("inf"))
            assert bool((excess <= 0).all()), (what, float(excess.max()))
            first = out if first is None else first
            assert torch.equal(out, first), what


@pytest.mark.parametrize("m", [300, 1000])
def test_every_planned_kernel_of_the_cutlass_backend(m, monkeypatch):
    """What the plan may send a cutlass-backend call to (run_kernel, the forward's own path): the
    CUTLASS kernel along M with a swizzle, the Triton tiled GEMM (its own config and a persistent
    TMA tile the sweep times) on the CUTLASS quantizer's padded rows, the small-batch kernel on 128-row tiles; each against float64 (bias included), and the
    forward and the MLP following a plan that says CUTLASS along M."""
    from epmoe.kernels import dense_configs as dc
    from epmoe.kernels.dense_int8 import small_m_config
    from epmoe.linear import _dense_kernels, run_kernel

    mod, lin = _module("cutlass", "int8_channel", "int32", 1024, 576, True, monkeypatch)
    own = mod._impl.impl == "epmoe"
    x = torch.randn(m, 1024, device=DEV, dtype=torch.bfloat16)
    from epmoe.kernels.configs import GemmConfig

    plans = [("triton", None), ("triton", GemmConfig(128, 64, 128, 8, False, 4, 4, True, True)),
             ("small_m", small_m_config(m, 576, 1024, "int8_channel", _sms(), False, block_m=128))]
    if own:
        plans += [("cutlass", dc.CutlassLaunch(False, 4)), ("cutlass", dc.CutlassLaunch(True, 2))]
    with torch.no_grad():
        for kernel, launch in plans:
            y = run_kernel(mod._impl, mod, x, kernel, launch)[:m]
            assert y.dtype == torch.bfloat16 and y.shape == (m, 576)
            assert rel(y, ref_linear(mod, x)) <= TIGHT, (kernel, launch)
        if not own:
            return
        along_m = ("cutlass", dc.CutlassLaunch(False, 8))
        monkeypatch.setattr(_dense_kernels(), "dense_plan", lambda *a: along_m)
        assert mod.plan(m) == along_m
        assert rel(mod(x), ref_linear(mod, x)) <= TIGHT
        lins = [torch.nn.Linear(a, b, bias=False, device=DEV) for a, b in ((1024, 256), (1024, 256), (256, 1024))]
        mlp = Int8MLP.from_float(*lins, backend="cutlass")
        assert rel(mlp(x), ref_mlp(mlp, x)) <= 1e-2


# ------------------------------------------------------------------ programmatic dependent launch
@pytest.mark.parametrize("m,n,k,kw", [(1, 576, 7168, {}), (16, 576, 7168, dict(fused=False)),
                                      (64, 1536, 7168, dict(fused=False, split_k=1))],
                         ids=["fused-split", "unfused-split", "unfused"])  # fmt: skip
def test_pdl_launch_bit_for_bit_and_ordered(m, n, k, kw):
    """A launch with ``pdl=True`` gives the plain launch's output bit for bit, eagerly and in a
    CUDA graph right after the kernel that writes its input (fresh inputs each replay: a read
    before that kernel finished would see the previous replay's rows), and every element is
    within the float64 bound."""
    from epmoe.kernels.dense_int8 import dense_int8_small_m, small_m_config
    from epmoe.kernels.pdl import pdl_enabled

    if not pdl_enabled(DEV):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+ and EPMOE_PDL not 0")
    x, w, ws, bias = _small_inputs(m, n, k, "int8_channel", torch.bfloat16)
    cfg = small_m_config(m, n, k, "int8_channel", _sms(), **kw)
    pdl = cfg._replace(pdl=True)

    def run(inp, launch):
        return dense_int8_small_m(inp, w, ws, bias, scheme="int8_channel", accumulator="int32", config=launch)

    plain = run(x, cfg)
    _check_every_element(plain, x, w, ws, bias, "int8_channel")
    assert torch.equal(run(x, pdl), plain)
    src, xin = x.clone(), torch.empty_like(x)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.mul(src, 2.0, out=xin)
        run(xin, pdl)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 2.0, out=xin)  # the kernel right before the dependent launch writes its input
        out = run(xin, pdl)
    g = torch.Generator(device=DEV).manual_seed(1)
    for _ in range(5):
        src.copy_(torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run(src * 2.0, cfg))


PREFETCH_CASES = [("int8_channel", "int32", 1, dict(fused=True)), ("int8_channel", "int32", 16, dict(fused=False)),
                  ("int8_channel", "int32", 64, dict(fused=False, split_k=1)),
                  ("int8_block", "fp32", 16, dict(fused=False, split_k=1)), ("int8_block", "fp32", 33, {})]


@pytest.mark.parametrize("scheme,acc,m,kw", PREFETCH_CASES,
                         ids=["fused-split", "unfused-split", "unfused", "block-unfused", "block-default"])
@pytest.mark.parametrize("prefetch", ["choices", "whole", "unaligned"])
def test_pdl_prefetch_bit_for_bit_and_ordered(scheme, acc, m, kw, prefetch):
    """Dependent launches that prefetch their weight into L2 before they wait (each bound of
    ``PREFETCH_CHOICES``; ``whole``: more than any program's slice; ``unaligned``: weight rows
    not 16-byte aligned, where the prefetch is skipped) give the plain launch's output bit for
    bit, every element within the float64 bound. And in a CUDA graph of two chained layers (the
    second's quantizer reads the first's output, fresh inputs each replay), every kernel a
    dependent launch: a quantizer that ran before the GEMM it follows had finished, or a GEMM
    before its quantizer, would read the previous replay's rows."""
    from epmoe.kernels.dense_int8 import PREFETCH_CHOICES, dense_int8_small_m, small_m_config
    from epmoe.kernels.pdl import pdl_enabled

    if not pdl_enabled(DEV):
        pytest.skip("programmatic dependent launch needs compute capability 9.0+ and EPMOE_PDL not 0")
    n1, k = 1536, 7168
    x, w1, ws1, bias = _small_inputs(m, n1, k, scheme, torch.bfloat16)
    if prefetch == "unaligned":  # rows 7176 bytes apart: not a multiple of 16
        w1 = torch.empty(n1, k + 8, device=DEV, dtype=torch.int8)[:, :k].copy_(w1)
    _, w2, ws2, _ = _small_inputs(m + 1, 576, n1, scheme, torch.bfloat16)
    bounds = {"choices": PREFETCH_CHOICES, "whole": (1 << 22,), "unaligned": PREFETCH_CHOICES[:1]}[prefetch]

    def run(inp, w, ws, b, launch):
        return dense_int8_small_m(inp, w, ws, b, scheme=scheme, accumulator=acc, config=launch)

    cfg1 = small_m_config(m, n1, k, scheme, _sms(), **kw)
    cfg2 = small_m_config(m, 576, n1, scheme, _sms(), **kw)
    plain = run(x, w1, ws1, bias, cfg1)
    _check_every_element(plain, x, w1, ws1, bias, scheme)
    for b in bounds:
        l1, l2 = (c._replace(pdl=True, prefetch=b) for c in (cfg1, cfg2))
        assert torch.equal(run(x, w1, ws1, bias, l1), plain), b

        def chain(inp):
            return run(run(inp, w1, ws1, bias, l1), w2, ws2, None, l2)

        src, xin = x.clone(), torch.empty_like(x)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.mul(src, 2.0, out=xin)
            chain(xin)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            torch.mul(src, 2.0, out=xin)
            out = chain(xin)
        g = torch.Generator(device=DEV).manual_seed(b)
        for _ in range(5):
            src.copy_(torch.randn(m, k, device=DEV, generator=g).to(torch.bfloat16))
            graph.replay()
            torch.cuda.synchronize()
            mid = run(src * 2.0, w1, ws1, bias, cfg1)
            want = run(mid, w2, ws2, None, cfg2)
            assert torch.equal(out, want), b
        _check_every_element(want, mid, w2, ws2, None, scheme)
