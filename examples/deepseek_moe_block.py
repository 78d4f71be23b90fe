"""A DeepSeek-V3 MoE block: gate, shared experts and the routed experts as a DeepEPMoELayer.

Runs as a single process on the CPU or one GPU:  python examples/deepseek_moe_block.py
Under torchrun the same block runs with expert parallelism (see ep_torchrun.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epmoe import DeepEPMoELayer
from epmoe.quant import get_scheme, quantize_weight


@dataclass
class MoEConfig:
    """DeepSeek-V3 defaults are 7168 / 2048 / 256 experts / 8 groups / top-8; scaled down here."""

    hidden_size: int = 512
    moe_intermediate_size: int = 256
    n_routed_experts: int = 32
    n_shared_experts: int = 1
    num_experts_per_tok: int = 8
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5


class SharedExperts(nn.Module):
    def __init__(self, cfg: MoEConfig, dtype):
        super().__init__()
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        self.gate_proj = nn.Linear(cfg.hidden_size, inter, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(cfg.hidden_size, inter, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(inter, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV3MoE(nn.Module):
    def __init__(self, cfg: MoEConfig, quant: str = "int8_channel", group=None, device=None,
                 dtype=torch.bfloat16, deepep_buffer=None):  # fmt: skip
        super().__init__()
        self.cfg = cfg
        # The router runs in fp32 on every rank (it is tiny and its ties matter).
        self.gate = nn.Linear(cfg.hidden_size, cfg.n_routed_experts, bias=False, device=device)
        self.experts = DeepEPMoELayer(
            cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.hidden_size,
            cfg.moe_intermediate_size, quant=quant, group=group, device=device,
            params_dtype=dtype, scoring_func="sigmoid", num_expert_group=cfg.n_group,
            topk_group=cfg.topk_group, routed_scaling_factor=cfg.routed_scaling_factor,
            use_correction_bias=True, deepep_buffer=deepep_buffer,
        )  # fmt: skip
        self.shared_experts = SharedExperts(cfg, dtype).to(device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.gate(hidden_states.float())
        return self.experts(hidden_states, logits) + self.shared_experts(hidden_states)


def random_checkpoint(cfg: MoEConfig, quant: str, seed: int = 0):
    """Routed-expert tensors named as in DeepSeek checkpoints (global expert ids)."""
    g = torch.Generator().manual_seed(seed)
    scheme = get_scheme(quant)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            w = torch.randn(1, *shape, generator=g) / shape[1] ** 0.5
            q, s = quantize_weight(w, scheme)
            name = f"model.layers.3.mlp.experts.{e}.{proj}"
            yield f"{name}.weight", q[0] if scheme.quantized else q[0].bfloat16()
            if s is not None:
                yield f"{name}.weight_scale" + ("_inv" if scheme.weight_granularity == "block" else ""), s[0]
    yield "model.layers.3.mlp.gate.e_score_correction_bias", torch.randn(cfg.n_routed_experts, generator=g) * 0.05


def main():
    cfg = MoEConfig()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block = DeepseekV3MoE(cfg, quant="int8_channel", device=device)
    block.experts.load_weights(((n, t.to(device)) for n, t in random_checkpoint(cfg, "int8_channel")), strict=True)
    x = torch.randn(16, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y = block(x)
    print(block.experts)
    print("output", tuple(y.shape), y.dtype, "finite:", bool(torch.isfinite(y).all()))


if __name__ == "__main__":
    main()
