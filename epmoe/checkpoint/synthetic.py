"""A small DeepSeek-V3-named FP8 checkpoint with the weight distribution of trained experts, for
trying ``epmoe convert``, ``epmoe fidelity --checkpoint`` and loading without the real weights
(``epmoe make-checkpoint DIR`` on the command line)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from ..quant.reference import quantize_weight
from ..quant.schemes import BLOCK, SCHEMES
from ..tensors import check_positive_int
from .files import SafetensorsFile, write_safetensors
from .formats import CONFIG_NAME, INDEX_NAME


def synthetic_weight(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A float64 ``[n, k]`` weight shaped like a trained expert projection.

    Gaussian entries with standard deviation ``1/sqrt(k)`` times a log-normal scale per output
    channel and per input channel (sigma 0.25 each, so channel magnitudes spread over ~2x), and
    0.5% of the input channels (at least one) three times larger: outlier columns raise the amax
    of every row (per-channel scales) but only of the blocks that hold them (128x128 scales).
    """
    w = torch.randn(n, k, generator=gen, dtype=torch.float64) / math.sqrt(k)
    w *= torch.exp(0.25 * torch.randn(n, 1, generator=gen, dtype=torch.float64))
    w *= torch.exp(0.25 * torch.randn(1, k, generator=gen, dtype=torch.float64))
    cols = torch.randperm(k, generator=gen)[: max(1, k // 200)]
    w[:, cols] *= 3.0
    return w


def fp8_block_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q, s = quantize_weight(w.float().unsqueeze(0), SCHEMES["fp8_block"])
    return q[0], s[0]


def write_synthetic_checkpoint(
    path: str | Path,
    *,
    num_layers: int = 2,
    first_k_dense: int = 1,
    experts: int = 8,
    top_k: int = 2,
    hidden: int = 256,
    intermediate: int = 128,
    dense_intermediate: int = 384,
    vocab: int = 64,
    shards: int = 3,
    seed: int = 0,
) -> Path:
    """Write a small DeepSeek-V3-named FP8 checkpoint into the new or empty directory ``path``.

    Layers ``< first_k_dense`` have a dense MLP, the others ``experts`` routed experts, one shared
    expert, the router ``gate.weight`` and ``e_score_correction_bias``. Every layer has MLA
    attention projections (some with sizes that are not multiples of 128, so edge blocks occur).
    Linear weights are float8_e4m3fn with fp32 ``weight_scale_inv`` 128x128 block scales; norms,
    embeddings and the head are bf16. Tensors are spread over ``shards`` files, a weight and its
    scale always in the same file. Only one shard's tensors are in memory at a time.

    Returns:
        ``path`` as a ``Path``.

    Raises:
        ValueError: a size that is not a positive integer, ``first_k_dense`` outside
            ``[0, num_layers]``, ``top_k`` outside ``[1, experts]``, or ``path`` a file or a
            directory that is not empty.
    """
    sizes = dict(num_layers=num_layers, experts=experts, top_k=top_k, hidden=hidden,
                 intermediate=intermediate, dense_intermediate=dense_intermediate, vocab=vocab,
                 shards=shards)  # fmt: skip
    for name, value in sizes.items():
        check_positive_int(name, value)
    if not 0 <= first_k_dense <= num_layers:
        raise ValueError(f"first_k_dense={first_k_dense!r} must be in [0, num_layers={num_layers}]")
    if top_k > experts:
        raise ValueError(f"top_k={top_k} must be at most experts={experts}")
    root = Path(path)
    if root.exists() and (not root.is_dir() or any(root.iterdir())):
        raise ValueError(f"path {root} exists and is not an empty directory; choose a new or empty one")
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    q_lora, kv_lora, rope, nope, v_head, heads = 96, 128, 64, 128, 128, 2

    # (name, shape, kind) in model order; generated lazily so a shard is the unit of memory.
    specs: list[tuple[str, tuple[int, int] | tuple[int], str]] = [
        ("model.embed_tokens.weight", (vocab, hidden), "bf16")
    ]
    for layer in range(num_layers):
        p = f"model.layers.{layer}"
        specs += [
            (f"{p}.input_layernorm.weight", (hidden,), "ones"),
            (f"{p}.post_attention_layernorm.weight", (hidden,), "ones"),
            (f"{p}.self_attn.q_a_proj.weight", (q_lora, hidden), "fp8"),
            (f"{p}.self_attn.q_a_layernorm.weight", (q_lora,), "ones"),
            (f"{p}.self_attn.q_b_proj.weight", (heads * (nope + rope), q_lora), "fp8"),
            (f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + rope, hidden), "fp8"),
            (f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,), "ones"),
            (f"{p}.self_attn.kv_b_proj.weight", (heads * (nope + v_head), kv_lora), "fp8"),
            (f"{p}.self_attn.o_proj.weight", (hidden, heads * v_head), "fp8"),
        ]
        if layer < first_k_dense:
            specs += [
                (f"{p}.mlp.gate_proj.weight", (dense_intermediate, hidden), "fp8"),
                (f"{p}.mlp.up_proj.weight", (dense_intermediate, hidden), "fp8"),
                (f"{p}.mlp.down_proj.weight", (hidden, dense_intermediate), "fp8"),
            ]
            continue
        specs += [
            (f"{p}.mlp.gate.weight", (experts, hidden), "bf16"),
            (f"{p}.mlp.gate.e_score_correction_bias", (experts,), "f32"),
        ]
        for e in range(experts):
            specs += [
                (f"{p}.mlp.experts.{e}.gate_proj.weight", (intermediate, hidden), "fp8"),
                (f"{p}.mlp.experts.{e}.up_proj.weight", (intermediate, hidden), "fp8"),
                (f"{p}.mlp.experts.{e}.down_proj.weight", (hidden, intermediate), "fp8"),
            ]
        specs += [
            (f"{p}.mlp.shared_experts.gate_proj.weight", (intermediate, hidden), "fp8"),
            (f"{p}.mlp.shared_experts.up_proj.weight", (intermediate, hidden), "fp8"),
            (f"{p}.mlp.shared_experts.down_proj.weight", (hidden, intermediate), "fp8"),
        ]
    specs += [("model.norm.weight", (hidden,), "ones"), ("lm_head.weight", (vocab, hidden), "bf16")]

    def nbytes(shape, kind):
        return math.prod(shape) * (1 if kind == "fp8" else 2 if kind in ("bf16", "ones") else 4)

    total = sum(nbytes(s, k) for _, s, k in specs)
    per_shard = -(-total // shards)
    groups: list[list] = [[]]
    acc = 0
    for spec in specs:
        if acc >= per_shard * len(groups) and len(groups) < shards:
            groups.append([])
        groups[-1].append(spec)
        acc += nbytes(spec[1], spec[2])
    groups += [[] for _ in range(shards - len(groups))]

    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, 1):
        shard = f"model-{i:05d}-of-{shards:05d}.safetensors"
        tensors: dict[str, torch.Tensor] = {}
        for name, shape, kind in group:
            if kind == "fp8":
                q, s = fp8_block_weight(synthetic_weight(*shape, gen))
                tensors[name], tensors[name + "_scale_inv"] = q, s
            elif kind == "bf16":
                tensors[name] = (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
            elif kind == "ones":
                tensors[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                tensors[name] = 0.01 * torch.randn(shape, generator=gen)
        write_safetensors(root / shard, tensors)
        weight_map.update({n: shard for n in tensors})
        del tensors

    index_total = 0
    for shard in sorted(set(weight_map.values())):
        f = SafetensorsFile(root / shard)
        index_total += sum(info.nbytes for info in f.tensors.values())
    (root / INDEX_NAME).write_text(
        json.dumps({"metadata": {"total_size": index_total}, "weight_map": weight_map}, indent=2)
    )
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "hidden_size": hidden,
        "intermediate_size": dense_intermediate,
        "moe_intermediate_size": intermediate,
        "num_hidden_layers": num_layers,
        "first_k_dense_replace": first_k_dense,
        "n_routed_experts": experts,
        "n_shared_experts": 1,
        "num_experts_per_tok": top_k,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "routed_scaling_factor": 2.5,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope,
        "v_head_dim": v_head,
        "num_attention_heads": heads,
        "vocab_size": vocab,
        "torch_dtype": "bfloat16",
        "quantization_config": {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [BLOCK, BLOCK],
        },
    }
    (root / CONFIG_NAME).write_text(json.dumps(config, indent=2) + "\n")
    (root / "tokenizer_config.json").write_text('{"model_max_length": 4096}\n')
    return root
