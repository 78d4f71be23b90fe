"""The accuracy study's plumbing on a CPU (benchmarks/train_tiny_moe.py, eval_ppl.py, tiny_lm.py):
a miniature of the model trains a few steps, is saved in BF16 and FP8, converted with
``epmoe convert`` and scored per scheme, with EP = 2 over gloo against EP = 1. Checks that things
run, are finite, that training lowers the loss and the held-out perplexity, and that EP = 2 gives
bitwise the logits of EP = 1 with each rank's partial sum rounded as EP = 2 does; not the values."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from benchmarks import eval_ppl, tiny_lm, train_tiny_moe  # noqa: E402

VARIANTS = "hf,bf16,fp8_block,int8_channel_int32,int8_block_dense"
EP_VARIANTS = "fp8_block,int8_block_dense"


# ------------------------------------------------------------------------------ data rules
def test_split_depends_on_the_name_only():
    names = [f"stdlib:mod{i}.py" for i in range(2000)]
    held = [n for n in names if tiny_lm.is_heldout(n, 0.05)]
    assert held == [n for n in names if tiny_lm.is_heldout(n, 0.05)]
    assert 50 < len(held) < 150  # about 5 %
    assert set(held) <= {n for n in names if tiny_lm.is_heldout(n, 0.5)}  # a larger fraction keeps them


def test_train_batches_are_seeded_windows():
    tokens = np.arange(100, dtype=np.uint16)
    a = [b for _, b in zip(range(3), tiny_lm.train_batches(tokens, 10, 4, seed=1))]
    b = [b for _, b in zip(range(3), tiny_lm.train_batches(tokens, 10, 4, seed=1))]
    c = [b for _, b in zip(range(3), tiny_lm.train_batches(tokens, 10, 4, seed=2))]
    assert all(np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    assert not all(np.array_equal(x[1], y[1]) for x, y in zip(a, c))
    for _, batch in a:
        assert batch.shape == (4, 10) and (batch[:, 0] % 10 == 0).all()  # whole, aligned windows
        assert (np.diff(batch, axis=1) == 1).all()
    assert [e for e, _ in a] == [0, 0, 1]  # 10 windows: two batches of 4 per epoch


def test_unigram_perplexity_by_hand():
    train = np.array([0, 0, 1], dtype=np.uint16)
    windows = np.array([[5, 0, 1]])
    counts = np.ones(tiny_lm.SYMBOLS)
    counts[0] += 2
    counts[1] += 1
    p = counts / counts.sum()
    want = math.exp(-(math.log(p[0]) + math.log(p[1])) / 2)
    assert tiny_lm.unigram_perplexity(train, windows) == pytest.approx(want, rel=1e-12)
    with pytest.raises(ValueError, match="max_tokens=5"):
        tiny_lm.eval_windows(np.arange(100, dtype=np.uint16), 10, 5)


def test_correction_bias_moves_toward_balance():
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM(tiny_lm.model_config("tiny"))
    load = train_tiny_moe.RouterLoad(model)
    load.counts[0].copy_(torch.tensor([10.0, 0, 2, 4, 4, 4, 4, 4]))  # mean 4
    load.update_bias(0.25)
    bias = load.routers[0].e_score_correction_bias
    assert bias.tolist() == [-0.25, 0.25, 0.25, 0, 0, 0, 0, 0]
    assert float(load.counts[0].abs().sum()) == 0.0


# ---------------------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("tinylm")
    result = train_tiny_moe.main([
        "--ckpt", str(root / "ckpt"), "--json", str(root / "train.json"), "--size", "tiny", "--device", "cpu",
        "--seq-len", "32", "--batch", "4", "--max-steps", "6", "--warmup-steps", "1", "--lr", "3e-3",
        "--eval-tokens", "512", "--eval-batch", "16", "--log-every", "3",
    ])  # fmt: skip
    return root, result


def test_training_lowers_loss_and_heldout_perplexity(trained):
    root, result = trained
    losses = [c["loss"] for c in result["curve"]]
    assert [c["step"] for c in result["curve"]] == list(range(6)) and all(map(math.isfinite, losses))
    assert np.mean(losses[-2:]) < losses[0]
    h = result["heldout"]
    assert math.isfinite(h["perplexity"]) and h["perplexity"] < h["initial_perplexity"]
    assert math.isfinite(h["unigram_perplexity"]) and h["targets"] == 16 * 31
    assert json.loads((root / "train.json").read_text())["steps"] == 6
    assert len(result["router_balance"]) == 2 and result["experts_implementation"] in ("grouped_mm", "eager")


def test_saved_split_and_checkpoints(trained):
    root, _ = trained
    ckpt = root / "ckpt"
    held, data = tiny_lm.read_data(ckpt)
    assert all(tiny_lm.is_heldout(n, data["heldout_fraction"]) for n in data["heldout_names"])
    docs = dict(tiny_lm.corpus())  # this Python's: the tokens saved are these documents' bytes
    assert np.array_equal(held, tiny_lm.encode([(n, docs[n]) for n in data["heldout_names"]]))
    assert data["heldout_tokens"] == held.size and data["python"] and data["train_documents"] > 100
    np.save(root / "other.npy", held[1:])  # a different held-out file is refused, naming both hashes
    (root / "other.npy").replace(ckpt / tiny_lm.HELDOUT_TOKENS)
    with pytest.raises(ValueError, match="records"):
        tiny_lm.read_data(ckpt)
    np.save(ckpt / tiny_lm.HELDOUT_TOKENS, held)

    fp8 = ckpt / tiny_lm.FP8_DIR
    config = json.loads((fp8 / "config.json").read_text())
    assert config["quantization_config"] == tiny_lm.FP8_QUANT_CONFIG
    index = json.loads((fp8 / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.experts.3.down_proj.weight"
    with safe_open(fp8 / index[name], "pt") as f:
        q, s = f.get_tensor(name), f.get_tensor(name + "_scale_inv")
    with safe_open(ckpt / tiny_lm.BF16_DIR / "model.safetensors", "pt") as f:
        w = f.get_tensor(name).double()
    assert q.dtype == torch.float8_e4m3fn and tuple(s.shape) == (1, 1) and index[name] == index[name + "_scale_inv"]
    # e4m3 keeps 3 mantissa bits: each weight within 2^-4 of its magnitude (or of the block's
    # smallest normal step), computed here in float64.
    deq = q.double() * s.double()
    assert float(((deq - w).abs() - w.abs() / 16).max()) <= float(s) * 2.0**-6
    assert "model.layers.1.mlp.gate.weight" in index and not any(k.startswith("lm_head.weight_") for k in index)


def test_eval_every_variant_and_ep2_identical(trained, tmp_path):
    root, _ = trained
    out = eval_ppl.main([
        "--ckpt", str(root / "ckpt"), "--work", str(tmp_path / "work"), "--json", str(tmp_path / "eval.json"),
        "--variants", VARIANTS, "--device", "cpu", "--max-tokens", "256", "--batch", "8",
        "--ep-sequences", "1", "--ep-seq-len", "16", "--ep-variants", EP_VARIANTS,
    ])  # fmt: skip
    rows = {r["variant"]: r for r in out["rows"]}
    assert list(rows) == VARIANTS.split(",")
    for r in rows.values():
        assert "error" not in r and math.isfinite(r["perplexity"]) and 0.0 <= r["top1_agreement"] <= 1.0
    assert rows["hf"]["delta_pct"] == 0.0 and rows["hf"]["top1_agreement"] == 1.0
    assert rows["bf16"]["backends"]["experts"] == ["torch"] and rows["bf16"]["backends"]["dispatch"] == ["local"]
    dense = rows["int8_block_dense"]["backends"]
    assert dense["dense_int8"] == ["torch"] and dense["int8_linears"] > 0
    assert rows["int8_channel_int32"]["backends"]["int8_linears"] == 0
    assert set(out["convert_seconds"]) == {"int8_channel", "int8_block-dense"}
    ep = out["ep"]
    assert [r["variant"] for r in ep["rows"]] == EP_VARIANTS.split(",")
    # The miniature routes as the full model (4 groups, top-2 groups, each rank owning 2 groups), so
    # some tokens' experts sit on both ranks: there EP = 2 rounds each rank's partial sum to BF16
    # before adding them, and the check must match EP = 1 with that rounding, bit for bit.
    assert all(0 < r["tokens_split_over_ranks"] < r["moe_tokens"] for r in ep["rows"])
    assert ep["all_split_rounding_identical"]
    assert ep["all_identical"] == all(r["logits_identical"] for r in ep["rows"])
    assert all(r["ep2_backends"]["dispatch"] == ["all_to_all"] for r in ep["rows"])
    assert all(r["ep1_backends"]["dispatch"] == ["local"] for r in ep["rows"])
    assert [o["layer"] for o in out["expert_input_outliers"]] == [1, 2]
    assert all(o["max_over_median"] >= 1.0 for o in out["expert_input_outliers"])
    table = eval_ppl.render_table(json.loads((tmp_path / "eval.json").read_text()))
    assert all(f"| {v} |" in table for v in VARIANTS.split(","))


# ------------------------------------------------------------------------------ the eval CLI
@pytest.mark.parametrize("argv,needle", [
    (["--variants", "hf,int4"], "--variants: unknown ['int4']"),
    (["--backend", "fp8_block"], "--backend 'fp8_block'"),
    (["--backend", "int8_block_dense=triton"], "--backend 'int8_block_dense=triton'"),
    (["--backend", "fp8_block=magic"], "--backend 'fp8_block=magic'"),
    (["--ep-variants", "int8_block"], "--ep-variants: ['int8_block'] are not among"),
    (["--max-tokens", "0"], "--max-tokens=0"),
])  # fmt: skip
def test_eval_arguments_are_checked(argv, needle, capsys):
    with pytest.raises(SystemExit):
        eval_ppl.main(["--ckpt", "unused", "--variants", "hf,bf16"] + argv)  # a later --variants wins
    assert needle in capsys.readouterr().err


def test_table_names_the_backend_and_a_failed_row():
    row = dict(variant="fp8_block", scheme="fp8_block", accumulator=None, dense_int8=False, weights="fp8",
               implementation="epmoe", requested_backend="cutlass", error="BackendUnavailableError: no headers")
    ref = dict(variant="hf", scheme="bf16", accumulator=None, dense_int8=False, weights="bf16",
               implementation="transformers grouped_mm", backends={"experts": []}, perplexity=3.5,
               delta_pct=0.0, top1_agreement=1.0)
    dense = dict(variant="int8_block_dense", scheme="int8_block", accumulator=None, dense_int8=True,
                 weights="int8_block-dense", implementation="epmoe", backends={"experts": ["triton"],
                 "dense_int8": ["triton"]}, perplexity=3.52, delta_pct=0.5714, top1_agreement=0.9912)
    table = eval_ppl.render_table(dict(reference="hf", rows=[ref, row, dense], device="cuda", gpu="H200"))
    assert "| hf | bf16 | - | BF16 | bf16 | transformers grouped_mm | 3.5000 | +0.000 | 100.00 % |" in table
    assert "| fp8_block | fp8_block | - | BF16 | fp8 | cutlass | error: BackendUnavailableError: no headers" in table
    assert "| int8_block_dense | int8_block | - | INT8 (Int8Linear, triton) | int8_block-dense | triton | 3.5200 | +0.571 | 99.12 % |" in table
