"""The transformers integration on one GPU: tiny random models in bf16 with the layer's GPU
backends (auto: Triton for bf16 / INT8; fp8_block only where DeepGEMM or the CUTLASS kernel runs)
against the model's own eager experts, and greedy generation."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bf16 model: activations and weights in bf16 on both sides; the bound is the layer's bf16 one.
BOUNDS = {"bf16": 1e-2, "int8_channel": 5e-2, "int8_block": 5e-2, "fp8_block": 1e-1}


def _model(family):
    from transformers import AutoModelForCausalLM

    from epmoe.integrations import transformers as et

    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(et.tiny_config(family), dtype=torch.bfloat16).eval()
    model.set_experts_implementation("eager")
    return model


@pytest.mark.parametrize("quant", sorted(BOUNDS))
@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "mixtral"])
@torch.no_grad()
def test_gpu_logits_match_eager(family, quant):
    from epmoe.integrations import transformers as et

    model = _model(family)
    ids = torch.randint(0, 96, (4, 33), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    ref = model(ids).logits.float()
    try:
        et.enable(model, quant)
    except (ValueError, RuntimeError) as exc:
        if quant == "fp8_block":
            pytest.skip(f"fp8_block cannot run here: {exc}")
        raise
    err = float((model(ids).logits.float() - ref).norm() / ref.norm())
    assert err <= BOUNDS[quant], f"{family} {quant}: {err:.2e}"


@torch.no_grad()
def test_gpu_greedy_generation_bf16():
    from epmoe.integrations import transformers as et

    model = _model("qwen3_moe")
    ids = torch.randint(0, 96, (2, 6), device="cuda", generator=torch.Generator("cuda").manual_seed(2))
    ref = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    et.enable(model, "bf16")
    out = model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    # bf16 top-k sums differ in rounding order from the eager loop: report the agreement, require most
    same = (out[:, 6:] == ref[:, 6:]).float().mean().item()
    assert same >= 0.5, f"only {same:.0%} of greedy tokens agree with eager"
