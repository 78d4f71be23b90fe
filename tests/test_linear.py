"""Int8Linear / Int8MLP (epmoe.linear) against independent float64 references.

The reference quantizes the activations itself in float64 (amax / 127, round half to even, clamp)
and multiplies the stored INT8 weights (data, not code under test) by their scales in float64;
nothing here calls the quantizer or GEMM under test to build an expectation. Triton cases run
under the CPU interpreter (fp16 / fp32 inputs: the interpreter truncates bf16).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from epmoe.experts.select import BackendUnavailableError  # noqa: E402
from epmoe.linear import Int8Linear, Int8MLP, dense_backend_decisions  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
CASES = [("int8_channel", "int32"), ("int8_channel", "fp32"), ("int8_block", "fp32")]
CASE_IDS = ["channel-int32", "channel-fp32", "block"]
# Output rounding of fp32 (fp16) results, and a rare activation code that lands the other side of
# a rounding boundary between the fp32 quantizer and the float64 one (seen: 1 code in 32k,
# 1.2e-4 of the norm); both far below the ~1e-2 of the quantization itself.
TIGHT = {torch.float32: 1e-3, torch.float16: 2e-3}
# Two INT8 operands, each ~0.8% rms error on Gaussian data (docs/quantization.md): ~1.2%.
LOOSE = 3e-2


def ref_quant_rows(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """float64 fake-quantized activations: per row, or per 1 x group."""
    x = x.double()
    k = x.shape[-1]
    g = k if group is None else group
    xg = x.reshape(x.shape[0], k // g, g)
    scale = xg.abs().amax(-1, keepdim=True).clamp(min=1e-10) / 127.0
    return (torch.round(xg / scale).clamp(-127, 127) * scale).reshape(x.shape)


def ref_weight(lin: Int8Linear) -> torch.Tensor:
    w = lin.weight.double().cpu()
    s = lin.weight_scale.double().cpu()
    if lin.scheme == "int8_channel":
        return w * s
    full = s.repeat_interleave(128, 0).repeat_interleave(128, 1)
    return w * full[: w.shape[0], : w.shape[1]]


def ref_linear(lin: Int8Linear, x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1]).cpu()
    out = ref_quant_rows(x2, None if lin.scheme == "int8_channel" else 128) @ ref_weight(lin).t()
    if lin.bias is not None:
        out = out + lin.bias.double().cpu()
    return out.reshape(*x.shape[:-1], -1)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def make(k, n, scheme, acc, bias, backend, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=bias)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        if bias:
            lin.bias.copy_(torch.randn(n, generator=g) * 0.1)
    return lin.to(DEVICE), Int8Linear.from_float(lin.to(DEVICE), scheme=scheme, accumulator=acc, backend=backend)


def check(lin, mod, m, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, lin.in_features, generator=g).to(DEVICE, dtype)
    with torch.no_grad():
        y = mod(x)
    assert y.dtype == dtype and y.shape == (m, lin.out_features)
    assert rel(y, ref_linear(mod, x)) <= TIGHT[dtype]
    float_ref = x.double().cpu() @ lin.weight.double().cpu().t()
    if lin.bias is not None:
        float_ref = float_ref + lin.bias.double().cpu()
    assert rel(y, float_ref) <= LOOSE


@pytest.mark.parametrize("m", [1, 7, 128, 1000])
@pytest.mark.parametrize("scheme,acc", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_torch_backend(m, scheme, acc, bias):
    lin, mod = make(256, 96, scheme, acc, bias, "torch")
    assert mod.backend_name == "torch"
    check(lin, mod, m, torch.float32, seed=m)


@pytest.mark.parametrize("m", [1, 7, 128, 1000])
@pytest.mark.parametrize("scheme,acc", CASES, ids=CASE_IDS)
def test_triton_backend(m, scheme, acc):
    pytest.importorskip("triton")
    bias = m == 7  # one bias case per scheme keeps the interpreter time down
    lin, mod = make(128, 48, scheme, acc, bias, "triton")
    assert mod.backend_name == "triton"
    check(lin, mod, m, torch.float16 if m in (7, 128) else torch.float32, seed=m + 1)


def test_leading_dims_and_empty_batch():
    lin, mod = make(128, 40, "int8_channel", "int32", True, "torch")
    x = torch.randn(2, 3, 128, device=DEVICE)
    y = mod(x)
    assert y.shape == (2, 3, 40)
    assert rel(y, ref_linear(mod, x)) <= TIGHT[torch.float32]
    assert mod(torch.randn(0, 128, device=DEVICE)).shape == (0, 40)


@pytest.mark.parametrize("scheme", ["int8_channel", "int8_block"])
def test_from_float_round_trip(scheme):
    """Dequantized weights lie within half a step of the float ones; state_dict round-trips."""
    lin, mod = make(256, 200, scheme, None, True, "torch")
    assert mod.weight.dtype == torch.int8 and mod.weight_scale.dtype == torch.float32
    want = (200, 1) if scheme == "int8_channel" else (2, 2)
    assert tuple(mod.weight_scale.shape) == want
    w = lin.weight.double().cpu()
    err = (ref_weight(mod) - w).abs()
    s = mod.weight_scale.double().cpu()
    if scheme == "int8_channel":
        grid = s.expand(200, 256)
    else:
        grid = s.repeat_interleave(128, 0).repeat_interleave(128, 1)[:200, :256]
    assert bool((err <= grid / 2 + 1e-7 * w.abs() + 1e-12).all())
    assert torch.equal(mod.bias.detach().cpu(), lin.bias.detach().float().cpu())
    fresh = Int8Linear(256, 200, bias=True, scheme=scheme, backend="torch", device=DEVICE)
    fresh.load_state_dict(mod.state_dict())
    assert torch.equal(fresh.weight, mod.weight) and torch.equal(fresh.weight_scale, mod.weight_scale)


def test_dtype_casts_keep_int8_and_fp32():
    _, mod = make(128, 64, "int8_block", None, True, "torch")
    w, s = mod.weight.clone(), mod.weight_scale.clone()
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.double(),
                 lambda m: m.float(), lambda m: m.to(DEVICE, torch.float16)):  # fmt: skip
        mod = cast(mod)
        assert mod.weight.dtype == torch.int8 and mod.weight_scale.dtype == torch.float32
        assert torch.equal(mod.weight, w) and torch.equal(mod.weight_scale, s)  # no lossy round trip
    assert mod.bias.dtype == torch.float16
    assert mod(torch.randn(3, 128, device=DEVICE, dtype=torch.float16)).dtype == torch.float16


def test_meta_device_defers_backend():
    from epmoe.linear import _ALL_ROWS

    mod = Int8Linear(128, 64, scheme="int8_channel", device="meta")
    assert mod.backend_name is None
    with pytest.raises(RuntimeError, match="meta"):
        mod(torch.randn(1, 128, device="meta"))
    with pytest.raises(RuntimeError, match="meta device; move it to a real device"):
        mod.plan(1)
    mod = mod.to_empty(device="cpu")
    assert mod.backend_name == "torch" and mod.weight.dtype == torch.int8
    assert mod._all_rows.device.type == "cpu"
    # to_empty leaves buffers uninitialised; the module's constant is set again.
    assert mod._all_rows.tolist() == [_ALL_ROWS]
    assert mod.plan(1) == ("tiled", None)  # the torch backend's only path


# ------------------------------------------------------------------------------------ checkpoints
@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    pytest.importorskip("safetensors")
    from epmoe.checkpoint.synthetic import write_synthetic_checkpoint
    from epmoe import checkpoint as cv

    root = tmp_path_factory.mktemp("ckpt")
    src = write_synthetic_checkpoint(root / "fp8", num_layers=1, first_k_dense=1, experts=2, shards=1)
    out = {"fp8": src}
    for target in ("int8_channel", "int8_block"):
        cv.convert_checkpoint(src, root / target, target, dense=True, progress=False)
        out[target] = root / target
    return out


def _tensors(path, prefix):
    from safetensors import safe_open

    got = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), "pt") as st:
                got.update({k: st.get_tensor(k) for k in st.keys() if k.startswith(prefix + ".")})
    return got


@pytest.mark.parametrize("target", ["int8_channel", "int8_block"])
@pytest.mark.parametrize("proj", ["self_attn.q_a_proj", "self_attn.o_proj", "mlp.down_proj"])
def test_load_convert_dense_checkpoint(checkpoints, target, proj):
    """``convert --dense`` output loads as it is; the FP8 source loads to the same bits."""
    name = f"model.layers.0.{proj}"
    conv = _tensors(checkpoints[target], name)
    n, k = conv[name + ".weight"].shape
    mod = Int8Linear(k, n, scheme=target, backend="torch", device=DEVICE)
    loaded = mod.load_weights((nm, t.to(DEVICE)) for nm, t in conv.items())
    assert loaded == set(conv)
    scale_key = name + (".weight_scale" if target == "int8_channel" else ".weight_scale_inv")
    assert torch.equal(mod.weight.cpu(), conv[name + ".weight"])
    assert torch.equal(mod.weight_scale.cpu(), conv[scale_key])
    fp8 = _tensors(checkpoints["fp8"], name)
    direct = Int8Linear(k, n, scheme=target, backend="torch", device=DEVICE)
    direct.load_weights(fp8)
    assert torch.equal(direct.weight, mod.weight) and torch.equal(direct.weight_scale, mod.weight_scale)
    # The forward against the FP8 weights' float64 values.
    wq, ws = fp8[name + ".weight"].double(), fp8[name + ".weight_scale_inv"].double()
    w = wq * ws.repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    x = torch.randn(7, k, device=DEVICE)
    assert rel(mod(x), x.double().cpu() @ w.t()) <= LOOSE


def test_load_other_scheme_requantizes(checkpoints):
    name = "model.layers.0.self_attn.o_proj"
    conv = _tensors(checkpoints["int8_channel"], name)
    n, k = conv[name + ".weight"].shape
    mod = Int8Linear(k, n, scheme="int8_block", backend="torch", device=DEVICE)
    mod.load_weights(conv)
    w = conv[name + ".weight"].double() * conv[name + ".weight_scale"].double()
    assert tuple(mod.weight_scale.shape) == (-(-n // 128), -(-k // 128))
    # Requantized: within half a step of the new 128x128 grid of the channel-dequantized values.
    grid = mod.weight_scale.double().cpu().repeat_interleave(128, 0).repeat_interleave(128, 1)[:n, :k]
    assert bool(((ref_weight(mod) - w).abs() <= grid / 2 + 1e-6 * w.abs() + 1e-12).all())


# ------------------------------------------------------------------------------------ the MLP
def ref_mlp(mlp: Int8MLP, x: torch.Tensor) -> torch.Tensor:
    group = None if mlp.down_proj.scheme == "int8_channel" else 128
    gu = ref_linear(mlp.gate_up_proj, x).float().to(x.dtype).double()  # GEMM1's output dtype
    g, u = gu.chunk(2, dim=-1)
    h = F.silu(g) * u
    return ref_quant_rows(h, group) @ ref_weight(mlp.down_proj).t()


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scheme", ["int8_channel", "int8_block"])
@pytest.mark.parametrize("m", [1, 7, 128])
def test_mlp(backend, scheme, m):
    if backend == "triton":
        pytest.importorskip("triton")
    h, i = 128, 128
    g = torch.Generator().manual_seed(m)
    lins = [nn.Linear(a, b, bias=False).to(DEVICE) for a, b in ((h, i), (h, i), (i, h))]
    with torch.no_grad():
        for lin in lins:
            lin.weight.copy_((torch.randn(lin.weight.shape, generator=g) / lin.in_features**0.5).to(DEVICE))
    mlp = Int8MLP.from_float(*lins, scheme=scheme, backend=backend)
    assert mlp.gate_up_proj.backend_name == backend and mlp.down_proj.backend_name == backend
    x = torch.randn(m, h, generator=g).to(DEVICE)
    y = mlp(x)
    assert y.shape == (m, h) and y.dtype == torch.float32
    assert rel(y, ref_mlp(mlp, x)) <= 5e-3  # plus a rare requantization tie of the intermediate
    xf = x.double().cpu()
    wg, wu, wd = (lin.weight.double().cpu() for lin in lins)
    assert rel(y, (F.silu(xf @ wg.t()) * (xf @ wu.t())) @ wd.t()) <= 5e-2


def test_mlp_fused_gate_up_from_checkpoint(checkpoints):
    """The dense MLP of the synthetic checkpoint (I=384: blocks of 128 never straddle gate/up)."""
    prefix = "model.layers.0.mlp"
    t = _tensors(checkpoints["int8_block"], prefix)
    i, h = t[prefix + ".gate_proj.weight"].shape
    mlp = Int8MLP(h, i, scheme="int8_block", backend="torch", device=DEVICE)
    mlp.load_weights(t)
    assert torch.equal(mlp.gate_up_proj.weight.cpu()[:i], t[prefix + ".gate_proj.weight"])
    assert torch.equal(mlp.gate_up_proj.weight_scale.cpu()[: i // 128], t[prefix + ".gate_proj.weight_scale_inv"])
    assert torch.equal(mlp.down_proj.weight.cpu(), t[prefix + ".down_proj.weight"])
    assert mlp.load_weights(t) == set(t)  # the names given


def test_mlp_load_refuses_a_second_layer_and_names_the_tensor():
    h, i = 128, 256
    mlp = Int8MLP(h, i, backend="torch", device=DEVICE)
    one = {f"layers.3.mlp.{p}.weight": torch.randn(*((h, i) if p == "down_proj" else (i, h)))
           for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
    mlp.load_weights(one)
    before = [t.clone() for t in (mlp.gate_up_proj.weight, mlp.down_proj.weight)]
    two = dict(one) | {"layers.4.mlp.gate_proj.weight": torch.randn(i, h)}
    with pytest.raises(ValueError, match=r"^tensor 'layers.4.mlp.gate_proj.weight': prefix 'layers.4.mlp', where the "
                                         r"first tensor had 'layers.3.mlp'; allowed: one MLP's tensors per call$"):
        mlp.load_weights(two)
    mixed = {k.replace("layers.3", "layers.4") if "up_proj" in k else k: v for k, v in one.items()}
    with pytest.raises(ValueError, match="allowed: one MLP's tensors per call"):
        mlp.load_weights(mixed)
    with pytest.raises(ValueError, match=r"^tensor 'layers.3.mlp.gate_proj.weight' given twice"):
        mlp.load_weights(list(one.items()) + [("layers.3.mlp.gate_proj.weight", torch.randn(i, h))])
    bad = {k: v for k, v in one.items()} | {"layers.3.mlp.up_proj.weight": torch.randn(i, i)}
    bad["layers.3.mlp.down_proj.weight"] = torch.randn(h, i)  # a new down, refused with the rest
    with pytest.raises(ValueError, match=r"^tensor 'layers.3.mlp.up_proj.weight': shape \(256, 256\); allowed: \[256, 128\]"):
        mlp.load_weights(bad)
    # Nothing was copied: every tensor is checked first.
    assert all(torch.equal(a, b) for a, b in zip(before, (mlp.gate_up_proj.weight, mlp.down_proj.weight)))


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kwargs,words",
    [
        (dict(scheme="int4"), ["scheme", "int4", "int8_block"]),
        (dict(accumulator="fp16"), ["accumulator", "fp16", "int32"]),
        (dict(scheme="int8_block", accumulator="int32"), ["accumulator", "int32", "fp32"]),
        (dict(in_features=100, scheme="int8_block"), ["in_features", "100", "128"]),
        (dict(in_features=0), ["in_features", "0", "positive"]),
        (dict(backend="cuda"), ["backend", "cuda", "triton"]),
    ],
)
def test_bad_construction(kwargs, words):
    args = dict(in_features=128, out_features=64)
    args.update(kwargs)
    with pytest.raises(ValueError) as exc:
        Int8Linear(**args)
    for w in words:
        assert w in str(exc.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_device_without_cuda_is_refused():
    with pytest.raises(ValueError, match=r"^device='cuda': CUDA is not available here"):
        Int8Linear(128, 64, device="cuda")
    with pytest.raises(ValueError, match=r"^device='cuda:0': CUDA is not available here"):
        Int8MLP(128, 256, device="cuda:0")


def test_bad_forward_and_load():
    mod = Int8Linear(128, 64, backend="torch")
    with pytest.raises(ValueError, match=r"\[\.\.\., 128\]"):
        mod(torch.randn(2, 64))
    with pytest.raises(TypeError, match="int32"):
        mod(torch.ones(2, 128, dtype=torch.int32))
    with pytest.raises(ValueError, match="unknown name"):
        mod.load_weights({"q_proj.qweight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"\[64, 128\]"):
        mod.load_weights({"weight": torch.zeros(64, 64, dtype=torch.int8), "weight_scale": torch.ones(64, 1)})
    with pytest.raises(ValueError, match="weight_scale"):
        mod.load_weights({"weight": torch.zeros(64, 128, dtype=torch.int8)})
    with pytest.raises(ValueError, match=r"\[64, 1\]"):
        mod.load_weights({"weight": torch.zeros(64, 128, dtype=torch.int8), "weight_scale": torch.ones(64)})
    with pytest.raises(ValueError, match="bias=False"):
        mod.load_weights({"weight": torch.zeros(64, 128), "bias": torch.zeros(64)})
    with pytest.raises(ValueError, match="weight_scale_inv"):
        mod.load_weights({"weight": torch.zeros(64, 128).to(torch.float8_e4m3fn)})


def test_forced_backend_that_cannot_run_raises():
    with pytest.raises(BackendUnavailableError, match="SGLANG_CUTLASS_MOE"):
        Int8Linear(128, 64, backend="cutlass")
    with pytest.raises(BackendUnavailableError, match="int8_block"):
        Int8Linear(128, 64, scheme="int8_block", backend="cutlass")


def test_backend_decisions_reasons():
    cpu = torch.device("cpu")
    d = {n: (ok, r) for n, ok, r in dense_backend_decisions("int8_channel", "fp32", cpu, 128, 64, env={})}
    assert d["torch"][0] and not d["cutlass"][0] and "int32" in d["cutlass"][1]
    assert not d["triton"][0] and "TRITON_INTERPRET=1" in d["triton"][1]
    d = dict((n, (ok, r)) for n, ok, r in dense_backend_decisions(
        "int8_channel", "int32", cpu, 128, 64, env={"SGLANG_CUTLASS_MOE": "1", "TRITON_INTERPRET": "1"}))  # fmt: skip
    assert not d["cutlass"][0] and "not a CUDA GPU" in d["cutlass"][1]
    assert d["triton"][0]
    d = dict((n, (ok, r)) for n, ok, r in dense_backend_decisions("int8_channel", "int32", cpu, 128, 64, env={}))
    assert "SGLANG_CUTLASS_MOE=1 is required" in d["cutlass"][1]


def test_backend_log_names_the_kernels_its_plan_picks_among():
    from epmoe.linear import select_dense_backend

    cpu = torch.device("cpu")
    impl, lines = select_dense_backend("triton", "int8_channel", "int32", cpu, 128, 64)  # TRITON_INTERPRET=1 here
    assert impl.name == "triton" and "the dense plan picks among ['small_m', 'triton', 'tiled']" in lines[-1]
    impl, lines = select_dense_backend("torch", "int8_channel", "int32", cpu, 128, 64)
    assert impl.name == "torch" and "dense plan" not in lines[-1]


def test_info_rows_for_dense_backends():
    from epmoe.cli import capability_rows

    rows = {name: status for kind, name, status in capability_rows(torch.device("cpu")) if kind == "dense"}
    assert rows["torch int8_block fp32"] == "available"
    assert "int32" in rows["cutlass int8_channel fp32"]
    assert set(rows) == {f"{b} {s}" for b in ("cutlass", "triton", "torch")
                         for s in ("int8_channel int32", "int8_channel fp32", "int8_block fp32")}  # fmt: skip
