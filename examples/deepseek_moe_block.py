"""A DeepSeek-V3 MoE block: gate, shared experts and the routed experts as a DeepEPMoELayer.

The shared experts run in INT8 (an ``epmoe.Int8MLP``: gate/up fused, SiLU*up fused into the
requantization) when ``quant_dense=`` asks for it or when the checkpoint's shared-expert weights
are INT8 (``epmoe convert --dense`` output); otherwise in the block's float dtype.

Runs as a single process on the CPU or one GPU:  python examples/deepseek_moe_block.py
Under torchrun the same block runs with expert parallelism (see ep_torchrun.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from epmoe import DeepEPMoELayer, Int8MLP
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
                 dtype=torch.bfloat16, deepep_buffer=None, quant_dense=None):  # fmt: skip
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
        inter = cfg.moe_intermediate_size * cfg.n_shared_experts
        if quant_dense is None:
            self.shared_experts = SharedExperts(cfg, dtype).to(device)
        else:
            self.shared_experts = Int8MLP(cfg.hidden_size, inter, scheme=quant_dense, device=device)

    def load_shared_experts(self, named_tensors):
        """Shared-expert tensors (``...mlp.shared_experts.{gate,up,down}_proj.*``). INT8 weights
        turn a float block's shared experts into an :class:`epmoe.Int8MLP` of the checkpoint's
        scheme (``weight_scale`` per channel, ``weight_scale_inv`` per 128x128 block)."""
        tensors = dict(named_tensors)
        weights = [t for n, t in tensors.items() if n.endswith("_proj.weight")]
        if not isinstance(self.shared_experts, Int8MLP) and any(t.dtype == torch.int8 for t in weights):
            scheme = "int8_block" if any(n.endswith("weight_scale_inv") for n in tensors) else "int8_channel"
            inter = self.cfg.moe_intermediate_size * self.cfg.n_shared_experts
            self.shared_experts = Int8MLP(self.cfg.hidden_size, inter, scheme=scheme, device=weights[0].device)
        if isinstance(self.shared_experts, Int8MLP):
            return self.shared_experts.load_weights(tensors)
        for n, t in tensors.items():
            proj = n.split(".")[-2]
            getattr(self.shared_experts, proj).weight.data.copy_(t)
        return set(tensors)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.gate(hidden_states.float())
        return self.experts(hidden_states, logits) + self.shared_experts(hidden_states)


def _mlp_tensors(prefix: str, h: int, i: int, scheme, g: torch.Generator):
    """One MLP's gate/up/down tensors in ``scheme``, named ``prefix.<proj>.weight[_scale[_inv]]``."""
    for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
        w = torch.randn(1, *shape, generator=g) / shape[1] ** 0.5
        q, s = quantize_weight(w, scheme)
        yield f"{prefix}.{proj}.weight", q[0] if scheme.quantized else q[0].bfloat16()
        if s is not None:
            yield f"{prefix}.{proj}.weight_scale" + ("_inv" if scheme.weight_granularity == "block" else ""), s[0]


def random_checkpoint(cfg: MoEConfig, quant: str, seed: int = 0):
    """Routed-expert tensors named as in DeepSeek checkpoints (global expert ids), then the
    shared experts' in the same scheme (as ``epmoe convert --dense`` writes them)."""
    g = torch.Generator().manual_seed(seed)
    scheme = get_scheme(quant)
    h, i = cfg.hidden_size, cfg.moe_intermediate_size
    for e in range(cfg.n_routed_experts):
        yield from _mlp_tensors(f"model.layers.3.mlp.experts.{e}", h, i, scheme, g)
    yield from _mlp_tensors("model.layers.3.mlp.shared_experts", h, i * cfg.n_shared_experts, scheme, g)
    yield "model.layers.3.mlp.gate.e_score_correction_bias", torch.randn(cfg.n_routed_experts, generator=g) * 0.05


def main():
    cfg = MoEConfig()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    block = DeepseekV3MoE(cfg, quant="int8_channel", device=device)
    tensors = [(n, t.to(device)) for n, t in random_checkpoint(cfg, "int8_channel")]
    block.experts.load_weights((nt for nt in tensors if ".shared_experts." not in nt[0]), strict=True)
    # INT8 shared-expert weights in the checkpoint: the shared experts become an Int8MLP.
    block.load_shared_experts(nt for nt in tensors if ".shared_experts." in nt[0])
    x = torch.randn(16, cfg.hidden_size, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        y = block(x)
    print(block.experts)
    print(block.shared_experts)
    print("output", tuple(y.shape), y.dtype, "finite:", bool(torch.isfinite(y).all()))


if __name__ == "__main__":
    main()
