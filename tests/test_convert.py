"""FP8-block -> INT8 checkpoint conversion (epmoe.checkpoint).

Checkpoints are small synthetic ones in DeepSeek naming, written in tmp_path. Outputs are read back
with the safetensors library, independently of the converter's own reader and writer.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import epmoe.checkpoint as cv  # noqa: E402
from epmoe.checkpoint.cli import convert_main  # noqa: E402
import epmoe.checkpoint.convert as cv_convert  # noqa: E402
from epmoe.checkpoint.convert import MANIFEST_NAME  # noqa: E402
from epmoe.checkpoint.formats import INDEX_NAME  # noqa: E402
from epmoe.checkpoint.plan import is_expert_weight  # noqa: E402
from epmoe.checkpoint.synthetic import synthetic_weight, write_synthetic_checkpoint  # noqa: E402
from epmoe.quant.reference import dequantize_weight, quantize_weight  # noqa: E402
from epmoe.quant.schemes import SCHEMES  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TARGETS = ["int8_channel", "int8_block"]
SCALE_KEY = {"int8_channel": "weight_scale", "int8_block": "weight_scale_inv"}
EXPERT = "model.layers.1.mlp.experts.3.gate_proj.weight"  # present in every small checkpoint
BF16_U = 2.0**-8  # unit roundoff of bf16 (8 significant bits)


def fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_weight(w.float().unsqueeze(0), SCHEMES["fp8_block"])
    return q[0], s[0]


def deq(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return dequantize_weight(q.unsqueeze(0), s.unsqueeze(0))[0].double()


def per_element_step(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 scale that applies to each element of ``q`` (channel or 128x128 block)."""
    return dequantize_weight(torch.ones_like(q, dtype=torch.float32).unsqueeze(0), scale.unsqueeze(0))[0].double()


def assert_round_trip(q8, scale8, w_fp8_deq: torch.Tensor, name: str = "") -> None:
    """|int8 reconstruction - FP8 value| <= step/2 + bf16 rounding.

    The converter rounds the FP8 value w to bf16 (|bf16(w) - w| <= 2^-8 |w|), then to the int8
    grid of step s = amax/127 of its channel or block (|s*round(v/s) - v| <= s/2; clamping never
    bites because |v| <= amax). The 1e-6 relative slack covers fp32 products in dequantization.
    """
    rec = deq(q8, scale8)
    step = per_element_step(q8, scale8)
    bound = step / 2 + BF16_U * w_fp8_deq.abs() + 1e-6 * w_fp8_deq.abs() + 1e-30
    excess = (rec - w_fp8_deq).abs() - bound
    assert float(excess.max()) <= 0, f"{name}: round-trip error exceeds step/2 + bf16 by {float(excess.max())}"


def tensors_of(dirpath: Path) -> dict[str, torch.Tensor]:
    index = json.loads((dirpath / INDEX_NAME).read_text())
    out = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(str(dirpath / shard), "pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out


def file_bytes(dirpath: Path) -> dict[str, bytes]:
    return {
        p.relative_to(dirpath).as_posix(): p.read_bytes()
        for p in sorted(dirpath.rglob("*"))
        if p.is_file() and p.name != MANIFEST_NAME
    }


@pytest.fixture(scope="module")
def src(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("fp8") / "src", shards=3, seed=1)


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory) -> dict[str, Path]:
    out = {}
    for t in TARGETS:
        out[t] = tmp_path_factory.mktemp(t) / "dst"
        cv.convert_checkpoint(src, out[t], t, progress=False)
    return out


def copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for p in src.iterdir():
        (dst / p.name).write_bytes(p.read_bytes())
    return dst


def edit_checkpoint(root: Path, fn) -> None:
    """Apply ``fn(tensors: dict, weight_map: dict)`` shard by shard and rewrite index + shards."""
    index = json.loads((root / INDEX_NAME).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(root / shard))
        fn(shard, tensors, index["weight_map"])
        save_file(tensors, str(root / shard), metadata={"format": "pt"})
    (root / INDEX_NAME).write_text(json.dumps(index))


# ----------------------------------------------------------------------------------- tensors


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("shape", [(256, 384), (200, 300), (1, 7), (1100, 130)])
def test_convert_tensor_round_trip(target, shape):
    gen = torch.Generator().manual_seed(shape[0] * 7 + shape[1])
    w = synthetic_weight(*shape, gen)
    w[0, 0] = 0.0
    if shape[0] > 128:
        w[128:256] = 0.0  # an all-zero channel/block gets the floor scale, not 0/0
    q8, s8 = fp8_block(w)
    out = cv.convert_tensor(q8, s8, target)
    assert set(out) == {"weight", SCALE_KEY[target]}
    assert out["weight"].dtype == torch.int8 and tuple(out["weight"].shape) == shape
    n, k = shape
    want = (n, 1) if target == "int8_channel" else (math.ceil(n / 128), math.ceil(k / 128))
    assert out[SCALE_KEY[target]].dtype == torch.float32 and tuple(out[SCALE_KEY[target]].shape) == want
    assert_round_trip(out["weight"], out[SCALE_KEY[target]], deq(q8, s8), f"{target} {shape}")
    # The grid is the bf16 amax over 127 per channel/block: every channel/block reaches +-127.
    amax_q = out["weight"].abs().amax(dim=1) if target == "int8_channel" else None
    if amax_q is not None:
        nonzero = deq(q8, s8).abs().amax(dim=1) > 0
        assert bool((amax_q[nonzero] == 127).all())
    assert torch.isfinite(out[SCALE_KEY[target]]).all()


def test_convert_tensor_rounds_through_bf16():
    """Values are taken from bf16, as DeepSeek's FP8 -> BF16 cast and the public INT8 models did."""
    q8 = torch.tensor([[1.0, 3.0] + [0.0] * 126], dtype=torch.float32).to(torch.float8_e4m3fn)
    # 1/3 is not a bf16 number; the channel amax is bf16(3 * s) and the grid follows from it.
    s8 = torch.tensor([[1.0 / 3.0]])
    out = cv.convert_tensor(q8, s8, "int8_channel")
    amax_bf16 = (torch.tensor(3.0) * s8[0, 0]).to(torch.bfloat16).float()
    assert torch.equal(out["weight_scale"], (amax_bf16 / 127).reshape(1, 1))


@pytest.mark.parametrize(
    "weight, scale, match",
    [
        (torch.zeros(4, 8, dtype=torch.bfloat16), torch.ones(1, 1), "expected torch.float8_e4m3fn"),
        (torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(2, 1), r"expected \[1, 1\]"),
        (torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.ones(1, 1, dtype=torch.float64), "float32"),
        (torch.zeros(4, 8).to(torch.float8_e4m3fn), torch.full((1, 1), float("nan")), "non-finite"),
        (torch.zeros(2, 4, 8).to(torch.float8_e4m3fn), torch.ones(1, 1), "2-D"),
    ],
)
def test_convert_tensor_rejects(weight, scale, match):
    with pytest.raises(ValueError, match=match):
        cv.convert_tensor(weight, scale, "int8_channel", name="w.weight")


def test_convert_tensor_rejects_nan_weight_and_bad_target():
    q = torch.zeros(4, 8).to(torch.float8_e4m3fn)
    q[2, 5] = float("nan")
    with pytest.raises(ValueError, match=r"w.weight: non-finite weight at \[2, 5\]"):
        cv.convert_tensor(q, torch.ones(1, 1), "int8_block", name="w.weight")
    with pytest.raises(ValueError, match=r"target='int4'.*allowed"):
        cv.convert_tensor(q, torch.ones(1, 1), "int4")


# -------------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("target", TARGETS)
def test_checkpoint_round_trip(src, converted, target):
    dst = converted[target]
    before, after = tensors_of(src), tensors_of(dst)
    suffix = SCALE_KEY[target]
    n_experts = 0
    for name, t in before.items():
        if name.endswith("_scale_inv") and name[: -len("_scale_inv")] in before:
            continue
        is_expert = is_expert_weight(name)
        if is_expert:
            n_experts += 1
            q, s = after[name], after[name[: -len("weight")] + suffix]
            assert q.dtype == torch.int8 and q.shape == t.shape
            assert_round_trip(q, s, deq(t, before[name + "_scale_inv"]), name)
            if target == "int8_channel":
                assert name + "_scale_inv" not in after
        else:  # dense FP8 weights (no --dense), norms, embeddings, router: unchanged bits
            assert after[name].dtype == t.dtype
            assert torch.equal(after[name].view(torch.uint8), t.view(torch.uint8)), name
    assert n_experts == 8 * 3 + 3
    # Nothing is lost or invented: converted weights trade their scale_inv for the target's scale.
    conv = {n for n in before if is_expert_weight(n)}
    expected = {n for n in before if not (n.endswith("_scale_inv") and n[: -len("_scale_inv")] in conv)}
    expected |= {n[: -len("weight")] + suffix for n in conv}
    assert set(after) == expected

    index = json.loads((dst / INDEX_NAME).read_text())
    assert set(index["weight_map"]) == set(after)
    sizes = sum(t.numel() * t.element_size() for t in after.values())
    assert index["metadata"]["total_size"] == sizes
    config = json.loads((dst / "config.json").read_text())
    qc = config["quantization_config"]
    if target == "int8_channel":
        assert qc["quant_method"] == "w8a8_int8" and qc["activation_scheme"] == "dynamic"
    else:
        assert qc["quant_method"] == "blockwise_int8" and qc["weight_block_size"] == [128, 128]
    assert qc["epmoe_conversion"]["source_quantization_config"]["quant_method"] == "fp8"
    assert config["n_routed_experts"] == 8
    assert (dst / "tokenizer_config.json").read_text() == (src / "tokenizer_config.json").read_text()
    assert cv.checkpoint_scheme(dst) == target
    assert json.loads((dst / MANIFEST_NAME).read_text())["complete"] is True
    assert not list(dst.rglob("*.tmp"))


def test_dense_converts_every_fp8_weight(src, tmp_path):
    cv.convert_checkpoint(src, tmp_path / "dst", "int8_channel", dense=True, progress=False)
    before, after = tensors_of(src), tensors_of(tmp_path / "dst")
    assert not [n for n, t in after.items() if t.dtype == torch.float8_e4m3fn]
    assert not [n for n in after if n.endswith("_scale_inv")]
    for name in ("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.down_proj.weight"):
        assert after[name].dtype == torch.int8
        assert_round_trip(after[name], after[name[:-6] + "weight_scale"], deq(before[name], before[name + "_scale_inv"]), name)
    cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert "dense" in cfg["quantization_config"]["epmoe_conversion"]["converted"]
    assert cfg["quantization_config"]["epmoe_conversion"]["fp8_block_weights_kept"] == 0


def test_scale_in_another_shard(src, converted, tmp_path):
    """A weight whose scale_inv lives in another shard converts the same; the scale moves with it."""
    root = copy_checkpoint(src, tmp_path / "src")
    index = json.loads((root / INDEX_NAME).read_text())
    scale = EXPERT + "_scale_inv"
    home = index["weight_map"][scale]
    other = next(s for s in sorted(set(index["weight_map"].values())) if s != home)
    moved = {}

    def fn(shard, tensors, wm):
        if shard == home:
            moved[scale] = tensors.pop(scale)
            wm[scale] = other

    edit_checkpoint(root, fn)
    edit_checkpoint(root, lambda shard, tensors, wm: tensors.update(moved) if shard == other else None)
    cv.convert_checkpoint(root, tmp_path / "dst", "int8_block", progress=False)
    a, b = tensors_of(tmp_path / "dst"), tensors_of(converted["int8_block"])
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), k
    wm = json.loads((tmp_path / "dst" / INDEX_NAME).read_text())["weight_map"]
    assert wm[scale] == wm[EXPERT] == home


# ------------------------------------------------------------------------------------- layer


def reference_moe(w: dict, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Float64 sum_j w_j * down(silu(gate x) * up x) from per-expert float64 weights."""
    x = x.double()
    out = torch.zeros_like(x)
    for e in range(ids.max().item() + 1):
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if tok.numel():
            h = F.silu(x[tok] @ w[e, "gate_proj"].t()) * (x[tok] @ w[e, "up_proj"].t())
            out.index_add_(0, tok, (h @ w[e, "down_proj"].t()) * weights[tok, slot].double().unsqueeze(1))
    return out


def build_layer(path: Path, layer: int):
    from epmoe.layer import DeepEPMoELayer

    kwargs = cv.layer_kwargs_from_config(path)
    m = DeepEPMoELayer(backend="torch", dispatch="local", device="cpu", **kwargs)
    loaded = m.load_weights(cv.iter_expert_weights(path, layer, correction_bias=True))
    return m, loaded


@pytest.mark.parametrize("target", TARGETS)
def test_converted_checkpoint_loads_into_layer(src, converted, target):
    pytest.importorskip("epmoe.layer")
    dst = converted[target]
    kw = cv.layer_kwargs_from_config(dst)
    assert kw == {**cv.layer_kwargs_from_config(src), "quant": target}
    assert kw["num_experts"] == 8 and kw["use_correction_bias"] and kw["scoring_func"] == "sigmoid"
    fp8_layer, _ = build_layer(src, 1)
    int8_layer, loaded = build_layer(dst, 1)
    assert len(loaded) == 8 * 3 * 2 + 1  # weight + scale per projection, and the bias
    assert int8_layer.scheme.name == target and fp8_layer.scheme.name == "fp8_block"

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(96, kw["hidden_size"], generator=gen).to(torch.bfloat16)
    logits = torch.randn(96, kw["num_experts"], generator=gen)
    ids, weights = fp8_layer.route(logits)
    assert torch.equal(ids, int8_layer.route(logits)[0])  # same bias loaded into both
    with torch.inference_mode():
        out_fp8 = fp8_layer(x, logits).double()
        out_int8 = int8_layer(x, logits).double()

    # Reference: float64 on the FP8 checkpoint's own (dequantized) weights, read independently.
    t = tensors_of(src)
    w = {}
    for e in range(8):
        for p in ("gate_proj", "up_proj", "down_proj"):
            n = f"model.layers.1.mlp.experts.{e}.{p}.weight"
            w[e, p] = deq(t[n], t[n + "_scale_inv"])
    ref = reference_moe(w, x, ids, weights)
    err_int8 = float((out_int8 - ref).norm() / ref.norm())
    err_fp8 = float((out_fp8 - ref).norm() / ref.norm())
    b_int8, b_fp8 = SCHEMES[target].rel_error_bound, SCHEMES["fp8_block"].rel_error_bound
    assert err_int8 <= b_int8, f"{target} layer vs float64 of the FP8 weights: {err_int8:.4f} > {b_int8}"
    assert err_fp8 <= b_fp8
    # Both approximate the same float64 output, so they differ by at most the sum of the bounds.
    assert float((out_int8 - out_fp8).norm() / ref.norm()) <= b_int8 + b_fp8


def test_iter_expert_weights_subset_and_errors(src, converted, tmp_path):
    names = [n for n, _ in cv.iter_expert_weights(converted["int8_channel"], 1, experts=[2, 5])]
    assert len(names) == 2 * 3 * 2
    assert {n.split(".experts.")[1].split(".")[0] for n in names} == {"2", "5"}
    assert all(n.endswith((".weight", ".weight_scale")) for n in names)
    with pytest.raises(ValueError, match="no routed expert weights for layer 0"):
        next(cv.iter_expert_weights(src, 0))
    with pytest.raises(ValueError, match=r"expert 9: checkpoint has projections \[\]"):
        next(cv.iter_expert_weights(src, 1, experts=[9]))
    root = copy_checkpoint(src, tmp_path / "noscale")
    index = json.loads((root / INDEX_NAME).read_text())
    del index["weight_map"][EXPERT + "_scale_inv"]
    (root / INDEX_NAME).write_text(json.dumps(index))
    with pytest.raises(ValueError, match="has no 'weight_scale_inv'"):
        next(cv.iter_expert_weights(root, 1))


# ---------------------------------------------------------------------- interruption, resume


def test_interrupted_conversion_resumes_to_identical_output(src, converted, tmp_path, monkeypatch):
    dst = tmp_path / "dst"
    index = json.loads((src / INDEX_NAME).read_text())
    shards = sorted(set(index["weight_map"].values()))
    first_shard_experts = sum(
        1 for n, s in index["weight_map"].items()
        if s == shards[0] and is_expert_weight(n)
    )  # fmt: skip
    real = cv.convert_tensor
    calls = {"n": 0}

    def crashing(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > first_shard_experts + 2:  # in the middle of the second shard
            raise RuntimeError("simulated crash")
        return real(*args, **kwargs)

    monkeypatch.setattr(cv_convert, "convert_tensor", crashing)
    with pytest.raises(RuntimeError, match="simulated crash"):
        cv.convert_checkpoint(src, dst, "int8_block", progress=False)
    monkeypatch.setattr(cv_convert, "convert_tensor", real)

    manifest = json.loads((dst / MANIFEST_NAME).read_text())
    assert list(manifest["shards"]) == [shards[0]] and manifest["complete"] is False
    assert (dst / shards[0]).is_file() and not (dst / shards[1]).exists()
    assert not (dst / INDEX_NAME).exists()  # an interrupted output never looks complete
    assert not list(dst.glob("*.tmp"))  # an exception removes its temporary file

    with pytest.raises(ValueError, match="unfinished conversion.*--resume"):
        cv.convert_checkpoint(src, dst, "int8_block", progress=False)
    with pytest.raises(ValueError, match="target='int8_block', this run has target='int8_channel'"):
        cv.convert_checkpoint(src, dst, "int8_channel", resume=True, progress=False)

    # What a kill -9 would leave: a half-written temporary and a truncated file under a final
    # name that the manifest does not record. Neither may be taken for a finished shard.
    (dst / (shards[1] + ".tmp")).write_bytes(b"\0" * 1000)
    full = (converted["int8_block"] / shards[2]).read_bytes()
    (dst / shards[2]).write_bytes(full[: len(full) // 2])

    res = cv.convert_checkpoint(src, dst, "int8_block", resume=True, progress=False)
    assert res.shards_skipped == [shards[0]] and res.shards_written == shards[1:]
    assert file_bytes(dst) == file_bytes(converted["int8_block"])

    # A recorded shard damaged afterwards is detected (size) and converted again.
    (dst / shards[0]).write_bytes((dst / shards[0]).read_bytes()[:-8])
    res = cv.convert_checkpoint(src, dst, "int8_block", resume=True, progress=False)
    assert res.shards_written == [shards[0]]
    # Same size, flipped data byte: only the full hash sees it.
    data = bytearray((dst / shards[1]).read_bytes())
    data[-1] ^= 0xFF
    (dst / shards[1]).write_bytes(bytes(data))
    assert cv.convert_checkpoint(src, dst, "int8_block", resume=True, progress=False).shards_written == []
    res = cv.convert_checkpoint(src, dst, "int8_block", resume=True, progress=False, verify_hash=True)
    assert res.shards_written == [shards[1]]
    assert file_bytes(dst) == file_bytes(converted["int8_block"])


# ------------------------------------------------------------------------------- bad inputs


def _drop_scale(root):
    def fn(shard, tensors, wm):
        if EXPERT + "_scale_inv" in tensors:
            del tensors[EXPERT + "_scale_inv"]
            del wm[EXPERT + "_scale_inv"]

    edit_checkpoint(root, fn)


def _wrong_scale_shape(root):
    def fn(shard, tensors, wm):
        if EXPERT + "_scale_inv" in tensors:
            tensors[EXPERT + "_scale_inv"] = torch.ones(2, 2)

    edit_checkpoint(root, fn)


def _bf16_expert(root):
    def fn(shard, tensors, wm):
        if EXPERT in tensors:
            tensors[EXPERT] = tensors[EXPERT].to(torch.bfloat16)

    edit_checkpoint(root, fn)


def _orphan_scale(root):
    def fn(shard, tensors, wm):
        if EXPERT in tensors:
            tensors["model.layers.1.mlp.experts.3.extra.weight_scale_inv"] = torch.ones(1, 1)
            wm["model.layers.1.mlp.experts.3.extra.weight_scale_inv"] = shard

    edit_checkpoint(root, fn)


def _index_names_missing_tensor(root):
    index = json.loads((root / INDEX_NAME).read_text())
    index["weight_map"]["model.layers.1.mlp.ghost.weight"] = index["weight_map"][EXPERT]
    (root / INDEX_NAME).write_text(json.dumps(index))


def _missing_shard(root):
    index = json.loads((root / INDEX_NAME).read_text())
    (root / index["weight_map"][EXPERT]).unlink()


def _bf16_config(root):
    cfg = json.loads((root / "config.json").read_text())
    del cfg["quantization_config"]
    (root / "config.json").write_text(json.dumps(cfg))


def _block_64(root):
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (root / "config.json").write_text(json.dumps(cfg))


def _inconsistent_experts(root):
    def fn(shard, tensors, wm):
        if EXPERT in tensors:
            tensors[EXPERT] = torch.zeros(256, 256).to(torch.float8_e4m3fn)
            tensors[EXPERT + "_scale_inv"] = torch.ones(2, 2)

    edit_checkpoint(root, fn)


def _truncated_shard(root):
    index = json.loads((root / INDEX_NAME).read_text())
    p = root / index["weight_map"][EXPERT]
    p.write_bytes(p.read_bytes()[:-100])


@pytest.mark.parametrize(
    "mutate, exc, match",
    [
        (_drop_scale, ValueError, rf"FP8 weight '{EXPERT}' \[128, 256\] in .* has no '{EXPERT}_scale_inv'"),
        (_wrong_scale_shape, ValueError, r"_scale_inv' in .* is F32 \[2, 2\]; expected F32 \[1, 2\] = \[ceil\(128/128\), ceil\(256/128\)\]"),
        (_bf16_expert, ValueError, rf"expert weight '{EXPERT}' in .* has dtype BF16 shape \[128, 256\]; expected F8_E4M3"),
        (_orphan_scale, ValueError, r"'model.layers.1.mlp.experts.3.extra.weight_scale_inv' has no weight"),
        (_index_names_missing_tensor, ValueError, r"maps tensor 'model.layers.1.mlp.ghost.weight' to .*does not hold it"),
        (_missing_shard, FileNotFoundError, r"shard .*model-0000\d-of-00003.safetensors named by model.safetensors.index.json .* does not exist"),
        (_bf16_config, ValueError, r"config.json has no quantization_config"),
        (_block_64, ValueError, r"weight_block_size=\[64, 64\]; only .* can be converted"),
        (_inconsistent_experts, ValueError, rf"'{EXPERT}' has shape \[256, 256\], inconsistent with"),
        (_truncated_shard, ValueError, r"outside the .* data bytes \(truncated file\?\)"),
        (lambda root: (root / INDEX_NAME).unlink(), FileNotFoundError, r"index .*model.safetensors.index.json does not exist"),
        (lambda root: (root / "config.json").unlink(), FileNotFoundError, r"config .*config.json does not exist"),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_bad_source(src, tmp_path, mutate, exc, match):
    root = copy_checkpoint(src, tmp_path / "src")
    mutate(root)
    dst = tmp_path / "dst"
    with pytest.raises(exc, match=match):
        cv.convert_checkpoint(root, dst, "int8_channel", progress=False)
    assert not dst.exists()  # validation happens before anything is written


def test_bad_destination(src, tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("x")
    with pytest.raises(ValueError, match=r"DST .*full exists and is not empty"):
        cv.convert_checkpoint(src, tmp_path / "full", "int8_channel", progress=False)
    with pytest.raises(ValueError, match=r"has no \.epmoe-convert\.json: it is not a conversion that can be resumed"):
        cv.convert_checkpoint(src, tmp_path / "full", "int8_channel", resume=True, progress=False)
    with pytest.raises(ValueError, match=r"DST .* is inside SRC"):
        cv.convert_checkpoint(src, src / "int8", "int8_channel", progress=False)
    with pytest.raises(ValueError, match=r"target='fp4' is not a conversion target"):
        cv.convert_checkpoint(src, tmp_path / "new", "fp4", progress=False)
    with pytest.raises(FileNotFoundError, match=r"SRC .*nowhere is not a directory"):
        cv.convert_checkpoint(tmp_path / "nowhere", tmp_path / "new", "int8_channel", progress=False)
    assert not (src / "int8").exists() and not (tmp_path / "new").exists()


def test_cli_main(src, tmp_path, capsys, monkeypatch):
    # The plain progress line (tqdm is optional): make "import tqdm.auto" fail for this run.
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)
    assert convert_main(["--to", "int8_block", str(src), str(tmp_path / "out")]) == 0
    captured = capsys.readouterr()
    assert "converted 27 weights to int8_block: 3 shards written" in captured.out
    assert "[3/3]" in captured.err and "100.0%" in captured.err
    assert convert_main(["--to", "int8_block", str(src), str(tmp_path / "out")]) == 2
    assert "pass --resume" in capsys.readouterr().err
    assert convert_main(["--to", "int8_block", "--resume", "--quiet", str(src), str(tmp_path / "out")]) == 0
    assert "0 shards written, 3 kept" in capsys.readouterr().out


# -------------------------------------------------------------------------------- peak memory

_RSS_CHILD = textwrap.dedent(
    """
    import json, resource, sys
    import torch
    from epmoe.checkpoint.convert import convert_checkpoint

    def status(key):
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))

    torch.ones(8).sum()  # let torch set up its thread pool before the baseline
    try:  # "5" resets the peak-RSS mark (VmHWM) to the current RSS, hiding import-time peaks
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        base = status("VmRSS")
    except OSError:
        base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    res = convert_checkpoint(sys.argv[1], sys.argv[2], "int8_channel", progress=False)
    peak = max(status("VmHWM"), status("VmRSS"))
    print(json.dumps({"base_kb": base, "peak_kb": peak, "written": len(res.shards_written)}))
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/status (Linux)")
def test_peak_rss_stays_near_one_shard(tmp_path):
    """Six ~40 MB shards (16 MB of FP8 experts to convert + 24 MB of bf16 to copy each).

    The converter streams tensor by tensor, so its peak RSS growth must stay well under a multiple
    of one shard; a converter that loads a shard (or the model) would exceed it.
    """
    root = tmp_path / "big"
    root.mkdir()
    gen = torch.Generator().manual_seed(0)
    def fp8(n, k):
        return (torch.randint(-100, 100, (n, k), generator=gen).float() * 0.5).to(torch.float8_e4m3fn)

    shapes = {"gate_proj": (512, 1024), "up_proj": (512, 1024), "down_proj": (1024, 512)}
    pool = {p: [fp8(*shape) for _ in range(2)] for p, shape in shapes.items()}
    n_shards, weight_map, shard_bytes = 6, {}, 0
    for s in range(n_shards):
        name = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        tensors = {}
        for e in range(11):  # 33 x 512 KiB of FP8 = 16.5 MiB
            for p, (n, k) in shapes.items():
                w = f"model.layers.{s}.mlp.experts.{e}.{p}.weight"
                tensors[w] = pool[p][e % 2].clone()
                tensors[w + "_scale_inv"] = torch.full((n // 128, k // 128), 1e-3)
        tensors[f"model.layers.{s}.filler.weight"] = torch.zeros(3 * 4096, 1024, dtype=torch.bfloat16)
        save_file(tensors, str(root / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in tensors})
        shard_bytes = max(shard_bytes, (root / name).stat().st_size)
    (root / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (root / "config.json").write_text(json.dumps({"quantization_config": {
        "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}}))  # fmt: skip

    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, "-c", _RSS_CHILD, str(root), str(tmp_path / "out")],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["written"] == n_shards
    growth = (r["peak_kb"] - r["base_kb"]) * 1024
    total = sum(p.stat().st_size for p in root.glob("*.safetensors"))
    assert total > 5 * shard_bytes
    print(f"peak RSS growth {growth / 2**20:.1f} MiB; one shard {shard_bytes / 2**20:.1f} MiB")
    assert growth < 2.5 * shard_bytes, f"peak RSS grew {growth / 2**20:.1f} MiB for {shard_bytes / 2**20:.1f} MiB shards"


# -------------------------------------------------------------------------------- make-checkpoint


def test_make_checkpoint_then_convert_with_a_json_summary(tmp_path, capsys):
    from epmoe import cli

    src = tmp_path / "synthetic"
    assert cli.main(["make-checkpoint", str(src), "--experts", "4", "--shards", "2", "--seed", "3"]) == 0
    assert "try `epmoe convert --to int8_channel" in capsys.readouterr().out
    assert cv.checkpoint_scheme(src) == "fp8_block"
    assert cv.expert_ids(src, 1) == [0, 1, 2, 3]
    assert cli.main(["convert", "--to", "int8_channel", "--json", "--quiet", str(src), str(tmp_path / "out")]) == 0
    summary = json.loads(capsys.readouterr().out)
    # One MoE layer: 4 routed experts x 3 projections + 3 shared-expert projections.
    assert summary["tensors_converted"] == 15 and summary["target"] == "int8_channel"
    assert sorted(summary["shards_written"]) == sorted(set(json.loads((src / INDEX_NAME).read_text())["weight_map"].values()))
    assert summary["shards_skipped"] == [] and summary["dst"] == str(tmp_path / "out")
    assert summary["total_size"] == json.loads((tmp_path / "out" / INDEX_NAME).read_text())["metadata"]["total_size"]
    # The directory is not empty any more: refused, naming the path; bad sizes name the option.
    assert cli.main(["make-checkpoint", str(src)]) == 2
    assert f"path {src} exists and is not an empty directory" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"top_k=9 must be at most experts=8"):
        write_synthetic_checkpoint(tmp_path / "bad", top_k=9)
    with pytest.raises(ValueError, match=r"shards=0 must be a positive integer"):
        write_synthetic_checkpoint(tmp_path / "bad", shards=0)


def _rewrite_in_place(shard: Path, tensor: str) -> None:
    """Change one tensor's bytes in place: same header, same size, later modification time."""
    with safe_open(str(shard), "pt") as f:
        t = f.get_tensor(tensor)
    header_len = int.from_bytes(shard.read_bytes()[:8], "little")
    header = json.loads(shard.read_bytes()[8 : 8 + header_len])
    begin = 8 + header_len + header[tensor]["data_offsets"][0]
    flipped = (t.view(torch.uint8) ^ 1).contiguous().numpy().tobytes()
    with open(shard, "r+b") as f:
        f.seek(begin)
        f.write(flipped)
    st = shard.stat()
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))


@pytest.mark.parametrize("verify", [False, True])
def test_resume_refuses_a_source_shard_rewritten_in_place(tmp_path, verify):
    src = write_synthetic_checkpoint(tmp_path / "src", experts=2, shards=2, seed=4)
    dst = tmp_path / "out"
    cv.convert_checkpoint(src, dst, "int8_channel", progress=False, verify_hash=verify)
    weight_map = json.loads((src / INDEX_NAME).read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.1.up_proj.weight"
    shard = src / weight_map[name]
    size = shard.stat().st_size
    if verify:  # with hashes recorded, a new modification time alone is no change
        st = shard.stat()
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        assert cv.convert_checkpoint(src, dst, "int8_channel", resume=True, progress=False, verify_hash=True).shards_written == []
    _rewrite_in_place(shard, name)
    assert shard.stat().st_size == size
    why = "its SHA-256 differs" if verify else "mtime_ns"
    with pytest.raises(ValueError, match=rf"cannot resume into .*: source shard {shard.name} changed since the conversion started \({why}"):
        cv.convert_checkpoint(src, dst, "int8_channel", resume=True, progress=False, verify_hash=verify)
    assert convert_main(["--to", "int8_channel", "--resume", "--quiet", str(src), str(dst)]) == 2
