"""epmoe inside Hugging Face transformers MoE models (tiny random models of each family, CPU,
torch backend): enabled model vs the model's own eager experts, generation, loading, EP over gloo,
and the refusals."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from epmoe.integrations import transformers as et  # noqa: E402
from epmoe.quant import dequantize_weight, get_scheme, quantize_weight  # noqa: E402
from epmoe.checkpoint.convert import convert_checkpoint  # noqa: E402

import hf_reference  # noqa: E402
import hf_worker  # noqa: E402
from epmoe.launch import run_ranks  # noqa: E402

FAMILIES = sorted(et.TINY_FAMILIES)
# docs/quantization.md: the layer's relative-error bound per scheme; bf16 with float32
# parameters is float32 math throughout (the 1e-5).
BOUNDS = {"bf16": 1e-5, "int8_channel": 5e-2, "int8_channel_int32": 5e-2, "int8_block": 5e-2, "fp8_block": 1e-1}


def _model(family: str, seed: int = 0):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(et.tiny_config(family)).eval()
    model.set_experts_implementation("eager")
    return model


def _rel(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


_ids = hf_worker.ids


@pytest.mark.parametrize("scheme", sorted(BOUNDS))
@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_logits_match_eager(family, scheme):
    model, ids = _model(family), _ids()
    ref = model(ids).logits
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    quant, kwargs = scheme, {}
    if scheme == "int8_channel_int32":
        quant, kwargs = "int8_channel", {"accumulator": "int32"}
    et.enable(model, quant, backend="torch", **kwargs)
    layers = [m for m in model.modules() if isinstance(m, et.DeepEPMoELayer)]
    assert layers and all(layer.scheme.name == quant for layer in layers)
    assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n, _ in model.named_parameters())
    after = sum(p.numel() * p.element_size() for p in model.parameters())
    assert after == held if quant == "bf16" else after < held  # the module's copies are gone
    err = _rel(model(ids).logits, ref)
    assert err <= BOUNDS[scheme], f"{family} {scheme}: relative error {err:.2e} > {BOUNDS[scheme]}"
    if scheme != "bf16":
        assert err > 1e-6  # the quantized weights are really used


@pytest.mark.parametrize("scheme", ["bf16", "int8_channel"])
def test_bf16_model_against_float64_with_routing_pinned(scheme):
    """A bf16 model (the GPU test's setting; here the torch backend): each experts call within the
    bound of a float64 reference on identical inputs, and no further from it than transformers'
    eager experts; whole-model logits with routing pinned to the float64 model's (hf_reference)."""
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(et.tiny_config("mixtral"), dtype=torch.bfloat16).eval()
    model.set_experts_implementation("eager")
    ids = torch.randint(0, hf_worker.VOCAB, (4, 33), generator=torch.Generator().manual_seed(2))
    bound = 4 * hf_reference.BF16_UNIT_ROUNDOFF if scheme == "bf16" else BOUNDS[scheme]
    errors = hf_reference.check_against_float64(model, ids, scheme, bound, lambda m: et.enable(m, scheme, backend="torch"))
    assert min(errors["experts"]) > 0  # the layer ran, and in bf16


@pytest.mark.parametrize("family", FAMILIES)
@torch.no_grad()
def test_greedy_generation_matches_eager(family):
    model, ids = _model(family), _ids(seq=5)
    ref = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    et.enable(model, "bf16", backend="torch")
    out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    assert out.shape == (2, 5 + 16)
    assert torch.equal(out, ref)


@torch.no_grad()
def test_experts_implementation_epmoe_from_pretrained(tmp_path):
    model, ids = _model("qwen2_moe"), _ids()
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, experts_implementation="epmoe").eval()
    assert loaded.config._experts_implementation == "epmoe"
    out = loaded(ids).logits  # converts each experts module at its first call
    assert any(isinstance(m, et.DeepEPMoELayer) for m in loaded.modules())
    assert _rel(out, ref) <= 1e-5


@pytest.mark.parametrize("family,shard", [("mixtral", None), ("deepseek_v3", "150KB"), ("qwen3_moe", None)])
@torch.no_grad()
def test_loader_reads_a_save_pretrained_directory(tmp_path, family, shard):
    model, ids = _model(family), _ids()
    ref = model(ids).logits
    model.save_pretrained(tmp_path, **({"max_shard_size": shard} if shard else {}))
    loaded = et.from_pretrained(tmp_path, backend="torch", device="cpu")
    assert _rel(loaded(ids).logits, ref) <= 1e-5
    report = loaded.epmoe_load_report
    assert report.bytes_read == report.checkpoint_bytes and report.local_experts == report.num_experts


@torch.no_grad()
def test_loader_skips_what_transformers_ignores_and_names_a_tensor_with_no_place(tmp_path):
    from safetensors.torch import load_file, save_file

    model, ids = _model("deepseek_v3"), _ids()
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    # DeepSeek-V3's checkpoints carry the multi-token-prediction layer after the last one
    # (transformers' _keys_to_ignore_on_load_unexpected: model.layers.61.*).
    sd["model.layers.61.shared_head.norm.weight"] = torch.ones(8)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded = et.from_pretrained(tmp_path, backend="torch", device="cpu")
    assert _rel(loaded(ids).logits, ref) <= 1e-5
    sd["model.layers.9.self_attn.extra.weight"] = torch.ones(8)
    save_file(sd, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"^checkpoint tensor 'model.layers.9.self_attn.extra.weight' has no place in "
                                         r"DeepseekV3ForCausalLM; allowed: the names of its state_dict"):
        et.from_pretrained(tmp_path, backend="torch", device="cpu")


@torch.no_grad()
def test_loader_reads_a_layer_that_an_ignore_pattern_names_when_the_model_has_it(tmp_path):
    # GLM-4.5's patterns name layer 46: the MTP layer of the 46-layer Air, a real layer of the
    # 92-layer model. transformers skips a matching tensor only when the model has no place for it.
    config = et.tiny_config("glm4_moe")
    config.num_hidden_layers = 48
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.set_experts_implementation("eager")
    assert any("46" in p for p in model._keys_to_ignore_on_load_unexpected)
    ids = _ids()
    ref = model(ids).logits
    model.save_pretrained(tmp_path)
    loaded = et.from_pretrained(tmp_path, backend="torch", device="cpu")
    assert _rel(loaded(ids).logits, ref) <= 1e-5


def _fp8_checkpoint(model, path):
    """Save ``model`` DeepSeek-style: every projection weight float8_e4m3fn with 128x128
    ``weight_scale_inv`` (embeddings, norms, router and head stay float); sets the model's own
    weights to the dequantized values, so it is the reference."""
    from safetensors.torch import load_file, save_file

    model.save_pretrained(path)

    sd = load_file(path / "model.safetensors")
    scheme = get_scheme("fp8_block")
    out = {}
    for name, t in sd.items():
        if name.endswith("proj.weight") and t.dim() == 2:
            q, s = quantize_weight(t.unsqueeze(0), scheme)
            out[name], out[name + "_scale_inv"] = q[0], s[0]
            sd[name] = dequantize_weight(q, s)[0]
        else:
            out[name] = t
    (path / "model.safetensors").unlink()
    half = sorted(out)[: len(out) // 2]
    save_file({k: out[k] for k in half}, path / "a.safetensors", metadata={"format": "pt"})
    save_file({k: out[k] for k in out if k not in half}, path / "b.safetensors", metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {k: "a.safetensors" if k in half else "b.safetensors" for k in out}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}
    (path / "config.json").write_text(json.dumps(cfg))
    return sd


@torch.no_grad()
def test_loader_reads_fp8_block_and_epmoe_convert_outputs(tmp_path):
    model, ids = _model("deepseek_v3"), _ids()
    src = tmp_path / "fp8"
    src.mkdir()
    deq = _fp8_checkpoint(model, src)
    # The reference: the same model with the dequantized FP8 weights, through its eager experts.
    ref_dir = tmp_path / "ref"
    from safetensors.torch import save_file

    model.save_pretrained(ref_dir)
    save_file(deq, ref_dir / "model.safetensors", metadata={"format": "pt"})
    reference = AutoModelForCausalLM.from_pretrained(ref_dir, experts_implementation="eager").eval()
    ref = reference(ids).logits

    fp8 = et.from_pretrained(src, backend="torch", device="cpu")
    assert {m.scheme.name for m in fp8.modules() if isinstance(m, et.DeepEPMoELayer)} == {"fp8_block"}
    assert _rel(fp8(ids).logits, ref) <= BOUNDS["fp8_block"]
    bf16 = et.from_pretrained(src, quant="bf16", backend="torch", device="cpu")
    assert _rel(bf16(ids).logits, ref) <= 1e-5  # FP8 experts dequantized exactly, as the reference

    dst = tmp_path / "int8"
    convert_checkpoint(src, dst, "int8_block")
    int8 = et.from_pretrained(dst, backend="torch", device="cpu")
    assert {m.scheme.name for m in int8.modules() if isinstance(m, et.DeepEPMoELayer)} == {"int8_block"}
    assert _rel(int8(ids).logits, ref) <= BOUNDS["int8_block"]
    with pytest.raises(ValueError, match="stores int8_block experts; quant='bf16'"):
        et.from_pretrained(dst, quant="bf16", backend="torch", device="cpu")


@pytest.mark.parametrize("family", ["deepseek_v3"])
def test_ep2_over_gloo_matches_ep1(tmp_path, family):
    model = _model(family)
    model.save_pretrained(tmp_path / "ckpt", max_shard_size="150KB")
    run_ranks(hf_worker.ep_rank, 2, str(tmp_path / "ckpt"), str(tmp_path / "out"))
    ep1 = et.from_pretrained(tmp_path / "ckpt", backend="torch", device="cpu")
    for rank in range(2):
        got = torch.load(f"{tmp_path / 'out'}.{rank}")
        ids = _ids(seed=10 + rank, batch=1 + rank, seq=6 + rank)
        with torch.no_grad():
            assert _rel(got["logits"], ep1(ids).logits) <= 1e-6
            assert torch.equal(got["gen"], ep1.generate(ids, max_new_tokens=4, min_new_tokens=4, do_sample=False))
        report = got["report"]
        assert report["local_experts"] * 2 == report["num_experts"]
        assert report["bytes_read"] < report["checkpoint_bytes"]  # the other rank's experts are never read


# ---------------------------------------------------------------------------------- refusals
def test_second_enable_and_bad_quant_are_refused():
    model = _model("mixtral")
    with pytest.raises(ValueError, match="quant='int4'"):
        et.enable(model, "int4")
    et.enable(model, backend="torch")
    with pytest.raises(ValueError, match="already enabled"):
        et.enable(model, backend="torch")


@pytest.mark.parametrize("kw", [dict(routed_scaling_factor=2.5), dict(renormalize=False), dict(num_expert_group=2),
                                dict(use_correction_bias=True)])
def test_routing_arguments_are_refused(kw):
    # The model's router gives the layer its experts and weights: a routing argument would be
    # silently ignored.
    (name, value), = kw.items()
    with pytest.raises(ValueError, match=rf"^{name}={value!r}: the model's own router picks and weighs the experts"):
        et.enable(_model("qwen3_moe"), backend="torch", **kw)


def test_model_without_moe_is_refused():
    cfg = AutoConfig.for_model("llama", vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(ValueError, match="'llama'.*has no MoE experts module"):
        et.enable(AutoModelForCausalLM.from_config(cfg))


def test_gpt_oss_is_refused_naming_what_is_missing():
    cfg = AutoConfig.for_model("gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                               num_attention_heads=2, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                               num_experts_per_tok=2, layer_types=["full_attention"])  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(ValueError, match=r"'gpt_oss'.*expert biases.*interleaved.*_apply_gate") as exc:
        et.enable(model)
    assert "no MoE" not in str(exc.value)
    assert "gate_up_proj" in dict(model.model.layers[0].mlp.experts.named_parameters())  # untouched


def test_llama4_is_refused():
    cfg = AutoConfig.for_model("llama4_text", vocab_size=64, hidden_size=32, intermediate_size=32,
                               intermediate_size_mlp=64, num_hidden_layers=1, num_attention_heads=2,
                               num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1)  # fmt: skip
    with pytest.raises(ValueError, match="'llama4_text'.*ExpertsInterface"):
        et.enable(AutoModelForCausalLM.from_config(cfg))


def test_non_silu_activation_is_refused():
    cfg = et.tiny_config("qwen3_moe")
    cfg.hidden_act = "gelu"
    with pytest.raises(ValueError, match="'qwen3_moe'.*activation 'gelu'"):
        et.enable(AutoModelForCausalLM.from_config(cfg))


def test_hf_generate_example_runs_and_matches_eager(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "hf_generate.py"
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "tiny"), "--make-tiny", "mixtral", "--backend", "torch",
         "--new-tokens", "8", "--check"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    assert "eager experts generate the same tokens: True" in r.stdout


# ------------------------------------------------------------------------- host synchronisation
class _HostReads:
    """Counts what would make the host wait for a GPU, issued by code other than Triton's
    interpreter, while ``active``: scalar reads (``item``, ``int``, ``bool``), ``tolist``, and the
    ops whose output size depends on values (``nonzero``, boolean-mask indexing, ``unique``,
    ``bincount``, ``masked_select``, ``repeat_interleave`` without ``output_size``). On CPU they
    cost nothing, so they are found by name, not by time."""

    SIZED_BY_VALUES = ("aten.nonzero.default", "aten.masked_select.default", "aten.bincount.default",
                       "aten._unique2.default", "aten.unique_consecutive.default", "aten.unique_dim.default")  # fmt: skip

    def __init__(self):
        self.active, self.found = False, []

    def _from_interpreter(self) -> bool:
        import traceback

        return any("/triton/" in f.filename for f in traceback.extract_stack()[:-3])

    def note(self, what: str) -> None:
        if self.active and not self._from_interpreter():
            import traceback

            where = next((f for f in reversed(traceback.extract_stack()[:-2]) if "/epmoe/" in f.filename or "transformers" in f.filename), None)
            self.found.append(f"{what} at {where.filename.rsplit('/', 2)[-1]}:{where.lineno}" if where else what)

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        reads = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = str(func)
                if name == "aten._local_scalar_dense.default" or name in reads.SIZED_BY_VALUES:
                    reads.note(name)
                elif name == "aten.index.Tensor" and any(
                    isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1]
                ):
                    reads.note("boolean-mask index")
                elif name.startswith("aten.repeat_interleave") and kwargs.get("output_size") is None:
                    reads.note(name)
                return func(*args, **kwargs)

        return Mode()


@pytest.mark.skipif(not torch.cuda.is_available() and __import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs the Triton interpreter on CPU")  # fmt: skip
def test_enabled_experts_forward_reads_nothing_back(monkeypatch):
    """After ``enable`` (default ``validate``) an experts forward with the Triton backend and local
    dispatch issues no host read: an eager decode step is not serialised per layer, and the step can
    be captured in a CUDA graph. On CPU the layer would take its torch scatter and gather (the
    reference path, which reads counts back); they are pointed at the Triton kernels the GPU runs,
    under the interpreter. validate=True reads its checks back once per forward: counted too."""
    import epmoe.layer as layer_module
    from epmoe import ops
    from epmoe.layouts import _to_contiguous_kernels

    def scatter(x, x_scale, ids, e, alignment, padded_rows, *, expected_m=None, scale_mn_major=False):
        return _to_contiguous_kernels(x, x_scale, ids, e, alignment, padded_rows, expected_m, scale_mn_major)

    monkeypatch.setattr(layer_module, "to_contiguous", scatter)
    monkeypatch.setattr(layer_module, "gather_weighted", lambda out, pos, w, dtype: ops.gather_weighted(out, pos, w.float(), dtype))
    counts = {}
    for validate in (None, True):
        model, ids = _model("qwen3_moe"), _ids(batch=3, seq=1)  # a decode-sized step
        reads = _HostReads()
        experts = [m for _, m in et.experts_modules(model)]
        et.enable(model, "int8_channel", backend="triton", **({} if validate is None else {"validate": validate}))
        for m in experts:
            m.register_forward_pre_hook(lambda *a: setattr(reads, "active", True))
            m.register_forward_hook(lambda *a: setattr(reads, "active", False))
        original_tolist = torch.Tensor.tolist
        monkeypatch.setattr(torch.Tensor, "tolist", lambda t: reads.note("tolist") or original_tolist(t))
        with torch.no_grad(), reads.mode():
            model(ids)
        monkeypatch.setattr(torch.Tensor, "tolist", original_tolist)
        counts[validate] = reads.found
    assert counts[None] == [], counts[None]
    # The counter sees the value checks' read-back, one per experts call.
    assert len(counts[True]) == len(experts) and all("inputs.py" in f for f in counts[True]), counts[True]
