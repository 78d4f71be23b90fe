"""``epmoe fidelity`` (epmoe.bench.fidelity): error of every scheme against float64."""

from __future__ import annotations

import json

import pytest
import torch

from epmoe.bench import fidelity as fid
from epmoe.checkpoint.synthetic import write_synthetic_checkpoint
from epmoe.quant.schemes import SCHEMES

pytest.importorskip("epmoe.layer")

SMALL = ["--experts", "8", "--hidden", "256", "--intermediate", "128", "--tokens", "64", "--top-k", "2"]


@pytest.fixture(scope="module")
def small_result(tmp_path_factory):
    d = tmp_path_factory.mktemp("fid")
    assert fid.main([*SMALL, "--json", str(d / "r.json"), "--markdown", str(d / "t.md")]) == 0
    return json.loads((d / "r.json").read_text()), (d / "t.md").read_text()


def rows_by_key(result):
    return {(r["scheme"], r["accumulator"], r["weights"] != "direct"): r for r in result["rows"]}


def test_synthetic_table(small_result, capsys):
    result, table = small_result
    rows = rows_by_key(result)
    assert len(rows) == len(fid.VARIANTS) == 7
    for (scheme, acc, via), r in rows.items():
        assert r["accumulator_in_layer"]  # the layer has an accumulator option
        for kind in fid.ACTIVATIONS:
            for metric in ("rel_fro", "rel_mean_abs", "worst_token"):
                assert 0 < r[kind][metric] < 1, (scheme, acc, via, kind, metric)
        if not via:
            # Gaussian activations are what the scheme bounds are stated for.
            assert r["gaussian"]["rel_fro"] <= SCHEMES[scheme].rel_error_bound, (scheme, acc)
    w = {k: r["weight_rel_err"] for k, r in rows.items()}
    assert w["bf16", "fp32", False] < 0.003  # bf16 keeps 8 bits: ~2^-9 rms relative
    assert w["bf16", "fp32", False] < w["int8_channel", "fp32", False] < w["fp8_block", "fp32", False]
    # Converted weights carry FP8's error plus INT8's; the conversion alone adds about INT8's.
    for key, r in rows.items():
        assert (r["conversion_rel_err"] is None) == (not key[2])
    conv = rows["int8_channel", "fp32", True]["conversion_rel_err"]
    assert 0.5 * w["int8_channel", "fp32", False] < conv < 2 * w["int8_channel", "fp32", False]
    assert w["int8_channel", "fp32", True] > w["fp8_block", "fp32", False]
    assert w["int8_block", "fp32", True] > w["fp8_block", "fp32", False]
    # The torch backend computes int32 and fp32 accumulation the same way (dequantized fp32).
    a, b = rows["int8_channel", "fp32", False], rows["int8_channel", "int32", False]
    assert a["weight_rel_err"] == b["weight_rel_err"]
    assert abs(a["gaussian"]["rel_fro"] - b["gaussian"]["rel_fro"]) < 1e-4
    # The emulated kernel matches the layer up to the layer's bf16 output rounding, and at K <= 1040
    # every fp32 partial sum is an integer below 2^24, so fp32 and int32 accumulation agree exactly.
    emu = {e["accumulator"]: e for e in result["accumulator_emulation"]}
    assert abs(emu["int32"]["gaussian"]["rel_fro"] - a["gaussian"]["rel_fro"]) < 0.005
    assert emu["fp32"]["gaussian"]["rel_diff_vs_int32"] == 0.0
    assert "| int8_block | fp32 | fp8 -> bf16 -> int8 (epmoe convert) |" in table
    assert table.count("\n| ") == 7 + 1 + 2 + 1  # rows + header, for both tables


def test_fp32_accumulation_rounds_where_int32_is_exact():
    """With K = 8192 positive products, sums pass 2^24 and fp32 accumulation starts rounding."""
    gen = torch.Generator().manual_seed(0)
    h, i = 8192, 128
    stored = {}
    for p, (n, k) in {"gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i)}.items():
        q = torch.randint(60, 128, (n, k), generator=gen, dtype=torch.int8)
        stored[0, p] = {"weight": q, "weight_scale": torch.full((n, 1), 1e-4)}
    src = fid.WeightSource(stored, "int8_channel", 1, h, i, "test")
    x = torch.rand(4, h, generator=gen) + 0.5
    ids, w = torch.zeros(4, 1, dtype=torch.int64), torch.ones(4, 1)
    o32 = fid.emulate_int8_channel(src, x, ids, w, "fp32")
    oi = fid.emulate_int8_channel(src, x, ids, w, "int32")
    rel = float((o32 - oi).norm() / oi.norm())
    assert 0 < rel < 1e-6


def test_checkpoint_mode(tmp_path):
    from epmoe.checkpoint.convert import convert_checkpoint

    src = write_synthetic_checkpoint(tmp_path / "fp8", experts=4, shards=2)
    convert_checkpoint(src, tmp_path / "int8", "int8_block", progress=False)
    common = ["--layer", "1", "--tokens", "32", "--top-k", "2", "--json"]

    assert fid.main(["--checkpoint", str(src), *common, str(tmp_path / "a.json")]) == 0
    rows = rows_by_key(json.loads((tmp_path / "a.json").read_text()))
    assert len(rows) == 7
    assert rows["fp8_block", "fp32", False]["weight_rel_err"] == 0.0  # the checkpoint's own weights
    assert rows["int8_block", "fp32", True]["weight_rel_err"] > 0

    assert fid.main(["--checkpoint", str(tmp_path / "int8"), *common, str(tmp_path / "b.json")]) == 0
    result = json.loads((tmp_path / "b.json").read_text())
    rows = rows_by_key(result)
    assert len(rows) == 5  # no FP8 conversion path from an INT8 checkpoint
    assert rows["int8_block", "fp32", False]["weight_rel_err"] == 0.0
    assert "int8_block weights" in result["source"] and result["experts"] == 4
    for r in rows.values():
        assert r["gaussian"]["rel_fro"] <= r["bound"]

    assert fid.main(["--checkpoint", str(src), "--layer", "1", "--experts", "2", "--tokens", "8",
                     "--top-k", "1"]) == 0  # fmt: skip


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--checkpoint", "x"], "--checkpoint needs --layer"),
        (["--layer", "3"], "--layer applies only with --checkpoint"),
        (["--hidden", "100"], "--hidden 100 must be a positive multiple of 128"),
        (["--experts", "0"], "--experts 0 must be >= 1"),
    ],
)
def test_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        fid.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_checkpoint_and_top_k(tmp_path, capsys):
    src = write_synthetic_checkpoint(tmp_path / "fp8", experts=4, shards=1)
    assert fid.main(["--checkpoint", str(src), "--layer", "0"]) == 2
    assert "has no routed experts for --layer 0" in capsys.readouterr().err
    assert fid.main(["--checkpoint", str(src), "--layer", "1", "--experts", "6"]) == 2
    assert "need ids 0..5" in capsys.readouterr().err
    assert fid.main([*SMALL[:6], "--top-k", "9", "--tokens", "4"]) == 2
    assert "--top-k 9 must be in [1, 8]" in capsys.readouterr().err


def test_activation_distributions():
    gen = torch.Generator().manual_seed(3)
    x = fid.synthetic_activations(4096, 512, "outliers", gen)
    rms = x.pow(2).mean(0).sqrt()
    ratio = rms / rms.median()
    assert int((ratio > 8).sum()) == 2  # a few channels (max(2, H/1024)) at 10x-100x
    assert float(ratio.max()) < 150
    tok = x.norm(dim=1)
    assert float(tok.max() / tok.median()) > 3  # heavy-tailed tokens
    g = fid.synthetic_activations(4096, 512, "gaussian", torch.Generator().manual_seed(3))
    assert abs(float(g.std()) - 1) < 0.01
    a = fid.synthetic_activations(8, 128, "outliers", torch.Generator().manual_seed(1))
    assert torch.equal(a, fid.synthetic_activations(8, 128, "outliers", torch.Generator().manual_seed(1)))
    with pytest.raises(ValueError, match="activation kind 'uniform'"):
        fid.synthetic_activations(8, 128, "uniform", gen)
