"""The dense INT8 plan (epmoe.kernels.dense_configs): measured tables as the sweep writes them,
bucket choice, the default rule, and the refusals of a malformed table."""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.kernels import dense_configs as dc
from epmoe.kernels.dense_int8 import SmallMConfig, small_m_config

CFG = SmallMConfig(16, 16, 512, 4, 5, True, 8)
ALONG_M = dc.CutlassLaunch(False, 4)
TABLE = {"int8_channel_int32": {"N=576,K=7168": {
    "1": {"kernel": "small_m", "config": CFG.to_dict()},  # one entry (tables before the kernels were told apart)
    "64": [{"kernel": "small_m", "config": CFG._replace(block_m=64, fused=False).to_dict(), "us": 9.0}],
    "1024": [{"kernel": "cutlass", "config": ALONG_M.to_dict(), "us": 40.0}, {"kernel": "triton", "us": 50.0},
             {"kernel": "small_m", "config": CFG._replace(block_m=64, fused=False).to_dict(), "us": 60.0}],
    "4096": [{"kernel": "small_m", "config": CFG._replace(block_m=128, fused=False).to_dict(), "us": 73.0},
             {"kernel": "cutlass", "config": {"raster_along_n": True, "max_swizzle": 1}, "us": 93.0}],
    "16384": {"kernel": "tiled"},
}}}  # fmt: skip
CUTLASS = dc.KERNELS  # what the cutlass backend runs on the project's kernel


def test_table_round_trip_and_buckets(tmp_path):
    path = dc.table_path("Some GPU", tmp_path)
    assert path.name == "dense_int8_Some_GPU.json"
    dc.write_dense_table(path, TABLE, device="Some GPU", source="test")
    data = json.loads(path.read_text())
    assert data["device"] == "Some GPU" and data["configs"] == TABLE
    bounds, plans = dc.parse_table(data)["int8_channel_int32"]["N=576,K=7168"]
    assert bounds == (1, 64, 1024, 4096, 16384)
    tall = CFG._replace(block_m=64, fused=False)
    assert plans[:3] == ((("small_m", CFG),), (("small_m", tall),),
                         (("cutlass", ALONG_M), ("triton", None), ("small_m", tall)))  # fmt: skip
    assert plans[3][1] == ("cutlass", dc.CutlassLaunch()) and plans[4] == (("tiled", None),)


@pytest.fixture
def some_gpu(tmp_path, monkeypatch):
    """A CUDA device named "Some GPU" (132 SMs) whose table is TABLE plus a partial block-scheme
    shape. (No GPU needed: the device facts are stubbed.)"""
    from epmoe import devices
    from epmoe.kernels import configs

    partial = {"N=24576,K=1536": {"1": {"kernel": "small_m", "config": CFG._replace(fused=False).to_dict()}}}
    dc.write_dense_table(dc.table_path("Some GPU", tmp_path), {**TABLE, "int8_block_fp32": partial})
    monkeypatch.setenv("EPMOE_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(configs, "device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(dc, "device_name", lambda device=None: "Some GPU")
    monkeypatch.setattr(devices, "sm_count", lambda device=None: 132)
    dc.load_dense_table.cache_clear()
    dc.dense_plan.cache_clear()
    yield torch.device("cuda", 0)
    dc.load_dense_table.cache_clear()
    dc.dense_plan.cache_clear()


def test_plan_reads_the_device_table(some_gpu):
    """The smallest bucket >= M; past a shape's largest measured bucket, and for other shapes and
    modes, the default rule (a shape the sweep measured only at one row is not stretched to large
    batches)."""
    dev = some_gpu
    assert dc.dense_plan("int8_channel", "int32", 576, 7168, 1, dev) == ("small_m", CFG)
    assert dc.dense_plan("int8_channel", "int32", 576, 7168, 2, dev)[1].block_m == 64
    assert dc.dense_plan("int8_channel", "int32", 576, 7168, 16384, dev) == ("tiled", None)
    assert dc.dense_plan("int8_channel", "int32", 576, 7168, 99999, dev) == ("tiled", None)
    # No entry: the default rule.
    assert dc.dense_plan("int8_block", "fp32", 576, 7168, 1, dev) == (
        "small_m", small_m_config(1, 576, 7168, "int8_block", 132))
    assert dc.dense_plan("int8_channel", "int32", 1536, 7168, 65, dev) == ("tiled", None)
    assert dc.dense_plan("int8_block", "fp32", 24576, 1536, 1, dev) == ("small_m", CFG._replace(fused=False))
    for m in (2, 4096):
        assert dc.dense_plan("int8_block", "fp32", 24576, 1536, m, dev) == dc.default_plan("int8_block", 24576, 1536, m, 132)


def test_plan_takes_the_fastest_kernel_the_backend_runs(some_gpu):
    """A bucket lists kernels fastest first: the cutlass backend takes CUTLASS with its measured
    walk, the triton backend (no CUTLASS) the next one it runs; a bucket where the small-batch
    kernel was fastest (kv_a-like at 4096 rows) gives it to both."""
    dev = some_gpu
    tall = CFG._replace(block_m=64, fused=False)
    for m in (300, 1024):
        assert dc.dense_plan("int8_channel", "int32", 576, 7168, m, dev, CUTLASS) == ("cutlass", ALONG_M)
        assert dc.dense_plan("int8_channel", "int32", 576, 7168, m, dev) == ("triton", None)
        assert dc.dense_plan("int8_channel", "int32", 576, 7168, m, dev, ("small_m",)) == ("small_m", tall)
    for kernels in (CUTLASS, dc.TRITON_KERNELS):
        assert dc.dense_plan("int8_channel", "int32", 576, 7168, 4096, dev, kernels) == (
            "small_m", CFG._replace(block_m=128, fused=False))
    # Nothing runnable in the bucket: the default rule, not a neighbour's entry.
    assert dc.dense_plan("int8_channel", "int32", 576, 7168, 1024, dev, ("tiled",)) == ("tiled", None)


def test_int8_linear_plan_per_backend(some_gpu, monkeypatch):
    """Int8Linear.plan (what the forward runs) consults the table with its backend's kernels:
    cutlass on the project's kernel, on sgl-kernel (no CUTLASS walk to choose), and triton."""
    from epmoe import linear

    monkeypatch.setattr(torch.Tensor, "device", property(lambda self: some_gpu))
    mod = linear.Int8Linear.__new__(linear.Int8Linear)
    torch.nn.Module.__init__(mod)
    mod.scheme, mod.accumulator, mod.in_features, mod.out_features = "int8_channel", "int32", 7168, 576
    mod.weight = torch.nn.Parameter(torch.zeros(1, dtype=torch.int8), requires_grad=False)
    for impl, want in ((linear._CutlassImpl("epmoe"), ("cutlass", ALONG_M)),
                       (linear._CutlassImpl("sgl"), ("triton", None)), (linear._TritonImpl(), ("triton", None))):  # fmt: skip
        mod._impl = impl
        assert mod.plan(1024) == want
        assert mod.plan(1) == ("small_m", CFG)
    mod._impl = linear._TorchImpl()
    assert mod.plan(1024) == ("tiled", None)
    with pytest.raises(ValueError, match="rows"):
        mod.plan(0)


def test_backends_run_the_plans_kernel_lists():
    """Each GPU backend's kernels are the plan's lists themselves, not copies that could drift."""
    from epmoe import linear

    assert linear._TritonImpl.kernels is linear._CutlassImpl("sgl").kernels is dc.TRITON_KERNELS
    assert linear._CutlassImpl("epmoe").kernels is dc.KERNELS


def test_default_rule():
    assert dc.default_plan("int8_channel", 576, 7168, dc.SMALL_M_MAX, 132)[0] == "small_m"
    assert dc.default_plan("int8_channel", 576, 7168, dc.SMALL_M_MAX + 1, 132) == ("tiled", None)
    kernel, cfg = dc.default_plan("int8_block", 7168, 16384, 4096, 132)
    assert kernel == "small_m" and cfg[:2] == (128, 128) and not cfg.fused and cfg.group_m == 8
    from epmoe.linear import SMALL_M_MAX

    assert SMALL_M_MAX == dc.SMALL_M_MAX


def test_malformed_tables_are_refused(tmp_path):
    with pytest.raises(ValueError, match="'configs' object"):
        dc.parse_table({"device": "x"})
    with pytest.raises(ValueError, match="kernel='cublas'"):
        dc.parse_table({"configs": {"int8_channel_int32": {"N=1,K=1": {"1": {"kernel": "cublas"}}}}})
    bad = {"configs": {"m": {"N=1,K=1": {"1": {"kernel": "small_m", "config": {**CFG.to_dict(), "block_k": 100}}}}}}
    with pytest.raises(ValueError, match="block_k=100"):
        dc.parse_table(bad)
    with pytest.raises(ValueError, match="block_k=100"):
        dc.write_dense_table(tmp_path / "t.json", bad["configs"])
    assert not (tmp_path / "t.json").exists()
    for entry, says in (("small_m", "kernel=None"), ({"kernel": "small_m"}, "KeyError"),
                        ({"kernel": "small_m", "config": {"block_m": "x"}}, "small_m entry has a 'config'")):
        with pytest.raises(ValueError, match=f"int8_channel_int32 N=1,K=1 bucket 1: .*{says}"):
            dc.parse_table({"configs": {"int8_channel_int32": {"N=1,K=1": {"1": entry}}}})
    with pytest.raises(ValueError, match="bucket one: ValueError"):
        dc.parse_table({"configs": {"m": {"N=1,K=1": {"one": {"kernel": "tiled"}}}}})
    with pytest.raises(ValueError, match="bucket 0: a bucket of 0 rows; allowed: a row count >= 1"):
        dc.parse_table({"configs": {"m": {"N=1,K=1": {"0": {"kernel": "tiled"}}}}})
    with pytest.raises(ValueError, match="max_swizzle=3; allowed"):
        dc.parse_table({"configs": {"m": {"N=1,K=1": {"1": [{"kernel": "cutlass", "config": {"max_swizzle": 3}}]}}}})
    with pytest.raises(ValueError, match="unknown keys"):
        dc.parse_table({"configs": {"m": {"N=1,K=1": {"1": [{"kernel": "cutlass", "config": {"raster": 0}}]}}}})
    with pytest.raises(ValueError, match="an empty list"):
        dc.parse_table({"configs": {"m": {"N=1,K=1": {"1": []}}}})


@pytest.mark.parametrize("plan", ["small_m-split", "tiled", "triton"])
def test_int8_linear_follows_the_plan(plan, monkeypatch):
    """Int8Linear (triton under the interpreter) runs what the plan says: a split small-batch
    launch at 128 rows, the tiled GEMM at 7 rows; both against the float64 reference, and the MLP's
    down projection (int8 codes in) takes the same launch unfused."""
    from epmoe import linear
    from test_linear import TIGHT, make, ref_linear, ref_mlp, rel

    calls = []
    ns = linear._dense_kernels()
    real = ns.dense_int8_small_m
    cfg = SmallMConfig(64, 16, 128, 4, 2, True, 2)

    def fake_plan(scheme, accumulator, n, k, m, device, kernels):
        calls.append(m)
        return ("small_m", cfg) if plan == "small_m-split" else (plan, None)

    def spy(*args, config=None, **kw):
        calls.append(config)
        return real(*args, config=config, **kw)

    monkeypatch.setattr(ns, "dense_plan", fake_plan)
    monkeypatch.setattr(ns, "dense_int8_small_m", spy)
    m = 128 if plan == "small_m-split" else 7
    lin, mod = make(256, 40, "int8_channel", "int32", True, "triton", seed=3)
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        y = mod(x)
    assert rel(y, ref_linear(mod, x)) <= TIGHT[torch.float32]
    assert calls == ([m, cfg] if plan == "small_m-split" else [m])  # one plan lookup a call
    calls.clear()
    lins = [torch.nn.Linear(a, b, bias=False) for a, b in ((256, 128), (256, 128), (128, 256))]
    mlp = linear.Int8MLP.from_float(*lins, backend="triton")
    with torch.no_grad():
        out = mlp(x)
    assert rel(out, ref_mlp(mlp, x)) <= 1e-2
    if plan == "small_m-split":
        assert calls == [m, cfg, m, cfg._replace(fused=False)]


def test_int8_linear_unfuses_tall_fused_launches_on_unaligned_rows(monkeypatch):
    """A plan's fused launch on 64-row tiles reaches the kernel unfused when the activation rows
    are not 16-byte aligned (checked_launch), fused when they are; both against float64."""
    from epmoe import linear
    from test_linear import TIGHT, make, ref_linear, rel

    ns = linear._dense_kernels()
    real, seen = ns.dense_int8_small_m, []
    tall = SmallMConfig(64, 16, 128, 4, 2, True)
    monkeypatch.setattr(ns, "dense_plan", lambda *a: ("small_m", tall))
    monkeypatch.setattr(ns, "dense_int8_small_m", lambda *a, config=None, **kw: seen.append(config.fused) or real(
        *a, config=config, **kw))  # fmt: skip
    _, mod = make(256, 40, "int8_channel", "int32", False, "triton", seed=5)
    base = torch.randn(3, 260, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        for x in (base[:, :256].contiguous(), base[:, 1:257]):  # aligned rows; a 4-byte offset
            assert rel(mod(x), ref_linear(mod, x)) <= TIGHT[torch.float32]
    assert seen == [True, False]


def test_cutlass_dense_path_wiring(monkeypatch):
    """The cutlass backend's CUTLASS call on CPU, the kernel stood in for by float64 math of what
    it is given: the quantizer's codes padded to whole 128-row blocks, the plan's walk, one
    weight; the sliced output against the independent float64 reference (bias included)."""
    from epmoe import linear
    from epmoe.experts import cutlass_backend as cb
    from test_linear import make, ref_linear, rel

    seen = []

    def fake(a, a_scale, b, b_scale, out=None, *, raster_along_n=True, max_swizzle=1, kernel="cooperative"):
        seen.append((a.shape[0], raster_along_n, max_swizzle, kernel, tuple(b.shape)))
        return ((a.double() @ b.double().t()) * a_scale.double() * b_scale.double().view(1, -1)).to(torch.bfloat16)

    monkeypatch.setattr(cb, "int8_dense_gemm", fake)
    _, mod = make(256, 48, "int8_channel", "int32", True, "triton", seed=7)
    impl = linear._CutlassImpl("epmoe")
    x = torch.randn(130, 256, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        y = linear.run_kernel(impl, mod, x, "cutlass", dc.CutlassLaunch(False, 4, "pingpong"))[:130]
        y2 = impl.tiled_gemm(mod, *linear._TorchImpl().quantize(x[:5], "int8_channel"), torch.float32)
    # Padded; the launch's kernel passed on; the default walk on the default kernel.
    assert seen == [(256, False, 4, "pingpong", (48, 256)), (128, True, 1, "cooperative", (48, 256))]
    assert y.shape == (130, 48) and y2.shape == (5, 48) and y2.dtype == torch.float32
    assert rel(y, ref_linear(mod, x)) <= 5e-3  # bf16 output
    assert rel(y2, ref_linear(mod, x[:5])) <= 5e-3


def test_int8_dense_gemm_refuses_before_loading(monkeypatch):
    """Every refusal of the CUTLASS dense op happens in Python, naming the value, before the
    extension is loaded."""
    from epmoe.experts import cutlass_backend as cb

    monkeypatch.setattr(cb, "load_extension", lambda *a, **k: pytest.fail("the extension was loaded"))
    a, sa = torch.zeros(256, 32, dtype=torch.int8), torch.ones(256, 1)
    b, sb = torch.zeros(16, 32, dtype=torch.int8), torch.ones(16, 1)
    for change, error, words in (
        (dict(a=a[:200], a_scale=sa[:200]), ValueError, "200 rows; allowed: a multiple of 128"),
        (dict(b=torch.zeros(2, 16, 32, dtype=torch.int8), b_scale=torch.ones(2, 16, 1)), ValueError, "one weight"),
        (dict(b_scale=torch.ones(8, 1)), ValueError, "b_scale has shape"),
        (dict(max_swizzle=3), ValueError, "max_swizzle=3; allowed"),
        (dict(kernel="ping"), ValueError, r"kernel='ping'; allowed: \['cooperative', 'pingpong'\]"),
        (dict(kernel="ping", a=a[:200]), ValueError, "kernel='ping'"),  # named first, before the operands
        (dict(a=a.float()), TypeError, "a must be torch.int8"),
        ({}, ValueError, "a must be a CUDA tensor"),
    ):  # fmt: skip
        with pytest.raises(error, match=words):
            cb.int8_dense_gemm(**{**dict(a=a, a_scale=sa, b=b, b_scale=sb), **change})


def test_mlp_down_projection_is_planned_for_its_real_rows(monkeypatch):
    """The MLP's down projection takes codes padded to whole 128-row blocks by a CUTLASS gate/up;
    its plan is looked up for the call's rows, not the padded count (a table entry at a few rows
    must not be skipped for the 128-row bucket). The CUTLASS kernel is stood in for by float64
    math of what it is given; the output against the independent float64 reference."""
    from epmoe import linear
    from epmoe.experts import cutlass_backend as cb
    from test_linear import ref_mlp, rel

    def fake(a, a_scale, b, b_scale, out=None, *, raster_along_n=True, max_swizzle=1, kernel="cooperative"):
        return ((a.double() @ b.double().t()) * a_scale.double() * b_scale.double().view(1, -1)).to(torch.bfloat16)

    planned = []

    def fake_plan(scheme, accumulator, n, k, m, device, kernels):
        planned.append((n, k, m))
        return "cutlass", dc.CutlassLaunch()

    monkeypatch.setattr(cb, "int8_dense_gemm", fake)
    monkeypatch.setattr(linear._dense_kernels(), "dense_plan", fake_plan)
    torch.manual_seed(9)
    lins = [torch.nn.Linear(a, b, bias=False) for a, b in ((256, 128), (256, 128), (128, 256))]
    mlp = linear.Int8MLP.from_float(*lins, backend="triton")
    mlp.gate_up_proj._impl = mlp.down_proj._impl = linear._CutlassImpl("epmoe")
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(10))
    with torch.no_grad():
        out = mlp(x)
    assert planned == [(256, 256, 5), (256, 128, 5)]
    assert out.shape == (5, 256) and rel(out, ref_mlp(mlp, x)) <= 2e-2


def test_run_kernel_refuses_a_kernel_its_backend_does_not_run():
    from epmoe import linear
    from test_linear import make

    _, mod = make(256, 40, "int8_channel", "int32", False, "triton", seed=11)
    x = torch.randn(3, 256)
    with pytest.raises(ValueError, match=r"kernel='cutlass' is not one the 'triton' backend runs; allowed: \['small_m', 'triton', 'tiled'\]"):
        linear.run_kernel(linear._TritonImpl(), mod, x, "cutlass", dc.CutlassLaunch())
    with pytest.raises(ValueError, match=r"kernel='small_m' is not one the 'torch' backend runs; allowed: \['tiled'\]"):
        linear.run_kernel(linear._TorchImpl(), mod, x, "small_m", CFG)


def test_table_booleans_must_be_booleans():
    """A JSON string "false" is refused rather than read as true by bool()."""
    with pytest.raises(ValueError, match="cutlass launch raster_along_n='false'; allowed: true, false, 0 or 1"):
        dc.CutlassLaunch.from_dict({"raster_along_n": "false"})
    with pytest.raises(ValueError, match="small-batch config fused='no'; allowed: true, false, 0 or 1"):
        SmallMConfig.from_dict({**CFG.to_dict(), "fused": "no"})
    assert dc.CutlassLaunch.from_dict({"raster_along_n": False}).raster_along_n is False
    # A table's triton entry (a grouped-GEMM tile config) is checked the same way.
    with pytest.raises(ValueError, match="TMA='false'; allowed: true, false, 0 or 1"):
        dc.GemmConfig.from_dict({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "TMA": "false"})


def test_cutlass_launch_kernel():
    """A table's cutlass entry names its kernel; entries written before there was a choice (no
    ``kernel`` key) are the cooperative kernel's; any other name is refused, naming it and the
    allowed ones, in the table's own refusal that says where."""
    assert dc.CutlassLaunch.from_dict({"raster_along_n": True, "max_swizzle": 2}) == dc.CutlassLaunch(True, 2, "cooperative")
    pingpong = dc.CutlassLaunch(False, 8, "pingpong")
    assert dc.CutlassLaunch.from_dict(pingpong.to_dict()) == pingpong
    with pytest.raises(ValueError, match=r"cutlass launch kernel='coop'; allowed: \['cooperative', 'pingpong'\]"):
        dc.CutlassLaunch.from_dict({"kernel": "coop"})
    bad = {"configs": {"int8_channel_int32": {"N=576,K=7168": {"1024": [{"kernel": "cutlass", "config": {"kernel": 1}}]}}}}
    with pytest.raises(ValueError, match=r"N=576,K=7168 bucket 1024: ValueError: cutlass launch kernel=1; allowed"):
        dc.parse_table(bad)
    table = {"int8_channel_int32": {"N=576,K=7168": {"1024": [{"kernel": "cutlass", "config": pingpong.to_dict()}]}}}
    assert dc.parse_table({"configs": table})["int8_channel_int32"]["N=576,K=7168"][1] == ((("cutlass", pingpong),),)
