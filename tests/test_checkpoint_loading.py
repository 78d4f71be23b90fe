"""Loading one MoE layer from checkpoints written by transformers' save_pretrained (DeepSeek-V3,
Qwen3-MoE, Mixtral naming), strict loads, and routing read from a transformers 5 config.json."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from epmoe.checkpoint import iter_expert_weights, layer_kwargs_from_config  # noqa: E402
from epmoe.layer import DeepEPMoELayer  # noqa: E402

COMMON = dict(vocab_size=32, hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2)
FAMILIES = {
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", "model.layers.1.mlp.", dict(
        moe_intermediate_size=32, intermediate_size=96, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "model.layers.1.mlp.", dict(
        moe_intermediate_size=32, intermediate_size=96, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "model.layers.1.block_sparse_moe.", dict(
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2)),
}  # fmt: skip


def save_tiny(family: str, path):
    cfg_name, model_name, _, kw = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, cfg_name)(**COMMON, **kw)).eval()
    block = model.model.layers[1].mlp
    if family == "deepseek_v3":  # a bias that changes routing, so loading it is tested
        with torch.no_grad():
            block.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.5)
    model.save_pretrained(path)
    return block


def checkpoint_items(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def block_experts_output(family, block, x):
    """The transformers block's routed-experts output (shared experts taken out)."""
    with torch.no_grad():
        out = block(x[None])
        out = out[0] if isinstance(out, tuple) else out
        out = out[0]
        if family == "deepseek_v3":
            out = out - block.shared_experts(x)
    return out


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_loads_from_save_pretrained_with_prefix(family, tmp_path):
    block = save_tiny(family, tmp_path)
    on_disk = json.loads((tmp_path / "config.json").read_text())
    assert "scoring_func" not in on_disk and "topk_method" not in on_disk  # what transformers 5 writes
    kwargs = layer_kwargs_from_config(tmp_path)
    if family == "deepseek_v3":
        assert kwargs["scoring_func"] == "sigmoid" and kwargs["use_correction_bias"]
    layer = DeepEPMoELayer(**kwargs, backend="torch", dispatch="local", device="cpu", params_dtype=torch.float32)
    prefix = FAMILIES[family][2]
    # The README's way: the whole checkpoint, one layer picked by its prefix (router gate, shared
    # experts, attention and other layers ignored), strict: every expert tensor must be there.
    loaded = layer.load_weights(checkpoint_items(tmp_path), prefix=prefix)
    expected = set(layer.expected_weight_names(prefix))
    assert loaded == expected if family != "mixtral" else len(loaded) == len(expected)  # w1|w3|w2 names
    x = torch.randn(13, COMMON["hidden_size"])
    with torch.no_grad():
        logits = torch.nn.functional.linear(x, block.gate.weight)
        out = layer(x, logits)
    torch.testing.assert_close(out, block_experts_output(family, block, x), rtol=1e-4, atol=1e-5)
    # The transformers 5 in-memory layout (fused gate_up_proj [E, 2I, H], down_proj [E, H, I]).
    fused = DeepEPMoELayer(**kwargs, backend="torch", dispatch="local", device="cpu", params_dtype=torch.float32)
    state = [(f"{prefix}{k}", v) for k, v in block.state_dict().items()]
    if family == "mixtral":  # transformers 5 calls the module mlp in memory
        state = [(k.replace("block_sparse_moe", "mlp"), v) for k, v in state]
        prefix = "model.layers.1.mlp."
    fused.load_weights(state, prefix=prefix)
    with torch.no_grad():
        torch.testing.assert_close(fused(x, logits), out, rtol=1e-5, atol=1e-6)
    # iter_expert_weights reads the single model.safetensors (no index).
    again = DeepEPMoELayer(**kwargs, backend="torch", dispatch="local", device="cpu", params_dtype=torch.float32)
    again.load_weights(iter_expert_weights(tmp_path, 1, correction_bias=kwargs["use_correction_bias"]))
    with torch.no_grad():
        torch.testing.assert_close(again(x, logits), out, rtol=0, atol=0)


def test_strict_load_names_the_missing_expert_tensors(tmp_path):
    E, H, I = 8, 64, 32
    layer = DeepEPMoELayer(E, 2, H, I, quant="int8_channel", device="cpu", backend="torch", use_correction_bias=True,
                           scoring_func="sigmoid")  # fmt: skip
    names = layer.expected_weight_names("model.layers.3.mlp.")
    assert len(names) == E * 3 * 2 + 1 and names[-1] == "model.layers.3.mlp.gate.e_score_correction_bias"
    assert names[:2] == ["model.layers.3.mlp.experts.0.gate_proj.weight", "model.layers.3.mlp.experts.0.gate_proj.weight_scale"]
    tensors = {}
    for n in names:
        if n.endswith("bias"):
            tensors[n] = torch.zeros(E)
        elif n.endswith("weight"):
            shape = (H, I) if ".down_proj." in n else (I, H)
            tensors[n] = torch.randint(-127, 128, shape, dtype=torch.int8)
        else:
            tensors[n] = torch.rand((H if ".down_proj." in n else I), 1) * 1e-2
    missing = [n for n in names if ".experts.5." in n]  # a whole expert left out
    with pytest.raises(ValueError, match=r"6 tensor\(s\) of rank 0's experts are missing: "
                       r"'model.layers.3.mlp.experts.5.gate_proj.weight', .* and 1 more"):  # fmt: skip
        layer.load_weights([(n, t) for n, t in tensors.items() if n not in missing])
    assert layer.w13_weight_scale.isnan().all()  # nothing copied
    # int8 weights missing, scales present: plausible wrong values unless refused.
    only_scales = [(n, t) for n, t in tensors.items() if not n.endswith(".weight")]
    with pytest.raises(ValueError, match=r"24 tensor\(s\) .* missing: 'experts.0.gate_proj.weight'"):
        layer.load_weights([(n.replace("model.layers.3.mlp.", ""), t) for n, t in only_scales])
    assert layer.load_weights(tensors.items(), prefix="model.layers.3.mlp.") == set(names)
    assert layer.load_weights([(n, t) for n, t in tensors.items() if n not in missing], strict=False)


def test_config_whose_routing_cannot_be_determined_is_refused(tmp_path):
    config = {"model_type": "my_moe", "n_routed_experts": 8, "num_experts_per_tok": 2, "hidden_size": 64,
              "moe_intermediate_size": 32}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"routing cannot be determined: no \['scoring_func', 'topk_method'\] "
                       r"and model_type='my_moe'"):  # fmt: skip
        layer_kwargs_from_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "scoring_func": "softmax", "topk_method": "greedy"}))
    kw = layer_kwargs_from_config(tmp_path)
    assert kw["scoring_func"] == "softmax" and not kw["use_correction_bias"]
